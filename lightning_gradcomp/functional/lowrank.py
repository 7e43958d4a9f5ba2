"""Low-rank (PowerSGD) math: matrix views of gradients, orthogonalisation, factor sizes and warm starts.

A gradient of shape ``(d0, d1, ...)`` is viewed as an ``n x m`` matrix with ``n = d0`` and
``m = d1 * d2 * ...``. A rank-``r`` approximation ``P Q^T`` needs ``(n + m) r`` numbers instead of ``n m``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "adapt_factor",
    "effective_rank",
    "lowrank_numel",
    "lowrank_saves",
    "matrix_shape",
    "orthogonalize",
    "random_factor",
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
