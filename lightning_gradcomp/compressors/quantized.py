"""The quantized all-reduce protocol shared by QSGD, TernGrad, SignSGD and DIANA.

A quantizing compressor encodes each compressed slot as ``uint8`` codes of ``bits`` bits (packed)
plus one fp32 scale per group of ``group_size`` elements. Two aggregations are offered, and ``"auto"`` (the
default) picks per run: ``"allgather"`` at ``W <= 2``, where it sends the same bytes as ``"alltoall"`` (``(W-1) P_1``
against ``2 (W-1) P_1 / W``) in one collective instead of two and without the owner's second quantization, and
``"alltoall"`` from ``W = 3`` on (:func:`resolve_aggregation`).

``"alltoall"`` (bandwidth-optimal; bytes per rank do not grow with W)
    1. Every layer is cut into W contiguous pieces of whole groups; *chunk* ``j`` is piece ``j`` of every
       layer of the bucket, owned by rank ``j`` (:func:`build_layout`; the cut depends on the layer
       alone, so ownership survives DDP's re-bucketing and resumes are exact).
    2. Every rank quantizes its layers with its own per-layer random streams; chunk ``j``'s payload (packed
       codes, then scales, zero-padded to a common size ``P``) goes to rank ``j`` in **one all-to-all**.
    3. The owner of chunk ``j`` decodes the W payloads, sums them in rank order and divides by W.
    4. The owner re-quantizes its averaged chunk (subclasses may shift it or add server-side error
       feedback) and the W re-quantized chunks are **all-gathered**. Every rank decodes the same bytes
       with the same function, so all ranks end bit-identical whatever randomness the owners used.

    Bytes per rank: ``(W-1) P`` for the all-to-all plus ``(W-1) P`` for the all-gather, where
    ``P ~ (sum_l n_l b_l / 8 + 4 G) / W`` (``G`` scales), i.e. ``~ 2 (W-1)/W (n b/8 + 4 G)``.

``"allgather"`` (exact aggregation of the per-rank messages)
    Every rank all-gathers all W messages and sums the decoded values in rank order:
    ``(W - 1) (n b / 8 + 4 G)`` bytes per rank, growing linearly with W.

Both are synchronous: the all-to-all must complete before the owner re-quantizes, so everything is
waited in ``reduce()`` and the returned Future is already complete.

This module holds :class:`QuantizedCompressor`, the exchange; it re-exports what it is built on: the wire format
(:mod:`.wire_layout`: slot codecs, chunk layouts, payloads, bytes), the state of the owned pieces
(:mod:`.owned_state`) and the quantizers' arguments (:mod:`.quantized_arguments`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.checks import check_group_size
from lightning_gradcomp.comm import completed_future
from lightning_gradcomp.compressors.base import Capabilities, Compressor, ReduceContext, Reduction
from lightning_gradcomp.compressors.owned_state import OwnedStore as OwnedStore
from lightning_gradcomp.compressors.owned_state import (
    owned_moved,
    owned_state,
    stage_owned,
    state_copy,
)
from lightning_gradcomp.compressors.quantized_arguments import (
    AGGREGATIONS,
    check_aggregation,
    check_p,
    resolve_aggregation,
    resolve_group_size,
)
from lightning_gradcomp.compressors.wire_layout import (
    ChunkLayout,
    Segment,
    SlotCodec,
    WireLayout,
    build_layout,
    layer_rotation,
    split_groups,
    wire_bytes,
)
from lightning_gradcomp.functional import _native
from lightning_gradcomp.functional.dequantize import Quantized, rows_mean
from lightning_gradcomp.functional.layerwise import quantization_errors, quantized_sizes
from lightning_gradcomp.functional.quantization_groups import num_groups

__all__ = [
    "AGGREGATIONS",
    "ChunkLayout",
    "DecodedMessages",
    "QuantizedCompressor",
    "Segment",
    "SlotCodec",
    "WireLayout",
    "build_layout",
    "check_aggregation",
    "check_p",
    "layer_rotation",
    "owned_moved",
    "owned_state",
    "resolve_aggregation",
    "resolve_group_size",
    "stage_owned",
    "split_groups",
    "state_copy",
    "wire_bytes",
]


def _generator(ctx: ReduceContext, codec: SlotCodec, device: torch.device, salt: str) -> Optional[torch.Generator]:
    """This rank's stream for one layer (per layer, so independent of the bucket layout); none for sign."""
    return None if codec.levels == 0 else ctx.generator(device, shared=False, salt=salt)


class DecodedMessages(Sequence[Tensor]):
    """This rank's stage-1 messages, each decoded (fp32) on first access.

    QSGD and TernGrad need their own decoded message only for observers (``Reduction.local``), so the full
    dequantization pass runs only when something reads it. SignSGD and DIANA never decode it into a tensor: they
    add it into their residuals and shifts straight from the codes (:meth:`message`, ``Quantized.decode_add``).
    """

    def __init__(self, messages: list[Quantized]) -> None:
        self._messages = messages
        self._values: Optional[list[Tensor]] = None

    def message(self, index: int) -> Quantized:
        """The codes and scales of message ``index`` (not decoded)."""
        return self._messages[index]

    def _decoded(self) -> list[Tensor]:
        if self._values is None:
            self._values = [m.decode() for m in self._messages]
        return self._values

    def __getitem__(self, index: Any) -> Any:
        return self._decoded()[index]

    def __len__(self) -> int:
        return len(self._messages)


class QuantizedCompressor(Compressor):
    """Base class of compressors that send packed quantization codes plus fp32 scales: it does the exchange, a
    subclass states its math.

    A subclass implements :meth:`codec` (the wire format of a slot given its per-layer parameter: ``levels`` and
    ``group_size``) and, to quantize otherwise than by the codec's stochastic rounding or scaled sign, :meth:`encode`
    (a flat tensor to codes and scales). The base class packs the messages, exchanges them (one all-gather, then
    every rank decodes the W messages and sums them in rank order; or the all-to-all protocol), and with
    :attr:`~Compressor.uses_error_feedback` returns the residuals ``p - c`` (decoded from this rank's own codes). Its
    :meth:`layer_costs` make a subclass with a per-layer parameter tunable by L-GreCo (the exact bytes of each
    candidate's codec; the error of :meth:`encode` when it is overridden).

    Deeper protocol hooks (DIANA's shifts, SignSGD's server-side error feedback): :meth:`_encode_inputs`,
    :meth:`_after_encode`, :meth:`_owner_message`, :meth:`_owner_shift`, :meth:`_owner_sent`, :meth:`_received`
    and :meth:`_exact_mean`. Hooks run in the ``reduce()`` body and do local math only.

    Args:
        aggregation: ``"auto"`` (default: ``"allgather"`` at W <= 2, else ``"alltoall"``), ``"alltoall"``
            (bandwidth-optimal two-stage) or ``"allgather"`` (exact); see :func:`resolve_aggregation`.
    """

    capabilities = Capabilities(
        borrows_inputs=True,  # quantization only reads them (DIANA subtracts its shift in that pass), keeps nothing
        # 1/16-1/8 of the dense bytes still travel: overlap them with backward (docs/benchmarks-history.md)
        bucket_cap_mb=4.0,
    )

    def __init__(self, aggregation: str = "auto") -> None:
        self.aggregation: str = check_aggregation(aggregation)
        self._layouts: dict[tuple, WireLayout] = {}

    @property
    def bucket_size(self) -> int:
        """Deprecated name of ``group_size`` (warns)."""
        warnings.warn("`.bucket_size` is deprecated: use `.group_size`", DeprecationWarning, stacklevel=2)
        return int(self.group_size)

    @bucket_size.setter
    def bucket_size(self, value: int) -> None:
        warnings.warn("`.bucket_size` is deprecated: use `.group_size`", DeprecationWarning, stacklevel=2)
        self.group_size = check_group_size(value, "bucket_size")

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled compressor, one saved before ``bucket_size`` became ``group_size`` included."""
        state = dict(state)
        if "bucket_size" in state:
            state.setdefault("group_size", state.pop("bucket_size"))
        self.__dict__.update(state)

    # ------------------------------------------------------------------ subclass API
    def codec(self, param: Any) -> SlotCodec:
        """The encoding of a slot whose per-layer parameter is ``param``."""
        raise NotImplementedError

    def encode(self, x: Tensor, codec: SlotCodec, generator: Optional[torch.Generator]) -> Quantized:
        """The math: a flat fp32 tensor (a layer, or a piece of one) as codes and scales in ``codec``'s format.

        A :class:`~lightning_gradcomp.functional.quantize.Quantized` of ``uint8`` codes ``c`` in ``[0, 2 L]`` (one
        per element, ``L = codec.levels``) and one fp32 scale ``s`` per group of ``codec.group_size`` elements, which
        every rank decodes to ``(c - L) s / L`` (``L = 0``: scaled sign, ``c`` in ``{0, 1}``, decoded to
        ``s (2 c - 1)``). ``generator``: this rank's stream for the layer (``None`` for scaled sign); deterministic
        encoders ignore it. It must not modify ``x``.

        Default: the codec's own rounding (:meth:`SlotCodec.quantize`: stochastic rounding, or scaled sign).
        """
        return codec.quantize(x, generator)

    def layer_costs(
        self, stat: Tensor, shape: Sequence[int], candidates: Sequence[Any]
    ) -> tuple[list[float], list[float]]:
        """Bytes ``ceil(n b / 8) + 4 ceil(n / group_size)`` and exact expected stochastic-rounding errors of the
        :meth:`codec` of each candidate (``b`` its bits; stochastic codecs with ``L = 2**(b-1) - 1`` levels, as
        QSGD's), for subclasses with a per-layer parameter (see :meth:`Compressor.layer_costs`).

        Raises:
            ValueError: the compressor has no per-layer parameter.
        """
        if not self.tunable:
            raise self._not_tunable()
        sizes, errors = [], []
        for value in candidates:
            c = self.codec(value)
            sizes += quantized_sizes(stat.numel(), [c.bits], c.group_size)
            if self._encodes_itself():
                errors.append(self._encode_error(stat, c))
            else:
                errors += quantization_errors(stat, [c.bits], c.group_size, c.p)
        return sizes, errors

    def _encodes_itself(self) -> bool:
        """Whether a subclass overrides :meth:`encode` (else the codecs' own rounding runs, fused with shifts)."""
        return type(self).encode is not QuantizedCompressor.encode

    def _encode_error(self, stat: Tensor, codec: SlotCodec) -> float:
        """``||A - decode(encode(A))||`` of :meth:`encode` (one draw of a generator seeded 0, for a randomized one)."""
        x = stat.detach().reshape(-1).to(torch.float32)
        generator = torch.Generator(device=x.device).manual_seed(0)
        return float((x - self.encode(x, codec, generator).decode()).norm())

    def _encode_shifted(
        self, x: Tensor, codec: SlotCodec, generator: Optional[torch.Generator], shift: Optional[Tensor]
    ) -> Quantized:
        """``encode(x - shift)``; the codecs' own rounding does the subtraction in its pass."""
        if not self._encodes_itself():
            return codec.quantize(x, generator, shift)
        return self.encode(x if shift is None else x - shift, codec, generator)

    def _encode_inputs(self, tensors: list[Tensor], ctx: ReduceContext) -> tuple[list[Tensor], Optional[list[Tensor]]]:
        """What is quantized at stage 1: ``(x, shifts)``, slot ``i`` being encoded as ``x[i] - shifts[i]`` when
        ``shifts`` is given (the subtraction fused into the quantization pass; DIANA's ``g_i - h_i``). Default: the
        tensors themselves, no shifts."""
        return tensors, None

    def _after_encode(
        self, tensors: list[Tensor], decoded: DecodedMessages, ctx: ReduceContext
    ) -> tuple[Optional[list[Tensor]], Optional[Sequence[Tensor]]]:
        """``(residuals, local)`` of the result, from this rank's decoded messages (see :class:`Reduction`).

        ``decoded`` decodes each message on first access (:class:`DecodedMessages`). Default: with error feedback,
        the residuals ``p - c`` written over the inputs straight from the codes; else ``local``, decoded lazily."""
        if self.uses_error_feedback:
            for i, p in enumerate(tensors):
                decoded.message(i).decode_add(p, -1.0, p)
            return tensors, None
        return None, decoded  # decoded lazily, only if an observer reads ``local``

    def _owner_message(self, ctx: ReduceContext, seg: Segment, mean: Tensor) -> Tensor:
        """What the owner re-quantizes for ``seg`` given the exact average of the W messages."""
        return mean

    def _owner_shift(self, ctx: ReduceContext, seg: Segment) -> Optional[Tensor]:
        """What the owner's message is re-quantized against (``Q(message - shift)``, the subtraction fused into the
        quantization pass), or ``None``."""
        return None

    def _owner_sent(self, ctx: ReduceContext, seg: Segment, message: Tensor, sent: Quantized) -> None:
        """Called with the owner's re-quantized message (server-side error feedback)."""

    def _received(self, ctx: ReduceContext, seg: Segment, piece: Quantized, out: Tensor) -> None:
        """Write the averaged gradient of ``seg`` into ``out`` from its all-gathered piece (identical on all ranks);
        by default its decoded values."""
        piece.decode(out=out)

    def _exact_mean(self, ctx: ReduceContext, slot: int, piece: Quantized, out: Tensor) -> None:
        """``allgather`` aggregation: write the averaged gradient of a slot into ``out`` from the W messages ``piece``
        (rows in rank order); by default their exact average (:func:`~.quantize.rows_mean`)."""
        rows_mean(piece, out=out)

    def _reduced(self, ctx: ReduceContext) -> None:
        """Called once the averaged result is complete (state updates that needed every segment)."""

    # ------------------------------------------------------------------ protocol
    @property
    def uses_error_feedback(self) -> bool:
        return False

    def prepare(self) -> None:
        """Build or load the compiled CPU kernel (stochastic rounding, decoding, 2/4-bit packing) now.

        The strategy calls this on every rank in its setup, so the build (once per machine) does not stall
        the first backward. Where the kernel cannot be built, it warns once and the torch steps run (the
        same codes and values).
        """
        _native.load()

    def precompute(self, index: int, tensor: Tensor, ctx: ReduceContext) -> Optional[Quantized]:
        """Slot ``index``'s stage-1 message (codes and scales) of ``tensor``, when the compressor encodes its inputs
        as given (it does not override :meth:`_encode_inputs`); else ``None``."""
        if type(self)._encode_inputs is not QuantizedCompressor._encode_inputs:
            return None
        return self._quantize(index, tensor, self.codec(ctx.params[index]), ctx, None)

    def _quantize(
        self, index: int, x: Tensor, codec: SlotCodec, ctx: ReduceContext, shift: Optional[Tensor]
    ) -> Quantized:
        """Slot ``index``'s stage-1 message ``Q(x - shift)``."""
        return self._encode_shifted(x, codec, _generator(ctx, codec, x.device, ctx.slots[index].name), shift)

    def _message(
        self, index: int, x: Tensor, codec: SlotCodec, ctx: ReduceContext, shift: Optional[Tensor]
    ) -> Quantized:
        """What :meth:`precompute` made of slot ``index`` already, else :meth:`_quantize`."""
        early = ctx.precomputed(index)
        return self._quantize(index, x, codec, ctx, shift) if early is None else early

    def aggregation_at(self, world_size: int) -> str:
        """The protocol this compressor runs at ``world_size`` ranks (``"alltoall"`` or ``"allgather"``)."""
        return resolve_aggregation(self.aggregation, world_size)

    def layout(self, ctx: ReduceContext, numels: Sequence[int], codecs: Sequence[SlotCodec], parts: int) -> WireLayout:
        """The (cached) wire layout of a bucket."""
        names = tuple(slot.name for slot in ctx.slots)
        key = (names, tuple(numels), tuple(codecs), parts)
        if key not in self._layouts:
            self._layouts[key] = build_layout(numels, codecs, parts, names)
        return self._layouts[key]

    def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
        """Quantize, exchange (all-to-all + all-gather, or one all-gather), decode; see the module docstring."""
        codecs = [self.codec(p) for p in ctx.params]
        numels = [t.numel() for t in tensors]
        inputs, shifts = self._encode_inputs(tensors, ctx)
        messages = [
            self._message(i, x, c, ctx, None if shifts is None else shifts[i])
            for i, (x, c) in enumerate(zip(inputs, codecs))
        ]
        residuals, local = self._after_encode(tensors, DecodedMessages(messages), ctx)
        shares = ctx.shares([n * c.bits + 32 * num_groups(n, c.group_size) for n, c in zip(numels, codecs)])
        # the bucket's slices when the engine offers them (the inputs are read only in stage 1), else new tensors
        out = (
            list(ctx.outputs)
            if ctx.outputs is not None
            else [t.new_empty(n, dtype=torch.float32) for t, n in zip(tensors, numels)]
        )
        if self.aggregation_at(ctx.world_size) == "allgather" or ctx.world_size == 1:
            averaged = self._reduce_allgather(messages, numels, codecs, ctx, shares, out)
        else:
            averaged = self._reduce_alltoall(messages, numels, codecs, ctx, shares, out)
        self._reduced(ctx)
        return Reduction(averaged=completed_future(averaged), residuals=residuals, local=local)

    def _reduce_allgather(
        self,
        messages: list[Quantized],
        numels: list[int],
        codecs: list[SlotCodec],
        ctx: ReduceContext,
        shares: list[tuple[str, int]],
        out: list[Tensor],
    ) -> list[Tensor]:
        layout = self.layout(ctx, numels, codecs, 1)
        device = messages[0].codes.device
        gathered = ctx.comm.all_gather(layout.pack(0, messages, device, whole_slots=True), shares=shares)
        for seg, piece in zip(layout.chunks[0].segments, layout.unpack(0, gathered, packed=True)):
            self._exact_mean(ctx, seg.slot, piece, out[seg.slot][seg.start : seg.end])
        return out

    def _reduce_alltoall(
        self,
        messages: list[Quantized],
        numels: list[int],
        codecs: list[SlotCodec],
        ctx: ReduceContext,
        shares: list[tuple[str, int]],
        out: list[Tensor],
    ) -> list[Tensor]:
        world, rank = ctx.world_size, ctx.rank
        layout = self.layout(ctx, numels, codecs, world)
        size = layout.payload_nbytes
        device = messages[0].codes.device
        send = torch.empty(world, size, dtype=torch.uint8, device=device)
        for j in range(world):
            layout.pack(j, messages, device, whole_slots=True, out=send[j])
        send = send.view(-1)
        recv = torch.empty_like(send)
        ctx.comm.all_to_all(recv, send, shares=shares)

        replies = []
        for seg, piece in zip(layout.chunks[rank].segments, layout.unpack(rank, recv.view(world, size), packed=True)):
            message = self._owner_message(ctx, seg, rows_mean(piece))
            codec = codecs[seg.slot]
            owner_stream = _generator(ctx, codec, message.device, ctx.slots[seg.slot].name + "/owner")
            sent = self._encode_shifted(message, codec, owner_stream, self._owner_shift(ctx, seg))
            self._owner_sent(ctx, seg, message, sent)
            replies.append(sent)
        gathered = ctx.comm.all_gather(layout.pack(rank, replies, device), shares=shares)

        for j in range(world):
            for seg, piece in zip(layout.chunks[j].segments, layout.unpack(j, gathered[j], packed=True)):
                self._received(ctx, seg, piece, out[seg.slot][seg.start : seg.end])
        return out

    def extra_repr(self) -> str:
        return "" if self.aggregation == "auto" else f"aggregation={self.aggregation!r}"
