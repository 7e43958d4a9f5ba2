"""The grid every quantizer cuts a flat tensor into: groups of ``group_size`` elements (the last one may be shorter),
the ``p``-norm of each group (its scale), the levels of a bit width and the bits of a code.

See :mod:`.quantize` for the quantizers built on it; ``alpha_p`` is DIANA's constant of the block ``p``-norm.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from lightning_gradcomp.checks import is_int, is_number

__all__ = ["alpha_p", "code_bits", "group_norms", "levels_for_bits", "num_groups", "parse_p"]

PNorm = Union[int, float, str]
"""A norm order: ``1``, ``2`` or infinity (``float("inf")``, ``"inf"``)."""


_HALF_DTYPES = (torch.float16, torch.bfloat16)
"""Inputs quantized, and values decoded, through fp32."""


def parse_p(p: PNorm) -> float:
    """Validate a norm order and return it as ``1.0``, ``2.0`` or ``inf``.

    Raises:
        ValueError: ``p`` is not 1, 2 or infinity (``"inf"`` is accepted for YAML configs).

    Example::

        >>> parse_p(2), parse_p("inf"), parse_p("L1")
        (2.0, inf, 1.0)
    """
    value: Optional[float] = None
    if isinstance(p, str):
        key = p.strip().lower().removeprefix("l")
        value = {"1": 1.0, "2": 2.0, "inf": math.inf, "infinity": math.inf}.get(key)
    elif is_number(p):
        value = float(p)
    if value not in (1.0, 2.0, math.inf):
        raise ValueError(f"`p` must be 1, 2 or inf, got {p!r}")
    return value


def levels_for_bits(bits: int) -> int:
    """Levels ``L = 2**(bits - 1) - 1`` of a symmetric ``bits``-bit stochastic quantizer (bits in [2, 8]).

    Example::

        >>> [levels_for_bits(bits) for bits in (2, 4, 8)]
        [1, 7, 127]
    """
    if not is_int(bits) or not 2 <= bits <= 8:
        raise ValueError(f"`bits` must be an integer in [2, 8], got {bits!r}")
    return (1 << (bits - 1)) - 1


def code_bits(levels: int) -> int:
    """Bits per code: 1 for scaled sign (``levels == 0``), else ``ceil(log2(2 L + 1))``.

    Example::

        >>> [code_bits(levels) for levels in (0, 1, 7, 127)]
        [1, 2, 4, 8]
    """
    if levels < 0 or levels > 127:
        raise ValueError(f"`levels` must be in [0, 127], got {levels!r}")
    return 1 if levels == 0 else (2 * levels).bit_length()


def num_groups(numel: int, group_size: int) -> int:
    """Number of groups (scales) of a ``numel``-element tensor: ``ceil(numel / group_size)``.

    Example::

        >>> num_groups(10, 4), num_groups(8, 4)
        (3, 2)
    """
    return -(-int(numel) // int(group_size))


def _grouped(x: Tensor, group_size: int) -> Tensor:
    """``x`` of shape ``(..., n)`` zero-padded to whole groups, viewed as ``(..., groups, group_size)``."""
    n = x.shape[-1]
    groups = num_groups(n, group_size)
    pad = groups * group_size - n
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], dim=-1)
    return x.reshape(*x.shape[:-1], groups, group_size)


def _ungrouped(x: Tensor, numel: int) -> Tensor:
    """Inverse of :func:`_grouped`: ``(..., groups, group_size)`` back to ``(..., numel)``."""
    return x.reshape(*x.shape[:-2], -1)[..., :numel]


def _pnorms(x: Tensor, group_size: int, p: float) -> Tensor:
    """Per-group ``p``-norms of a flat tensor, shape ``(num_groups,)``, in its dtype, over a view of the whole groups
    (no padded copy) and the short last group. ``p = 2`` is ``torch.linalg.vector_norm`` (no squared temporary); 1
    and inf are ``abs().sum()`` / ``abs().amax()``, which torch's CPU ``vector_norm`` runs 4-15x slower."""
    n = x.numel()
    full = n // group_size * group_size
    parts = [_norm_rows(x[:full].reshape(-1, group_size), p)] if full else []
    if full < n:
        parts.append(_norm_rows(x[full:].reshape(1, -1), p))
    if not parts:
        return x.new_empty(0)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _norm_rows(rows: Tensor, p: float) -> Tensor:
    """The ``p``-norm of each row of a 2-D tensor.

    A 2-norm sums squares in the rows' dtype, so finite entries can overflow it (fp32: squares beyond ``3.4e38``, i.e.
    entries from about ``1.8e19``); the rows whose norm came out infinite are computed again scaled by their largest
    magnitude (finite whenever the true norm is). Reading whether any did is one host read of the norms, made on the
    thread that quantizes (the communication thread), never the training thread. (A 1-norm overflows only for
    entries near ``3.4e38 / group_size``: not checked, so SignSGD's torch steps keep its kernel's results.)"""
    if p != 2.0:
        magnitudes = rows.abs()
        return magnitudes.amax(dim=-1) if p == math.inf else magnitudes.sum(dim=-1)
    norms = torch.linalg.vector_norm(rows, 2, dim=-1)
    overflowed = torch.isinf(norms)
    if not bool(overflowed.any()):
        return norms
    where = overflowed.nonzero().squeeze(1)
    big = rows.index_select(0, where)
    peak = big.abs().amax(dim=-1)  # Inf where the row holds an Inf: its norm stays Inf
    rescaled = torch.linalg.vector_norm(big / peak.unsqueeze(1), 2, dim=-1).mul_(peak)  # entries <= 1: no overflow
    return norms.index_copy(0, where, torch.where(torch.isfinite(peak), rescaled, norms.index_select(0, where)))


def group_norms(x: Tensor, group_size: int, p: PNorm) -> Tensor:
    """The ``p``-norm of each group of a flat tensor, shape ``(num_groups,)``, in ``x``'s dtype.

    Example::

        >>> x = torch.tensor([3.0, -4.0, 1.0])
        >>> group_norms(x, 2, 2).tolist(), group_norms(x, 2, "inf").tolist()
        ([5.0, 1.0], [4.0, 1.0])
    """
    return _pnorms(x.reshape(-1), int(group_size), parse_p(p))


def alpha_p(d: int, p: PNorm) -> float:
    r"""DIANA's ``alpha_p(d) = inf_{x != 0} ||x||_2^2 / (||x||_1 ||x||_p)`` for blocks of ``d`` elements.

    ``alpha_1 = 1/d``, ``alpha_2 = 1/sqrt(d)``, ``alpha_inf = 2 / (1 + sqrt(d))``. The block quantizer's
    variance parameter is ``omega = 1/alpha_p - 1``, and DIANA's shift step must satisfy
    ``0 < alpha <= alpha_p``.

    Example::

        >>> alpha_p(4, 1), alpha_p(4, 2), alpha_p(9, "inf")
        (0.25, 0.5, 0.5)
    """
    if not is_int(d) or d < 1:
        raise ValueError(f"`d` must be a positive integer, got {d!r}")
    p = parse_p(p)
    if p == 1.0:
        return 1.0 / d
    if p == 2.0:
        return 1.0 / math.sqrt(d)
    return 2.0 / (1.0 + math.sqrt(d))
