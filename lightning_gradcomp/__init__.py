"""lightning_gradcomp: communication-efficient data-parallel training for PyTorch Lightning.

Importing the package registers the ``gradcomp_*`` strategy names with Lightning's registry.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gradcomp import callbacks, compressors  # noqa: F401 - import order: presets are declared there
from lightning_gradcomp.comm import CommStats
from lightning_gradcomp.strategy import GradCompStrategy

__version__ = "0.1.0"

GradCompStrategy.register_strategies(StrategyRegistry)

__all__ = ["CommStats", "GradCompStrategy", "__version__"]
