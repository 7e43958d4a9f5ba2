"""PowerSGD on real gloo ranks: wire bytes, replicas, error-feedback consistency, warm start, rank changes, resume."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from helpers.distributed import run_workers
from helpers.models import assert_replicas_identical, fit
from helpers.reduce import make_slots, rank_inputs, reduce_worker
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.shard_files import read_shards
from lightning_gradcomp.comm import Comm, all_reduce_bytes
from lightning_gradcomp.compressors import PowerSGD, ReduceContext, create
from lightning_gradcomp.functional.layerwise import lowrank_errors
from lightning_gradcomp.plan import LayerSlot

SHAPES = [(40, 30), (17, 6, 10)]


def _identical(results: list[dict]) -> None:
    for res in results[1:]:
        for step_a, step_b in zip(results[0]["steps"], res["steps"]):
            for a, b in zip(step_a["averaged"], step_b["averaged"]):
                assert torch.equal(a, b)


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_replicas_and_error_feedback(world: int) -> None:
    ranks = [2, 3]
    results = run_workers(reduce_worker, world, PowerSGD(rank=2), SHAPES, ranks, 2)
    _identical(results)
    numel = sum((n + m) * r for (n, m), r in zip([(40, 30), (17, 60)], ranks))
    steps = 2
    assert results[0]["stats"]["wire_bytes"] == pytest.approx(steps * all_reduce_bytes(4 * numel, world))
    assert results[0]["stats"]["collectives"] == 2 * steps  # one P and one Q all-reduce per bucket and step
    # Error feedback is consistent: the average of the ranks' own contributions p - residual is the output.
    for step in range(steps):
        inputs = [rank_inputs(r, SHAPES, step) for r in range(world)]
        for layer in range(len(SHAPES)):
            contrib = sum(inputs[r][layer] - results[r]["steps"][step]["residuals"][layer] for r in range(world))
            torch.testing.assert_close(results[0]["steps"][step]["averaged"][layer], contrib / world,
                                       atol=1e-5, rtol=1e-4)


def _mixed_kernel_worker(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 runs without the compiled kernel (BLAS products), the others with it."""
    if rank == 1:
        from lightning_gradcomp.functional import _native

        _native.load = lambda: None  # type: ignore[assignment]  # this forked rank only
    return reduce_worker(rank, world, PowerSGD(rank=3), [(64, 40), (33, 7, 5), (130, 257)], None, 3)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_and_without_the_kernel_stay_identical(world: int) -> None:
    """The kernel's ``M Q`` / ``M^T P`` round differently from BLAS, but they are only each rank's contribution to an
    all-reduce; the decoding every rank must agree on stays torch's, so the averaged result is the same bits on a rank
    without the kernel."""
    _identical(run_workers(_mixed_kernel_worker, world))


def _shared_column_space_worker(rank: int, world: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    u = torch.randn(30, 2, generator=gen)  # same on every rank
    v = torch.randn(20, 2, generator=torch.Generator().manual_seed(100 + rank))
    m = (u @ v.T).reshape(-1)
    ctx = ReduceContext(Comm(), 0, 0, make_slots([(30, 20)]), [2])
    red = PowerSGD(rank=2).reduce([m.clone()], ctx)
    return {"input": m, "averaged": red.averaged.wait()[0], "residual": red.residuals[0].clone()}


def test_exact_for_inputs_within_the_rank() -> None:
    results = run_workers(_shared_column_space_worker, 2)
    mean = sum(r["input"] for r in results) / 2
    torch.testing.assert_close(results[0]["averaged"], mean, atol=1e-4, rtol=1e-4)
    for r in results:
        assert float(r["residual"].abs().max()) < 1e-4


def _repeat_worker(rank: int, world: int, warm_start: bool, steps: int) -> list[float]:
    """Compress the same matrix repeatedly (no EF here): the warm start converges to the best rank-2 error."""
    torch.manual_seed(0)
    a = torch.randn(40, 8) @ torch.diag(torch.tensor([10.0, 6.0, 3.0, 1.0, .5, .3, .2, .1])) @ torch.randn(8, 25)
    comp = PowerSGD(rank=2, warm_start=warm_start)
    comm = Comm()
    errs = []
    for step in range(steps):
        ctx = ReduceContext(comm, step, 0, make_slots([(40, 25)]), [2])
        out = comp.reduce([a.reshape(-1).clone()], ctx).averaged.wait()[0]
        errs.append(float(torch.linalg.norm(out.view(40, 25) - a)))
    return errs


def test_warm_start_converges_to_best_rank_r() -> None:
    warm = run_workers(_repeat_worker, 2, True, 12)[0]
    cold = run_workers(_repeat_worker, 2, False, 12)[0]
    torch.manual_seed(0)
    a = torch.randn(40, 8) @ torch.diag(torch.tensor([10.0, 6.0, 3.0, 1.0, .5, .3, .2, .1])) @ torch.randn(8, 25)
    best = lowrank_errors(a, [2])[0]
    assert warm[-1] == pytest.approx(best, rel=1e-3)
    assert warm[0] > 1.05 * best  # one power iteration from a random start is not optimal ...
    assert min(cold) > warm[-1] * 1.01  # ... and without warm start it never gets there


def _layout_worker(rank: int, world: int, order: list[int]) -> dict[str, torch.Tensor]:
    """Reduce the two layers of SHAPES in the given bucket order, fresh and after a rank change."""
    comp, comm = PowerSGD(rank=2), Comm()
    named = make_slots(SHAPES)
    slots, offset = [], 0
    for i in order:
        slots.append(LayerSlot(named[i].name, offset, named[i].shape, compressed=True))
        offset += named[i].numel
    out: dict[str, torch.Tensor] = {}
    for step, r in enumerate([2, 3]):  # step 0: fresh factors; step 1: adapt_factor draws a new column
        tensors = rank_inputs(rank, SHAPES, step)
        red = comp.reduce([tensors[i].clone() for i in order], ReduceContext(comm, step, 0, slots, [r, r]))
        for i, t in zip(order, red.averaged.wait()):
            out[f"{step}/{named[i].name}"] = t.clone()
    return out


def test_factors_do_not_depend_on_bucket_layout() -> None:
    """DDP re-buckets after its first step and after a resume: a layer's random factors must follow its name."""
    forward = run_workers(_layout_worker, 2, [0, 1])[0]
    backward = run_workers(_layout_worker, 2, [1, 0])[0]
    assert forward.keys() == backward.keys()
    for key in forward:
        assert torch.equal(forward[key], backward[key]), key


def _rank_change_worker(rank: int, world: int) -> dict[str, Any]:
    comp = PowerSGD(rank=2)
    comm = Comm()
    slots = make_slots(SHAPES)
    shapes_seen, outs = [], []
    for step, params in enumerate([[2, 2], [3, 2], [1, 2], [1, 40], [2, 2]]):
        tensors = rank_inputs(rank, SHAPES, step)
        red = comp.reduce([t.clone() for t in tensors], ReduceContext(comm, step, 0, slots, params))
        outs.append([t.clone() for t in red.averaged.wait()])
        shapes_seen.append({k: tuple(v.shape) for k, v in comp.state_dict()["factors"].items()})
    return {"outs": outs, "shapes": shapes_seen}


def test_rank_change_resizes_factors_identically() -> None:
    first = run_workers(_rank_change_worker, 2)
    again = run_workers(_rank_change_worker, 2)
    for res in (first[1], again[0], again[1]):
        for step_a, step_b in zip(first[0]["outs"], res["outs"]):
            for a, b in zip(step_a, step_b):
                assert torch.equal(a, b)
    shapes = first[0]["shapes"]
    assert [s["layer0"] for s in shapes] == [(30, 2), (30, 3), (30, 1), (30, 1), (30, 2)]
    assert shapes[3]["layer1"] == (60, 17)  # rank 40 is clipped to min(n, m) = 17


def _resume_worker(rank: int, world: int) -> dict[str, Any]:
    slots = make_slots(SHAPES)
    a, comm = PowerSGD(rank=2), Comm()
    for step in range(3):
        ctx = ReduceContext(comm, step, 0, slots, [2, 2])
        a.reduce([t.clone() for t in rank_inputs(rank, SHAPES, step)], ctx).averaged.wait()  # as DDP does
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = PowerSGD(rank=2)
    b.load_state_dict(torch.load(buf, weights_only=True))
    fresh = PowerSGD(rank=2)
    inputs = rank_inputs(rank, SHAPES, 3)
    outs = {}
    for name, comp in (("continued", a), ("resumed", b), ("fresh", fresh)):
        red = comp.reduce([t.clone() for t in inputs], ReduceContext(comm, 3, 0, slots, [2, 2]))
        outs[name] = red.averaged.wait()
    return outs


def test_state_dict_resume_keeps_warm_start() -> None:
    res = run_workers(_resume_worker, 2)[0]
    for x, y in zip(res["continued"], res["resumed"]):
        assert torch.equal(x, y)
    assert any(not torch.equal(x, y) for x, y in zip(res["continued"], res["fresh"]))


def test_accepts_only_layers_that_shrink() -> None:
    comp = PowerSGD(rank=4)  # min_compression_rate 2: (n + m) * 4 * 2 <= n * m
    assert comp.accepts(LayerSlot("a", 0, (16, 16), True))
    assert not comp.accepts(LayerSlot("b", 0, (15, 16), True))
    assert comp.accepts(LayerSlot("c", 0, (32, 3, 3, 3), True))
    assert not comp.accepts(LayerSlot("d", 0, (4096,), True))
    assert not comp.accepts(LayerSlot("e", 0, (4, 4096), True))  # rank 4 of min side 4 saves nothing
    assert PowerSGD(rank=4, min_compression_rate=1.0).accepts(LayerSlot("b", 0, (15, 16), True))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"rank": 0}, ValueError, "rank"),
    ({"rank": 1.5}, TypeError, "rank"),
    ({"warm_start": 1}, TypeError, "warm_start"),
    ({"min_compression_rate": 0.5}, ValueError, "min_compression_rate"),
])
def test_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        PowerSGD(**kwargs)
    with pytest.raises(ValueError, match="rank"):
        PowerSGD().check_param(0)


def test_registry_and_preset() -> None:
    assert isinstance(create("powersgd", rank=3), PowerSGD)
    from lightning.pytorch.strategies import StrategyRegistry
    assert "powersgd_gc" in StrategyRegistry
    assert isinstance(StrategyRegistry.get("powersgd_gc").compressor, PowerSGD)


# ---------------------------------------------------------------------------------------------- Lightning
def _strategy(**kwargs: Any) -> GradCompStrategy:
    return GradCompStrategy(compressor=PowerSGD(rank=2), start_method="fork", **kwargs)


@pytest.mark.parametrize("world", [2, 3])
def test_lightning_replicas_identical_and_bytes(tmp_path: Any, world: int) -> None:
    records = fit(_strategy(), tmp_path, devices=world, max_epochs=2)
    assert_replicas_identical(records)
    stats = records[0]["stats"]
    layers = stats["layers"]
    assert layers["body.0.weight"]["compressed"] and layers["body.2.weight"]["compressed"]
    assert not layers["head.weight"]["compressed"]
    compressed_steps = stats["steps"] - 2
    expected = compressed_steps * all_reduce_bytes(4 * ((64 + 32) * 2), world)
    assert layers["body.0.weight"]["wire_bytes"] == pytest.approx(
        expected + 2 * all_reduce_bytes(4 * 64 * 32, world))
    assert stats["wire_bytes"] < stats["dense_bytes"] / 2


def test_lightning_resume_is_exact_and_keeps_q(tmp_path: Any) -> None:
    import lightning.pytorch as pl

    full = fit(_strategy(), tmp_path / "full", max_epochs=2)
    ckpt_dir = tmp_path / "ckpt"
    first = fit(_strategy(), ckpt_dir, max_epochs=1, enable_checkpointing=True,
                callbacks=[pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True)])
    per_rank = read_shards(ckpt_dir / "last.ckpt")
    factors = per_rank[0]["compressor"]["factors"]
    assert set(factors) == {"body.0.weight", "body.2.weight"}
    assert all(torch.equal(factors[k], per_rank[1]["compressor"]["factors"][k]) for k in factors)
    resumed = fit(_strategy(), tmp_path / "resumed", max_epochs=2, ckpt_path=str(ckpt_dir / "last.ckpt"))
    assert len(first[0]["params"]) + len(resumed[0]["params"]) == len(full[0]["params"])
    assert_replicas_identical(resumed)
    assert torch.equal(resumed[0]["params"][-1], full[0]["params"][-1])
