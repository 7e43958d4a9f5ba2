"""SignSGD: 1-bit scaled sign with worker error feedback and the owners' server-side error memory."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.distributed import run_workers
from helpers.models import TinyNet, assert_replicas_identical, fit
from helpers.reduce import make_slots
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors import SignSGD, create
from lightning_gradcomp.compressors.base import ReduceContext
from lightning_gradcomp.functional.quantize import sign_quantize
from lightning_gradcomp.plan import LayerSlot
from lightning_gradcomp.presets import PRESETS

SLOTS = [LayerSlot("a", 0, (30, 20), True), LayerSlot("b", 600, (1000,), True)]


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"bucket_size": -1}, ValueError, "bucket_size"),
    ({"bucket_size": True}, TypeError, "bucket_size"),
    ({"aggregation": 1}, ValueError, "aggregation"),
])
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        SignSGD(**kwargs)


def test_codec_registry_and_preset() -> None:
    comp = SignSGD(bucket_size=128)
    assert comp.codec(None).bits == 1 and comp.uses_error_feedback
    assert isinstance(create("signsgd"), SignSGD)
    assert isinstance(PRESETS["signsgd"][1]()["compressor"], SignSGD)


def _reduce_steps(rank: int, world: int, aggregation: str, steps: int) -> dict[str, Any]:
    comm = Comm(None, CommStats())
    comp = SignSGD(bucket_size=64, aggregation=aggregation)
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(s.numel, generator=gen) for s in SLOTS]
    outs, residual_ok = [], True
    for step in range(steps):
        ctx = ReduceContext(comm, step, 0, SLOTS, [None, None])
        red = comp.reduce([x.clone() for x in xs], ctx)
        expected = [x - sign_quantize(x, 64).decode() for x in xs]
        residual_ok &= all(torch.allclose(r, e, atol=1e-6) for r, e in zip(red.residuals, expected))
        outs.append(torch.cat(red.averaged.wait()))
    buf = io.BytesIO()
    torch.save(comp.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    return {"outs": outs, "residual_ok": residual_ok, "state": state, "mean": torch.cat(xs)}


def test_residuals_are_p_minus_local_sign_and_server_memory_is_checkpointed() -> None:
    results = run_workers(_reduce_steps, 2, "alltoall", 3)
    assert all(r["residual_ok"] for r in results)
    for step in range(3):
        assert torch.equal(results[0]["outs"][step], results[1]["outs"][step])
    server = results[0]["state"]["server"]
    owned = sum(entry["value"].numel() for entry in server.values())
    assert 0 < owned < 1600  # rank 0 holds the memory of its chunk only
    assert any(entry["value"].abs().sum() > 0 for entry in server.values())

    comp = SignSGD()
    comp.load_state_dict(results[0]["state"])
    again = comp.state_dict()["server"]
    for key, entry in server.items():
        assert torch.equal(again[key]["value"], entry["value"]) and again[key]["start"] == entry["start"]
    comp.reset_state()
    assert comp.state_dict() == {"server": {}}


def _mixed_kernel_steps(rank: int, world: int, aggregation: str) -> dict[str, Any]:
    """Rank 1 runs without the compiled kernel (torch's scales), the others with it."""
    if rank == 1:
        from lightning_gradcomp.functional import _native

        _native.load = lambda: None  # type: ignore[assignment]  # this forked rank only
    return _reduce_steps(rank, world, aggregation, 3)


@pytest.mark.parametrize(("world", "aggregation"), [(2, "alltoall"), (3, "alltoall"), (3, "allgather")])
def test_ranks_with_and_without_the_kernel_agree(world: int, aggregation: str) -> None:
    """The kernel's bucket means round differently from torch's, but each is computed by the rank that sends it: the
    averaged result is the same bits on every rank."""
    results = run_workers(_mixed_kernel_steps, world, aggregation)
    for step in range(3):
        assert all(torch.equal(r["outs"][step], results[0]["outs"][step]) for r in results[1:])


def test_server_memory_makes_repeated_sign_averages_converge() -> None:
    """With constant inputs, server error feedback makes the running mean of outputs approach the true mean."""
    results = run_workers(_reduce_steps, 2, "alltoall", 60)
    # Worker memories are not fed back here (each step reuses the same x), so the target is the exact mean
    # of the first-stage messages; the server memory keeps the second stage's cumulative error bounded.
    messages = [torch.cat([sign_quantize(x, 64).decode() for x in r["mean"].split([600, 1000])]) for r in results]
    target = (messages[0] + messages[1]) / 2
    running = torch.stack(results[0]["outs"]).mean(0)
    assert (running - target).norm() < 0.1 * target.norm()


def test_allgather_keeps_no_server_memory() -> None:
    results = run_workers(_reduce_steps, 2, "allgather", 2)
    assert results[0]["state"] == {"server": {}}
    assert torch.equal(results[0]["outs"][1], results[1]["outs"][1])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_replicas_identical_in_lightning(tmp_path: Path, world: int) -> None:
    model = TinyNet(samples=16 * world, batch_size=4)
    records = fit(GradCompStrategy(compressor=SignSGD(bucket_size=128), start_method="fork"), tmp_path,
                  devices=world, model=model)
    assert_replicas_identical(records)
    assert records[0]["memory"]  # worker error-feedback memories exist


def _observed_and_not(rank: int, world: int, aggregation: str, sizes: list[int]) -> dict[str, Any]:
    """The same inputs reduced with ``observed`` on (the residual in a second pass) and off (written by the quantize
    pass), each with its own compressor (its own server memory), three steps."""
    comm = Comm(None, CommStats())
    slots = make_slots([(n,) for n in sizes])
    gen = torch.Generator().manual_seed(100 + rank)
    steps = [[torch.randn(n, generator=gen) * 10.0 ** (i % 3) for i, n in enumerate(sizes)] for _ in range(3)]
    out: dict[str, Any] = {}
    for observed in (True, False):
        comp = SignSGD(bucket_size=64, aggregation=aggregation)
        residuals, averaged = [], []
        for step, xs in enumerate(steps):
            ctx = ReduceContext(comm, step, 0, slots, [None] * len(slots), observed=observed)
            red = comp.reduce([x.clone() for x in xs], ctx)
            averaged.append(torch.cat(red.averaged.wait()))
            residuals.append(torch.cat(red.residuals))
        out[str(observed)] = (averaged, residuals, comp.state_dict())
    out["inputs"] = [torch.cat(xs) for xs in steps]
    out["messages"] = [torch.cat([sign_quantize(x, 64).decode() for x in xs]) for xs in steps]
    return out


@pytest.mark.parametrize("sizes", [[1], [63, 64, 65], [1000, 7, 4097]])
@pytest.mark.parametrize(("world", "aggregation"), [(2, "allgather"), (3, "alltoall"), (4, "alltoall"), (5, "alltoall")])
def test_residual_written_by_the_quantize_pass_gives_the_same_bits(
    world: int, aggregation: str, sizes: list[int]
) -> None:
    """Unobserved, the quantize pass writes ``p - c``; observed, a second pass does: the same residuals, averages and
    server memories, bit for bit, on every rank; and the residual is ``p - c`` (not ``p``)."""
    results = run_workers(_observed_and_not, world, aggregation, sizes)
    for r in results:
        (avg_a, res_a, state_a), (avg_b, res_b, state_b) = r["True"], r["False"]
        for a, b in zip(avg_a + res_a, avg_b + res_b):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        assert state_a.keys() == state_b.keys()
        for key in state_a["server"]:
            assert torch.equal(state_a["server"][key]["value"], state_b["server"][key]["value"])
        assert all(torch.equal(a, results[0]["True"][0][i]) for i, a in enumerate(avg_a))
        for res, x, c in zip(res_b, r["inputs"], r["messages"]):
            assert torch.equal(res, x - c)
