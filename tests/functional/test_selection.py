"""Exact and approximate top-k index selection."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.functional.selection import (
    APPROX_BAND,
    approx_topk_indices,
    band_limits,
    exact_topk_indices,
    sampled_threshold,
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
    raise ValueError(kind)


def _is_exact_top_set(x: torch.Tensor, idx: torch.Tensor) -> bool:
    """Every kept |x| is >= every dropped |x|."""
    mask = torch.zeros(x.numel(), dtype=torch.bool)
    mask[idx] = True
    a = x.abs()
    return bool(mask.all()) or float(a[mask].min()) >= float(a[~mask].max())


def test_exact_matches_topk_and_is_sorted() -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    idx = exact_topk_indices(x, 50)
    assert idx.dtype == torch.int64 and torch.equal(idx, idx.sort().values)
    assert set(idx.tolist()) == set(torch.topk(x.abs(), 50).indices.tolist())
    assert torch.equal(exact_topk_indices(x[:7], 10), torch.arange(7))


@pytest.mark.parametrize("kind", ["gauss", "heavy", "sparse", "ties"])
@pytest.mark.parametrize("ratio", [0.01, 0.001])
def test_approx_count_in_band_and_top_set(kind: str, ratio: float) -> None:
    n = 200_000 if ratio >= 0.01 else 1_000_000  # large enough to take the sampled path
    k = int(n * ratio)
    lo, hi = band_limits(k)
    for seed in range(12):
        x = _inputs(kind, n, seed)
        idx = approx_topk_indices(x, k, torch.Generator().manual_seed(100 + seed))
        assert lo <= idx.numel() <= hi, (kind, seed, idx.numel(), k)
        assert torch.equal(idx, idx.sort().values)
        assert idx.unique().numel() == idx.numel()
        if kind != "ties":
            assert _is_exact_top_set(x, idx)


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
        assert _is_exact_top_set(x, idx)


def test_approx_falls_back_to_exact_on_small_tensors() -> None:
    x = torch.randn(3000, generator=torch.Generator().manual_seed(4))
    idx = approx_topk_indices(x, 30, torch.Generator().manual_seed(0))
    assert torch.equal(idx, exact_topk_indices(x, 30))


def test_approx_is_deterministic_given_generator() -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(5))
    a = approx_topk_indices(x, 1000, torch.Generator().manual_seed(9))
    b = approx_topk_indices(x, 1000, torch.Generator().manual_seed(9))
    assert torch.equal(a, b)


def test_sampled_threshold_estimates_quantile() -> None:
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(6)).abs()
    t = sampled_threshold(x, 4000, torch.Generator().manual_seed(1), sample_size=40_000)
    count = int((x >= t).sum())
    assert 0.8 * 4000 <= count <= 1.2 * 4000
