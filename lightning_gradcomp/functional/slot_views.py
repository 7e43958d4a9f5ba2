"""Views over the slots of a bucket: split a flat tensor into slots, and one view covering slices of one storage
(back to back: :func:`contiguous_span`; with gaps: :func:`storage_window`), so a compressor reads, writes, gathers or
scatters all of a bucket's slots in one call instead of one per slot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

__all__ = ["contiguous_span", "split_flat", "storage_window"]


def split_flat(flat: Tensor, counts: Sequence[int]) -> list[Tensor]:
    """Split a 1-D tensor into consecutive pieces of ``counts`` elements (views).

    Example::

        >>> [piece.tolist() for piece in split_flat(torch.arange(5.0), [2, 0, 3])]
        [[0.0, 1.0], [], [2.0, 3.0, 4.0]]
    """
    return list(torch.split(flat, list(counts)))


def contiguous_span(tensors: Sequence[Tensor]) -> Optional[Tensor]:
    """One 1-D view covering ``tensors`` when they lie back to back in one storage (the slots of a bucket), else
    ``None``; a compressor then reads or writes them all without a concatenated copy.

    Example::

        >>> buf = torch.arange(6.0)
        >>> contiguous_span([buf[0:2], buf[2:5]]).tolist(), contiguous_span([buf[0:2], buf[3:5]])
        ([0.0, 1.0, 2.0, 3.0, 4.0], None)
    """
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        if (
            t.dim() != 1
            or t.dtype != first.dtype
            or (t.numel() > 1 and t.stride(0) != 1)
            or t.storage_offset() != offset
            or t.untyped_storage().data_ptr() != storage
        ):
            return None
        offset += t.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


def storage_window(tensors: Sequence[Tensor]) -> Optional[tuple[Tensor, list[int]]]:
    """``(window, offsets)`` when ``tensors`` are non-overlapping 1-D dense views of one storage with one dtype (the
    slots of a bucket, back to back or not): ``window`` is one 1-D view from the first element of any of them to the
    last, and ``tensors[i]`` is ``window[offsets[i] : offsets[i] + tensors[i].numel()]``. Else ``None``.

    An index op on ``window`` at positions inside the tensors touches nothing between them, so one gather or
    scatter serves all the slots of a bucket instead of one call per slot.

    Example::

        >>> buf = torch.arange(8.0)
        >>> window, offsets = storage_window([buf[1:3], buf[5:8]])
        >>> window.tolist(), offsets
        ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], [0, 4])
        >>> storage_window([buf[0:2], torch.zeros(2)]) is None
        True
    """
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    for t in tensors:
        if (
            t.dim() != 1
            or t.dtype != first.dtype
            or (t.numel() > 1 and t.stride(0) != 1)
            or t.untyped_storage().data_ptr() != storage
        ):
            return None
    offsets = [int(t.storage_offset()) for t in tensors]
    spans = sorted((o, o + t.numel()) for o, t in zip(offsets, tensors))
    if any(nxt[0] < prev[1] for prev, nxt in zip(spans, spans[1:])):  # overlapping views
        return None
    start, end = spans[0][0], max(stop for _, stop in spans)
    return first.as_strided((end - start,), (1,), start), [o - start for o in offsets]
