"""The built-in strategy names of :class:`~lightning_gradcomp.GradCompStrategy` (``gradcomp_topk``, ``scalecom``...).

Declared here, on the Lightning floor, so that the compressors import nothing from Lightning: a compressor module
defines its class; this module gives configurations of it a ``Trainer(strategy=...)`` name
(:func:`~lightning_gradcomp.presets.register_preset`). Importing :mod:`lightning_gradcomp` imports this module. The
order of the declarations is the order of ``lightning-gradcomp list``. The presets of the other strategies are
declared next to their classes (``localsgd``, ``diloco`` and ``diloco_cltk`` in :mod:`~.localsgd.strategy`,
``swarmsgd`` in :mod:`~.swarm.strategy`).
"""

from __future__ import annotations

import torch

from lightning_gradcomp.callbacks.lgreco import LGreCo
from lightning_gradcomp.compressors.cast import Cast
from lightning_gradcomp.compressors.cltk import CLTK
from lightning_gradcomp.compressors.diana import DIANA
from lightning_gradcomp.compressors.none import NoCompression
from lightning_gradcomp.compressors.powersgd import PowerSGD
from lightning_gradcomp.compressors.qsgd import QSGD
from lightning_gradcomp.compressors.randomk import RandomK
from lightning_gradcomp.compressors.signsgd import SignSGD
from lightning_gradcomp.compressors.terngrad import TernGrad
from lightning_gradcomp.compressors.topk import TopK
from lightning_gradcomp.presets import register_preset

__all__: list[str] = []

register_preset("gradcomp_fp16", "DDP + float16 all-reduce", lambda: {"compressor": Cast(torch.float16)})
register_preset("gradcomp_bf16", "DDP + bfloat16 all-reduce", lambda: {"compressor": Cast(torch.bfloat16)})
register_preset(
    "scalecom",
    "DDP + ScaleCom CLT-k 1% with error feedback (leader broadcast + all-reduce)",
    lambda: {"compressor": CLTK(density=0.01)},
)
register_preset(
    "scalecom_compact",
    "DDP + CLT-k 1%, approximate selection, fp16 values, delta16 indices (133x fewer bytes than dense)",
    lambda: {"compressor": CLTK(density=0.01, selection="approx", value_dtype=torch.float16, index_coding="delta16")},
)
register_preset(
    "diana",
    "DDP + DIANA (l-inf blocks of 128, alpha = alpha_p/2) over the quantized all-reduce",
    lambda: {"compressor": DIANA()},
)
register_preset("gradcomp_none", "DDP with the dense all-reduce (reference)", lambda: {"compressor": NoCompression()})
register_preset(
    "powersgd_gc", "DDP + PowerSGD rank 4 with error feedback and warm start", lambda: {"compressor": PowerSGD(rank=4)}
)
register_preset(
    "qsgd", "DDP + 4-bit QSGD (bucket 512) over the quantized all-reduce", lambda: {"compressor": QSGD(bits=4)}
)
register_preset(
    "gradcomp_randomk", "DDP + shared random-1% with error feedback", lambda: {"compressor": RandomK(density=0.01)}
)
register_preset(
    "signsgd", "DDP + scaled SignSGD (1 bit, bucket 512) with error feedback", lambda: {"compressor": SignSGD()}
)
register_preset(
    "terngrad", "DDP + TernGrad (2-bit, bucket 512) over the quantized all-reduce", lambda: {"compressor": TernGrad()}
)
register_preset(
    "gradcomp_topk",
    "DDP + local top-1% with error feedback (all-gather, delta16 indices)",
    lambda: {"compressor": TopK(density=0.01, index_coding="delta16")},
)
register_preset(
    "lgreco",
    "DDP + PowerSGD rank 4 with L-GreCo per-layer ranks (re-chosen every 1000 steps)",
    lambda: {"compressor": PowerSGD(rank=4), "layerwise": LGreCo()},
)
