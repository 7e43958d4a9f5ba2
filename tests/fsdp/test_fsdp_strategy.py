"""GradCompFSDPStrategy in Lightning fits: 4 forked CPU ranks as replicas x shards (gloo)."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from fsdp.models import COMPRESSORS as ALL
from fsdp.models import SIZES, Block, ShardedNet, fit_sharded, plan_from_record
from helpers.wire import hook_call_bytes
from lightning.pytorch.loggers import CSVLogger
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler

from lightning_gradcomp import GradCompFSDPStrategy
from lightning_gradcomp.callbacks import CompressionLogger, LowPassMemoryFilter
from lightning_gradcomp.callbacks.guard import CompressionWarning
from lightning_gradcomp.compressors import CLTK
from lightning_gradcomp.gloo_workers import run_workers
from lightning_gradcomp.schedule import WarmupSchedule, scheduled_param

STEPS = 20


def _native_hsdp(rank: int, world: int, shard: int, steps: int) -> torch.Tensor:
    """The same fit by hand, with FSDP2's own 2-D-mesh HSDP: flat full parameters after ``steps`` steps."""
    mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    model = ShardedNet(self_shard=False)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = model.configure_optimizers()
    per_epoch = len(model.x) // world // model.batch_size
    for step in range(steps):
        epoch, batch = divmod(step, per_epoch)
        sampler = DistributedSampler(range(len(model.x)), num_replicas=world, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)  # Lightning's train sampler: shuffled, seed 0, set_epoch every epoch
        index = list(sampler)[batch * model.batch_size : (batch + 1) * model.batch_size]
        loss = model.training_step((model.x[index], model.y[index]), step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("shard", [1, 2])
def test_no_compression_matches_native_hsdp(tmp_path: Path, shard: int) -> None:
    ours = fit_sharded(GradCompFSDPStrategy(shard_size=shard, start_method="fork"), tmp_path, max_steps=STEPS)
    native = run_workers(_native_hsdp, 4, shard, STEPS)
    for rank in range(4):
        got, want = ours[rank]["params"][-1], native[rank]
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-6


COMPRESSORS = {name: ALL[name] for name in ("cltk", "qsgd", "signsgd", "powersgd", "diana")}


def _expected_wire_bytes(record: dict[str, Any], compressor: Any, start_step: int, replicas: int) -> float:
    plans = [plan_from_record(p) for p in record["plans"]]
    total = 0.0
    for step in range(record["step"]):
        for plan in plans:
            compressing = step >= start_step and bool(plan.compressed)
            params = [compressor.default_param] * len(plan.compressed)
            total += hook_call_bytes(compressor, plan, params, replicas, compressing)
    return total


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@pytest.mark.parametrize("shard", [1, 2])
def test_every_rank_holds_the_same_parameters_and_the_bytes_match(tmp_path: Path, name: str, shard: int) -> None:
    strategy = GradCompFSDPStrategy(compressor=COMPRESSORS[name](), shard_size=shard, start_method="fork",
                                    min_numel=8, start_step=2)
    records = fit_sharded(strategy, tmp_path, max_steps=8)
    first = records[0]["params"]
    assert len(first) == 8
    for rank, record in enumerate(records[1:], start=1):
        for step, (a, b) in enumerate(zip(first, record["params"])):
            assert torch.equal(a, b), f"{name}: rank {rank} differs from rank 0 after step {step}"
    assert torch.isfinite(first[-1]).all()
    for record in records:
        stats = record["stats"]
        assert record["step"] == 8 and stats["compressed_steps"] == 6
        assert stats["wire_bytes"] == pytest.approx(_expected_wire_bytes(record, COMPRESSORS[name](), 2, 4 // shard))
        assert stats["wire_bytes"] < stats["dense_bytes"]
        assert (stats["intra_bytes"] > 0) == (shard > 1)


def test_a_density_warm_up_and_small_param(tmp_path: Path) -> None:
    """``schedule=`` moves the density of every compressed shard with the step, ``small_param=`` compresses the shards
    the size rule leaves dense (with the schedule applied relative to the target, as in GradCompStrategy); the
    replicas stay identical and each step's bytes follow the formula at that step's parameters."""
    comp, schedule, small, steps = CLTK(density=0.05), WarmupSchedule(steps=4, start=0.4, stages=2), 0.5, 6
    strategy = GradCompFSDPStrategy(compressor=comp, shard_size=2, start_method="fork", min_numel=8, start_step=0,
                                    schedule=schedule, small_param=small)
    records = fit_sharded(strategy, tmp_path, max_steps=steps)
    for record in records[1:]:
        assert all(torch.equal(a, b) for a, b in zip(records[0]["params"], record["params"]))
    plans = [plan_from_record(p) for p in records[0]["plans"]]
    assert any(slot.small for plan in plans for slot in plan.compressed)  # the 1-D shards, at small_param
    for record in records:
        total, constant = 0.0, 0.0
        for step in range(steps):
            scheduled = scheduled_param(comp, comp.default_param, schedule.value(step, comp.default_param))
            for plan in (plan_from_record(p) for p in record["plans"]):
                bases = [small if slot.small else comp.default_param for slot in plan.compressed]
                total += hook_call_bytes(comp, plan, [scheduled_param(comp, b, scheduled) for b in bases], 2, True)
                constant += hook_call_bytes(comp, plan, bases, 2, True)
        assert record["stats"]["wire_bytes"] == pytest.approx(total)
        assert total > constant  # the warm-up sent more than the target density would have


def test_shard_modules_and_bf16_parameters(tmp_path: Path) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    strategy = GradCompFSDPStrategy(compressor=CLTK(density=0.1), shard_size=2, start_method="fork", min_numel=8,
                                    shard_modules=(Block,), mp_policy=policy)
    records = fit_sharded(strategy, tmp_path, model=ShardedNet(self_shard=False), max_steps=6)
    for record in records[1:]:
        assert all(torch.equal(a, b) for a, b in zip(records[0]["params"], record["params"]))
    assert records[0]["stats"]["compressed_steps"] == 4


def test_a_module_that_shards_nothing_is_told_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="fully_shard|shard_modules"):
        fit_sharded(GradCompFSDPStrategy(shard_size=2, start_method="fork"), tmp_path,
                    model=ShardedNet(self_shard=False), max_steps=1)


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="shard_size"):
        GradCompFSDPStrategy(shard_size=0)
    with pytest.raises(TypeError, match="shard_modules"):
        GradCompFSDPStrategy(shard_modules=("Block",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start_method"):
        GradCompFSDPStrategy(start_method="thread")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="small_param"):
        GradCompFSDPStrategy(compressor=CLTK(density=0.01), small_param=2.0)
    with pytest.raises(ValueError, match="schedule"):
        GradCompFSDPStrategy(schedule={0: 0.5})  # NoCompression has no parameter to schedule


@pytest.mark.parametrize("name", ["gradcomp_fsdp", "scalecom_fsdp", "powersgd_fsdp", "qsgd_fsdp"])
def test_presets_build_the_strategy(name: str) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = StrategyRegistry.get(name + "_fork")
    assert isinstance(strategy, GradCompFSDPStrategy) and strategy._start_method == "fork"


def test_a_preset_on_one_node_is_one_replica(tmp_path: Path) -> None:
    """shard_size defaults to the processes of a node: on one machine the model is sharded over all of them, and
    nothing crosses nodes (no replica reduction)."""
    records = fit_sharded("scalecom_fsdp_fork", tmp_path, devices=2, max_steps=2)
    assert records[0]["step"] is None and torch.equal(records[0]["params"][-1], records[1]["params"][-1])


def test_a_compressor_that_needs_the_whole_world_refuses_naming_itself() -> None:
    class WholeWorld(CLTK):
        hierarchical = False

    with pytest.raises(ValueError, match="WholeWorld cannot run in GradCompFSDPStrategy"):
        GradCompFSDPStrategy(compressor=WholeWorld())


def test_the_documented_example_runs() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        import fsdp_hsdp
    finally:
        sys.path.pop(0)
    trainer = fsdp_hsdp.main("cltk", 2, max_epochs=1, start_method="fork")
    assert trainer.state.finished  # the parent of forked ranks does not train (its global_step stays 0)


class RootOnlyNet(ShardedNet):
    """One FSDP unit, the LightningModule itself: its hook fires inside FSDP2's end-of-backward callback."""

    def configure_model(self) -> None:
        fully_shard(self, mesh=self.device_mesh["shard"])


@pytest.mark.parametrize("case", ["root_only", "accumulate"])
def test_root_only_sharding_and_gradient_accumulation(tmp_path: Path, case: str) -> None:
    """Accumulation: FSDP2 reduce-scatters every micro-batch (no no_sync under ModelParallelStrategy), so each is
    reduced across replicas; the staged state chains and the counter counts optimizer steps."""
    model = RootOnlyNet() if case == "root_only" else ShardedNet()
    options = {"accumulate_grad_batches": 2} if case == "accumulate" else {}
    strategy = GradCompFSDPStrategy(compressor=CLTK(density=0.05), shard_size=2, start_method="fork", min_numel=8)
    records = fit_sharded(strategy, tmp_path, model=model, max_steps=6, **options)
    for record in records[1:]:
        assert all(torch.equal(a, b) for a, b in zip(records[0]["params"], record["params"]))
    assert [r["step"] for r in records] == [6] * 4 and records[0]["stats"]["compressed_steps"] == 4


class FrozenNet(ShardedNet):
    """The first block's weight frozen (FSDP2 leaves it out of the reduce-scatter, so of the plan) and a sharded block
    never used in forward (FSDP2 runs no post-backward for it on any rank: no hook call, no collective)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[0].linear.weight.requires_grad_(False)
        self.spare = Block(SIZES[-1], SIZES[-1])

    def configure_model(self) -> None:
        for module in (*self.blocks, self.spare):
            fully_shard(module, mesh=self.device_mesh["shard"])
        fully_shard(self, mesh=self.device_mesh["shard"])


def test_frozen_and_unused_parameters(tmp_path: Path) -> None:
    strategy = GradCompFSDPStrategy(compressor=CLTK(density=0.05), shard_size=2, start_method="fork", min_numel=8)
    records = fit_sharded(strategy, tmp_path, model=FrozenNet(), max_steps=4)
    for record in records[1:]:
        assert all(torch.equal(a, b) for a, b in zip(records[0]["params"], record["params"]))
    names = {slot[0] for plan in records[0]["plans"] for slot in plan["slots"]}
    assert "blocks.0.linear.weight" not in names and "blocks.0.linear.bias" in names
    assert not any(name.startswith("spare.") for name in names)


class _CallbackProbe(pl.Callback):
    """At the end of the fit: what the callbacks saw (the guard's message, the logger's ratio, the beta in force)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        logger = next(c for c in trainer.callbacks if isinstance(c, CompressionLogger))
        torch.save({"guard": logger.guard.message if logger.guard is not None else "no guard",
                    "ratio": float(logger.compressed_steps_compression()), "beta": trainer.strategy.beta,
                    "memory_beta": trainer.strategy.error_feedback.beta},
                   self.out / f"probe{trainer.global_rank}.pt")


def test_the_callbacks_work_with_it(tmp_path: Path) -> None:
    """CompressionLogger (with its guard) reads the replica reduction as it reads the DDP hook, and
    LowPassMemoryFilter sets the memory's beta through the strategy."""
    strategy = GradCompFSDPStrategy(compressor=CLTK(density=0.05), shard_size=2, start_method="fork", min_numel=8)
    callbacks = [CompressionLogger(log_every_n_steps=1, error_every_n_steps=2, prog_bar=False,
                                   summary=False), LowPassMemoryFilter(beta=1.0, schedule={3: 0.5}),
                 _CallbackProbe(tmp_path)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompressionWarning)
        fit_sharded(strategy, tmp_path, max_steps=6, callbacks=callbacks,
                    logger=CSVLogger(tmp_path, name="log", version=0), log_every_n_steps=1)
    with open(tmp_path / "log" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    intra = [float(r["gradcomp/intra_bytes"]) for r in rows if r.get("gradcomp/intra_bytes")]
    wire = [float(r["gradcomp/wire_bytes"]) for r in rows if r.get("gradcomp/wire_bytes")]
    assert len(intra) == len(wire) == 6 and all(x > 0 for x in intra)  # the shard group's bytes, beside the wire
    for rank in range(4):
        probe = torch.load(tmp_path / f"probe{rank}.pt", weights_only=True)
        assert probe["guard"] is None, probe["guard"]
        assert probe["ratio"] > 5.0
        assert probe["beta"] == probe["memory_beta"] == 0.5
