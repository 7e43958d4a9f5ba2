"""Sparsification helpers."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.functional import kept_count, random_indices, scatter_dense, topk_indices


@pytest.mark.parametrize(("numel", "ratio", "k"), [(1000, 0.01, 10), (10, 0.01, 1), (7, 1.0, 7), (3, 0.5, 2)])
def test_kept_count(numel: int, ratio: float, k: int) -> None:
    assert kept_count(numel, ratio) == k


def test_topk_indices_are_the_largest_magnitudes() -> None:
    x = torch.tensor([0.1, -5.0, 3.0, -0.2, 4.0])
    assert sorted(topk_indices(x, 3).tolist()) == [1, 2, 4]
    assert topk_indices(x, 9).tolist() == [0, 1, 2, 3, 4]


def test_random_indices_distinct_and_reproducible() -> None:
    a = random_indices(100, 10, torch.Generator().manual_seed(3), torch.device("cpu"))
    b = random_indices(100, 10, torch.Generator().manual_seed(3), torch.device("cpu"))
    assert torch.equal(a, b) and a.unique().numel() == 10 and int(a.max()) < 100


def test_scatter_dense_adds_duplicates() -> None:
    out = scatter_dense(4, torch.tensor([1, 1, 3], dtype=torch.int32), torch.tensor([1.0, 2.0, 5.0]))
    assert out.tolist() == [0.0, 3.0, 0.0, 5.0]
