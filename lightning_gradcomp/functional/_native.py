"""Optional compiled CPU kernel of the approximate top-k selection (see :mod:`.selection`).

:func:`load` compiles a small C++ extension (pybind11 only, no torch headers: 10-15 s) with
``torch.utils.cpp_extension.load`` on its first call and returns it, or ``None`` when the environment
variable ``LIGHTNING_GRADCOMP_NO_NATIVE`` is ``1`` or the build fails (then it warns once and does not
retry in this process). The build is cached under torch's extensions directory
(``TORCH_EXTENSIONS_DIR``), keyed by a hash of the source, torch and Python versions, so it runs once
per machine; concurrent processes wait on torch's build lock. Nothing is compiled at import time.

:func:`at_least` is the kernel: the sorted indices of ``|x_i| >= t`` in one pass over ``x``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
import warnings
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

__all__ = ["DISABLE_ENV", "at_least", "load"]

DISABLE_ENV = "LIGHTNING_GRADCOMP_NO_NATIVE"
"""Set this environment variable to ``1`` to use the NumPy path instead of the compiled kernel."""

_SOURCE = r"""
#include <pybind11/pybind11.h>
#include <cmath>
#include <cstdint>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace {

// Bit j of the result: |x[j]| >= t, for the 64 entries at x (false for NaN, as NumPy compares).
inline uint64_t mask64(const float* x, float t) {
    uint64_t m = 0;
#if defined(__SSE2__)
    const __m128 abs_bits = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    const __m128 tt = _mm_set1_ps(t);
    for (int q = 0; q < 16; ++q) {
        const __m128 v = _mm_and_ps(_mm_loadu_ps(x + 4 * q), abs_bits);
        m |= static_cast<uint64_t>(_mm_movemask_ps(_mm_cmpge_ps(v, tt))) << (4 * q);
    }
#else
    for (int j = 0; j < 64; ++j) m |= static_cast<uint64_t>(std::fabs(x[j]) >= t) << j;
#endif
    return m;
}

inline uint64_t mask64(const double* x, double t) {
    uint64_t m = 0;
#if defined(__SSE2__)
    const __m128d abs_bits = _mm_castsi128_pd(_mm_set1_epi64x(0x7fffffffffffffffLL));
    const __m128d tt = _mm_set1_pd(t);
    for (int q = 0; q < 32; ++q) {
        const __m128d v = _mm_and_pd(_mm_loadu_pd(x + 2 * q), abs_bits);
        m |= static_cast<uint64_t>(_mm_movemask_pd(_mm_cmpge_pd(v, tt))) << (2 * q);
    }
#else
    for (int j = 0; j < 64; ++j) m |= static_cast<uint64_t>(std::fabs(x[j]) >= t) << j;
#endif
    return m;
}

// Sorted indices of the entries with |x| >= t, written to out[0:capacity]; returns the true count.
// One pass: a 64-bit mask per 64 entries, then one step per set bit.
template <typename T>
int64_t at_least_impl(const T* x, int64_t n, T t, int64_t* out, int64_t capacity) {
    int64_t count = 0;
    int64_t i = 0;
    for (const int64_t body = n - n % 64; i < body; i += 64) {
        for (uint64_t m = mask64(x + i, t); m != 0; m &= m - 1) {
            if (count < capacity) out[count] = i + __builtin_ctzll(m);
            ++count;
        }
    }
    for (; i < n; ++i) {
        if (std::fabs(x[i]) >= t) {
            if (count < capacity) out[count] = i;
            ++count;
        }
    }
    return count;
}

// Raw addresses keep the build free of the torch headers (seconds instead of a minute or more);
// the Python wrapper checks dtypes, sizes and contiguity.
int64_t at_least(uintptr_t x, int64_t n, bool is_double, double threshold, uintptr_t out, int64_t capacity) {
    int64_t* dst = reinterpret_cast<int64_t*>(out);
    if (is_double) {
        return at_least_impl<double>(reinterpret_cast<const double*>(x), n, threshold, dst, capacity);
    }
    return at_least_impl<float>(reinterpret_cast<const float*>(x), n, static_cast<float>(threshold), dst, capacity);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("at_least", &at_least, pybind11::call_guard<pybind11::gil_scoped_release>());
}
"""

_NAME = "lightning_gradcomp_native_" + hashlib.sha256(
    f"{_SOURCE}|{torch.__version__}|{sys.version_info[:2]}".encode()).hexdigest()[:12]

_LOCK = threading.Lock()
_MODULE: ModuleType | None = None
_FAILED = False


def load() -> ModuleType | None:
    """The compiled kernel module, building it on first use; ``None`` if disabled or unavailable."""
    global _MODULE, _FAILED
    if os.environ.get(DISABLE_ENV, "") == "1":
        return None
    if _MODULE is not None or _FAILED:
        return _MODULE
    with _LOCK:
        if _MODULE is None and not _FAILED:
            try:
                _MODULE = _build()
            except Exception as err:  # noqa: BLE001 - any build or load failure means: use the NumPy path
                _FAILED = True
                lines = str(err).strip().splitlines()
                warnings.warn(f"lightning_gradcomp: the compiled selection kernel is unavailable "
                              f"({type(err).__name__}: {lines[-1] if lines else ''}); using NumPy instead. "
                              f"Set {DISABLE_ENV}=1 to skip building it.", RuntimeWarning, stacklevel=2)
    return _MODULE


def _build() -> ModuleType:
    """Import the cached build, or write the source to the build directory and build it with torch's loader."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    build_dir = os.path.join(root, _NAME)
    done = os.path.join(build_dir, "built")  # the library's path, written after a complete build
    library = ""
    if os.path.exists(done):
        with open(done, encoding="utf-8") as f:
            library = f.read().strip()
    if not library or not os.path.exists(library):
        module = _compile(build_dir)
        tmp = f"{done}.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(str(module.__file__))
        os.replace(tmp, done)
        return module
    spec = importlib.util.spec_from_file_location(_NAME, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(build_dir: str) -> ModuleType:
    """Build and import the extension in ``build_dir`` (torch's JIT loader, ninja, g++)."""
    from torch.utils import cpp_extension  # only when building

    os.makedirs(build_dir, exist_ok=True)
    source = os.path.join(build_dir, "selection.cpp")
    tmp = f"{source}.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(_SOURCE)
    os.replace(tmp, source)  # atomic: a concurrent build never reads half a file
    with warnings.catch_warnings():  # torch's compiler-version notices are not ours to show
        warnings.simplefilter("ignore")
        return cpp_extension.load(_NAME, [source], extra_cflags=["-O3"], build_directory=build_dir, verbose=False)


def at_least(kernel: ModuleType, x: Tensor, threshold: float, capacity: int) -> tuple[np.ndarray, int]:
    """Sorted int64 indices of the entries with ``x_i >= t`` or ``x_i <= -t``, in one pass.

    ``t`` is ``threshold`` rounded to ``x``'s dtype (as NumPy compares).

    Args:
        kernel: the module from :func:`load`.
        x: contiguous 1-d fp32 or fp64 CPU tensor.
        threshold: ``t``.
        capacity: the most indices to write.

    Returns:
        ``(indices, count)``: the first ``min(count, capacity)`` indices, and the true count (a caller
        whose ``capacity`` was too small can retry with ``count``).
    """
    if x.device.type != "cpu" or x.dim() != 1 or not x.is_contiguous() or x.dtype not in (torch.float32,
                                                                                           torch.float64):
        raise ValueError(f"`x` must be a contiguous 1-d fp32/fp64 CPU tensor, got {x.dtype} {tuple(x.shape)} "
                         f"on {x.device}")
    if capacity < 0:
        raise ValueError(f"`capacity` must be >= 0, got {capacity}")
    out = torch.empty(capacity, dtype=torch.int64)
    count = kernel.at_least(x.data_ptr(), x.numel(), x.dtype == torch.float64, float(threshold), out.data_ptr(),
                            capacity)
    return out.numpy()[:min(count, capacity)], count
