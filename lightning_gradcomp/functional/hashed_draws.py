"""Counter-based uniform draws in ``[0, 1)`` (:func:`hashed_uniform`): entry ``i`` depends only on ``i`` and a 64-bit
key, so the draws of stochastic rounding on the CPU cost no serial generator pass (see :mod:`.quantize`)."""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

__all__ = ["hashed_uniform"]

_MASK32 = 0xFFFFFFFF
_MIX1, _MIX2 = 0x21F0AAAD, 0x735A2D97
"""Multipliers of the 32-bit mixing function of :func:`hashed_uniform` (C. Wellons' ``lowbias32`` search)."""


def _mix32(x: Tensor) -> Tensor:
    """The 32-bit integer hash ``mix`` of :func:`hashed_uniform` on int64 tensors holding values below 2**32
    (the products stay below 2**63, so nothing overflows)."""
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX2) & _MASK32
    return x ^ (x >> 15)


def hashed_uniform(
    numel: int, key: int, *, dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu"
) -> Tensor:
    """Counter-based uniform draws in ``[0, 1)``: entry ``i`` of the result depends only on ``i`` and ``key``.

    With ``k0``, ``k1`` the low and high 32 bits of ``key`` (read as unsigned 64-bit) and ``i = hi * 2**32 + lo``:
    ``u_i = (mix(mix(lo ^ k0) ^ ((k1 + hi) mod 2**32)) >> 8) * 2**-24``, where ``mix`` is a 32-bit integer
    hash (``x ^= x >> 16; x *= 0x21f0aaad; x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15``). Values are
    multiples of ``2**-24`` below 1, as ``torch.rand`` gives in fp32. The compiled kernel computes the same
    bits in registers (stochastic rounding of a CPU tensor never materializes them).

    Args:
        numel: number of draws.
        key: any integer (taken modulo ``2**64``).
        dtype: floating dtype of the result (the values are exact in every float dtype but fp16/bf16).
        device: device of the result.

    Example::

        >>> u = hashed_uniform(4, 12345)
        >>> bool(((u >= 0) & (u < 1)).all()), torch.equal(u, hashed_uniform(4, 12345))
        (True, True)
        >>> torch.equal(u, hashed_uniform(4, 1))  # another key, other draws
        False
        >>> torch.equal(hashed_uniform(3, 7), hashed_uniform(10, 7)[:3])  # a prefix does not depend on numel
        True
    """
    return _hashed_draws(torch.arange(int(numel), dtype=torch.int64, device=device), key).to(dtype)


def _hashed_draws(index: Tensor, key: int) -> Tensor:
    """The fp32 draws of :func:`hashed_uniform` at the int64 positions ``index`` (any shape, values >= 0)."""
    key = int(key) % (1 << 64)
    lo, hi = index & _MASK32, index >> 32
    h = _mix32(_mix32(lo ^ (key & _MASK32)) ^ ((hi + (key >> 32)) & _MASK32))
    return (h >> 8).to(torch.float32) * 2.0**-24


def _draw_key(generator: torch.Generator) -> int:
    """One 64-bit key for :func:`hashed_uniform` from a CPU ``generator`` (advances it by one draw)."""
    return int(torch.randint(-(1 << 63), (1 << 63) - 1, (1,), generator=generator, dtype=torch.int64)) % (1 << 64)
