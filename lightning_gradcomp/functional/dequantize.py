"""Quantized tensors and their decoding: :class:`Quantized` (codes, one per byte or still bit-packed in a received
payload, and per-group scales), :func:`dequantize`, :func:`dequantize_add` (decode and add in one pass) and
:func:`rows_mean` (the mean of decoded rows), on the compiled CPU kernel or the torch steps, bit for bit alike (see
:mod:`.quantize`)."""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from lightning_gradcomp.functional import _native
from lightning_gradcomp.functional.axpy import add_scaled
from lightning_gradcomp.functional.packing import packed_nbytes, unpack_bits
from lightning_gradcomp.functional.quantization_groups import _HALF_DTYPES, _grouped, _ungrouped, code_bits, num_groups

__all__ = ["Quantized", "dequantize", "dequantize_add", "rows_mean"]


class Quantized(NamedTuple):
    """Codes and scales of a quantized flat tensor.

    Attributes:
        codes: ``uint8`` codes, shape ``(..., n)``, values in ``[0, 2**code_bits(levels))``; or, when ``numel`` is
            set, rows of codes *bit-packed* ``bits`` wide (as :func:`.packing.pack_bits` writes them), of which this
            tensor holds the codes ``first, ..., first + numel - 1`` of each row (a view into a received payload).
        scales: fp32 scales, shape ``(..., num_groups(n, group_size))``.
        levels: ``L >= 1`` for stochastic rounding, ``0`` for scaled sign.
        group_size: elements sharing one scale.
        numel: ``None`` (one code per byte), or the number of bit-packed codes per row.
        first: index of the first packed code in each row of ``codes`` (only with ``numel``).

    Example::

        >>> q = Quantized(torch.tensor([0, 1, 2], dtype=torch.uint8), torch.tensor([4.0]), levels=1, group_size=3)
        >>> q.bits, q.decode().tolist()
        (2, [-4.0, 0.0, 4.0])
        >>> packed = Quantized(torch.tensor([0b100100], dtype=torch.uint8), torch.tensor([4.0]), 1, 3, numel=3)
        >>> packed.decode().tolist(), packed.unpacked().codes.tolist()
        ([-4.0, 0.0, 4.0], [0, 1, 2])
    """

    codes: Tensor
    scales: Tensor
    levels: int
    group_size: int
    numel: Optional[int] = None
    first: int = 0

    @property
    def bits(self) -> int:
        """Bits per code on the wire."""
        return code_bits(self.levels)

    @property
    def size(self) -> int:
        """Codes per row (``n``)."""
        return self.codes.shape[-1] if self.numel is None else self.numel

    def unpacked(self) -> Quantized:
        """The same codes one per byte (``self`` when they already are)."""
        if self.numel is None:
            return self
        codes = unpack_bits(self.codes, self.bits, self.first + self.numel)[..., self.first :]
        return Quantized(codes, self.scales, self.levels, self.group_size)

    def decode(self, dtype: torch.dtype = torch.float32, out: Optional[Tensor] = None) -> Tensor:
        """The dequantized tensor, shape ``(..., n)`` (written into ``out`` when given, see :func:`dequantize`)."""
        return _decode(self, dtype, out)

    def decode_add(
        self, base: Tensor, alpha: float, out: Tensor, alpha2: Optional[float] = None, out2: Optional[Tensor] = None
    ) -> None:
        """``out = base + alpha * decode()`` (and ``out2 = base + alpha2 * decode()``), see :func:`dequantize_add`."""
        _decode_add(self, base, alpha, out, alpha2, out2)


def dequantize(
    codes: Tensor,
    scales: Tensor,
    levels: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
    out: Optional[Tensor] = None,
) -> Tensor:
    """Decode codes ``(..., n)`` with per-group scales ``(..., G)`` into values ``(..., n)`` of ``dtype``.

    ``out`` (optional): a tensor of that shape and dtype to write the values into (returned); the compiled
    kernel writes a contiguous fp32 ``out`` directly, saving a fresh allocation and a copy.

    Example::

        >>> codes = torch.tensor([0, 1, 2, 2], dtype=torch.uint8)
        >>> dequantize(codes, torch.tensor([4.0, 1.0]), levels=1, group_size=2).tolist()
        [-4.0, 0.0, 1.0, 1.0]
        >>> buffer = torch.empty(4)
        >>> dequantize(codes, torch.tensor([4.0, 1.0]), 1, 2, out=buffer) is buffer
        True
    """
    return _decode(Quantized(codes, scales, levels, group_size), dtype, out)


def _decode(q: Quantized, dtype: torch.dtype, out: Optional[Tensor], level: Optional[int] = None) -> Tensor:
    """:func:`dequantize` of ``q`` (its codes packed or not)."""
    shape = (*q.codes.shape[:-1], q.size)
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype):
        raise ValueError(f"`out` must be {dtype} of shape {shape}, got {out.dtype} {tuple(out.shape)}")
    if dtype is torch.float32 and _native_codes(q):
        kernel = _native.load()
        if kernel is not None:
            direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
            values = _dequantize_native(kernel, q, out=out if direct else None, level=level)
            return values if out is None or direct else out.copy_(values)
    q = q.unpacked()
    n = q.codes.shape[-1]
    work = torch.float32 if dtype in _HALF_DTYPES else dtype  # 16 bits: an fp32 scale cast first could overflow
    values = _grouped(q.codes, q.group_size).to(work)
    if q.levels == 0:
        step = q.scales.to(work).unsqueeze(-1)
        result = _ungrouped(values.mul_(2.0).sub_(1.0).mul_(step), n)
    else:
        step = (q.scales.to(work) / float(q.levels)).unsqueeze(-1)
        result = _ungrouped(values.sub_(float(q.levels)).mul_(step), n)
    result = result.to(dtype)
    return result if out is None else out.copy_(result)


def dequantize_add(
    codes: Tensor,
    scales: Tensor,
    levels: int,
    group_size: int,
    base: Tensor,
    alpha: float,
    out: Tensor,
    alpha2: Optional[float] = None,
    out2: Optional[Tensor] = None,
    level: Optional[int] = None,
) -> None:
    """``out = base + alpha * d`` (and ``out2 = base + alpha2 * d`` when given), ``d`` the decoded 1-D ``codes``.

    Each entry is ``torch.add(base, d, alpha=alpha)`` to the bit (one fused multiply-add, as torch's AVX2 and
    AVX-512 kernels compute it). The compiled kernel never writes ``d`` out: one pass reads the codes and ``base``
    and writes the outputs (fp32, contiguous, ``codes``' length; ``out`` may be ``base`` itself). Otherwise ``d``
    is decoded by :func:`dequantize` and added by :func:`~.axpy.add_scaled` (torch's ``add`` bits).

    Example::

        >>> codes, out = torch.tensor([0, 1, 2], dtype=torch.uint8), torch.empty(3)
        >>> dequantize_add(codes, torch.tensor([4.0]), 1, 3, torch.ones(3), 0.5, out)
        >>> out.tolist()
        [-1.0, 1.0, 3.0]
    """
    _decode_add(Quantized(codes, scales, levels, group_size), base, alpha, out, alpha2, out2, level)


def _decode_add(
    q: Quantized,
    base: Tensor,
    alpha: float,
    out: Tensor,
    alpha2: Optional[float] = None,
    out2: Optional[Tensor] = None,
    level: Optional[int] = None,
) -> None:
    """:func:`dequantize_add` of ``q`` (its codes packed or not)."""
    n = q.size
    outputs = [out] if out2 is None else [out, out2]
    for tensor in (base, *outputs):
        if tensor.dtype != torch.float32 or tensor.shape != (n,):
            raise ValueError(
                f"`base` and the outputs must be fp32 of shape {(n,)}, got {tensor.dtype} {tuple(tensor.shape)}"
            )
    if (
        q.codes.dim() == 1
        and _native_codes(q)
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (base, *outputs))
    ):
        kernel = _native.load()
        if kernel is not None:
            bits, first = _storage(q)
            kernel.dequantize_add(
                q.codes.data_ptr(), bits, first, n, q.scales.data_ptr(), q.group_size, q.levels, base.data_ptr(),
                float(alpha), out.data_ptr(), 0.0 if alpha2 is None else float(alpha2),
                0 if out2 is None else out2.data_ptr(), _native._level(kernel, level),
            )  # fmt: skip
            return
    add_scaled(_decode(q, torch.float32, None), base, alpha, out, alpha2, out2, level=level)


def rows_mean(q: Quantized, out: Optional[Tensor] = None, level: Optional[int] = None) -> Tensor:
    """``sum_r decode(q[r]) / R`` over the ``R`` rows of 2-D codes, summed strictly in row order (``((d_0 + d_1) +
    d_2) + ...``, then divided by ``R``: the bits of those torch steps on any rank), written into ``out`` (fp32,
    ``(n,)``) when given. The compiled kernel does it in one pass (rows decoded 512 entries at a time, packed codes
    included), straight into a contiguous CPU ``out``; otherwise each row after the first is added straight from its
    codes.

    Example::

        >>> rows = torch.tensor([[0, 2], [2, 2]], dtype=torch.uint8)
        >>> rows_mean(Quantized(rows, torch.tensor([[4.0], [2.0]]), levels=1, group_size=2)).tolist()
        [-1.0, 3.0]
    """
    if q.codes.dim() != 2:
        raise ValueError(f"`q` must hold 2-D codes (rows, n), got shape {tuple(q.codes.shape)}")
    if out is not None and (out.dtype != torch.float32 or tuple(out.shape) != (q.size,)):
        raise ValueError(f"`out` must be fp32 of shape {(q.size,)}, got {out.dtype} {tuple(out.shape)}")
    rows = q.codes.shape[0]
    if rows and _native_codes(q) and (kernel := _native.load()) is not None:
        target = out if out is not None and out.device.type == "cpu" and out.is_contiguous() else None
        if target is None:
            target = torch.empty(q.size, dtype=torch.float32)
        bits, first = _storage(q)
        kernel.dequantize_mean(
            q.codes.data_ptr(), rows, q.size, q.codes.stride(0), bits, first, q.scales.data_ptr(), q.scales.stride(0),
            q.group_size, q.levels, target.data_ptr(), _native._level(kernel, level),
        )  # fmt: skip
        return target if out is None or target is out else out.copy_(target)

    def row(r: int) -> Quantized:
        return q._replace(codes=q.codes[r], scales=q.scales[r])

    acc = row(0).decode()
    for r in range(1, rows):
        row(r).decode_add(acc, 1.0, acc)
    acc.div_(rows)
    return acc if out is None else out.copy_(acc)


def _storage(q: Quantized) -> tuple[int, int]:
    """``(bits, first)`` of ``q``'s code storage as the kernel reads it: 8 bits (one code per byte) when unpacked."""
    return (8, 0) if q.numel is None else (q.bits, q.first)


def _native_codes(q: Quantized) -> bool:
    """Whether the kernel can decode ``q``: 1-D or 2-D ``uint8`` rows (unit stride) with matching fp32 scales, the
    codes one per byte or packed 1, 2 or 4 bits wide."""
    codes, scales, n = q.codes, q.scales, q.size
    if q.numel is not None and (q.bits not in (1, 2, 4) or codes.shape[-1] < packed_nbytes(q.first + n, q.bits)):
        return False
    return (
        codes.device.type == "cpu"
        and scales.device.type == "cpu"
        and codes.dtype is torch.uint8
        and scales.dtype is torch.float32
        and 1 <= codes.dim() <= 2
        and codes.shape[:-1] == scales.shape[:-1]
        and scales.shape[-1] == num_groups(n, q.group_size)
        and (codes.shape[-1] <= 1 or codes.stride(-1) == 1)
        and (scales.shape[-1] <= 1 or scales.stride(-1) == 1)
    )


def _dequantize_native(
    kernel: ModuleType,
    q: Quantized,
    level: Optional[int] = None,
    out: Optional[Tensor] = None,
) -> Tensor:
    """:func:`dequantize` of ``q``'s codes into fp32 in one kernel call: ``(code - L) * (scale / L)`` (``L = 0``:
    ``(2 code - 1) * scale``), into ``out`` (contiguous fp32 CPU, ``(..., n)``) when given."""
    codes, scales = q.codes, q.scales
    if out is None:
        out = torch.empty((*codes.shape[:-1], q.size), dtype=torch.float32)
    rows = codes.shape[0] if codes.dim() == 2 else 1
    code_stride = codes.stride(0) if codes.dim() == 2 else 0
    scale_stride = scales.stride(0) if scales.dim() == 2 else 0
    bits, first = _storage(q)
    kernel.dequantize(
        codes.data_ptr(), rows, q.size, code_stride, bits, first, scales.data_ptr(), scale_stride, q.group_size,
        q.levels, out.data_ptr(), _native._level(kernel, level),
    )  # fmt: skip
    return out
