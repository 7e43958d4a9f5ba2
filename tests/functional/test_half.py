"""The casts' fused passes (``functional.half``): torch's bits for every finite value and infinity, NaN for NaN,
and the NaN/Inf check of ``widen``; at the portable level and the CPU's best, on tails of every length."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.functional import _native
from lightning_gradcomp.functional.half import scaled_cast, widen

kernel = _native.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the compiled kernel could not be built here")
LEVELS = sorted({0, kernel.level if kernel is not None else 0})
DTYPES = [torch.float16, torch.bfloat16]
SIZES = [1, 7, 8, 9, 15, 17, 100, 4097, 100_003]


def _values(n: int, seed: int) -> torch.Tensor:
    """Magnitudes from 1e-12 to 1e6, the fp16 edges (overflow at 65520, subnormals, the smallest normal), and a
    quarter of random bit patterns (NaNs with payloads, infinities, fp32 subnormals)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-12, 6, n)[torch.randperm(n, generator=gen)]
    edges = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e-8, 5.96e-8, 2.98e-8, 2.9802322e-08,
                          6.1035156e-05, 6.1e-05, float("inf"), -float("inf"), 3e38, -3e38, 1e-45, 1.17e-38])
    x[: min(n, edges.numel())] = edges[: min(n, edges.numel())]
    quarter = n // 4
    if quarter:
        x[n - quarter:] = torch.randint(-2**31, 2**31 - 1, (quarter,), generator=gen, dtype=torch.int32).view(
            torch.float32)
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, except that any NaN matches any NaN."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a].view(bits), b[~nan_b].view(bits))


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_scaled_cast_gives_torchs_bits(n: int, dtype: torch.dtype, level: int) -> None:
    for world in (1, 2, 3, 5, 8):
        x = _values(n, n + world)
        want = x.clone().div_(world).to(dtype)
        src = x.clone()
        out = scaled_cast(src, world, torch.empty(n, dtype=dtype), level=level)
        assert _same(out, want)
        assert _same(src, x)  # the kernel reads its input only


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_widen_is_exact_and_checks_for_nan_and_inf(n: int, dtype: torch.dtype, level: int) -> None:
    gen = torch.Generator().manual_seed(n)
    bits = torch.randint(-2**15, 2**15 - 1, (n,), generator=gen, dtype=torch.int16)
    for codes in (bits, bits & 0x3FFF):  # every pattern; then finite only (exponent below all-ones)
        src = codes.view(dtype)
        out = torch.full((n,), 7.0)
        seen = widen(src, out, level=level)
        assert _same(out, src.float())
        assert seen == bool((~torch.isfinite(src.float())).any())


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("position", [0, 5, 8, 99])  # in the vector body and in the tail
def test_widen_finds_a_single_nan_or_inf_anywhere(level: int, position: int) -> None:
    for dtype in DTYPES:
        for value in (float("nan"), float("inf"), -float("inf")):
            src = torch.ones(100, dtype=dtype)
            src[position] = value
            assert widen(src, torch.empty(100), level=level) is True
        assert widen(torch.ones(100, dtype=dtype), torch.empty(100), level=level) is False


def test_torch_steps_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "load", lambda: None)
    src = torch.tensor([3.0, 1e6, -2.5])
    out = scaled_cast(src, 2, torch.empty(3, dtype=torch.float16))
    assert out.tolist() == [1.5, float("inf"), -1.25]
    back = torch.empty(3)
    assert widen(out, back) is None  # no check on the torch steps: the caller checks
    assert back.tolist() == [1.5, float("inf"), -1.25]


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="`scaled_cast` takes fp32 into fp16/bf16 of one size"):
        scaled_cast(torch.zeros(3), 2, torch.empty(3))
    with pytest.raises(ValueError, match="`scaled_cast` takes fp32 into fp16/bf16 of one size"):
        scaled_cast(torch.zeros(3), 2, torch.empty(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="`widen` takes fp16/bf16 into fp32 of one size"):
        widen(torch.zeros(3), torch.empty(3))
