"""TopK: local top-k sparsification with an all-gather of (values, int32 indices).

Every rank keeps its own ``k`` largest-magnitude entries of ``p = m + g`` per layer, so supports
differ between ranks and the payload must be all-gathered: bytes per rank grow like ``(W-1) * k``.
This is the honest baseline that CLT-k (ScaleCom) improves on.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.comm import then_same_numerics
from lightning_gradcomp.compressors.base import ReduceContext, Reduction
from lightning_gradcomp.compressors.registry import register
from lightning_gradcomp.compressors.sparse import SparseCompressor, pack_bytes, unpack_bytes
from lightning_gradcomp.functional.selection import exact_topk_indices, prepare_native
from lightning_gradcomp.functional.sparsify import kept_count
from lightning_gradcomp.presets import register_preset

__all__ = ["TopK"]


@register("topk")
class TopK(SparseCompressor):
    """Local top-k with error feedback.

    Wire bytes per rank: ``(W - 1) * sum_l k_l * (4 + value bytes)``.

    Args:
        ratio: fraction of each layer's elements kept, in (0, 1].
        value_dtype: wire dtype of the kept values (fp32, fp16 or bf16).
    """

    def __init__(self, ratio: float = 0.01, value_dtype: torch.dtype | str = torch.float32) -> None:
        super().__init__(ratio, value_dtype)

    def prepare(self) -> None:
        """Build or load the compiled selection kernel now (the strategy's setup calls this on every rank), not in
        the first ``reduce``; without it the selection takes the torch steps (the same set)."""
        prepare_native()

    def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
        """Select locally, all-gather one packed byte payload, sum the ranks' entries in rank order.

        While the payload travels, this rank writes its residuals and zeroes its output slots."""
        ks = [kept_count(t.numel(), r) for t, r in zip(tensors, ctx.params)]
        indices = [exact_topk_indices(t, k) for t, k in zip(tensors, ks)]
        values = torch.cat([t.index_select(0, i) for t, i in zip(tensors, indices)])
        sent = values.to(self.value_dtype)
        flat_idx = torch.cat(indices).to(torch.int32)
        fut = ctx.comm.all_gather(pack_bytes([flat_idx, sent]), async_op=True, shares=ctx.shares(ks))

        residuals = []
        pos = 0
        for t, idx, k in zip(tensors, indices, ks):
            t.index_copy_(0, idx, values[pos : pos + k] - sent[pos : pos + k].to(torch.float32))  # p - c, in place
            residuals.append(t)
            pos += k
        averaged = [ctx.output(i, t) for i, t in enumerate(tensors)]  # zeroed while the payload travels
        total = sum(ks)

        def decode(f: Future) -> list[Tensor]:
            touched: list[list[Tensor]] = [[] for _ in ks]
            for raw in f.value():  # rank order: identical summation on every rank
                idx, vals = unpack_bytes(raw, [(torch.int32, total), (self.value_dtype, total)])
                vals, idx = vals.to(torch.float32), idx.long()
                pos = 0
                for out, k, seen in zip(averaged, ks, touched):
                    out.index_add_(0, idx[pos : pos + k], vals[pos : pos + k])
                    seen.append(idx[pos : pos + k])
                    pos += k
            for out, seen in zip(averaged, touched):  # the other entries are zeros, and 0 / W = 0: divide the sums
                where = torch.cat(seen)
                out.index_put_((where,), out.index_select(0, where).div_(ctx.world_size))
            return averaged

        return Reduction(averaged=then_same_numerics(fut, decode, ctx.comm.stats), residuals=residuals)


register_preset(
    "gradcomp_topk", "DDP + local top-1% with error feedback (all-gather)", lambda: {"compressor": TopK(ratio=0.01)}
)
