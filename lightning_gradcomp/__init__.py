"""lightning_gradcomp: communication-efficient data-parallel training for PyTorch Lightning.

Importing the package registers the ``gradcomp_*`` strategy names with Lightning's registry.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gradcomp import callbacks, compressors  # noqa: F401 - import order: presets are declared there
from lightning_gradcomp.comm import CommStats
from lightning_gradcomp.localsgd import LocalSGDStrategy
from lightning_gradcomp.strategy import GradCompStrategy
from lightning_gradcomp.swarm import SwarmStrategy

__version__ = "0.1.0"

GradCompStrategy.register_strategies(StrategyRegistry)
SwarmStrategy.register_strategies(StrategyRegistry)
LocalSGDStrategy.register_strategies(StrategyRegistry)

__all__ = ["CommStats", "GradCompStrategy", "LocalSGDStrategy", "SwarmStrategy", "__version__"]
