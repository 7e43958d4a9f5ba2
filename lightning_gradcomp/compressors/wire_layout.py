"""The wire format of the quantizing compressors (:mod:`.quantized`): how each slot is encoded (:class:`SlotCodec`),
how a bucket's slots are cut into W chunks of whole groups (:func:`build_layout`), how a chunk's codes and scales are
packed into one payload and parsed back (:class:`WireLayout`), and the bytes one rank sends (:func:`wire_bytes`)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors.quantized_arguments import resolve_aggregation
from lightning_gradcomp.functional import _native
from lightning_gradcomp.functional.dequantize import Quantized
from lightning_gradcomp.functional.packing import pack_bits, packed_nbytes, unpack_bits
from lightning_gradcomp.functional.quantization_groups import code_bits, num_groups
from lightning_gradcomp.functional.scaled_sign import sign_quantize
from lightning_gradcomp.functional.stochastic_rounding import stochastic_quantize

__all__ = [
    "ChunkLayout",
    "Segment",
    "SlotCodec",
    "WireLayout",
    "build_layout",
    "layer_rotation",
    "split_groups",
    "wire_bytes",
]

_SCALE_BYTES = 4


@dataclass(frozen=True)
class SlotCodec:
    """How one slot is encoded.

    Attributes:
        levels: ``L >= 1`` stochastic levels per sign, or 0 for scaled sign.
        group_size: elements per fp32 scale.
        p: norm of the scale for stochastic rounding (2 or inf).
    """

    levels: int
    group_size: int
    p: float = float("inf")

    @property
    def bits(self) -> int:
        """Bits per element on the wire."""
        return code_bits(self.levels)

    def quantize(self, x: Tensor, generator: Optional[torch.Generator], minus: Optional[Tensor] = None) -> Quantized:
        """Encode a flat tensor, or ``x - minus`` (``generator`` is unused by scaled sign)."""
        if self.levels == 0:
            return sign_quantize(x if minus is None else x - minus, self.group_size)
        assert generator is not None
        return stochastic_quantize(x, self.levels, self.group_size, self.p, generator, minus=minus)


@dataclass(frozen=True)
class Segment:
    """A contiguous, group-aligned piece ``[start, end)`` of slot ``slot`` (groups ``[group_start, group_end)``)."""

    slot: int
    start: int
    end: int
    group_start: int
    group_end: int

    @property
    def numel(self) -> int:
        """Elements in the segment."""
        return self.end - self.start


@dataclass(frozen=True)
class ChunkLayout:
    """The payload of one chunk: byte-aligned runs of packed codes (equal bits), then fp32 scales.

    Attributes:
        segments: the slot pieces, in order.
        runs: ``(bits, first segment, end segment, byte offset, numel)`` of each run of equal-bit segments.
        scale_offset: byte offset of the scales.
        num_scales: number of fp32 scales.
    """

    segments: tuple[Segment, ...]
    runs: tuple[tuple[int, int, int, int, int], ...]
    scale_offset: int
    num_scales: int

    @property
    def nbytes(self) -> int:
        """Unpadded payload size in bytes."""
        return self.scale_offset + _SCALE_BYTES * self.num_scales


@dataclass(frozen=True)
class WireLayout:
    """How the concatenated compressed slots map to W (or 1) chunk payloads of ``payload_nbytes`` bytes."""

    codecs: tuple[SlotCodec, ...]
    numels: tuple[int, ...]
    chunks: tuple[ChunkLayout, ...]

    @property
    def payload_nbytes(self) -> int:
        """Padded size of one chunk's payload (the largest chunk)."""
        return max((c.nbytes for c in self.chunks), default=0)

    def pack(
        self,
        index: int,
        pieces: Sequence[Quantized],
        device: torch.device,
        *,
        whole_slots: bool = False,
        out: Optional[Tensor] = None,
    ) -> Tensor:
        """Serialize chunk ``index`` into ``payload_nbytes`` bytes on ``device``.

        On the CPU with the compiled kernel, each segment's codes (1, 2, 4 or 8 bits) are packed straight into their
        place in the payload (``out`` when given: a contiguous ``uint8`` row of ``payload_nbytes``, e.g. one row of an
        all-to-all's send buffer); otherwise each run is concatenated, packed and the parts joined (the same bytes).

        Args:
            index: the chunk.
            pieces: one :class:`Quantized` per segment of the chunk, or (``whole_slots``) one per slot.
            device: where the payload lives (also when the chunk is empty).
            whole_slots: slice each segment out of its slot's encoding.
            out: where to write the payload (returned).
        """
        chunk = self.chunks[index]
        if out is not None and (
            out.dtype != torch.uint8 or out.shape != (self.payload_nbytes,) or not out.is_contiguous()
        ):
            raise ValueError(
                f"`out` must be a contiguous uint8 tensor of shape ({self.payload_nbytes},), "
                f"got {out.dtype} {tuple(out.shape)}"
            )
        if whole_slots:
            pieces = [
                Quantized(
                    pieces[s.slot].codes[s.start : s.end],
                    pieces[s.slot].scales[s.group_start : s.group_end],
                    pieces[s.slot].levels,
                    pieces[s.slot].group_size,
                )
                for s in chunk.segments
            ]
        kernel = _native.load() if device.type == "cpu" else None
        if kernel is None or any(8 % run[0] for run in chunk.runs):  # 3, 5, 6 and 7 bits: through a bit stream
            payload = self._joined(chunk, pieces, device)
            return payload if out is None else out.copy_(payload)
        payload = torch.zeros(self.payload_nbytes, dtype=torch.uint8) if out is None else out.zero_()
        base = payload.data_ptr()
        for bits, first, last, offset, _ in chunk.runs:
            pos = 0
            for q in pieces[first:last]:  # quantizer codes: in range by construction
                codes = q.unpacked().codes.contiguous()
                kernel.pack_into(codes.data_ptr(), codes.numel(), bits, base + offset, pos)
                pos += codes.numel()
        if chunk.segments:
            scales = _scale_bytes(pieces)
            payload[chunk.scale_offset : chunk.scale_offset + scales.numel()].copy_(scales)
        return payload

    def _joined(self, chunk: ChunkLayout, pieces: Sequence[Quantized], device: torch.device) -> Tensor:
        """:meth:`pack` by torch steps: each run concatenated and packed, then the scales and the padding."""
        parts = []
        for bits, first, last, _, _ in chunk.runs:
            codes = torch.cat([pieces[k].unpacked().codes for k in range(first, last)])
            parts.append(pack_bits(codes, bits, check=False))  # quantizer codes: in range by construction
        if chunk.segments:
            parts.append(_scale_bytes(pieces))
        pad = self.payload_nbytes - chunk.nbytes
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)

    def unpack(self, index: int, payload: Tensor, *, packed: bool = False) -> list[Quantized]:
        """Parse chunk ``index`` from ``payload`` of shape ``(..., payload_nbytes)``: one entry per segment.

        ``packed``: leave the codes bit-packed in ``payload`` (views, ``Quantized.numel`` set) where they decode
        straight from there (1, 2 and 4 bits); otherwise each run of codes is unpacked into one byte per code.
        """
        chunk = self.chunks[index]
        lead = payload.shape[:-1]
        start = chunk.scale_offset
        # The scales sit at any byte offset of a payload of any byte size (a row stride that is not a multiple
        # of 4, or an empty chunk), so byte views of the payload cannot be reinterpreted as fp32: copy the
        # bytes into fresh fp32 storage instead.
        scales = payload.new_empty((*lead, chunk.num_scales), dtype=torch.float32)
        scales.view(torch.uint8).copy_(payload[..., start : start + _SCALE_BYTES * chunk.num_scales])
        out: list[Quantized] = []
        g = 0
        for bits, first, last, offset, numel in chunk.runs:
            run = payload[..., offset : offset + packed_nbytes(numel, bits)]
            keep = packed and bits in (1, 2, 4)
            codes = run if keep else unpack_bits(run, bits, numel)
            pos = 0
            for seg in chunk.segments[first:last]:
                codec = self.codecs[seg.slot]
                ng = seg.group_end - seg.group_start
                piece_scales = scales[..., g : g + ng]
                if keep:
                    piece = Quantized(codes, piece_scales, codec.levels, codec.group_size, seg.numel, pos)
                else:
                    piece = Quantized(codes[..., pos : pos + seg.numel], piece_scales, codec.levels, codec.group_size)
                out.append(piece)
                pos += seg.numel
                g += ng
        return out


def _scale_bytes(pieces: Sequence[Quantized]) -> Tensor:
    """The fp32 scales of ``pieces``, concatenated, as the bytes a payload carries them in."""
    return torch.cat([q.scales.to(torch.float32) for q in pieces]).view(torch.uint8)


def layer_rotation(name: str, parts: int) -> int:
    """First chunk that receives one of layer ``name``'s leftover groups (a stable hash of the name)."""
    return zlib.crc32(name.encode()) % parts


def split_groups(groups: int, parts: int, rotation: int) -> list[int]:
    """Groups of one layer per chunk: ``groups // parts`` each, the remainder one each from ``rotation`` on."""
    base, extra = divmod(groups, parts)
    sizes = [base] * parts
    for k in range(extra):
        sizes[(rotation + k) % parts] += 1
    return sizes


def build_layout(
    numels: Sequence[int], codecs: Sequence[SlotCodec], parts: int, names: Optional[Sequence[str]] = None
) -> WireLayout:
    """Cut every layer into ``parts`` contiguous pieces of whole groups; chunk ``j`` holds piece ``j`` of each.

    A layer's pieces depend only on its size, codec, name and ``parts``, never on the other layers of
    the bucket, so chunk ownership (and the owners' per-layer state) survives DDP's re-bucketing. The
    ``G mod parts`` leftover groups of a layer go to chunks ``rotation, rotation + 1, ...`` with a
    rotation hashed from the layer name, so chunk payloads differ by about ``sqrt(#layers)`` groups.
    """
    names = list(names) if names is not None else [f"slot{i}" for i in range(len(numels))]
    pieces: list[list[Segment]] = [[] for _ in range(parts)]
    for i, (n, codec, name) in enumerate(zip(numels, codecs, names)):
        first = 0
        for j, size in enumerate(split_groups(num_groups(n, codec.group_size), parts, layer_rotation(name, parts))):
            if size:
                last = first + size
                pieces[j].append(Segment(i, first * codec.group_size, min(last * codec.group_size, n), first, last))
                first = last
    chunks = tuple(_chunk(segments, codecs) for segments in pieces)
    return WireLayout(tuple(codecs), tuple(int(n) for n in numels), chunks)


def _chunk(segments: list[Segment], codecs: Sequence[SlotCodec]) -> ChunkLayout:
    runs = []
    offset = 0
    k = 0
    while k < len(segments):
        bits = codecs[segments[k].slot].bits
        end = k
        numel = 0
        while end < len(segments) and codecs[segments[end].slot].bits == bits:
            numel += segments[end].numel
            end += 1
        runs.append((bits, k, end, offset, numel))
        offset += packed_nbytes(numel, bits)
        k = end
    return ChunkLayout(tuple(segments), tuple(runs), offset, sum(s.group_end - s.group_start for s in segments))


def wire_bytes(
    numels: Sequence[int],
    codecs: Sequence[SlotCodec],
    world_size: int,
    aggregation: str,
    names: Optional[Sequence[str]] = None,
) -> float:
    """Exact bytes one rank sends for one reduction (what :class:`~lightning_gradcomp.comm.Comm` counts).

    ``alltoall``: ``2 (W - 1) P`` with ``P`` the padded chunk payload; ``allgather``: ``(W - 1) P_1`` with
    ``P_1`` the whole message; ``auto`` as :func:`resolve_aggregation` resolves it. ``names`` are the layer names
    (they set where leftover groups go).
    """
    aggregation = resolve_aggregation(aggregation, world_size)
    parts = world_size if aggregation == "alltoall" else 1
    payload = build_layout(numels, codecs, parts, names).payload_nbytes
    return float((world_size - 1) * payload * (2 if aggregation == "alltoall" else 1))
