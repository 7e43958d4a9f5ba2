"""The optional compiled kernel of the selections: identical results to the NumPy path, fallbacks."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import threading
import time
import warnings
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import lightning_gradcomp
from lightning_gradcomp.functional import _native, selection
from lightning_gradcomp.functional.selection import (
    approx_topk_indices,
    band_limits,
    systematic_stride,
)

kernel = _native.load()  # compiled at most once per machine (then cached in torch's extensions directory)
needs_kernel = pytest.mark.skipif(kernel is None, reason="the compiled kernel could not be built here")
LEVELS = sorted({0, 1, 2, 3} & set(range((kernel.level if kernel is not None else 0) + 1)))
"""Instruction-set levels this CPU runs (0 portable C++, 1 SSE2, 2 AVX2, 3 AVX-512F)."""


def _inputs(kind: str, n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        x = torch.randn(n, generator=gen)
    elif kind == "heavy":
        x = torch.randn(n, generator=gen) / torch.randn(n, generator=gen).abs().clamp_min(1e-3)
    elif kind == "ties":  # a few distinct magnitudes
        x = torch.randint(-3, 4, (n,), generator=gen).float()
    elif kind == "fewties":  # 2 % share one large magnitude
        x = torch.randn(n, generator=gen)
        x[torch.randperm(n, generator=gen)[: max(1, n // 50)]] = -3.0
    elif kind == "sparse":  # mostly exact zeros
        x = torch.zeros(n)
        hot = torch.randperm(n, generator=gen)[: n // 300]
        x[hot] = torch.randn(hot.numel(), generator=gen)
    elif kind == "nan":
        x = torch.randn(n, generator=gen)
        x[::997] = float("nan")
        x[5::1001] = float("inf")
        x[7::1003] = -0.0
    elif kind == "manynan":  # a seventh NaN: more NaN than k
        x = torch.randn(n, generator=gen)
        x[::7] = float("nan")
    elif kind == "zeros":
        x = torch.zeros(n)
    else:
        raise ValueError(kind)
    return x.to(dtype)


def _numpy_only(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(_native, "load", lambda: None)
    return monkeypatch


# ------------------------------------------------------------------------------------------------ at_least
@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", [1, 63, 64, 65, 127, 128, 129, 1000, 270_001])
@pytest.mark.parametrize("kind", ["gauss", "ties", "sparse", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_at_least_matches_numpy_and_brute_force(level: int, n: int, kind: str, dtype: torch.dtype) -> None:
    x = _inputs(kind, n, n, dtype)
    xn = x.numpy()
    for threshold in (0.0, 0.3, 1.0, 2.5, float("inf"), float("nan")):
        brute = np.flatnonzero(np.abs(xn) >= xn.dtype.type(threshold))
        idx, count = _native.at_least(kernel, x, threshold, n, level=level)
        assert count == brute.size and idx.dtype == np.int64
        np.testing.assert_array_equal(idx, brute)
        np.testing.assert_array_equal(selection._at_least_numpy(xn, threshold), brute)


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
def test_at_least_overflow_returns_the_true_count(level: int) -> None:
    x = _inputs("gauss", 100_003, 1)
    brute = np.flatnonzero(np.abs(x.numpy()) >= 1.0)
    for capacity in (0, 1, 63, 64, 65, 100, brute.size - 1, brute.size):
        idx, count = _native.at_least(kernel, x, 1.0, capacity, level=level)
        assert count == brute.size
        np.testing.assert_array_equal(idx, brute[:capacity])


@needs_kernel
def test_kernel_functions_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="`x`"):
        _native.at_least(kernel, torch.randn(10, 10)[:, 0], 1.0, 10)
    with pytest.raises(ValueError, match="`x`"):
        _native.at_least(kernel, torch.ones(10, dtype=torch.int32), 1.0, 10)
    with pytest.raises(ValueError, match="`capacity`"):
        _native.at_least(kernel, torch.ones(10), 1.0, -1)
    with pytest.raises(ValueError, match="`x`"):
        _native.exact(kernel, torch.ones(10, dtype=torch.float16), 3)
    for k in (0, 10, 11):
        with pytest.raises(ValueError, match="k"):
            _native.exact(kernel, torch.ones(10), k)
    x = torch.randn(1000)
    for offset, stride, k, limits in ((7, 7, 5, (4, 6)), (-1, 7, 5, (4, 6)), (0, 7, 7, (4, 6)), (0, 7, 5, (0, 6)),
                                      (0, 7, 5, (6, 5))):
        with pytest.raises(ValueError, match="offset"):
            _native.approx(kernel, x, offset, stride, (6.0, 24.0), k, limits)


# ------------------------------------------------------------------------------------------------ approx
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["gauss", "heavy", "ties", "fewties", "sparse", "nan", "manynan", "zeros"])
@pytest.mark.parametrize("n,k", [(501_760, 5018), (131_075, 300), (400_001, 40_000), (64 * 1025, 70)])
def test_selection_identical_with_and_without_kernel(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                     kind: str, n: int, k: int) -> None:
    """The kept set is the NumPy path's, for the same generator (so fidelity results carry over)."""
    x = _inputs(kind, n, k, dtype)
    for seed in range(2):
        for band, oversample in (((0.9, 1.1), 1.25), ((0.9, 1.0), 1.25), ((0.9, 1.0), 0.5), ((0.5, 2.0), 0.1)):
            native = approx_topk_indices(x, k, torch.Generator().manual_seed(seed), band=band, oversample=oversample)
            with monkeypatch.context() as m:
                _numpy_only(m)
                numpy = approx_topk_indices(x, k, torch.Generator().manual_seed(seed), band=band, oversample=oversample)
            assert torch.equal(native, numpy), (kind, seed, band, oversample)
            lo, hi = band_limits(k, band)
            assert lo <= native.numel() <= hi


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
def test_selection_identical_at_every_instruction_set(monkeypatch: pytest.MonkeyPatch, level: int) -> None:
    xs = [_inputs(kind, 200_011, 5) for kind in ("gauss", "ties", "nan")]
    with monkeypatch.context() as m:
        _numpy_only(m)
        expected = [approx_topk_indices(x, 2000, torch.Generator().manual_seed(1), band=(0.9, 1.0)) for x in xs]
    monkeypatch.setattr(kernel, "level", level)
    for x, e in zip(xs, expected, strict=True):
        assert torch.equal(approx_topk_indices(x, 2000, torch.Generator().manual_seed(1), band=(0.9, 1.0)), e)


@needs_kernel
def test_approx_statuses() -> None:
    """DONE with a selection in the band, TIES with the sorted candidates, NONE when both aims keep too few."""
    x = _inputs("gauss", 200_000, 3)
    status, idx = _native.approx(kernel, x, 5, 31, (2500.0, 10000.0), 2000, (1800, 2000))
    assert status == _native.DONE and 1800 <= idx.size <= 2000
    assert np.all(np.diff(idx) > 0) and idx.dtype == np.int64
    assert np.abs(x.numpy()[idx]).min() >= np.sort(np.abs(x.numpy()))[-idx.size]  # a top set
    ties = _inputs("ties", 200_000, 3)  # two sevenths of the entries share the top magnitude
    status, idx = _native.approx(kernel, ties, 5, 31, (2500.0, 10000.0), 2000, (1800, 2000))
    np.testing.assert_array_equal(idx, np.flatnonzero(np.abs(ties.numpy()) >= 3.0))
    assert status == _native.TIES
    status, idx = _native.approx(kernel, x, 5, 31, (10.0, 40.0), 2000, (1800, 2000))
    assert status == _native.NONE and idx.size == 0


@needs_kernel
def test_approx_retries_at_the_lower_threshold_and_past_its_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Aims far below the band: the second threshold keeps more candidates than the buffer holds."""
    status, _ = _native.approx(kernel, torch.ones(4_200_000), 0, 7, (10.0, 40.0), 10, (9, 11))
    assert status == _native.TIES  # over 2**22 candidates: the kernel frees its buffers, which start small again
    x = _inputs("heavy", 300_007, 2)
    for oversample in (0.3, 0.6):
        native = approx_topk_indices(x, 3000, torch.Generator().manual_seed(4), band=(0.9, 1.0), oversample=oversample)
        with monkeypatch.context() as m:
            _numpy_only(m)
            numpy = approx_topk_indices(x, 3000, torch.Generator().manual_seed(4), band=(0.9, 1.0),
                                        oversample=oversample)
        assert torch.equal(native, numpy)


@needs_kernel
def test_selection_calls_the_kernel_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = kernel.approx

    def spy(*args):  # type: ignore[no-untyped-def]
        calls.append(args[1])
        return real(*args)

    monkeypatch.setattr(kernel, "approx", spy)
    x = _inputs("gauss", 300_000, 3)
    approx_topk_indices(x, 3000, torch.Generator().manual_seed(0))
    assert calls == [300_000]


@needs_kernel
def test_selection_of_transposed_and_strided_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-d non-contiguous tensor is copied and selected by the kernel; a strided vector by NumPy."""
    base = _inputs("heavy", 400 * 1001, 6)
    for x in (base.reshape(400, 1001).t(), base[::3]):
        native = approx_topk_indices(x, 1200, torch.Generator().manual_seed(2))
        with monkeypatch.context() as m:
            _numpy_only(m)
            numpy = approx_topk_indices(x, 1200, torch.Generator().manual_seed(2))
        assert torch.equal(native, numpy)
        flat = x.reshape(-1).contiguous().numpy()
        np.testing.assert_array_equal(np.sort(np.abs(flat[native.numpy()])), np.sort(np.abs(flat))[-native.numel():])


def test_offset_draw_is_randints() -> None:
    """The kernel path draws the sample offset as the NumPy path does (``torch.randint``)."""
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for stride in (1, 2, 7, 73, 1009, 2**20 + 7):
        for _ in range(20):
            assert selection._draw_offset(stride, a) == int(torch.randint(stride, (1,), generator=b))
    assert torch.equal(a.get_state(), b.get_state())


def test_offset_draw_in_and_out_of_inference_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept buffer is created in inference mode first, then updated outside it (and back)."""
    monkeypatch.setattr(selection, "_SCRATCH", threading.local())
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    draws = []
    for inference in (True, False, True):
        with torch.inference_mode(inference):
            draws.append(selection._draw_offset(1000, a))
    assert draws == [int(torch.randint(1000, (1,), generator=b)) for _ in range(3)]


def test_offset_draws_in_threads() -> None:
    results: dict[int, list[int]] = {}

    def work(i: int) -> None:
        gen = torch.Generator().manual_seed(i)
        results[i] = [selection._draw_offset(1000, gen) for _ in range(200)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        gen = torch.Generator().manual_seed(i)
        assert results[i] == [int(torch.randint(1000, (1,), generator=gen)) for _ in range(200)]


# ------------------------------------------------------------------------------------------------ exact
def _numpy_exact(x: torch.Tensor, k: int, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        _numpy_only(m)
        return selection._exact_small(x, k)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["gauss", "heavy", "ties", "fewties", "sparse", "nan", "manynan", "zeros"])
@pytest.mark.parametrize("n", [2, 65, 2047, 2048, 2049, 3200, 9216, 25_601])
def test_exact_matches_numpy(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, kind: str, n: int) -> None:
    """The kernel's exact selection, or None exactly when NumPy has to break ties at the cut."""
    x = _inputs(kind, n, n, dtype)
    for k in sorted(k for k in {1, 2, n // 100, n // 10, n // 3, n - 1} if 1 <= k < n):
        expected = _numpy_exact(x, k, monkeypatch)
        found = _native.exact(kernel, x, k)
        assert (found is not None) == _unique_at_cut(x, k), (kind, k)
        if found is not None:
            np.testing.assert_array_equal(found, expected.numpy())
            assert found.dtype == np.int64
        assert torch.equal(selection._exact_small(x, k), expected)  # with the kernel, through the fallback


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("factor", [0.0, 1.0, 1.5, 2.0, 3.0, 10.0])
def test_exact_when_its_sample_misleads(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, factor: float) -> None:
    """The kernel's threshold comes from a systematic sample (every ``_native.exact_stride(n)``-th entry). Scaling
    exactly those entries makes it miss every way: zeros (every entry a candidate: the count exceeds the room, a
    second scan), a tail overestimated once (the second, lower threshold) or twice (radix selection over all
    entries). The set is NumPy's whichever path finds it."""
    n = 1024 * 50
    x = _inputs("gauss", n, 3, dtype)
    x[:: _native.exact_stride(n)] *= factor
    for k in (1, n // 100, n // 10):
        found = _native.exact(kernel, x, k)
        assert found is not None
        np.testing.assert_array_equal(found, _numpy_exact(x, k, monkeypatch).numpy())


@needs_kernel
@pytest.mark.parametrize("shape", [(256, 512), (512, 384), (128, 1024), (300, 7)])
def test_exact_on_matrices_whose_columns_differ_in_scale(monkeypatch: pytest.MonkeyPatch, shape: tuple) -> None:
    """A weight gradient whose columns' scales span decades (the case a power-of-two sampling stride read wrong)."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(shape, generator=gen) * torch.logspace(-4, 2, shape[1])).reshape(-1)
    for k in (1, x.numel() // 100, x.numel() // 10):
        found = _native.exact(kernel, x, k)
        assert found is not None
        np.testing.assert_array_equal(found, _numpy_exact(x, k, monkeypatch).numpy())


def _unique_at_cut(x: torch.Tensor, k: int) -> bool:
    """Whether NumPy's cut (the k-th largest |x|, NaN last) has exactly k entries at or above it."""
    magnitudes = np.abs(x.numpy())
    cut = np.partition(magnitudes, x.numel() - k)[x.numel() - k]
    return int(np.count_nonzero(magnitudes >= cut)) == k


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
def test_exact_nan_and_inf_at_the_cut(monkeypatch: pytest.MonkeyPatch, level: int) -> None:
    """NumPy sorts NaN last: k - (NaN count) finite entries are kept unless NaN is at the cut."""
    base = _inputs("gauss", 5000, 1)
    for nans in (0, 1, 3, 10, 11, 50):
        for infs in (0, 2):
            x = base.clone()
            x[torch.arange(nans) * 97] = float("nan")
            x[torch.arange(infs) * 89 + 1] = -float("inf")
            for k in (10, 11, 12, 60):
                expected = _numpy_exact(x, k, monkeypatch)
                found = _native.exact(kernel, x, k, level=level)
                assert (found is not None) == _unique_at_cut(x, k), (nans, infs, k)
                if found is not None:
                    np.testing.assert_array_equal(found, expected.numpy())
                    assert np.isinf(x.numpy()[found]).sum() == infs
                else:
                    assert torch.equal(selection._exact_small(x, k), expected)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_nan_compensated_by_a_tie(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """One NaN and a tie at the (k-1)-th largest finite |x|: NumPy keeps k finite entries, so does the kernel."""
    x = _inputs("gauss", 9000, 2, dtype)
    order = np.argsort(-np.abs(x.numpy()))
    x[int(order[20])] = -x[int(order[8])]  # the 9th largest magnitude, twice
    x[3] = float("nan")
    expected = _numpy_exact(x, 10, monkeypatch)
    found = _native.exact(kernel, x, 10)
    assert found is not None and expected.numel() == 10 and not np.isnan(x.numpy()[found]).any()
    np.testing.assert_array_equal(found, expected.numpy())


@needs_kernel
def test_exact_used_for_small_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = kernel.exact

    def spy(*args):  # type: ignore[no-untyped-def]
        calls.append(args[1])
        return real(*args)

    monkeypatch.setattr(kernel, "exact", spy)
    x = _inputs("gauss", 9216, 0)
    idx = approx_topk_indices(x, 92, torch.Generator().manual_seed(0))
    assert calls == [9216] and torch.equal(idx, selection.exact_topk_indices(x, 92))
    assert calls == [9216, 9216]  # exact_topk_indices uses the kernel too
    assert torch.equal(approx_topk_indices(x[::2], 46, torch.Generator()), selection.exact_topk_indices(x[::2], 46))
    assert calls == [9216, 9216]  # a strided view takes the NumPy (and torch) path


# ------------------------------------------------------------------------------------------------ loading
def test_env_var_disables_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_native.DISABLE_ENV, "1")
    monkeypatch.setattr(_native, "_DISABLED", None)  # read again, as on a process's first call
    assert _native.load() is None
    x = _inputs("gauss", 300_000, 4)
    idx = approx_topk_indices(x, 3000, torch.Generator().manual_seed(0))
    assert band_limits(3000)[0] <= idx.numel() <= band_limits(3000)[1]
    monkeypatch.delenv(_native.DISABLE_ENV)
    assert _native.load() is None  # read once per process
    monkeypatch.setattr(_native, "_DISABLED", None)
    assert _native.load() is kernel


def test_failed_build_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_native.DISABLE_ENV, raising=False)
    monkeypatch.setattr(_native, "_DISABLED", None)
    monkeypatch.setattr(_native, "_MODULE", None)
    monkeypatch.setattr(_native, "_FAILED", False)
    builds: list[int] = []

    def broken() -> None:
        builds.append(1)
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(_native, "_build", broken)
    x = _inputs("gauss", 300_000, 5)
    with pytest.warns(RuntimeWarning, match="compiler exploded"):
        first = approx_topk_indices(x, 3000, torch.Generator().manual_seed(0))
    second = approx_topk_indices(x, 3000, torch.Generator().manual_seed(0))  # no second warning, no rebuild
    assert builds == [1] and torch.equal(first, second)
    np.testing.assert_array_equal(np.sort(np.abs(x.numpy()))[-first.numel():],
                                  np.sort(np.abs(x.numpy()[first.numpy()])))


def test_stride_used_by_both_paths() -> None:
    assert selection._plan(501_760, 5018, (0.9, 1.1), 64) == (4517, 5519, 6400, systematic_stride(501_760, 6400))


# ------------------------------------------------------------------------------------------------ building
def test_sources_are_package_data() -> None:
    """The C++ sources are real files of the package, every one of the folder is built, and pyproject ships them
    (wheel and editable installs)."""
    package = Path(lightning_gradcomp.__file__).parent
    folder = package / "functional" / "native"
    assert sorted(_native.SOURCE_FILES) == sorted(p.name for p in folder.iterdir() if p.suffix in (".cpp", ".h"))
    files = _native.sources()
    assert list(files) == list(_native.SOURCE_FILES)
    for name, text in files.items():
        assert text == (folder / name).read_text(encoding="utf-8")
        assert f"// ==> native/{name}\n{text}" in _native.source()
    assert [name for name, text in files.items() if "PYBIND11_MODULE(LGC_MODULE_NAME, m)" in text] == ["module.cpp"]
    assert [name for name, text in files.items() if "#include <pybind11/" in text] == ["module.cpp"]
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["package-data"]["lightning_gradcomp"]
    for name in files:
        assert any(fnmatch((folder / name).relative_to(package).as_posix(), pattern) for pattern in patterns), name
    assert any(dep.startswith("numpy") for dep in pyproject["project"]["dependencies"])


def _reset_loader(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """A process that has not loaded the kernel yet, with an empty extensions directory ``cache``."""
    monkeypatch.delenv(_native.DISABLE_ENV, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    for name, value in (("_DISABLED", None), ("_MODULE", None), ("_FAILED", False)):
        monkeypatch.setattr(_native, name, value)


@pytest.mark.parametrize("broken", ["no compiler", "compile error"])
def test_unbuildable_kernel_warns_once_with_the_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       broken: str) -> None:
    _reset_loader(monkeypatch, tmp_path / "cache")
    if broken == "no compiler":
        monkeypatch.delenv("CXX", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path))  # no c++, g++ or clang++ here
        reason = "no C++ compiler found"
    else:
        fake = tmp_path / "fake-cxx"
        fake.write_text("#!/bin/sh\necho 'module.cpp:1:1: error: boom' >&2\nexit 1\n")
        fake.chmod(0o755)
        monkeypatch.setenv("CXX", str(fake))
        reason = "error: boom"
    x = _inputs("gauss", 300_000, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert selection.prepare_native() is False
        assert _native.load() is None
        idx = approx_topk_indices(x, 3000, torch.Generator().manual_seed(0))  # NumPy
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and reason in messages[0] and "NumPy" in messages[0], messages
    lo, hi = band_limits(3000)
    assert lo <= idx.numel() <= hi


def _copy_compile(log: Path, seconds: float) -> Callable[[str, str, str], str]:
    """A stand-in for ``_native._compile`` that logs, takes ``seconds``, and copies this machine's kernel."""
    def compile_(name: str, text: str, work: str) -> str:
        (log / f"compile-{os.getpid()}").touch()
        time.sleep(seconds)
        out = os.path.join(work, name + _native._SUFFIX)
        shutil.copyfile(str(kernel.__file__), out)
        return out

    return compile_


def _build_and_report(queue: Any) -> None:
    try:
        queue.put((True, _native._build().level))
    except BaseException as err:  # noqa: BLE001 - report it to the test
        queue.put((False, repr(err)))


def _start(target: Callable[..., None], *args: Any) -> multiprocessing.process.BaseProcess:
    process = multiprocessing.get_context("fork").Process(target=target, args=args)
    process.start()
    return process


@needs_kernel
def test_concurrent_builds_compile_once_and_publish_atomically(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """Three ranks of one machine build at once: one compiles, the others wait and import its library."""
    _reset_loader(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(_native, "_compile", _copy_compile(tmp_path, 1.0))
    queue = multiprocessing.get_context("fork").Queue()
    processes = [_start(_build_and_report, queue) for _ in range(3)]
    results = [queue.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=10)
    assert all(ok for ok, _ in results), results
    assert len(list(tmp_path.glob("compile-*"))) == 1
    (build_dir,) = (tmp_path / "cache").iterdir()  # the published library, no half-built leftovers
    assert sorted(p.name for p in build_dir.iterdir()) == ["build.lock", build_dir.name + _native._SUFFIX]


@needs_kernel
def test_killed_build_leaves_no_stale_lock(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A rank killed while it builds (e.g. by a collective's timeout) does not block the next run's build."""
    _reset_loader(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(_native, "_compile", _copy_compile(tmp_path, 60.0))
    killed = _start(_build_and_report, multiprocessing.get_context("fork").Queue())
    deadline = time.monotonic() + 30
    while not list(tmp_path.glob("compile-*")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert killed.pid is not None and list(tmp_path.glob("compile-*"))
    os.kill(killed.pid, signal.SIGKILL)  # holds the lock, mid-build
    killed.join(timeout=10)
    monkeypatch.setattr(_native, "_compile", _copy_compile(tmp_path, 0.0))
    start = time.monotonic()
    module = _native._build()
    assert time.monotonic() - start < 10 and module.level == kernel.level
    assert len(list(tmp_path.glob("compile-*"))) == 2
