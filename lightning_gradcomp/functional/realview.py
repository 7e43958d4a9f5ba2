"""Complex tensors as real numbers, as DDP reduces them.

DDP lays a complex parameter's gradient out in its bucket as ``torch.view_as_real`` does: ``2 n`` real numbers
(real and imaginary parts interleaved) of the matching real dtype. Everything that flattens, compresses, averages
or writes back parameters therefore works on :func:`real_view` of each tensor, and rebuilds a tensor of the
original dtype with :func:`from_real`.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["from_real", "real_shape", "real_view", "real_view_numel"]


def real_view(tensor: Tensor) -> Tensor:
    """``tensor`` itself, or for a complex tensor its real view (shape ``(*shape, 2)``, the matching real dtype,
    sharing its storage: writing the view writes the tensor).

    Example::

        >>> z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
        >>> real_view(z).tolist(), real_view(z).dtype
        ([[1.0, 2.0], [3.0, -4.0]], torch.float32)
    """
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def real_shape(tensor: Tensor) -> tuple[int, ...]:
    """The shape of :func:`real_view` of ``tensor``: its own, with a trailing 2 when it is complex.

    Example::

        >>> real_shape(torch.zeros(3, 4, dtype=torch.complex128)), real_shape(torch.zeros(3, 4))
        ((3, 4, 2), (3, 4))
    """
    return (*tensor.shape, 2) if tensor.is_complex() else tuple(tensor.shape)


def real_view_numel(tensor: Tensor) -> int:
    """Real numbers in ``tensor``: its element count, twice that when it is complex.

    Example::

        >>> real_view_numel(torch.zeros(5, dtype=torch.complex64)), real_view_numel(torch.zeros(5))
        (10, 5)
    """
    return tensor.numel() * (2 if tensor.is_complex() else 1)


def from_real(values: Tensor, like: Tensor) -> Tensor:
    """``values`` (shaped as :func:`real_view` of ``like``, any real dtype) as a tensor of ``like``'s dtype and shape.

    Example::

        >>> z = torch.zeros(2, dtype=torch.complex64)
        >>> from_real(torch.tensor([[1.0, 2.0], [3.0, -4.0]], dtype=torch.float64), z).tolist()
        [(1+2j), (3-4j)]
    """
    if not like.is_complex():
        return values.to(like.dtype)
    return torch.view_as_complex(values.to(real_view(like).dtype).contiguous())
