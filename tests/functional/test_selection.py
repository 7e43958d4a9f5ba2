"""Exact and approximate top-k index selection."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from lightning_gradcomp.functional import selection
from lightning_gradcomp.functional.selection import (
    APPROX_BAND,
    approx_topk_indices,
    band_limits,
    exact_topk_indices,
    sampled_threshold,
    systematic_stride,
)


def _inputs(kind: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(n, generator=gen)
    if kind == "heavy":  # Cauchy-like tails
        return torch.randn(n, generator=gen) / torch.randn(n, generator=gen).abs().clamp_min(1e-3)
    if kind == "sparse":  # mostly exact zeros: the threshold can be 0
        x = torch.zeros(n)
        hot = torch.randperm(n, generator=gen)[: n // 300]
        x[hot] = torch.randn(hot.numel(), generator=gen)
        return x
    if kind == "ties":  # a few distinct magnitudes
        return torch.randint(-3, 4, (n,), generator=gen).float()
    if kind == "rows":  # outer-product structure, like a linear layer's gradient (rows of 1568)
        rows = n // 1568 + 1
        g = torch.randn(rows, 1, generator=gen) * torch.randn(1, 1568, generator=gen)
        return (g + 0.1 * torch.randn(rows, 1568, generator=gen)).reshape(-1)[:n].contiguous()
    raise ValueError(kind)


def _assert_exact_top_set(x: torch.Tensor, idx: torch.Tensor) -> None:
    """The kept magnitudes are the ``c`` largest of ``|x|`` (as a multiset: right with ties too)."""
    magnitudes = np.sort(np.abs(x.double().numpy()))
    kept = np.sort(np.abs(x.double().numpy())[idx.numpy()])
    np.testing.assert_array_equal(kept, magnitudes[magnitudes.size - idx.numel():])


def _assert_valid(idx: torch.Tensor, n: int) -> None:
    assert idx.dtype == torch.int64
    assert torch.equal(idx, idx.sort().values)
    assert idx.unique().numel() == idx.numel()
    assert idx.numel() == 0 or (int(idx[0]) >= 0 and int(idx[-1]) < n)


def test_exact_matches_topk_and_is_sorted() -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    idx = exact_topk_indices(x, 50)
    assert idx.dtype == torch.int64 and torch.equal(idx, idx.sort().values)
    assert set(idx.tolist()) == set(torch.topk(x.abs(), 50).indices.tolist())
    assert torch.equal(exact_topk_indices(x[:7], 10), torch.arange(7))


@pytest.mark.parametrize("kind", ["gauss", "heavy", "sparse", "ties", "rows"])
@pytest.mark.parametrize("ratio", [0.01, 0.001])
def test_approx_count_in_band_and_top_set(kind: str, ratio: float) -> None:
    n = 200_003 if ratio >= 0.01 else 1_000_005  # large enough to sample; not a multiple of 8
    k = int(n * ratio)
    lo, hi = band_limits(k)
    for seed in range(8):
        x = _inputs(kind, n, seed)
        idx = approx_topk_indices(x, k, torch.Generator().manual_seed(100 + seed))
        assert lo <= idx.numel() <= hi, (kind, seed, idx.numel(), k)
        _assert_valid(idx, n)
        _assert_exact_top_set(x, idx)


@pytest.mark.parametrize("n", [300_001, 131_072 * 2 + 8, 131_072 * 3 + 13, 262_151])
def test_approx_sizes_across_blocks_and_tail(n: int) -> None:
    """Sizes around the CPU pass's block and word boundaries; the largest entries sit at both ends."""
    x = _inputs("gauss", n, n)
    tail = n % 8 or 8  # not a whole 8-entry word when n % 8 != 0
    x[-tail:] = 100.0 + torch.arange(tail)  # the top entries sit in the tail and at the start
    x[:5] = -100.0 - torch.arange(5)
    k = n // 100
    for seed in range(4):
        idx = approx_topk_indices(x, k, torch.Generator().manual_seed(seed), band=(0.9, 1.0))
        assert band_limits(k, (0.9, 1.0))[0] <= idx.numel() <= k
        _assert_valid(idx, n)
        _assert_exact_top_set(x, idx)
        assert int(idx[-1]) == n - 1 and int(idx[0]) == 0


@pytest.mark.parametrize("ratio", [0.3, 0.1, 0.03, 0.005])
def test_approx_densities(ratio: float) -> None:
    """From dense to sparse flags (the padded and unpadded scans of the CPU pass)."""
    n = 400_000
    k = int(n * ratio)
    x = _inputs("gauss", n, 11)
    idx = approx_topk_indices(x, k, torch.Generator().manual_seed(1), band=(0.9, 1.0))
    assert band_limits(k, (0.9, 1.0))[0] <= idx.numel() <= k
    _assert_valid(idx, n)
    _assert_exact_top_set(x, idx)


def test_approx_float64_and_torch_path_agree_on_semantics() -> None:
    x = _inputs("heavy", 120_011, 3)
    k = 1200
    lo, hi = band_limits(k)
    for xx in (x.double(), x.half()):  # NumPy path (fp64) and the torch path (fp16 is not NumPy-viewed)
        idx = approx_topk_indices(xx, k, torch.Generator().manual_seed(2))
        assert lo <= idx.numel() <= hi
        _assert_valid(idx, x.numel())
        _assert_exact_top_set(xx.double(), idx)


def test_approx_strided_input() -> None:
    base = _inputs("gauss", 2 * 150_000, 4)
    x = base[::2]  # not contiguous
    idx = approx_topk_indices(x, 1500, torch.Generator().manual_seed(0))
    assert band_limits(1500)[0] <= idx.numel() <= band_limits(1500)[1]
    _assert_exact_top_set(x.contiguous(), idx)


@pytest.mark.parametrize("oversample", [0.5, 0.1])
def test_approx_corrects_too_few(oversample: float) -> None:
    """An aim below the band forces the retry (0.5: lower threshold) or the exact fallback (0.1)."""
    x = _inputs("gauss", 200_000, 9)
    idx = approx_topk_indices(x, 2000, torch.Generator().manual_seed(0), band=(0.9, 1.0), oversample=oversample)
    assert 1800 <= idx.numel() <= 2000
    _assert_valid(idx, x.numel())
    _assert_exact_top_set(x, idx)
    if oversample == 0.1:
        assert torch.equal(idx, exact_topk_indices(x, 2000))


def test_approx_band_bounds() -> None:
    assert APPROX_BAND == (0.9, 1.1)
    assert band_limits(1000) == (900, 1100)
    assert band_limits(1) == (1, 1)
    assert band_limits(1000, (0.9, 1.0)) == (900, 1000)
    with pytest.raises(ValueError, match="band"):
        band_limits(10, (1.1, 1.2))


def test_approx_tight_band_never_exceeds_k() -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(3))
    for seed in range(10):
        idx = approx_topk_indices(x, 1000, torch.Generator().manual_seed(seed), band=(0.9, 1.0))
        assert 900 <= idx.numel() <= 1000
        _assert_exact_top_set(x, idx)


def test_approx_tight_band_with_ties_at_the_cut() -> None:
    x = _inputs("ties", 100_003, 5)  # a third of the entries share the top magnitude
    idx = approx_topk_indices(x, 1000, torch.Generator().manual_seed(0), band=(0.9, 1.0))
    assert 900 <= idx.numel() <= 1000
    _assert_valid(idx, x.numel())
    _assert_exact_top_set(x, idx)


@pytest.mark.parametrize("n,k", [(1, 1), (2, 1), (7, 3), (7, 7), (7, 9), (100, 1), (100, 99), (3000, 30), (9216, 92)])
def test_approx_tiny_tensors_are_exact(n: int, k: int) -> None:
    x = _inputs("gauss", n, n)
    idx = approx_topk_indices(x, k, torch.Generator().manual_seed(0))
    assert torch.equal(idx, exact_topk_indices(x, k))


def test_approx_tiny_tensor_with_ties_keeps_k() -> None:
    x = torch.tensor([1.0, -2.0, 2.0, 0.5, 2.0, -2.0, 0.0, 1.0])
    idx = approx_topk_indices(x, 3, torch.Generator().manual_seed(0))
    assert idx.numel() == 3 and set(idx.tolist()) <= {1, 2, 4, 5}
    _assert_valid(idx, 8)


def test_approx_nan_does_not_break_the_band() -> None:
    x = _inputs("gauss", 200_000, 6)
    x[::5000] = float("nan")
    idx = approx_topk_indices(x, 2000, torch.Generator().manual_seed(0))
    assert band_limits(2000)[0] <= idx.numel() <= band_limits(2000)[1]
    _assert_valid(idx, x.numel())


def test_approx_is_deterministic_given_generator() -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(5))
    a = approx_topk_indices(x, 1000, torch.Generator().manual_seed(9))
    b = approx_topk_indices(x, 1000, torch.Generator().manual_seed(9))
    assert torch.equal(a, b)


def test_approx_draws_its_offset_from_the_generator() -> None:
    """A different generator state gives a different sample, hence (usually) a different count."""
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(7))
    counts = {approx_topk_indices(x, 4000, torch.Generator().manual_seed(s), band=(0.5, 2.0)).numel()
              for s in range(6)}
    assert len(counts) > 1


def test_approx_threads_use_their_own_scratch() -> None:
    xs = [_inputs("gauss", 300_000 + 8 * i, i) for i in range(4)]
    expected = [approx_topk_indices(x, 3000, torch.Generator().manual_seed(0)) for x in xs]
    results: list = [None] * 4

    def work(i: int) -> None:
        for _ in range(5):
            results[i] = approx_topk_indices(xs[i], 3000, torch.Generator().manual_seed(0))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(r, e) for r, e in zip(results, expected, strict=True))


def test_scratch_is_kept_only_up_to_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selection._native, "load", lambda: None)  # the masks belong to the NumPy pass
    monkeypatch.setattr(selection, "_SCRATCH", threading.local())
    monkeypatch.setattr(selection, "_SCRATCH_MAX", 150_000)
    small, large = _inputs("gauss", 120_000, 1), _inputs("gauss", 200_000, 2)
    for x in (small, large, small):
        idx = approx_topk_indices(x, x.numel() // 100, torch.Generator().manual_seed(0))
        _assert_exact_top_set(x, idx)
    assert selection._SCRATCH.arrays[0].size == 120_000  # the large tensor's masks were not kept


def test_at_least_matches_a_full_scan() -> None:
    x = _inputs("heavy", 270_001, 8).numpy()
    for threshold in (0.0, 0.5, 3.0, 50.0, 1e9):
        expected = np.flatnonzero(np.abs(x) >= threshold)
        np.testing.assert_array_equal(selection._at_least_numpy(x, threshold), expected)


def test_systematic_stride() -> None:
    assert systematic_stride(501_760, 6400) == 73  # 78 -> largest <= 78 coprime to 2, 3, 5, 7
    assert math.gcd(systematic_stride(10**7, 1000), 210) == 1
    assert systematic_stride(1000, 100) == 7  # small strides: coprime to 2 and 3
    assert systematic_stride(1000, 250) == 1
    assert systematic_stride(10, 100) == 1


def test_sampled_threshold_estimates_quantile() -> None:
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(6)).abs()
    t = sampled_threshold(x, 4000, torch.Generator().manual_seed(1), sample_size=40_000)
    count = int((x >= t).sum())
    assert 0.8 * 4000 <= count <= 1.2 * 4000


@pytest.mark.parametrize("n", [1000, 32768, 100_003, 1 << 20])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1, 0.2])
@pytest.mark.parametrize("kind", ["normal", "heavy", "sparse", "constant_tail"])
def test_exact_topk_equals_torch_topk(n: int, density: float, kind: str) -> None:  # sparsify.topk_indices too
    """The candidate filter gives exactly ``torch.topk``'s magnitudes (and its indices where there are no ties)."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen)
    if kind == "heavy":
        x = x * torch.rand(n, generator=gen).pow(-2)
    elif kind == "sparse":
        x = x * (torch.rand(n, generator=gen) < 0.05)
    elif kind == "constant_tail":  # many equal magnitudes around the k-th value
        x = torch.where(torch.rand(n, generator=gen) < 0.5, torch.full_like(x, 0.5), x)
    k = max(1, int(n * density))
    ours = exact_topk_indices(x, k)
    ref = torch.topk(x.abs(), k, sorted=False)
    assert ours.numel() == k and torch.equal(ours, ours.unique())
    assert torch.equal(x.abs()[ours].sort().values, ref.values.sort().values)
    if kind in ("normal", "heavy"):
        assert torch.equal(ours, ref.indices.sort().values)


def test_exact_topk_uses_the_kernel_for_unique_sets_and_the_torch_steps_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel's radix selection answers when the top-k set is unique; a tie at the cut (the kernel answers
    ``None``) and tensors it does not serve (fp16, strided) take the torch steps; the sets are the same."""
    from lightning_gradcomp.functional import _native, selection
    from lightning_gradcomp.functional.selection import topk_indices

    kernel = _native.load()
    if kernel is None:
        pytest.skip("the compiled kernel could not be built here")
    calls: list[object] = []

    class Spy:
        level = kernel.level

        def exact(self, *args: object) -> object:
            result = kernel.exact(*args)
            calls.append(result is not None)
            return result

    monkeypatch.setattr(_native, "load", lambda: Spy())
    x = torch.randn(200_003, generator=torch.Generator().manual_seed(0))
    assert torch.equal(selection.exact_topk_indices(x, 2000), topk_indices(x, 2000).sort().values)
    tied = torch.ones(1000)
    assert selection.exact_topk_indices(tied, 10).numel() == 10  # a tie at the cut: the torch steps choose
    for other in (x.half(), x[::2]):
        assert torch.equal(selection.exact_topk_indices(other, 500), topk_indices(other, 500).sort().values)
    assert calls == [True, False]  # only the contiguous fp32 tensors reach the kernel
