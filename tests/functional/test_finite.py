"""The NaN/Inf flag of a bucket: the kernel's exponent scan and torch's ``isfinite(x).all()`` agree on every class
of input (finite extremes, NaN/Inf anywhere in the vector body or the tail), at the portable level and the CPU's
best; other dtypes take torch's steps."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.functional import _native
from lightning_gradcomp.functional.finite import nonfinite_flag

kernel = _native.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the compiled kernel could not be built here")
LEVELS = sorted({0, kernel.level if kernel is not None else 0})


def _torch_flag(x: torch.Tensor) -> float:
    return float(not bool(torch.isfinite(x).all()))


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 100, 4097])
def test_the_kernel_flags_exactly_the_nan_and_inf_entries(n: int, level: int) -> None:
    finite = torch.randn(n) * torch.logspace(-40, 37, max(n, 1))[:n]  # subnormals to ~1e37: all finite
    if n:
        finite[0] = torch.finfo(torch.float32).max
    assert nonfinite_flag(finite, level=level).item() == 0.0 == _torch_flag(finite)
    for position in sorted({0, n // 2, n - 1}) if n else []:
        for value in (float("nan"), float("inf"), -float("inf"), -float("nan")):
            x = finite.clone()
            x[position] = value
            flag = nonfinite_flag(x, level=level)
            assert flag.dtype == torch.float32 and flag.shape == (1,)
            assert flag.item() == 1.0 == _torch_flag(x)


def test_other_dtypes_and_views_take_torchs_steps() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = torch.ones(10, dtype=dtype)
        assert nonfinite_flag(x).item() == 0.0 and nonfinite_flag(x).dtype == dtype
        x[3] = float("inf")
        assert nonfinite_flag(x).item() == 1.0
    strided = torch.ones(20)[::2].clone()
    strided[4] = float("nan")
    assert nonfinite_flag(torch.stack([strided, strided], 1)[:, 0]).item() == 1.0  # not contiguous
