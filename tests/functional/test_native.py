"""The optional compiled kernel of the approximate selection: identical results, fallbacks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_gradcomp.functional import _native, selection
from lightning_gradcomp.functional.selection import approx_topk_indices, band_limits

kernel = _native.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the compiled kernel could not be built here")


def _inputs(kind: str, n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        x = torch.randn(n, generator=gen)
    elif kind == "ties":
        x = torch.randint(-3, 4, (n,), generator=gen).float()
    elif kind == "sparse":  # mostly exact zeros
        x = torch.zeros(n)
        hot = torch.randperm(n, generator=gen)[: n // 300]
        x[hot] = torch.randn(hot.numel(), generator=gen)
    elif kind == "nan":
        x = torch.randn(n, generator=gen)
        x[::997] = float("nan")
        x[5::1001] = float("inf")
        x[7::1003] = -0.0
    else:
        raise ValueError(kind)
    return x.to(dtype)


@needs_kernel
@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 270_001])
@pytest.mark.parametrize("kind", ["gauss", "ties", "sparse", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_at_least_matches_numpy_and_brute_force(n: int, kind: str, dtype: torch.dtype) -> None:
    x = _inputs(kind, n, n, dtype)
    xn = x.numpy()
    for threshold in (0.0, 0.3, 1.0, 2.5, float("inf"), float("nan")):
        brute = np.flatnonzero(np.abs(xn) >= xn.dtype.type(threshold))
        idx, count = _native.at_least(kernel, x, threshold, n)
        assert count == brute.size and idx.dtype == np.int64
        np.testing.assert_array_equal(idx, brute)
        np.testing.assert_array_equal(selection._at_least_numpy(xn, threshold), brute)


@needs_kernel
def test_at_least_overflow_returns_the_true_count() -> None:
    x = _inputs("gauss", 100_003, 1)
    brute = np.flatnonzero(np.abs(x.numpy()) >= 1.0)
    for capacity in (0, 1, 100, brute.size - 1):
        idx, count = _native.at_least(kernel, x, 1.0, capacity)
        assert count == brute.size
        np.testing.assert_array_equal(idx, brute[:capacity])


@needs_kernel
def test_at_least_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="`x`"):
        _native.at_least(kernel, torch.randn(10, 10)[:, 0], 1.0, 10)
    with pytest.raises(ValueError, match="`x`"):
        _native.at_least(kernel, torch.ones(10, dtype=torch.int32), 1.0, 10)
    with pytest.raises(ValueError, match="`capacity`"):
        _native.at_least(kernel, torch.ones(10), 1.0, -1)


@needs_kernel
@pytest.mark.parametrize("kind", ["gauss", "ties", "sparse", "nan"])
@pytest.mark.parametrize("n,k", [(501_760, 5018), (131_075, 300), (400_001, 40_000)])
def test_selection_identical_with_and_without_kernel(monkeypatch: pytest.MonkeyPatch, kind: str, n: int,
                                                     k: int) -> None:
    """The kept set is the NumPy path's, for the same generator (so fidelity results carry over)."""
    x = _inputs(kind, n, k)
    for seed in range(3):
        for band in ((0.9, 1.1), (0.9, 1.0)):
            native = approx_topk_indices(x, k, torch.Generator().manual_seed(seed), band=band)
            with monkeypatch.context() as m:
                m.setattr(_native, "load", lambda: None)
                numpy = approx_topk_indices(x, k, torch.Generator().manual_seed(seed), band=band)
            assert torch.equal(native, numpy)
            lo, hi = band_limits(k, band)
            assert lo <= native.numel() <= hi


@needs_kernel
def test_selection_uses_the_kernel_and_retries_a_short_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = _native.at_least

    def spy(kern, x, threshold, capacity):  # type: ignore[no-untyped-def]
        calls.append(capacity)
        return real(kern, x, threshold, capacity)

    monkeypatch.setattr(_native, "at_least", spy)
    x = _inputs("ties", 200_000, 3)  # ties: far more candidates than aimed at
    idx = approx_topk_indices(x, 2000, torch.Generator().manual_seed(0))
    assert len(calls) == 2 and calls[1] > calls[0]
    monkeypatch.setattr(_native, "load", lambda: None)
    assert torch.equal(idx, approx_topk_indices(x, 2000, torch.Generator().manual_seed(0)))


def test_env_var_disables_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_native.DISABLE_ENV, "1")
    assert _native.load() is None
    x = _inputs("gauss", 300_000, 4)
    idx = approx_topk_indices(x, 3000, torch.Generator().manual_seed(0))
    assert band_limits(3000)[0] <= idx.numel() <= band_limits(3000)[1]


def test_failed_build_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_native.DISABLE_ENV, raising=False)
    monkeypatch.setattr(_native, "_MODULE", None)
    monkeypatch.setattr(_native, "_FAILED", False)
    builds: list[int] = []

    def broken() -> None:
        builds.append(1)
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(_native, "_build", broken)
    x = _inputs("gauss", 300_000, 5)
    with pytest.warns(RuntimeWarning, match="compiler exploded"):
        first = approx_topk_indices(x, 3000, torch.Generator().manual_seed(0))
    second = approx_topk_indices(x, 3000, torch.Generator().manual_seed(0))  # no second warning, no rebuild
    assert builds == [1] and torch.equal(first, second)
    np.testing.assert_array_equal(np.sort(np.abs(x.numpy()))[-first.numel():],
                                  np.sort(np.abs(x.numpy()[first.numpy()])))
