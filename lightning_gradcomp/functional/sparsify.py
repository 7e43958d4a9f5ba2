"""Sparsification math: how many elements to keep, which ones, and scattering them back."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.functional import _native
from lightning_gradcomp.functional.sampling import systematic_stride as systematic_stride  # moved: sampling
from lightning_gradcomp.functional.selection import FILTER_MIN_NUMEL as FILTER_MIN_NUMEL  # moved: top-k selection
from lightning_gradcomp.functional.selection import topk_indices as topk_indices

__all__ = [
    "decode_delta16",
    "decode_delta16_layers",
    "decode_int32_indices",
    "delta16_capacity",
    "encode_delta16",
    "encode_delta16_layers",
    "encode_int32_indices",
    "int32_index_words",
    "kept_count",
    "packed_positions",
    "repeated_offsets",
    "scatter_dense",
    "stratified_indices",
    "stratified_layers",
]


def kept_count(numel: int, density: float) -> int:
    """Elements kept at ``density`` of ``numel``: ``round(density * numel)`` clipped to ``[1, numel]``.

    Example::

        >>> kept_count(1000, 0.01), kept_count(10, 0.001), kept_count(10, 2.0)
        (10, 1, 10)
    """
    return max(1, min(numel, int(round(density * numel))))


def stratified_indices(numel: int, k: int, generator: torch.Generator, device: torch.device) -> tuple[Tensor, Tensor]:
    """One uniform index in each of ``k`` near-equal blocks of ``[0, numel)``: O(k) work, not O(numel).

    Every element of a block of size ``b`` is chosen with probability ``1/b`` (``= k/numel`` when ``k``
    divides ``numel``), so scaling a kept value by its block size gives an unbiased estimate.

    Returns:
        ``(indices, block_sizes)``: int64 indices, sorted and distinct, and the size of each one's block.

    Example::

        >>> indices, sizes = stratified_indices(10, 3, torch.Generator().manual_seed(0), torch.device("cpu"))
        >>> sizes.tolist()  # blocks [0, 3), [3, 6) and [6, 10)
        [3, 3, 4]
        >>> bool((indices >= torch.tensor([0, 3, 6])).all() and (indices < torch.tensor([3, 6, 10])).all())
        True
    """
    return stratified_layers([numel], [k], [generator], device)


def stratified_layers(
    numels: Sequence[int], ks: Sequence[int], generators: Sequence[torch.Generator], device: torch.device
) -> tuple[Tensor, Tensor]:
    """:func:`stratified_indices` of several layers at once: layer ``l`` draws its ``min(ks[l], numels[l])``
    uniforms from ``generators[l]`` (the same draws, so the same indices, as one call per layer), and the rest is a
    handful of vectorized steps over all layers together.

    Returns:
        ``(indices, block_sizes)``, the layers' one after the other: indices within each layer (int64, sorted and
        distinct per layer) and the size of each one's block.

    Example::

        >>> gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
        >>> indices, sizes = stratified_layers([10, 4], [3, 2], gens, torch.device("cpu"))
        >>> sizes.tolist()
        [3, 3, 4, 2, 2]
        >>> alone, _ = stratified_indices(10, 3, torch.Generator().manual_seed(0), torch.device("cpu"))
        >>> torch.equal(indices[:3], alone)
        True
    """
    starts, sizes, limits = _strata(tuple(numels), tuple(ks))
    draws = [
        torch.rand(min(k, n), generator=g, device=g.device, dtype=torch.float64)
        for n, k, g in zip(numels, ks, generators)
    ]
    uniforms = torch.cat(draws) if len(draws) > 1 else draws[0]
    on = uniforms.device  # the draws' device: the strata go there (a copy to it), the draws never to the host
    offsets = (uniforms * sizes.to(on)).long().clamp_max_(limits.to(on))
    return (starts.to(on) + offsets).to(device), sizes.to(device, copy=True)


@functools.lru_cache(maxsize=256)
def _strata(numels: tuple[int, ...], ks: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """Per block of :func:`stratified_layers`: its first index within its layer, its size, its size minus one (CPU
    int64, concatenated over the layers; cached, never modified)."""
    starts, sizes = [], []
    for numel, k in zip(numels, ks):
        k = min(k, numel)
        if k <= 0:  # nothing kept: no block
            starts.append(torch.zeros(0, dtype=torch.int64))
            sizes.append(torch.zeros(0, dtype=torch.int64))
            continue
        bounds = torch.div(torch.arange(k + 1, dtype=torch.int64) * numel, k, rounding_mode="floor")
        starts.append(bounds[:-1])
        sizes.append(bounds[1:] - bounds[:-1])
    size = torch.cat(sizes)
    return torch.cat(starts), size, size - 1


@functools.lru_cache(maxsize=256)
def repeated_offsets(
    offsets: tuple[int, ...], counts: tuple[int, ...], device: Optional[torch.device] = None
) -> Tensor:
    """``offsets[l]`` repeated ``counts[l]`` times (int64 on ``device``, the CPU by default; cached per device, so a
    GPU bucket copies it to the device once: never modify it). Added to the concatenated per-layer indices of several
    layers, it turns them into positions in one window over all of them
    (:func:`~lightning_gradcomp.functional.slot_views.storage_window`).

    Example::

        >>> repeated_offsets((0, 10), (2, 3)).tolist()
        [0, 0, 10, 10, 10]
    """
    flat = torch.repeat_interleave(torch.tensor(offsets, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64))
    return flat if device is None else flat.to(device)


def packed_positions(counts: Sequence[int], slots: Sequence[int], device: Optional[torch.device] = None) -> Tensor:
    """Where ``counts[l]`` entries go when each fills the start of its layer's slot of ``slots[l]`` entries, the
    slots back to back (int64 on ``device``): ``slots[0] + ... + slots[l-1] + j`` for the ``j``-th of layer ``l``.

    Example::

        >>> packed_positions([2, 3, 1], [4, 5, 1]).tolist()
        [0, 1, 4, 5, 6, 9]
    """
    shift = tuple(s - c for s, c in zip(_starts(slots), _starts(counts)))
    return torch.arange(sum(counts), device=device) + repeated_offsets(shift, tuple(counts), device)


def scatter_dense(numel: int, indices: Tensor, values: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """A zero fp32 vector of ``numel`` elements with ``values`` added at ``indices`` (duplicates add); added into
    ``out`` instead when given (a zeroed fp32 tensor of ``numel`` elements, e.g. ``ReduceContext.output``).

    Example::

        >>> scatter_dense(5, torch.tensor([0, 3, 3]), torch.tensor([1.0, 2.0, 0.5])).tolist()
        [1.0, 0.0, 0.0, 2.5, 0.0]
    """
    if out is None:
        out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    out.index_add_(0, indices.long(), values.to(torch.float32))
    return out


INT32_INDEX_LIMIT = 2**31
"""Most elements a layer may have for each of its indices to travel as one int32 (positions up to ``2**31 - 1``)."""


def int32_index_words(numel: int) -> int:
    """int32 words per index of a ``numel``-element layer under the int32 index coding: 1, or 2 (the int64 index as its
    low and high halves) above :data:`INT32_INDEX_LIMIT` elements, where one int32 cannot hold every position.

    Example::

        >>> int32_index_words(2**31), int32_index_words(2**31 + 1)
        (1, 2)
    """
    return 1 if numel <= INT32_INDEX_LIMIT else 2


def encode_int32_indices(indices: Tensor, numel: int, capacity: Optional[int] = None) -> Tensor:
    """A ``numel``-element layer's int64 indices as int32 words (:func:`int32_index_words` per index), padded with
    ``-1`` indices up to ``capacity`` indices (``None``: no padding).

    Example::

        >>> encode_int32_indices(torch.tensor([3, 2**32 + 5]), 2**33, capacity=3).tolist()
        [3, 0, 5, 1, -1, -1]
    """
    count = indices.numel() if capacity is None else capacity
    if count < indices.numel():
        raise ValueError(f"`capacity` must be at least the {indices.numel()} indices, got {capacity}")
    if int32_index_words(numel) == 1:
        out = indices.to(torch.int32)
        return out if count == indices.numel() else torch.cat([out, out.new_full((count - out.numel(),), -1)])
    wide = torch.full((count,), -1, dtype=torch.int64, device=indices.device)
    wide[: indices.numel()] = indices
    low = ((wide & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000  # the low half as a signed 32-bit value
    return torch.stack([low, wide >> 32], dim=1).reshape(-1).to(torch.int32)


def decode_int32_indices(codes: Tensor, numel: int) -> Tensor:
    """Inverse of :func:`encode_int32_indices`: the int64 indices, padding included (``-1``).

    Example::

        >>> decode_int32_indices(torch.tensor([3, 0, 5, 1, -1, -1], dtype=torch.int32), 2**33).tolist()
        [3, 4294967301, -1]
    """
    if int32_index_words(numel) == 1:
        return codes.to(torch.int64)
    pairs = codes.to(torch.int64).reshape(-1, 2)
    return (pairs[:, 0] & 0xFFFFFFFF) | (pairs[:, 1] << 32)


DELTA16_ESCAPE = 65535
"""A delta16 code 0 advances the position by this much without keeping an entry."""


def delta16_capacity(numel: int, k: int) -> int:
    """Codes reserved for ``k`` sorted indices of a ``numel``-element layer: ``k + (numel - 1) // 65535`` (enough
    for any ``k`` indices, so every rank knows the size).

    Example::

        >>> delta16_capacity(1000, 10), delta16_capacity(262144, 2621)
        (10, 2625)
    """
    return k + max(numel - 1, 0) // DELTA16_ESCAPE  # an empty layer: 0


def encode_delta16(indices: Tensor, capacity: int) -> Tensor:
    """Sorted distinct indices -> ``capacity`` uint16 codes (gaps; 0 = advance 65535; zero padding).

    Example::

        >>> encode_delta16(torch.tensor([0, 4, 5]), delta16_capacity(10, 3)).to(torch.int32).tolist()
        [1, 4, 1]
    """
    return encode_delta16_layers([indices], [capacity])


def decode_delta16(codes: Tensor) -> Tensor:
    """Inverse of :func:`encode_delta16`: the sorted int64 indices.

    Example::

        >>> codes = encode_delta16(torch.tensor([2, 70000]), delta16_capacity(100000, 2))
        >>> codes.to(torch.int32).tolist(), decode_delta16(codes).tolist()
        ([3, 0, 4463], [2, 70000])
    """
    return decode_delta16_layers(codes, [codes.numel()])


def encode_delta16_layers(indices: Sequence[Tensor], capacities: Sequence[int]) -> Tensor:
    """:func:`encode_delta16` of several layers at once: their codes back to back, layer ``l`` in ``capacities[l]``
    codes. One pass over all the indices, whatever the number of layers (the compiled kernel on the CPU, else
    vectorized torch steps: the same codes). Raises ``ValueError`` (kernel) for indices that are not sorted and distinct
    within a layer.

    Example::

        >>> encode_delta16_layers([torch.tensor([0, 4]), torch.tensor([2])], [2, 1]).to(torch.int32).tolist()
        [1, 4, 3]
    """
    _check_capacities(capacities, len(indices))
    device = indices[0].device if indices else torch.device("cpu")
    ks: list[int] = [i.numel() for i in indices]
    kernel = _native.load() if device.type == "cpu" and sum(ks) > 0 else None
    if kernel is not None:  # one pass in the compiled kernel: the same codes
        flat = torch.cat([i.reshape(-1) for i in indices]).to(torch.int64)
        sizes = torch.tensor([ks, list(capacities)], dtype=torch.int64)
        codes = torch.empty(sum(capacities), dtype=torch.uint16)
        if not kernel.delta16_encode(
            flat.data_ptr(), sizes[0].data_ptr(), sizes[1].data_ptr(), len(ks), codes.data_ptr()
        ):
            raise ValueError("`indices` must be sorted and distinct within each layer, and fit its `capacities`")
        return codes
    codes = torch.zeros(sum(capacities), dtype=torch.int32, device=device)
    if not sum(ks):
        return codes.to(torch.uint16)
    flat = torch.cat(list(indices))
    starts = _starts(ks)  # each layer's first entry
    previous = torch.cat([flat.new_full((1,), -1), flat[:-1]])
    previous[torch.tensor([s for s, k in zip(starts, ks) if k], device=device)] = -1  # a layer's gaps count from -1
    gaps = flat - previous  # >= 1
    escapes = (gaps - 1) // DELTA16_ESCAPE
    advance = torch.cumsum(escapes + 1, 0)  # codes used so far, over all layers
    before = torch.cat([advance.new_zeros(1), advance])[torch.tensor(starts, device=device)]
    offsets = torch.tensor(_starts(capacities), device=device)  # each layer's first code
    shift = torch.repeat_interleave(offsets - before, torch.tensor(ks, device=device), output_size=flat.numel())
    codes[advance - 1 + shift] = (gaps - escapes * DELTA16_ESCAPE).to(torch.int32)  # in [1, 65535]
    return codes.to(torch.uint16)


def decode_delta16_layers(codes: Tensor, capacities: Sequence[int]) -> Tensor:
    """Inverse of :func:`encode_delta16_layers`: every layer's sorted int64 indices, back to back (split them by the
    layers' kept counts). One pass, as the encoding.

    Example::

        >>> codes = encode_delta16_layers([torch.tensor([0, 4]), torch.tensor([2])], [2, 1])
        >>> decode_delta16_layers(codes, [2, 1]).tolist()
        [0, 4, 2]
    """
    _check_capacities(capacities)
    if sum(capacities) != codes.numel():
        raise ValueError(f"`capacities` must add up to the number of codes ({codes.numel()}), got {list(capacities)}")
    kernel = _native.load() if codes.device.type == "cpu" and codes.dtype == torch.uint16 and codes.numel() else None
    if kernel is not None:  # one pass in the compiled kernel: the same indices
        flat = codes.reshape(-1).contiguous()
        sizes = torch.tensor(list(capacities), dtype=torch.int64)
        out = torch.empty(flat.numel(), dtype=torch.int64)
        found = kernel.delta16_decode(flat.data_ptr(), sizes.data_ptr(), len(capacities), out.data_ptr(), out.numel())
        if found < 0:
            raise ValueError("`codes` decode to more indices than they hold")
        return out[:found]
    c = codes.to(torch.int64)
    positions = torch.cumsum(torch.where(c == 0, DELTA16_ESCAPE, c), 0)  # over all layers
    if len(capacities) > 1:  # each layer counts from its own first code
        starts = torch.tensor(_starts(capacities), device=c.device)
        before = torch.cat([positions.new_zeros(1), positions])[starts]
        counts = torch.tensor(list(capacities), device=c.device)
        positions = positions - torch.repeat_interleave(before, counts, output_size=c.numel())
    return (positions - 1)[c != 0]


def _check_capacities(capacities: Sequence[int], layers: Optional[int] = None) -> None:
    """Raise ``ValueError`` unless ``capacities`` are integers >= 0 (``layers`` of them, when given)."""
    if layers is not None and len(capacities) != layers:
        raise ValueError(f"`capacities` must give one count per layer ({layers}), got {len(capacities)}")
    if any(not isinstance(c, int) or c < 0 for c in capacities):
        raise ValueError(f"`capacities` must be integers >= 0, got {list(capacities)}")


def _starts(sizes: Sequence[int]) -> list[int]:
    """Where each of consecutive pieces of ``sizes`` begins (exclusive prefix sums)."""
    return [0, *itertools.accumulate(sizes)][: len(sizes)]
