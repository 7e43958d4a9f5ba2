"""Cubic-lattice relative quantization: exact decode within the bound, wrap detection, the pair test."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.functional.lattice import (
    lattice_checksum,
    lattice_codes,
    lattice_decode,
    lattice_error_bound,
    lattice_index,
    lattice_levels,
    lattice_sides,
    lattice_value,
    pair_decodable,
)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_decode_is_exact_and_within_half_side_inside_the_bound(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    q = lattice_levels(bits)
    side = torch.tensor(0.01)
    x = torch.randn(5000, generator=gen) * 3
    # receiver reference anywhere with |x - y| + s/2 < q s / 2 (stay 1 % inside the bound)
    reach = (q / 2 - 0.5) * 0.99 * float(side)
    y = x + (torch.rand(5000, generator=gen) * 2 - 1) * reach
    index = lattice_index(x, side)
    codes = lattice_codes(index, bits)
    assert int(codes.min()) >= 0 and int(codes.max()) < q
    decoded = lattice_decode(codes, y, side, bits)
    assert torch.equal(decoded, index)
    error = (lattice_value(decoded, side) - x.double()).abs()
    assert float(error.max()) <= float(lattice_error_bound(side))
    assert lattice_checksum(decoded) == lattice_checksum(index)


def test_wrap_around_is_detected_by_the_checksum() -> None:
    gen = torch.Generator().manual_seed(0)
    side, bits = torch.tensor(0.001), 8
    x = torch.randn(4096, generator=gen)
    y = x.clone()
    y[17] += 0.2  # 200 sides away: beyond q / 2 = 128
    index = lattice_index(x, side)
    decoded = lattice_decode(lattice_codes(index, bits), y, side, bits)
    assert not torch.equal(decoded, index)
    assert int((decoded - index)[17]) % 256 == 0  # off by a multiple of q ...
    assert abs(float(lattice_value(decoded, side)[17]) - float(y[17])) <= 0.128 + 1e-6  # ... and lands near y
    assert lattice_checksum(decoded) != lattice_checksum(index)
    blocks = lattice_checksum(decoded.view(4, 1024)) != lattice_checksum(index.view(4, 1024))
    assert blocks.tolist() == [True, False, False, False]  # per-block checksums locate the wrapped block


def test_checksum_catches_cancelling_wraps() -> None:
    gen = torch.Generator().manual_seed(1)
    index = torch.randint(-(2**20), 2**20, (3000,), generator=gen)
    reference = lattice_checksum(index)
    for trial in range(200):
        wrong = index.clone()
        pos = torch.randperm(3000, generator=gen)[:3]
        wrong[pos[0]] += 256
        wrong[pos[1]] -= 256
        wrong[pos[2]] += 256 * (trial % 3 - 1)
        assert lattice_checksum(wrong) != reference


def test_sides_follow_the_spread_and_are_floored() -> None:
    spread = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    absmax = torch.tensor([1.0, 8.0, 0.0], dtype=torch.float64)
    side = lattice_sides(spread, absmax, bits=8, margin=2.0)
    assert side.dtype == torch.float32
    assert float(side[0]) == pytest.approx(2.0 / 128)
    assert float(side[1]) == pytest.approx(8.0 * 2.0**-16)
    assert float(side[2]) > 0


@pytest.mark.parametrize("bad", [0, 17, 2.0, True])
def test_bits_are_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="bits"):
        lattice_levels(bad)  # type: ignore[arg-type]


def test_pair_test_is_symmetric_and_sufficient() -> None:
    """Whenever the pair test passes, both ends decoded each other exactly (random near-boundary trials)."""
    gen = torch.Generator().manual_seed(2)
    bits, q = 4, 16
    accepted = rejected = 0
    for _ in range(100):
        side_a = torch.rand((4, 1), generator=gen, dtype=torch.float64).float() * 0.01 + 0.001
        side_b = torch.rand((4, 1), generator=gen, dtype=torch.float64).float() * 0.01 + 0.001
        x_a = torch.randn(4, 64, generator=gen)
        scale = float(torch.rand((), generator=gen)) * q / 2 * float(torch.minimum(side_a, side_b).min())
        x_b = x_a + (torch.rand(4, 64, generator=gen) * 2 - 1) * scale
        k_a, k_b = lattice_index(x_a, side_a), lattice_index(x_b, side_b)
        v_a, v_b = lattice_value(k_a, side_a), lattice_value(k_b, side_b)
        verdict = pair_decodable(v_a, v_b, side_a, side_b, bits)
        assert verdict.shape == (4,) and torch.equal(verdict, pair_decodable(v_b, v_a, side_b, side_a, bits))
        decoded_a = lattice_decode(lattice_codes(k_a, bits), x_b, side_a, bits)  # b decodes a's codes
        decoded_b = lattice_decode(lattice_codes(k_b, bits), x_a, side_b, bits)
        for block in range(4):
            if verdict[block]:
                accepted += 1
                assert torch.equal(decoded_a[block], k_a[block]) and torch.equal(decoded_b[block], k_b[block])
            else:
                rejected += 1
    assert accepted > 30 and rejected > 30  # the trials straddle the boundary


def test_dithered_rounding_decodes_exactly_and_is_unbiased() -> None:
    from lightning_gradcomp.functional.lattice import lattice_dither

    side = torch.tensor(0.1)
    x = torch.full((20000,), 0.03)  # nearest rounding always gives 0.0: bias -0.03
    y = x + 0.2  # receiver's reference, well inside the decodable range for 8 bits
    dither = lattice_dither((20000,), torch.Generator().manual_seed(0))
    index = lattice_index(x, side, dither)
    decoded = lattice_decode(lattice_codes(index, 8), y, side, 8, dither)
    assert torch.equal(decoded, index)
    value = lattice_value(decoded, side, dither)
    assert float((value - x).abs().max()) <= float(lattice_error_bound(side))
    assert abs(float((value - x).mean())) < 0.002  # unbiased (the error is uniform on [-s/2, s/2))
    assert float(lattice_value(lattice_index(x, side), side).mean()) == 0.0  # deterministic rounding: biased
    assert torch.equal(lattice_index(x, side, None), lattice_index(x, side))  # default unchanged
