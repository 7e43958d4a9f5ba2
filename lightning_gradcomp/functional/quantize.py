r"""Quantizers: stochastic rounding (QSGD, TernGrad, DIANA's block p-quantizer) and scaled sign.

Every quantizer cuts a flat tensor into *groups* of ``group_size`` consecutive elements (the last
group may be shorter) and sends one fp32 *scale* per group plus one small integer *code* per element:

* **Stochastic rounding with** ``L`` **levels** (``levels >= 1``). With ``s = ||x_group||_p``,
  ``y = L |x_j| / s`` is rounded up with probability ``y - floor(y)`` and down otherwise, so

  .. math:: Q(x)_j = s \cdot \mathrm{sign}(x_j)\, \xi_j / L, \qquad \mathbb{E}\, Q(x) = x .

  The code is ``L + sign(x_j) xi_j`` in ``[0, 2L]``, which needs ``ceil(log2(2L + 1))`` bits.
  QSGD with ``bits`` bits uses ``L = 2**(bits - 1) - 1``; TernGrad and the DIANA block quantizer
  use ``L = 1`` (codes ``{0, 1, 2}``: 2 bits). The per-element variance is exactly
  ``(s / L)**2 f (1 - f)`` with ``f = frac(y)`` (see :func:`quantization_variance`); for ``L = 1``
  the second moment is ``E||Q(x)||^2 = sum_l ||x_l||_1 ||x_l||_p <= ||x||^2 / alpha_p(d)``.
* **Scaled sign** (``levels = 0``, deterministic, biased): ``s = ||x_group||_1 / |group|``,
  code ``1`` for ``x_j >= 0`` else ``0`` (1 bit), value ``s (2 c - 1)``.

Randomness comes only from the ``torch.Generator`` passed in. On CUDA (and any device but the CPU) the uniform
draws are ``torch.rand`` from it. On the CPU, where ``torch.rand`` is a serial Mersenne Twister that costs more
than the whole rounding, each call draws one 64-bit key from the generator and the draws are a counter-based
hash of the entry's position and the key (:func:`hashed_uniform`): the same 24-bit resolution as ``torch.rand``
in fp32, computed inside the compiled kernel at no extra pass.

**Compiled CPU path.** When the optional kernel of :mod:`._native` is available, stochastic rounding of an
fp32 CPU tensor is one kernel call (the same key and the same draws as the torch steps), and
:func:`dequantize` of ``uint8`` codes into fp32 is one call too, also straight from codes still bit-packed in a
received payload (:attr:`Quantized.numel`: the codes are unpacked in the kernel's registers, eight per AVX2 step,
never written out as bytes). Each element goes through the same fp32 operations in the same order as the torch
steps (no FMA), so codes, scales and values are bit-identical, NaN and infinity included; the ``p = 1`` and
``p = 2`` norms are the same torch calls on both.
``LIGHTNING_GRADCOMP_NO_NATIVE=1`` or a failed build selects the torch steps.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from lightning_gradcomp.checks import is_int, is_number, renamed_keywords
from lightning_gradcomp.functional import _native
from lightning_gradcomp.functional.axpy import add_scaled
from lightning_gradcomp.functional.packing import packed_nbytes, unpack_bits

__all__ = [
    "Quantized",
    "alpha_p",
    "block_quantize",
    "code_bits",
    "dequantize",
    "dequantize_add",
    "group_norms",
    "hashed_uniform",
    "levels_for_bits",
    "num_groups",
    "parse_p",
    "qsgd_quantize",
    "quantization_variance",
    "rows_mean",
    "sign_codes",
    "sign_quantize",
    "stochastic_quantize",
    "terngrad_quantize",
]

PNorm = Union[int, float, str]
"""A norm order: ``1``, ``2`` or infinity (``float("inf")``, ``"inf"``)."""


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


_HALF_DTYPES = (torch.float16, torch.bfloat16)
"""Inputs quantized, and values decoded, through fp32."""


def parse_p(p: PNorm) -> float:
    """Validate a norm order and return it as ``1.0``, ``2.0`` or ``inf``.

    Raises:
        ValueError: ``p`` is not 1, 2 or infinity (``"inf"`` is accepted for YAML configs).

    Example::

        >>> parse_p(2), parse_p("inf"), parse_p("L1")
        (2.0, inf, 1.0)
    """
    value: Optional[float] = None
    if isinstance(p, str):
        key = p.strip().lower().removeprefix("l")
        value = {"1": 1.0, "2": 2.0, "inf": math.inf, "infinity": math.inf}.get(key)
    elif is_number(p):
        value = float(p)
    if value not in (1.0, 2.0, math.inf):
        raise ValueError(f"`p` must be 1, 2 or inf, got {p!r}")
    return value


def levels_for_bits(bits: int) -> int:
    """Levels ``L = 2**(bits - 1) - 1`` of a symmetric ``bits``-bit stochastic quantizer (bits in [2, 8]).

    Example::

        >>> [levels_for_bits(bits) for bits in (2, 4, 8)]
        [1, 7, 127]
    """
    if not is_int(bits) or not 2 <= bits <= 8:
        raise ValueError(f"`bits` must be an integer in [2, 8], got {bits!r}")
    return (1 << (bits - 1)) - 1


def code_bits(levels: int) -> int:
    """Bits per code: 1 for scaled sign (``levels == 0``), else ``ceil(log2(2 L + 1))``.

    Example::

        >>> [code_bits(levels) for levels in (0, 1, 7, 127)]
        [1, 2, 4, 8]
    """
    if levels < 0 or levels > 127:
        raise ValueError(f"`levels` must be in [0, 127], got {levels!r}")
    return 1 if levels == 0 else (2 * levels).bit_length()


def num_groups(numel: int, group_size: int) -> int:
    """Number of groups (scales) of a ``numel``-element tensor: ``ceil(numel / group_size)``.

    Example::

        >>> num_groups(10, 4), num_groups(8, 4)
        (3, 2)
    """
    return -(-int(numel) // int(group_size))


def _grouped(x: Tensor, group_size: int) -> Tensor:
    """``x`` of shape ``(..., n)`` zero-padded to whole groups, viewed as ``(..., groups, group_size)``."""
    n = x.shape[-1]
    groups = num_groups(n, group_size)
    pad = groups * group_size - n
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], dim=-1)
    return x.reshape(*x.shape[:-1], groups, group_size)


def _ungrouped(x: Tensor, numel: int) -> Tensor:
    """Inverse of :func:`_grouped`: ``(..., groups, group_size)`` back to ``(..., numel)``."""
    return x.reshape(*x.shape[:-2], -1)[..., :numel]


def _pnorms(x: Tensor, group_size: int, p: float) -> Tensor:
    """Per-group ``p``-norms of a flat tensor, shape ``(num_groups,)``, in its dtype, over a view of the whole groups
    (no padded copy) and the short last group. ``p = 2`` is ``torch.linalg.vector_norm`` (no squared temporary); 1
    and inf are ``abs().sum()`` / ``abs().amax()``, which torch's CPU ``vector_norm`` runs 4-15x slower."""
    n = x.numel()
    full = n // group_size * group_size
    parts = [_norm_rows(x[:full].reshape(-1, group_size), p)] if full else []
    if full < n:
        parts.append(_norm_rows(x[full:].reshape(1, -1), p))
    if not parts:
        return x.new_empty(0)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _norm_rows(rows: Tensor, p: float) -> Tensor:
    """The ``p``-norm of each row of a 2-D tensor.

    A 2-norm sums squares in the rows' dtype, so finite entries can overflow it (fp32: squares beyond ``3.4e38``, i.e.
    entries from about ``1.8e19``); the rows whose norm came out infinite are computed again scaled by their largest
    magnitude (finite whenever the true norm is). Reading whether any did is one host read of the norms, made on the
    thread that quantizes (the communication thread), never the training thread. (A 1-norm overflows only for
    entries near ``3.4e38 / group_size``: not checked, so SignSGD's torch steps keep its kernel's results.)"""
    if p != 2.0:
        magnitudes = rows.abs()
        return magnitudes.amax(dim=-1) if p == math.inf else magnitudes.sum(dim=-1)
    norms = torch.linalg.vector_norm(rows, 2, dim=-1)
    overflowed = torch.isinf(norms)
    if not bool(overflowed.any()):
        return norms
    where = overflowed.nonzero().squeeze(1)
    big = rows.index_select(0, where)
    peak = big.abs().amax(dim=-1)  # Inf where the row holds an Inf: its norm stays Inf
    rescaled = torch.linalg.vector_norm(big / peak.unsqueeze(1), 2, dim=-1).mul_(peak)  # entries <= 1: no overflow
    return norms.index_copy(0, where, torch.where(torch.isfinite(peak), rescaled, norms.index_select(0, where)))


def group_norms(x: Tensor, group_size: int, p: PNorm) -> Tensor:
    """The ``p``-norm of each group of a flat tensor, shape ``(num_groups,)``, in ``x``'s dtype.

    Example::

        >>> x = torch.tensor([3.0, -4.0, 1.0])
        >>> group_norms(x, 2, 2).tolist(), group_norms(x, 2, "inf").tolist()
        ([5.0, 1.0], [4.0, 1.0])
    """
    return _pnorms(x.reshape(-1), int(group_size), parse_p(p))


_MASK32 = 0xFFFFFFFF
_MIX1, _MIX2 = 0x21F0AAAD, 0x735A2D97
"""Multipliers of the 32-bit mixing function of :func:`hashed_uniform` (C. Wellons' ``lowbias32`` search)."""


def _mix32(x: Tensor) -> Tensor:
    """The 32-bit integer hash ``mix`` of :func:`hashed_uniform` on int64 tensors holding values below 2**32
    (the products stay below 2**63, so nothing overflows)."""
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX2) & _MASK32
    return x ^ (x >> 15)


def hashed_uniform(
    numel: int, key: int, *, dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu"
) -> Tensor:
    """Counter-based uniform draws in ``[0, 1)``: entry ``i`` of the result depends only on ``i`` and ``key``.

    With ``k0``, ``k1`` the low and high 32 bits of ``key`` (read as unsigned 64-bit) and ``i = hi * 2**32 + lo``:
    ``u_i = (mix(mix(lo ^ k0) ^ ((k1 + hi) mod 2**32)) >> 8) * 2**-24``, where ``mix`` is a 32-bit integer
    hash (``x ^= x >> 16; x *= 0x21f0aaad; x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15``). Values are
    multiples of ``2**-24`` below 1, as ``torch.rand`` gives in fp32. The compiled kernel computes the same
    bits in registers (stochastic rounding of a CPU tensor never materializes them).

    Args:
        numel: number of draws.
        key: any integer (taken modulo ``2**64``).
        dtype: floating dtype of the result (the values are exact in every float dtype but fp16/bf16).
        device: device of the result.

    Example::

        >>> u = hashed_uniform(4, 12345)
        >>> bool(((u >= 0) & (u < 1)).all()), torch.equal(u, hashed_uniform(4, 12345))
        (True, True)
        >>> torch.equal(u, hashed_uniform(4, 1))  # another key, other draws
        False
        >>> torch.equal(hashed_uniform(3, 7), hashed_uniform(10, 7)[:3])  # a prefix does not depend on numel
        True
    """
    return _hashed_draws(torch.arange(int(numel), dtype=torch.int64, device=device), key).to(dtype)


def _hashed_draws(index: Tensor, key: int) -> Tensor:
    """The fp32 draws of :func:`hashed_uniform` at the int64 positions ``index`` (any shape, values >= 0)."""
    key = int(key) % (1 << 64)
    lo, hi = index & _MASK32, index >> 32
    h = _mix32(_mix32(lo ^ (key & _MASK32)) ^ ((hi + (key >> 32)) & _MASK32))
    return (h >> 8).to(torch.float32) * 2.0**-24


def _draw_key(generator: torch.Generator) -> int:
    """One 64-bit key for :func:`hashed_uniform` from a CPU ``generator`` (advances it by one draw)."""
    return int(torch.randint(-(1 << 63), (1 << 63) - 1, (1,), generator=generator, dtype=torch.int64)) % (1 << 64)


def _uniform_like(y: Tensor, generator: torch.Generator) -> Tensor:
    """The uniform draws of the torch steps for ``y`` (see the module docstring: hashed on the CPU)."""
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


def alpha_p(d: int, p: PNorm) -> float:
    r"""DIANA's ``alpha_p(d) = inf_{x != 0} ||x||_2^2 / (||x||_1 ||x||_p)`` for blocks of ``d`` elements.

    ``alpha_1 = 1/d``, ``alpha_2 = 1/sqrt(d)``, ``alpha_inf = 2 / (1 + sqrt(d))``. The block quantizer's
    variance parameter is ``omega = 1/alpha_p - 1``, and DIANA's shift step must satisfy
    ``0 < alpha <= alpha_p``.

    Example::

        >>> alpha_p(4, 1), alpha_p(4, 2), alpha_p(9, "inf")
        (0.25, 0.5, 0.5)
    """
    if not is_int(d) or d < 1:
        raise ValueError(f"`d` must be a positive integer, got {d!r}")
    p = parse_p(p)
    if p == 1.0:
        return 1.0 / d
    if p == 2.0:
        return 1.0 / math.sqrt(d)
    return 2.0 / (1.0 + math.sqrt(d))
