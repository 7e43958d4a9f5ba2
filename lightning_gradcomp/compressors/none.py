"""NoCompression: the plain dense all-reduce (bit-identical to DDP's default)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.comm import then_same_numerics
from lightning_gradcomp.compressors.base import Capabilities, Compressor, ReduceContext, Reduction
from lightning_gradcomp.functional.axpy import predivide_
from lightning_gradcomp.functional.slot_views import split_flat

__all__ = ["NoCompression"]


class NoCompression(Compressor):
    """Dense fp32 all-reduce of every bucket; the engine pre-divides by W exactly as DDP does."""

    capabilities = Capabilities(dense=True)

    def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
        """Average by one all-reduce of the concatenated slots."""
        counts = [t.numel() for t in tensors]
        flat = predivide_(torch.cat(tensors), ctx.world_size)
        fut = ctx.comm.all_reduce(flat, async_op=True, shares=ctx.shares(counts))
        return Reduction(averaged=then_same_numerics(fut, lambda f: split_flat(f.value(), counts), ctx.comm.stats))
