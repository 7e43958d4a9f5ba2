"""TopK: local top-k sparsification with an all-gather of (values, indices: int32 or delta16).

Every rank keeps its own ``k`` largest-magnitude entries of ``p = m + g`` per layer, so supports
differ between ranks and the payload must be all-gathered: bytes per rank grow like ``(W-1) * k``.
This is the honest baseline that CLT-k (ScaleCom) improves on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Optional

import torch
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.comm import then_same_numerics
from lightning_gradcomp.compressors.base import ReduceContext, Reduction
from lightning_gradcomp.compressors.registry import register
from lightning_gradcomp.compressors.sparse import (
    SparseCompressor,
    check_index_coding,
    pack_bytes,
    resolve_density,
    saturated_wire_values,
    slot_positions,
    slot_shift,
    unpack_bytes,
)
from lightning_gradcomp.functional.layerwise import topk_errors
from lightning_gradcomp.functional.selection import exact_topk_indices, prepare_native
from lightning_gradcomp.functional.slot_views import split_flat
from lightning_gradcomp.functional.sparsify import (
    decode_delta16_layers,
    decode_int32_indices,
    delta16_capacity,
    encode_delta16_layers,
    encode_int32_indices,
    int32_index_words,
    kept_count,
)

__all__ = ["TopK"]


@register("topk")
class TopK(SparseCompressor):
    """Local top-k with error feedback.

    Wire bytes per rank: ``(W - 1) * sum_l (k_l * value bytes + index bytes)``, the index bytes ``4 k_l`` (int32;
    ``8 k_l`` for a layer of more than ``2**31`` elements, whose positions need 64 bits) or
    ``2 * (k_l + (n_l - 1) // 65535)`` (delta16).

    Args:
        density: fraction of each layer's elements kept, in (0, 1].
        value_dtype: wire dtype of the kept values (fp32, fp16 or bf16; 16-bit values saturate just below the
            dtype's largest finite value instead of overflowing, the rest kept in the residual:
            :func:`~.sparse.saturated_wire_values`).
        index_coding: ``"int32"`` (two int32 words per index in a layer of more than ``2**31`` elements:
            :func:`~lightning_gradcomp.functional.sparsify.int32_index_words`) or ``"delta16"``: each layer's sorted
            indices as uint16 gaps
            (:func:`~lightning_gradcomp.functional.sparsify.encode_delta16`), about half the index bytes, a fixed size
            every rank knows (the all-gather's payloads stay equal).
        ratio: deprecated name of ``density`` (warns with a ``DeprecationWarning``).
    """

    def __init__(
        self,
        density: float = 0.01,
        value_dtype: torch.dtype | str = torch.float32,
        index_coding: Literal["int32", "delta16"] = "int32",
        *,
        ratio: Optional[float] = None,
    ) -> None:
        super().__init__(resolve_density("TopK", density, ratio, 0.01), value_dtype)
        self.index_coding = check_index_coding(index_coding)

    def index_slots(self, numel: int, k: int) -> int:
        """Index entries (uint16 or int32 words) on the wire for a layer of ``numel`` elements keeping ``k``."""
        return delta16_capacity(numel, k) if self.index_coding == "delta16" else k * int32_index_words(numel)

    def layer_costs(
        self, stat: Tensor, shape: Sequence[int], candidates: Sequence[Any]
    ) -> tuple[list[float], list[float]]:
        """Bytes ``k * value bytes`` plus the index bytes of :attr:`index_coding`, and top-``k`` errors (see
        :meth:`Compressor.layer_costs`)."""
        n = stat.numel()
        ks = [kept_count(n, r) for r in candidates]
        index_bytes = 2 if self.index_coding == "delta16" else 4
        sizes = [float(k * self.value_dtype.itemsize + index_bytes * self.index_slots(n, k)) for k in ks]
        return sizes, topk_errors(stat, ks)

    def prepare(self) -> None:
        """Build or load the compiled selection kernel now (the strategy's setup calls this on every rank), not in
        the first ``reduce``; without it the selection takes the torch steps (the same set)."""
        prepare_native()

    def precompute(self, index: int, tensor: Tensor, ctx: ReduceContext) -> Tensor:
        """The sorted indices of ``tensor``'s ``k`` largest magnitudes (``k`` from slot ``index``'s density): what
        :meth:`reduce` keeps of that slot on this rank."""
        return self._select(index, tensor, ctx)

    def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
        """Select locally (unless done already: :meth:`precompute`), all-gather one packed byte payload, sum the ranks'
        entries divided by W (DDP's order: divide, then sum) in rank order.

        While the payload travels, this rank writes its residuals and zeroes its output slots. When the inputs (and
        the outputs) are slices of one buffer, gathering, residuals and sums take one call each for the whole bucket
        (:func:`~.functional.slot_views.storage_window`), not one per slot."""
        numels = [t.numel() for t in tensors]
        ks = [kept_count(n, r) for n, r in zip(numels, ctx.params)]
        indices = [self._chosen(i, t, ctx) for i, t in enumerate(tensors)]  # sorted
        local = torch.cat(indices)
        gathered = slot_positions(tensors, local, ks)
        if gathered is not None:
            values = gathered[0].index_select(0, gathered[1])
        else:
            values = torch.cat([t.index_select(0, i) for t, i in zip(tensors, indices)])
        sent = saturated_wire_values(values, self.value_dtype)  # a 16-bit value never overflows to Inf
        delta16 = self.index_coding == "delta16"
        slots = [self.index_slots(n, k) for n, k in zip(numels, ks)]
        wide = not delta16 and any(s != k for s, k in zip(slots, ks))  # a layer of more than 2**31 elements
        if delta16:
            codes = encode_delta16_layers(indices, slots)
        elif wide:
            codes = torch.cat([encode_int32_indices(i, n) for i, n in zip(indices, numels)])
        else:
            codes = local.to(torch.int32)
        index_dtype = codes.dtype
        index_bytes = codes.element_size()
        nbytes = [k * sent.element_size() + s * index_bytes for k, s in zip(ks, slots)]
        fut = ctx.comm.all_gather(pack_bytes([sent, codes]), async_op=True, shares=ctx.shares(nbytes))

        lost = values - sent.to(torch.float32)  # p - c at the kept entries, written in place
        if gathered is not None:
            gathered[0].scatter_(0, gathered[1], lost)
        else:
            for t, i, r in zip(tensors, indices, split_flat(lost, ks)):
                t.scatter_(0, i, r)
        averaged = [ctx.output(i, t) for i, t in enumerate(tensors)]  # zeroed while the payload travels
        # the outputs' window, and the shift from each rank's slot-local indices to positions in it
        out_window = slot_shift(averaged, ks)
        specs = [(self.value_dtype, sum(ks)), (index_dtype, sum(slots))]

        def decode(f: Future) -> list[Tensor]:
            for raw in f.value():  # rank order: identical summation on every rank
                vals, received = unpack_bytes(raw, specs)
                vals = vals.to(torch.float32, copy=True).div_(ctx.world_size)  # as DDP: divide, then sum
                if delta16:
                    idx = decode_delta16_layers(received, slots)
                elif wide:
                    idx = torch.cat([decode_int32_indices(c, n) for c, n in zip(received.split(slots), numels)])
                else:
                    idx = received.long()
                if out_window is not None:
                    out_window[0].scatter_add_(0, idx.add_(out_window[1]), vals)
                    continue
                for out, i, v in zip(averaged, torch.split(idx, ks), torch.split(vals, ks)):
                    out.scatter_add_(0, i, v)
            return averaged

        return Reduction(averaged=then_same_numerics(fut, decode, ctx.comm.stats), residuals=tensors)

    def _chosen(self, index: int, tensor: Tensor, ctx: ReduceContext) -> Tensor:
        early = ctx.precomputed(index)
        return self._select(index, tensor, ctx) if early is None else early

    @staticmethod
    def _select(index: int, tensor: Tensor, ctx: ReduceContext) -> Tensor:
        return exact_topk_indices(tensor, kept_count(tensor.numel(), ctx.params[index]))

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.index_coding == "int32" else f", index_coding={self.index_coding!r}")
