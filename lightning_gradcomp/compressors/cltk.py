"""CLTK: ScaleCom's cyclic local top-k (one leader's indices, all-reduced values).

Per step and bucket, one **leader** rank selects, for every compressed layer, the ``k`` largest
entries of *its own* error-compensated ``p = m + g``. The indices of all layers travel in **one
broadcast** from the leader, every rank gathers its own values at those indices, and the values
travel in **one all-reduce**. The support is the same on every rank, so the compressor commutes with
the average: ``mean_i CLT(p_i) == CLT(mean_i p_i)``, and bytes per rank stay ``O(k)`` for any W::

    int32 indices, fp32 values:  4 k  +  2 (W-1)/W * 4 k        (dense: 2 (W-1)/W * 4 n)

Each rank's residual (its memory update) is its *local* ``p`` with the kept entries removed.

Leader: ``step mod W``, the paper's rule (see :func:`leader_rank`). ``spread_leaders=True`` uses
``(step + bucket_index) mod W`` instead, so that with several buckets the selection work of one step is
spread over several ranks; that opt-in is not resume-exact with several buckets, because DDP groups layers
into different buckets in the first step after a resume.

Wire options:

* ``value_dtype``: fp32 (default), fp16 or bf16 values; 16-bit values are divided by W before the
  cast and saturated (:func:`~.sparse.saturated_wire_values`: no overflow in the 16-bit sum), and the cast's rounding
  and the part clamped off stay in the residual.
* ``index_coding``: ``"int32"`` (default; a layer of more than ``2**31`` elements sends each index as two int32
  words, its low and high halves: 8 bytes), or ``"delta16"``: the sorted indices of a layer as uint16
  gaps, where code 0 means "advance 65535 without keeping" (so any gap fits). A layer of ``n``
  elements uses ``k + (n - 1) // 65535`` codes, a fixed size all ranks know: about half the index bytes.
* ``selection``: ``"exact"`` (``torch.topk``) or ``"approx"`` (sampled threshold,
  :func:`~lightning_gradcomp.functional.selection.approx_topk_indices`). The wire always has ``k``
  value slots per layer; ``approx`` keeps between ``ceil(0.9 k)`` and ``k`` of them (the band
  ``(0.9, 1.0)``: a surplus is trimmed to the exact top-k of the candidates), and unused slots carry
  index padding and zero values.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from torch import Tensor

from lightning_gradcomp.checks import check_bool
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
    unpack_bytes,
)
from lightning_gradcomp.functional.selection import approx_topk_indices, exact_topk_indices, prepare_native
from lightning_gradcomp.functional.slot_views import split_flat
from lightning_gradcomp.functional.sparsify import (
    decode_delta16,
    decode_int32_indices,
    delta16_capacity,
    encode_delta16,
    encode_int32_indices,
    int32_index_words,
    kept_count,
    packed_positions,
    scatter_dense,
)

__all__ = ["CLTK", "decode_delta16", "delta16_capacity", "encode_delta16", "leader_rank"]

_APPROX_BAND = (0.9, 1.0)


def leader_rank(step: int, bucket_index: int, world_size: int) -> int:
    """The rank selecting indices for ``bucket_index`` at ``step``: ``(step + bucket_index) mod W``."""
    return (step + bucket_index) % world_size


@register("cltk")
class CLTK(SparseCompressor):
    """ScaleCom's cyclic local top-k with error feedback (memory low-pass: ``GradCompStrategy(beta=)``
    or :class:`~lightning_gradcomp.callbacks.LowPassMemoryFilter`).

    Args:
        density: fraction of each layer's elements kept, in (0, 1] (per layer via ``set_layer_params``).
        selection: ``"exact"`` (``torch.topk``) or ``"approx"`` (sampled threshold, 0.9k..k kept).
        value_dtype: wire dtype of the values (fp32, fp16 or bf16).
        index_coding: ``"int32"`` (two words per index in a layer of more than ``2**31`` elements) or ``"delta16"``
            (uint16 gaps, about half the index bytes).
        spread_leaders: offset the leader by the bucket index (spreads top-k work over ranks; not
            resume-exact with several buckets). Default: the paper's ``step mod W``.
        ratio: deprecated name of ``density`` (warns with a ``DeprecationWarning``).
    """

    def __init__(
        self,
        density: float = 0.01,
        selection: Literal["exact", "approx"] = "exact",
        value_dtype: torch.dtype | str = torch.float32,
        index_coding: Literal["int32", "delta16"] = "int32",
        spread_leaders: bool = False,
        *,
        ratio: Optional[float] = None,
    ) -> None:
        super().__init__(resolve_density("CLTK", density, ratio, 0.01), value_dtype)
        if selection not in ("exact", "approx"):
            raise ValueError(f"`selection` must be 'exact' or 'approx', got {selection!r}")
        self.selection = selection
        self.spread_leaders = check_bool("spread_leaders", spread_leaders)
        self.index_coding = check_index_coding(index_coding)

    def index_slots(self, numel: int, k: int) -> int:
        """Index entries (uint16 or int32 words) on the wire for a layer of ``numel`` elements keeping ``k``."""
        return delta16_capacity(numel, k) if self.index_coding == "delta16" else k * int32_index_words(numel)

    def prepare(self) -> None:
        """Build or load the compiled selection kernel (both selections use it on CPU) now, not in the first
        ``reduce``.

        The strategy calls this on every rank in its setup: the build (7-20 s, once per machine; the ranks of
        a machine wait for one build) would otherwise stall the leader's first backward while the other
        ranks wait in the index broadcast. Where the kernel cannot be built, it warns once and the
        selection uses NumPy or torch (the same indices).
        """
        prepare_native()

    def precompute(self, index: int, tensor: Tensor, ctx: ReduceContext) -> Optional[Tensor]:
        """On this step's leader, the indices it keeps of slot ``index`` (``tensor``: its ``p``); ``None`` on the
        other ranks, which take the leader's."""
        if ctx.rank != self._leader(ctx):
            return None
        return self._select(tensor, kept_count(tensor.numel(), ctx.params[index]), ctx, ctx.slots[index].name)

    def _leader(self, ctx: ReduceContext) -> int:
        return leader_rank(ctx.step, ctx.bucket_index if self.spread_leaders else 0, ctx.world_size)

    def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
        """Leader selects (unless it did already: :meth:`precompute`), one broadcast of the indices, one all-reduce of
        the values."""
        numels = [t.numel() for t in tensors]
        ks = [kept_count(n, r) for n, r in zip(numels, ctx.params)]
        slots = [self.index_slots(n, k) for n, k in zip(numels, ks)]
        index_dtype = torch.uint16 if self.index_coding == "delta16" else torch.int32
        leader = self._leader(ctx)
        device = tensors[0].device
        if ctx.rank == leader:
            chosen = [self._chosen(i, t, k, ctx) for i, (t, k) in enumerate(zip(tensors, ks))]
            payload = pack_bytes([self._encode(idx, n, k, s) for idx, n, k, s in zip(chosen, numels, ks, slots)])
        else:
            nbytes = sum(slots) * torch.empty((), dtype=index_dtype).element_size()
            payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
        ctx.comm.broadcast(payload, leader, shares=ctx.shares(slots))
        codes = unpack_bytes(payload, [(index_dtype, s) for s in slots])
        indices = [self._decode(c, n) for c, n in zip(codes, numels)]

        world = ctx.world_size
        counts = [idx.numel() for idx in indices]  # k, or fewer with the approximate selection
        every = torch.cat(indices)
        # where each chosen entry sits in the values' per-layer slots of k (None: they fill them, counts == ks)
        slotted = None if counts == ks else packed_positions(counts, ks, device)
        gathered = slot_positions(tensors, every, counts)
        if gathered is not None:
            taken = gathered[0].index_select(0, gathered[1])
        else:
            taken = torch.cat([t.index_select(0, idx) for t, idx in zip(tensors, indices)])
        if slotted is None:
            values = taken
        else:
            values = torch.zeros(sum(ks), dtype=torch.float32, device=device).scatter_(0, slotted, taken)
        if self.value_dtype == torch.float32:
            sent, local, divisor = values, values, world
        else:  # pre-divided by W and saturated (no 16-bit overflow); the cast's rounding stays in the residual
            sent, divisor = saturated_wire_values(values, self.value_dtype, world), 1
            local = sent.to(torch.float32).mul_(world)  # this rank's contribution c as the wire carries it
        lost = values - local  # residual p - c at the chosen entries, written in p's storage
        lost = lost if slotted is None else lost.index_select(0, slotted)
        if gathered is not None:
            gathered[0].scatter_(0, gathered[1], lost)
        else:
            for t, idx, r in zip(tensors, indices, split_flat(lost, counts)):
                t.scatter_(0, idx, r)
        fut = ctx.comm.all_reduce(sent, async_op=True, shares=ctx.shares(ks))
        outputs = [ctx.output(i, t) for i, t in enumerate(tensors)]  # zeroed while the values travel
        scattered = slot_positions(outputs, every, counts)

        def decode(f: torch.futures.Future) -> list[Tensor]:
            mean = f.value().to(torch.float32).div_(divisor)
            mean = mean if slotted is None else mean.index_select(0, slotted)
            if scattered is not None:
                scattered[0].scatter_add_(0, scattered[1], mean)
                return outputs
            return [
                scatter_dense(n, idx, v, out=out)
                for n, out, idx, v in zip(numels, outputs, indices, split_flat(mean, counts))
            ]

        return Reduction(averaged=then_same_numerics(fut, decode, ctx.comm.stats), residuals=tensors)

    def _chosen(self, index: int, p: Tensor, k: int, ctx: ReduceContext) -> Tensor:
        early = ctx.precomputed(index)
        return self._select(p, k, ctx, ctx.slots[index].name) if early is None else early

    def _select(self, p: Tensor, k: int, ctx: ReduceContext, name: str) -> Tensor:
        """The leader's indices; the approximate selection's sample is seeded by the layer ``name`` (not its
        position in the bucket, which changes when DDP re-buckets)."""
        if self.selection == "exact":
            return exact_topk_indices(p, k)
        gen = ctx.generator(p.device, shared=True, salt=name)
        return approx_topk_indices(p, k, gen, band=_APPROX_BAND)

    def _encode(self, indices: Tensor, numel: int, k: int, slots: int) -> Tensor:
        """The leader's indices of a layer (``k`` or fewer) in its ``slots`` codes; int32 ones padded with -1."""
        if self.index_coding == "delta16":
            return encode_delta16(indices, slots)
        return encode_int32_indices(indices, numel, capacity=k)

    def _decode(self, codes: Tensor, numel: int) -> Tensor:
        if self.index_coding == "delta16":
            return decode_delta16(codes)
        indices = decode_int32_indices(codes, numel)
        return indices[indices >= 0]

    def extra_repr(self) -> str:
        extra = "" if self.selection == "exact" else f", selection={self.selection!r}"
        extra += "" if self.index_coding == "int32" else f", index_coding={self.index_coding!r}"
        return super().extra_repr() + extra
