"""Replica identity of GradCompFSDPStrategy at every world size W = 2..5 and every shard size dividing it.

Layers of odd and prime widths (one of 2 rows, fewer than the shards at S = 3 and 5): FSDP2's dim-0 shards are
uneven, padded, some empty. After every step every rank's full parameters (``full_tensor()``) must be bit-identical,
and the bytes each rank sends across replicas must follow the formula and agree inside its replicate group (the ranks
holding the same shard; ranks of other shard indices hold other shard sizes, hence send other byte counts).

Two levels: the replica reduction the strategy assembles (:meth:`GradCompFSDPStrategy.make_reduction`) on FSDP2
without Lightning, all compressors in one process-group launch per layout; and ``Trainer.fit`` once per layout (the
strategy's mesh, replicate group and sampler at that world size).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fsdp.models import COMPRESSORS, ShardedNet, fit_sharded, plan_from_record, plan_record, tanh_mlp
from helpers.wire import hook_call_bytes
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_gradcomp import GradCompFSDPStrategy
from lightning_gradcomp.comm import Comm
from lightning_gradcomp.fsdp_reduction import replicate_group
from lightning_gradcomp.gloo_workers import run_workers
from lightning_gradcomp.localsgd.fsdp import LocalSGDFSDPStrategy

WIDTH, SIZES = 11, (13, 7, 2, 5)
"""Input width and layer widths: odd and prime; 2 rows leave some of 3 or 5 shards empty."""
STEPS, START = 4, 1  # the first step dense, the others compressed


MULTI_REPLICA = [(2, 1), (3, 1), (4, 1), (4, 2), (5, 1)]
"""``(W, S)`` with more than one replica: every shard size dividing W = 2..5 but W itself."""


def _model() -> nn.Sequential:
    return tanh_mlp(SIZES, WIDTH)


def _fit_each(rank: int, world: int, shard: int, names: list[str]) -> dict[str, Any]:
    """On one rank: for each compressor a fresh model, sharded per layer over the shard group, trained ``STEPS``
    steps with the strategy's replica reduction; the full parameters after every step, the bytes and the plans."""
    torch.use_deterministic_algorithms(True)
    mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    group = replicate_group(shard)
    results: dict[str, Any] = {}
    for name in names:
        model = _model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        strategy = GradCompFSDPStrategy(compressor=COMPRESSORS[name](), shard_size=shard, min_numel=8,
                                        start_step=START)
        reduction = strategy.make_reduction(Comm(group), {id(p): n for n, p in model.named_parameters()})
        assert reduction.install(model) == len(SIZES)
        reduction.attach_optimizer(optimizer)
        params = []
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
            x, y = torch.randn(6, WIDTH, generator=gen), torch.randn(6, SIZES[-1], generator=gen)
            ((model(x) - y) ** 2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            params.append(torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()]))
        results[name] = {"params": params, "stats": reduction.stats.state_dict(), "step": reduction.step,
                         "plans": [plan_record(p) for p in reduction.plans()]}
    return results


def _expected_wire_bytes(record: dict[str, Any], compressor: Any, replicas: int) -> float:
    total = 0.0
    for step in range(record["step"]):
        for plan in (plan_from_record(p) for p in record["plans"]):
            compressing = step >= START and not compressor.dense and bool(plan.compressed)
            params = [compressor.default_param] * len(plan.compressed)
            total += hook_call_bytes(compressor, plan, params, replicas, compressing)
    return total


@pytest.mark.parametrize(("world", "shard"), MULTI_REPLICA)
def test_every_compressor_keeps_every_rank_identical(world: int, shard: int) -> None:
    names = sorted(COMPRESSORS)
    records = run_workers(_fit_each, world, shard, names, timeout=120.0)
    replicas = world // shard
    for name in names:
        first = records[0][name]["params"]
        assert len(first) == STEPS and torch.isfinite(first[-1]).all(), name
        for rank in range(1, world):
            for step, (a, b) in enumerate(zip(first, records[rank][name]["params"])):
                assert torch.equal(a, b), f"W={world} S={shard} {name}: rank {rank} differs after step {step}"
        sent = [records[rank][name]["stats"]["wire_bytes"] for rank in range(world)]
        for rank in range(world):
            assert sent[rank] == sent[rank % shard], f"W={world} S={shard} {name}: rank {rank}'s replicate group"
            want = _expected_wire_bytes(records[rank][name], COMPRESSORS[name](), replicas)
            assert sent[rank] == pytest.approx(want), f"W={world} S={shard} {name}: rank {rank}"
            assert records[rank][name]["stats"]["compressed_steps"] == (0 if name == "none" else STEPS - START)


FITS = [(2, 1, "cltk"), (3, 1, "qsgd"), (4, 1, "signsgd"), (4, 2, "powersgd"), (5, 1, "diana"), (2, 2, "cltk"),
        (3, 3, "cltk"), (5, 5, "cltk")]
"""One ``Trainer.fit`` per layout, the compressors spread over the multi-replica ones."""


@pytest.mark.parametrize(("world", "shard", "name"), FITS)
def test_lightning_fit_at_every_world_size(tmp_path: Path, world: int, shard: int, name: str) -> None:
    strategy = GradCompFSDPStrategy(compressor=COMPRESSORS[name](), shard_size=shard, start_method="fork",
                                    min_numel=8, start_step=START)
    records = fit_sharded(strategy, tmp_path, devices=world, model=ShardedNet(sizes=SIZES), max_steps=STEPS)
    first = records[0]["params"]
    assert len(first) == STEPS and torch.isfinite(first[-1]).all()
    for rank, record in enumerate(records[1:], start=1):
        for step, (a, b) in enumerate(zip(first, record["params"])):
            assert torch.equal(a, b), f"W={world} S={shard} {name}: rank {rank} differs from rank 0 after step {step}"
    sent = [record["stats"]["wire_bytes"] for record in records]
    if shard == world:  # one replica: nothing crosses replicas
        assert all(record["step"] is None for record in records) and sent == [0] * world
        return
    for rank, record in enumerate(records):
        assert sent[rank] == sent[rank % shard]
        assert sent[rank] == pytest.approx(_expected_wire_bytes(record, COMPRESSORS[name](), world // shard))
        assert record["step"] == STEPS and record["stats"]["compressed_steps"] == STEPS - START


DILOCO = [(2, 1, "nesterov", "cltk"), (3, 1, "nesterov", "signsgd"), (5, 1, "average", "none")]
"""LocalSGDFSDPStrategy at W = 2, 3, 5 (W = 4 as 2 x 2 is tests/fsdp/test_localsgd_fsdp.py's)."""


@pytest.mark.parametrize(("world", "shard", "outer", "name"), DILOCO)
def test_diloco_replicas_meet_at_every_sync(tmp_path: Path, world: int, shard: int, outer: str, name: str) -> None:
    """The replicas differ between syncs and every rank holds the same full parameters after each outer step."""
    local_steps, steps = 2, 6
    strategy = LocalSGDFSDPStrategy(local_steps=local_steps, outer=outer, compressor=COMPRESSORS[name](),
                                    shard_size=shard, start_method="fork", min_numel=8)
    records = fit_sharded(strategy, tmp_path, devices=world, model=ShardedNet(sizes=SIZES), max_steps=steps)
    for step in range(steps):
        full = [record["params"][step] for record in records]
        synced = (step + 1) % local_steps == 0
        for rank in range(1, world):
            same = torch.equal(full[0], full[rank])
            assert same == (synced or rank // shard == 0), f"W={world} {name}: rank {rank} after step {step + 1}"
    assert torch.isfinite(records[0]["params"][-1]).all()
    sent = [record["stats"]["wire_bytes"] for record in records]
    assert sent[0] > 0 and all(sent[rank] == sent[rank % shard] for rank in range(world))
