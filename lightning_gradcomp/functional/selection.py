"""Top-k index selection by magnitude: exact, and approximate (sampled threshold) for speed.

:func:`exact_topk_indices` is ``torch.topk`` on ``|x|``: on CPU it costs many times a memory copy
(about 10x at tens of millions of elements, far more on cache-resident tensors).

:func:`approx_topk_indices` is the fast variant. It estimates the magnitude threshold of the
``k``-th largest entry from a small random sample of ``|x|``, keeps every entry at or above it (one
pass over ``x`` and one over the resulting mask, no sort; on CPU these run in NumPy, several times
faster than ``torch.nonzero``), then corrects the count:

* **Band.** It returns ``c`` indices with ``ceil(lo * k) <= c <= max(k, floor(hi * k))``; the default
  band ``(0.9, 1.1)`` is :data:`APPROX_BAND`. This is guaranteed, not just likely: too many
  candidates are trimmed to the ``k`` largest (a selection over about ``k`` candidates, cheap); too
  few trigger one retry with a lower threshold, then an exact fallback.
* **Which entries.** The kept set is always an exact top-``c`` set (every kept ``|x_i|`` is >= every
  dropped one, up to ties), so only the count ``c`` is approximate.
* **Cost.** The sample holds about ``hits * n / k`` entries (``hits`` of them expected above the
  threshold, default 64). The threshold aims at ``oversample * k`` entries (default 1.25), so a retry
  is rare (0.1 % of calls on Gaussian inputs) and trimming, which is cheap, is the common correction.
  Tensors too small to be worth sampling (sample >= n / 4) use exact selection.

All functions return **sorted** int64 indices (delta coding of indices relies on it).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

__all__ = ["APPROX_BAND", "approx_topk_indices", "band_limits", "exact_topk_indices", "sampled_threshold"]

APPROX_BAND: tuple[float, float] = (0.9, 1.1)
"""Default ``(lo, hi)`` band of the approximate selection's count, as fractions of ``k``."""


def band_limits(k: int, band: tuple[float, float] = APPROX_BAND) -> tuple[int, int]:
    """Smallest and largest count accepted for target ``k``: ``(ceil(lo k), max(k, floor(hi k)))``."""
    lo, hi = band
    if not 0.0 < lo <= 1.0 <= hi:
        raise ValueError(f"`band` must satisfy 0 < lo <= 1 <= hi, got {band!r}")
    return max(1, math.ceil(lo * k - 1e-9)), max(k, math.floor(hi * k + 1e-9))


def exact_topk_indices(x: Tensor, k: int) -> Tensor:
    """Sorted int64 indices of the ``k`` largest ``|x|`` of a flat tensor (``torch.topk``)."""
    if k >= x.numel():
        return torch.arange(x.numel(), device=x.device)
    return torch.topk(x.abs(), k, sorted=False).indices.sort().values


def sampled_threshold(magnitudes: Tensor, count: float, generator: torch.Generator, sample_size: int) -> float:
    """Estimate ``t`` such that about ``count`` entries of ``magnitudes`` are ``>= t``.

    Draws ``sample_size`` entries uniformly with replacement and returns the sample's
    ``ceil(count * sample_size / n)``-th largest value.
    """
    n = magnitudes.numel()
    picks = torch.randint(n, (sample_size,), generator=generator, device=generator.device).to(magnitudes.device)
    sample = magnitudes.index_select(0, picks)
    rank = min(sample_size, max(1, math.ceil(count * sample_size / n)))
    return float(torch.topk(sample, rank, sorted=False).values.min())


def approx_topk_indices(x: Tensor, k: int, generator: torch.Generator, *, band: tuple[float, float] = APPROX_BAND,
                        hits: int = 64, oversample: float = 1.25) -> Tensor:
    """Sorted int64 indices of an exact top-``c`` set of ``|x|`` with ``c`` in the band around ``k``.

    Args:
        x: flat tensor.
        k: target count, ``1 <= k``.
        generator: source of the random sample (the compressor passes ``ctx.generator``).
        band: ``(lo, hi)`` fractions of ``k`` the count must fall in (see :func:`band_limits`).
        hits: expected sampled entries above the threshold (sample size ``hits * n / k``).
        oversample: the threshold aims at ``oversample * k`` entries.

    Returns:
        ``c`` sorted indices, ``band_limits(k, band)[0] <= c <= band_limits(k, band)[1]``.
    """
    n = x.numel()
    lo, hi = band_limits(k, band)
    sample_size = math.ceil(hits * n / max(k, 1))
    if k >= n or 4 * sample_size >= n:
        return exact_topk_indices(x, k)
    magnitudes = x.abs()
    for aim in (oversample * k, 4.0 * oversample * k):  # second pass: the correction for too few
        threshold = sampled_threshold(magnitudes, aim, generator, sample_size)
        idx = _at_least(magnitudes, threshold)
        if idx.numel() > hi:
            return _trim(idx, magnitudes.index_select(0, idx), k, hi)
        if idx.numel() >= lo:
            return idx
    return exact_topk_indices(x, k)


def _at_least(magnitudes: Tensor, threshold: float) -> Tensor:
    """Sorted int64 indices of the entries ``>= threshold``.

    On CPU through NumPy (a zero-copy view), whose compare and ``flatnonzero`` are vectorized: several
    times faster than ``torch.nonzero``. Other devices use torch.
    """
    if magnitudes.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(magnitudes.detach().numpy() >= threshold)).to(torch.int64)
    return (magnitudes >= threshold).nonzero().squeeze(1)


def _trim(idx: Tensor, values: Tensor, k: int, hi: int) -> Tensor:
    """The ``k`` largest of the sorted candidates ``idx`` (``values`` = their magnitudes), still sorted.

    A selection over the candidates only (about ``k`` of them, not ``n``); order is kept without a sort.
    """
    cut = torch.kthvalue(values, values.numel() - k + 1).values  # the k-th largest candidate
    keep = idx[values >= cut]
    if keep.numel() > hi:  # many ties at the cut
        keep = idx.index_select(0, torch.topk(values, k, sorted=False).indices).sort().values
    return keep
