"""Helpers of compressors/base.py: contiguous_span, storage_window and ReduceContext.output."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.compressors.base import ReduceContext, contiguous_span, storage_window
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


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1]])
def test_storage_window_covers_slices_with_gaps_in_any_order(order: list[int]) -> None:
    buf = torch.arange(20.0)
    slices = [buf[2:5], buf[7:8], buf[11:17]]
    pieces = [slices[i] for i in order]
    found = storage_window(pieces)
    assert found is not None
    window, offsets = found
    assert window.data_ptr() == buf[2:].data_ptr() and window.numel() == 15  # first to last element
    for piece, offset in zip(pieces, offsets):
        assert torch.equal(window[offset : offset + piece.numel()], piece)
    window.index_fill_(0, torch.tensor([offsets[0], offsets[-1]]), -1.0)  # a view: writes reach the slices
    assert pieces[0][0] == -1.0 and pieces[-1][0] == -1.0


def test_storage_window_refuses_other_storages_dtypes_strides_and_overlaps() -> None:
    buf = torch.arange(12.0)
    assert storage_window([buf[0:2], torch.arange(2.0)]) is None  # another storage
    assert storage_window([buf[0:2], buf.view(torch.int32)[4:6]]) is None  # another dtype
    assert storage_window([buf[0:4:2], buf[6:8]]) is None  # strided
    assert storage_window([buf[0:4], buf[3:6]]) is None  # overlapping
    assert storage_window([buf.view(3, 4)]) is None  # not 1-D
    assert storage_window([]) is None
    single = torch.arange(3.0)
    found = storage_window([single])
    assert found is not None and found[1] == [0] and torch.equal(found[0], single)


# ---------------------------------------------------------------------------------------------- Capabilities
def test_each_compressor_declares_its_capabilities_and_the_old_names_read_them() -> None:
    from lightning_gradcomp.compressors import CLTK, DIANA, QSGD, Cast, NoCompression, PowerSGD, RandomK, SignSGD, TopK
    from lightning_gradcomp.compressors.base import CAPABILITY_NAMES, Capabilities

    assert NoCompression.capabilities == Capabilities(dense=True)
    assert Cast.capabilities == Capabilities(borrows_inputs=True, propagates_nonfinite=True,
                                             compresses_small_layers=True)
    for cls in (QSGD, SignSGD, DIANA):
        assert cls.capabilities == Capabilities(borrows_inputs=True, bucket_cap_mb=4.0)
    for cls in (TopK, RandomK, CLTK):
        assert cls.capabilities == Capabilities(sparse_outputs=True)
    assert PowerSGD.capabilities == Capabilities()
    for comp in (NoCompression(), Cast(), QSGD(), TopK(), PowerSGD()):
        for name in CAPABILITY_NAMES:  # what the engine reads today
            assert getattr(comp, name) == getattr(type(comp).capabilities, name)


def test_capabilities_are_checked_and_frozen() -> None:
    import dataclasses

    from lightning_gradcomp.compressors.base import Capabilities

    with pytest.raises(TypeError, match="`borrows_inputs` must be a bool"):
        Capabilities(borrows_inputs=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`bucket_cap_mb`"):
        Capabilities(bucket_cap_mb=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Capabilities().dense = True  # type: ignore[misc]


def test_an_old_style_flag_still_works_with_a_deprecation_warning_at_class_creation() -> None:
    from lightning_gradcomp.compressors import Capabilities, TopK

    with pytest.warns(DeprecationWarning, match=r"sets bucket_cap_mb, hierarchical as class attributes.*"
                                                r"dataclasses.replace\(TopK.capabilities, bucket_cap_mb=2, "
                                                r"hierarchical=False\)") as caught:
        class OldStyle(TopK):
            hierarchical = False
            bucket_cap_mb = 2

    assert caught[0].filename == __file__  # points at the class statement
    assert OldStyle.capabilities == Capabilities(sparse_outputs=True, hierarchical=False, bucket_cap_mb=2)
    comp = OldStyle()
    assert comp.hierarchical is False and comp.bucket_cap_mb == 2 and comp.sparse_outputs is True
    assert TopK().hierarchical is True  # the base class is untouched


def test_a_new_style_subclass_does_not_warn() -> None:
    import warnings

    from lightning_gradcomp.compressors import Capabilities, Compressor

    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class NewStyle(Compressor):
            capabilities = Capabilities(borrows_inputs=True)

            def reduce(self, tensors, ctx):  # type: ignore[no-untyped-def]
                raise NotImplementedError

    assert NewStyle().borrows_inputs is True and NewStyle().dense is False
