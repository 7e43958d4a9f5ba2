"""Complex tensors as real numbers: views that share storage, and the way back, for every dtype and layout."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.functional.realview import from_real, real_shape, real_view, real_view_numel

DTYPES = [torch.complex64, torch.complex128, torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 5), (2, 3, 4)])
def test_real_view_round_trips_and_writes_through(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    t = torch.randn(shape, generator=gen, dtype=torch.complex128 if dtype.is_complex else torch.float64).to(dtype)
    view = real_view(t)
    assert not view.is_complex() and tuple(view.shape) == real_shape(t) and view.numel() == real_view_numel(t)
    if t.numel():
        assert view.data_ptr() == t.data_ptr()  # a view, not a copy
    back = from_real(view.double(), t)  # through another dtype, as the strategies' flat fp64 means go
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    before = t.clone()
    view.mul_(2)  # writing the view writes the tensor, imaginary parts included
    assert torch.equal(t, before * 2)


def test_a_non_contiguous_complex_tensor_keeps_its_layout() -> None:
    z = torch.randn(4, 6, dtype=torch.complex64).T  # a transposed parameter
    view = real_view(z)
    assert view.shape == (6, 4, 2)
    assert torch.equal(view[..., 1], z.imag) and torch.equal(view[..., 0], z.real)
    assert torch.equal(from_real(view.reshape(-1).view(6, 4, 2), z), z)  # reshape copies: still the same values
