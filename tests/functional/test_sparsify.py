"""Sparsification helpers."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.functional import kept_count, scatter_dense, stratified_indices, topk_indices


@pytest.mark.parametrize(("numel", "ratio", "k"), [(1000, 0.01, 10), (10, 0.01, 1), (7, 1.0, 7), (3, 0.5, 2)])
def test_kept_count(numel: int, ratio: float, k: int) -> None:
    assert kept_count(numel, ratio) == k


def test_topk_indices_are_the_largest_magnitudes() -> None:
    x = torch.tensor([0.1, -5.0, 3.0, -0.2, 4.0])
    assert sorted(topk_indices(x, 3).tolist()) == [1, 2, 4]
    assert topk_indices(x, 9).tolist() == [0, 1, 2, 3, 4]


def test_scatter_dense_adds_duplicates() -> None:
    out = scatter_dense(4, torch.tensor([1, 1, 3], dtype=torch.int32), torch.tensor([1.0, 2.0, 5.0]))
    assert out.tolist() == [0.0, 3.0, 0.0, 5.0]


@pytest.mark.parametrize(("numel", "k"), [(100, 10), (103, 10), (7, 7), (5, 1), (1000, 999)])
def test_stratified_indices_one_per_block(numel: int, k: int) -> None:
    idx, sizes = stratified_indices(numel, k, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert idx.numel() == k and int(sizes.sum()) == numel and int(sizes.min()) >= 1
    starts = torch.cumsum(sizes, 0) - sizes
    assert bool(((idx >= starts) & (idx < starts + sizes)).all())  # exactly one index inside each block
    assert torch.equal(idx, stratified_indices(numel, k, torch.Generator().manual_seed(0), torch.device("cpu"))[0])


def test_stratified_indices_are_uniform_within_blocks() -> None:
    """Each of the 4 elements of a block is picked about 1/4 of the time (chi-square, 3 dof, p ~ 1e-4)."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(8)
    draws = 4000
    for _ in range(draws):
        idx, _ = stratified_indices(8, 2, gen, torch.device("cpu"))
        counts.index_add_(0, idx, torch.ones(2))
    expected = draws / 4
    chi2 = float(((counts[:4] - expected) ** 2 / expected).sum())
    assert chi2 < 21.1
