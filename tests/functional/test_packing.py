"""Bit packing: exact round trips, the documented bit layout, sizes, batching and input validation."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_gradcomp.functional.packing import pack_bits, packed_nbytes, unpack_bits


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 63, 1000, 4099])
def test_round_trip_is_exact(bits: int, numel: int) -> None:
    gen = torch.Generator().manual_seed(bits * 10_000 + numel)
    codes = torch.randint(0, 2**bits, (numel,), generator=gen, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(numel, bits) == -(-numel * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, numel), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_batch_dimensions_pack_each_row_independently(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 2, 37), generator=gen, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, 2, packed_nbytes(37, bits))
    assert torch.equal(packed[1, 0], pack_bits(codes[1, 0], bits))
    assert torch.equal(unpack_bits(packed, bits, 37), codes)


def test_bit_layout_is_little_endian_within_and_across_bytes() -> None:
    ones = torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1], dtype=torch.uint8)
    assert pack_bits(ones, 1).tolist() == [0b10001101, 0b00000001]
    assert pack_bits(torch.tensor([3, 0, 1, 2]), 2).tolist() == [3 | 1 << 4 | 2 << 6]
    assert pack_bits(torch.tensor([0xA, 0x5]), 4).tolist() == [0x5A]
    # 3-bit codes 5 = 101b and 3 = 011b form the stream 1,0,1,1,1,0 (LSB first).
    assert pack_bits(torch.tensor([5, 3]), 3).tolist() == [0b011101]


def test_unpack_ignores_trailing_padding_bytes() -> None:
    codes = torch.tensor([1, 2, 3], dtype=torch.uint8)
    padded = torch.cat([pack_bits(codes, 2), torch.full((5,), 255, dtype=torch.uint8)])
    assert torch.equal(unpack_bits(padded, 2, 3), codes)


def test_wider_integer_and_bool_inputs_are_accepted() -> None:
    wide = pack_bits(torch.tensor([1, 0, 1], dtype=torch.int64), 1)
    assert torch.equal(wide, pack_bits(torch.tensor([True, False, True]), 1))


@pytest.mark.parametrize("bits", [0, 9, 2.0, True])
def test_invalid_bits_raise(bits: object) -> None:
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), bits)  # type: ignore[arg-type]


def test_codes_that_do_not_fit_raise() -> None:
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        pack_bits(torch.tensor([0, 4], dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        pack_bits(torch.tensor([-1, 0]), 1)
    with pytest.raises(TypeError, match="integer"):
        pack_bits(torch.tensor([0.0, 1.0]), 1)


def test_short_or_mistyped_payload_raises() -> None:
    with pytest.raises(ValueError, match="need 3 bytes"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 3, 8)
    with pytest.raises(TypeError, match="uint8"):
        unpack_bits(torch.zeros(2, dtype=torch.int32), 1, 8)


def test_packing_is_vectorized() -> None:
    """Four million codes round-trip in well under the time of a per-element Python loop (minutes)."""
    codes = torch.randint(0, 2, (4_000_000,), dtype=torch.uint8)
    start = time.perf_counter()
    out = unpack_bits(pack_bits(codes, 1), 1, codes.numel())
    assert time.perf_counter() - start < 5.0
    assert torch.equal(out, codes)
