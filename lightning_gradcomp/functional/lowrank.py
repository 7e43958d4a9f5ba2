"""Low-rank (PowerSGD) math: matrix views of gradients, orthogonalisation, factor sizes and warm starts.

A gradient of shape ``(d0, d1, ...)`` is viewed as an ``n x m`` matrix with ``n = d0`` and
``m = d1 * d2 * ...``. A rank-``r`` approximation ``P Q^T`` needs ``(n + m) r`` numbers instead of ``n m``.

The two products of a power iteration, ``M Q`` and ``M^T P`` with a thin factor (``r`` columns), are
:func:`thin_matmul`: on contiguous fp32 CPU tensors the compiled kernel (:mod:`._native`) reads ``M`` once per
product. One core's BLAS runs these skinny shapes at a tenth of that speed (on the bench transformer's layers at rank
4: 7.4 ms against 0.27 ms for a copy of the same matrices). The kernel sums in a fixed order of its own (deterministic
on every CPU, but not BLAS's bits); PowerSGD uses it only for each rank's local contributions, which the all-reduces
then make identical, so replicas stay identical even where some ranks run without the kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.functional import _native

__all__ = [
    "adapt_factor",
    "effective_rank",
    "lowrank_numel",
    "lowrank_saves",
    "matrix_shape",
    "orthogonalize",
    "random_factor",
    "subtract_product",
    "thin_matmul",
]


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The ``(n, m)`` matrix view of a tensor shape: ``(shape[0], prod(shape[1:]))`` (``(n, 1)`` for vectors).

    Example::

        >>> matrix_shape((64, 3, 3, 3)), matrix_shape((10,)), matrix_shape(())
        ((64, 27), (10, 1), (1, 1))
    """
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), int(math.prod(shape[1:]))


def effective_rank(n: int, m: int, rank: int) -> int:
    """``rank`` clipped to ``[1, min(n, m)]``: a rank above ``min(n, m)`` cannot be represented.

    Example::

        >>> effective_rank(10, 3, 8), effective_rank(10, 3, 0)
        (3, 1)
    """
    return max(1, min(int(rank), n, m))


def lowrank_numel(n: int, m: int, rank: int) -> int:
    """Numbers sent for a rank-``rank`` factorisation of an ``n x m`` matrix: ``(n + m) * rank``.

    Example::

        >>> lowrank_numel(64, 27, 4), lowrank_numel(64, 27, 100)  # the second is capped at rank 27
        (364, 2457)
    """
    return (n + m) * effective_rank(n, m, rank)


def lowrank_saves(n: int, m: int, rank: int, min_compression_rate: float = 1.0) -> bool:
    """Whether rank ``rank`` shrinks ``n x m`` by at least ``min_compression_rate``: ``(n+m) r rate <= n m``.

    Example::

        >>> lowrank_saves(64, 27, 4), lowrank_saves(64, 27, 4, min_compression_rate=5)  # 364 of 1728 numbers
        (True, False)
    """
    return (n + m) * rank * min_compression_rate <= n * m and rank <= min(n, m)


def orthogonalize(matrix: Tensor) -> Tensor:
    """Orthonormal columns spanning (at least) the column space of ``matrix`` (fp32, ``n x r`` with ``r <= n``).

    Uses a Householder QR, which is backward stable in fp32 and never divides by a column norm: zero or
    linearly dependent columns come back as unit columns orthogonal to the others (no NaN, unlike
    Gram-Schmidt without an epsilon). The result is a deterministic function of the input.

    Raises:
        ValueError: ``matrix`` is not 2-D or has more columns than rows.

    Example::

        >>> q = orthogonalize(torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]))
        >>> q.shape, torch.allclose(q.T @ q, torch.eye(2), atol=1e-6)
        (torch.Size([3, 2]), True)
        >>> bool(torch.isfinite(orthogonalize(torch.zeros(3, 2))).all())  # zero columns: no NaN
        True
    """
    if matrix.dim() != 2 or matrix.shape[1] > matrix.shape[0]:
        raise ValueError(f"orthogonalize expects an n x r matrix with r <= n, got shape {tuple(matrix.shape)}")
    q, _ = torch.linalg.qr(matrix.to(torch.float32), mode="reduced")
    return q


def random_factor(m: int, rank: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """An orthonormal ``m x rank`` start factor drawn from ``generator`` (shared seed: same on every rank).

    Example::

        >>> f = random_factor(6, 2, torch.Generator().manual_seed(0), torch.device("cpu"))
        >>> f.shape, torch.allclose(f.T @ f, torch.eye(2), atol=1e-6)
        (torch.Size([6, 2]), True)
        >>> torch.equal(f, random_factor(6, 2, torch.Generator().manual_seed(0), torch.device("cpu")))  # same seed
        True
    """
    sample = torch.randn(m, rank, generator=generator, device=generator.device, dtype=torch.float32)
    return orthogonalize(sample).to(device)


def adapt_factor(factor: Tensor, rank: int, generator: torch.Generator) -> Tensor:
    """Resize a warm-start factor ``m x r_old`` to ``m x rank``.

    Shrinking keeps the leading columns (the dominant directions of the power iteration); growing appends
    random columns orthogonalised against the kept ones, so the warm start survives a rank change.

    Example::

        >>> gen = torch.Generator().manual_seed(0)
        >>> f = random_factor(6, 2, gen, torch.device("cpu"))
        >>> g = adapt_factor(f, 3, gen)
        >>> g.shape, torch.equal(g[:, :2], f), torch.allclose(g.T @ g, torch.eye(3), atol=1e-5)
        (torch.Size([6, 3]), True, True)
        >>> torch.equal(adapt_factor(g, 1, gen), f[:, :1])
        True
    """
    m, old = factor.shape
    if rank <= old:
        return factor[:, :rank].contiguous()
    extra = torch.randn(m, rank - old, generator=generator, device=generator.device, dtype=torch.float32)
    extra = extra.to(factor.device)
    basis = orthogonalize(factor) if old else factor
    extra = orthogonalize(extra - basis @ (basis.T @ extra))
    return torch.cat([factor, extra], dim=1)


def thin_matmul(
    mat: Tensor, factor: Tensor, out: Tensor, *, transpose: bool = False, level: Optional[int] = None
) -> Tensor:
    """``out = mat @ factor`` (``transpose``: ``mat.T @ factor``) for a 2-D ``mat`` and a thin ``factor``.

    Args:
        mat: the ``n x m`` matrix.
        factor: ``m x r`` (``n x r`` with ``transpose``).
        out: the ``n x r`` (``m x r``) result, written in place and returned.
        transpose: multiply by ``mat``'s transpose.
        level: highest kernel instruction-set level to use (tests); ``None``: the CPU's best.

    Contiguous fp32 CPU tensors with ``r`` up to the kernel's limit (32) take the compiled kernel (its own fixed
    summation order); anything else ``torch.matmul``.

    Example::

        >>> m = torch.arange(6.0).view(2, 3)
        >>> thin_matmul(m, torch.ones(3, 1), torch.empty(2, 1)).tolist()
        [[3.0], [12.0]]
        >>> thin_matmul(m, torch.ones(2, 1), torch.empty(3, 1), transpose=True).tolist()
        [[3.0], [5.0], [7.0]]
    """
    n, m = mat.shape
    r = factor.shape[1]
    inner, outer = (n, m) if transpose else (m, n)
    if factor.shape != (inner, r) or out.shape != (outer, r):
        raise ValueError(
            f"`thin_matmul` of a {n} x {m} matrix{' (transposed)' if transpose else ''} takes a factor of shape "
            f"({inner}, r) and an out of ({outer}, r), got {tuple(factor.shape)} and {tuple(out.shape)}"
        )
    kernel = _thin_kernel(r, (mat, out), (factor,))
    if kernel is None:
        return torch.matmul(mat.T if transpose else mat, factor, out=out)
    run = kernel.thin_matmul_t if transpose else kernel.thin_matmul
    factor = factor.contiguous()  # kept alive through the call
    run(mat.data_ptr(), n, m, factor.data_ptr(), r, out.data_ptr(), _native._level(kernel, level))
    return out


def _thin_kernel(r: int, direct: Sequence[Tensor], copied: Sequence[Tensor]) -> Optional[ModuleType]:
    """The compiled kernel when it can take ``r`` columns, the tensors ``direct`` as they are (contiguous fp32 CPU: it
    reads or writes them through their pointers; the first is the matrix, not empty) and ``copied`` once the caller
    has made them contiguous (fp32 CPU)."""
    if not all(t.device.type == "cpu" and t.dtype is torch.float32 for t in copied) or direct[0].numel() == 0:
        return None
    kernel = _native.for_fp32(*direct)
    return kernel if kernel is not None and 1 <= r <= kernel.thin_max else None


def subtract_product(mat: Tensor, left: Tensor, right: Tensor, *, level: Optional[int] = None) -> Tensor:
    """``mat -= left @ right.T`` in place (PowerSGD's residual ``M - P Q^T``) and return ``mat``.

    Args:
        mat: the ``n x m`` matrix, updated in place.
        left: ``n x r``.
        right: ``m x r``.
        level: highest kernel instruction-set level to use (tests); ``None``: the CPU's best.

    Contiguous fp32 CPU tensors with ``r`` up to the kernel's limit (32) take the compiled kernel, one read and write
    of ``mat`` (entry ``(i, j)`` subtracts ``sum_c left[i, c] right[j, c]``, summed in order); anything else
    ``mat.addmm_(left, right.T, alpha=-1)``.

    Example::

        >>> subtract_product(torch.ones(2, 3), torch.ones(2, 1), torch.arange(3.0).view(3, 1)).tolist()
        [[1.0, 0.0, -1.0], [1.0, 0.0, -1.0]]
    """
    n, m = mat.shape
    r = left.shape[1]
    if left.shape != (n, r) or right.shape != (m, r):
        raise ValueError(
            f"`subtract_product` of a {n} x {m} matrix takes factors of shapes ({n}, r) and ({m}, r), got "
            f"{tuple(left.shape)} and {tuple(right.shape)}"
        )
    kernel = _thin_kernel(r, (mat,), (left, right))
    if kernel is None:
        return mat.addmm_(left, right.T, alpha=-1.0)
    left, right = left.contiguous(), right.contiguous()  # kept alive through the call
    kernel.subtract_product(mat.data_ptr(), n, m, left.data_ptr(), right.data_ptr(), r, _native._level(kernel, level))
    return mat
