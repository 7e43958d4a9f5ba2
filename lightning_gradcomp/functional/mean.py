"""Deprecated: :func:`predivide_` moved to :mod:`lightning_gradcomp.functional.axpy` (scalings and scaled additions).

Importing this module warns with a ``DeprecationWarning``; it will be removed in the next release.
"""

from __future__ import annotations

import warnings

from lightning_gradcomp.functional.axpy import predivide_

__all__ = ["predivide_"]

warnings.warn(
    "lightning_gradcomp.functional.mean is deprecated: import predivide_ from lightning_gradcomp.functional.axpy",
    DeprecationWarning,
    stacklevel=2,
)
