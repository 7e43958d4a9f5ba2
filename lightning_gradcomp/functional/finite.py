"""The engine's "this rank saw NaN/Inf" flag: one read pass over a bucket; and zeroing a gradient that holds one.

On a contiguous fp32 CPU tensor the compiled kernel (:mod:`._native`) tests every value's exponent bits (all ones:
NaN or an infinity), 8 at a time; elsewhere (CUDA, 16-bit buckets, ``LIGHTNING_GRADCOMP_NO_NATIVE=1``) torch's
``isfinite(x).all()`` answers the same question on the device, without a host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.functional import _native
from lightning_gradcomp.functional.realview import real_view

__all__ = ["DeferredCount", "nonfinite_flag", "zero_if_nonfinite"]


def nonfinite_flag(x: Tensor, level: Optional[int] = None) -> Tensor:
    """A one-element tensor of ``x``'s dtype (a complex ``x``: the matching real dtype) and device: 1 when some entry of
    ``x`` is NaN or infinite (a complex entry: either part), else 0.

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
    return (~torch.isfinite(x).all()).to(real_view(x).dtype).reshape(1)


def zero_if_nonfinite(tensors: Sequence[Tensor]) -> Tensor:
    """Zero every tensor of ``tensors`` in place when some entry of any of them is NaN or infinite.

    Returns the decision as a one-element fp32 tensor on the tensors' device (1: they were zeroed; 0 for an empty
    sequence, on the CPU). No host sync: on the CPU the flag is read to skip the zeroing of finite tensors; on other
    devices every tensor is masked with the flag on the device (one pass each). Sparse COO tensors (the gradient of
    ``nn.Embedding(sparse=True)``) are judged and zeroed by their stored values.

    Example::

        >>> grads = [torch.tensor([1.0, 2.0]), torch.tensor([float("inf")])]
        >>> zero_if_nonfinite(grads).item(), [g.tolist() for g in grads]
        (1.0, [[0.0, 0.0], [0.0]])
    """
    if not tensors:
        return torch.zeros(1)
    flag = torch.cat([nonfinite_flag(_stored(t)).to(torch.float32) for t in tensors]).amax().reshape(1)
    if flag.device.type == "cpu":
        if flag.item():
            for t in tensors:
                t.zero_()
        return flag
    _zero_where(tensors, flag)
    return flag


def _zero_where(tensors: Sequence[Tensor], flag: Tensor) -> None:
    """Zero every tensor of ``tensors`` where the one-element ``flag`` is non-zero, on the device (one pass each)."""
    bad = flag.bool().reshape(())  # broadcasts to any shape, 0-dim included
    for t in tensors:
        _stored(t).masked_fill_(bad, 0)


def _stored(t: Tensor) -> Tensor:
    """The values ``t`` stores: a sparse COO tensor's ``values`` (a view), else ``t``."""
    return t._values() if t.is_sparse else t


class DeferredCount:
    """A count of one-element 0/1 device flags (e.g. from :func:`zero_if_nonfinite`), summed on their device without
    a host sync and read when asked (:meth:`take`: one host read).

    Example::

        >>> count = DeferredCount()
        >>> count.add(torch.ones(1)); count.add(torch.zeros(1)); count.add(torch.ones(1))
        >>> count.take(), count.take()
        (2, 0)
    """

    def __init__(self) -> None:
        self._sum: Optional[Tensor] = None

    def add(self, flag: Tensor) -> None:
        """Add ``flag`` (kept on its device)."""
        self._sum = flag.detach().clone() if self._sum is None else self._sum.add_(flag)

    def take(self) -> int:
        """The flags added since the last call (a host read), and start again from zero."""
        total, self._sum = self._sum, None
        return 0 if total is None else int(total.sum().item())
