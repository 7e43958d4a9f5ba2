"""Compressors: one small file per family, plus a name registry (``register`` / ``create`` / ``list``)."""

from lightning_gradcomp.compressors import registry
from lightning_gradcomp.compressors.base import Compressor, ReduceContext, Reduction
from lightning_gradcomp.compressors.cast import Cast
from lightning_gradcomp.compressors.none import NoCompression
from lightning_gradcomp.compressors.randomk import RandomK
from lightning_gradcomp.compressors.registry import create, register
from lightning_gradcomp.compressors.topk import TopK

__all__ = [
    "Cast",
    "Compressor",
    "NoCompression",
    "RandomK",
    "ReduceContext",
    "Reduction",
    "TopK",
    "create",
    "register",
    "registry",
]
