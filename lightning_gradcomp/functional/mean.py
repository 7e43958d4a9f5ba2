"""DDP's pre-division of a gradient by the world size, with DDP's bits.

DDP's reducer averages by scaling each gradient *before* the sum-all-reduce. Where it copies a gradient into its
bucket (every step under ``zero_grad(set_to_none=True)``, PyTorch's and Lightning's default, and always without
``gradient_as_bucket_view``) it multiplies by the reciprocal ``1 / W`` (a double scalar, rounded to the gradient's
dtype), not dividing by ``W``. For a power-of-two ``W`` the two are the same; for ``W = 3`` or ``5`` they differ in
the last bit of about a third of the entries. Dense reductions that stand for DDP's use :func:`predivide_`, so they
keep its bits at every world size.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["predivide_"]


def predivide_(tensor: Tensor, world_size: int) -> Tensor:
    """Scale ``tensor`` in place by ``1 / world_size`` as DDP's reducer does (see the module); returns it.

    Example::

        >>> import torch
        >>> x = torch.tensor([1.0, 2.0, 10.0])
        >>> predivide_(x.clone(), 3).tolist() == (x * (1.0 / 3)).tolist()
        True
    """
    return tensor.mul_(1.0 / world_size)
