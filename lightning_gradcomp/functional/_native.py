"""Optional compiled CPU kernel of the top-k selections (see :mod:`.selection`) and of the quantizers'
stochastic rounding, decoding and 2/4-bit packing (see :mod:`.quantize` and :mod:`.packing`).

The kernel's C++ sources are package data, the files :data:`SOURCE_FILES` of ``functional/native/`` (:func:`sources`):
one source per kind of kernel (``select.cpp``, ``quantize.cpp``, ``axpy.cpp``, ``casts.cpp``, ``finite.cpp``,
``sign.cpp``, ``gemm.cpp``, ``feedback.cpp``, ``delta16.cpp``, ``bitpack.cpp``), the helpers several share in
``common.h``, and ``module.cpp``, the one that includes pybind11 and registers every function: ONE plain pybind11
module, no torch headers or libraries. :func:`load` compiles them with the system's C++ compiler (``$CXX``, else
``c++``, ``g++`` or ``clang++`` on the ``PATH``), each source in its own process, as many at once as the CPUs allow,
then links them (7 s on 2 idle cores, 15-30 s on 2 cores busy with other work), and imports the module. Call it before
training: ``CLTK(selection="approx").prepare()`` does (through ``selection.prepare_native``), and so does every
quantizing compressor's ``prepare()``, on every rank in the strategy's setup, so that no build runs during backward
while the other ranks wait in a collective. A selection or quantization that runs before any :func:`load` still builds
the kernel on its first call. Nothing is compiled at import time.

:func:`load` returns ``None`` when the environment variable ``LIGHTNING_GRADCOMP_NO_NATIVE`` is ``1`` (read
on the first call) or the kernel cannot be built or imported (no compiler, no ``Python.h``, a compile error):
then it warns once per process, naming the reason, and does not retry; the selections use NumPy and the
quantizers their torch steps (the same results, slower).

The build is cached under torch's extensions directory (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``), keyed by a hash of the sources (:func:`source`), torch's version (its pybind11 headers),
the Python ABI and the flags, so it runs once per machine; later processes import it in milliseconds. Concurrent
processes (the ranks of one machine) take turns on an ``flock`` of ``<cache>/<name>/build.lock``, which the OS releases
when its holder dies (a killed build leaves no stale lock): the first compiles in a private directory and publishes the
library by an atomic rename, so no process imports a half-written library, and the others find it when the lock is
theirs. Without ``fcntl`` (or after :data:`_LOCK_TIMEOUT` seconds of waiting) a process builds unlocked: redundant work,
still correct.

Kernel functions (each reads ``x`` as flat; results are identical to the NumPy steps they replace):

* :func:`at_least`: the sorted indices of ``|x_i| >= t``, one pass (a 64-bit compare mask per 64
  entries, SSE2/AVX2/AVX-512 chosen at run time, then the set bits).
* :func:`approx`: all CPU steps of ``approx_topk_indices`` in one call: the systematic sample, its
  order statistic (radix selection on the bits of ``|x|``, which order as NumPy orders ``|x|``, NaN
  last), the threshold pass and the trim to the ``k`` largest candidates.
* :func:`exact`: the exact top-``k`` (the k-th largest ``|x|`` among the entries above a threshold from a
  systematic sample, at the stride :func:`exact_stride` gives; a second, lower threshold when too few pass the
  first; radix selection over all entries only when both fall short).
* ``stochastic_round``, ``dequantize``, ``dequantize_add``, ``dequantize_mean``, ``pack``, ``unpack`` and
  ``pack_into`` (called by :mod:`.quantize`, :mod:`.packing` and the quantizers' wire layout, which check their
  arguments): stochastic rounding of fp32 groups with the counter-based uniform draws of ``quantize.hashed_uniform``
  computed in registers; decoding of codes one per byte or still bit-packed 1, 2 or 4 bits wide in a received payload
  (eight per AVX2 step, never unpacked into memory), also straight into ``base + alpha * d`` (an explicit fused
  multiply-add, as torch's ``add`` computes it) and into the rank-ordered mean of W rows; 2/4-bit (un)packing; and
  packing a segment's codes at any code offset of a payload. Each is bit-identical to the torch steps it replaces
  (the build turns FMA contraction off, so every other fp32 step rounds as torch's does).
* ``add_scaled`` (called by :mod:`.axpy`): ``base + alpha * x`` into one or two outputs, torch's ``add`` bits.
* ``scaled_cast`` and ``widen`` (called by :mod:`.half`): ``x / d`` rounded to fp16/bf16 in one pass, and 16 bits
  widened back to fp32 with a NaN/Inf check in the same pass (F16C conversions, as torch's vector loop uses).
* ``any_nonfinite`` (called by :mod:`.finite`): whether some fp32 value is NaN or infinite, one scan of the
  exponent bits.
* ``compensate`` (called by :mod:`.feedback`): error feedback's ``p = m + g / s`` in one pass, checking ``g`` for
  NaN/Inf and optionally zeroing it on the way (torch's bits).
* ``sign_codes`` and ``sign_quantize`` (called by :mod:`.quantize`): scaled sign's ``x >= 0`` bytes (torch's), and
  with them each bucket's mean ``|x|`` in one pass (the kernel's own summation order); optionally the residual
  ``x - decode()`` too, each bucket's right after its mean (``dequantize_add``'s bits).
* ``stochastic_round`` takes an optional ``minus``: DIANA's ``g - h``, subtracted group by group.
* ``thin_matmul``, ``thin_matmul_t`` and ``subtract_product`` (called by :mod:`.lowrank`): PowerSGD's ``M Q``,
  ``M^T P`` and ``M - P Q^T`` for up to ``thin_max`` (32) columns, one pass over ``M`` each, in a fixed summation
  order of their own (not BLAS's bits).

``native/common.h`` begins with the list of which source holds which function.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from importlib import resources
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from lightning_gradcomp.functional.sampling import systematic_stride

__all__ = [
    "DISABLE_ENV",
    "DONE",
    "MAX_NUMEL",
    "NONE",
    "SOURCE_DIR",
    "SOURCE_FILES",
    "TIES",
    "approx",
    "at_least",
    "exact",
    "exact_stride",
    "for_fp32",
    "load",
    "source",
    "sources",
]

DISABLE_ENV = "LIGHTNING_GRADCOMP_NO_NATIVE"
"""Set this environment variable to ``1`` to use the NumPy path instead of the compiled kernel."""

DONE, NONE, TIES = 0, 1, 2
"""Status of :func:`approx`: selection made; no threshold kept enough; too many ties to trim."""

MAX_NUMEL = 1 << 32
"""Tensors must have fewer entries than this (the kernel's histograms count in 32 bits)."""

SOURCE_DIR = ("lightning_gradcomp.functional", "native")
"""Where the kernel's sources are: ``(package, folder relative to it)``, shipped as package data."""

SOURCE_FILES = (
    "common.h",
    "module.cpp",
    "select.cpp",
    "quantize.cpp",
    "axpy.cpp",
    "casts.cpp",
    "finite.cpp",
    "sign.cpp",
    "gemm.cpp",
    "feedback.cpp",
    "delta16.cpp",
    "bitpack.cpp",
)
"""The kernel's sources in :data:`SOURCE_DIR`, in the order :func:`source` joins them (the ``.cpp`` files are compiled,
``module.cpp``, the slowest, first)."""

_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
"""File name ending of an extension module of this Python (e.g. ``.cpython-311-x86_64-linux-gnu.so``)."""

_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off")
"""Compiler flags of every source (pybind11's recommended ones; the kernel picks its instruction set at run time). No
contraction of ``a * b + c`` into an FMA: the quantization kernel must round each fp32 step as torch does."""

_LINK_FLAGS = ("-shared",)
"""Flags of the link of the compiled sources into the extension module."""

_LOCK_TIMEOUT = 600.0
"""Seconds a process waits for another one's build before it builds too (unlocked)."""

_LOCK = threading.Lock()
_MODULE: ModuleType | None = None
_FAILED = False
_DISABLED: bool | None = None
"""Whether :data:`DISABLE_ENV` is ``1``: read on the first call of :func:`load` (an ``os.environ`` look-up
costs more than the selection of a small layer once other work has evicted Python's caches)."""


def sources() -> dict[str, str]:
    """The kernel's C++ sources, file name to text in the order of :data:`SOURCE_FILES`, read from the package data (a
    wheel and an editable install alike)."""
    package, folder = SOURCE_DIR
    root = resources.files(package).joinpath(*folder.split("/"))
    return {name: root.joinpath(name).read_text(encoding="utf-8") for name in SOURCE_FILES}


def source() -> str:
    """The kernel's C++ sources as one text: each file's text after a line naming it, in the order of
    :data:`SOURCE_FILES` (the cache key hashes it)."""
    return _joined(sources())


def _joined(files: dict[str, str]) -> str:
    """:func:`source`'s text of the sources ``files``."""
    return "".join(f"// ==> {SOURCE_DIR[1]}/{name}\n{text}" for name, text in files.items())


def load() -> ModuleType | None:
    """The compiled kernel module, building it on first use; ``None`` if disabled or unavailable.

    :data:`DISABLE_ENV` is read on the first call (set it before the first CPU selection). A failed build
    or import warns once (``RuntimeWarning``, with the reason) and is not retried in this process.
    """
    global _MODULE, _FAILED, _DISABLED
    if _DISABLED is None:
        _DISABLED = os.environ.get(DISABLE_ENV, "") == "1"
    if _DISABLED:
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
                warnings.warn(
                    f"lightning_gradcomp: the compiled CPU kernel is unavailable "
                    f"({type(err).__name__}: {lines[0] if lines else 'no message'}); the selections "
                    f"use NumPy, and the quantizers, the casts and the NaN/Inf scan torch instead (same results, "
                    f"slower). Set "
                    f"{DISABLE_ENV}=1 to skip building it.",
                    RuntimeWarning,
                    stacklevel=2,
                )
    return _MODULE


def _build() -> ModuleType:
    """Import the cached kernel, compiling it first when this machine has none (see the module docstring)."""
    files = sources()
    key = f"{_joined(files)}|{torch.__version__}|{_SUFFIX}|{_FLAGS}|{_LINK_FLAGS}"
    name = "lightning_gradcomp_native_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    build_dir = os.path.join(_cache_root(), name)
    library = os.path.join(build_dir, name + _SUFFIX)
    if not os.path.exists(library):
        os.makedirs(build_dir, exist_ok=True)
        with _exclusive(os.path.join(build_dir, "build.lock")):
            if not os.path.exists(library):  # another process may have built it while this one waited
                work = tempfile.mkdtemp(prefix="build-", dir=build_dir)
                try:
                    os.replace(_compile(name, files, work), library)  # atomic: the whole library or none
                finally:
                    shutil.rmtree(work, ignore_errors=True)
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as err:
        raise ImportError(f"{err} (delete {build_dir} to rebuild it)") from err
    return module


def _cache_root() -> str:
    """Torch's extensions directory: ``TORCH_EXTENSIONS_DIR``, else torch's default."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    from torch.utils.cpp_extension import get_default_build_root  # imports setuptools: only when needed

    return get_default_build_root()


@contextlib.contextmanager
def _exclusive(path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` of ``path`` (created if missing) for the block; the OS releases it when
    the holder dies. Without ``fcntl``, where the file system refuses locks, or after :data:`_LOCK_TIMEOUT`
    seconds, the block runs unlocked."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path, "a", encoding="utf-8") as handle:  # closing it releases the lock
        deadline = time.monotonic() + _LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # another process builds: wait for it
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            except OSError:  # no locks on this file system
                break
        yield


def _compile(name: str, files: dict[str, str], work: str) -> str:
    """Compile the sources ``files`` (file name to text) as the extension module ``name`` in the directory ``work``;
    its path. Each ``.cpp`` is compiled by its own process, as many at once as this process may use CPUs, in the
    order of ``files``; then one link."""
    compiler = _compiler()
    pybind11 = os.path.join(os.path.dirname(torch.__file__), "include")  # torch ships pybind11's headers
    python = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(pybind11, "pybind11", "pybind11.h")):
        raise RuntimeError(f"pybind11 headers not found in {pybind11}")
    if not os.path.exists(os.path.join(python, "Python.h")):
        raise RuntimeError(f"Python.h not found in {python} (install the Python development headers)")
    for file, text in files.items():
        with open(os.path.join(work, file), "w", encoding="utf-8") as f:
            f.write(text)
    units = [file for file in files if file.endswith(".cpp")]
    flags = [*_FLAGS, f"-DLGC_MODULE_NAME={name}", "-isystem", pybind11, "-isystem", python]
    commands = [[*compiler, *flags, "-c", os.path.join(work, u), "-o", os.path.join(work, u + ".o")] for u in units]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(units), _cpus()))) as pool:
        done = list(pool.map(_run, commands))
    for unit, (returncode, output) in zip(units, done):
        if returncode != 0:
            detail = _first_error(returncode, output)
            raise RuntimeError(f"{shlex.join(compiler)} failed to compile {SOURCE_DIR[1]}/{unit}: {detail}")
    out = os.path.join(work, name + _SUFFIX)
    command = [*compiler, *_LINK_FLAGS, *(os.path.join(work, u + ".o") for u in units), "-o", out]
    if sys.platform == "darwin":
        command += ["-undefined", "dynamic_lookup"]  # Python's symbols resolve when the module is imported
    returncode, output = _run(command)
    if returncode != 0:
        raise RuntimeError(f"{shlex.join(compiler)} failed to link the kernel: {_first_error(returncode, output)}")
    return out


def _run(command: list[str]) -> tuple[int, str]:
    """Run ``command``; its exit status and its output (stderr, then stdout)."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    return done.returncode, done.stderr + done.stdout


def _first_error(returncode: int, output: str) -> str:
    """The first line of a failed compiler's ``output`` that names an error, else its first line, else its exit
    status."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [f"exit status {returncode}"])[0]


def _cpus() -> int:
    """How many CPUs this process may use."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def _compiler() -> list[str]:
    """The C++ compiler command: ``$CXX``, else the first of ``c++``, ``g++``, ``clang++`` on the ``PATH``."""
    command = shlex.split(os.environ.get("CXX", ""))
    if command:
        if shutil.which(command[0]) is None:
            raise RuntimeError(f"the C++ compiler CXX={os.environ['CXX']!r} was not found")
        return command
    for candidate in ("c++", "g++", "clang++"):
        found = shutil.which(candidate)
        if found:
            return [found]
    raise RuntimeError("no C++ compiler found (install g++ or clang++, or set CXX)")


def for_fp32(*tensors: Tensor) -> ModuleType | None:
    """The kernel when every tensor is a contiguous fp32 CPU tensor (the fp32 passes read and write them through raw
    pointers), else ``None``; ``None`` too where the kernel is unavailable (see :func:`load`)."""
    if all(t.device.type == "cpu" and t.dtype is torch.float32 and t.is_contiguous() for t in tensors):
        return load()
    return None


def _check(x: Tensor) -> None:
    """Raise ``ValueError`` unless ``x`` is a contiguous fp32/fp64 CPU tensor."""
    if x.device.type != "cpu" or not x.is_contiguous() or x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"`x` must be a contiguous fp32/fp64 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}")


def _level(kernel: ModuleType, level: int | None) -> int:
    """The instruction-set level to run: the CPU's best (``kernel.level``) unless a lower one is asked."""
    return kernel.level if level is None else min(level, kernel.level)


def at_least(
    kernel: ModuleType, x: Tensor, threshold: float, capacity: int, *, level: int | None = None
) -> tuple[np.ndarray, int]:
    """Sorted int64 indices of the entries with ``x_i >= t`` or ``x_i <= -t``, in one pass.

    ``t`` is ``threshold`` rounded to ``x``'s dtype (as NumPy compares).

    Args:
        kernel: the module from :func:`load`.
        x: contiguous fp32 or fp64 CPU tensor (read as flat).
        threshold: ``t``.
        capacity: the most indices to write.
        level: instruction set, for tests: 0 portable C++, 1 SSE2, 2 AVX2, 3 AVX-512F (default: the
            best the CPU runs, ``kernel.level``; higher values are lowered to it).

    Returns:
        ``(indices, count)``: the first ``min(count, capacity)`` indices, and the true count (a caller
        whose ``capacity`` was too small can retry with ``count``).
    """
    _check(x)
    if capacity < 0:
        raise ValueError(f"`capacity` must be >= 0, got {capacity}")
    out = torch.empty(capacity, dtype=torch.int64)
    count = kernel.at_least(
        x.data_ptr(),
        x.numel(),
        x.dtype == torch.float64,
        float(threshold),
        out.data_ptr(),
        capacity,
        _level(kernel, level),
    )
    return out.numpy()[: min(count, capacity)], count


def approx(
    kernel: ModuleType,
    x: Tensor,
    offset: int,
    stride: int,
    aims: tuple[float, float],
    k: int,
    limits: tuple[int, int],
    *,
    level: int | None = None,
) -> tuple[int, np.ndarray]:
    """The CPU steps of the approximate selection in one call (see ``selection._approx_numpy``).

    The sample ``|x[offset::stride]|``; for each aim in turn, its ``rank``-th largest value ``t``
    (``rank = min(m, max(1, ceil(aim * m / n)))`` for a sample of ``m``), and the entries with
    ``|x_i| >= t``: more than ``hi`` of them are trimmed to the ``k`` largest, ``lo`` to ``hi`` are
    kept, fewer go to the next aim.

    Args:
        kernel: the module from :func:`load`.
        x: contiguous fp32 or fp64 CPU tensor of ``n`` entries (read as flat).
        offset: first sampled entry, ``0 <= offset < min(stride, n)``.
        stride: sample stride, ``>= 1``.
        aims: the two candidate counts the thresholds aim at.
        k: the count a trim keeps, ``1 <= k <= hi``.
        limits: ``(lo, hi)``, the accepted counts.
        level: instruction set, as in :func:`at_least`.

    Returns:
        ``(status, indices)``: :data:`DONE` and the sorted selection; :data:`TIES` and the sorted
        candidates of a trim that more than ``hi`` entries tie (the caller trims them); or :data:`NONE`
        and no indices (both thresholds kept fewer than ``lo``).
    """
    _check(x)
    n = x.numel()
    lo, hi = limits
    if not (0 <= offset < stride and offset < n and 1 <= k <= hi and 1 <= lo <= hi and n < MAX_NUMEL):
        raise ValueError(
            f"need 0 <= offset < min(stride, n), 1 <= k <= hi, 1 <= lo <= hi and n < 2**32, got "
            f"offset={offset}, stride={stride}, n={n}, k={k}, limits={limits}"
        )
    status, idx = kernel.approx(
        x.data_ptr(),
        n,
        x.dtype == torch.float64,
        offset,
        stride,
        float(aims[0]),
        float(aims[1]),
        k,
        lo,
        hi,
        _level(kernel, level),
    )
    return status, idx


def exact(kernel: ModuleType, x: Tensor, k: int, *, level: int | None = None) -> np.ndarray | None:
    """Sorted int64 indices of the ``k`` largest ``|x_i|``, or ``None`` when that set is not unique.

    The ``k``-th largest ``|x_i|`` (NaN counts as largest, as in ``np.partition``) is found by radix
    selection, then every entry at or above it is kept; ``None`` when that is not exactly ``k`` entries
    (ties, or NaN, at the cut).

    Args:
        kernel: the module from :func:`load`.
        x: contiguous fp32 or fp64 CPU tensor of ``n`` entries (read as flat).
        k: ``1 <= k < n``.
        level: instruction set, as in :func:`at_least`.
    """
    _check(x)
    n = x.numel()
    if not 1 <= k < n < MAX_NUMEL:
        raise ValueError(f"need 1 <= k < n < 2**32, got k={k}, n={n}")
    return kernel.exact(x.data_ptr(), n, x.dtype == torch.float64, k, exact_stride(n), _level(kernel, level))


@functools.lru_cache(maxsize=256)
def exact_stride(n: int) -> int:
    """Stride of :func:`exact`'s threshold sample of ``n`` entries: about 1,024 of them, at least every 8th, at the
    stride :func:`~.sampling.systematic_stride` gives (coprime to 210, so that it meets every column of a matrix)."""
    return systematic_stride(n, min(1024, n // 8))
