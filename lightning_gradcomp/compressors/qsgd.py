"""QSGD: unbiased stochastic rounding to ``bits`` bits with one fp32 scale per bucket."""

from __future__ import annotations

from typing import Any, Optional, Union

from lightning_gradcomp.checks import check_bucket_size, check_group_size, check_int
from lightning_gradcomp.compressors.quantized import QuantizedCompressor
from lightning_gradcomp.compressors.quantized_arguments import check_p, resolve_group_size
from lightning_gradcomp.compressors.registry import register
from lightning_gradcomp.compressors.wire_layout import SlotCodec
from lightning_gradcomp.functional.quantization_groups import levels_for_bits

__all__ = ["QSGD", "check_bits", "check_bucket_size", "check_group_size"]


def check_bits(value: Any) -> int:
    """Validate a QSGD bit width: an integer in [2, 8] (integral floats accepted)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return check_int("bits", value, 2, 8)


@register("qsgd")
class QSGD(QuantizedCompressor):
    """QSGD quantization: ``L = 2**(bits-1) - 1`` levels per sign, stochastic rounding, unbiased, no EF.

    Each group of ``group_size`` consecutive elements (the QSGD paper's "bucket") is scaled by its ``p``-norm
    (``"inf"``: max-norm, lower variance in practice; ``2``: the QSGD paper's norm) and every element becomes a
    ``bits``-bit code.
    ``bits`` is the per-layer parameter (L-GreCo may set a different width per layer).

    Bytes per rank (all-to-all; ``"auto"``'s all-gather at W <= 2 sends as many): ``~ 2 (W-1)/W * (n bits/8 + 4
    n/group_size)``,
    i.e. ``4 / (bits/8 + 4/group_size)`` times less than the fp32 all-reduce (7.9x for 4 bits, 512).

    Args:
        bits: bits per element, 2 to 8 (2 bits is ternary).
        group_size: elements per fp32 scale.
        p: scale norm, ``"inf"`` or ``2``.
        aggregation: ``"auto"`` (default: ``"allgather"`` at W <= 2, else ``"alltoall"``), ``"alltoall"``
            (re-quantizing, bandwidth-optimal) or ``"allgather"`` (exact mean of the per-rank messages; bytes grow
            with W).
        bucket_size: deprecated name of ``group_size`` (warns with a ``DeprecationWarning``).
    """

    param_name = "bits"

    def __init__(
        self,
        bits: int = 4,
        group_size: int = 512,
        p: Union[int, float, str] = "inf",
        aggregation: str = "auto",
        *,
        bucket_size: Optional[int] = None,
    ) -> None:
        super().__init__(aggregation)
        self.bits: int = check_bits(bits)
        self.group_size: int = resolve_group_size("QSGD", group_size, bucket_size)
        self.p: float = check_p(p)

    def check_param(self, value: Any) -> int:
        return check_bits(value)

    def codec(self, param: Any) -> SlotCodec:
        bits = self.bits if param is None else int(param)
        return SlotCodec(levels_for_bits(bits), self.group_size, self.p)

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        return f"bits={self.bits}, group_size={self.group_size}, p={self.p}" + (f", {extra}" if extra else "")
