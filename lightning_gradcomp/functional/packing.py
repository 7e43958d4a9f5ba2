"""Bit packing: integer codes of 1 to 8 bits per element into ``uint8`` bytes and back.

Codes are packed little-endian along the last dimension: element ``i`` occupies bits
``[i * bits, (i + 1) * bits)`` of the bit stream, bit 0 being the least significant bit of byte 0.
Widths that divide 8 (1, 2, 4, 8) use a fast path (NumPy's ``packbits`` for 1 bit on CPU); other widths
(3, 5, 6, 7) go through a bit stream.
Everything is vectorized (the only Python loops run over bit positions, at most 8), and leading
dimensions are batch dimensions, so ``W`` received payloads unpack in one call. With the optional compiled
kernel of :mod:`._native`, 2- and 4-bit codes of up to two dimensions on CPU pack and unpack in one call
(the same bytes and codes).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from lightning_gradcomp.checks import is_int
from lightning_gradcomp.functional import _native

__all__ = ["pack_bits", "packed_nbytes", "unpack_bits"]


def _check_bits(bits: int) -> int:
    if not is_int(bits) or not 1 <= bits <= 8:
        raise ValueError(f"`bits` must be an integer in [1, 8], got {bits!r}")
    return bits


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits occupy once packed: ``ceil(numel * bits / 8)``.

    Example::

        >>> packed_nbytes(10, 3), packed_nbytes(8, 1), packed_nbytes(5, 8)
        (4, 1, 5)
    """
    return (int(numel) * _check_bits(bits) + 7) // 8


def _pad_last(x: Tensor, multiple: int) -> Tensor:
    extra = (-x.shape[-1]) % multiple
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-1], extra)], dim=-1)


def _rows(x: Tensor, bits: int) -> Optional[tuple[int, int]]:
    """``(rows, row stride)`` of a CPU ``uint8`` tensor the kernel can (un)pack at ``bits``, else ``None``."""
    if bits not in (2, 4) or x.device.type != "cpu" or not 1 <= x.dim() <= 2 or (x.shape[-1] > 1 and x.stride(-1) != 1):
        return None
    if x.dim() == 1:
        return 1, 0
    return x.shape[0], x.stride(0)


def _pack_divisor(codes: Tensor, bits: int) -> Tensor:
    per = 8 // bits
    rows = _rows(codes, bits)
    if rows is not None and (kernel := _native.load()) is not None:
        n = codes.shape[-1]
        out = torch.empty(*codes.shape[:-1], -(-n // per), dtype=torch.uint8)
        kernel.pack(codes.data_ptr(), rows[0], n, rows[1], bits, out.data_ptr())
        return out
    if bits == 1 and codes.device.type == "cpu" and codes.dim() >= 1:
        packed = np.packbits(codes.contiguous().numpy(), axis=-1, bitorder="little")  # fast path on CPU
        return torch.from_numpy(packed)
    grouped = _pad_last(codes, per).reshape(*codes.shape[:-1], -1, per)
    out = grouped[..., 0].clone()
    for k in range(1, per):  # loops over bit positions (< 8), never over elements
        out |= grouped[..., k] << (bits * k)
    return out


def _unpack_divisor(packed: Tensor, bits: int, numel: int) -> Tensor:
    per = 8 // bits
    rows = _rows(packed, bits)
    if rows is not None and (kernel := _native.load()) is not None:
        out = torch.empty(*packed.shape[:-1], numel, dtype=torch.uint8)
        kernel.unpack(packed.data_ptr(), rows[0], rows[1], bits, numel, out.data_ptr())
        return out
    if bits == 1 and packed.device.type == "cpu":
        unpacked = np.unpackbits(packed.contiguous().numpy(), axis=-1, count=numel, bitorder="little")
        return torch.from_numpy(unpacked)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :numel]


def pack_bits(codes: Tensor, bits: int, *, check: bool = True) -> Tensor:
    """Pack integer ``codes`` (values in ``[0, 2**bits)``) along the last dimension.

    Args:
        codes: integer tensor of shape ``(..., n)``.
        bits: width of one code, 1 to 8.
        check: verify that every code fits in ``bits`` bits (one pass over the codes and a device-to-host
            sync). Callers whose codes are in range by construction (the quantized compressors) pass
            ``False``; an out-of-range code then corrupts the packed bytes instead of raising.

    Returns:
        ``uint8`` tensor of shape ``(..., packed_nbytes(n, bits))``.

    Raises:
        ValueError: ``bits`` out of range, or a code does not fit in ``bits`` bits.
        TypeError: ``codes`` is not an integer tensor.

    Example::

        >>> pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist()  # 1 + (2 << 2) + (3 << 4) + (0 << 6)
        [57]
        >>> pack_bits(torch.tensor([[5, 7, 1], [0, 6, 2]]), 3).shape  # leading dimensions are batch dimensions
        torch.Size([2, 2])
    """
    _check_bits(bits)
    if codes.dtype.is_floating_point or codes.dtype.is_complex:
        raise TypeError(f"`codes` must be an integer tensor, got {codes.dtype}")
    if codes.dim() == 0:
        codes = codes.reshape(1)
    if codes.dtype == torch.bool:
        codes = codes.to(torch.uint8)
    if check and codes.numel():
        low, high = torch.aminmax(codes)
        if int(low) < 0 or int(high) >= (1 << bits):
            raise ValueError(f"codes must lie in [0, {1 << bits}) for bits={bits}")
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.clone()
    if 8 % bits == 0:
        return _pack_divisor(codes, bits)
    shifts = torch.arange(bits, dtype=torch.uint8, device=codes.device)
    stream = ((codes.unsqueeze(-1) >> shifts) & 1).reshape(*codes.shape[:-1], codes.shape[-1] * bits)
    return _pack_divisor(stream, 1)


def unpack_bits(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes of each row, as ``uint8``.

    Args:
        packed: ``uint8`` tensor of shape ``(..., nbytes)`` with ``nbytes >= packed_nbytes(numel, bits)``.
        bits: width of one code, 1 to 8.
        numel: number of codes per row.

    Returns:
        ``uint8`` tensor of shape ``(..., numel)``.

    Example::

        >>> codes = torch.tensor([5, 0, 7, 3, 1])
        >>> unpack_bits(pack_bits(codes, 3), 3, numel=5).tolist()
        [5, 0, 7, 3, 1]
    """
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"`packed` must be a uint8 tensor, got {packed.dtype}")
    need = packed_nbytes(numel, bits)
    if packed.shape[-1] < need:
        raise ValueError(f"{numel} codes of {bits} bits need {need} bytes, got {packed.shape[-1]}")
    packed = packed[..., :need]
    if bits == 8:
        return packed.clone()
    if 8 % bits == 0:
        return _unpack_divisor(packed, bits, numel)
    stream = _unpack_divisor(packed, 1, numel * bits).reshape(*packed.shape[:-1], numel, bits)
    weights = (1 << torch.arange(bits, device=packed.device)).to(torch.uint8)
    return (stream * weights).sum(dim=-1, dtype=torch.uint8)
