"""Top-k index selection by magnitude: exact, and approximate (sampled threshold) for speed.

:func:`exact_topk_indices` selects exactly ``torch.topk``'s set on ``|x|``, filtering candidates with a sampled
threshold first on large tensors (:func:`topk_indices`): about 3 copies' time
on a 4M-element layer, where ``torch.topk`` itself costs about 30.

:func:`approx_topk_indices` is the fast variant. It estimates the magnitude threshold ``t`` of the
``k``-th largest entry from a small sample of ``|x|``, finds every entry with ``|x_i| >= t`` (no sort),
then corrects the count:

* **Band.** It returns ``c`` indices with ``ceil(lo * k) <= c <= max(k, floor(hi * k))``; the default
  band ``(0.9, 1.1)`` is :data:`APPROX_BAND`. This is guaranteed, not just likely: too many
  candidates are trimmed to the ``k`` largest (a selection over about ``k`` candidates, cheap); too
  few trigger one retry with a lower threshold, then an exact fallback.
* **Which entries.** The kept set is always an exact top-``c`` set (every kept ``|x_i|`` is >= every
  dropped one, up to ties), so only the count ``c`` is approximate.
* **Sample.** About ``hits * n / k`` entries (``hits`` of them expected above the threshold, default
  64). On CPU it is a systematic sample: every ``d``-th entry from a random offset (drawn from
  ``generator``), with the stride ``d`` coprime to 2, 3, 5 and 7 so that it visits every column of
  layers whose row lengths are built from those factors. Elsewhere it is uniform with replacement
  (:func:`sampled_threshold`). The threshold aims at ``oversample * k`` entries (default 1.25), so a
  retry is rare and trimming, which is cheap, is the common correction. Tensors too small to be worth
  sampling (sample >= n / 4) use exact selection.
* **CPU pass.** Two NumPy compares (``x >= t``, ``x <= -t``) write byte masks, in blocks of
  131,072 entries that stay in L2 between the passes; an OR of their ``uint64`` views gives one
  flag per 8 entries. Only the flagged 8-entry words are expanded to indices. NumPy's ``flatnonzero``
  pays about 20 ns per hit below 10 % density and 0.4 ns per entry above it, so scanning ``n / 8``
  flags (padded above 10 % when needed) and then about ``8 k`` mask bytes costs far less than scanning
  ``n`` mask bytes for about ``k`` hits. The masks are per-thread scratch arrays kept between calls
  (2.3 bytes per entry of the largest tensor seen, up to 32M entries; fresh ones page-fault at these
  sizes); they hold no state. Other devices and dtypes use the same steps in torch (no blocks, ``nonzero``).
* **Compiled CPU path.** When the optional C++ kernel of :mod:`._native` is available (built by
  :func:`prepare_native` before training, which ``CLTK.prepare`` calls in the strategy's setup, else on the
  first CPU call; 7-20 s once per machine, then cached; ``LIGHTNING_GRADCOMP_NO_NATIVE=1`` disables it), a
  contiguous tensor's selection is one kernel call: the sample, its order statistic (radix selection on
  the bits of ``|x|``), the threshold pass (a compare mask per 64 entries), and the trim of the
  candidates to the ``k`` largest. The offset is drawn as ``randint`` draws it. Tensors too small to
  sample use the kernel's exact selection. Each step computes exactly what the NumPy step computes
  (order statistics in NumPy's order, NaN last; NumPy's ``argpartition`` still decides the rare ties
  at a cut), so the result is identical; the cost per call falls from about 20 NumPy calls to one,
  which matters on cache-resident tensors.

All functions return **sorted** int64 indices (delta coding of indices relies on it).
"""

from __future__ import annotations

import functools
import math
import threading
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from lightning_gradcomp.functional import _native
from lightning_gradcomp.functional.sampling import systematic_stride

__all__ = [
    "APPROX_BAND",
    "FILTER_MIN_NUMEL",
    "approx_topk_indices",
    "band_limits",
    "exact_topk_indices",
    "prepare_native",
    "sampled_threshold",
    "topk_indices",
]

FILTER_MIN_NUMEL = 32768
"""Smallest tensor for which :func:`topk_indices` filters candidates before ``torch.topk``."""


def topk_indices(x: Tensor, k: int) -> Tensor:
    """Indices (int64, unsorted) of the ``k`` largest ``|x|`` of a flat tensor: the set ``torch.topk`` selects.

    ``torch.topk`` over a whole large layer costs 30-60 copies' time on CPU. For tensors of at least
    :data:`FILTER_MIN_NUMEL` elements (and ``k <= n / 8``) a threshold ``t`` is read from a systematic sample of
    ``|x|`` (about 4096 entries at a stride coprime to 210, :func:`systematic_stride`, so that it meets every column
    of a matrix; deterministic) so that about ``1.5 k`` entries are expected at or above it; the entries
    ``|x| >= t`` are gathered in one pass, and ``torch.topk`` runs on those candidates only. The top-``k`` set lies
    among the candidates whenever there are at least ``k`` of them (the ``k``-th largest value is then ``>= t``), so
    the result is exact; with fewer, a second threshold aims at ``4 k``, and only when that too falls short (a
    sample far from typical) does ``torch.topk`` run on the whole tensor. Ties at the ``k``-th value may resolve to
    other indices than a plain ``torch.topk`` (any choice among equal magnitudes is a top-``k`` set); the result is
    deterministic.

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
    sample = magnitudes[:: systematic_stride(n, 4096)]
    for aim in (1.5 * k, 4.0 * k):
        rank = min(sample.numel(), math.ceil(aim * sample.numel() / n) + 8)
        threshold = torch.topk(sample, rank, sorted=False).values.min()
        candidates = magnitudes.lt(threshold).logical_not_().nonzero().squeeze(1)  # NaN too: torch.topk's largest
        if candidates.numel() >= k:
            chosen = torch.topk(magnitudes.index_select(0, candidates), k, sorted=False).indices
            return candidates.index_select(0, chosen)
    return torch.topk(magnitudes, k, sorted=False).indices


APPROX_BAND: tuple[float, float] = (0.9, 1.1)
"""Default ``(lo, hi)`` band of the approximate selection's count, as fractions of ``k``."""

_NUMPY_DTYPES = (torch.float32, torch.float64)

_BLOCK = 1 << 17
"""Entries per block of the CPU pass (512 KB of fp32)."""

_SCRATCH = threading.local()
"""Per-thread reusable masks of the CPU pass (see :func:`_scratch`)."""

_SCRATCH_MAX = 1 << 25
"""Largest tensor (entries) whose masks are kept between calls: at most 75 MB per thread."""


def prepare_native() -> bool:
    """Build (once per machine, then cached) or load the compiled CPU kernel now: the selections', the quantizers',
    the casts' and the engine's NaN/Inf scan.

    Call it before training, so that the first CPU selection or compressed bucket does not build it (7-20 s);
    the strategy's setup does, directly and through ``Compressor.prepare``. Returns whether the kernel is
    available: ``False`` when ``LIGHTNING_GRADCOMP_NO_NATIVE=1`` or it cannot be built (then it has warned once,
    naming the reason, and the selections use NumPy and the other passes torch, with the same results).
    """
    return _native.load() is not None


def band_limits(k: int, band: tuple[float, float] = APPROX_BAND) -> tuple[int, int]:
    """Smallest and largest count accepted for target ``k``: ``(ceil(lo k), max(k, floor(hi k)))``.

    Example::

        >>> band_limits(100), band_limits(5), band_limits(10, (0.5, 2.0))
        ((90, 110), (5, 5), (5, 20))
    """
    lo, hi = band
    if not 0.0 < lo <= 1.0 <= hi:
        raise ValueError(f"`band` must satisfy 0 < lo <= 1 <= hi, got {band!r}")
    return max(1, math.ceil(lo * k - 1e-9)), max(k, math.floor(hi * k + 1e-9))


def exact_topk_indices(x: Tensor, k: int) -> Tensor:
    """Sorted int64 indices of the ``k`` largest ``|x|`` of a flat tensor (:func:`topk_indices`).

    On a contiguous fp32/fp64 CPU tensor the compiled kernel's radix selection finds the set when it is unique
    (no tie at the cut): the same set, 10-15x faster than the torch steps on layers of millions of entries.
    Ties (or a NaN at the cut) and other tensors take the torch steps.

    Example::

        >>> exact_topk_indices(torch.tensor([0.5, -3.0, 1.0, 2.0, -0.1]), 3).tolist()
        [1, 2, 3]
    """
    found = _exact_native(x, k)
    return found if found is not None else topk_indices(x, k).sort().values


def _exact_native(x: Tensor, k: int) -> Tensor | None:
    """The kernel's exact top-``k`` (sorted) of a contiguous fp32/fp64 CPU tensor, or ``None`` (no kernel, another
    tensor, or a set that is not unique)."""
    n = x.numel()
    if not (1 <= k < n < _native.MAX_NUMEL and x.is_cpu and x.dtype in _NUMPY_DTYPES and x.is_contiguous()):
        return None
    kernel = _native.load()
    if kernel is None:
        return None
    found = kernel.exact(x.data_ptr(), n, x.dtype is torch.float64, k, _native.exact_stride(n), kernel.level)
    return None if found is None else torch.from_numpy(found)


def sampled_threshold(magnitudes: Tensor, count: float, generator: torch.Generator, sample_size: int) -> float:
    """Estimate ``t`` such that about ``count`` entries of ``magnitudes`` are ``>= t``.

    Draws ``sample_size`` entries uniformly with replacement and returns the sample's
    ``ceil(count * sample_size / n)``-th largest value.

    Example::

        >>> t = sampled_threshold(torch.arange(1000.0), 100, torch.Generator().manual_seed(0), sample_size=200)
        >>> 850 <= t <= 950  # about 100 of the 1000 entries are >= t
        True
    """
    n = magnitudes.numel()
    picks = torch.randint(n, (sample_size,), generator=generator, device=generator.device).to(magnitudes.device)
    sample = magnitudes.index_select(0, picks)
    rank = min(sample_size, max(1, math.ceil(count * sample_size / n)))
    return float(torch.topk(sample, rank, sorted=False).values.min())


def approx_topk_indices(
    x: Tensor,
    k: int,
    generator: torch.Generator,
    *,
    band: tuple[float, float] = APPROX_BAND,
    hits: int = 64,
    oversample: float = 1.25,
) -> Tensor:
    """Sorted int64 indices of an exact top-``c`` set of ``|x|`` with ``c`` in the band around ``k``.

    Args:
        x: flat tensor.
        k: target count, ``1 <= k``.
        generator: source of the sample (the compressor passes ``ctx.generator``).
        band: ``(lo, hi)`` fractions of ``k`` the count must fall in (see :func:`band_limits`).
        hits: expected sampled entries above the threshold (sample size ``hits * n / k``).
        oversample: the threshold aims at ``oversample * k`` entries.

    Returns:
        ``c`` sorted indices, ``band_limits(k, band)[0] <= c <= band_limits(k, band)[1]``.

    Example::

        >>> x = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
        >>> idx = approx_topk_indices(x, 1000, torch.Generator().manual_seed(1))
        >>> lo, hi = band_limits(1000)
        >>> kept = torch.zeros(x.numel(), dtype=torch.bool).index_fill_(0, idx, True)
        >>> lo <= idx.numel() <= hi, bool((idx.diff() > 0).all()), bool(x[kept].abs().min() >= x[~kept].abs().max())
        (True, True, True)
    """
    n = x.numel()
    lo, hi, sample_size, stride = _plan(n, k, tuple(band), hits)
    if k >= n or 4 * sample_size >= n:
        return _exact_small(x, k)
    if x.is_cpu and x.dtype in _NUMPY_DTYPES:
        kernel = _native.load() if n < _native.MAX_NUMEL else None
        if kernel is not None and not x.is_contiguous():
            x = x.detach().reshape(-1)  # copies a non-contiguous tensor of 2+ dims
        if kernel is not None and x.is_contiguous():
            return _approx_native(kernel, x, k, lo, hi, generator, stride, oversample)
        flat = x.detach().reshape(-1)
        found = _approx_numpy(flat.numpy(), k, lo, hi, generator, stride, oversample)
        return exact_topk_indices(flat, k) if found is None else torch.from_numpy(found)
    return _approx_torch(x.reshape(-1), k, lo, hi, generator, sample_size, oversample)


@functools.lru_cache(maxsize=1024)
def _plan(n: int, k: int, band: tuple[float, float], hits: int) -> tuple[int, int, int, int]:
    """``(lo, hi, sample_size, stride)`` of :func:`approx_topk_indices` (cached: layers repeat every step)."""
    lo, hi = band_limits(k, band)
    sample_size = math.ceil(hits * n / max(k, 1))
    return lo, hi, sample_size, systematic_stride(n, sample_size)


# ------------------------------------------------------------------------------------------------ CPU (kernel)
def _approx_native(
    kernel: ModuleType, x: Tensor, k: int, lo: int, hi: int, generator: torch.Generator, stride: int, oversample: float
) -> Tensor:
    """:func:`_approx_numpy` in one call of the compiled kernel (``x`` contiguous): the same result.

    Calls the kernel directly (the checks of :func:`._native.approx` hold by construction here).
    """
    offset = _draw_offset(stride, generator)
    status, idx = kernel.approx(
        x.data_ptr(),
        x.numel(),
        x.dtype is torch.float64,
        offset,
        stride,
        oversample * k,
        4.0 * oversample * k,
        k,
        lo,
        hi,
        kernel.level,
    )
    if status == _native.DONE:
        return torch.from_numpy(idx)
    if status == _native.TIES:  # more than hi tie at the cut: NumPy's argpartition decides, as on its path
        return torch.from_numpy(_trim_numpy(x.detach().reshape(-1).numpy(), idx, k, hi))
    return exact_topk_indices(x.reshape(-1), k)


def _draw_offset(stride: int, generator: torch.Generator) -> int:
    """``int(torch.randint(stride, (1,), generator=generator))``: the same draw, into a kept CPU tensor.

    ``randint`` is ``empty(...).random_(0, stride)``; skipping the allocation saves a third of its cost.
    """
    if generator.device.type != "cpu":
        return int(torch.randint(stride, (1,), generator=generator, device=generator.device))
    buffer = getattr(_SCRATCH, "offset", None)
    if buffer is None:
        with torch.inference_mode(False):  # a normal tensor: updated in place in and out of inference mode
            buffer = _SCRATCH.offset = torch.empty(1, dtype=torch.int64)
    return int(buffer.random_(0, stride, generator=generator))


# ------------------------------------------------------------------------------------------------ CPU (NumPy)
def _approx_numpy(
    xn: np.ndarray, k: int, lo: int, hi: int, generator: torch.Generator, stride: int, oversample: float
) -> np.ndarray | None:
    """:func:`approx_topk_indices` on a NumPy view; ``None`` when both thresholds keep fewer than ``lo``."""
    n = xn.size
    sample = np.abs(xn[_draw_offset(stride, generator) :: stride])
    for aim in (oversample * k, 4.0 * oversample * k):  # second pass: the correction for too few
        rank = min(sample.size, max(1, math.ceil(aim * sample.size / n)))
        sample.partition(sample.size - rank)
        threshold = float(sample[sample.size - rank])
        idx = _at_least_numpy(xn, threshold)
        if idx.size > hi:
            return _trim_numpy(xn, idx, k, hi)
        if idx.size >= lo:
            return idx
    return None


def _at_least_numpy(xn: np.ndarray, threshold: float) -> np.ndarray:
    """Sorted int64 indices of the entries with ``|x| >= threshold`` (see the module docstring)."""
    body = xn.size - xn.size % 8
    pos, neg, flags = _scratch(body)
    pos_words, neg_words = pos.view(np.uint64), neg.view(np.uint64)
    for start in range(0, body, _BLOCK):  # a block's entries, masks and flags stay in L2 between the passes
        stop = min(start + _BLOCK, body)
        np.greater_equal(xn[start:stop], threshold, out=pos[start:stop])
        np.less_equal(xn[start:stop], -threshold, out=neg[start:stop])
        np.logical_or(
            pos_words[start // 8 : stop // 8], neg_words[start // 8 : stop // 8], out=flags[start // 8 : stop // 8]
        )  # one flag per 8 entries
    word = _flat_nonzero(flags, body // 8)
    bits = pos_words[word]
    bits |= neg_words[word]
    byte = np.flatnonzero(bits.view(np.bool_))  # >= 1 hit per 8 bytes: NumPy's branch-free loop
    idx = word.take(byte >> 3)
    idx <<= 3
    byte &= 7
    idx |= byte
    if body < xn.size:
        tail = np.flatnonzero(np.abs(xn[body:]) >= threshold)
        if tail.size:
            idx = np.concatenate([idx, tail + body])
    return idx


def _flat_nonzero(flags: np.ndarray, size: int) -> np.ndarray:
    """``np.flatnonzero(flags[:size])``, using the ``size // 8`` spare entries of ``flags``.

    NumPy's ``nonzero`` runs a branch-free loop (about 0.4 ns per entry) when more than 10 % of the
    entries are set, and otherwise one ``memchr`` per hit (about 20 ns each). Between 2.5 % and 10 %
    the spare entries are set to True until the density passes 10 %, and their indices dropped.
    """
    hits = int(np.count_nonzero(flags[:size]))
    pad = 0 if not 0.025 * size < hits <= 0.1 * size else math.ceil((0.1 * size - hits) / 0.9) + 1
    flags[size : size + pad] = True
    found = np.flatnonzero(flags[: size + pad])
    return found[:hits]


def _scratch(size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two bool arrays of ``size`` entries and one of about ``1.125 size / 8`` for the CPU pass.

    This thread's arrays, grown to the largest size asked and kept (2.3 bytes per entry), up to
    :data:`_SCRATCH_MAX` entries; larger tensors get fresh arrays.
    """
    cached = getattr(_SCRATCH, "arrays", None)
    if cached is None or cached[0].size < size:
        cached = (np.empty(size, np.bool_), np.empty(size, np.bool_), np.empty(size // 8 + size // 64 + 8, np.bool_))
        if size <= _SCRATCH_MAX:
            _SCRATCH.arrays = cached
    return cached[0][:size], cached[1][:size], cached[2]


def _trim_numpy(xn: np.ndarray, idx: np.ndarray, k: int, hi: int) -> np.ndarray:
    """The ``k`` largest ``|x|`` among the sorted candidates ``idx``, still sorted (``<= hi`` when tied)."""
    values = xn.take(idx)
    np.abs(values, out=values)
    cut = np.partition(values, idx.size - k)[idx.size - k]  # the k-th largest candidate
    keep = np.compress(values >= cut, idx)
    if keep.size > hi:  # many ties at the cut
        chosen = np.argpartition(values, idx.size - k)[idx.size - k :]
        chosen.sort()
        keep = idx[chosen]
    return keep


def _exact_small(x: Tensor, k: int) -> Tensor:
    """Exact top-``k`` for tensors too small to sample: a NumPy selection on CPU, else ``torch.topk``."""
    n = x.numel()
    if k >= n or not x.is_cpu or x.dtype not in _NUMPY_DTYPES:
        return exact_topk_indices(x, k)
    found = _exact_native(x, k)
    if found is not None:
        return found
    magnitudes = np.abs(x.detach().reshape(-1).numpy())
    cut = np.partition(magnitudes, n - k)[n - k]
    idx = np.flatnonzero(magnitudes >= cut)
    if idx.size != k:  # ties at the cut (or a NaN cut)
        idx = np.argpartition(magnitudes, n - k)[n - k :]
        idx.sort()
    return torch.from_numpy(idx.astype(np.int64, copy=False))


# ------------------------------------------------------------------------------------------------ other devices
def _approx_torch(
    x: Tensor, k: int, lo: int, hi: int, generator: torch.Generator, sample_size: int, oversample: float
) -> Tensor:
    """:func:`approx_topk_indices` in torch (uniform sample with replacement)."""
    magnitudes = x.abs()
    for aim in (oversample * k, 4.0 * oversample * k):
        threshold = sampled_threshold(magnitudes, aim, generator, sample_size)
        idx = (magnitudes >= threshold).nonzero().squeeze(1)
        if idx.numel() > hi:
            return _trim_torch(idx, magnitudes.index_select(0, idx), k, hi)
        if idx.numel() >= lo:
            return idx
    return exact_topk_indices(x, k)


def _trim_torch(idx: Tensor, values: Tensor, k: int, hi: int) -> Tensor:
    """The ``k`` largest of the sorted candidates ``idx`` (``values`` = their magnitudes), still sorted."""
    cut = torch.kthvalue(values, values.numel() - k + 1).values  # the k-th largest candidate
    keep = idx[values >= cut]
    if keep.numel() > hi:  # many ties at the cut
        keep = idx.index_select(0, torch.topk(values, k, sorted=False).indices).sort().values
    return keep
