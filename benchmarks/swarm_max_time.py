"""Async SwarmSGD under a wall-clock budget: optimizer steps per rank when one rank is slower.

Fits a small MLP (two 64 x 64 layers, regression on fixed random data) with ``SwarmStrategy()`` (asynchronous,
the defaults) on ``--world-size`` forked CPU ranks with ``Trainer(max_time=...)``. Every rank sleeps ``--sleep``
seconds after each batch, the ``--straggler`` rank ``--slowdown`` times as long. Prints each rank's optimizer
steps, the fast ranks' least count over the straggler's, and whether the final (averaged) models are bit-identical.
``--callbacks`` adds ``EarlyStopping`` on each rank's own ``train_loss`` (checked at every epoch end) and a
step-based ``ModelCheckpoint(every_n_train_steps=...)``.

    python benchmarks/swarm_max_time.py --world-size 4 --max-time 40 [--callbacks] [--mode lockstep]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import SwarmStrategy


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        gen = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(256, 64, generator=gen), torch.randn(256, 64, generator=gen)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.body(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=8, shuffle=True)


class Straggler(pl.Callback):
    """Sleeps ``sleep`` s after each batch (``slowdown`` times as long on rank ``straggler``); at the end of the fit
    writes this rank's step count and final parameters to ``<out>/rank<r>.pt``."""

    def __init__(self, out: str, sleep: float, straggler: int, slowdown: float) -> None:
        self.out, self.sleep, self.straggler, self.slowdown = out, sleep, straggler, slowdown

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        time.sleep(self.sleep * (self.slowdown if trainer.global_rank == self.straggler else 1.0))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        final = torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()])
        torch.save({"steps": trainer.global_step, "final": final}, f"{self.out}/rank{trainer.global_rank}.pt")


def run(world_size: int, max_time: float, sleep: float, straggler: int, slowdown: float, callbacks: bool,
        mode: str, every_n_train_steps: int = 25) -> tuple[list[int], bool]:
    """One fit; returns each rank's optimizer steps and whether all final models are bit-identical."""
    with tempfile.TemporaryDirectory() as out:
        extra: list[pl.Callback] = []
        if callbacks:
            extra = [EarlyStopping("train_loss", patience=1000, check_on_train_epoch_end=True),
                     ModelCheckpoint(dirpath=Path(out) / "ck", every_n_train_steps=every_n_train_steps)]
        trainer = pl.Trainer(accelerator="cpu", devices=world_size, max_time={"seconds": max_time}, max_epochs=-1,
                             strategy=SwarmStrategy(mode=mode, start_method="fork"),  # type: ignore[arg-type]
                             callbacks=[Straggler(out, sleep, straggler, slowdown), *extra], logger=False,
                             enable_checkpointing=callbacks, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(_Net())
        records = [torch.load(f"{out}/rank{r}.pt", weights_only=True) for r in range(world_size)]
    identical = all(torch.equal(r["final"], records[0]["final"]) for r in records)
    return [r["steps"] for r in records], identical


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--max-time", type=float, default=40.0)
    parser.add_argument("--sleep", type=float, default=0.025)
    parser.add_argument("--straggler", type=int, default=-1, help="default: the last rank")
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--callbacks", action="store_true")
    parser.add_argument("--mode", default="async", choices=["async", "lockstep"])
    args = parser.parse_args()
    straggler = args.straggler % args.world_size
    steps, identical = run(args.world_size, args.max_time, args.sleep, straggler, args.slowdown, args.callbacks,
                           args.mode)
    fast = min(s for r, s in enumerate(steps) if r != straggler)
    print(f"W={args.world_size} mode={args.mode} max_time={args.max_time:g}s sleep={args.sleep:g}s rank {straggler} "
          f"x{args.slowdown:g} callbacks={args.callbacks}: steps per rank {steps}, fast/straggler "
          f"{fast / max(steps[straggler], 1):.2f}, final models identical: {identical}")


if __name__ == "__main__":
    main()
