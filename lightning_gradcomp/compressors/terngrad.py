"""TernGrad: unbiased scaled ternary quantization (2-bit codes, one max-norm scale per bucket)."""

from __future__ import annotations

import math
from typing import Any, Optional

from lightning_gradcomp.compressors.quantized import QuantizedCompressor
from lightning_gradcomp.compressors.quantized_arguments import resolve_group_size
from lightning_gradcomp.compressors.registry import register
from lightning_gradcomp.compressors.wire_layout import SlotCodec

__all__ = ["TernGrad"]


@register("terngrad")
class TernGrad(QuantizedCompressor):
    """TernGrad: each element becomes ``s * sign(x) * Bernoulli(|x| / s)`` with ``s = max |x|`` of its group.

    Unbiased, no error feedback. The original paper uses one scale per layer; here a layer is cut into
    groups of ``group_size`` elements so the quantized all-reduce can split it across ranks (smaller
    groups also lower the variance). Gradient clipping from the paper is not applied (it biases).
    Bytes per rank (all-to-all): ``~ 2 (W-1)/W * (n/4 + 4 n/group_size)``, 15.5x less than fp32 at 512.

    Args:
        group_size: elements per fp32 scale.
        aggregation: ``"auto"`` (default: ``"allgather"`` at W <= 2, else ``"alltoall"``), ``"alltoall"`` or
            ``"allgather"``.
        bucket_size: deprecated name of ``group_size`` (warns with a ``DeprecationWarning``).
    """

    def __init__(self, group_size: int = 512, aggregation: str = "auto", *, bucket_size: Optional[int] = None) -> None:
        super().__init__(aggregation)
        self.group_size: int = resolve_group_size("TernGrad", group_size, bucket_size)

    def codec(self, param: Any) -> SlotCodec:
        return SlotCodec(1, self.group_size, math.inf)

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        return f"group_size={self.group_size}" + (f", {extra}" if extra else "")
