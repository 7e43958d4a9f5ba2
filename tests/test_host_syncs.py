"""The hook makes no host syncs on the training thread during compressed steps (issue 21, item 2).

Every Tensor method that waits for the device on a GPU (``item``, ``__bool__``, ``tolist``, ``cpu``, ``numpy``,
``__int__``, ``__float__``, ``nonzero``) is wrapped to count its calls made *on the training thread while it is
inside the hook or the optimizer-step commit*. On CPU these calls cost little, but each would serialise
communication with backward on a GPU. The compression itself runs on the communication thread, where waiting
is allowed (it is what the thread is for).
"""

from __future__ import annotations

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
