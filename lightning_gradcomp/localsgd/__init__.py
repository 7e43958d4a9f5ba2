"""Local SGD / DiLoCo: local steps with an outer optimizer on compressed pseudo-gradients (on DDP-style replicas,
``LocalSGDStrategy``, or on FSDP2-sharded replicas, ``LocalSGDFSDPStrategy``)."""

from lightning_gradcomp.localsgd.engine import OUTERS, OuterSync, split_fragments
from lightning_gradcomp.localsgd.fsdp import LocalSGDFSDPStrategy
from lightning_gradcomp.localsgd.strategy import CHECKPOINT_KEY, LocalSGDStrategy

__all__ = ["CHECKPOINT_KEY", "OUTERS", "LocalSGDFSDPStrategy", "LocalSGDStrategy", "OuterSync", "split_fragments"]
