"""add_scaled: ``base + alpha * x`` (one or two outputs) to torch.add's bits, at every kernel level."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.functional import _native
from lightning_gradcomp.functional.axpy import add_scaled

kernel = _native.load()
LEVELS = sorted({0, kernel.level if kernel is not None else 0})


def _inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, base = torch.randn(n, generator=gen) * 1e3, torch.randn(n, generator=gen)
    if n > 20:
        x[::7], base[3::11] = float("inf"), float("nan")
        x[5::13], base[6::17] = 3e38, 3e38  # overflow to infinity
        x[8::19] = 1e-41  # subnormal
    return x, base


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 513, 100_003])
@pytest.mark.parametrize("alpha, alpha2", [(0.37, 1.0), (2.0**-7, None), (1.0, 1 / 129), (-1.0, 0.5)])
def test_add_scaled_is_torch_add(n: int, alpha: float, alpha2: float | None, level: int) -> None:
    x, base = _inputs(n, n)
    out, out2 = torch.full((n,), 7.0), None if alpha2 is None else torch.full((n,), 7.0)
    add_scaled(x, base, alpha, out, alpha2, out2, level=level)
    assert torch.equal(_bits(out), _bits(torch.add(base, x, alpha=alpha)))
    if out2 is not None:
        assert torch.equal(_bits(out2), _bits(torch.add(base, x, alpha=alpha2)))


@pytest.mark.parametrize("use_kernel", [True, False])
def test_outputs_may_alias_either_input(use_kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not use_kernel:
        monkeypatch.setattr(_native, "load", lambda: None)
    x, base = _inputs(1000, 1)
    want, want2 = torch.add(base, x, alpha=0.5), base + x
    a, b = x.clone(), base.clone()
    add_scaled(a, b, 0.5, b, 1.0, a)  # out over base, out2 over x
    assert torch.equal(_bits(b), _bits(want)) and torch.equal(_bits(a), _bits(want2))
    a, b = x.clone(), base.clone()
    add_scaled(a, b, 0.5, a)
    assert torch.equal(_bits(a), _bits(want))


def test_shapes_and_dtypes_must_match() -> None:
    with pytest.raises(ValueError, match="`base` and the outputs must be"):
        add_scaled(torch.zeros(3), torch.zeros(4), 1.0, torch.zeros(3))
    with pytest.raises(ValueError, match="`base` and the outputs must be"):
        add_scaled(torch.zeros(3), torch.zeros(3), 1.0, torch.zeros(3), 1.0, torch.zeros(3, dtype=torch.float64))


def test_other_dtypes_take_torch_add() -> None:
    x, base = torch.randn(10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    out = torch.empty_like(x)
    add_scaled(x, base, 0.25, out)
    assert torch.equal(out, torch.add(base, x, alpha=0.25))
