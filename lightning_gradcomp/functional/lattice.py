r"""Cubic-lattice (relative) quantization: low-bit codes decoded against the receiver's own vector.

A coordinate ``x`` is mapped to its lattice index ``k = round(x / s)`` (side ``s > 0``) and only
``c = k mod q`` travels, with ``q = 2**bits``. A receiver holding a reference ``y`` close to ``x``
(in SwarmSGD: its own model) recovers ``k`` as the integer congruent to ``c`` nearest to ``y / s``:

.. math::

    \hat k = c + q \cdot \mathrm{round}\big((y / s - c) / q\big).

Decoding is exact (:math:`\hat k = k`) whenever :math:`|k - y/s| < q/2`, which holds if
:math:`|x - y| + s/2 < q s / 2`; the decoded value :math:`s \hat k` is then within
:func:`lattice_error_bound` (half a side, plus float32 rounding) of ``x``. Otherwise the coordinate
*wraps* by a multiple of :math:`q s` and lands near ``y`` anyway, so a wrong decode cannot be seen from
the values: :func:`lattice_checksum` of the indices (one per block) detects it. :func:`pair_decodable`
is a per-block test both ends of an exchange evaluate on identical numbers to agree, without another
message, on which blocks *both* decodes were exact.

Arithmetic is float32 with int32 indices. :func:`lattice_sides` floors every side at ``absmax * 2**-16``
so that ``|x / s| <= 2**16``: indices are exact in float32 and rounding errors stay below ``2**-8``
lattice units, which the error bound and the 1 % safety margin of :func:`pair_decodable` absorb.
Sides are per block of coordinates: ``side`` arguments broadcast against the values (shape
``(blocks, 1)`` for values ``(blocks, block)``).

**Dithered (unbiased) rounding.** The optional ``dither`` argument of :func:`lattice_index`,
:func:`lattice_decode` and :func:`lattice_value` is a tensor ``u`` of uniform offsets in ``[-1/2, 1/2)``
(:func:`lattice_dither`, drawn from a seed both ends know) shifting the lattice per coordinate:
``k = round(x / s + u)`` and the value is ``(k - u) s``. Its error ``(k - u) s - x`` is uniform on
``[-s/2, s/2)`` and independent of ``x`` (subtractive dither), so the quantizer is unbiased; without a
dither, rounding is deterministic (nearest point, error a fixed function of ``x``: biased). The decode
condition and :func:`pair_decodable` hold unchanged with dithered values. ``dither=None`` (the default)
is the deterministic lattice, bit for bit as before.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.checks import is_int

__all__ = [
    "MAX_BLOCK",
    "lattice_checksum",
    "lattice_codes",
    "lattice_decode",
    "lattice_dither",
    "lattice_error_bound",
    "lattice_index",
    "lattice_levels",
    "lattice_sides",
    "lattice_value",
    "pair_decodable",
]

MAX_BLOCK = 2**16
"""Largest row length :func:`lattice_checksum` handles without int64 overflow."""

_MIN_SIDE = 1e-30
_RELATIVE_FLOOR = 2.0**-16
_ROUNDING = 2.0**-7
_INDEX_CLAMP = 2**20
_WEIGHT_LIMIT = 2**26
_SAFETY = 0.99
_weights_cache: dict[tuple[int, str], Tensor] = {}


def lattice_levels(bits: int) -> int:
    """Number of code values ``q = 2**bits`` (``bits`` in [1, 16]).

    Example::

        >>> lattice_levels(1), lattice_levels(4)
        (2, 16)
    """
    if not is_int(bits) or not 1 <= bits <= 16:
        raise ValueError(f"`bits` must be an integer in [1, 16], got {bits!r}")
    return 1 << bits


def lattice_sides(spread: Tensor, absmax: Tensor, bits: int, margin: float) -> Tensor:
    """Per-block sides that decode exactly for peers up to ``margin * spread`` away.

    Args:
        spread: expected ``max |x - y|`` per block (any shape; non-negative).
        absmax: ``max |x|`` per block, same shape; floors the side at ``absmax * 2**-16``.
        bits: bits per code.
        margin: safety factor (> 0) on ``spread``.

    Returns:
        float32 sides, ``max(margin * spread / (q / 2), absmax * 2**-16, 1e-30)``.

    Example::

        >>> lattice_sides(torch.tensor([1.0]), torch.tensor([10.0]), bits=4, margin=2.0).tolist()  # 2 * 1 / 8
        [0.25]
        >>> lattice_sides(torch.tensor([0.0]), torch.tensor([65536.0]), bits=4, margin=2.0).tolist()  # absmax * 2**-16
        [1.0]
    """
    half = lattice_levels(bits) / 2
    side = margin * spread.double() / half
    side = torch.maximum(side, absmax.double() * _RELATIVE_FLOOR).clamp_min(_MIN_SIDE)
    return side.float()


def lattice_dither(shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Uniform dither offsets in ``[-1/2, 1/2)`` (float32, CPU) drawn from ``generator``.

    Both ends of an exchange seed ``generator`` identically (e.g. from the shared seed, the exchange id
    and the sender's rank) to get the same offsets without sending them.

    Example::

        >>> u = lattice_dither((2, 3), torch.Generator().manual_seed(0))
        >>> u.shape, bool(((u >= -0.5) & (u < 0.5)).all())
        (torch.Size([2, 3]), True)
    """
    return torch.rand(shape, generator=generator, dtype=torch.float32) - 0.5


def lattice_index(x: Tensor, side: Tensor, dither: Optional[Tensor] = None) -> Tensor:
    """Nearest lattice index ``round(x / side)`` (int32; ties to even). Needs ``|x / side| < 2**24``.

    With ``dither`` (:func:`lattice_dither`): ``round(x / side + dither)`` (unbiased with :func:`lattice_value`).

    Example::

        >>> lattice_index(torch.tensor([0.9, -1.6, 2.5]), torch.tensor(0.5)).tolist()
        [2, -3, 5]
    """
    scaled = x.float() / side.float()
    if dither is not None:
        scaled = scaled + dither.float()
    return torch.round(scaled).to(torch.int32)


def lattice_codes(index: Tensor, bits: int) -> Tensor:
    """The transmitted part of ``index``: ``index mod 2**bits`` (uint8 for ``bits <= 8``, else int32).

    Example::

        >>> lattice_codes(torch.tensor([2, -3, 17]), 4).tolist()
        [2, 13, 1]
    """
    codes = index.to(torch.int32) & (lattice_levels(bits) - 1)
    return codes.to(torch.uint8) if bits <= 8 else codes


def lattice_decode(
    codes: Tensor, reference: Tensor, side: Tensor, bits: int, dither: Optional[Tensor] = None
) -> Tensor:
    """Recover lattice indices (int32) from ``codes`` using the receiver's ``reference``.

    Exact when ``|index - reference / side| < 2**bits / 2`` and ``|index| <= 2**20`` for every coordinate (decoded
    indices are clamped to ``+-2**20``; :func:`lattice_sides` keeps indices far below); otherwise the wrong
    coordinates are off by multiples of ``2**bits``, or clamped. ``dither``: the sender's offsets (the reference is
    shifted the same way, so the condition is unchanged).

    Example::

        >>> side = torch.tensor(0.5)
        >>> x, y = torch.tensor([10.2, -7.1]), torch.tensor([10.0, -7.4])  # the sender's and the receiver's vectors
        >>> index = lattice_index(x, side)
        >>> lattice_decode(lattice_codes(index, 4), y, side, 4).tolist(), index.tolist()
        ([20, -14], [20, -14])
    """
    q = float(lattice_levels(bits))
    c = codes.float()
    scaled = reference.float() / side.float()
    if dither is not None:
        scaled = scaled + dither.float()
    k = c + q * torch.round((scaled - c) / q)
    return k.clamp_(-_INDEX_CLAMP, _INDEX_CLAMP).to(torch.int32)


def lattice_value(index: Tensor, side: Tensor, dither: Optional[Tensor] = None) -> Tensor:
    """Lattice point ``index * side`` (float32); with ``dither``: ``(index - dither) * side``.

    Example::

        >>> lattice_value(torch.tensor([20, -14]), torch.tensor(0.5)).tolist()
        [10.0, -7.0]
        >>> lattice_value(torch.tensor([3]), torch.tensor(1.0), dither=torch.tensor([0.25])).tolist()
        [2.75]
    """
    if dither is not None:
        return (index.float() - dither.float()) * side.float()
    return index.float() * side.float()


def lattice_error_bound(side: Tensor) -> Tensor:
    """Largest ``|value - x|`` of an exact decode: ``side * (1/2 + 2**-7)`` (half a side + rounding).

    Example::

        >>> lattice_error_bound(torch.tensor([1.0, 0.5])).tolist()
        [0.5078125, 0.25390625]
    """
    return side.float() * (0.5 + _ROUNDING)


def _checksum_weights(length: int, device: torch.device) -> Tensor:
    key = (length, str(device))
    weights = _weights_cache.get(key)
    if weights is None:
        gen = torch.Generator().manual_seed(20211206)
        weights = torch.randint(1, _WEIGHT_LIMIT, (length,), generator=gen, dtype=torch.int64).to(device)
        if len(_weights_cache) > 16:
            _weights_cache.clear()
        _weights_cache[key] = weights
    return weights


def lattice_checksum(index: Tensor) -> Tensor:
    """A 31-bit checksum of ``index`` per row (over the last dimension), as int64 in ``[0, 2**31)``.

    Shape: ``index.shape[:-1]`` (one checksum per block for ``(blocks, block)`` input; 0-d for a vector).
    It folds the exact int64 sum ``sum_i w_i * index_i`` with fixed pseudo-random weights
    ``w_i < 2**26``, so a decode that wrapped (indices off by multiples of ``2**bits``) goes unnoticed
    only if the errors cancel, with probability about ``2**-26``. Exact (no overflow) for
    ``|index| <= 2**20`` and rows up to :data:`MAX_BLOCK` long.

    Example::

        >>> index = torch.tensor([[3, -1, 7], [0, 0, 0]])
        >>> checksum = lattice_checksum(index)
        >>> checksum.shape, int(checksum[1])
        (torch.Size([2]), 0)
        >>> bool(lattice_checksum(index + torch.tensor([0, 16, 0]))[0] != checksum[0])  # a wrapped coordinate shows
        True
    """
    if index.shape[-1] > MAX_BLOCK:
        raise ValueError(f"checksum rows must have at most {MAX_BLOCK} elements, got {index.shape[-1]}")
    total = (index.long() * _checksum_weights(index.shape[-1], index.device)).sum(dim=-1)
    return (total ^ (total >> 32)) & 0x7FFFFFFF


def pair_decodable(
    value_a: Tensor, value_b: Tensor, side_a: Tensor, side_b: Tensor, bits: int, valid: Optional[Tensor] = None
) -> Tensor:
    """Per block, whether each end of a pair surely decoded the other's codes exactly (symmetric in a, b).

    ``value_a = side_a * index_a`` is a's lattice point and ``x_a`` lies within
    ``e_a = lattice_error_bound(side_a)`` of it, so b's decode of a's codes (reference ``x_b``) is exact
    if ``D + e_b < (q / 2) side_a`` with ``D = max |value_a - value_b|`` over the block; this checks both
    directions with a 1 % margin. Both ends compute it on the same numbers when their own decode was
    exact (verified by :func:`lattice_checksum`), so they agree on the outcome without exchanging a flag.

    Args:
        value_a, value_b: lattice points of shape ``(blocks, block)``.
        side_a, side_b: sides broadcastable to ``(blocks, 1)``.
        bits: bits per code.
        valid: optional mask of ``value`` entries that exist (padding excluded).

    Returns:
        bool tensor of shape ``(blocks,)``.

    Example::

        >>> a, b = torch.tensor([[1.0, 2.0], [0.0, 0.0]]), torch.tensor([[1.5, 2.0], [9.0, 0.0]])
        >>> side = torch.full((2, 1), 0.5)
        >>> pair_decodable(a, b, side, side, bits=4).tolist()  # decodable up to about (16 / 2) * 0.5 = 4 apart
        [True, False]
    """
    half = lattice_levels(bits) / 2
    gap = (value_a - value_b).abs()
    if valid is not None:
        gap = torch.where(valid, gap, torch.zeros((), dtype=gap.dtype, device=gap.device))
    dist = gap.amax(dim=-1, keepdim=True).double()
    sa, sb = side_a.double(), side_b.double()
    ok = (dist + lattice_error_bound(side_b).double() <= _SAFETY * half * sa) & (
        dist + lattice_error_bound(side_a).double() <= _SAFETY * half * sb
    )
    return ok.reshape(ok.shape[:-1])
