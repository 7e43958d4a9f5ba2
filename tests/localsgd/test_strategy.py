"""LocalSGDStrategy end to end on forked CPU ranks: replicas, DDP equivalence, bytes, evaluation, resume, errors."""

from __future__ import annotations

import io
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gradcomp  # noqa: F401 - registers "localsgd", "diloco", "diloco_cltk"
from helpers.models import SparseEmbeddingNet, TinyNet, fit
from helpers.shards import damage_shard
from lightning_gradcomp import LocalSGDStrategy
from lightning_gradcomp.callbacks import CompressionLogger
from lightning_gradcomp.shard_files import read_shards, shard_dir
from lightning_gradcomp.comm import all_reduce_bytes, broadcast_bytes
from lightning_gradcomp.compressors import CLTK, DIANA, NoCompression, PowerSGD, QSGD, SignSGD
from lightning_gradcomp.functional.sparsify import kept_count
from lightning_gradcomp.localsgd import split_fragments

NUMEL = {"body.0.weight": 2048, "body.0.bias": 64, "body.2.weight": 4096, "body.2.bias": 64, "head.weight": 256,
         "head.bias": 4}  # TinyNet's parameters; the two body matrices are compressed (min_numel 1024)


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


class Probe(pl.Callback):
    """Saves the final parameters, stats, engine counters and, at each validation, the evaluated model."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.evals: list[dict[str, torch.Tensor]] = []

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        s = trainer.strategy
        if s.hook is None:
            return
        theta = torch.cat([s.hook.theta[n].reshape(-1) for n, _ in pl_module.named_parameters()])
        backup = s._eval_backup
        local = torch.cat([backup[n].reshape(-1) for n, _ in pl_module.named_parameters()])
        self.evals.append({"evaluated": _flat(pl_module), "theta": theta, "local": local})

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        s = trainer.strategy
        torch.save({"final": _flat(pl_module), "comm": s.comm_stats.state_dict(), "syncs": s.hook.step,
                    "cursor": s.hook.cursor, "memory": s.hook.memory.state_dict(), "evals": self.evals,
                    "fragments": [[slot.name for slot in plan.slots] for plan in s.hook.plans()]},
                   self.out / f"probe{trainer.global_rank}.pt")


def _run(tmp_path: Path, name: str, strategy: Any, devices: int = 2, **kwargs: Any) -> tuple[list, list]:
    out = tmp_path / name
    out.mkdir(parents=True, exist_ok=True)
    kwargs["callbacks"] = [Probe(out), *kwargs.get("callbacks", [])]
    records = fit(strategy, out, devices=devices, **kwargs)
    probes = [torch.load(out / f"probe{r}.pt", weights_only=True) for r in range(devices)]
    return records, probes


class PlainSGDNet(TinyNet):
    """TinyNet with SGD without momentum: local steps are then linear in the gradient."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class ValNet(TinyNet):
    """TinyNet with a validation loop over its training data."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.hparams.batch_size)


class ScheduledNet(TinyNet):
    """TinyNet with AdamW and a per-step LR schedule."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# ---------------------------------------------------------------------------------------------- replicas
@pytest.mark.parametrize("devices, compressor, outer", [
    (2, NoCompression(), "nesterov"),
    (3, CLTK(ratio=0.1), "nesterov"),
    (3, QSGD(bits=4, bucket_size=128), "average"),
    (3, SignSGD(bucket_size=128), "nesterov"),  # the >= 500x setting of docs/localsgd.md (server memory too)
])
def test_replicas_identical_right_after_every_sync(tmp_path: Path, devices: int, compressor: Any, outer: str):
    steps = 8
    records, probes = _run(tmp_path, "run", LocalSGDStrategy(local_steps=2, outer=outer, compressor=compressor,
                                                             start_method="fork"),
                           devices=devices, max_steps=steps, max_epochs=-1)
    for t in range(steps):
        same = all(torch.equal(records[0]["params"][t], r["params"][t]) for r in records[1:])
        assert same == (t % 2 == 1), f"after batch {t}: identical={same}"  # syncs after steps 2, 4, ...
    for p in probes[1:]:
        assert torch.equal(p["final"], probes[0]["final"])
    assert probes[0]["syncs"] == steps // 2


def test_streaming_fragments_sync_one_fragment_at_a_time(tmp_path: Path):
    model = TinyNet()
    names = [n for n, _ in model.named_parameters()]
    records, probes = _run(tmp_path, "run", LocalSGDStrategy(local_steps=4, fragments=2, compressor=CLTK(0.1),
                                                             start_method="fork"), max_steps=8, max_epochs=-1)
    fragments = probes[0]["fragments"]
    assert len(fragments) == 2 and sorted(sum(fragments, [])) == sorted(names)
    offsets, o = {}, 0
    for n, p in model.named_parameters():
        offsets[n] = slice(o, o + p.numel())
        o += p.numel()
    for t in range(8):
        synced = fragments[(t // 2) % 2] if t % 2 == 1 else []
        for n in names:
            a, b = records[0]["params"][t][offsets[n]], records[1]["params"][t][offsets[n]]
            assert torch.equal(a, b) == (n in synced), (t, n)
    assert probes[0]["syncs"] == 5 and probes[0]["cursor"] == 0  # 4 streamed syncs + the final one
    assert torch.equal(probes[0]["final"], probes[1]["final"])  # the final sync of the pending fragments


# ---------------------------------------------------------------------------------------------- DDP invariant
def test_h1_average_dense_matches_ddp(tmp_path: Path):
    """H = 1, averaging, dense, SGD without momentum: x <- mean_i(x - lr g_i) = x - lr mean_i g_i, i.e. DDP.

    Equal in exact arithmetic only: DDP rounds ``mean(g)`` then the update, we round each rank's update, then
    the pseudo-gradient ``theta - x_i``, its mean and ``theta - mean``; so a float32-rounding tolerance.
    """
    ddp = fit("ddp_fork", tmp_path / "ddp", model=PlainSGDNet(), max_epochs=2)
    local = fit(LocalSGDStrategy(local_steps=1, outer="average", start_method="fork"), tmp_path / "local",
                model=PlainSGDNet(), max_epochs=2)
    assert len(ddp[0]["params"]) == len(local[0]["params"]) == 8
    for a, b in zip(ddp[0]["params"], local[0]["params"]):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), float((a - b).abs().max())
    assert not torch.allclose(ddp[0]["params"][-1], _flat(PlainSGDNet()), rtol=0, atol=1e-3)  # it did train


# ---------------------------------------------------------------------------------------------- bytes
def test_bytes_follow_the_formulas(tmp_path: Path):
    n = sum(NUMEL.values())
    _, dense = _run(tmp_path, "dense", LocalSGDStrategy(local_steps=4, compressor=None, start_method="fork"),
                    max_steps=8, max_epochs=-1)
    stats = dense[0]["comm"]
    assert stats["steps"] == 8
    assert stats["dense_bytes"] == 8 * all_reduce_bytes(4 * n, 2)
    assert stats["wire_bytes"] == 2 * all_reduce_bytes(4 * n, 2)  # ratio = H exactly

    _, sparse = _run(tmp_path, "cltk", LocalSGDStrategy(local_steps=4, compressor=CLTK(ratio=0.01),
                                                        start_method="fork"), max_steps=8, max_epochs=-1)
    k = kept_count(2048, 0.01) + kept_count(4096, 0.01)
    small = n - 2048 - 4096
    per_sync = all_reduce_bytes(4 * small, 2) + broadcast_bytes(4 * k, 2) + all_reduce_bytes(4 * k, 2)
    assert sparse[0]["comm"]["wire_bytes"] == pytest.approx(2 * per_sync, rel=1e-12)
    assert sparse[0]["comm"]["dense_bytes"] == stats["dense_bytes"]
    assert sparse[0]["memory"]  # error feedback on the pseudo-gradients


# ---------------------------------------------------------------------------------------------- evaluation
def test_validation_uses_the_global_model(tmp_path: Path):
    records, probes = _run(tmp_path, "val", LocalSGDStrategy(local_steps=4, start_method="fork"), model=ValNet(),
                           max_epochs=2, val_check_interval=3, num_sanity_val_steps=0)
    evals = [p["evals"] for p in probes]
    assert len(evals[0]) >= 2
    for i, e in enumerate(evals[0]):
        assert torch.equal(e["evaluated"], e["theta"])  # the global model is what is evaluated ...
        assert torch.equal(e["evaluated"], evals[1][i]["evaluated"])  # ... identical on every rank
    assert not torch.equal(evals[0][0]["local"], evals[0][0]["theta"])  # step 3: mid-cycle, local had drifted
    assert torch.equal(evals[0][0]["local"], records[0]["params"][2])  # and is restored afterwards
    assert torch.equal(records[0]["params"][3], records[1]["params"][3])  # training went on from it (sync at 4)


# ---------------------------------------------------------------------------------------------- resume
def test_resume_mid_fragment_cycle_is_exact(tmp_path: Path):
    def strategy() -> LocalSGDStrategy:  # a fragment every 2 steps; the epoch ends after 4: mid-cycle
        return LocalSGDStrategy(local_steps=6, fragments=3, compressor=CLTK(ratio=0.1), start_method="fork")

    def ckpt(d: Path) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=d, save_top_k=-1, every_n_epochs=1)

    straight, pa = _run(tmp_path, "a", strategy(), max_epochs=3, callbacks=[ckpt(tmp_path / "ck_a")],
                        enable_checkpointing=True)
    path = next((tmp_path / "ck_a").glob("epoch=0*.ckpt"))
    saved = torch.load(path, weights_only=True)["localsgd"]
    assert saved["shared"]["cursor"] == 2 and saved["world_size"] == 2
    assert "per_rank" not in saved and len(saved["shards"]) == 2  # the local states are in the shards
    per_rank = read_shards(path, key="localsgd")
    assert not torch.equal(*(torch.cat([v.reshape(-1) for v in e["model"].values()]) for e in per_rank))
    resumed, pb = _run(tmp_path, "b", strategy(), max_epochs=3, ckpt_path=str(path),
                       callbacks=[ckpt(tmp_path / "ck_b")], enable_checkpointing=True)
    for rank in range(2):
        assert len(resumed[rank]["params"]) == 8
        for a, b in zip(straight[rank]["params"][4:], resumed[rank]["params"]):
            assert torch.equal(a, b)
        assert torch.equal(pa[rank]["final"], pb[rank]["final"])
        assert pa[rank]["comm"]["wire_bytes"] == pb[rank]["comm"]["wire_bytes"]
        assert pa[rank]["syncs"] == pb[rank]["syncs"]
        for name, m in pa[rank]["memory"].items():
            assert torch.equal(m, pb[rank]["memory"][name])


def test_overlap_applies_each_exchange_tau_steps_later_and_replicas_agree(tmp_path: Path):
    # H = 2, tau = 1: exchanges issued after steps 2, 4, 6, 8 and applied after steps 3, 5, 7 (and at the end)
    steps = 8
    records, probes = _run(tmp_path, "run", LocalSGDStrategy(local_steps=2, overlap=1, compressor=CLTK(ratio=0.1),
                                                             start_method="fork"),
                           max_steps=steps, max_epochs=-1)
    for t in range(steps):
        same = torch.equal(records[0]["params"][t], records[1]["params"][t])
        assert same == (t in (2, 4, 6)), f"after batch {t}: identical={same}"
    assert torch.equal(probes[0]["final"], probes[1]["final"])
    assert probes[0]["syncs"] == 4  # the last one applied by on_train_end; nothing left for a final sync
    assert any(torch.count_nonzero(m) for m in probes[0]["memory"].values())  # error feedback ran (in the thread)


def test_resume_with_an_exchange_in_flight_is_exact(tmp_path: Path):
    def strategy() -> LocalSGDStrategy:  # fragment exchanges issued after steps 2, 4, ..., applied a step later
        return LocalSGDStrategy(local_steps=6, fragments=3, overlap=1, compressor=CLTK(ratio=0.1),
                                start_method="fork")

    def ckpt(d: Path) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=d, save_top_k=-1, every_n_epochs=1)

    straight, pa = _run(tmp_path, "a", strategy(), max_epochs=2, callbacks=[ckpt(tmp_path / "ck_a")],
                        enable_checkpointing=True)
    path = next((tmp_path / "ck_a").glob("epoch=0*.ckpt"))
    saved = torch.load(path, weights_only=True)["localsgd"]
    pending = saved["shared"]["pending"]  # the epoch ends after step 4: that exchange was drained, not applied
    assert pending is not None and pending["apply_at"] == 5 and pending["indices"] == [1]
    resumed, pb = _run(tmp_path, "b", strategy(), max_epochs=2, ckpt_path=str(path))
    for rank in range(2):
        for a, b in zip(straight[rank]["params"][4:], resumed[rank]["params"], strict=True):
            assert torch.equal(a, b)
        assert torch.equal(pa[rank]["final"], pb[rank]["final"])
        assert pa[rank]["comm"]["wire_bytes"] == pb[rank]["comm"]["wire_bytes"]
        for name, m in pa[rank]["memory"].items():
            assert torch.equal(m, pb[rank]["memory"][name])
    with pytest.raises(Exception, match="overlap"):  # resuming with another overlap is refused
        _run(tmp_path, "c", LocalSGDStrategy(local_steps=6, fragments=3, compressor=CLTK(ratio=0.1),
                                             start_method="fork"), max_epochs=2, ckpt_path=str(path))


def test_resume_on_another_world_size_resets_per_rank_state(tmp_path: Path):
    _run(tmp_path, "w2", LocalSGDStrategy(local_steps=3, compressor=CLTK(0.1), start_method="fork"), max_epochs=1,
         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1)], enable_checkpointing=True)
    path = next((tmp_path / "ck").glob("*.ckpt"))
    saved = torch.load(path, weights_only=True)
    theta = torch.cat([v.reshape(-1) for v in saved["localsgd"]["shared"]["theta"].values()])
    assert torch.equal(theta, torch.cat([v.reshape(-1) for v in saved["state_dict"].values()]))
    _, probes = _run(tmp_path, "w3", LocalSGDStrategy(local_steps=3, compressor=CLTK(0.1), start_method="fork"),
                     devices=3, max_epochs=2, ckpt_path=str(path))  # warns (in the ranks) and resets EF memories
    # counters kept: steps 5-7 (3 per rank at W=3) sync at step 6, plus the final sync of step 7
    assert probes[0]["syncs"] == saved["localsgd"]["shared"]["step"] + 2
    assert torch.equal(probes[0]["final"], probes[2]["final"])


# ---------------------------------------------------------------------------------------------- shards
_MANIFEST_KEYS = {"version", "compressor", "world_size", "dir", "replicated", "shards"}


def test_rank_zero_file_holds_the_manifest_and_each_rank_its_own_shard(tmp_path: Path):
    """At W = 3 rank 0's file gets the settings, the shared state and the manifest; every rank's local state is in
    its own shard; a checkpoint that ModelCheckpoint replaces takes its shards along."""
    ckpt_dir = tmp_path / "ck"
    records, _ = _run(tmp_path, "run", LocalSGDStrategy(local_steps=4, compressor=CLTK(ratio=0.1), start_method="fork"),
                      devices=3, max_epochs=2, enable_checkpointing=True,  # 3 steps per epoch: the last is mid-cycle
                      callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=1, save_last=True)])
    last = ckpt_dir / "last.ckpt"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["epoch=1-step=6.ckpt", "epoch=1-step=6.ckpt.gradcomp",
                                                           "last.ckpt", "last.ckpt.gradcomp"]  # epoch 0's are gone
    entry = torch.load(last, weights_only=True)["localsgd"]
    assert set(entry) == _MANIFEST_KEYS | {"outer", "local_steps", "fragments", "overlap", "shared"}
    assert entry["version"] == 2 and entry["world_size"] == 3 and entry["replicated"] == {}
    assert sorted(os.listdir(shard_dir(last))) == sorted(shard["file"] for shard in entry["shards"])
    buffer = io.BytesIO()
    torch.save({k: v for k, v in entry.items() if k != "shared"}, buffer)  # all but the replicated state
    assert buffer.tell() < 16 * 1024 < min(shard["bytes"] for shard in entry["shards"])
    for rank, state in enumerate(read_shards(last, key="localsgd")):
        assert set(state) == {"model", "optimizers", "memory", "compressor", "stats", "pending_nonfinite"}
        assert torch.equal(torch.cat([v.reshape(-1) for v in state["model"].values()]), records[rank]["params"][-1])
    assert not torch.equal(records[0]["params"][-1], records[1]["params"][-1])  # the shards differ


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-rank checkpoint after one epoch (4 steps, local_steps=3: mid-cycle)."""
    root = tmp_path_factory.mktemp("localsgd_shards")
    fit(LocalSGDStrategy(local_steps=3, compressor=CLTK(ratio=0.1), start_method="fork"), root / "first",
        enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=root / "ck", save_last=True)])
    return root / "ck" / "last.ckpt"


@pytest.mark.parametrize("damage", ["missing", "one_byte"])
def test_a_damaged_shard_stops_the_resume_naming_it(two_rank_checkpoint: Path, tmp_path: Path, damage: str):
    ckpt = tmp_path / "copy" / "last.ckpt"
    shutil.copytree(two_rank_checkpoint.parent, ckpt.parent)
    message = damage_shard(ckpt, "localsgd", "local-state", damage)
    with pytest.raises(Exception, match=message):
        fit(LocalSGDStrategy(local_steps=3, compressor=CLTK(ratio=0.1), start_method="fork",
                             timeout=timedelta(seconds=60)), tmp_path / "resumed", max_epochs=2, ckpt_path=str(ckpt))
    assert not (tmp_path / "resumed" / "rank0.pt").exists()  # nothing trained


def test_old_single_file_checkpoint_still_resumes_exactly(tmp_path: Path):
    """A version-1 checkpoint (every rank's local state inline in rank 0's file, no shards) resumes exactly."""
    def strategy() -> LocalSGDStrategy:
        return LocalSGDStrategy(local_steps=3, compressor=CLTK(ratio=0.1), start_method="fork")

    straight, pa = _run(tmp_path, "a", strategy(), max_epochs=2, enable_checkpointing=True,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck_a", save_top_k=-1, every_n_epochs=1)])
    path = next((tmp_path / "ck_a").glob("epoch=0*.ckpt"))
    saved = torch.load(path, weights_only=True)
    entry = saved["localsgd"]
    saved["localsgd"] = {**{k: entry[k] for k in ("world_size", "compressor", "outer", "local_steps", "fragments",
                                                   "overlap", "shared")},
                         "version": 1, "per_rank": read_shards(path, key="localsgd")}
    old = tmp_path / "old.ckpt"
    torch.save(saved, old)
    resumed, pb = _run(tmp_path, "b", strategy(), max_epochs=2, ckpt_path=str(old))
    for rank in range(2):
        for a, b in zip(straight[rank]["params"][4:], resumed[rank]["params"], strict=True):
            assert torch.equal(a, b)
        assert torch.equal(pa[rank]["final"], pb[rank]["final"])
        for name, m in pa[rank]["memory"].items():
            assert torch.equal(m, pb[rank]["memory"][name])


# ---------------------------------------------------------------------------------------------- Lightning features
def test_accumulation_clipping_bf16_scheduler_and_logger(tmp_path: Path):
    strategy = LocalSGDStrategy(local_steps=2, compressor=PowerSGD(rank=2), start_method="fork")
    logger = CSVLogger(tmp_path, name="csv")
    _, probes = _run(tmp_path, "run", strategy, model=ScheduledNet(), max_epochs=2, accumulate_grad_batches=2,
                     gradient_clip_val=0.5, precision="bf16-mixed", logger=logger, log_every_n_steps=1,
                     callbacks=[CompressionLogger(log_every_n_steps=1, error_every_n_steps=1)])
    assert probes[0]["comm"]["steps"] == 4  # 8 micro-batches, 2 per optimizer step
    assert probes[0]["syncs"] == 2
    assert torch.equal(probes[0]["final"], probes[1]["final"])
    text = next(tmp_path.glob("csv/*/metrics.csv")).read_text()
    for name in ("gradcomp/compression_whole_run", "gradcomp/wire_bytes", "gradcomp/error"):
        assert name in text


def test_registry_names():
    trainer = pl.Trainer(strategy="diloco_cltk_fork", accelerator="cpu", devices=2, logger=False)
    s = trainer.strategy
    assert isinstance(s, LocalSGDStrategy) and s.outer == "nesterov" and isinstance(s.compressor, CLTK)
    s = pl.Trainer(strategy="localsgd_spawn", accelerator="cpu", devices=2, logger=False).strategy
    assert isinstance(s, LocalSGDStrategy) and s.outer == "average"
    assert isinstance(pl.Trainer(strategy="diloco", accelerator="cpu", devices=2, logger=False).strategy,
                      LocalSGDStrategy)


# ---------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("kwargs, error, match", [
    ({"local_steps": 0}, ValueError, "local_steps"),
    ({"local_steps": 2.5}, TypeError, "local_steps"),
    ({"fragments": 0}, ValueError, "fragments"),
    ({"local_steps": 6, "fragments": 4}, ValueError, "fragments.*divide"),
    ({"outer_lr": 0.0}, ValueError, "outer_lr"),
    ({"outer_momentum": 1.0}, ValueError, r"outer_momentum.*\[0, 1\)"),
    ({"outer_momentum": -0.1}, ValueError, "outer_momentum"),
    ({"outer": "adam"}, ValueError, "outer"),
    ({"compressor": DIANA()}, ValueError, "DIANA"),
    ({"compressor": "nope"}, ValueError, "compressor"),
    ({"min_numel": 0}, ValueError, "min_numel"),
    ({"beta": 0.0}, ValueError, "beta"),
    ({"sync_at_end": 1}, TypeError, "sync_at_end"),
    ({"overlap": -1}, ValueError, "overlap"),
    ({"local_steps": 6, "fragments": 3, "overlap": 3}, ValueError, "overlap.*at most"),
])
def test_bad_arguments_are_rejected(kwargs: dict, error: type, match: str):
    with pytest.raises(error, match=match):
        LocalSGDStrategy(**kwargs)


def test_more_fragments_than_tensors_is_rejected():
    assert split_fragments([3, 1, 2], 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="fragments.*at most.*3"):
        split_fragments([3, 1, 2], 4)


def test_sparse_embedding_gradients_train_and_a_nan_in_them_is_zeroed(tmp_path: Path) -> None:
    """``nn.Embedding(sparse=True)``: the inner-step guard reads and zeroes sparse gradients by their stored values."""
    strategy = LocalSGDStrategy(local_steps=2, start_method="fork")
    records = fit(strategy, tmp_path, max_epochs=2, model=SparseEmbeddingNet(poison_step=3))
    for rank, rec in enumerate(records):
        assert all(bool(torch.isfinite(p).all()) for p in rec["params"]), rank
        assert rec["stats"]["nonfinite_steps"] == rank  # rank 1's poisoned step only
    assert torch.equal(records[0]["params"][-1], records[1]["params"][-1])  # the last step is a sync
