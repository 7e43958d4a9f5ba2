"""lightning_gradcomp: communication-efficient data-parallel training for PyTorch Lightning.

Importing the package declares its strategy presets (``gradcomp_topk``, ``scalecom``, ``diloco``...), each
registered with Lightning's ``StrategyRegistry`` as it is declared; see :mod:`lightning_gradcomp.presets`. The
presets of ``GradCompStrategy`` go into Fabric's ``STRATEGY_REGISTRY`` too (:mod:`lightning_gradcomp.fabric_strategy`).
"""

from lightning_gradcomp import callbacks, compressors  # noqa: F401 - public subpackages
from lightning_gradcomp.comm import CommStats
from lightning_gradcomp.fabric_strategy import GradCompFabricStrategy
from lightning_gradcomp.localsgd import LocalSGDStrategy
from lightning_gradcomp.strategy import GradCompStrategy
from lightning_gradcomp.swarm import SwarmStrategy

__version__ = "0.1.0"

__all__ = [
    "CommStats",
    "GradCompFabricStrategy",
    "GradCompStrategy",
    "LocalSGDStrategy",
    "SwarmStrategy",
    "__version__",
]
