"""The compiled quantization kernels: bit-identical to the torch steps they replace, and fallbacks."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import CommStats
from lightning_gradcomp.compressors import QSGD, Cast, PowerSGD
from lightning_gradcomp.functional import _native, quantize
from lightning_gradcomp.functional.packing import pack_bits, packed_nbytes, unpack_bits
from lightning_gradcomp.functional.quantize import Quantized, dequantize, stochastic_quantize

kernel = _native.load()  # compiled at most once per machine (then cached in torch's extensions directory)
needs_kernel = pytest.mark.skipif(kernel is None, reason="the compiled kernel could not be built here")
LEVELS = sorted({0, kernel.level if kernel is not None else 0})
"""Instruction-set levels to run: portable C++ and the CPU's best (AVX2 code at levels 2 and 3)."""

SIZES = [1, 2, 511, 512, 513, 4097, 100_003]
GROUPS = [1, 7, 128, 512]
QUANT_LEVELS = [1, 3, 7, 127]


@contextmanager
def _torch_path() -> Iterator[None]:
    """Run the torch steps (the reference) instead of the kernel."""
    load = _native.load
    _native.load = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        _native.load = load  # type: ignore[assignment]


def _inputs(kind: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    if kind == "special":  # zero groups, negative zeros, subnormal groups and values, huge values
        x[n // 5 : n // 3] = 0.0
        x[n // 3 : n // 2] = torch.randn(n // 2 - n // 3, generator=gen) * 1e-41  # subnormal scales
        x[::11] = -0.0
        x[3::29] *= 1e-39
        x[5::37] *= 3e37
        x[-1:] = 1e-45
    elif kind == "nonfinite":
        x[::97] = float("nan")
        x[11::89] = float("inf")
        x[13::83] = -float("inf")
        x[17::79] = -float("nan")
        x[19::7] = -0.0
    elif kind == "overflow":  # p = 2 norms overflow to inf
        x *= 3e38
    return x


def _assert_same(a: Quantized, b: Quantized) -> None:
    assert a.codes.dtype == b.codes.dtype == torch.uint8 and a.scales.dtype == b.scales.dtype == torch.float32
    assert a.codes.shape == b.codes.shape and a.scales.shape == b.scales.shape
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales.view(torch.int32), b.scales.view(torch.int32))  # bits: -0.0, NaN and inf too


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


# ------------------------------------------------------------------------------------------------ sign codes
@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", ["normal", "special", "nonfinite"])
@pytest.mark.parametrize("n", [0, *SIZES, 7, 8, 9, 15, 16, 17])
def test_sign_codes_are_torchs(n: int, kind: str, level: int) -> None:
    """Scaled sign's codes: ``x >= 0`` as torch.ge gives it (NaN: 0, -0.0: 1), at every tail length."""
    x = _inputs(kind, n, n)
    codes = quantize.sign_codes(x, level=level)
    assert codes.dtype == torch.uint8 and torch.equal(codes, torch.ge(x, 0).to(torch.uint8))
    with _torch_path():
        assert torch.equal(quantize.sign_codes(x), codes)


@needs_kernel
@pytest.mark.parametrize("kind", ["normal", "special", "nonfinite"])
@pytest.mark.parametrize("group_size", [1, 5, 8, 9, 512, 1500])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 17, 511, 513, 4097, 100_003])
def test_sign_quantize_in_one_pass(n: int, group_size: int, kind: str) -> None:
    """Codes as torch.ge gives them; each bucket's mean ``|x|`` within fp32 rounding of torch's (its own summation
    order: the same bits at every level); NaN/Inf buckets alike; a short last bucket divided by its own length."""
    x = _inputs(kind, n, n + group_size)
    with _torch_path():
        reference = quantize.sign_quantize(x, group_size)
    got = [quantize.sign_quantize(x, group_size, level=level) for level in LEVELS]
    for q in got:
        assert q.codes.dtype == torch.uint8 and torch.equal(q.codes, reference.codes)
        assert q.scales.dtype == torch.float32 and q.scales.shape == reference.scales.shape
        assert (q.levels, q.group_size) == (0, group_size)
        assert _bits_equal(q.scales, got[0].scales)
    exact = x.double().abs()
    groups = -(-n // group_size)  # each bucket's sum and mean in fp64, the short last bucket by its own length
    sums = torch.nn.functional.pad(exact, (0, groups * group_size - n)).reshape(groups, group_size).sum(dim=1)
    lengths = torch.full((groups,), float(group_size), dtype=torch.float64)
    lengths[-1] = n - (groups - 1) * group_size
    means = sums / lengths
    finite = torch.isfinite(sums) & (sums < 1e38)  # sums of huge values overflow fp32 in any order
    assert torch.equal(torch.isinf(got[0].scales[finite]), torch.zeros(int(finite.sum()), dtype=torch.bool))
    torch.testing.assert_close(got[0].scales.double()[finite], means[finite], rtol=4 * min(group_size, n) * 2.0**-24,
                               atol=1e-44)
    assert torch.equal(torch.isnan(got[0].scales), torch.isnan(reference.scales))


@needs_kernel
@pytest.mark.parametrize("kind", ["normal", "special", "nonfinite"])
@pytest.mark.parametrize("group_size", [1, 9, 512, 1500])
@pytest.mark.parametrize("n", [1, 9, 513, 100_003])
def test_sign_quantize_writes_the_residual_of_decode_add(n: int, group_size: int, kind: str) -> None:
    """``residual=``: the message unchanged, and ``x - decode()`` with the bits of ``q.decode_add(x, -1.0, out)``
    (negative zeros and NaN/Inf results included) at every level, into another tensor or over ``x`` itself; the
    torch steps (no kernel) write the same bits."""
    x = _inputs(kind, n, 7 * n + group_size)
    for level in LEVELS:
        q = quantize.sign_quantize(x, group_size, level=level)
        expected = torch.empty_like(x)
        q.decode_add(x, -1.0, expected)
        apart = torch.empty_like(x)
        fused = quantize.sign_quantize(x, group_size, level=level, residual=apart)
        assert torch.equal(fused.codes, q.codes) and _bits_equal(fused.scales, q.scales)
        assert _bits_equal(apart, expected), level
        inplace = x.clone()
        quantize.sign_quantize(inplace, group_size, level=level, residual=inplace)
        assert _bits_equal(inplace, expected), level
    with _torch_path():
        reference = quantize.sign_quantize(x, group_size)
        expected = torch.empty_like(x)
        reference.decode_add(x, -1.0, expected)
        apart = torch.empty_like(x)
        quantize.sign_quantize(x, group_size, residual=apart)
    assert _bits_equal(apart, expected)


def test_sign_quantize_rejects_a_residual_of_another_size_or_dtype() -> None:
    x = torch.randn(10)
    with pytest.raises(ValueError, match="residual"):
        quantize.sign_quantize(x, 4, residual=torch.empty(9))
    with pytest.raises(ValueError, match="residual"):
        quantize.sign_quantize(x, 4, residual=torch.empty(10, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------ rounding
@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("p", [math.inf, 2.0])
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("n", SIZES)
def test_stochastic_round_is_bit_identical(n: int, group_size: int, p: float, level: int) -> None:
    for levels in QUANT_LEVELS:
        for kind in ("gauss", "special", "nonfinite", "overflow"):
            x = _inputs(kind, n, n + group_size + levels)
            seed = 1000 * levels + n
            with _torch_path():
                ref = stochastic_quantize(x, levels, group_size, p, torch.Generator().manual_seed(seed))
            gen = torch.Generator().manual_seed(seed)
            got = quantize._stochastic_native(kernel, x, levels, group_size, p, gen, level=level)
            _assert_same(got, ref)
            assert got.levels == ref.levels and got.group_size == ref.group_size
            with _torch_path():  # the codes decode to the same values (the kernel's decoding is tested below)
                assert _bits_equal(got.decode(), ref.decode())


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("p", [math.inf, 2.0])
@pytest.mark.parametrize("group_size", [1, 7, 128, 1500])
@pytest.mark.parametrize("n", SIZES)
def test_quantizing_a_difference_is_quantizing_its_value(n: int, group_size: int, p: float, level: int) -> None:
    """``minus`` (DIANA's ``g - h``): the kernel subtracts group by group and gives the codes and scales of the
    materialized difference, as do the torch steps; ``x`` and ``minus`` are left as they were."""
    for levels in (1, 7):
        for kind in ("gauss", "special", "nonfinite"):
            x, shift = _inputs(kind, n, n + levels), _inputs("gauss", n, group_size) * 0.5
            before = (x.clone(), shift.clone())
            seed = 7 * levels + n
            reference = stochastic_quantize(x - shift, levels, group_size, p, torch.Generator().manual_seed(seed))
            gen = torch.Generator().manual_seed(seed)
            if p == math.inf:
                _assert_same(
                    quantize._stochastic_native(kernel, x, levels, group_size, p, gen, level, shift), reference
                )
            _assert_same(
                stochastic_quantize(x, levels, group_size, p, torch.Generator().manual_seed(seed), shift), reference
            )
            with _torch_path():
                _assert_same(
                    stochastic_quantize(x, levels, group_size, p, torch.Generator().manual_seed(seed), shift), reference
                )
            assert _bits_equal(x, before[0]) and _bits_equal(shift, before[1])


def test_quantizing_a_difference_checks_its_size() -> None:
    with pytest.raises(ValueError, match="`minus` must have as many elements"):
        stochastic_quantize(torch.ones(4), 1, 2, "inf", torch.Generator(), torch.ones(3))


@needs_kernel
@pytest.mark.parametrize("p", [1, 2, "inf"])
def test_public_quantizer_uses_the_kernel_and_the_same_stream(p: object, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = kernel.stochastic_round

    class Spy:
        level = kernel.level

        def stochastic_round(self, *args: object) -> None:
            calls.append(args)
            real(*args)

    x = _inputs("special", 10_007, 3)
    with _torch_path():
        ref_gen = torch.Generator().manual_seed(5)
        ref = stochastic_quantize(x, 7, 128, p, ref_gen)
    gen = torch.Generator().manual_seed(5)
    monkeypatch.setattr(_native, "load", lambda: Spy())
    _assert_same(stochastic_quantize(x, 7, 128, p, gen), ref)
    assert len(calls) == 1
    assert torch.equal(gen.get_state(), ref_gen.get_state())  # the same draws: later draws are unchanged


@needs_kernel
def test_stochastic_round_handles_views_and_empty_tensors() -> None:
    base = _inputs("gauss", 2 * 4097, 1)
    for x in (base[::2], base.reshape(2, 4097).t(), base[:0]):
        with _torch_path():
            ref = stochastic_quantize(x, 3, 128, "inf", torch.Generator().manual_seed(2))
        _assert_same(stochastic_quantize(x, 3, 128, "inf", torch.Generator().manual_seed(2)), ref)


@needs_kernel
def test_other_inputs_keep_the_torch_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    def load() -> None:
        raise AssertionError("the kernel only serves fp32 CPU tensors")

    monkeypatch.setattr(_native, "load", load)
    gen = torch.Generator().manual_seed(0)
    q = stochastic_quantize(torch.randn(1000, dtype=torch.float64), 3, 64, "inf", gen)
    assert q.codes.dtype == torch.uint8
    dequantize(q.codes, q.scales.double(), 3, 64)  # fp64 scales: the torch steps
    dequantize(q.codes, q.scales, 3, 64, dtype=torch.float64)  # fp64 values: the torch steps


# ------------------------------------------------------------------------------------------------ decoding
@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("n", SIZES)
def test_dequantize_is_bit_identical(n: int, group_size: int, level: int) -> None:
    gen = torch.Generator().manual_seed(n + group_size)
    groups = quantize.num_groups(n, group_size)
    for levels in (0, *QUANT_LEVELS):  # 0: scaled sign (1-bit codes)
        codes = torch.randint(0, 2 * levels + 1 if levels else 2, (3, n), generator=gen, dtype=torch.uint8)
        scales = torch.randn(3, groups, generator=gen).abs()
        scales.view(-1)[::5] = 0.0
        scales.view(-1)[1::7] = 1e-41
        scales.view(-1)[2::11] = float("inf")
        scales.view(-1)[3::13] = float("nan")
        scales.view(-1)[4::17] = 3e38
        wide = torch.zeros(3, n + 5, dtype=torch.uint8)  # rows with a stride, as a received payload's
        wide[:, 2 : 2 + n] = codes
        for c, s in ((codes[0], scales[0]), (codes, scales), (wide[:, 2 : 2 + n], scales)):
            with _torch_path():
                ref = dequantize(c, s, levels, group_size)
            got = quantize._dequantize_native(kernel, Quantized(c, s, levels, group_size), level=level)
            assert got.dtype == torch.float32 and _bits_equal(got, ref)
            assert _bits_equal(dequantize(c, s, levels, group_size), ref)


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("group_size", [1, 7, 128, 512, 1500])  # 1500: a group spans the kernel's 512-entry chunks
@pytest.mark.parametrize("n", SIZES)
def test_dequantize_add_is_bit_identical_to_decode_then_torch_add(n: int, group_size: int, level: int) -> None:
    """DIANA's shift updates: ``base + alpha * d`` from the codes, each entry torch.add's fused multiply-add."""
    gen = torch.Generator().manual_seed(n + 3 * group_size)
    groups = quantize.num_groups(n, group_size)
    for levels in (0, *QUANT_LEVELS):
        codes = torch.randint(0, 2 * levels + 1 if levels else 2, (n,), generator=gen, dtype=torch.uint8)
        scales = torch.randn(groups, generator=gen).abs()
        scales[::5] = 0.0
        scales[1::7] = 1e-41
        scales[2::11] = float("inf")
        scales[4::17] = 3e38
        base = _inputs("special" if levels % 2 else "nonfinite", n, levels)
        decoded = dequantize(codes, scales, levels, group_size)
        for alpha, alpha2 in ((0.37, 1.0), (1.0, 1 / 129), (2.0**-7, None)):
            want = torch.add(base, decoded, alpha=alpha)
            want2 = None if alpha2 is None else torch.add(base, decoded, alpha=alpha2)
            out, out2 = torch.full((n,), 7.0), None if alpha2 is None else torch.full((n,), 7.0)
            quantize.dequantize_add(codes, scales, levels, group_size, base, alpha, out, alpha2, out2, level=level)
            assert _bits_equal(out, want) and (out2 is None or _bits_equal(out2, want2))
            with _torch_path():
                ref = torch.empty(n)
                quantize.dequantize_add(codes, scales, levels, group_size, base, alpha, ref)
            assert _bits_equal(ref, want)
        in_place = base.clone()  # ``out`` may be ``base``
        quantize.dequantize_add(codes, scales, levels, group_size, in_place, 0.5, in_place, level=level)
        assert _bits_equal(in_place, torch.add(base, decoded, alpha=0.5))


def _packed_piece(codes: Tensor, scales: Tensor, levels: int, group_size: int, first: int, pad: int) -> Quantized:
    """``codes`` (rows, n) bit-packed behind ``first`` other codes, in rows of ``pad`` extra bytes (a payload's)."""
    bits = quantize.code_bits(levels)
    lead = torch.randint(0, 1 << bits, (*codes.shape[:-1], first), dtype=torch.uint8)
    packed = pack_bits(torch.cat([lead, codes], dim=-1), bits)
    rows = torch.full((*packed.shape[:-1], packed.shape[-1] + pad), 0xA5, dtype=torch.uint8)
    rows[..., : packed.shape[-1]] = packed
    return Quantized(rows, scales, levels, group_size, numel=codes.shape[-1], first=first)


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("group_size", [1, 7, 128, 512, 1500])
@pytest.mark.parametrize("n", SIZES)
def test_packed_codes_decode_as_unpacked(n: int, group_size: int, level: int) -> None:
    """Codes still bit-packed in a payload (any first code, 1, 2 and 4 bits, rows with a stride) decode, and add, to
    the bits of their unpacked bytes."""
    gen = torch.Generator().manual_seed(7 * n + group_size)
    groups = quantize.num_groups(n, group_size)
    for levels in (0, 1, 7):  # 1, 2 and 4 bits
        for first in (0, 1, 3, 13):
            codes = torch.randint(0, 2 * levels + 1 if levels else 2, (3, n), generator=gen, dtype=torch.uint8)
            scales = torch.randn(3, groups, generator=gen).abs()
            scales.view(-1)[::5] = float("inf")
            piece = _packed_piece(codes, scales, levels, group_size, first, pad=3)
            assert piece.size == n and torch.equal(piece.unpacked().codes, codes)
            row = piece._replace(codes=piece.codes[1], scales=scales[1])
            for q, c, s in ((piece, codes, scales), (row, codes[1], scales[1])):
                want = dequantize(c, s, levels, group_size)
                got = quantize._dequantize_native(kernel, q, level=level)
                assert _bits_equal(got, want) and _bits_equal(q.decode(), want)
                with _torch_path():
                    assert _bits_equal(q.decode(), want)
            base = torch.randn(n, generator=gen)
            row = piece._replace(codes=piece.codes[2], scales=scales[2])
            decoded = dequantize(codes[2], scales[2], levels, group_size)
            out, out2 = torch.empty(n), torch.empty(n)
            quantize._decode_add(row, base, 0.37, out, 1.0, out2, level=level)
            assert _bits_equal(out, torch.add(base, decoded, alpha=0.37)) and _bits_equal(out2, base + decoded)
            with _torch_path():
                ref = torch.empty(n)
                row.decode_add(base, 0.37, ref)
            assert _bits_equal(ref, out)


@needs_kernel
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 31, 32, 33, 95, 1000, 4099])
def test_pack_into_writes_pack_bits_bytes_at_any_first_code(bits: int, n: int) -> None:
    """Spans packed one after another at any code offset give the bytes of packing their concatenation."""
    gen = torch.Generator().manual_seed(n * bits)
    for first in (0, 1, 3, 7, 9):
        lead = torch.randint(0, 1 << bits, (first,), generator=gen, dtype=torch.uint8)
        codes = torch.randint(0, 1 << bits, (n,), generator=gen, dtype=torch.uint8)
        tail = torch.randint(0, 1 << bits, (5,), generator=gen, dtype=torch.uint8)
        want = pack_bits(torch.cat([lead, codes, tail]), bits)
        row = torch.zeros(want.numel() + 2, dtype=torch.uint8)
        for start, span in ((0, lead), (first, codes), (first + n, tail)):
            kernel.pack_into(span.data_ptr(), span.numel(), bits, row.data_ptr(), start)
        assert torch.equal(row[: want.numel()], want) and not row[want.numel() :].any()


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [1, 511, 513, 4097, 100_003])
def test_rows_mean_is_the_rank_ordered_torch_sum_then_division(n: int, rows: int, level: int) -> None:
    """The owner's mean of W messages: ``((d_0 + d_1) + ...) / W`` to the bit, codes packed or not."""
    gen = torch.Generator().manual_seed(n + rows)
    for levels, group_size in ((0, 512), (1, 128), (7, 1500), (127, 64)):
        codes = torch.randint(0, 2 * levels + 1 if levels else 2, (rows, n), generator=gen, dtype=torch.uint8)
        scales = torch.rand(rows, quantize.num_groups(n, group_size), generator=gen) * 3
        scales.view(-1)[::7] = float("inf")
        want = dequantize(codes[0], scales[0], levels, group_size)
        for r in range(1, rows):
            want = want + dequantize(codes[r], scales[r], levels, group_size)
        want = want / rows
        pieces = [Quantized(codes, scales, levels, group_size)]
        if levels < 127:
            pieces.append(_packed_piece(codes, scales, levels, group_size, first=5, pad=2))
        for q in pieces:
            assert _bits_equal(quantize.rows_mean(q, level=level), want)
            into = torch.full((2 * n,), 7.0)  # straight into a slice, and into a strided view (through a copy)
            assert quantize.rows_mean(q, out=into[:n], level=level).data_ptr() == into.data_ptr()
            assert _bits_equal(into[:n], want) and bool((into[n:] == 7.0).all())
            assert _bits_equal(quantize.rows_mean(q, out=into[::2]), want)
            with _torch_path():
                assert _bits_equal(quantize.rows_mean(q), want)
                assert _bits_equal(quantize.rows_mean(q, out=torch.empty(n)), want)


def test_dequantize_add_checks_its_outputs() -> None:
    codes, scales = torch.zeros(4, dtype=torch.uint8), torch.ones(1)
    with pytest.raises(ValueError, match="`base` and the outputs must be fp32 of shape"):
        quantize.dequantize_add(codes, scales, 1, 4, torch.zeros(4), 1.0, torch.empty(3))
    with pytest.raises(ValueError, match="`base` and the outputs must be fp32 of shape"):
        quantize.dequantize_add(codes, scales, 1, 4, torch.zeros(4, dtype=torch.float64), 1.0, torch.empty(4))


# ------------------------------------------------------------------------------------------------ packing
@needs_kernel
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 511, 4097, 100_003])
def test_pack_and_unpack_match_the_torch_steps(bits: int, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 1 << bits, (3, n), generator=gen, dtype=torch.uint8)
    wild = torch.randint(0, 256, (3, n), generator=gen, dtype=torch.uint8)  # trusted callers skip the check
    for c, check in ((codes[1], True), (codes, True), (codes[:, 1:], True), (wild, False)):
        with _torch_path():
            ref = pack_bits(c, bits, check=check)
        got = pack_bits(c, bits, check=check)
        assert torch.equal(got, ref) and got.shape[-1] == packed_nbytes(c.shape[-1], bits)
        payload = torch.cat([got, got], dim=-1)  # rows with a stride
        for packed in (got, payload, payload[..., 1:]):
            with _torch_path():
                ref_codes = unpack_bits(packed, bits, c.shape[-1])
            assert torch.equal(unpack_bits(packed, bits, c.shape[-1]), ref_codes)


def test_pack_bits_checks_codes_unless_trusted() -> None:
    codes = torch.tensor([1, 2, 16], dtype=torch.uint8)
    with pytest.raises(ValueError, match="codes must lie"):
        pack_bits(codes, 4)
    assert pack_bits(codes, 4, check=False).shape == (2,)


# ------------------------------------------------------------------------------------------------ fallbacks
def test_quantizing_compressors_prepare_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    loads = []
    monkeypatch.setattr(_native, "load", lambda: loads.append(1))
    QSGD(bits=4).prepare()
    assert loads == [1]


def test_the_casts_and_the_strategy_prepare_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The casts' 16-bit passes and the engine's NaN/Inf scan use the kernel: it is built in setup, not in the first
    compressed bucket."""
    loads = []
    monkeypatch.setattr(_native, "load", lambda: loads.append(1))
    Cast(torch.float16).prepare()
    assert loads == [1]
    strategy = GradCompStrategy(compressor=PowerSGD(rank=2))  # no kernel of its own
    strategy.make_hook(_FakeComm(), {})
    assert loads == [1, 1]


class _FakeComm:
    """What ``make_hook`` reads of a ``Comm`` without a process group."""

    def __init__(self) -> None:
        self.stats = CommStats()
        self.world_size, self.rank = 1, 0


def test_without_the_kernel_the_torch_steps_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "load", lambda: None)
    x = _inputs("special", 4097, 0)
    q = stochastic_quantize(x, 7, 128, "inf", torch.Generator().manual_seed(0))
    packed = pack_bits(q.codes, 4)
    assert torch.equal(unpack_bits(packed, 4, x.numel()), q.codes)
    assert torch.isfinite(q.decode()).all()
