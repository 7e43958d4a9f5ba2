"""NoCompression, Cast, TopK and RandomK on real gloo ranks: results, residuals, wire bytes."""

from __future__ import annotations

import pytest
import torch

from helpers.distributed import run_workers
from helpers.reduce import rank_inputs, reduce_worker
from lightning_gradcomp.comm import all_gather_bytes, all_reduce_bytes
from lightning_gradcomp.compressors import CLTK, Cast, NoCompression, RandomK, TopK
from lightning_gradcomp.functional import kept_count, topk_indices

SHAPES = [(40, 30), (17, 60)]


def _inputs(world: int) -> list[list[torch.Tensor]]:
    return [rank_inputs(r, SHAPES) for r in range(world)]


def _identical(results: list[dict]) -> None:
    first = results[0]["steps"][-1]["averaged"]
    for res in results[1:]:
        for a, b in zip(first, res["steps"][-1]["averaged"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("world", [2, 3])
def test_no_compression_is_the_exact_mean(world: int) -> None:
    results = run_workers(reduce_worker, world, NoCompression(), SHAPES)
    _identical(results)
    inputs = _inputs(world)
    for layer, avg in enumerate(results[0]["steps"][0]["averaged"]):
        torch.testing.assert_close(avg, sum(x[layer] / world for x in inputs))
    n = sum(40 * 30 for _ in [0]) + 17 * 60
    assert results[0]["stats"]["wire_bytes"] == pytest.approx(all_reduce_bytes(4 * n, world))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_halves_bytes(dtype: torch.dtype) -> None:
    world = 2
    results = run_workers(reduce_worker, world, Cast(dtype), SHAPES)
    _identical(results)
    inputs = _inputs(world)
    for layer, avg in enumerate(results[0]["steps"][0]["averaged"]):
        torch.testing.assert_close(avg, sum(x[layer] / world for x in inputs), atol=2e-2, rtol=2e-2)
    n = 40 * 30 + 17 * 60
    assert results[0]["stats"]["wire_bytes"] == pytest.approx(all_reduce_bytes(2 * n, world))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("value_dtype", "index_coding"),
                         [(torch.float32, "int32"), (torch.float16, "int32"), (torch.float32, "delta16"),
                          (torch.float16, "delta16")])
def test_topk_all_gather(world: int, value_dtype: torch.dtype, index_coding: str) -> None:
    ratios = [0.05, 0.2]
    compressor = TopK(0.1, value_dtype=value_dtype, index_coding=index_coding)
    results = run_workers(reduce_worker, world, compressor, SHAPES, ratios)
    _identical(results)
    inputs = _inputs(world)
    ks = [kept_count(40 * 30, 0.05), kept_count(17 * 60, 0.2)]
    for layer, k in enumerate(ks):
        expected = torch.zeros_like(inputs[0][layer])
        for x in inputs:  # each rank's values divided by W, then summed in rank order (DDP's order): the same bits
            idx = topk_indices(x[layer], k)
            expected[idx] += x[layer][idx].to(value_dtype).float() / world
        assert torch.equal(results[0]["steps"][0]["averaged"][layer], expected)
        for rank, x in enumerate(inputs):  # residual = p - c: zero (or rounding error) where kept
            idx = topk_indices(x[layer], k)
            residual = results[rank]["steps"][0]["residuals"][layer]
            kept = x[layer][idx]
            torch.testing.assert_close(residual[idx], kept - kept.to(value_dtype).float())
            mask = torch.ones_like(x[layer], dtype=torch.bool)
            mask[idx] = False
            assert torch.equal(residual[mask], x[layer][mask])
    value_bytes = 4 if value_dtype == torch.float32 else 2
    index_bytes = 4 * sum(ks) if index_coding == "int32" else 2 * sum(ks)  # both layers under 65536 elements
    expected = all_gather_bytes(sum(ks) * value_bytes + index_bytes, world)
    assert results[0]["stats"]["wire_bytes"] == pytest.approx(expected)


@pytest.mark.parametrize("unbiased", [False, True])
def test_randomk_shared_support(unbiased: bool) -> None:
    world = 3
    results = run_workers(reduce_worker, world, RandomK(0.1, unbiased=unbiased), SHAPES)
    _identical(results)
    inputs = _inputs(world)
    for layer in range(len(SHAPES)):
        avg = results[0]["steps"][0]["averaged"][layer]
        support = avg != 0
        assert int(support.sum()) == kept_count(inputs[0][layer].numel(), 0.1)
        scale = inputs[0][layer].numel() / int(support.sum()) if unbiased else 1.0
        expected = sum(x[layer] for x in inputs) / world * scale
        torch.testing.assert_close(avg[support], expected[support])
        if not unbiased:
            residual = results[1]["steps"][0]["residuals"][layer]
            assert torch.equal(residual[~support], inputs[1][layer][~support])
            assert not residual[support].any()
    assert (results[0]["steps"][0]["residuals"] is None) == unbiased
    k = sum(kept_count(40 * 30 if i == 0 else 17 * 60, 0.1) for i in range(2))
    assert results[0]["stats"]["wire_bytes"] == pytest.approx(all_reduce_bytes(4 * k, world))


def _randomk_mean(rank: int, world: int, steps: int) -> torch.Tensor:
    from lightning_gradcomp.comm import Comm
    from lightning_gradcomp.compressors.base import ReduceContext
    from helpers.reduce import make_slots

    comm, slots = Comm(), make_slots([(8, 8)])
    x = rank_inputs(0, [(8, 8)])[0]
    total = torch.zeros_like(x)
    for step in range(steps):
        ctx = ReduceContext(comm, step, 0, slots, [0.25])
        total += RandomK(0.25, unbiased=True).reduce([x.clone()], ctx).averaged.wait()[0]
    return total / steps


def test_randomk_unbiased_estimator() -> None:
    """E[RandomK_unbiased(x)] = x; tolerance from the variance x^2 (n/k - 1) / steps (5 sigma)."""
    steps = 400
    mean = run_workers(_randomk_mean, 1, steps)[0]
    x = rank_inputs(0, [(8, 8)])[0]
    sigma = x.abs() * ((64 / 16 - 1) / steps) ** 0.5
    assert bool(((mean - x).abs() <= 5 * sigma + 1e-6).all())
    assert not torch.allclose(mean, x, atol=1e-4)  # it really is a random estimate, not the identity


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ratio": 0}, r"`ratio` must be in \(0.0, 1.0\]"), ({"ratio": 1.5}, "ratio"), ({"ratio": -1}, "ratio"),
    ({"ratio": "0.1"}, "`ratio` must be a number"), ({"value_dtype": torch.int8}, "`value_dtype` must be one of"),
])
def test_sparse_argument_validation(kwargs: dict, message: str) -> None:
    for cls in (TopK, RandomK):
        with pytest.raises((ValueError, TypeError), match=message):
            cls(**kwargs)


def test_cast_and_randomk_validation() -> None:
    with pytest.raises(ValueError, match="`dtype` must be torch.float16 or torch.bfloat16"):
        Cast(torch.float32)
    assert Cast("bfloat16").dtype == torch.bfloat16
    with pytest.raises(TypeError, match="`unbiased` must be a bool"):
        RandomK(0.1, unbiased="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="density"):
        TopK().check_param(0.0)


def test_topk_index_coding_is_validated_and_counted_in_its_layer_costs() -> None:
    with pytest.raises(ValueError, match="`index_coding` must be 'int32' or 'delta16', got 'int8'"):
        TopK(index_coding="int8")  # type: ignore[arg-type]
    stat = torch.randn(300_001, generator=torch.Generator().manual_seed(0))
    ratios = [0.001, 0.01, 0.5]
    ks = [kept_count(stat.numel(), r) for r in ratios]
    int32, _ = TopK(value_dtype=torch.float16).layer_costs(stat, stat.shape, ratios)
    delta16, errors = TopK(value_dtype=torch.float16, index_coding="delta16").layer_costs(stat, stat.shape, ratios)
    assert int32 == [float(k * (2 + 4)) for k in ks]
    assert delta16 == [float(k * 2 + 2 * (k + 300_000 // 65535)) for k in ks]  # 4 escape codes on 300,001 entries
    assert errors == TopK().layer_costs(stat, stat.shape, ratios)[1]
    assert "index_coding='delta16'" in repr(TopK(index_coding="delta16"))


class _ShortCLTK(CLTK):
    """CLT-k whose leader keeps one entry fewer than k in every layer of more than one (as the approximate
    selection may, anywhere in its band)."""

    def _select(self, p: torch.Tensor, k: int, ctx, name: str) -> torch.Tensor:
        chosen = super()._select(p, k, ctx, name)
        return chosen[1:] if chosen.numel() > 1 else chosen


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("make", [lambda: TopK(0.1), lambda: TopK(0.2, value_dtype=torch.float16),
                                  lambda: TopK(0.1, index_coding="delta16", value_dtype=torch.bfloat16),
                                  lambda: RandomK(0.1), lambda: RandomK(0.3, value_dtype=torch.float16),
                                  lambda: RandomK(0.1, unbiased=True), lambda: CLTK(0.1),
                                  lambda: CLTK(0.1, selection="approx", value_dtype=torch.float16,
                                               index_coding="delta16"),
                                  lambda: CLTK(0.2, selection="approx", value_dtype=torch.bfloat16),
                                  lambda: _ShortCLTK(0.1), lambda: _ShortCLTK(0.1, value_dtype=torch.float16)],
                         ids=["topk", "topk-fp16", "topk-delta16-bf16", "randomk", "randomk-fp16", "randomk-unbiased",
                              "cltk", "cltk-compact", "cltk-approx-bf16", "cltk-short", "cltk-short-fp16"])
def test_sparsifiers_on_slices_of_one_buffer_equal_the_per_slot_path(world: int, make) -> None:
    """Given slices of one buffer (the outputs always are: the bucket's slices), the sparsifiers gather, write
    residuals and scatter once for all of them: the same bits as one call per slot on separate tensors, and nothing
    between the slices moves. A CLT-k leader that keeps fewer than k entries (as the approximate selection may)
    leaves the values' slots partly unused."""
    shapes = [(40, 30), (1,), (17, 60), (7,)]
    per_slot = run_workers(reduce_worker, world, make(), shapes, None, 2)
    windowed = run_workers(reduce_worker, world, make(), shapes, None, 2, 0, True)
    for a, b in zip(per_slot, windowed):
        for step_a, step_b in zip(a["steps"], b["steps"]):
            for key in ("averaged", "residuals"):
                if step_a[key] is None:
                    assert step_b[key] is None
                    continue
                assert all(torch.equal(x, y) for x, y in zip(step_a[key], step_b[key])), key
        assert a["stats"]["wire_bytes"] == b["stats"]["wire_bytes"]


@pytest.mark.parametrize("world", [2, 3])
def test_cltk_with_fewer_than_k_entries_averages_the_leaders_choice(world: int) -> None:
    """The leader keeps k - 1 entries per layer: the average holds the ranks' mean there and zeros elsewhere, and
    each rank's residual is its input with those entries zeroed (fp32 values)."""
    from lightning_gradcomp.compressors.cltk import leader_rank
    from lightning_gradcomp.functional import exact_topk_indices

    shapes, ratio = [(40, 30), (17, 60), (7,)], 0.1
    results = run_workers(reduce_worker, world, _ShortCLTK(ratio), shapes, None, 1, 0, True)
    inputs = [rank_inputs(r, shapes) for r in range(world)]
    leader = leader_rank(0, 0, world)
    for layer, shape in enumerate(shapes):
        p = inputs[leader][layer]
        chosen = exact_topk_indices(p, kept_count(p.numel(), ratio))
        chosen = chosen[1:] if chosen.numel() > 1 else chosen
        want = torch.zeros_like(p)
        want[chosen] = sum(x[layer][chosen] for x in inputs) / world
        for rank, res in enumerate(results):
            torch.testing.assert_close(res["steps"][0]["averaged"][layer], want)
            residual = inputs[rank][layer].clone()
            residual[chosen] = 0.0
            assert torch.equal(res["steps"][0]["residuals"][layer], residual)
