"""Compressors: one small file per family, plus a name registry (``register`` / ``create`` / ``names``).

Base classes that do the exchange, so that a new compressor states only its math: :class:`QuantizedCompressor`
(encode, all-gather, decode and sum in rank order; or the all-to-all protocol) and :class:`SharedIndexCompressor`
(the same entries kept on every rank, their values summed by one all-reduce).
"""

from lightning_gradcomp.compressors import registry
from lightning_gradcomp.compressors.base import Capabilities, Compressor, ReduceContext, Reduction
from lightning_gradcomp.compressors.cast import Cast
from lightning_gradcomp.compressors.cltk import CLTK
from lightning_gradcomp.compressors.diana import DIANA, BlockQuantizer
from lightning_gradcomp.compressors.none import NoCompression
from lightning_gradcomp.compressors.powersgd import PowerSGD
from lightning_gradcomp.compressors.qsgd import QSGD
from lightning_gradcomp.compressors.quantized import QuantizedCompressor, SlotCodec
from lightning_gradcomp.compressors.randomk import RandomK
from lightning_gradcomp.compressors.registry import create, register
from lightning_gradcomp.compressors.signsgd import SignSGD
from lightning_gradcomp.compressors.sparse import SharedIndexCompressor, SparseCompressor
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
    "SharedIndexCompressor",
    "SignSGD",
    "SlotCodec",
    "SparseCompressor",
    "TernGrad",
    "TopK",
    "create",
    "register",
    "registry",
]
