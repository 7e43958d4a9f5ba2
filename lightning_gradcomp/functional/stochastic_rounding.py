"""Stochastic rounding (QSGD, TernGrad, DIANA's block p-quantizer): unbiased codes ``L + sign(x) xi`` in ``[0, 2L]``
and one fp32 scale per group, on the compiled CPU kernel or the torch steps (see :mod:`.quantize`); and the exact
variance of that rounding."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.checks import renamed_keywords
from lightning_gradcomp.functional import _native
from lightning_gradcomp.functional.dequantize import Quantized
from lightning_gradcomp.functional.hashed_draws import _draw_key, hashed_uniform
from lightning_gradcomp.functional.quantization_groups import (
    _HALF_DTYPES,
    PNorm,
    _grouped,
    _pnorms,
    _ungrouped,
    group_norms,
    levels_for_bits,
    num_groups,
    parse_p,
)

__all__ = [
    "block_quantize",
    "qsgd_quantize",
    "quantization_variance",
    "stochastic_quantize",
    "terngrad_quantize",
]


def _uniform_like(y: Tensor, generator: torch.Generator) -> Tensor:
    """The uniform draws of the torch steps for ``y`` (see :mod:`.quantize`: hashed on the CPU)."""
    if y.device.type != "cpu":
        return torch.rand(y.shape, generator=generator, dtype=y.dtype, device=y.device)
    return hashed_uniform(y.numel(), _draw_key(generator), dtype=y.dtype).view(y.shape)


def stochastic_quantize(
    x: Tensor, levels: int, group_size: int, p: PNorm, generator: torch.Generator, minus: Optional[Tensor] = None
) -> Quantized:
    """Unbiased stochastic rounding of a flat tensor to ``levels`` levels per sign, per-group ``p``-norm scale.

    ``xi = floor(L |x| / s + u)`` with ``u ~ U[0, 1)`` rounds up with probability ``frac(L |x| / s)``.

    Args:
        x: flat floating tensor of ``n`` elements.
        levels: ``L >= 1``.
        group_size: elements per scale.
        p: norm of the scale (2 or inf; 1 is allowed but gives large variance).
        generator: source of the uniform draws (on ``x``'s device).
        minus: quantize ``x - minus`` instead (``x``'s shape and dtype): the same codes and scales, but the compiled
            kernel subtracts group by group without writing the difference out (max-norm scales; other norms, and
            the torch steps, subtract first).

    Returns:
        :class:`Quantized` with ``n`` codes in ``[0, 2L]`` and ``ceil(n / group_size)`` fp32 scales.
        Zero groups, and groups whose scale is too small for ``L / scale`` to stay finite in fp32 (below about
        ``L * 2.9e-39``: subnormal scales, and at large ``L`` the smallest normal ones), get scale 0 and decode to
        exact zeros.

    Example::

        >>> gen = torch.Generator().manual_seed(0)
        >>> x = torch.tensor([0.5, -1.0, 0.0, 2.0])
        >>> q = stochastic_quantize(x, 1, 4, "inf", gen)
        >>> q.scales.tolist(), q.codes[2:].tolist()  # 0 -> L, the group's max -> 2 L
        ([2.0], [1, 2])
        >>> mean = sum(stochastic_quantize(x, 1, 4, "inf", gen).decode() for _ in range(2000)) / 2000
        >>> torch.allclose(mean, x, atol=0.1)  # unbiased
        True
    """
    if not 1 <= levels <= 127:
        raise ValueError(f"`levels` must be in [1, 127] (codes 0..2L in one byte), got {levels!r}")
    x = x.reshape(-1)
    norm = parse_p(p)
    if minus is not None and minus.numel() != x.numel():
        raise ValueError(f"`minus` must have as many elements as `x` ({x.numel()}), got {minus.numel()}")
    if x.dtype in _HALF_DTYPES:  # in fp32: the norms, L |x| / s and the draws rounded in 16 bits were biased
        x = x.float()
        minus = None if minus is None else minus.float()
    kernel = _native_for(x) if x.numel() < _native.MAX_NUMEL else None
    fused = minus is not None and norm == math.inf and minus.dtype is x.dtype and minus.device == x.device
    if minus is not None and (kernel is None or not fused):
        x, minus = x - minus.reshape(-1), None
    if kernel is not None:
        shift = None if minus is None else minus.reshape(-1).contiguous()
        return _stochastic_native(kernel, x.contiguous(), levels, group_size, norm, generator, minus=shift)
    n = x.numel()
    grouped = _grouped(x, group_size)
    mag = grouped.abs()
    scales = _pnorms(x, int(group_size), norm).to(torch.float32)
    wire = scales.to(x.dtype)  # probabilities use the scale exactly as it is sent
    inverse = levels / torch.where(wire > 0, wire, torch.ones_like(wire))
    # A group whose scale is zero, or so small (subnormal) that levels / scale overflows, is sent as zeros.
    usable = (wire > 0) & torch.isfinite(inverse)
    inverse = torch.where(usable, inverse, torch.zeros_like(inverse))
    scales = torch.where(usable, scales, torch.zeros_like(scales))
    y = mag.mul_(inverse.unsqueeze(-1))
    y.add_(_uniform_like(y, generator)).floor_()
    # Cap at the top level after rounding: y itself may exceed L by an ulp, and in floating point y + u can round
    # up to L + 1 (e.g. y = L, u = 1 - 2**-24); a negative code would then wrap past 2L as uint8.
    y.clamp_(max=float(levels))
    codes = torch.copysign(y, grouped).add_(float(levels))  # copysign(0, -x) + L == L
    return Quantized(_ungrouped(codes, n).to(torch.uint8), scales, int(levels), int(group_size))


def _native_for(x: Tensor) -> Optional[ModuleType]:
    """The compiled kernel for an fp32 CPU tensor (``None`` otherwise, or when it is unavailable)."""
    if x.device.type != "cpu" or x.dtype is not torch.float32:
        return None
    return _native.load()


def _stochastic_native(
    kernel: ModuleType,
    x: Tensor,
    levels: int,
    group_size: int,
    p: float,
    generator: torch.Generator,
    level: Optional[int] = None,
    minus: Optional[Tensor] = None,
) -> Quantized:
    """:func:`stochastic_quantize` of a contiguous fp32 CPU tensor (fewer than 2**32 entries): one kernel call.
    ``minus`` (contiguous fp32, max-norm only) is subtracted group by group in the kernel.

    The kernel takes the max-norm itself; other norms are the torch steps' (a NaN norm, whatever its bits, makes
    the group unusable).
    ``level`` lowers the instruction set (for tests), as in :func:`._native.at_least`.
    """
    n = x.numel()
    if p == math.inf:
        scales = torch.empty(num_groups(n, group_size), dtype=torch.float32)
    else:
        scales = _pnorms(x, int(group_size), p)  # the torch steps' norms
    key = _draw_key(generator)  # the torch steps' key: the same draws, and the generator advances alike
    codes = torch.empty(n, dtype=torch.uint8)
    if minus is not None and p != math.inf:
        raise ValueError("`minus` is fused for max-norm scales only")
    kernel.stochastic_round(
        x.data_ptr(),
        0 if minus is None else minus.data_ptr(),
        n,
        key,
        group_size,
        levels,
        p != math.inf,
        scales.data_ptr(),
        codes.data_ptr(),
        _native._level(kernel, level),
    )
    return Quantized(codes, scales, int(levels), int(group_size))


@renamed_keywords(bucket_size="group_size")
def qsgd_quantize(x: Tensor, bits: int, group_size: int, generator: torch.Generator, p: PNorm = "inf") -> Quantized:
    """QSGD: ``bits``-bit stochastic rounding (``L = 2**(bits-1) - 1``), one scale per ``group_size`` elements
    (``bucket_size=``: its deprecated name).

    Example::

        >>> q = qsgd_quantize(torch.tensor([1.0, -0.5, 0.25, 0.0]), 4, 4, torch.Generator().manual_seed(0))
        >>> q.levels, q.bits, q.scales.tolist(), q.codes[[0, 3]].tolist()  # +max -> 2 L, 0 -> L
        (7, 4, [1.0], [14, 7])
    """
    return stochastic_quantize(x, levels_for_bits(bits), group_size, p, generator)


@renamed_keywords(bucket_size="group_size")
def terngrad_quantize(x: Tensor, group_size: int, generator: torch.Generator) -> Quantized:
    """TernGrad: unbiased ternary ``{-s, 0, s}`` with ``s`` the max-norm of each group of ``group_size`` elements
    (2-bit codes; ``bucket_size=``: the deprecated name of ``group_size``).

    Example::

        >>> q = terngrad_quantize(torch.tensor([3.0, -1.0, 0.0, -3.0]), 4, torch.Generator().manual_seed(0))
        >>> q.scales.tolist(), q.codes[[0, 2, 3]].tolist(), set(q.decode().tolist()) <= {-3.0, 0.0, 3.0}
        ([3.0], [2, 1, 0], True)
    """
    return stochastic_quantize(x, 1, group_size, math.inf, generator)


@renamed_keywords(block_size="group_size")
def block_quantize(x: Tensor, p: PNorm, group_size: int, generator: torch.Generator) -> Quantized:
    r"""DIANA's block p-quantization: ``Q(x)_j = ||x_l||_p sign(x_j) xi_j``, ``xi_j ~ Bernoulli(|x_j| / ||x_l||_p)``,
    ``x_l`` the group (block) of ``group_size`` elements holding ``x_j`` (``block_size=``: its deprecated name).

    Example::

        >>> q = block_quantize(torch.tensor([3.0, 4.0, 0.0, -1.0]), 2, 2, torch.Generator().manual_seed(0))
        >>> q.scales.tolist(), q.decode()[2:].tolist()  # the L2 norm of each block; |x_j| = norm is kept exactly
        ([5.0, 1.0], [0.0, -1.0])
    """
    return stochastic_quantize(x, 1, group_size, p, generator)


def quantization_variance(x: Tensor, levels: int, group_size: int, p: PNorm) -> Tensor:
    """Exact per-element variance of :func:`stochastic_quantize`: ``(s / L)**2 f (1 - f)``, ``f = frac(L |x| / s)``.

    Example::

        >>> quantization_variance(torch.tensor([1.0, 0.5, 0.0]), 1, 3, "inf").tolist()  # f = 0, 1/2, 0
        [0.0, 0.25, 0.0]
    """
    x = x.reshape(-1).to(torch.float64)
    grouped = _grouped(x, group_size)
    wire = group_norms(x.to(torch.float32), group_size, p).to(torch.float64).unsqueeze(-1)  # fp32 as sent
    y = torch.where(wire > 0, grouped.abs() * levels / torch.where(wire > 0, wire, 1.0), 0.0).clamp(max=float(levels))
    frac = y - y.floor()
    return _ungrouped((wire / levels).square() * frac * (1.0 - frac), x.numel())
