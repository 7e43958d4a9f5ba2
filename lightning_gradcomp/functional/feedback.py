"""Error-feedback compensation ``p = m + g / s``: the one pass every error-feedback compressor starts with.

On contiguous fp32 CPU tensors the compiled kernel (:mod:`._native`) computes ``p`` in one pass and, when asked,
zeroes ``g`` in the same pass (``clear``): a sparsifier's averaged result is mostly zeros and goes into ``g``'s
storage, so clearing it while ``g`` is in cache saves a second pass over a cold bucket. The values are torch's
bits (one fp32 division, then one fp32 add, as ``torch.addcdiv`` / ``m + g`` round them), and the same pass tells
whether ``g`` holds a NaN or an infinity: the engine's NaN/Inf flag of the compressed slots, without a pass of its
own. Other devices, dtypes or ``LIGHTNING_GRADCOMP_NO_NATIVE=1`` take the torch steps, then ``g.zero_()``, and do
not check.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.functional import _native

__all__ = ["compensate", "compensate_checked", "recover_gradient"]


def compensate(
    memory: Optional[Tensor],
    grad: Tensor,
    scale: Optional[Tensor] = None,
    *,
    clear: bool = False,
    level: Optional[int] = None,
) -> Tensor:
    """A new fp32 tensor ``p = memory + grad / scale`` (``grad / scale`` when ``memory`` is ``None``).

    See :func:`compensate_checked` for the arguments.

    Example::

        >>> g = torch.tensor([1.0, 2.0])
        >>> compensate(torch.tensor([0.5, -2.0]), g, torch.tensor([2.0]), clear=True).tolist(), g.tolist()
        ([1.0, -1.0], [0.0, 0.0])
    """
    return compensate_checked(memory, grad, scale, clear=clear, level=level)[0]


def compensate_checked(
    memory: Optional[Tensor],
    grad: Tensor,
    scale: Optional[Tensor] = None,
    *,
    clear: bool = False,
    level: Optional[int] = None,
) -> tuple[Tensor, Optional[bool]]:
    """``(p, nonfinite)``: a new fp32 tensor ``p = memory + grad / scale`` (``grad / scale`` when ``memory`` is
    ``None``), and whether ``grad`` holds a NaN or an infinity (``None``: not checked, on the torch steps).

    Args:
        memory: the error-feedback memory (fp32, ``grad``'s shape), or ``None`` before the first update.
        grad: the gradient (any float dtype).
        scale: a one-element tensor ``grad`` is divided by (the loss scale), or ``None`` for 1.
        clear: also set ``grad`` to zero (after it was read).
        level: highest kernel instruction-set level to use (tests); ``None``: the CPU's best.

    Example::

        >>> p, bad = compensate_checked(torch.tensor([0.5, -2.0]), torch.tensor([1.0, float("inf")]))
        >>> p.tolist(), bad in (True, None)  # None where the kernel is unavailable
        ([1.5, inf], True)
    """
    if scale is not None and scale.dtype != torch.float32:  # p is fp32 whatever the scale's dtype
        scale = scale.to(torch.float32)
    kernel = None if memory is None else _kernel_for(memory, grad, scale)
    if memory is not None and kernel is not None:
        divisor = 0.0 if scale is None else float(scale)  # a CPU tensor: no device sync
        if scale is None or divisor > 0.0:
            out = torch.empty_like(memory)
            bad = kernel.compensate(
                memory.data_ptr(),
                grad.data_ptr(),
                grad.numel(),
                divisor,
                out.data_ptr(),
                clear,
                _native._level(kernel, level),
            )
            return out, bool(bad)
    if memory is None:
        out = grad.to(torch.float32, copy=True)
        out = out if scale is None else out.div_(scale)
    elif scale is None:
        out = memory + grad.to(torch.float32)  # not promoted to fp64: p is fp32 whatever the gradient's dtype
    else:
        out = torch.addcdiv(memory, grad.to(torch.float32), scale)
    if clear:
        grad.zero_()
    return out, None


def recover_gradient(memory: Optional[Tensor], p: Tensor, scale: Optional[Tensor] = None) -> Tensor:
    """The gradient a compensation ``p = memory + g / scale`` came from, as far as ``p`` tells: a new fp32 tensor
    ``(p - memory) * scale`` (``p * scale`` without a memory: exact when ``scale`` is a power of two).

    NaN and infinities come back where ``g`` had them; other entries within the rounding of ``p`` (relative to
    ``|memory|``). For a gradient cleared in the compensation pass and needed after all (a non-finite step reduced
    densely).

    Example::

        >>> m, g = torch.tensor([0.5, 1.0]), torch.tensor([2.0, float("inf")])
        >>> recover_gradient(m, compensate(m, g, torch.tensor([4.0])), torch.tensor([4.0])).tolist()
        [2.0, inf]
    """
    out = p.clone() if memory is None else p - memory
    return out if scale is None else out.mul_(scale)


def _kernel_for(memory: Tensor, grad: Tensor, scale: Optional[Tensor]) -> Optional[ModuleType]:
    """The kernel when it can compute ``memory + grad / scale``: contiguous fp32 CPU tensors of one size, a CPU fp32
    one-element ``scale``."""
    if memory.shape != grad.shape:
        return None
    if scale is not None and not (scale.device.type == "cpu" and scale.dtype is torch.float32 and scale.numel() == 1):
        return None
    return _native.for_fp32(memory, grad)
