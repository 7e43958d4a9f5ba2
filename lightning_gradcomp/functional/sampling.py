"""Systematic samples: every ``d``-th entry of a tensor, at a stride that meets every column of a matrix.

The top-k selections read a threshold from such a sample (:func:`~.selection.topk_indices`, the compiled kernel's
``exact``: :func:`~._native.exact_stride`, and :mod:`~.selection`'s approximate selection).
"""

from __future__ import annotations

import functools
import math

__all__ = ["systematic_stride"]


@functools.lru_cache(maxsize=256)
def systematic_stride(n: int, sample_size: int) -> int:
    """Stride of a systematic sample of at least ``sample_size`` of ``n`` entries.

    The largest ``d <= n // sample_size`` coprime to 2, 3, 5 and 7 (to 2 and 3 only when
    ``n // sample_size < 11``), or 1.

    Example::

        >>> systematic_stride(10_000, 100), systematic_stride(50, 10)  # 97: coprime to 210; 5: coprime to 6
        (97, 5)
    """
    limit = max(1, n // max(sample_size, 1))
    modulus = 210 if limit >= 11 else 6
    return next(d for d in range(limit, 0, -1) if math.gcd(d, modulus) == 1)
