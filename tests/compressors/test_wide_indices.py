"""Layers of more than 2**31 elements under the int32 index coding: each index travels as two int32 words.

One int32 holds positions up to ``2**31 - 1``; before, TopK and CLT-k cast larger positions to int32, which wrapped
(position ``2**32 + 5`` arrived as 5, and CLT-k dropped the negative ones). Such layers cannot be built on this
machine, so the protocol tests lower :data:`~lightning_gradcomp.functional.sparsify.INT32_INDEX_LIMIT` to 1000
elements inside the workers: every path a wide layer takes then runs on small layers, next to narrow ones and at
the boundary (a layer of exactly 1000 elements stays narrow). The codec itself is checked on real 64-bit positions.
"""

from typing import Any, Callable

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from helpers.distributed import run_workers
from helpers.models import LayerSizesNet
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors import CLTK, TopK
from lightning_gradcomp.compressors import cltk
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.functional import sparsify
from lightning_gradcomp.functional.sparsify import (decode_int32_indices, encode_int32_indices, int32_index_words,
                                                    kept_count)
from lightning_gradcomp.hook import gradcomp_comm_hook

# ---------------------------------------------------------------------------- the codec


@pytest.mark.parametrize("numel", [2**31 + 1, 2**32, 2**32 + 1, 2**40, 2**62])
def test_wide_positions_round_trip(numel: int) -> None:
    edges = [0, 1, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 1, 2**32, 2**32 + 5, numel - 2, numel - 1]
    gen = torch.Generator().manual_seed(numel % 1000)
    drawn = torch.randint(0, numel, (200,), generator=gen, dtype=torch.int64)
    indices = torch.cat([torch.tensor([e for e in edges if 0 <= e < numel]), drawn]).unique()  # sorted
    codes = encode_int32_indices(indices, numel)
    assert codes.dtype == torch.int32 and codes.numel() == 2 * indices.numel()
    assert torch.equal(decode_int32_indices(codes, numel), indices)


@pytest.mark.parametrize(("numel", "capacity"), [(2**40, 7), (2**31 + 1, 3), (1000, 5), (2**31, 4)])
def test_padding_decodes_to_minus_one(numel: int, capacity: int) -> None:
    indices = torch.tensor([0, numel - 1])
    codes = encode_int32_indices(indices, numel, capacity=capacity)
    assert codes.numel() == capacity * int32_index_words(numel)
    assert decode_int32_indices(codes, numel).tolist() == [0, numel - 1] + [-1] * (capacity - 2)


@pytest.mark.parametrize("numel", [1000, 2**40])
def test_a_capacity_below_the_count_is_refused(numel: int) -> None:
    with pytest.raises(ValueError, match="`capacity` must be at least the 3 indices, got 2"):
        encode_int32_indices(torch.tensor([0, 1, 2]), numel, capacity=2)


@pytest.mark.parametrize("numel", [1, 1000, 2**31 - 1, 2**31])
def test_narrow_layers_keep_one_word_per_index(numel: int) -> None:
    """Up to 2**31 elements (positions below 2**31) the codes are the plain int32 values, as before."""
    indices = torch.tensor(sorted({0, numel // 2, numel - 1}))
    codes = encode_int32_indices(indices, numel)
    assert int32_index_words(numel) == 1 and torch.equal(codes, indices.to(torch.int32))
    assert torch.equal(decode_int32_indices(codes, numel), indices)


def test_index_bytes_of_a_wide_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wire's index entries, and what L-GreCo is told a layer's ratio costs: 8 bytes per index above 2**31."""
    wide, narrow, k = 2**31 + 1, 2**31, 1000
    for comp in (TopK(), CLTK()):
        assert comp.index_slots(wide, k) == 2 * k and comp.index_slots(narrow, k) == k
    assert TopK(index_coding="delta16").index_slots(wide, k) == k + (wide - 1) // 65535  # gaps: any size
    stat = torch.arange(10.0)
    assert TopK().layer_costs(stat, (10,), [0.5])[0] == CLTK().layer_costs(stat, (10,), [0.5])[0] == [5 * (4 + 4)]
    monkeypatch.setattr(sparsify, "INT32_INDEX_LIMIT", 9)  # a 10-element layer is wide now
    for comp in (TopK(), CLTK(), TopK(value_dtype=torch.float16)):
        sizes, _ = comp.layer_costs(stat, (10,), [0.5, 0.2])
        assert sizes == [k * (comp.value_dtype.itemsize + 8) for k in (5, 2)]
    assert TopK(index_coding="delta16").layer_costs(stat, (10,), [0.5])[0] == [5 * (4 + 2)]


# ---------------------------------------------------------------------------- the protocol, with a lowered limit
LIMIT = 1000
SHAPES = {  # 1000 elements: the boundary (narrow); 1001, 4097, 2500 and 30000: wide; the rest (and the conv) narrow
    "v7": (7,), "m1000": (10, 100), "m1001": (7, 143), "v129": (129,), "m4097": (17, 241), "m2500": (50, 50),
    "m30000": (100, 300),  # large enough for the approximate selection to sample
}
STEPS, START, BATCH = 5, 2, 4


class _ShortCLTK(CLTK):
    """CLT-k whose leader keeps one entry fewer than k in every layer of more than one, as the approximate selection
    may (anywhere in its band, rarely on these layers): the wire then carries one padding index per layer."""

    def _select(self, p: torch.Tensor, k: int, ctx: Any, name: str) -> torch.Tensor:
        chosen = super()._select(p, k, ctx, name)
        return chosen[1:] if chosen.numel() > 1 else chosen


VARIANTS: dict[str, Callable[[], Compressor]] = {
    "topk": lambda: TopK(ratio=0.1),
    "topk-fp16": lambda: TopK(ratio=0.05, value_dtype=torch.float16),
    "cltk": lambda: CLTK(ratio=0.1),
    "cltk-approx": lambda: CLTK(ratio=0.01, selection="approx"),
    "cltk-short": lambda: _ShortCLTK(ratio=0.1),  # fewer than k: padded indices on the wire
    "cltk-bf16-spread": lambda: CLTK(ratio=0.2, value_dtype=torch.bfloat16, spread_leaders=True),
}


def _train(rank: int, world: int, name: str) -> dict[str, Any]:
    padded = []  # the padding entries each wide layer's decoded codes held
    decode = sparsify.decode_int32_indices

    def counting(codes: torch.Tensor, numel: int) -> torch.Tensor:
        out = decode(codes, numel)
        if int32_index_words(numel) == 2:
            padded.append(int((out < 0).sum()))
        return out

    cltk.decode_int32_indices = counting
    try:
        return {**_fit(rank, name), "padded": sum(padded), "wide_decodes": len(padded)}
    finally:
        cltk.decode_int32_indices = decode


def _fit(rank: int, name: str) -> dict[str, Any]:
    model = LayerSizesNet(SHAPES)
    strategy = GradCompStrategy(compressor=VARIANTS[name](), start_step=START, min_numel=1, compress_1d=True)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01, gradient_as_bucket_view=True)  # ~2500 floats/bucket
    hook = strategy.make_hook(Comm(None, CommStats()), {id(p): n for n, p in model.named_parameters()},
                              torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hook.attach_optimizer(optimizer)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    gen = torch.Generator().manual_seed(rank)
    total = sum(p.numel() for p in model.layers.values())
    for _ in range(STEPS):
        image, features = torch.randn(BATCH, 3, 5, 5, generator=gen), torch.randn(BATCH, total, generator=gen)
        loss = (ddp(image, features).tanh() - torch.randn(BATCH, generator=gen).sign()).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    names = {p.numel(): n for n, p in model.named_parameters()}
    hook.close()
    return {"params": [p.detach().clone() for p in model.parameters()], "bytes": hook.stats.wire_bytes,
            "numels": sorted(names)}


def _both(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    default = sparsify.INT32_INDEX_LIMIT
    for limit in (default, LIMIT):
        sparsify.INT32_INDEX_LIMIT = limit
        try:
            out.update({(name, limit): _train(rank, world, name) for name in names})
        finally:
            sparsify.INT32_INDEX_LIMIT = default
    return out


def _extra_index_bytes(name: str, world: int, numels: list[int]) -> float:
    """The 4 more bytes per index of the wide layers, over the compressed steps, in each index collective's
    accounting: TopK all-gathers them ((W - 1) x), CLT-k's leader broadcasts them ((W - 1) / W x)."""
    comp = VARIANTS[name]()
    per_step = sum(4 * kept_count(n, comp.ratio) for n in numels if n > LIMIT)
    factor = world - 1 if isinstance(comp, TopK) else (world - 1) / world
    return (STEPS - START) * per_step * factor


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_wide_layers_train_exactly_as_narrow_ones(world: int) -> None:
    """With the limit lowered, the 1001-, 2500- and 4097-element layers send two words per index: the parameters
    equal, bit for bit, those of the run with one word per index, on every rank, and the bytes grow by exactly the
    high halves."""
    names = list(VARIANTS)
    results = run_workers(_both, world, names, timeout=120)
    problems = []
    for name in names:
        narrow, wide = [r[(name, sparsify.INT32_INDEX_LIMIT)] for r in results], [r[(name, LIMIT)] for r in results]
        for rank in range(world):
            for i, (a, b) in enumerate(zip(narrow[rank]["params"], wide[rank]["params"])):
                if not torch.equal(a, b) or not torch.equal(wide[0]["params"][i], b):
                    problems.append(f"{name} W={world} rank {rank}: parameter {i} differs")
            extra = wide[rank]["bytes"] - narrow[rank]["bytes"]
            want = _extra_index_bytes(name, world, narrow[rank]["numels"])
            if extra != pytest.approx(want, rel=1e-12) or want <= 0:
                problems.append(f"{name} W={world} rank {rank}: {extra} more bytes, expected {want}")
            if name.startswith("cltk") and not wide[rank]["wide_decodes"]:
                problems.append(f"{name} W={world} rank {rank}: no wide layer was decoded")
        if name == "cltk-short" and not wide[0]["padded"]:
            problems.append(f"{name} W={world}: no wide layer's slots were padded")
    assert not problems, "\n".join(problems)
