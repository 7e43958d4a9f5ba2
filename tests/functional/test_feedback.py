"""Error-feedback compensation ``p = m + g / s``: the kernel's pass gives torch's bits (``m + g``, ``addcdiv``) on
every class of input (lengths around the vector width, extremes, NaN/Inf, signed zeros), at the portable level and
the CPU's best, and ``clear`` zeroes the gradient; other inputs take torch's steps with the same contract."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from lightning_gradcomp.functional import _native
from lightning_gradcomp.functional.feedback import compensate, compensate_checked, recover_gradient

kernel = _native.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the compiled kernel could not be built here")
LEVELS = sorted({0, kernel.level if kernel is not None else 0})


def _torch_reference(m: Optional[torch.Tensor], g: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    if m is None:
        out = g.to(torch.float32, copy=True)
        return out if scale is None else out.div_(scale)
    return m + g.to(torch.float32) if scale is None else torch.addcdiv(m, g.to(torch.float32), scale)


def _values(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-42, 38, max(n, 1))[:n]  # subnormals to ~1e38
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 1e-45])
    if n:
        picks = torch.randint(0, n, (min(n, 8),), generator=gen)
        x[picks] = special[: picks.numel()]
    return x


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 31, 100, 4099, 70_001])
@pytest.mark.parametrize("scale", [None, 1.0, 1024.0, 3.0, 2.0**-20])
@pytest.mark.parametrize("clear", [False, True])
def test_the_kernel_gives_torchs_bits(n: int, level: int, scale: Optional[float], clear: bool) -> None:
    m, g = _values(n, 1), _values(n, 2)
    s = None if scale is None else torch.tensor([scale])
    expected = _torch_reference(m, g, s)
    g_before = g.clone()
    p = compensate(m, g, s, clear=clear, level=level)
    assert p.dtype == torch.float32 and p.shape == m.shape
    assert torch.equal(p.view(torch.int32), expected.view(torch.int32)) or (
        torch.equal(torch.isnan(p), torch.isnan(expected)) and torch.equal(p[~p.isnan()], expected[~p.isnan()])
    )  # NaN payloads are unspecified; every other bit matches
    if clear:
        assert torch.equal(g, torch.zeros(n))
    else:  # untouched, bit for bit
        assert torch.equal(g.view(torch.int32), g_before.view(torch.int32))


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}


@pytest.mark.parametrize("clear", [False, True])
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize(
    "case",
    ["no memory", "fp16 gradient", "bf16 gradient", "fp64 gradient", "strided gradient", "no kernel"],
)
def test_other_inputs_take_torchs_steps(case: str, scaled: bool, clear: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``p`` is fp32 whatever the gradient's dtype (an fp64 gradient is not promoted to fp64)."""
    n = 37
    m: Optional[torch.Tensor] = torch.randn(n)
    g = torch.randn(n)
    scale: Optional[torch.Tensor] = torch.tensor([4.0]) if scaled else None
    if case == "no memory":
        m = None
    elif case.endswith("gradient") and "strided" not in case:
        g = g.to(DTYPES[case.split()[0]])
    elif case == "strided gradient":
        g = torch.randn(n, 2)[:, 0]
    else:
        monkeypatch.setattr(_native, "load", lambda: None)
    expected = _torch_reference(m, g, scale)
    p = compensate(m, g, scale, clear=clear)
    assert p.dtype == torch.float32 and torch.equal(p, expected)
    assert (g == 0).all() == clear


@needs_kernel
@pytest.mark.parametrize("value", [0.0, -2.0])
def test_a_non_positive_scale_takes_torchs_steps(value: float) -> None:
    m, g = torch.randn(20), torch.randn(20)
    scale = torch.tensor([value])
    assert torch.equal(compensate(m, g, scale), torch.addcdiv(m, g, scale))


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", [1, 8, 9, 1000])
def test_the_kernel_flags_exactly_a_nan_or_inf_gradient(n: int, level: int) -> None:
    m = torch.randn(n)
    finite = torch.randn(n) * 1e30  # m + g may overflow nowhere: |g| <~ 5e30
    finite[0] = torch.finfo(torch.float32).max
    assert compensate_checked(m, finite.clone(), level=level)[1] is False
    for position in sorted({0, n // 2, n - 1}):
        for value in (float("nan"), float("inf"), -float("inf")):
            g = finite.clone()
            g[position] = value
            p, bad = compensate_checked(m, g, torch.tensor([2.0]), clear=True, level=level)
            assert bad is True and bool(torch.isfinite(p).all()) is False


def test_the_torch_steps_do_not_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "load", lambda: None)
    assert compensate_checked(torch.zeros(3), torch.tensor([1.0, float("nan"), 2.0]))[1] is None
    assert compensate_checked(None, torch.ones(3))[1] is None


@pytest.mark.parametrize("scale", [None, 1.0, 1024.0, 2.0**-3])
@pytest.mark.parametrize("with_memory", [False, True])
def test_recover_gradient_gives_back_nan_and_inf_exactly_and_the_rest_within_rounding(
        scale: Optional[float], with_memory: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(1000, generator=gen) * torch.logspace(-3, 3, 1000)
    grad[[7, 500, 999]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    memory = torch.randn(1000, generator=gen) if with_memory else None
    s = None if scale is None else torch.tensor([scale])
    back = recover_gradient(memory, compensate(memory, grad.clone(), s), s)
    for where in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(where(back), where(grad))
    finite = torch.isfinite(grad)
    if memory is None:  # p = g / s with s a power of two: exact
        assert torch.equal(back[finite], grad[finite])
    else:  # p's rounding, relative to |m| (times s)
        tolerance = 2.0**-23 * (memory.abs() + (grad / (scale or 1.0)).abs()) * (scale or 1.0)
        assert bool(((back - grad).abs()[finite] <= tolerance[finite]).all())


@pytest.mark.parametrize("shape", [(1,), ()])
@pytest.mark.parametrize("with_memory", [True, False])
def test_p_is_fp32_whatever_the_scales_dtype(shape: tuple, with_memory: bool) -> None:
    """A one-element fp64 scale promoted ``addcdiv`` to fp64; now the scale is taken in fp32, as the hook passes it."""
    g, m = torch.tensor([1.0, -3.0, 0.5]), torch.tensor([0.25, 0.5, -1.0])
    scale = torch.full(shape, 4.0, dtype=torch.float64)
    p = compensate(m if with_memory else None, g, scale)
    assert p.dtype is torch.float32
    assert torch.equal(p, compensate(m if with_memory else None, g, scale.float()))
