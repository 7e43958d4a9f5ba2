"""The engine's "this rank saw NaN/Inf" flag: one read pass over a bucket.

On a contiguous fp32 CPU tensor the compiled kernel (:mod:`._native`) tests every value's exponent bits (all ones:
NaN or an infinity), 8 at a time; elsewhere (CUDA, 16-bit buckets, ``LIGHTNING_GRADCOMP_NO_NATIVE=1``) torch's
``isfinite(x).all()`` answers the same question on the device, without a host sync.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.functional import _native

__all__ = ["nonfinite_flag"]


def nonfinite_flag(x: Tensor, level: Optional[int] = None) -> Tensor:
    """A one-element tensor of ``x``'s dtype and device: 1 when some entry of ``x`` is NaN or infinite, else 0.

    Example::

        >>> nonfinite_flag(torch.tensor([1.0, 3e38, -0.0])).item()
        0.0
        >>> nonfinite_flag(torch.tensor([1.0, float("nan")])).item()
        1.0
    """
    kernel = _native.for_fp32(x)
    if kernel is not None:
        bad = kernel.any_nonfinite(x.data_ptr(), x.numel(), _native._level(kernel, level))
        return torch.full((1,), float(bad), dtype=x.dtype)
    return (~torch.isfinite(x).all()).to(x.dtype).reshape(1)
