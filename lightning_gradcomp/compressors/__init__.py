"""Compressors: one small file per family, plus a name registry (``register`` / ``create`` / ``names``)."""

from lightning_gradcomp.compressors import registry
from lightning_gradcomp.compressors.base import Capabilities, Compressor, ReduceContext, Reduction
from lightning_gradcomp.compressors.cast import Cast
from lightning_gradcomp.compressors.cltk import CLTK
from lightning_gradcomp.compressors.diana import DIANA, BlockQuantizer
from lightning_gradcomp.compressors.none import NoCompression
from lightning_gradcomp.compressors.powersgd import PowerSGD
from lightning_gradcomp.compressors.qsgd import QSGD
from lightning_gradcomp.compressors.quantized import QuantizedCompressor
from lightning_gradcomp.compressors.randomk import RandomK
from lightning_gradcomp.compressors.registry import create, register
from lightning_gradcomp.compressors.signsgd import SignSGD
from lightning_gradcomp.compressors.terngrad import TernGrad
from lightning_gradcomp.compressors.topk import TopK

__all__ = [
    "BlockQuantizer",
    "CLTK",
    "Capabilities",
    "Cast",
    "Compressor",
    "DIANA",
    "NoCompression",
    "PowerSGD",
    "QSGD",
    "QuantizedCompressor",
    "RandomK",
    "ReduceContext",
    "Reduction",
    "SignSGD",
    "TernGrad",
    "TopK",
    "create",
    "register",
    "registry",
]
