"""Async SwarmSGD match-making: the share of pairing attempts that became exchanges, per rank.

Fits a small MLP (two 64 x 64 layers, regression on fixed random data) with ``SwarmStrategy(mode="async")`` on
``--world-size`` forked CPU ranks, ``--runs`` times, and prints each rank's applied exchanges and attempts
(``swarm_stats.exchanges`` and ``rounds``) summed over the runs, and their ratio. Timing decides who meets whom,
so the figures move from run to run; compare protocols with many runs, on a quiet machine.

    python benchmarks/swarm_pairing_rate.py --world-size 2 --runs 8 [--topology ring] [--steps 20] [--local-steps 1]
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
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
        return nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=8, shuffle=True)


class _Counts(pl.Callback):
    """Writes this rank's (exchanges, rounds) to ``<out>/rank<r>.pt`` at the end of the fit."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stats = trainer.strategy.swarm_stats
        torch.save((stats.exchanges, stats.rounds), f"{self.out}/rank{trainer.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--local-steps", type=int, default=1)
    parser.add_argument("--topology", default="complete")
    args = parser.parse_args()
    exchanges, rounds = [0] * args.world_size, [0] * args.world_size
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as out:
            strategy = SwarmStrategy(local_steps=args.local_steps, topology=args.topology, start_method="fork")
            trainer = pl.Trainer(accelerator="cpu", devices=args.world_size, strategy=strategy, max_steps=args.steps,
                                 max_epochs=-1, callbacks=[_Counts(out)], logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(_Net())
            for rank in range(args.world_size):
                made, tried = torch.load(f"{out}/rank{rank}.pt", weights_only=True)
                exchanges[rank] += made
                rounds[rank] += tried
    print(f"W={args.world_size} {args.topology}, {args.runs} runs of {args.steps} steps, H={args.local_steps}: "
          f"exchanges per rank {exchanges}, attempts per rank {rounds}, rate {sum(exchanges) / sum(rounds):.2f}")


if __name__ == "__main__":
    main()
