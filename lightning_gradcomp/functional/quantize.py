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

The quantizers live in one module per concept, all re-exported here: the grid of groups, norms, levels and code
widths (:mod:`.quantization_groups`), the counter-based draws (:mod:`.hashed_draws`), stochastic rounding
(:mod:`.stochastic_rounding`), scaled sign (:mod:`.scaled_sign`), and :class:`Quantized` with its decoding
(:mod:`.dequantize`).
"""

from __future__ import annotations

from lightning_gradcomp.functional.dequantize import Quantized, dequantize, dequantize_add, rows_mean
from lightning_gradcomp.functional.dequantize import _decode_add as _decode_add
from lightning_gradcomp.functional.dequantize import _dequantize_native as _dequantize_native
from lightning_gradcomp.functional.hashed_draws import _draw_key as _draw_key
from lightning_gradcomp.functional.hashed_draws import _hashed_draws as _hashed_draws
from lightning_gradcomp.functional.hashed_draws import hashed_uniform
from lightning_gradcomp.functional.quantization_groups import PNorm as PNorm
from lightning_gradcomp.functional.quantization_groups import (
    alpha_p,
    code_bits,
    group_norms,
    levels_for_bits,
    num_groups,
    parse_p,
)
from lightning_gradcomp.functional.scaled_sign import sign_codes, sign_quantize
from lightning_gradcomp.functional.stochastic_rounding import _stochastic_native as _stochastic_native
from lightning_gradcomp.functional.stochastic_rounding import (
    block_quantize,
    qsgd_quantize,
    quantization_variance,
    stochastic_quantize,
    terngrad_quantize,
)

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
