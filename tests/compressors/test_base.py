"""Helpers of compressors/base.py: contiguous_span and ReduceContext.output."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.compressors.base import ReduceContext, contiguous_span
from lightning_gradcomp.functional.quantize import dequantize
from lightning_gradcomp.plan import LayerSlot


@pytest.mark.parametrize("sizes", [[1], [3, 0, 5], [7, 1, 2, 9]])
def test_contiguous_span_covers_back_to_back_slices_and_writes_through(sizes: list[int]) -> None:
    buf = torch.arange(float(sum(sizes) + 4))
    pieces, start = [], 2
    for n in sizes:
        pieces.append(buf[start : start + n])
        start += n
    span = contiguous_span(pieces)
    assert span is not None and torch.equal(span, torch.cat(pieces))
    span.mul_(-1)  # a view: writes reach every slice
    assert all(bool((p <= 0).all()) for p in pieces)


def test_contiguous_span_refuses_gaps_strides_dtypes_and_other_storages() -> None:
    buf = torch.arange(12.0)
    assert contiguous_span([buf[0:2], buf[3:5]]) is None  # a gap
    assert contiguous_span([buf[0:4:2], buf[4:6]]) is None  # strided
    assert contiguous_span([buf[0:2], torch.arange(2.0)]) is None  # another storage
    assert contiguous_span([buf[0:2], buf.double()[2:4]]) is None  # another dtype
    assert contiguous_span([]) is None


def _ctx(outputs: object) -> ReduceContext:
    slot = LayerSlot("w", 0, (4,), compressed=True)
    return ReduceContext(None, 0, 0, [slot], [None], outputs=outputs)  # type: ignore[arg-type]  # no collectives


def test_output_zeroes_the_given_slice_or_makes_a_fresh_one() -> None:
    like = torch.ones(4)
    fresh = _ctx(None).output(0, like)
    assert torch.equal(fresh, torch.zeros(4)) and fresh.data_ptr() != like.data_ptr()
    dead = torch.full((4,), 7.0)
    given = _ctx([dead]).output(0, like)
    assert given is dead and torch.equal(dead, torch.zeros(4))


def test_dequantize_into_out_matches_a_fresh_result_for_every_layout() -> None:
    codes = torch.randint(0, 3, (2, 10), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    scales = torch.rand(2, 3, generator=torch.Generator().manual_seed(1))
    expected = dequantize(codes, scales, 1, 4)
    for out in (torch.empty(2, 10), torch.empty(10, 2).t()):  # contiguous, and a transposed (strided) buffer
        assert dequantize(codes, scales, 1, 4, out=out) is out and torch.equal(out, expected)
    with pytest.raises(ValueError, match="`out`"):
        dequantize(codes, scales, 1, 4, out=torch.empty(3, 10))
