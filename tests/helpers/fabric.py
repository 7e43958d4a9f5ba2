"""A Fabric training loop and the Trainer run it is compared with: the same model, optimizer and per-rank data.

Both read each rank's batches from :class:`RankShard` (rank r takes the r-th contiguous slice of the samples, in
order), so the two runs see the same batches on every rank. Each writes ``<out>/<name><rank>.pt`` with ``params``
(flat parameters after every optimizer step), ``wire`` (cumulative ``CommStats.wire_bytes`` after every step),
``hook_step`` and ``memory`` (the error-feedback memories at the end).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from helpers.distributed import free_port
from helpers.models import ReadyOrderNet, TinyNet

SAMPLES = 144
BATCH = 8


class RankShard(Sampler[int]):
    """Rank r of W takes samples ``[r * n / W, (r + 1) * n / W)`` in order (read when iterated, in the worker)."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def _world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def __iter__(self) -> Any:
        rank, world = self._world()
        per = self.samples // world
        return iter(range(rank * per, (rank + 1) * per))

    def __len__(self) -> int:
        return self.samples // self._world()[1]


def loader(model: TinyNet) -> DataLoader:
    return DataLoader(TensorDataset(model.x, model.y), batch_size=BATCH, sampler=RankShard(len(model.x)))


class ShardedTinyNet(TinyNet):
    def train_dataloader(self) -> DataLoader:
        return loader(self)


class ShardedReadyOrderNet(ReadyOrderNet):
    def train_dataloader(self) -> DataLoader:
        return loader(self)


MODELS = {"tiny": ShardedTinyNet, "ready": ShardedReadyOrderNet}


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def _dump(out: Path, name: str, rank: int, record: dict[str, Any], strategy: Any) -> None:
    hook = strategy.hook
    record["hook_step"] = hook.step if hook is not None else None
    record["memory"] = hook.memory.state_dict() if hook is not None else None
    record["stats"] = strategy.comm_stats.state_dict()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(record, out / f"{name}{rank}.pt")


def fabric_loop(fabric: Fabric, model: str, out: Path, steps: int, accumulate: int = 1, start: int = 0,
                save: Optional[str] = None, load: Optional[str] = None, separate: bool = False) -> None:
    """Optimizer steps ``start`` .. ``steps - 1`` of ``accumulate`` micro-batches each (``no_backward_sync`` on all but
    the last), as Lightning's automatic optimization takes them; ``load`` first restores model, optimizer and
    compression state with ``fabric.load``, ``save`` writes them at the end with ``fabric.save``. ``separate``: set
    up with ``fabric.setup_module`` then ``fabric.setup_optimizers`` instead of ``fabric.setup``."""
    raw = MODELS[model](samples=SAMPLES, batch_size=BATCH)
    optimizer = raw.configure_optimizers()
    data = fabric.setup_dataloaders(loader(raw), use_distributed_sampler=False)
    if separate:
        module = fabric.setup_module(raw)
        optimizer = fabric.setup_optimizers(optimizer)
    else:
        module, optimizer = fabric.setup(raw, optimizer)
    if load is not None:
        fabric.load(load, {"model": module, "optimizer": optimizer})
    record: dict[str, Any] = {"params": [], "wire": []}
    for index, (x, y) in enumerate(data):
        if index < start * accumulate:
            continue
        if index >= steps * accumulate:
            break
        syncing = (index + 1) % accumulate == 0
        with fabric.no_backward_sync(module, enabled=not syncing):
            loss = nn.functional.mse_loss(module(x), y)
            fabric.backward(loss / accumulate)  # Lightning's closure divides by accumulate_grad_batches
        if syncing:
            optimizer.step()
            optimizer.zero_grad()
            record["params"].append(_flat(module))
            record["wire"].append(fabric.strategy.comm_stats.wire_bytes)
    if save is not None:
        fabric.save(save, {"model": module, "optimizer": optimizer})
    fabric.barrier()
    fabric.strategy.teardown()  # stops the hook's thread and destroys its group (Fabric never calls it)
    record["released"] = fabric.strategy.hook is None or fabric.strategy._released
    _dump(Path(out), "fabric", fabric.global_rank, record, fabric.strategy)


def run_fabric(strategy: Any, out: Path, steps: int, *, devices: int = 2, model: str = "tiny", **loop: Any,
               ) -> list[dict[str, Any]]:
    """Launch :func:`fabric_loop` on ``devices`` CPU ranks (``strategy``: a fork or spawn variant, or an instance)."""
    os.environ["MASTER_PORT"] = str(free_port())  # a second launch in one test must not meet the first's port
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch(fabric_loop, model, out, steps, **loop)
    return [torch.load(Path(out) / f"fabric{r}.pt", weights_only=True) for r in range(devices)]


class _StepRecorder(pl.Callback):
    def __init__(self, out: Path, accumulate: int) -> None:
        self.out, self.accumulate = out, accumulate
        self.record: dict[str, Any] = {"params": [], "wire": []}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if (batch_idx + 1) % self.accumulate == 0:
            self.record["params"].append(_flat(pl_module))
            self.record["wire"].append(trainer.strategy.comm_stats.wire_bytes)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _dump(self.out, "trainer", trainer.global_rank, self.record, trainer.strategy)


def run_trainer(strategy: str, out: Path, steps: int, *, devices: int = 2, model: str = "tiny",
                accumulate: int = 1) -> list[dict[str, Any]]:
    """The same steps through ``Trainer.fit`` (``strategy``: a fork variant), recorded the same way."""
    os.environ["MASTER_PORT"] = str(free_port())
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, max_epochs=1,
                         accumulate_grad_batches=accumulate, use_distributed_sampler=False, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[_StepRecorder(Path(out), accumulate)], default_root_dir=str(out))
    trainer.fit(MODELS[model](samples=SAMPLES, batch_size=BATCH))
    return [torch.load(Path(out) / f"trainer{r}.pt", weights_only=True) for r in range(devices)]


def assert_replicas_identical(records: list[dict[str, Any]]) -> None:
    """Every rank holds bit-identical parameters after every step."""
    assert records[0]["params"], "no steps were recorded"
    for rank, record in enumerate(records[1:], start=1):
        assert len(record["params"]) == len(records[0]["params"])
        for step, (a, b) in enumerate(zip(records[0]["params"], record["params"])):
            assert torch.equal(a, b), f"rank {rank} differs from rank 0 after step {step}"
