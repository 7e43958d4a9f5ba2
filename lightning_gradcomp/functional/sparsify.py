"""Sparsification math: how many elements to keep, which ones, and scattering them back."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["kept_count", "scatter_dense", "stratified_indices", "topk_indices"]


def kept_count(numel: int, ratio: float) -> int:
    """Elements kept at ``ratio`` of ``numel``: ``round(ratio * numel)`` clipped to ``[1, numel]``.

    Example::

        >>> kept_count(1000, 0.01), kept_count(10, 0.001), kept_count(10, 2.0)
        (10, 1, 10)
    """
    return max(1, min(numel, int(round(ratio * numel))))


FILTER_MIN_NUMEL = 32768
"""Smallest tensor for which :func:`topk_indices` filters candidates before ``torch.topk``."""


def topk_indices(x: Tensor, k: int) -> Tensor:
    """Indices (int64, unsorted) of the ``k`` largest ``|x|`` of a flat tensor: the set ``torch.topk`` selects.

    ``torch.topk`` over a whole large layer costs 30-60 copies' time on CPU. For tensors of at least
    :data:`FILTER_MIN_NUMEL` elements (and ``k <= n / 8``) a threshold ``t`` is read from a strided sample of
    ``|x|`` (about 4096 entries, deterministic) so that about ``1.5 k`` entries are expected at or above it; the
    entries ``|x| >= t`` are gathered in one pass, and ``torch.topk`` runs on those candidates only. The
    top-``k`` set lies among the candidates whenever there are at least ``k`` of them (the ``k``-th largest
    value is then ``>= t``), so the result is exact; with fewer (a sample far from typical) it falls back to
    ``torch.topk`` on the whole tensor. Ties at the ``k``-th value may resolve to other indices than a plain
    ``torch.topk`` (any choice among equal magnitudes is a top-``k`` set); the result is deterministic.

    Example::

        >>> topk_indices(torch.tensor([0.5, -3.0, 1.0, 2.0]), 2).sort().values.tolist()  # unsorted: sort to compare
        [1, 3]
    """
    n = x.numel()
    if k >= n:
        return torch.arange(n, device=x.device)
    magnitudes = x.abs()
    if n < FILTER_MIN_NUMEL or 8 * k > n:
        return torch.topk(magnitudes, k, sorted=False).indices
    sample = magnitudes[:: max(1, n // 4096)]
    rank = min(sample.numel(), math.ceil(1.5 * k * sample.numel() / n) + 8)
    threshold = torch.topk(sample, rank, sorted=False).values.min()
    candidates = (magnitudes >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return torch.topk(magnitudes, k, sorted=False).indices
    chosen = torch.topk(magnitudes.index_select(0, candidates), k, sorted=False).indices
    return candidates.index_select(0, chosen)


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
    k = min(k, numel)
    bounds = torch.div(torch.arange(k + 1, dtype=torch.int64) * numel, k, rounding_mode="floor")
    sizes = bounds[1:] - bounds[:-1]
    offsets = (
        (torch.rand(k, generator=generator, device=generator.device, dtype=torch.float64).cpu() * sizes)
        .long()
        .clamp_max_(sizes - 1)
    )
    return (bounds[:-1] + offsets).to(device), sizes.to(device)


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
