"""The FSDP2 front-end of the pipeline, without Lightning: 4 gloo processes as replicas x shards, one fully_shard per
layer on the shard group, the replica reduction by :class:`FSDPReplicaReduction`."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp.models import COMPRESSORS as ALL
from fsdp.models import tanh_mlp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lightning_gradcomp.comm import Comm, all_reduce_bytes
from lightning_gradcomp.compressors import (
    CLTK,
    NoCompression,
)
from lightning_gradcomp.fsdp_reduction import FSDPReplicaReduction, ShardLayout, replicate_group, shard_plan
from lightning_gradcomp.gloo_workers import run_workers
from lightning_gradcomp.plan import SlotPolicy

SIZES = (7, 13, 5)  # odd and prime: uneven dim-0 shards, padding, an empty shard at S = 4 is not reached here


def _model(sizes: tuple[int, ...] = SIZES, width: int = 11) -> nn.Module:
    return tanh_mlp(sizes, width)


def _sharded(world: int, shard: int, native: bool, mp: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``_model()`` with each Linear and the root ``fully_shard``-ed over the (replicate, shard) mesh (native HSDP) or
    its shard dimension (ours), optionally with a bf16 / fp32-reduce policy; and its SGD."""
    torch.use_deterministic_algorithms(True)
    mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    model = _model()
    kwargs: dict[str, Any] = {"mesh": mesh if native else mesh["shard"]}
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _batch(rank: int, step: int, width: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, width, generator=gen), torch.randn(8, SIZES[-1], generator=gen)


def _train(
    rank: int, world: int, shard: int, make: Any, steps: int, native: bool, mp: bool, check_every: int,
    poison: tuple[int, int] = (-1, -1), nonfinite: str = "dense",
) -> dict[str, Any]:
    model, optimizer = _sharded(world, shard, native, mp)
    engine = None
    if not native:
        names = {id(p): n for n, p in model.named_parameters()}
        comm = Comm(replicate_group(shard))
        engine = FSDPReplicaReduction(
            make(), comm, names, start_step=1, policy=SlotPolicy(min_numel=8), nonfinite=nonfinite
        )
        assert engine.install(model) == len(SIZES)
        engine.attach_optimizer(optimizer)
    snapshots = []
    for step in range(steps):
        x, y = _batch(rank, step)
        if (rank, step) == poison:
            x[0, 0] = float("nan")
        loss = ((model(x).float() - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % check_every == 0:
            snapshots.append({n: p.full_tensor().clone() for n, p in model.named_parameters()})
    out: dict[str, Any] = {"snapshots": snapshots}
    if engine is not None:
        out["stats"] = engine.stats.state_dict()
        out["plans"] = engine.plans()
        out["steps"] = engine.step
    return out


def test_shard_plan_skips_the_padding_and_judges_the_shard() -> None:
    layout = [ShardLayout("w", (4, 5), 20), ShardLayout("b", (0,), 4), ShardLayout("v", (3, 3), 12)]
    plan = shard_plan(2, layout, SlotPolicy(min_numel=10))
    assert [(s.offset, s.numel, s.compressed) for s in plan.slots] == [(0, 20, True), (20, 0, False), (24, 9, False)]
    assert plan.numel == 36 and plan.index == 2


@pytest.mark.parametrize("shard", [1, 2])
def test_no_compression_matches_native_hsdp(shard: int) -> None:
    ours = run_workers(_train, 4, shard, NoCompression, 20, False, False, 20)
    native = run_workers(_train, 4, shard, NoCompression, 20, True, False, 20)
    for a, b in zip(ours, native):
        for name, value in a["snapshots"][-1].items():
            reference = b["snapshots"][-1][name]
            rel = ((value - reference).abs().max() / reference.abs().max()).item()
            assert rel <= 1e-6, (name, rel)


COMPRESSORS = {name: ALL[name] for name in ALL if name != "none"}


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@pytest.mark.parametrize("shard", [1, 2])
def test_compressed_replicas_stay_identical(name: str, shard: int) -> None:
    results = run_workers(_train, 4, shard, COMPRESSORS[name], 8, False, False, 2)
    for snapshots in zip(*(r["snapshots"] for r in results)):
        for tensors in snapshots[1:]:
            for key, value in tensors.items():
                assert torch.equal(value, snapshots[0][key]), (name, shard, key)
    first = results[0]["snapshots"][-1]
    assert all(torch.isfinite(v).all() for v in first.values())
    assert results[0]["steps"] == 8
    for r in results:  # compressed from step 1: fewer bytes than the dense all-reduce across replicas
        assert 0 < r["stats"]["wire_bytes"] < r["stats"]["dense_bytes"], name


def test_bytes_across_replicas_match_the_formula() -> None:
    """NoCompression: each module's reduce-scatter output all-reduced over R = 2 replicas at every step."""
    results = run_workers(_train, 4, 2, NoCompression, 3, False, False, 3)
    for r in results:
        numel = sum(plan.numel for plan in r["plans"])
        assert r["stats"]["wire_bytes"] == pytest.approx(3 * all_reduce_bytes(numel * 4, 2))
        assert r["stats"]["dense_bytes"] == pytest.approx(r["stats"]["wire_bytes"])
        # the shard group (S = 2): per module and step one reduce-scatter of (S - 1) x its output, and two all-gathers
        # of (S - 1) x its padded shards (forward, and backward after resharding), all fp32
        assert r["stats"]["intra_bytes"] == pytest.approx(3 * 3 * 4 * numel)


def test_bf16_parameters_with_fp32_reduction() -> None:
    results = run_workers(_train, 4, 2, lambda: CLTK(density=0.1), 4, False, True, 2)
    for snapshots in zip(*(r["snapshots"] for r in results)):
        for tensors in snapshots[1:]:
            for key, value in tensors.items():
                assert torch.equal(value, snapshots[0][key]), key


def test_a_native_hsdp_module_is_refused() -> None:
    def refuse(rank: int, world: int) -> str:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = _model()
        fully_shard(model, mesh=mesh)
        engine = FSDPReplicaReduction(NoCompression(), Comm(replicate_group(2)), {})
        with pytest.raises(ValueError, match="2-D mesh") as info:
            engine.install(model)
        dist.barrier()
        return str(info.value)

    assert "fully_shard(mesh=device_mesh['shard'])" in run_workers(refuse, 4)[0]


def test_a_nonfinite_gradient_on_one_rank_is_zeroed_on_every_rank() -> None:
    """Rank 1's batch holds a NaN at step 3: its shard group's reduce-scatter spreads it, the replicas' flag tells the
    others; with nonfinite="zero" every rank drops that step's gradient alike and no memory takes the NaN."""
    results = run_workers(_train, 4, 2, lambda: CLTK(density=0.05), 6, False, False, 1, (1, 3), "zero")
    for snapshots in zip(*(r["snapshots"] for r in results)):
        for tensors in snapshots[1:]:
            for key, value in tensors.items():
                assert torch.equal(value, snapshots[0][key]), key
    assert all(torch.isfinite(v).all() for v in results[0]["snapshots"][-1].values())
    assert all(r["stats"]["nonfinite_steps"] > 0 for r in results)


def _train_delayed(rank: int, world: int, native: bool, mode: str, steps: int = 3) -> dict[str, Any]:
    """2 replicas x 2 shards, NoCompression with every replica reduction held back 20 ms on the communication thread:
    the order in which each hook call returned and its reduction finished, and the final parameters. ``mode``:
    ``fp32``, ``mp`` (bf16 parameters, fp32 reduction), ``no_sync`` (a ``set_requires_gradient_sync(False)``
    micro-batch, then a synced one) or ``accumulate`` (two synced micro-batches onto the same ``.grad``)."""
    import threading
    import time

    model, optimizer = _sharded(world, 2, native, mode == "mp")
    events: list[str] = []
    lock = threading.Lock()
    if not native:
        names = {id(p): n for n, p in model.named_parameters()}
        engine = FSDPReplicaReduction(NoCompression(), Comm(replicate_group(2)), names, start_step=1)
        engine.install(model)
        engine.attach_optimizer(optimizer)
        pipeline, hook = engine.reduction.reduce, engine.reduce

        def slow(*args: Any) -> Any:
            on_training_thread = threading.current_thread() is threading.main_thread()
            time.sleep(0.02)
            fut = pipeline(*args)
            fut.wait()
            with lock:
                events.append("training thread" if on_training_thread else "done")
            return fut

        def returned(*args: Any, **kwargs: Any) -> None:
            hook(*args, **kwargs)
            with lock:
                events.append("returned")

        engine.reduction.reduce, engine.reduce = slow, returned  # type: ignore[method-assign]
    for step in range(steps):
        micro = [_batch(rank, 2 * step)] + ([] if mode in ("fp32", "mp") else [_batch(rank, 2 * step + 1)])
        for index, (x, y) in enumerate(micro):
            if mode == "no_sync":
                model.set_requires_gradient_sync(index == len(micro) - 1)
            ((model(x).float() - y) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"events": events, "params": {n: p.full_tensor().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize(
    ("mode", "overlaps"), [("fp32", True), ("mp", True), ("no_sync", True), ("accumulate", False)]
)
def test_the_hook_returns_before_the_replica_reduction_where_fsdp2_views_the_buffer(mode: str, overlaps: bool) -> None:
    """The measured table of fsdp_reduction's docstring: where the sharded ``.grad`` views the hook's buffer, the hook
    returns first and the reduction finishes on the communication thread; where FSDP2 reads the buffer at once (a
    second synced micro-batch adds it to ``.grad``), the hook waits. Either way the result is native HSDP's."""
    ours = run_workers(_train_delayed, 4, False, mode)
    native = run_workers(_train_delayed, 4, True, mode)
    for rank, (a, b) in enumerate(zip(ours, native)):
        for name, value in a["params"].items():
            reference = b["params"][name]
            rel = ((value - reference).abs().max() / reference.abs().max()).item()
            assert rel <= 1e-6, (mode, rank, name, rel)
        events = a["events"]
        assert "training thread" not in events, events
        calls = events.count("returned")
        assert calls == events.count("done") == 3 * len(SIZES) * (2 if mode == "accumulate" else 1)
        if overlaps:  # the first reduction sleeps 20 ms: a hook that returns at once comes first
            assert events[0] == "returned", events
        else:  # the first micro-batch of a step overlaps, the second waits in the hook
            assert events[-2:] == ["done", "returned"], events
