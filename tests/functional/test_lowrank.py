"""Low-rank helpers: matrix views, orthogonalisation (stable, zero-safe), factor sizes and warm-start resizing."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.functional import _native, orthogonalize
from lightning_gradcomp.functional.lowrank import (adapt_factor, effective_rank, lowrank_numel, lowrank_saves,
                                                   matrix_shape, random_factor, subtract_product, thin_matmul)


def _assert_orthonormal(q: torch.Tensor, atol: float = 1e-5) -> None:
    assert q.dtype == torch.float32
    assert torch.isfinite(q).all()
    torch.testing.assert_close(q.T @ q, torch.eye(q.shape[1]), atol=atol, rtol=0)


def test_matrix_shape() -> None:
    assert matrix_shape((8, 3, 3, 3)) == (8, 27)
    assert matrix_shape((5, 7)) == (5, 7)
    assert matrix_shape((6,)) == (6, 1)


def test_sizes_and_saving_rule() -> None:
    assert effective_rank(10, 3, 8) == 3
    assert effective_rank(10, 30, 0) == 1
    assert lowrank_numel(100, 50, 4) == 600
    assert lowrank_numel(4, 50, 8) == 54 * 4  # clipped to min(n, m)
    assert lowrank_saves(64, 64, 4, 2.0)  # 128 * 4 * 2 = 1024 <= 4096
    assert lowrank_saves(16, 16, 4, 2.0)  # 32 * 4 * 2 = 256 <= 256: equality is allowed
    assert not lowrank_saves(16, 16, 5, 2.0)  # 320 > 256
    assert lowrank_saves(16, 16, 5, 1.0)
    assert not lowrank_saves(4, 100, 8, 1.0)  # rank above min(n, m)


@pytest.mark.parametrize("shape", [(50, 4), (7, 7), (300, 16)])
def test_orthogonalize_random(shape: tuple[int, int]) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    q = orthogonalize(x)
    assert q.shape == shape
    _assert_orthonormal(q)
    # Same column space: projecting x onto span(q) gives x back.
    torch.testing.assert_close(q @ (q.T @ x), x, atol=1e-4, rtol=1e-4)


def test_orthogonalize_zero_and_dependent_columns() -> None:
    x = torch.randn(20, 4, generator=torch.Generator().manual_seed(1))
    x[:, 1] = 0.0
    x[:, 3] = 2.0 * x[:, 0]
    _assert_orthonormal(orthogonalize(x))
    _assert_orthonormal(orthogonalize(torch.zeros(9, 3)))


def test_orthogonalize_ill_conditioned_is_stable() -> None:
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(200, 6, generator=gen)
    x = base * torch.logspace(0, -6, 6)  # condition number 1e6: classical Gram-Schmidt loses orthogonality
    _assert_orthonormal(orthogonalize(x), atol=1e-5)


def test_orthogonalize_rejects_wide_input() -> None:
    with pytest.raises(ValueError, match="r <= n"):
        orthogonalize(torch.randn(3, 5))


def test_orthogonalize_is_deterministic() -> None:
    x = torch.randn(64, 5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(orthogonalize(x.clone()), orthogonalize(x.clone()))


def test_random_factor_shared_seed() -> None:
    a = random_factor(30, 4, torch.Generator().manual_seed(7), torch.device("cpu"))
    b = random_factor(30, 4, torch.Generator().manual_seed(7), torch.device("cpu"))
    assert torch.equal(a, b)
    _assert_orthonormal(a)


def test_adapt_factor_shrink_keeps_leading_columns() -> None:
    q = torch.randn(30, 6)
    out = adapt_factor(q, 2, torch.Generator().manual_seed(0))
    assert torch.equal(out, q[:, :2])


def test_adapt_factor_grow_keeps_columns_and_adds_orthogonal_ones() -> None:
    q = torch.randn(30, 2, generator=torch.Generator().manual_seed(4)) * 5.0
    out = adapt_factor(q, 5, torch.Generator().manual_seed(0))
    assert out.shape == (30, 5)
    assert torch.equal(out[:, :2], q)
    extra = out[:, 2:]
    _assert_orthonormal(extra)
    assert float((q.T @ extra).abs().max()) < 1e-4
    again = adapt_factor(q, 5, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


# ------------------------------------------------------------------------------------------------ thin products
_kernel = _native.load()
_LEVELS = sorted({0, _kernel.level if _kernel is not None else 0})


@pytest.mark.parametrize("level", _LEVELS)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize(("n", "m", "r"), [(1, 1, 1), (7, 9, 1), (33, 17, 3), (1000, 256, 4), (256, 1024, 4),
                                           (64, 27, 8), (15, 8, 16), (40, 300, 32), (5, 6, 33)])
def test_thin_matmul_matches_float64(n: int, m: int, r: int, transpose: bool, level: int) -> None:
    """``M Q`` and ``M^T P`` within fp32 rounding of the float64 product, at the portable level and the CPU's
    best alike (the same bits: one summation order), for row counts around the vector width and r past the
    kernel's limit (33: torch.matmul)."""
    gen = torch.Generator().manual_seed(n * m + r)
    mat = torch.randn(n, m, generator=gen)
    factor = torch.randn(m if not transpose else n, r, generator=gen)
    out = torch.empty(n if not transpose else m, r)
    got = thin_matmul(mat, factor, out, transpose=transpose, level=level)
    assert got is out
    exact = (mat.double().T if transpose else mat.double()) @ factor.double()
    inner = n if transpose else m
    assert (got.double() - exact).abs().max() <= 4 * inner * 2.0**-24 * (mat.abs().max() * factor.abs().max()).double()
    best = thin_matmul(mat, factor, torch.empty_like(out), transpose=transpose)
    assert torch.equal(got, best)  # deterministic, level-independent
    strided = factor.T.contiguous().T  # the same values, column-major: copied for the kernel (and kept alive)
    assert torch.equal(thin_matmul(mat, strided, torch.empty_like(out), transpose=transpose, level=level), got)


def test_thin_matmul_takes_torch_for_other_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    mat = torch.randn(6, 4, dtype=torch.float64)
    factor = torch.randn(4, 2, dtype=torch.float64)
    assert torch.equal(thin_matmul(mat, factor, torch.empty(6, 2, dtype=torch.float64)), mat @ factor)
    strided = torch.randn(4, 6).T  # not contiguous
    assert torch.equal(thin_matmul(strided, torch.ones(4, 2), torch.empty(6, 2)), strided @ torch.ones(4, 2))
    monkeypatch.setattr(_native, "load", lambda: None)
    mat32, f32 = torch.randn(6, 4), torch.randn(4, 2)
    assert torch.equal(thin_matmul(mat32, f32, torch.empty(6, 2)), torch.matmul(mat32, f32))


@pytest.mark.parametrize(("factor", "out"), [((5, 2), (6, 2)), ((4, 2), (6, 3)), ((6, 2), (6, 2))])
def test_thin_matmul_checks_shapes(factor: tuple[int, int], out: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="takes a factor of shape"):
        thin_matmul(torch.randn(6, 4), torch.randn(*factor), torch.empty(*out))


@pytest.mark.parametrize("level", _LEVELS)
@pytest.mark.parametrize(("n", "m", "r"), [(1, 1, 1), (7, 9, 1), (33, 17, 3), (1000, 256, 4), (64, 40, 32), (5, 6, 33)])
def test_subtract_product_matches_float64(n: int, m: int, r: int, level: int) -> None:
    """``M - P Q^T`` in place, within fp32 rounding of the float64 result, the same bits at every level (r = 33:
    torch's addmm_); column-major factors give the same result in the kernel."""
    gen = torch.Generator().manual_seed(n + m + r)
    mat, left, right = torch.randn(n, m, generator=gen), torch.randn(n, r, generator=gen), torch.randn(m, r, generator=gen)
    exact = mat.double() - left.double() @ right.double().T
    got = mat.clone()
    assert subtract_product(got, left, right, level=level) is got
    bound = 4 * (r + 1) * 2.0**-24 * (mat.abs().max() + r * left.abs().max() * right.abs().max()).double()
    assert (got.double() - exact).abs().max() <= bound
    assert torch.equal(got, subtract_product(mat.clone(), left, right))
    if r <= 32:  # the kernel copies column-major factors; BLAS (r = 33) may round them differently
        strided = subtract_product(mat.clone(), left.T.contiguous().T, right.T.contiguous().T, level=level)
        assert torch.equal(got, strided)


def test_subtract_product_checks_shapes() -> None:
    with pytest.raises(ValueError, match="takes factors of shapes"):
        subtract_product(torch.randn(6, 4), torch.randn(6, 2), torch.randn(5, 2))
