"""lightning_gradcomp: communication-efficient data-parallel training for PyTorch Lightning.

Importing the package declares its strategy presets (``gradcomp_topk``, ``scalecom``, ``diloco``...), each
registered with Lightning's ``StrategyRegistry`` as it is declared; see :mod:`lightning_gradcomp.presets`. The
presets of ``GradCompStrategy`` go into Fabric's ``STRATEGY_REGISTRY`` too (:mod:`lightning_gradcomp.fabric_strategy`).
"""

# gradcomp_presets declares GradCompStrategy's presets, before the other strategies' (the order of `list`)
from lightning_gradcomp import callbacks, compressors, gradcomp_presets  # noqa: F401 - public subpackages
from lightning_gradcomp.comm import CommStats
from lightning_gradcomp.fabric_strategy import GradCompFabricStrategy
from lightning_gradcomp.fsdp_strategy import GradCompFSDPStrategy
from lightning_gradcomp.localsgd import LocalSGDFSDPStrategy, LocalSGDStrategy
from lightning_gradcomp.rate_corrected_adamw import RateCorrectedAdamW
from lightning_gradcomp.strategy import GradCompStrategy
from lightning_gradcomp.swarm import SwarmStrategy

__version__ = "0.1.0"

__all__ = [
    "CommStats",
    "GradCompFSDPStrategy",
    "GradCompFabricStrategy",
    "GradCompStrategy",
    "LocalSGDFSDPStrategy",
    "LocalSGDStrategy",
    "RateCorrectedAdamW",
    "SwarmStrategy",
    "__version__",
]
