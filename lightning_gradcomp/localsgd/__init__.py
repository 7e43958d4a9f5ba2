"""Local SGD / DiLoCo: local steps with an outer optimizer on compressed pseudo-gradients."""

from lightning_gradcomp.localsgd.engine import OUTERS, OuterSync, split_fragments
from lightning_gradcomp.localsgd.strategy import CHECKPOINT_KEY, LocalSGDStrategy

__all__ = ["CHECKPOINT_KEY", "OUTERS", "LocalSGDStrategy", "OuterSync", "split_fragments"]
