"""The NaN/Inf flag of a bucket: the kernel's exponent scan and torch's ``isfinite(x).all()`` agree on every class
of input (finite extremes, NaN/Inf anywhere in the vector body or the tail), at the portable level and the CPU's
best; other dtypes take torch's steps. ``zero_if_nonfinite`` (the local-step guards) on every dtype and shape."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_gradcomp.functional import _native
from lightning_gradcomp.functional.finite import _zero_where, nonfinite_flag, zero_if_nonfinite

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


SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4)]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_if_nonfinite_zeroes_every_tensor_exactly_when_one_holds_nan_or_inf(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)

    def tensors() -> list[torch.Tensor]:
        return [torch.randn(s, generator=gen).to(dtype) + 1 for s in SHAPES]

    finite = tensors()
    before = [t.clone() for t in finite]
    flag = zero_if_nonfinite(finite)
    assert flag.shape == (1,) and flag.dtype == torch.float32 and flag.item() == 0.0
    assert all(torch.equal(a, b) for a, b in zip(finite, before))  # untouched
    for where, shape in enumerate(SHAPES):
        if not math.prod(shape):
            continue
        for value in (float("nan"), float("inf"), -float("inf")):
            poisoned = tensors()
            poisoned[where].view(-1)[-1] = value
            assert zero_if_nonfinite(poisoned).item() == 1.0
            assert all(t.dtype == dtype and not t.any() for t in poisoned)  # every tensor, not only the bad one
    assert zero_if_nonfinite([]).item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_device_branch_masks_on_the_flag(dtype: torch.dtype) -> None:
    """What ``zero_if_nonfinite`` does off the CPU (no host read), run here on CPU tensors."""
    for value in (0.0, 1.0):
        tensors = [torch.full(s, float("nan") if value else 2.0, dtype=dtype) for s in SHAPES]
        _zero_where(tensors, torch.tensor([value]))
        for t, s in zip(tensors, SHAPES):
            assert t.shape == s and t.dtype == dtype
            assert (not t.any()) if value else bool((t == 2.0).all())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), None])
def test_sparse_gradients_are_judged_and_zeroed_by_their_stored_values(value: float) -> None:
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    embedding(torch.tensor([1, 2, 1])).sum().backward()  # uncoalesced: index 1 stored twice
    grad, dense = embedding.weight.grad, torch.ones(4)
    if value is not None:
        grad._values()[2, 1] = value
    before = grad.to_dense().clone()
    flag = zero_if_nonfinite([grad, dense])
    assert flag.item() == float(value is not None)
    if value is None:
        assert torch.equal(grad.to_dense(), before) and torch.equal(dense, torch.ones(4))
    else:
        assert not grad.to_dense().any() and not dense.any()
    device_branch = embedding.weight.grad.clone()
    _zero_where([device_branch], torch.ones(1))
    assert not device_branch.to_dense().any()
