"""Sparsification helpers."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.functional import kept_count, scatter_dense, stratified_indices, topk_indices
from lightning_gradcomp.functional.sparsify import (packed_positions, repeated_offsets, stratified_layers,
                                                   systematic_stride)


@pytest.mark.parametrize(("numel", "ratio", "k"), [(1000, 0.01, 10), (10, 0.01, 1), (7, 1.0, 7), (3, 0.5, 2)])
def test_kept_count(numel: int, ratio: float, k: int) -> None:
    assert kept_count(numel, ratio) == k


def test_topk_indices_are_the_largest_magnitudes() -> None:
    x = torch.tensor([0.1, -5.0, 3.0, -0.2, 4.0])
    assert sorted(topk_indices(x, 3).tolist()) == [1, 2, 4]
    assert topk_indices(x, 9).tolist() == [0, 1, 2, 3, 4]


def _same_set_as_torch_topk(x: torch.Tensor, k: int) -> None:
    """``topk_indices`` keeps the ``k`` largest magnitudes (distinct values here, so the set is unique)."""
    expected = torch.topk(x.abs(), k, sorted=False).indices.sort().values
    assert torch.equal(topk_indices(x, k).sort().values, expected)


@pytest.mark.parametrize("factor", [0.0, 1.0, 1.5, 2.0, 3.0, 10.0])
def test_topk_indices_when_its_sample_misleads(factor: float) -> None:
    """Its threshold comes from every ``systematic_stride(n, 4096)``-th entry; scaling exactly those makes the first
    threshold, or both, fall short (or every entry a candidate): the set is the same."""
    n = 4096 * 40
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    x[:: systematic_stride(n, 4096)] *= factor
    for k in (1, n // 100, n // 10):
        _same_set_as_torch_topk(x, k)


@pytest.mark.parametrize("shape", [(512, 512), (256, 768), (300, 7)])
@pytest.mark.parametrize("descending", [False, True])
def test_topk_indices_on_matrices_whose_columns_differ_in_scale(shape: tuple, descending: bool) -> None:
    """The case a power-of-two sampling stride read wrong (a few columns of every row), both ways round."""
    scales = torch.logspace(2, -4, shape[1]) if descending else torch.logspace(-4, 2, shape[1])
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(6)) * scales).reshape(-1)
    for k in (1, x.numel() // 100, x.numel() // 10):
        _same_set_as_torch_topk(x, k)


def test_scatter_dense_adds_duplicates() -> None:
    out = scatter_dense(4, torch.tensor([1, 1, 3], dtype=torch.int32), torch.tensor([1.0, 2.0, 5.0]))
    assert out.tolist() == [0.0, 3.0, 0.0, 5.0]


@pytest.mark.parametrize(("numel", "k"), [(100, 10), (103, 10), (7, 7), (5, 1), (1000, 999)])
def test_stratified_indices_one_per_block(numel: int, k: int) -> None:
    idx, sizes = stratified_indices(numel, k, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert idx.numel() == k and int(sizes.sum()) == numel and int(sizes.min()) >= 1
    starts = torch.cumsum(sizes, 0) - sizes
    assert bool(((idx >= starts) & (idx < starts + sizes)).all())  # exactly one index inside each block
    assert torch.equal(idx, stratified_indices(numel, k, torch.Generator().manual_seed(0), torch.device("cpu"))[0])


def test_stratified_indices_are_uniform_within_blocks() -> None:
    """Each of the 4 elements of a block is picked about 1/4 of the time (chi-square, 3 dof, p ~ 1e-4)."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(8)
    draws = 4000
    for _ in range(draws):
        idx, _ = stratified_indices(8, 2, gen, torch.device("cpu"))
        counts.index_add_(0, idx, torch.ones(2))
    expected = draws / 4
    chi2 = float(((counts[:4] - expected) ** 2 / expected).sum())
    assert chi2 < 21.1


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_delta16_of_many_layers_equals_each_layer_coded_alone(seed: int, native: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes around and above 65535 (escape codes), sparse to full layers, indices spread or clustered at the end."""
    from lightning_gradcomp.functional import _native
    from lightning_gradcomp.functional.sparsify import (decode_delta16, decode_delta16_layers, delta16_capacity,
                                                        encode_delta16, encode_delta16_layers)
    if native:
        assert _native.load() is not None  # the machine builds the kernel
    else:
        monkeypatch.setattr(_native, "load", lambda: None)  # the torch steps
    gen = torch.Generator().manual_seed(seed)
    layers = int(torch.randint(1, 7, (1,), generator=gen))
    numels = [int(torch.randint(1, 70_000, (1,), generator=gen)) * int(torch.randint(1, 5, (1,), generator=gen))
              for _ in range(layers)]
    ks = [max(1, int(n * float(torch.rand(1, generator=gen)) ** 3)) for n in numels]
    if seed % 4 == 0:  # every kept entry at the end of its layer: the longest runs of escapes
        indices = [torch.arange(n - k, n) for n, k in zip(numels, ks)]
    else:
        indices = [torch.randperm(n, generator=gen)[:k].sort().values for n, k in zip(numels, ks)]
    caps = [delta16_capacity(n, k) for n, k in zip(numels, ks)]
    codes = encode_delta16_layers(indices, caps)
    assert codes.dtype == torch.uint16 and codes.numel() == sum(caps)
    assert torch.equal(codes, torch.cat([_delta16_one_layer(i, c) for i, c in zip(indices, caps)]))
    assert torch.equal(codes, torch.cat([encode_delta16(i, c) for i, c in zip(indices, caps)]))
    assert torch.equal(decode_delta16_layers(codes, caps), torch.cat(indices))
    for piece, i in zip(torch.split(codes, caps), indices):
        assert torch.equal(decode_delta16(piece), i)


def _delta16_one_layer(indices: torch.Tensor, capacity: int) -> torch.Tensor:
    """The single-layer coding as it was written before the layers were coded together (the oracle)."""
    gaps = torch.diff(indices, prepend=indices.new_full((1,), -1))
    escapes = (gaps - 1) // 65535
    codes = torch.zeros(capacity, dtype=torch.int32)
    codes[torch.cumsum(escapes + 1, 0) - 1] = (gaps - escapes * 65535).to(torch.int32)
    return codes.to(torch.uint16)


def test_delta16_kernel_refuses_indices_it_cannot_code() -> None:
    from lightning_gradcomp.functional.sparsify import encode_delta16_layers
    for indices, capacity in ((torch.tensor([5, 3]), 2), (torch.tensor([2, 2]), 2), (torch.tensor([70_000]), 1)):
        with pytest.raises(ValueError, match="sorted and distinct"):
            encode_delta16_layers([indices], [capacity])


@pytest.mark.parametrize("seed", range(5))
def test_stratified_layers_draw_what_one_call_per_layer_draws(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    numels = [int(n) for n in torch.randint(1, 5000, (6,), generator=gen)] + [1, 7]
    ks = [max(1, int(n * r)) for n, r in zip(numels, torch.rand(len(numels), generator=gen).tolist())]
    ks[-1] = 99  # more than the layer holds: clipped, as stratified_indices clips
    indices, sizes = stratified_layers(numels, ks, [torch.Generator().manual_seed(seed * 100 + i) for i in range(8)],
                                       torch.device("cpu"))
    alone = [stratified_indices(n, k, torch.Generator().manual_seed(seed * 100 + i), torch.device("cpu"))
             for i, (n, k) in enumerate(zip(numels, ks))]
    assert torch.equal(indices, torch.cat([i for i, _ in alone]))
    assert torch.equal(sizes, torch.cat([s for _, s in alone]))
    sizes.fill_(0)  # the caller's copy: the cached block sizes are not touched
    assert torch.equal(stratified_layers(numels, ks, [torch.Generator().manual_seed(seed * 100 + i) for i in range(8)],
                                         torch.device("cpu"))[1], torch.cat([s for _, s in alone]))


def test_repeated_offsets() -> None:
    assert repeated_offsets((0, 10, 25), (2, 0, 3)).tolist() == [0, 0, 25, 25, 25]
    on_cpu = repeated_offsets((0, 10, 25), (2, 0, 3), torch.device("cpu"))
    assert on_cpu.device.type == "cpu" and on_cpu.tolist() == [0, 0, 25, 25, 25]
    assert repeated_offsets((0, 10, 25), (2, 0, 3), torch.device("cpu")) is on_cpu  # cached per device


def test_packed_positions_place_fewer_entries_at_the_start_of_each_slot() -> None:
    """CLT-k's values of a leader that kept fewer than k entries in a layer."""
    assert packed_positions([2, 3, 1], [4, 5, 1], torch.device("cpu")).tolist() == [0, 1, 4, 5, 6, 9]
    assert packed_positions([4, 5], [4, 5], torch.device("cpu")).tolist() == list(range(9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("where", ["unsampled", "sampled"])
def test_a_nan_counts_as_the_largest_magnitude_wherever_it_lies(dtype: torch.dtype, where: str) -> None:
    """``torch.topk`` ranks NaN above every number. Before, a NaN outside the threshold's sample failed ``|x| >= t``
    and was left out of the candidates (the compiled kernel hands NaN to these steps)."""
    from lightning_gradcomp.functional.selection import exact_topk_indices

    n, k = 65536, 100
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(dtype)
    stride = systematic_stride(n, 4096)
    at = 1 if where == "unsampled" else stride  # index 1 is never sampled (stride > 1), the stride always is
    x[at] = float("nan")
    expected = set(torch.topk(x.abs(), k).indices.tolist())
    assert at in expected
    assert set(topk_indices(x, k).tolist()) == expected
    assert set(exact_topk_indices(x, k).tolist()) == expected


def test_delta16_of_an_empty_layer_and_capacities_that_do_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty layer reserves no code (it reserved -1, and the kernel's encoding crashed the process); capacities
    that do not add up to the codes (or are negative) are refused on both paths (the kernel read past the codes)."""
    from lightning_gradcomp.functional import _native
    from lightning_gradcomp.functional.sparsify import decode_delta16_layers, delta16_capacity, encode_delta16_layers

    assert delta16_capacity(0, 0) == 0 and delta16_capacity(1, 1) == 1 and delta16_capacity(65536, 1) == 2
    short = torch.tensor([1, 1, 1, 7, 7, 7, 7], dtype=torch.uint16)[:3]
    for native in (True, False):
        if not native:
            monkeypatch.setattr(_native, "load", lambda: None)  # the torch steps
        caps = [delta16_capacity(0, 0), delta16_capacity(10, 2)]
        codes = encode_delta16_layers([torch.empty(0, dtype=torch.int64), torch.tensor([3, 4])], caps)
        assert codes.to(torch.int32).tolist() == [4, 1]
        assert decode_delta16_layers(codes, caps).tolist() == [3, 4]
        with pytest.raises(ValueError, match="`capacities` must add up to the number of codes"):
            decode_delta16_layers(short, [3, 4])
        with pytest.raises(ValueError, match="`capacities` must be integers >= 0"):
            decode_delta16_layers(short, [4, -1])
        with pytest.raises(ValueError, match="`capacities` must be integers >= 0"):
            encode_delta16_layers([torch.tensor([1]), torch.tensor([2])], [2, -1])
        with pytest.raises(ValueError, match="one count per layer"):
            encode_delta16_layers([torch.tensor([1])], [1, 1])


def test_stratified_indices_of_nothing_kept_are_empty() -> None:
    """``k = 0`` or an empty layer divided by zero; now they keep nothing, and the other layers are unchanged."""
    gens = lambda: [torch.Generator().manual_seed(s) for s in range(3)]  # noqa: E731
    indices, sizes = stratified_indices(5, 0, torch.Generator(), torch.device("cpu"))
    assert indices.numel() == 0 and sizes.numel() == 0
    mixed, _ = stratified_layers([5, 0, 10], [0, 0, 3], gens(), torch.device("cpu"))
    alone, _ = stratified_indices(10, 3, gens()[2], torch.device("cpu"))
    assert torch.equal(mixed, alone)
