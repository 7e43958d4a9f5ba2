"""A complete user-defined compressor: per-layer int8 with error feedback (docs/custom-compressor.md)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.comm import completed_future
from lightning_gradcomp.compressors import Compressor, ReduceContext, Reduction, register


@register("int8_allgather")
class Int8AllGather(Compressor):
    """Round each layer to int8 with one fp32 scale (absmax / 127); all-gather codes and scales.

    Rounding is biased, so the engine keeps an error-feedback memory. Bytes sent per rank:
    ``(W - 1) * (n + 4 L)`` for ``n`` elements in ``L`` layers (fp32 all-reduce: about ``8 n``).
    """

    @property
    def uses_error_feedback(self) -> bool:
        return True

    def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
        scales = torch.stack([t.abs().max() / 127 for t in tensors]).clamp_min(1e-30)
        codes = torch.cat([torch.round(t / s).to(torch.int8) for t, s in zip(tensors, scales)])
        counts = [t.numel() for t in tensors]
        all_codes = ctx.comm.all_gather(codes, shares=ctx.shares(counts))      # (W, n) int8
        all_scales = ctx.comm.all_gather(scales, shares=ctx.shares([1] * len(counts)))  # (W, L) fp32

        residuals = [t.sub_(c.float() * s) for t, c, s in zip(tensors, codes.split(counts), scales)]
        averaged = [torch.zeros(n, device=codes.device) for n in counts]
        for rank_codes, rank_scales in zip(all_codes, all_scales):  # rank order: same sums everywhere
            for out, c, s in zip(averaged, rank_codes.split(counts), rank_scales):
                out.add_(c.float() * s)
        return Reduction(completed_future([a / ctx.world_size for a in averaged]), residuals=residuals)
