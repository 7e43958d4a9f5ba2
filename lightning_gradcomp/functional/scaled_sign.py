"""Scaled sign (SignSGD's quantizer): 1 bit per element, the mean ``|x|`` of each group as its scale (deterministic,
biased; see :mod:`.quantize`)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.checks import renamed_keywords
from lightning_gradcomp.functional import _native
from lightning_gradcomp.functional.dequantize import Quantized
from lightning_gradcomp.functional.quantization_groups import _pnorms, num_groups

__all__ = ["sign_codes", "sign_quantize"]


@renamed_keywords(bucket_size="group_size")
def sign_quantize(
    x: Tensor, group_size: int, level: Optional[int] = None, residual: Optional[Tensor] = None
) -> Quantized:
    """Scaled sign: 1 bit per element, scale = mean ``|x|`` of each group of ``group_size`` elements (deterministic,
    biased; ``bucket_size=``: the deprecated name of ``group_size``).

    On a contiguous fp32 CPU tensor the compiled kernel writes the codes and the means in one pass, summing each
    bucket's ``|x|`` in a fixed order of its own (the same bits at every instruction-set ``level``, not torch's
    summation order: a message's scales are computed on the rank that sends them, so ranks never need to agree).
    Elsewhere torch's steps (``abs().sum()`` per bucket).

    ``residual`` (fp32, ``x``'s size; it may be ``x`` itself): also write ``x - decode()`` into it, the bits of
    ``q.decode_add(x, -1.0, residual)`` (error feedback's residual). The kernel writes each bucket's right after its
    mean, while the bucket is in cache, instead of in a second pass over ``x``.

    Example::

        >>> q = sign_quantize(torch.tensor([1.0, -3.0, 2.0, 2.0]), 2)
        >>> q.bits, q.codes.tolist(), q.scales.tolist(), q.decode().tolist()
        (1, [1, 0, 1, 1], [2.0, 2.0], [2.0, -2.0, 2.0, 2.0])
        >>> x = torch.tensor([1.0, -3.0, 2.0, 2.0])
        >>> _ = sign_quantize(x, 2, residual=x)
        >>> x.tolist()
        [-1.0, -1.0, 0.0, 0.0]
    """
    x = x.reshape(-1)
    size = int(group_size)
    if residual is not None and (residual.dtype != torch.float32 or residual.shape != (x.numel(),)):
        raise ValueError(
            f"`residual` must be fp32 of shape {(x.numel(),)}, got {residual.dtype} {tuple(residual.shape)}"
        )
    kernel = _native.for_fp32(x) if residual is None else _native.for_fp32(x, residual)
    if kernel is not None:
        codes = torch.empty(x.numel(), dtype=torch.uint8)
        means = torch.empty(num_groups(x.numel(), size), dtype=torch.float32)
        kernel.sign_quantize(
            x.data_ptr(), x.numel(), size, codes.data_ptr(), means.data_ptr(),
            0 if residual is None else residual.data_ptr(), _native._level(kernel, level),
        )  # fmt: skip
        return Quantized(codes, means, 0, size)
    scales = _pnorms(x, size, 1.0)  # sum of |x| per bucket (a fresh tensor)
    whole = x.numel() // size
    scales[:whole].div_(size)
    scales[whole:].div_(max(x.numel() - whole * size, 1))  # the short last bucket: its own mean
    q = Quantized(sign_codes(x), scales.to(torch.float32), 0, size)
    if residual is not None:
        q.decode_add(x, -1.0, residual)
    return q


def sign_codes(x: Tensor, level: Optional[int] = None) -> Tensor:
    """``uint8`` codes of scaled sign: 1 where ``x >= 0``, else 0 (NaN: 0), as ``torch.ge(x, 0)`` gives them.

    On a contiguous fp32 CPU tensor the compiled kernel writes them in one pass (8 compares per instruction);
    elsewhere ``torch.ge`` (a bool tensor viewed as bytes). ``level`` lowers the kernel's instruction set (tests).

    Example::

        >>> sign_codes(torch.tensor([1.0, -0.0, -2.0, float("nan")])).tolist()
        [1, 1, 0, 0]
    """
    x = x.reshape(-1)
    kernel = _native.for_fp32(x)
    if kernel is None:
        return torch.ge(x, 0).view(torch.uint8)  # bool: one byte, 0 or 1
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    kernel.sign_codes(x.data_ptr(), x.numel(), codes.data_ptr(), _native._level(kernel, level))
    return codes
