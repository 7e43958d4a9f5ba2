r"""Layer-wise allocation (L-GreCo): per-candidate error/size tables and the exact knapsack solver.

L-GreCo (Markov et al., MLSys 2024) picks one compression parameter per layer so that the total size is
minimal while the total compression error stays within a budget:

.. math::  \min_{c_1..c_L} \sum_l s_l(c_l) \quad \text{s.t.} \quad \sum_l e_l(c_l) \le E

Errors are **un-squared** Frobenius norms ``||A - C(A)||`` of the layer's error-compensated gradient ``A``,
as in the paper's code. Sizes are bytes; any per-family constant factor (all-reduce vs all-gather) scales
every candidate alike and does not change the choice.

Error tables (one statistic tensor ``A`` per layer, no process group):

* low rank: ``e(r) = sqrt(sum_{i>r} sigma_i^2)`` (best rank-``r`` error, Eckart-Young), all ranks from one
  eigen-decomposition; size ``4 (n + m) r``.
* top-k: ``e(k) = sqrt(sum of all but the k largest A_i^2)``, all ``k`` from one sort; size ``k (value +
  index bytes)`` (local top-k: 4 + 4; CLT-k-style shared indices cost the same per ``k``, up to a factor).
* random-k (unscaled, shared support): expected ``e(k) = sqrt(1 - k/n) ||A||``; size ``k * value bytes``.
* QSGD ``b`` bits (stochastic rounding to ``L = 2**(b-1) - 1`` levels per sign, blocks scaled by their
  max or L2 norm): the exact expected error ``sqrt(sum_i (s/L)^2 f_i (1 - f_i))``, ``f_i`` the fractional part of
  ``L |A_i| / s``; size ``numel * b / 8`` plus one 4-byte scale per block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import torch
from torch import Tensor

from lightning_gradcomp.checks import is_int, is_number, renamed_keywords
from lightning_gradcomp.functional.lowrank import matrix_shape
from lightning_gradcomp.functional.quantization_groups import PNorm, levels_for_bits
from lightning_gradcomp.functional.stochastic_rounding import quantization_variance

__all__ = [
    "error_units",
    "feedback_errors",
    "lowrank_errors",
    "lowrank_sizes",
    "quantization_errors",
    "quantized_sizes",
    "randomk_errors",
    "solve_layerwise",
    "solve_or_uniform",
    "sparse_sizes",
    "topk_errors",
]


# ---------------------------------------------------------------------------------------------- solver
def error_units(errors: Sequence[float], max_error: float, resolution: int) -> list[int]:
    """Errors in integer units of ``max_error / resolution``, rounded **up** exactly (rational arithmetic).

    ``units * max_error / resolution >= error`` holds exactly for every returned value, so a set of
    candidates whose units add up to at most ``resolution`` truly satisfies ``sum(errors) <= max_error``.
    A non-finite error, or one that exceeds the whole budget, maps to ``resolution + 1`` (never fits).

    Example::

        >>> error_units([0.0, 0.25, 0.3, 2.0, float("nan")], max_error=1.0, resolution=100)
        [0, 25, 30, 101, 101]
    """
    over = resolution + 1
    out = []
    for e in errors:
        e = float(e)
        if not math.isfinite(e):
            out.append(over)
        elif e == 0.0 or max_error == math.inf:
            out.append(0)
        elif max_error <= 0.0:
            out.append(over)
        else:
            units = math.ceil(Fraction(e) * resolution / Fraction(max_error))
            out.append(min(units, over))
    return out


def _validate(
    sizes: Sequence[Sequence[float]], errors: Sequence[Sequence[float]], max_error: float, resolution: int
) -> None:
    if not is_int(resolution) or resolution < 1:
        raise ValueError(f"`resolution` must be an integer >= 1, got {resolution!r}")
    if not is_number(max_error) or math.isnan(max_error):
        raise ValueError(f"`max_error` must be a number (not NaN), got {max_error!r}")
    if len(sizes) != len(errors):
        raise ValueError(f"`sizes` and `errors` must list the same layers, got {len(sizes)} and {len(errors)}")
    for layer, (s, e) in enumerate(zip(sizes, errors)):
        if len(s) != len(e) or len(s) == 0:
            raise ValueError(
                f"layer {layer}: `sizes` and `errors` need the same, non-zero number of candidates, "
                f"got {len(s)} and {len(e)}"
            )
        if any(math.isnan(float(x)) or float(x) < 0 for x in s):
            raise ValueError(
                f"layer {layer}: `sizes` must be >= 0 (inf marks a candidate never to pick), got {list(s)}"
            )
        if any(float(x) < 0 for x in e):
            raise ValueError(
                f"layer {layer}: `errors` must be >= 0 (NaN/inf mark a candidate never to pick), got {list(e)}"
            )


def solve_layerwise(
    sizes: Sequence[Sequence[float]], errors: Sequence[Sequence[float]], max_error: float, resolution: int = 10_000
) -> list[int]:
    """One candidate per layer minimising the total size subject to the total error ``<= max_error``.

    Dynamic programming over error units (``O(layers * candidates * resolution)``): each error is discretised
    into units of ``max_error / resolution``, rounded up (:func:`error_units`), so every answer truly satisfies
    ``sum_l errors[l][c_l] <= max_error``, and it is optimal among assignments whose rounded units fit in
    ``resolution``. Candidates with a NaN/inf error or an inf size are never chosen. Ties go to the lowest
    candidate index. Keep ``resolution`` at 100 x the number of layers or more so rounding wastes little budget.

    Args:
        sizes: ``sizes[l][c]``: bytes of candidate ``c`` for layer ``l`` (>= 0).
        errors: ``errors[l][c]``: error of candidate ``c`` for layer ``l`` (>= 0).
        max_error: the error budget (>= 0; ``inf`` means unconstrained).
        resolution: number of error units in the budget (integer >= 1).

    Returns:
        The chosen candidate index of every layer (``[]`` for no layers).

    Raises:
        ValueError: malformed input, or no assignment fits the budget.

    Example::

        >>> sizes, errors = [[100, 10], [100, 10]], [[0.0, 1.0], [0.0, 3.0]]
        >>> solve_layerwise(sizes, errors, max_error=1.0)  # only layer 0 can afford its small candidate
        [1, 0]
        >>> solve_layerwise(sizes, errors, max_error=4.0)
        [1, 1]
    """
    _validate(sizes, errors, max_error, resolution)
    if max_error < 0:
        raise ValueError(f"no assignment fits: the error budget {max_error!r} is negative")
    budget = resolution
    best = torch.zeros(budget + 1, dtype=torch.float64)  # min size of the layers so far with units <= b
    picks: list[Tensor] = []
    units_table = [error_units(e, float(max_error), resolution) for e in errors]
    for layer_sizes, units in zip(sizes, units_table):
        new = torch.full((budget + 1,), math.inf, dtype=torch.float64)
        pick = torch.full((budget + 1,), -1, dtype=torch.int64)
        for c, (size, u) in enumerate(zip(layer_sizes, units)):
            if u > budget or not math.isfinite(float(size)):
                continue
            cand = torch.full((budget + 1,), math.inf, dtype=torch.float64)
            cand[u:] = best[: budget + 1 - u] + float(size)
            better = cand < new
            new = torch.where(better, cand, new)
            pick = torch.where(better, torch.full_like(pick, c), pick)
        best = new
        picks.append(pick)
    if not math.isfinite(float(best[budget])):
        raise ValueError(
            f"no assignment of the {len(sizes)} layers fits the error budget {max_error!r} (at resolution {resolution})"
        )
    choice = [0] * len(sizes)
    b = budget
    for layer in range(len(sizes) - 1, -1, -1):
        c = int(picks[layer][b])
        choice[layer] = c
        b -= units_table[layer][c]
    return choice


def solve_or_uniform(
    sizes: Sequence[Sequence[float]],
    errors: Sequence[Sequence[float]],
    uniform: Sequence[int],
    max_error: float,
    resolution: int = 10_000,
) -> tuple[list[int], bool]:
    """:func:`solve_layerwise`, or the ``uniform`` assignment whenever it truly fits and the solver's is dearer or
    missing: ``(choice, whether it is the uniform fallback)``.

    Rounding errors up makes the solver conservative, so a budget equal to the uniform setting's own error
    usually excludes that setting from the solver's answers; it is still a valid (and sometimes the cheapest)
    answer.

    Raises:
        ValueError: malformed input (as :func:`solve_layerwise`, or ``uniform`` not one valid index per layer), or
            neither the solver nor the uniform assignment fits ``max_error``.

    Example::

        >>> sizes, errors = [[100, 10], [100, 10]], [[0.0, 1.0], [0.0, 3.0]]
        >>> solve_or_uniform(sizes, errors, uniform=[0, 0], max_error=1.0)
        ([1, 0], False)
        >>> solve_or_uniform([[4.0]] * 3, [[1.0]] * 3, uniform=[0, 0, 0], max_error=3.0, resolution=2)  # units of 1.5
        ([0, 0, 0], True)
    """
    _validate(sizes, errors, max_error, resolution)  # before the fallback, so malformed input is never masked
    uniform = list(uniform)
    if len(uniform) != len(sizes) or any(not 0 <= c < len(s) for c, s in zip(uniform, sizes)):
        raise ValueError(f"`uniform` must give one candidate index per layer ({len(sizes)} layers), got {uniform}")
    uniform_fits = sum(e[c] for e, c in zip(errors, uniform)) <= max_error
    try:
        picks = solve_layerwise(sizes, errors, max_error, resolution)
    except ValueError:
        if uniform_fits:
            return uniform, True
        raise
    if uniform_fits and sum(s[c] for s, c in zip(sizes, picks)) > sum(s[c] for s, c in zip(sizes, uniform)):
        return uniform, True
    return picks, False


# ---------------------------------------------------------------------------------------------- sizes
def lowrank_sizes(shape: Sequence[int], ranks: Sequence[int], value_bytes: int = 4) -> list[float]:
    """Bytes of the factors ``P`` and ``Q`` per rank: ``value_bytes * (n + m) * r`` (``inf`` above ``min(n, m)``).

    Example::

        >>> lowrank_sizes((64, 3, 3, 3), [1, 4, 100])  # rank 100 > min(64, 27): never chosen
        [364.0, 1456.0, inf]
    """
    n, m = matrix_shape(shape)
    return [float(value_bytes * (n + m) * r) if 1 <= r <= min(n, m) else math.inf for r in ranks]


def sparse_sizes(ks: Sequence[int], value_bytes: int = 4, index_bytes: int = 4) -> list[float]:
    """Bytes of ``k`` kept entries: ``k * (value_bytes + index_bytes)``.

    Example::

        >>> sparse_sizes([10, 100]), sparse_sizes([10], value_bytes=2, index_bytes=2)
        ([80.0, 800.0], [40.0])
    """
    return [float(k * (value_bytes + index_bytes)) for k in ks]


@renamed_keywords(bucket_size="group_size")
def quantized_sizes(numel: int, bits: Sequence[int], group_size: int, scale_bytes: int = 4) -> list[float]:
    """Bytes of ``numel`` codes of ``b`` bits (packed) plus one scale per group of ``group_size`` elements
    (``bucket_size=``: its deprecated name).

    Example::

        >>> quantized_sizes(1000, [2, 4], group_size=512)  # 250 or 500 bytes of codes + 2 scales
        [258.0, 508.0]
    """
    blocks = -(-numel // group_size)
    return [float(-(-numel * b // 8) + blocks * scale_bytes) for b in bits]


# ---------------------------------------------------------------------------------------------- errors
def feedback_errors(errors: Sequence[float], norm: float) -> list[float]:
    """Steady-state error-feedback residuals ``e / (1 - e / ||A||)`` of compression errors ``e`` of ``A``.

    If a compressor leaves a fraction ``q = e / ||A||`` of every input's norm, error feedback's memory obeys
    ``||m'|| <= q (||m|| + ||g||)``, whose fixed point is ``||m|| = q ||g|| / (1 - q) = e / (1 - q)`` with
    ``||g|| = ||A||``. Unlike ``e`` (which saturates at ``||A||``), this grows without bound as ``q -> 1``: it
    is what a starved layer costs under error feedback. ``q >= 1`` maps to ``inf`` (never chosen); a zero
    ``norm`` maps every error to 0.

    Example::

        >>> feedback_errors([0.0, 0.5, 1.0], norm=1.0)
        [0.0, 1.0, inf]
    """
    norm = float(norm)
    if norm <= 0.0:
        return [0.0 for _ in errors]
    out = []
    for e in errors:
        e = float(e)
        q = e / norm
        out.append(e / (1.0 - q) if q < 1.0 else math.inf)
    return out


def lowrank_errors(matrix: Tensor, ranks: Sequence[int]) -> list[float]:
    """Best rank-``r`` approximation errors ``sqrt(sum_{i>r} sigma_i^2)`` of ``matrix`` (any shape: ``(n, -1)``).

    One float64 eigen-decomposition of the smaller Gram matrix gives every rank at once.

    Example::

        >>> lowrank_errors(torch.diag(torch.tensor([3.0, 4.0])), [0, 1, 2])  # singular values 4 and 3
        [5.0, 3.0, 0.0]
    """
    n, m = matrix_shape(matrix.shape)
    a = matrix.detach().reshape(n, m).to(torch.float64)
    gram = a @ a.T if n <= m else a.T @ a
    eig = torch.linalg.eigvalsh(gram).clamp_min(0).flip(0)  # descending sigma_i^2
    tail = eig.flip(0).cumsum(0).flip(0)  # tail[i] = sum_{j >= i} sigma_j^2
    k = eig.numel()
    return [math.sqrt(float(tail[r])) if r < k else 0.0 for r in ranks]


def topk_errors(x: Tensor, ks: Sequence[int]) -> list[float]:
    """Errors of keeping the ``k`` largest ``|x_i|``: ``sqrt`` of the sum of the other squares (one sort).

    Example::

        >>> topk_errors(torch.tensor([3.0, -4.0, 0.0]), [0, 1, 3])
        [5.0, 3.0, 0.0]
    """
    sq = x.detach().reshape(-1).to(torch.float64).square().sort(descending=True).values
    tail = sq.flip(0).cumsum(0).flip(0)
    return [math.sqrt(float(tail[k])) if k < sq.numel() else 0.0 for k in ks]


def randomk_errors(x: Tensor, ks: Sequence[int]) -> list[float]:
    """Expected (root-mean-square) errors of keeping ``k`` uniformly random entries unscaled: ``sqrt(1-k/n)||x||``.

    Example::

        >>> randomk_errors(torch.tensor([3.0, 4.0, 0.0, 0.0]), [0, 3, 4])
        [5.0, 2.5, 0.0]
    """
    n = x.numel()
    norm_sq = float(x.detach().to(torch.float64).square().sum())
    return [math.sqrt(max(0.0, 1.0 - min(k, n) / n) * norm_sq) if n else 0.0 for k in ks]  # empty: no error


@renamed_keywords(bucket_size="group_size")
def quantization_errors(x: Tensor, bits: Sequence[int], group_size: int, p: PNorm = "inf") -> list[float]:
    """Exact root-mean-square errors of QSGD with ``b`` bits (``L = 2**(b-1) - 1`` levels) for each ``b``.

    Uses :func:`~lightning_gradcomp.functional.quantize.quantization_variance` (the expected squared error of
    :func:`~lightning_gradcomp.functional.quantize.qsgd_quantize`, scale = ``p``-norm of each group of
    ``group_size`` elements; ``bucket_size=``: its deprecated name), so the table is deterministic:
    ``e(b) = sqrt(sum_i (s/L)^2 f_i (1 - f_i))``.

    Example::

        >>> [round(e, 4) for e in quantization_errors(torch.tensor([1.0, 0.5, 0.0, 0.0]), [2, 8], group_size=4)]
        [0.5, 0.0039]
    """
    flat = x.detach().reshape(-1)
    return [math.sqrt(float(quantization_variance(flat, levels_for_bits(int(b)), group_size, p).sum())) for b in bits]
