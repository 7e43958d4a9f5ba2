"""The fp16/bf16 casts' two passes: ``x / d`` rounded to 16 bits, and 16 bits widened back with a NaN/Inf check.

On CPU tensors the compiled kernel (:mod:`._native`) fuses each into one pass: :func:`scaled_cast` reads the fp32
values once (no in-place division, no second pass for the cast) and :func:`widen` checks the 16-bit values for
NaN/Inf while it converts them (no pass over the result to sum it). The values are torch's bits: the division is
fp32 ``x / d`` and the rounding is to nearest even, as ``x.div_(d).half()`` / ``.bfloat16()`` give; NaNs stay
NaNs (their payload bits are not specified; torch's own differ between its vector and scalar loops). Other
devices, other dtypes or ``LIGHTNING_GRADCOMP_NO_NATIVE=1`` take the torch steps.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.functional import _native

__all__ = ["scaled_cast", "widen"]

_KINDS = {torch.float16: 0, torch.bfloat16: 1}


def _kernel(src: Tensor, out: Tensor, level: Optional[int]) -> tuple[Optional[ModuleType], int]:
    """The kernel and its level when it can convert ``src`` into ``out`` (contiguous CPU fp32 / 16-bit)."""
    if not (src.device.type == out.device.type == "cpu" and src.is_contiguous() and out.is_contiguous()):
        return None, 0
    kernel = _native.load()
    if kernel is None:
        return None, 0
    return kernel, _native._level(kernel, level)


def scaled_cast(src: Tensor, divisor: float, out: Tensor, level: Optional[int] = None) -> Tensor:
    """``out = (src / divisor)`` rounded to ``out``'s dtype (fp16 or bf16), the fp32 division first.

    ``src`` (fp32, as many elements as ``out``) may be overwritten: the torch steps divide it in place. Returns
    ``out``.

    Example::

        >>> scaled_cast(torch.tensor([3.0, 1e6]), 2, torch.empty(2, dtype=torch.float16)).tolist()
        [1.5, inf]
    """
    if out.dtype not in _KINDS or src.dtype != torch.float32 or src.numel() != out.numel():
        raise ValueError(f"`scaled_cast` takes fp32 into fp16/bf16 of one size, got {src.dtype} {out.dtype}")
    kernel, level = _kernel(src, out, level)
    if kernel is not None:
        kernel.scaled_cast(src.data_ptr(), src.numel(), float(divisor), out.data_ptr(), _KINDS[out.dtype], level)
        return out
    return out.copy_(src.div_(divisor))


def widen(src: Tensor, out: Tensor, level: Optional[int] = None) -> Optional[bool]:
    """``out = src`` (fp16/bf16 into fp32, exact); returns whether ``src`` holds a NaN or an infinity.

    The check comes free with the kernel's pass; the torch steps do not check and return ``None`` (the caller
    checks the result itself when it needs to).

    Example::

        >>> out = torch.empty(2)
        >>> widen(torch.tensor([1.5, 2.0], dtype=torch.bfloat16), out), out.tolist()
        (False, [1.5, 2.0])
    """
    if src.dtype not in _KINDS or out.dtype != torch.float32 or src.numel() != out.numel():
        raise ValueError(f"`widen` takes fp16/bf16 into fp32 of one size, got {src.dtype} {out.dtype}")
    kernel, level = _kernel(src, out, level)
    if kernel is not None:
        return bool(kernel.widen(src.data_ptr(), src.numel(), _KINDS[src.dtype], out.data_ptr(), level))
    out.copy_(src)
    return None
