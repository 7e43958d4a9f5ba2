"""The hook makes no host syncs on the training thread during compressed steps (issue 21, item 2).

Every Tensor method that waits for the device on a GPU (``item``, ``__bool__``, ``tolist``, ``cpu``, ``numpy``,
``__int__``, ``__float__``, ``nonzero``) is wrapped to count its calls made *on the training thread while it is
inside the hook or the optimizer-step commit*. On CPU these calls cost little, but each would serialise
communication with backward on a GPU. The compression itself runs on the communication thread, where waiting
is allowed (it is what the thread is for).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch

from helpers.models import fit
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.compressors import registry
from lightning_gradcomp.hook import GradCompHook
from lightning_gradcomp.step_transaction import StepTransaction

SYNCING = ("item", "__bool__", "tolist", "cpu", "numpy", "__int__", "__float__", "nonzero")

_inside = threading.local()


def _counting(method: Callable[..., Any], counts: dict[str, int], name: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "depth", 0):
            counts[name] = counts.get(name, 0) + 1
        return method(*args, **kwargs)
    return wrapper


def _inside_of(method: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return method(*args, **kwargs)
        finally:
            _inside.depth -= 1
    return wrapper


class _Save(pl.Callback):
    def __init__(self, out: Path, counts: dict[str, int]) -> None:
        self.out, self.counts = out, counts

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stats = trainer.strategy.comm_stats
        torch.save({"counts": dict(self.counts), "compressed_steps": stats.compressed_steps,
                    "hook_calls_counted": True}, self.out / f"syncs{trainer.global_rank}.pt")


@pytest.mark.parametrize("name", sorted(n for n in registry.list() if not n.startswith("unit_test")))
def test_no_host_sync_on_the_training_thread(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    counts: dict[str, int] = {}
    for method in SYNCING:
        monkeypatch.setattr(torch.Tensor, method, _counting(getattr(torch.Tensor, method), counts, method))
    monkeypatch.setattr(GradCompHook, "__call__", _inside_of(GradCompHook.__call__))
    monkeypatch.setattr(StepTransaction, "_on_optimizer_step", _inside_of(StepTransaction._on_optimizer_step))
    strategy = GradCompStrategy(compressor=registry.create(name), start_method="fork")
    fit(strategy, tmp_path, max_epochs=2, callbacks=[_Save(tmp_path, counts)])
    for rank in range(2):
        saved = torch.load(tmp_path / f"syncs{rank}.pt", weights_only=True)
        assert saved["counts"] == {}, f"rank {rank}: host syncs on the training thread: {saved['counts']}"
        if not registry.create(name).dense:
            assert saved["compressed_steps"] > 0


def test_the_counter_sees_a_sync_in_the_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a hook that reads a value on the training thread is caught."""
    counts: dict[str, int] = {}
    monkeypatch.setattr(torch.Tensor, "item", _counting(torch.Tensor.item, counts, "item"))
    original = GradCompHook.__call__

    def syncing_call(self: GradCompHook, bucket: Any) -> Any:
        bucket.buffer().sum().item()
        return original(self, bucket)

    monkeypatch.setattr(GradCompHook, "__call__", _inside_of(syncing_call))
    fit(GradCompStrategy(compressor=registry.create("topk"), start_method="fork"), tmp_path, max_epochs=1,
        callbacks=[_Save(tmp_path, counts)])
    assert torch.load(tmp_path / "syncs0.pt", weights_only=True)["counts"].get("item", 0) > 0


# ---------------------------------------------------------------------------------------------- FSDP2's replica path
# FSDPReplicaReduction hands each module's reduction to its communication thread, as the DDP hook does: on the autograd
# (training) thread, inside the hook and the end-of-backward wait, nothing reads a tensor's value, the non-finite
# decision included (it decides which collectives follow: the communication thread reads it). Any read there would
# serialise the host with the device on a GPU.
CPU_ONLY_SITES = {("hashed_draws.py", "_draw_key")}  # reached for CPU tensors only (on a GPU: torch.rand there)


def _counting_sites(method: Callable[..., Any], sites: dict[str, int], name: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "depth", 0):
            code = sys._getframe(1).f_code  # the caller of the Tensor method
            key = f"{Path(code.co_filename).name}|{code.co_name}|{name}"
            sites[key] = sites.get(key, 0) + 1
        return method(*args, **kwargs)
    return wrapper


class _SaveFSDP(pl.Callback):
    def __init__(self, out: Path, sites: dict[str, int], calls: list[int]) -> None:
        self.out, self.sites, self.calls = out, sites, calls

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save({"sites": dict(self.sites), "calls": self.calls[0],
                    "compressed_steps": trainer.strategy.comm_stats.compressed_steps},
                   self.out / f"syncs{trainer.global_rank}.pt")


@pytest.mark.parametrize("name", sorted(n for n in registry.names() if not n.startswith("unit_test")))
def test_the_fsdp_replica_reduction_reads_nothing_on_the_training_thread(tmp_path: Path, name: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """GradCompFSDPStrategy (2 replicas x 2 shards): inside the replica reduction's hook, its end-of-backward wait and
    the step commit, on the training thread, nothing reads a tensor's value (not even the non-finite decision)."""
    from fsdp.models import fit_sharded

    from lightning_gradcomp import GradCompFSDPStrategy
    from lightning_gradcomp.fsdp_reduction import FSDPReplicaReduction

    sites: dict[str, int] = {}
    calls = [0]
    for method in SYNCING:
        monkeypatch.setattr(torch.Tensor, method, _counting_sites(getattr(torch.Tensor, method), sites, method))
    original = FSDPReplicaReduction.reduce

    def counted(self: FSDPReplicaReduction, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        original(self, *args, **kwargs)

    monkeypatch.setattr(FSDPReplicaReduction, "reduce", _inside_of(counted))
    monkeypatch.setattr(FSDPReplicaReduction, "finish_backward", _inside_of(FSDPReplicaReduction.finish_backward))
    monkeypatch.setattr(StepTransaction, "_on_optimizer_step", _inside_of(StepTransaction._on_optimizer_step))
    strategy = GradCompFSDPStrategy(compressor=registry.create(name), shard_size=2, start_method="fork", min_numel=8)
    fit_sharded(strategy, tmp_path, max_steps=4, callbacks=[_SaveFSDP(tmp_path, sites, calls)])
    for rank in range(4):
        saved = torch.load(tmp_path / f"syncs{rank}.pt", weights_only=True)
        found = {tuple(key.split("|")[:2]): count for key, count in saved["sites"].items()}
        other = set(found) - CPU_ONLY_SITES
        assert not other, f"rank {rank}: host syncs on the training thread: {saved['sites']}"
        assert saved["calls"] > 0
        if not registry.create(name).dense:
            assert saved["compressed_steps"] > 0
