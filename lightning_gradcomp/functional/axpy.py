"""Scalings ``x * (1 / W)`` and scaled additions ``base + alpha * x``, with DDP's and ``torch.add``'s bits.

**DDP's pre-division** (:func:`predivide_`). DDP's reducer averages by scaling each gradient *before* the
sum-all-reduce. Where it copies a gradient into its bucket (every step under ``zero_grad(set_to_none=True)``,
PyTorch's and Lightning's default, and always without ``gradient_as_bucket_view``) it multiplies by the reciprocal
``1 / W`` (a double scalar, rounded to the gradient's dtype), not dividing by ``W``. For a power-of-two ``W`` the two
are the same; for ``W = 3`` or ``5`` they differ in the last bit of about a third of the entries. Dense reductions
that stand for DDP's use :func:`predivide_`, so they keep its bits at every world size.

**Scaled additions** (:func:`add_scaled`). DIANA's owner updates its master shift and forms its message from the
same two tensors: ``h + alpha * mean`` and ``h + mean``. On contiguous fp32 CPU tensors the compiled kernel
(:mod:`._native`) writes both in one pass over the inputs, each entry one fused multiply-add as
``torch.add(base, x, alpha=alpha)`` computes it (torch's AVX2 and AVX-512 kernels, and its scalar loop, contract
``base + alpha * x`` into one FMA). Elsewhere, torch's ``add``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.functional import _native

__all__ = ["add_scaled", "predivide_"]


def add_scaled(
    x: Tensor,
    base: Tensor,
    alpha: float,
    out: Tensor,
    alpha2: Optional[float] = None,
    out2: Optional[Tensor] = None,
    *,
    level: Optional[int] = None,
) -> None:
    """``out = base + alpha * x`` and, when ``out2`` is given, ``out2 = base + alpha2 * x`` (``alpha2`` default 1).

    Args:
        x, base: tensors of one shape and floating dtype.
        alpha, alpha2: the scales.
        out, out2: outputs of that shape and dtype; either may be ``x`` or ``base`` itself.
        level: highest kernel instruction-set level to use (tests); ``None``: the CPU's best.

    Example::

        >>> out, out2 = torch.empty(2), torch.empty(2)
        >>> add_scaled(torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0]), 0.5, out, 1.0, out2)
        >>> out.tolist(), out2.tolist()
        ([10.5, 21.0], [11.0, 22.0])
    """
    outputs = [out] if out2 is None else [out, out2]
    for tensor in (base, *outputs):
        if tensor.shape != x.shape or tensor.dtype != x.dtype:
            raise ValueError(
                f"`base` and the outputs must be {x.dtype} of shape {tuple(x.shape)}, "
                f"got {tensor.dtype} {tuple(tensor.shape)}"
            )
    second = 1.0 if alpha2 is None else float(alpha2)
    kernel = _native.for_fp32(x, base, *outputs)
    if kernel is not None:
        kernel.add_scaled(
            x.data_ptr(), base.data_ptr(), x.numel(), float(alpha), out.data_ptr(), second,
            0 if out2 is None else out2.data_ptr(), _native._level(kernel, level),
        )  # fmt: skip
        return
    if out2 is not None:  # both from the inputs as they were, whichever output aliases them
        first = torch.add(base, x, alpha=alpha)
        torch.add(base, x, alpha=second, out=out2)
        out.copy_(first)
        return
    torch.add(base, x, alpha=alpha, out=out)


def predivide_(tensor: Tensor, world_size: int) -> Tensor:
    """Scale ``tensor`` in place by ``1 / world_size`` as DDP's reducer does (see the module); returns it.

    Example::

        >>> x = torch.tensor([1.0, 2.0, 10.0])
        >>> predivide_(x.clone(), 3).tolist() == (x * (1.0 / 3)).tolist()
        True
    """
    return tensor.mul_(1.0 / world_size)
