"""Asynchronous SwarmSGD: consistent pairings, bytes, replay, straggler, dead partner, BatchNorm, checkpoints."""

from __future__ import annotations

import multiprocessing
import os
import queue
import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn

from helpers.distributed import free_port
from helpers.models import TinyNet, fit
from lightning_gradcomp import SwarmStrategy
from lightning_gradcomp.shard_files import read_shards
from lightning_gradcomp.comm import Comm
from lightning_gradcomp.swarm.asynchronous import AsyncGossip, StoreMatchmaker, exchange_group
from lightning_gradcomp.swarm.exchange import LatticeCodec, PairwiseGossip
from lightning_gradcomp.swarm.strategy import _check_replay_ranks


class Probe(pl.Callback):
    """Per rank: step clock, pairing log, figures, final parameters and buffers; optional sleep per step."""

    def __init__(self, out: Path, sleep: float = 0.0, straggler: int = -1, slowdown: float = 3.0,
                 jitter: float = 0.0) -> None:
        self.out, self.sleep, self.straggler, self.slowdown, self.jitter = Path(out), sleep, straggler, slowdown, jitter
        self.times: list[float] = []
        self.start = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.monotonic()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        delay = self.sleep * (self.slowdown if trainer.global_rank == self.straggler else 1.0)
        if self.jitter:
            delay += random.Random(len(self.times) * 31 + trainer.global_rank).random() * self.jitter
        if delay:
            time.sleep(delay)
        self.times.append(time.monotonic())

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        s = trainer.strategy
        numel = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        buffers = sum(b.numel() for b in pl_module.buffers() if b.is_floating_point())
        torch.save({"log": s.pairing_log, "swarm": s.swarm_stats.state_dict(), "comm": s.comm_stats.state_dict(),
                    "message": s.message_bytes(numel + buffers), "times": self.times, "start": self.start,
                    "final": torch.cat([t.detach().reshape(-1).clone() for t in pl_module.state_dict().values()
                                        if t.is_floating_point()])},
                   self.out / f"probe{trainer.global_rank}.pt")


def _run(tmp_path: Path, name: str, devices: int, strategy: Any, probe: dict | None = None,
         **kwargs: Any) -> tuple[list, list]:
    out = tmp_path / name
    out.mkdir(parents=True, exist_ok=True)
    callbacks = [Probe(out, **(probe or {})), *kwargs.pop("callbacks", [])]
    records = fit(strategy, out, devices=devices, callbacks=callbacks, **kwargs)
    return records, [torch.load(out / f"probe{r}.pt", weights_only=True) for r in range(devices)]


def _check_logs_consistent(probes: list) -> None:
    """Every logged exchange appears on both ends with the same ticket and swapped steps."""
    by_ticket: dict[int, list] = {}
    for rank, p in enumerate(probes):
        for pub, partner, partner_pub, ticket, applied, _ in p["log"]:
            assert applied >= pub and partner != rank
            by_ticket.setdefault(ticket, []).append((rank, partner, pub, partner_pub))
    for ticket, ends in by_ticket.items():
        assert len(ends) == 2, (ticket, ends)
        (a, pa, sa, qa), (b, pb, sb, qb) = ends
        assert (pa, pb, qa, qb) == (b, a, sb, sa), (ticket, ends)


def test_async_exchanges_pair_consistently_and_send_one_message_each(tmp_path: Path) -> None:
    strategy = SwarmStrategy(local_steps=1, start_method="fork", lattice_margin=16.0)
    assert strategy.mode == "async"
    _, probes = _run(tmp_path, "basic", 4, strategy, {"sleep": 0.005}, model=TinyNet(samples=128, batch_size=8),
                     max_epochs=4)
    _check_logs_consistent(probes)
    # pairing is opportunistic: under heavy load a rank may find no partner in its 16 steps, but some pair did
    assert sum(p["swarm"]["exchanges"] for p in probes) >= 2
    for p in probes:
        swarm = p["swarm"]
        assert swarm["exchanges"] == len(p["log"])
        assert swarm["fallbacks"] == 0
        assert p["comm"]["wire_bytes"] == swarm["exchanges"] * p["message"]  # one coded message per exchange
        steps = [entry[0] for entry in p["log"]]
        assert steps == sorted(steps)
    assert all(torch.equal(p["final"], probes[0]["final"]) for p in probes)  # average_at_end


def test_replay_of_the_pairing_log_repeats_an_async_run_bit_for_bit(tmp_path: Path) -> None:
    def strategy(replay: Any = None) -> SwarmStrategy:
        return SwarmStrategy(local_steps=2, geometric_local_steps=True, rounding="dithered", start_method="fork",
                             average_at_end=False, replay=replay, seed=3)

    model = lambda: TinyNet(samples=192, batch_size=8)  # noqa: E731 - 6 steps per epoch per rank
    first, probes = _run(tmp_path, "async", 4, strategy(), {"jitter": 0.01}, model=model(), max_epochs=4)
    logs = [p["log"] for p in probes]
    assert sum(map(len, logs)) >= 8
    again, replayed = _run(tmp_path, "replay", 4, strategy(replay=logs), model=model(), max_epochs=4)
    for rank in range(4):
        assert replayed[rank]["log"] == logs[rank]
        assert len(first[rank]["params"]) == len(again[rank]["params"]) == 24
        for step, (a, b) in enumerate(zip(first[rank]["params"], again[rank]["params"])):
            assert torch.equal(a, b), (rank, step)


@pytest.mark.parametrize("mode", ["async", "lockstep"])
def test_a_straggler_slows_only_itself_in_async_mode(tmp_path: Path, mode: str) -> None:
    """W=4, rank 3 sleeps 3x as long per step (sleep-dominated steps, so two cores suffice)."""
    steps = 20
    strategy = SwarmStrategy(local_steps=1, mode=mode, start_method="fork")
    _, probes = _run(tmp_path, mode, 4, strategy, {"sleep": 0.06, "straggler": 3},
                     model=TinyNet(samples=64, batch_size=8), max_epochs=-1, max_steps=steps)
    t0 = max(p["start"] for p in probes)
    horizon = min(probes[r]["times"][-1] for r in range(3))  # when the first fast rank finished
    done = [sum(t <= horizon for t in p["times"]) for p in probes]
    if mode == "async":
        assert min(done[:3]) >= 2 * done[3], done  # fast ranks >= 2x the straggler's steps in the same time
        assert probes[3]["swarm"]["exchanges"] > 0
    else:
        assert max(done[:3]) <= 1.5 * done[3] + 1, done  # lock-step: everybody at the straggler's pace
    assert horizon > t0


def _dead_partner_worker(rank: int, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = exchange_group(3.0)
    store = dist.PrefixStore("test/", dist.distributed_c10d._get_default_store())
    matchmaker = StoreMatchmaker(store, rank, [1 - rank])
    matchmaker.reset()
    dist.barrier(group=group)
    if rank == 1:  # claim one of rank 0's offers, then die without exchanging
        # rank 0 renews its offer at every step, so a claim can lose the race to a renewal: retry
        while matchmaker.claim(step=1) is None:
            time.sleep(0.001)
        os._exit(0)
    engine = PairwiseGossip(Comm(group), 1000, LatticeCodec())
    engine.anchor = torch.zeros(1000)
    gossip = AsyncGossip(engine, matchmaker, local_steps=1, geometric=False, seed=0, timeout=3.0)
    start = time.monotonic()
    try:
        for step in range(1, 2000):
            gossip.boundary(step, lambda: torch.zeros(1000))
            time.sleep(0.005)
        results.put(("no error", time.monotonic() - start))
    except RuntimeError as exc:
        results.put((str(exc), time.monotonic() - start))
    results.close()
    results.join_thread()  # flush the queue before the hard exit
    os._exit(0)


def test_fast_ranks_wait_for_a_straggler_longer_than_the_exchange_timeout(tmp_path: Path) -> None:
    """At the end of training the fast ranks wait for the straggler however long it takes (it is alive)."""
    strategy = SwarmStrategy(local_steps=1, start_method="fork", exchange_timeout=0.5)
    _, probes = _run(tmp_path, "wait", 2, strategy, {"sleep": 0.03, "straggler": 1, "slowdown": 8.0},
                     model=TinyNet(samples=64, batch_size=8), max_epochs=-1, max_steps=12)
    assert probes[1]["times"][-1] - probes[0]["times"][-1] > 1.0  # the straggler finished > 2 timeouts later
    assert torch.equal(probes[0]["final"], probes[1]["final"])  # average_at_end ran after the wait


def test_a_partner_that_died_is_detected_within_the_timeout() -> None:
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_dead_partner_worker, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        message, seconds = results.get(timeout=30)
    except queue.Empty:
        message, seconds = "rank 0 reported nothing within 30 s", float("inf")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    codes = [p.exitcode for p in procs]
    assert "presumed dead" in message and seconds < 3.0 + 5.0, (message, seconds, codes)


class BatchNormNet(TinyNet):
    """TinyNet with a BatchNorm layer (running statistics are buffers)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.norm = nn.BatchNorm1d(self.hparams.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


def test_batchnorm_statistics_are_gossiped_with_the_parameters(tmp_path: Path) -> None:
    strategy = SwarmStrategy(local_steps=1, mode="lockstep", non_blocking=False, average_at_end=False,
                             start_method="fork")
    _, probes = _run(tmp_path, "bn", 2, strategy, model=BatchNormNet(samples=64, batch_size=8), max_epochs=2)
    # W=2, blocking: after the last round both models, running statistics included, are bit-identical
    assert torch.equal(probes[0]["final"], probes[1]["final"])
    assert probes[0]["comm"]["wire_bytes"] == probes[0]["swarm"]["exchanges"] * probes[0]["message"]
    off = SwarmStrategy(local_steps=1, mode="lockstep", non_blocking=False, average_at_end=False,
                        gossip_buffers=False, start_method="fork")
    _, probes = _run(tmp_path, "bn_off", 2, off, model=BatchNormNet(samples=64, batch_size=8), max_epochs=2)
    assert not torch.equal(probes[0]["final"], probes[1]["final"])  # statistics stayed local


class EndCheckpoint(pl.Callback):
    """Every rank saves ``<dir>/end.ckpt`` when ``fit`` is over (collective, per-rank shards)."""

    def __init__(self, dirpath: Path) -> None:
        self.dirpath = Path(dirpath)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.dirpath / "end.ckpt")


def test_async_checkpoint_drains_exchanges_and_resumes(tmp_path: Path) -> None:
    """Saved during training (ModelCheckpoint on each rank's clock): rank 0's replica, no collective, and every rank
    resumes from it. Saved after fit: every rank's drained state in its shard, and each rank resumes its own."""
    def strategy() -> SwarmStrategy:
        return SwarmStrategy(local_steps=1, start_method="fork")

    model = lambda: TinyNet(samples=128, batch_size=8)  # noqa: E731 - 4 steps per epoch per rank
    _run(tmp_path, "first", 4, strategy(), {"sleep": 0.01, "straggler": 3}, model=model(), max_epochs=2,
         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_epochs=1),
                    EndCheckpoint(tmp_path / "ck")], enable_checkpointing=True)
    during = next((tmp_path / "ck").glob("epoch=0*.ckpt"))
    assert torch.load(during, weights_only=True)["swarm"]["replica"] == 0
    assert not Path(f"{during}.gradcomp").exists()
    _, probes = _run(tmp_path, "from_replica", 4, strategy(), {"sleep": 0.01}, model=model(), max_epochs=2,
                     ckpt_path=str(during))
    assert all(p["comm"]["steps"] == 4 for p in probes)  # epoch 1 only
    assert all(torch.equal(p["final"], probes[0]["final"]) for p in probes)
    path = tmp_path / "ck" / "end.ckpt"
    saved = read_shards(path, key="swarm")  # every rank's state, from its shard
    for rank, entry in enumerate(saved):
        assert entry["pending"] is None and entry["async"] is not None
        assert all(applied <= 8 for *_, applied, _ in entry["async"]["log"])  # drained at step 8, nothing after
    _check_logs_consistent([{"log": [tuple(e) for e in entry["async"]["log"]]} for entry in saved])
    _, probes = _run(tmp_path, "resumed", 4, strategy(), {"sleep": 0.01}, model=model(), max_epochs=3,
                     ckpt_path=str(path))
    for rank, p in enumerate(probes):
        old = [tuple(e) for e in saved[rank]["async"]["log"]]
        assert p["log"][: len(old)] == old and len(p["log"]) > len(old)
        assert all(pub >= 8 for pub, *_ in p["log"][len(old):])
        assert p["comm"]["steps"] == 12
    assert all(torch.equal(p["final"], probes[0]["final"]) for p in probes)


@pytest.mark.parametrize("callbacks", [False, True])
def test_a_time_limit_leaves_each_rank_on_its_own_clock(tmp_path: Path, callbacks: bool) -> None:
    """W=3, rank 2 sleeps 3x as long per step, ``max_time``: Lightning's per-batch Timer broadcast (and EarlyStopping's
    and ModelCheckpoint's decisions) are taken on each rank, so the fast ranks run on; the end still averages."""
    extra = [EarlyStopping("train_loss", patience=10_000, check_on_train_epoch_end=True),
             ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=5)] if callbacks else []
    _, probes = _run(tmp_path, "timed", 3, SwarmStrategy(start_method="fork"), {"sleep": 0.03, "straggler": 2},
                     model=TinyNet(samples=64, batch_size=8), max_epochs=-1, max_time={"seconds": 4},
                     callbacks=extra, enable_checkpointing=callbacks)
    done = [len(p["times"]) for p in probes]
    assert min(done[:2]) >= 2 * done[2], done
    assert all(torch.equal(p["final"], probes[0]["final"]) for p in probes)  # drained and averaged at the end


class StopSignal(pl.Callback):
    """Logs ``stop_signal``: 0 on rank 0 (its EarlyStopping fires at the first epoch end), 1 elsewhere."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pl_module.log("stop_signal", float(trainer.global_rank != 0))


def test_early_stopping_on_one_rank_stops_that_rank_only(tmp_path: Path) -> None:
    """Each rank's EarlyStopping decides on its own metric; the rank that stopped waits at the end for the others."""
    stop = EarlyStopping("stop_signal", stopping_threshold=0.5, check_on_train_epoch_end=True)
    _, probes = _run(tmp_path, "early", 3, SwarmStrategy(start_method="fork"), {"sleep": 0.01},
                     model=TinyNet(samples=72, batch_size=8), max_epochs=4, callbacks=[StopSignal(), stop])
    assert [len(p["times"]) for p in probes] == [3, 12, 12]  # 3 steps per epoch per rank
    assert all(torch.equal(p["final"], probes[0]["final"]) for p in probes)


def test_sync_dist_during_async_training_warns_once_and_stays_local() -> None:
    strategy = SwarmStrategy()
    meta = SimpleNamespace(name="acc", sync=SimpleNamespace(should=True))
    results = {"training_step.acc": SimpleNamespace(meta=meta)}
    strategy._lightning_module = SimpleNamespace(trainer=SimpleNamespace(_results=results))  # type: ignore[assignment]
    strategy._rank_local = True
    value = torch.tensor(2.0)
    with pytest.warns(UserWarning, match=r"sync_dist=True\) of \['acc'\]") as caught:
        assert strategy.reduce(value) is value
        assert strategy.reduce(value) is value
    assert len([w for w in caught if "sync_dist" in str(w.message)]) == 1
    assert strategy.broadcast("mine", src=0) == "mine" and strategy.reduce_boolean_decision(True) is True


@pytest.mark.parametrize("kwargs, error, match", [
    ({"mode": "gossip"}, ValueError, "mode"),
    ({"rounding": "stochastic"}, ValueError, "rounding"),
    ({"mode": "lockstep", "replay": [[]]}, ValueError, "replay"),
    ({"replay": 3}, TypeError, "replay"),
    ({"replay": [[(1, 2, 3, 4, 5)]]}, ValueError, "replay"),
    ({"replay": [5]}, TypeError, "replay"),
    ({"replay": [[1, 2, 3]]}, ValueError, "replay"),
    ({"replay": [[None]]}, ValueError, "replay"),
    ({"replay": {"a": []}}, TypeError, "replay"),
    ({"replay": {-1: []}}, TypeError, "replay"),
    ({"replay": [[(1, 2, 3, 4, 5, "x")]]}, ValueError, "replay"),
    ({"replay": [[(1.5, 1, 2, 3, 4, 0)]]}, ValueError, "replay"),  # was truncated to 1
    ({"replay": [[(1, -1, 2, 3, 4, 0)]]}, ValueError, "replay"),
    ({"replay": [[(1, 1, 2, 3, 4, 2)]]}, ValueError, "replay"),
    ({"replay": [[(True, 1, 2, 3, 4, 0)]]}, ValueError, "replay"),
    ({"monitor_every": 2}, ValueError, "monitor_every"),
    ({"gossip_buffers": 1}, TypeError, "gossip_buffers"),
    ({"exchange_timeout": 0}, ValueError, "exchange_timeout"),
    ({"exchange_timeout": 1e-9}, ValueError, r"`exchange_timeout` must be in \[1e-06, 1000000000000.0\]"),  # a zero timedelta
    ({"exchange_timeout": float("inf")}, ValueError, "exchange_timeout"),
])
def test_bad_async_arguments_are_rejected(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        SwarmStrategy(**kwargs)


def test_replay_logs_in_other_forms_are_accepted() -> None:
    """Tuples or lists (a log read back from JSON), NumPy integers, a bool ``drained``, a dict of some ranks."""
    entry = (np.int64(2), 1, 2, np.int32(7), 3, True)
    assert SwarmStrategy(replay=[[list(entry)], []]).replay == [[(2, 1, 2, 7, 3, 1)], []]
    assert SwarmStrategy(replay={1: (entry,)}).replay == {1: [(2, 1, 2, 7, 3, 1)]}


@pytest.mark.parametrize("replay, message", [
    ([[]], r"one pairing log per rank \(world size 2\), got 1"),
    ([[], [], []], r"one pairing log per rank \(world size 2\), got 3"),
    ({0: [], 2: []}, r"ranks \[2\], outside 0..1"),
    ([[(1, 7, 1, 1, 1, 0)], []], "rank 0's log names partner 7"),
    ([[], [(1, 1, 1, 1, 1, 0)]], "rank 1's log names partner 1"),
])
def test_replay_that_does_not_fit_the_world_is_refused(replay: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _check_replay_ranks(SwarmStrategy(replay=replay).replay, 2)
    _check_replay_ranks(SwarmStrategy(replay={0: [], 1: [(1, 0, 1, 1, 1, 0)]}).replay, 2)  # fits: no error


def test_a_replay_of_too_few_ranks_stops_the_setup_on_every_rank(tmp_path: Path) -> None:
    """Before, rank 1 found no log of its own: a bare ``IndexError`` in the middle of the setup."""
    with pytest.raises(Exception, match=r"`replay` must hold one pairing log per rank \(world size 2\), got 1"):
        fit(SwarmStrategy(replay=[[]], start_method="fork"), tmp_path, devices=2)
    assert not (tmp_path / "rank0.pt").exists()  # nothing trained
