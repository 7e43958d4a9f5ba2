"""SwarmStrategy (lock-step mode) end to end on forked CPU ranks: pairs, bytes, consensus, odd W, evaluation, resume."""

from __future__ import annotations

import io
import itertools
import math
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gradcomp  # noqa: F401 - registers "swarmsgd"
from helpers.models import SparseEmbeddingNet, TinyNet, fit
from helpers.shards import damage_shard
from lightning_gradcomp import SwarmStrategy
from lightning_gradcomp.shard_files import read_shards, shard_dir


class SwarmProbe(pl.Callback):
    """Saves every rank's swarm figures and partners per round, plus eval-time and epoch-end parameters."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.eval_params: list[torch.Tensor] = []
        self.start_params = torch.empty(0)
        self.epoch_end_params: list[torch.Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_params = _flat(pl_module)

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.eval_params.append(_flat(pl_module))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch_end_params.append(_flat(pl_module))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        s = trainer.strategy
        numel = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        torch.save({"swarm": s.swarm_stats.state_dict(), "comm": s.comm_stats.state_dict(),
                    "rounds": s.round_index, "numel": numel, "message": s.message_bytes(numel),
                    "partners": [s.partners(r) for r in range(s.round_index)], "final": _flat(pl_module),
                    "log": [list(entry) for entry in s.pairing_log],
                    "eval": self.eval_params, "epoch_end": self.epoch_end_params, "start": self.start_params},
                   self.out / f"probe{trainer.global_rank}.pt")


class ValNet(TinyNet):
    """TinyNet with a validation loop over its training data."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.hparams.batch_size)


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def _run(tmp_path: Path, name: str, devices: int, strategy: Any, **kwargs: Any) -> tuple[list, list]:
    out = tmp_path / name
    out.mkdir(parents=True, exist_ok=True)
    kwargs.setdefault("callbacks", [])
    kwargs["callbacks"] = [SwarmProbe(out), *kwargs["callbacks"]]
    records = fit(strategy, out, devices=devices, **kwargs)
    probes = [torch.load(out / f"probe{r}.pt", weights_only=True) for r in range(devices)]
    return records, probes


def _consensus(records: list) -> list[float]:
    out = []
    for t in range(len(records[0]["params"])):
        xs = torch.stack([r["params"][t] for r in records])
        out.append(float((xs - xs.mean(0)).norm(dim=1).max()))
    return out


def test_registry_name_and_local_steps_without_gradient_allreduce(tmp_path: Path) -> None:
    records, probes = _run(tmp_path, "reg", 2, "swarmsgd_fork", max_epochs=1)
    # both ranks stepped on their own gradient: after the first batch the models differ (the first
    # average is applied one round later in non-blocking mode)
    assert not torch.equal(records[0]["params"][0], records[1]["params"][0])
    assert torch.equal(probes[0]["final"], probes[1]["final"])  # average_at_end
    # the registered default is the asynchronous mode: one coded message per exchange actually made, plus the fp32
    # resend of the blocks whose lattice decode could wrap (rare; the pairing, hence the models' distance, depends
    # on timing), at least 4 bytes per resent block
    for rank, p in enumerate(probes):
        swarm = p["swarm"]
        extra = p["comm"]["wire_bytes"] - swarm["exchanges"] * p["message"]
        detail = (rank, p["comm"]["wire_bytes"], swarm["exchanges"], p["message"], swarm["fallbacks"],
                  swarm["fallback_blocks"])
        assert (extra == 0) if swarm["fallbacks"] == 0 else (extra >= 4 * swarm["fallback_blocks"]), detail


def test_blocking_rounds_leave_pairs_identical_and_count_one_message_each(tmp_path: Path) -> None:
    strategy = SwarmStrategy(mode="lockstep", local_steps=1, non_blocking=False, start_method="fork",
                             average_at_end=False)
    records, probes = _run(tmp_path, "blocking", 4, strategy, max_epochs=3)
    partners = probes[0]["partners"]
    assert all(p["partners"] == partners for p in probes)  # every rank derived the same pairings
    assert len(partners) == len(records[0]["params"]) == 6
    for step, pairing in enumerate(partners):
        for i, j in enumerate(pairing):
            assert j >= 0 and torch.equal(records[i]["params"][step], records[j]["params"][step]), (step, i, j)
    not_all_equal = any(not torch.equal(records[0]["params"][t], records[min({1, 2, 3} - {pairing[0]})]["params"][t])
                        for t, pairing in enumerate(partners))
    assert not_all_equal  # pairs agree, but not everybody (this is gossip, not an all-reduce)
    for p in probes:
        swarm = p["swarm"]
        assert swarm["exchanges"] == swarm["rounds"] == 6 and swarm["sat_out"] == 0
        assert p["comm"]["wire_bytes"] == swarm["exchanges"] * p["message"] + swarm["fallbacks"] * 4 * p["numel"]


def test_bytes_per_rank_per_round_do_not_depend_on_world_size(tmp_path: Path) -> None:
    per_world = {}
    for world in (2, 4):
        strategy = SwarmStrategy(mode="lockstep", local_steps=1, lattice_margin=64.0, topology="ring",
                                 start_method="fork")
        _, probes = _run(tmp_path, f"w{world}", world, strategy, max_epochs=100, max_steps=6)
        for p in probes:
            assert p["swarm"]["fallbacks"] == 0 and p["swarm"]["exchanges"] == p["rounds"] == 6
        per_world[world] = [p["comm"]["wire_bytes"] / p["rounds"] for p in probes]
        assert per_world[world] == [probes[0]["message"]] * world
    assert per_world[2][0] == per_world[4][0]
    numel = probes[0]["numel"]
    assert per_world[4][0] == 8 * ((numel + 1023) // 1024) + numel  # 8-bit codes + side and checksum per block


def test_consensus_distance_stays_bounded(tmp_path: Path) -> None:
    model = TinyNet(samples=64, batch_size=8)
    gossip, probes = _run(tmp_path, "gossip", 4, SwarmStrategy(mode="lockstep", local_steps=2, start_method="fork",
                                                                monitor_every=1, average_at_end=False),
                          model=model, max_epochs=20)
    alone, _ = _run(tmp_path, "alone", 4, SwarmStrategy(mode="lockstep", local_steps=10**6, start_method="fork",
                                                         average_at_end=False), model=TinyNet(samples=64, batch_size=8),
                    max_epochs=20)
    c, a = _consensus(gossip), _consensus(alone)
    quarter = len(c) // 4
    assert max(c[-quarter:]) <= 1.25 * max(c[quarter:2 * quarter])  # not growing
    assert max(c[-quarter:]) <= 0.5 * max(a[-quarter:])  # and far below models that never talk
    monitored = probes[0]["swarm"]["consensus_history"]  # measured in-run after every round (every 2nd step)
    assert len(monitored) == len(c) // 2
    assert monitored == pytest.approx(c[1::2], rel=1e-4)


def test_odd_world_size_one_rank_sits_out_per_round(tmp_path: Path) -> None:
    strategy = SwarmStrategy(mode="lockstep", local_steps=1, start_method="fork")
    records, probes = _run(tmp_path, "odd", 3, strategy, model=TinyNet(samples=48, batch_size=8), max_epochs=3)
    rounds = probes[0]["rounds"]
    assert rounds == 6
    assert sum(p["swarm"]["sat_out"] for p in probes) == rounds
    for p in probes:
        assert p["swarm"]["exchanges"] + p["swarm"]["sat_out"] == rounds
    assert torch.equal(probes[0]["final"], probes[2]["final"])


@pytest.mark.parametrize("eval_model", ["mean", "rank0"])
def test_evaluation_uses_the_averaged_model_then_restores_local_ones(tmp_path: Path, eval_model: str) -> None:
    strategy = SwarmStrategy(mode="lockstep", local_steps=1, eval_model=eval_model, start_method="fork",
                             average_at_end=False)
    records, probes = _run(tmp_path, eval_model, 4, strategy, model=ValNet(samples=64, batch_size=8),
                           max_epochs=2, num_sanity_val_steps=0)
    for epoch in range(2):
        last = 2 * epoch + 1  # two batches per epoch
        local = torch.stack([r["params"][last] for r in records])
        expected = local.double().mean(0).float() if eval_model == "mean" else local[0]
        for rank, p in enumerate(probes):
            assert torch.allclose(p["eval"][epoch], expected, atol=1e-6, rtol=0)
            assert torch.equal(p["epoch_end"][epoch], records[rank]["params"][last])  # local model restored
    assert not torch.equal(records[0]["params"][-1], records[1]["params"][-1])


def test_resume_is_exact(tmp_path: Path) -> None:
    def strategy() -> SwarmStrategy:
        return SwarmStrategy(mode="lockstep", local_steps=2, geometric_local_steps=True, start_method="fork")

    def ckpt(dirpath: Path) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=dirpath, save_top_k=-1, every_n_epochs=1)

    model = lambda: TinyNet(samples=128, batch_size=8)  # noqa: E731 - 4 steps per epoch on 4 ranks
    straight, probes_a = _run(tmp_path, "straight", 4, strategy(), model=model(), max_epochs=2,
                              callbacks=[ckpt(tmp_path / "ck_a")], enable_checkpointing=True)
    _, _ = _run(tmp_path, "first", 4, strategy(), model=model(), max_epochs=1,
                callbacks=[ckpt(tmp_path / "ck_b")], enable_checkpointing=True)
    path = next((tmp_path / "ck_b").glob("epoch=0*.ckpt"))
    saved = torch.load(path, weights_only=True)
    per_rank = read_shards(path, key="swarm")  # each rank's state is in its own shard, not in rank 0's file
    assert "per_rank" not in saved["swarm"] and len(per_rank) == 4 and saved["swarm"]["world_size"] == 4
    assert any(entry["pending"] is not None for entry in per_rank)  # an exchange was in flight at the save
    name = next(iter(saved["state_dict"]))
    mean = torch.stack([entry["model"][name] for entry in per_rank]).double().mean(0).float()
    assert torch.allclose(saved["state_dict"][name], mean, atol=1e-6, rtol=0)

    resumed, probes_b = _run(tmp_path, "resumed", 4, strategy(), model=model(), max_epochs=2, ckpt_path=str(path),
                             callbacks=[ckpt(tmp_path / "ck_c")], enable_checkpointing=True)
    for rank in range(4):
        assert len(resumed[rank]["params"]) == 4
        for a, b in zip(straight[rank]["params"][4:], resumed[rank]["params"]):
            assert torch.equal(a, b)
        assert torch.equal(probes_a[rank]["final"], probes_b[rank]["final"])
        counts = ("rounds", "exchanges", "sat_out", "fallbacks")
        assert [probes_a[rank]["swarm"][k] for k in counts] == [probes_b[rank]["swarm"][k] for k in counts]
        assert probes_a[rank]["comm"]["wire_bytes"] == probes_b[rank]["comm"]["wire_bytes"]


def test_resume_on_another_world_size_starts_every_rank_from_the_mean_model(tmp_path: Path) -> None:
    model = lambda: TinyNet(samples=64, batch_size=8)  # noqa: E731
    _run(tmp_path, "w2", 2, SwarmStrategy(mode="lockstep", start_method="fork"), model=model(), max_epochs=1,
         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1)], enable_checkpointing=True)
    path = next((tmp_path / "ck").glob("*.ckpt"))
    saved = torch.load(path, weights_only=True)
    mean = torch.cat([v.reshape(-1) for v in saved["state_dict"].values()])
    rank0 = read_shards(path, key="swarm")[0]["model"]
    assert not torch.equal(mean, torch.cat([v.reshape(-1) for v in rank0.values()]))
    _, probes = _run(tmp_path, "w4", 4, SwarmStrategy(mode="lockstep", start_method="fork"), model=model(),
                     max_epochs=2, ckpt_path=str(path))
    for p in probes:
        assert torch.equal(p["start"], mean)
        assert p["rounds"] == saved["swarm"]["counters"]["round_index"] + 2  # counter kept (rank 0's)


# ---------------------------------------------------------------------------------------------- shards
def _lockstep(**kwargs: Any) -> SwarmStrategy:
    return SwarmStrategy(mode="lockstep", local_steps=2, start_method="fork", **kwargs)


def test_rank_zero_file_holds_the_manifest_and_each_rank_its_own_shard(tmp_path: Path) -> None:
    """Rank 0's file gets ``bits``, its counters and the manifest; every rank's model, optimizer and gossip state
    are in its own shard; a checkpoint that ModelCheckpoint replaces takes its shards along."""
    ckpt_dir = tmp_path / "ck"
    records, _ = _run(tmp_path, "run", 2, _lockstep(), max_epochs=2, enable_checkpointing=True,
                      callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=1, save_last=True)])
    last = ckpt_dir / "last.ckpt"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["epoch=1-step=8.ckpt", "epoch=1-step=8.ckpt.gradcomp",
                                                           "last.ckpt", "last.ckpt.gradcomp"]  # epoch 0's are gone
    entry = torch.load(last, weights_only=True)["swarm"]
    assert set(entry) == {"version", "compressor", "world_size", "dir", "replicated", "shards", "bits", "counters"}
    assert entry["version"] == 2 and entry["world_size"] == 2 and entry["compressor"] == "LatticeCodec"
    assert sorted(os.listdir(shard_dir(last))) == sorted(shard["file"] for shard in entry["shards"])
    buffer = io.BytesIO()
    torch.save(entry, buffer)
    assert buffer.tell() < 16 * 1024 < min(shard["bytes"] for shard in entry["shards"])  # no model in the file
    states = read_shards(last, key="swarm")
    for rank, state in enumerate(states):
        assert set(state) == {"async", "model", "optimizers", "counters", "gossip", "pending", "comm_stats"}
        assert torch.equal(torch.cat([v.reshape(-1) for v in state["model"].values()]), records[rank]["params"][-1])
    assert entry["counters"] == states[0]["counters"]
    assert not torch.equal(records[0]["params"][-1], records[1]["params"][-1])  # the shards differ


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-rank lock-step checkpoint after one epoch."""
    root = tmp_path_factory.mktemp("swarm_shards")
    fit(_lockstep(), root / "first", enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=root / "ck", save_last=True)])
    return root / "ck" / "last.ckpt"


@pytest.mark.parametrize("damage", ["missing", "one_byte"])
def test_a_damaged_shard_stops_the_resume_naming_it(two_rank_checkpoint: Path, tmp_path: Path, damage: str) -> None:
    ckpt = tmp_path / "copy" / "last.ckpt"
    shutil.copytree(two_rank_checkpoint.parent, ckpt.parent)
    message = damage_shard(ckpt, "swarm", "rank-state", damage)
    with pytest.raises(Exception, match=message):
        fit(_lockstep(timeout=timedelta(seconds=60)), tmp_path / "resumed", max_epochs=2, ckpt_path=str(ckpt))
    assert not (tmp_path / "resumed" / "rank0.pt").exists()  # nothing trained


def test_old_single_file_checkpoint_still_resumes_exactly(tmp_path: Path) -> None:
    """A version-1 checkpoint (every rank's state inline in rank 0's file, no shards) resumes exactly."""
    straight, probes_a = _run(tmp_path, "straight", 2, _lockstep(), max_epochs=2, enable_checkpointing=True,
                              callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_epochs=1)])
    path = next((tmp_path / "ck").glob("epoch=0*.ckpt"))
    saved = torch.load(path, weights_only=True)
    saved["swarm"] = {"version": 1, "world_size": 2, "bits": saved["swarm"]["bits"],
                      "per_rank": read_shards(path, key="swarm")}
    old = tmp_path / "old.ckpt"
    torch.save(saved, old)
    resumed, probes_b = _run(tmp_path, "resumed", 2, _lockstep(), max_epochs=2, ckpt_path=str(old))
    for rank in range(2):
        for a, b in zip(straight[rank]["params"][4:], resumed[rank]["params"], strict=True):
            assert torch.equal(a, b)
        assert torch.equal(probes_a[rank]["final"], probes_b[rank]["final"])
        assert probes_a[rank]["rounds"] == probes_b[rank]["rounds"]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"local_steps": 0}, ValueError, "local_steps"),
    ({"bits": 9}, ValueError, "bits"),
    ({"block_size": 0}, ValueError, "block_size"),
    ({"lattice_margin": 0.5}, ValueError, "lattice_margin"),
    ({"topology": "star"}, ValueError, "topology"),
    ({"topology": [(0, 0)]}, ValueError, "topology"),
    ({"topology": 3}, TypeError, "topology"),
    ({"torus_shape": (0, 2)}, ValueError, "torus_shape"),
    ({"torus_shape": (1, 2)}, ValueError, "torus_shape` applies to topology='torus' only"),  # was ignored
    ({"topology": "ring", "torus_shape": (1, 2)}, ValueError, "torus_shape"),
    ({"bits": None, "block_size": 0}, ValueError, "block_size"),  # fp32 exchanges: checked all the same
    ({"bits": None, "block_size": "1024"}, ValueError, "block_size"),
    ({"bits": None, "lattice_margin": 0.5}, ValueError, "lattice_margin"),
    ({"bits": None, "lattice_margin": float("nan")}, ValueError, "lattice_margin"),
    ({"bits": None, "lattice_margin": "x"}, ValueError, "lattice_margin"),
    ({"eval_model": "best"}, ValueError, "eval_model"),
    ({"non_blocking": "yes"}, TypeError, "non_blocking"),
    ({"monitor_every": -1}, ValueError, "monitor_every"),
])
def test_bad_arguments_are_rejected(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        SwarmStrategy(**kwargs)


class _PoisonRankOne(pl.Callback):
    """Writes ``value`` into one weight of rank 1's model after step 5 (a diverged model, not a gradient)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == 5 and trainer.global_rank == 1:
            with torch.no_grad():
                pl_module.body[2].weight.view(-1)[3] = self.value


class _HoldTogether(pl.Callback):
    """Every rank waits for the others at the end of every batch (a barrier on the default group).

    Async gossip pairs only ranks that are training at the same time. A run of a dozen tiny steps takes a few
    milliseconds, so on a loaded machine one rank can finish before the other starts, and no exchange happens at
    all. Held together, both ranks attempt within the same step, and two open offers always pair (the lock and
    priority protocol of :class:`~lightning_gradcomp.swarm.asynchronous.StoreMatchmaker`). The exchanges still run
    on the exchange thread and are applied at a later boundary with the progress made since."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        torch.distributed.barrier()


@pytest.mark.parametrize("mode, value", [("lockstep", float("nan")), ("async", float("inf"))])
def test_a_diverged_model_heals_from_its_partner_and_poisons_nobody(tmp_path: Path, mode: str, value: float) -> None:
    """Rank 1's model holds NaN/Inf from step 5 on: rank 0 stays finite at every step, and rank 1 is finite again
    from its next applied exchange on (it took rank 0's values there), in lock-step and asynchronous gossip.

    Lock-step: the round after the poison applies at step 6. Async: that exchange's step depends on timing, so it is
    read from rank 1's pairing log; the ranks are held together at every batch end (:class:`_HoldTogether`) so
    that they overlap in time and pair."""
    strategy = SwarmStrategy(local_steps=2, bits=8, mode=mode, start_method="fork")
    callbacks = [_PoisonRankOne(value), SwarmProbe(tmp_path), *([_HoldTogether()] if mode == "async" else [])]
    records = fit(strategy, tmp_path, max_epochs=3, callbacks=callbacks)
    probes = [torch.load(tmp_path / f"probe{r}.pt", weights_only=True) for r in range(2)]
    after = [(apply_step, drained) for *_, apply_step, drained in probes[1]["log"] if apply_step > 5]
    assert after or mode == "lockstep", [p["log"] for p in probes]  # rank 1 exchanged after the poison
    finite = [[bool(torch.isfinite(p).all()) for p in rec["params"]] for rec in records]
    assert all(finite[0]), finite[0]
    assert all(math.isfinite(loss) for loss in records[0]["losses"])
    assert [p["swarm"]["nonfinite_exchanges"] for p in probes] == [0, 1]  # the poison took, on rank 1 only
    assert bool(torch.isfinite(probes[1]["final"]).all())
    heal_step = 6
    if mode == "async":
        heal_step, drained = after[0]
        if drained:  # applied by the end-of-fit drain, after the last recorded step
            heal_step = len(finite[1]) + 1
    assert not any(finite[1][5 : heal_step - 1]), finite[1]  # poisoned until that exchange ...
    assert all(finite[1][heal_step - 1 :]), finite[1]  # ... and healed from it on


class _PoisonLastRankAtEnd(pl.Callback):
    """At ``on_train_end`` (before the strategy's averaging), writes NaN/Inf into two weights of the last rank's
    model (a rank that diverged after its last exchange), then saves a checkpoint on every rank."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == trainer.world_size - 1:
            with torch.no_grad():
                pl_module.body[2].weight.view(-1)[3] = float("nan")
                pl_module.head.bias[1] = -float("inf")
        trainer.save_checkpoint(self.out / "end.ckpt")


@pytest.mark.parametrize("world", [2, 3])
def test_a_model_diverged_at_the_end_does_not_poison_the_mean(tmp_path: Path, world: int) -> None:
    """The checkpoint's mean model and ``average_at_end`` take, where the last rank's model is NaN/Inf, the mean of
    the other ranks' values; elsewhere the mean of all; every rank ends with the same finite model."""
    strategy = SwarmStrategy(local_steps=2, mode="lockstep", non_blocking=False, start_method="fork")
    records, probes = _run(tmp_path, "end", world, strategy, max_epochs=2, callbacks=[_PoisonLastRankAtEnd(tmp_path)])
    last = torch.stack([rec["params"][-1].double() for rec in records])  # each rank's model before the poison
    sizes = {n: p.numel() for n, p in TinyNet().named_parameters()}
    names = list(sizes)
    offsets = dict(zip(names, itertools.accumulate([0, *sizes.values()])))
    poisoned = [offsets["body.2.weight"] + 3, offsets["head.bias"] + 1]
    want = last.mean(0)
    want[poisoned] = last[:-1, poisoned].mean(0)
    want = want.float()
    for p in probes:
        assert bool(torch.isfinite(p["final"]).all())
        assert torch.equal(p["final"], probes[0]["final"])
        assert torch.allclose(p["final"], want, rtol=1e-6, atol=1e-7)
    state = torch.load(tmp_path / "end.ckpt", weights_only=True)["state_dict"]
    saved = torch.cat([state[n].reshape(-1) for n in names])
    assert torch.equal(saved, probes[0]["final"])  # the same contained mean


def test_sparse_embedding_gradients_train_and_a_nan_in_them_is_zeroed(tmp_path: Path) -> None:
    """``nn.Embedding(sparse=True)``: the local-step guard reads and zeroes sparse gradients by their stored values."""
    strategy = SwarmStrategy(local_steps=2, bits=8, mode="lockstep", start_method="fork")
    records = fit(strategy, tmp_path, max_epochs=2, model=SparseEmbeddingNet(poison_step=3),
                  callbacks=[SwarmProbe(tmp_path)])
    assert all(bool(torch.isfinite(p).all()) for rec in records for p in rec["params"])
    probes = [torch.load(tmp_path / f"probe{r}.pt", weights_only=True) for r in range(2)]
    assert [p["swarm"]["nonfinite_steps"] for p in probes] == [0, 1]
