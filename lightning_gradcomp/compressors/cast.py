"""Cast: all-reduce in 16-bit floating point (like PyTorch's fp16/bf16 compress hooks)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.checks import check_dtype
from lightning_gradcomp.comm import then_same_numerics
from lightning_gradcomp.compressors.base import (
    Capabilities,
    Compressor,
    ReduceContext,
    Reduction,
)
from lightning_gradcomp.compressors.registry import register
from lightning_gradcomp.functional.half import scaled_cast, widen
from lightning_gradcomp.functional.selection import prepare_native
from lightning_gradcomp.functional.slot_views import contiguous_span, split_flat

__all__ = ["Cast"]

_ALLOWED = (torch.float16, torch.bfloat16)


@register("fp16")
@register("cast")
class Cast(Compressor):
    """Send compressed slots as 16-bit floats: half the bytes of fp32, no error feedback.

    Values are divided by W *before* the cast (avoids fp16 overflow), then summed in ``dtype``.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16`` (``"float16"``/``"bfloat16"`` strings accepted).
    """

    capabilities = Capabilities(
        borrows_inputs=True,  # read by one pass, then overwritten by the result
        propagates_nonfinite=True,  # stateless; NaN and Inf survive the 16-bit sum (so does an fp16 overflow)
        compresses_small_layers=True,  # biases and norms are cast too, as by PyTorch's fp16_compress_hook
    )

    def __init__(self, dtype: torch.dtype | str = torch.float16) -> None:
        self.dtype: torch.dtype = check_dtype("dtype", dtype, _ALLOWED)

    def prepare(self) -> None:
        """Build or load the compiled kernel of the 16-bit passes now (the strategies' setup calls this), not in the
        first ``reduce``."""
        prepare_native()

    def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
        """One all-reduce of the concatenated, pre-divided 16-bit slots; the result is written into ``tensors``.

        No concatenated fp32 copy. When the slots lie back to back (every layer is cast by default, so a bucket is
        one span) they are cast through one view, divided by W on the way (:func:`~.half.scaled_cast`), and the sum
        is widened back with its NaN/Inf check in the same pass (:func:`~.half.widen`, reported in the
        reduction's ``result_nonfinite``); otherwise they are divided in place and concatenated into the 16-bit
        buffer."""
        counts = [t.numel() for t in tensors]
        span = contiguous_span(tensors)
        flat = torch.empty(sum(counts), dtype=self.dtype, device=tensors[0].device)
        if span is not None:
            scaled_cast(span, ctx.world_size, flat)  # x / W in fp32, rounded once to 16 bits
        else:
            torch._foreach_div_(tensors, ctx.world_size)  # one fused launch on CUDA, not one per slot
            torch.cat(tensors, out=flat)
        fut = ctx.comm.all_reduce(flat, async_op=True, shares=ctx.shares(counts))
        reduction = Reduction(averaged=fut)

        def decode(done: torch.futures.Future) -> list[Tensor]:
            total = done.value()
            if span is not None:
                reduction.result_nonfinite = widen(total, span)  # None without the kernel: the engine checks
                return tensors
            return [t.copy_(piece) for t, piece in zip(tensors, split_flat(total, counts))]

        reduction.averaged = then_same_numerics(fut, decode, ctx.comm.stats)
        return reduction

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}"
