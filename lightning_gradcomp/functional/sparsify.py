"""Sparsification math: how many elements to keep, which ones, and scattering them back."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["kept_count", "scatter_dense", "stratified_indices", "topk_indices"]


def kept_count(numel: int, ratio: float) -> int:
    """Elements kept at ``ratio`` of ``numel``: ``round(ratio * numel)`` clipped to ``[1, numel]``."""
    return max(1, min(numel, int(round(ratio * numel))))


def topk_indices(x: Tensor, k: int) -> Tensor:
    """Indices (int64, unsorted) of the ``k`` largest ``|x|`` of a flat tensor (exact)."""
    if k >= x.numel():
        return torch.arange(x.numel(), device=x.device)
    return torch.topk(x.abs(), k, sorted=False).indices


def stratified_indices(numel: int, k: int, generator: torch.Generator,
                       device: torch.device) -> tuple[Tensor, Tensor]:
    """One uniform index in each of ``k`` near-equal blocks of ``[0, numel)``: O(k) work, not O(numel).

    Every element of a block of size ``b`` is chosen with probability ``1/b`` (``= k/numel`` when ``k``
    divides ``numel``), so scaling a kept value by its block size gives an unbiased estimate.

    Returns:
        ``(indices, block_sizes)``: int64 indices, sorted and distinct, and the size of each one's block.
    """
    k = min(k, numel)
    bounds = torch.div(torch.arange(k + 1, dtype=torch.int64) * numel, k, rounding_mode="floor")
    sizes = bounds[1:] - bounds[:-1]
    offsets = (torch.rand(k, generator=generator, device=generator.device, dtype=torch.float64).cpu()
               * sizes).long().clamp_max_(sizes - 1)
    return (bounds[:-1] + offsets).to(device), sizes.to(device)


def scatter_dense(numel: int, indices: Tensor, values: Tensor) -> Tensor:
    """A zero fp32 vector of ``numel`` elements with ``values`` added at ``indices`` (duplicates add)."""
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    out.index_add_(0, indices.long(), values.to(torch.float32))
    return out
