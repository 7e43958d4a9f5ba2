"""LocalSGDFSDPStrategy (DiLoCo on FSDP2 replicas) in Lightning fits: 4 forked CPU ranks as 2 replicas x 2 shards."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from fsdp.models import FullRecorder, ShardedNet, fit_sharded, plan_from_record, plan_record
from helpers.wire import compressor_bytes
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gradcomp import GradCompFSDPStrategy
from lightning_gradcomp.comm import all_reduce_bytes
from lightning_gradcomp.compressors import CLTK, DIANA, NoCompression, SignSGD
from lightning_gradcomp.localsgd.fsdp import LocalSGDFSDPStrategy

REPLICAS, SHARDS = 2, 2


class EngineRecorder(FullRecorder):
    """FullRecorder (every rank's full parameters after every batch), with the engine's figures at the end."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        engine = strategy.hook
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({"params": self.params, "stats": strategy.comm_stats.state_dict(), "syncs": engine.step,
                    "memory": engine.memory.state_dict(), "plans": [plan_record(p) for p in engine.plans()],
                    "theta": engine.theta},
                   self.out / f"rank{trainer.global_rank}.pt")


def _fit(strategy: Any, out: Path, *, max_steps: int = -1, ckpt_path: Optional[str] = None,
         callbacks: Optional[list] = None, **trainer_kwargs: Any) -> list[dict[str, Any]]:
    out = Path(out)
    options: dict[str, Any] = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                               "enable_model_summary": False, **trainer_kwargs}
    trainer = pl.Trainer(accelerator="cpu", devices=REPLICAS * SHARDS, strategy=strategy, max_steps=max_steps,
                         callbacks=[EngineRecorder(out), *(callbacks or [])], default_root_dir=str(out), **options)
    trainer.fit(ShardedNet(), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(REPLICAS * SHARDS)]


def _diloco(**kwargs: Any) -> LocalSGDFSDPStrategy:
    options: dict[str, Any] = {"shard_size": SHARDS, "start_method": "fork", "min_numel": 8, **kwargs}
    return LocalSGDFSDPStrategy(**options)


@pytest.mark.parametrize(("outer", "compressor"), [("nesterov", CLTK(density=0.1)), ("average", None),
                                                    ("nesterov", SignSGD(group_size=16))])
def test_full_parameters_identical_on_every_rank_after_each_outer_step(tmp_path: Path, outer: str,
                                                                       compressor: Any) -> None:
    """Between syncs the two replicas drift apart (no cross-replica reduction on inner steps), the two shards of one
    replica hold one model; after every outer step all four ranks hold the same full parameters."""
    local_steps, steps = 4, 12
    records = _fit(_diloco(local_steps=local_steps, outer=outer, compressor=compressor), tmp_path, max_steps=steps)
    for step in range(steps):
        full = [record["params"][step] for record in records]
        assert torch.equal(full[0], full[1]) and torch.equal(full[2], full[3]), f"a replica split at step {step}"
        synced = (step + 1) % local_steps == 0
        assert torch.equal(full[0], full[2]) == synced, f"step {step + 1}: identical={not synced}"
    assert records[0]["syncs"] == steps // local_steps
    assert torch.isfinite(records[0]["params"][-1]).all()


def _per_sync_bytes(record: dict[str, Any], compressor: Any) -> float:
    total = 0.0
    for plan in (plan_from_record(p) for p in record["plans"]):
        dense = sum(s.numel for s in plan.dense)
        total += all_reduce_bytes(4 * dense, REPLICAS) if dense else 0.0
        if plan.compressed:
            params = [compressor.default_param] * len(plan.compressed)
            total += compressor_bytes(compressor, plan.compressed, params, REPLICAS)
    return total


def test_cross_replica_bytes_follow_the_formula_and_are_100x_below_per_step_hsdp(tmp_path: Path) -> None:
    """DiLoCo with H = 20 and 1-bit pseudo-gradients against per-step HSDP (GradCompFSDPStrategy with NoCompression)
    over the same 40 steps: the same FSDP2 traffic inside the shard groups, >= 100x fewer bytes across replicas."""
    steps = 40
    comp = SignSGD(group_size=16)
    ours = _fit(_diloco(local_steps=20, compressor=comp, min_numel=1, compress_1d=True), tmp_path / "diloco",
                max_steps=steps)
    hsdp = fit_sharded(GradCompFSDPStrategy(NoCompression(), shard_size=SHARDS, start_method="fork"),
                       tmp_path / "hsdp", max_steps=steps)
    for rank, (mine, theirs) in enumerate(zip(ours, hsdp)):
        stats, reference = mine["stats"], theirs["stats"]
        assert mine["syncs"] == 2 and stats["steps"] == steps
        assert stats["wire_bytes"] == pytest.approx(2 * _per_sync_bytes(mine, comp), rel=1e-12)
        assert stats["intra_bytes"] == reference["intra_bytes"] > 0
        assert stats["dense_bytes"] <= reference["wire_bytes"]  # HSDP also all-reduces FSDP2's shard padding
        ratio = reference["wire_bytes"] / stats["wire_bytes"]
        assert ratio >= 100, f"rank {rank}: only {ratio:.1f}x fewer cross-replica bytes than per-step HSDP"


def test_dense_diloco_sends_one_shard_all_reduce_per_sync(tmp_path: Path) -> None:
    records = _fit(_diloco(local_steps=3), tmp_path, max_steps=6)
    for record in records:
        numel = sum(s.numel for p in record["plans"] for s in plan_from_record(p).slots)
        assert record["stats"]["wire_bytes"] == 2 * all_reduce_bytes(4 * numel, REPLICAS)
        assert record["stats"]["dense_bytes"] == 6 * all_reduce_bytes(4 * numel, REPLICAS)


def _checkpointing(out: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=out, save_top_k=-1, every_n_epochs=1)


def test_resume_mid_cycle_is_exact(tmp_path: Path) -> None:
    """Six steps an epoch, a sync every 5: the checkpoint after epoch 2 (step 12) falls two steps after a sync."""
    def strategy() -> LocalSGDFSDPStrategy:
        return _diloco(local_steps=5, compressor=CLTK(density=0.1))

    straight = _fit(strategy(), tmp_path / "straight", max_epochs=4, callbacks=[_checkpointing(tmp_path / "ck")],
                    enable_checkpointing=True)
    path = next((tmp_path / "ck").glob("epoch=1*.ckpt"))
    resumed = _fit(strategy(), tmp_path / "resumed", max_epochs=4, ckpt_path=str(path))
    for rank, (rec, ref) in enumerate(zip(resumed, straight)):
        assert len(rec["params"]) == 12 and len(ref["params"]) == 24
        for step, (a, b) in enumerate(zip(rec["params"], ref["params"][12:])):
            assert torch.equal(a, b), f"rank {rank} differs after resumed step {step + 13}"
        assert rec["syncs"] == ref["syncs"] == 4
        assert rec["memory"].keys() == ref["memory"].keys() and rec["memory"]
        assert all(torch.equal(rec["memory"][k], ref["memory"][k]) for k in rec["memory"])
        assert all(torch.equal(rec["theta"][k], ref["theta"][k]) for k in rec["theta"])
        assert rec["stats"]["wire_bytes"] == ref["stats"]["wire_bytes"]
    with pytest.raises(Exception, match="local_steps"):
        _fit(_diloco(local_steps=4, compressor=CLTK(density=0.1)), tmp_path / "other", max_epochs=4,
             ckpt_path=str(path))


class WholeWorld(CLTK):
    hierarchical = False


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"overlap": 1}, "`overlap` must be 0 in LocalSGDFSDPStrategy"),
    ({"save_distributed_checkpoint": False}, "`save_distributed_checkpoint` must be True"),
    ({"compressor": DIANA()}, "`compressor` DIANA cannot reduce pseudo-gradients"),
    ({"compressor": WholeWorld()}, "WholeWorld cannot run in LocalSGDFSDPStrategy"),
    ({"local_steps": 6, "fragments": 4}, "`fragments` must divide `local_steps`"),
    ({"outer": "adam"}, "`outer` must be one of"),
    ({"shard_size": 0}, "shard_size"),
])
def test_unsupported_options_are_refused_naming_the_argument(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LocalSGDFSDPStrategy(**kwargs)


def test_sync_batchnorm_is_refused(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="sync_batchnorm"):
        _fit(_diloco(), tmp_path, max_steps=1, sync_batchnorm=True)


@pytest.mark.parametrize("name", ["diloco_fsdp", "diloco_cltk_fsdp"])
def test_presets_build_the_strategy(name: str) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = StrategyRegistry.get(name + "_fork")
    assert isinstance(strategy, LocalSGDFSDPStrategy) and strategy._start_method == "fork"
    assert strategy.outer == "nesterov" and strategy.local_steps == 20


class EvalRecorder(pl.Callback):
    """Every rank's full parameters at the start of each validation (a collective)."""

    def __init__(self, out: Path) -> None:
        self.out, self.evals = Path(out), []

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in pl_module.parameters()]
        self.evals.append(torch.cat([t.detach().float().reshape(-1).clone() for t in full]))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(self.evals, self.out / f"evals{trainer.global_rank}.pt")


class ValShardedNet(ShardedNet):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x).float(), y), sync_dist=True)

    def val_dataloader(self) -> Any:
        return self.train_dataloader()


def test_validation_runs_on_the_global_model(tmp_path: Path) -> None:
    """Validation after step 3 (mid-cycle, H = 4): every rank evaluates the same global model, then trains on from its
    own local shards."""
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=_diloco(local_steps=4), max_steps=8,
                         val_check_interval=3, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[EngineRecorder(tmp_path), EvalRecorder(tmp_path)])
    trainer.fit(ValShardedNet())
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    evals = [torch.load(tmp_path / f"evals{r}.pt", weights_only=True) for r in range(4)]
    assert len(evals[0]) >= 1
    assert all(torch.equal(evals[0][0], e[0]) for e in evals[1:])  # one global model, on every rank
    assert not torch.equal(records[0]["params"][2], records[2]["params"][2])  # the local models had drifted
    assert not torch.equal(evals[0][0], records[0]["params"][2])
    assert torch.equal(records[0]["params"][3], records[2]["params"][3])  # the sync at step 4 still joins them


def test_shard_modules_with_bf16_parameters(tmp_path: Path) -> None:
    from fsdp.models import Block
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    strategy = _diloco(local_steps=3, compressor=CLTK(density=0.1), shard_modules=(Block,), mp_policy=policy)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=6, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), callbacks=[EngineRecorder(tmp_path)])
    trainer.fit(ShardedNet(self_shard=False))
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    for step in (2, 5):
        assert all(torch.equal(records[0]["params"][step], r["params"][step]) for r in records[1:])
    assert records[0]["syncs"] == 2


def test_the_documented_example_runs() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        import fsdp_diloco
    finally:
        sys.path.pop(0)
    trainer = fsdp_diloco.main("cltk", 4, max_epochs=1, start_method="fork")
    assert trainer.state.finished


class NativeHSDPNet(ShardedNet):
    """Sharded on the whole 2-D mesh: FSDP2's own HSDP, which would all-reduce across replicas every step."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for block in self.blocks:
            fully_shard(block, mesh=self.device_mesh)
        fully_shard(self, mesh=self.device_mesh)


def test_a_module_on_the_2d_mesh_is_refused(tmp_path: Path) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=_diloco(), max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    with pytest.raises(Exception, match="2-D mesh"):
        trainer.fit(NativeHSDPNet())


def test_one_replica_sends_nothing_across(tmp_path: Path) -> None:
    """A preset on one machine: shard_size is the node's processes, so the model is one replica sharded over both;
    the outer step still runs (on dense pseudo-gradients), and no byte crosses replicas."""
    records = fit_sharded("diloco_cltk_fsdp_fork", tmp_path, devices=2, max_steps=4)
    assert torch.equal(records[0]["params"][-1], records[1]["params"][-1])
    assert records[0]["stats"]["wire_bytes"] == 0 and records[0]["stats"]["intra_bytes"] > 0


def test_streaming_fragments_on_shards(tmp_path: Path) -> None:
    """fragments=2, H = 4: one fragment every 2 steps; the ranks holding the same shard index agree on theta."""
    records = _fit(_diloco(local_steps=4, fragments=2, compressor=CLTK(density=0.1)), tmp_path, max_steps=12)
    assert [r["syncs"] for r in records] == [6] * 4
    for a, b in ((0, 2), (1, 3)):  # the replicate groups
        assert records[a]["theta"].keys() == records[b]["theta"].keys()
        assert all(torch.equal(records[a]["theta"][k], records[b]["theta"][k]) for k in records[a]["theta"])
    assert records[0]["theta"]["blocks.0.linear.weight"].shape == (7, 11)  # theta is a shard: rows 0-6 of 13
    assert records[1]["theta"]["blocks.0.linear.weight"].shape == (6, 11)
    for step in range(12):
        assert not torch.equal(records[0]["params"][step], records[2]["params"][step])  # never all synced at once
