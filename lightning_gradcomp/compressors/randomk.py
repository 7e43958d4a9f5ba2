"""RandomK: shared-seed random sparsification with an all-reduce of the kept values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.checks import check_bool
from lightning_gradcomp.comm import then_same_numerics
from lightning_gradcomp.compressors.base import ReduceContext, Reduction, split_flat
from lightning_gradcomp.compressors.registry import register
from lightning_gradcomp.compressors.sparse import (
    SparseCompressor,
    resolve_density,
    saturated_wire_values,
    slot_positions,
)
from lightning_gradcomp.functional.layerwise import randomk_errors, sparse_sizes
from lightning_gradcomp.functional.sparsify import kept_count, scatter_dense, stratified_layers

__all__ = ["RandomK"]


@register("randomk")
class RandomK(SparseCompressor):
    """Keep ``k`` random entries per layer, chosen by a generator shared by all ranks.

    Selection is stratified: each layer is cut into ``k`` near-equal blocks and one uniform element is
    kept per block (O(k) random numbers instead of a permutation of the whole layer; each element is kept
    with probability ``1/block size`` = ``k/n``).

    The support is identical everywhere, so the values are all-reduced: bytes per rank are
    ``2 (W-1)/W * sum_l k_l * value bytes``, independent of W. No indices travel.

    Args:
        density: fraction of each layer's elements kept, in (0, 1].
        unbiased: scale kept values by their block size (``n / k``) and skip error feedback (unbiased, high
            variance);
            the default keeps values unscaled and relies on error feedback.
        value_dtype: wire dtype of the values (fp32, fp16 or bf16; 16-bit values are divided by W and saturated
            before the cast: :func:`~.sparse.saturated_wire_values`).
        ratio: deprecated name of ``density`` (warns with a ``DeprecationWarning``).
    """

    def __init__(
        self,
        density: float = 0.01,
        unbiased: bool = False,
        value_dtype: torch.dtype | str = torch.float32,
        *,
        ratio: Optional[float] = None,
    ) -> None:
        super().__init__(resolve_density("RandomK", density, ratio, 0.01), value_dtype)
        self.unbiased = check_bool("unbiased", unbiased)

    @property
    def uses_error_feedback(self) -> bool:
        return not self.unbiased

    def layer_costs(
        self, stat: Tensor, shape: Sequence[int], candidates: Sequence[Any]
    ) -> tuple[list[float], list[float]]:
        """Bytes ``k * value bytes`` (no indices travel) and expected unscaled random-``k`` errors
        ``sqrt(1 - k/n) ||A||`` (see :meth:`Compressor.layer_costs`)."""
        ks = [kept_count(stat.numel(), r) for r in candidates]
        return sparse_sizes(ks, self.value_dtype.itemsize, index_bytes=0), randomk_errors(stat, ks)

    def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
        """Shared indices, one all-reduce of the concatenated values.

        The sums are scattered into the outputs (the bucket's slices) by one call for the whole bucket
        (:func:`~.base.storage_window`); inputs that are slices of one buffer are gathered and given their residuals
        by one call each too. Otherwise one call per slot."""
        ks = [kept_count(t.numel(), r) for t, r in zip(tensors, ctx.params)]
        numels = [t.numel() for t in tensors]
        device = tensors[0].device
        generators = [ctx.generator(device, shared=True, salt=slot.name) for slot in ctx.slots]
        local, sizes = stratified_layers(numels, ks, generators, device)  # indices within each slot
        gathered = slot_positions(tensors, local, ks)
        if gathered is not None:
            values = gathered[0].index_select(0, gathered[1])
        else:
            values = torch.cat([t.index_select(0, i) for t, i in zip(tensors, split_flat(local, ks))])
        if self.unbiased:
            values = values * sizes.to(values.dtype)
        world = ctx.world_size
        # 16 bits: divided by W and saturated (the all-reduce's sums never overflow to Inf)
        sent = saturated_wire_values(values, self.value_dtype, world)
        residuals = None
        if self.uses_error_feedback:
            contribution = sent if self.value_dtype == torch.float32 else sent.to(torch.float32).mul_(world)
            lost = values - contribution  # p - c at the kept entries (zeros in fp32), c as the wire carries it
            if gathered is not None:
                gathered[0].scatter_(0, gathered[1], lost)
            else:
                for t, i, r in zip(tensors, split_flat(local, ks), split_flat(lost, ks)):
                    t.scatter_(0, i, r)
            residuals = tensors
        fut = ctx.comm.all_reduce(sent, async_op=True, shares=ctx.shares(ks))
        scale = 1.0 if self.value_dtype != torch.float32 else 1.0 / world
        outputs = [ctx.output(slot, t) for slot, t in enumerate(tensors)]  # zeroed while the values travel
        scattered = slot_positions(outputs, local, ks)

        def decode(f: torch.futures.Future) -> list[Tensor]:
            summed = f.value().to(torch.float32).mul_(scale)
            if scattered is not None:
                scattered[0].scatter_add_(0, scattered[1], summed)
                return outputs
            return [
                scatter_dense(n, i, v, out=out)
                for n, out, i, v in zip(numels, outputs, split_flat(local, ks), split_flat(summed, ks))
            ]

        return Reduction(averaged=then_same_numerics(fut, decode, ctx.comm.stats), residuals=residuals)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", unbiased=True" if self.unbiased else "")
