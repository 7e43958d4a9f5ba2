"""The run behind docs/monitoring.md: a short logged fit, then ``lightning-gradcomp report`` on its logs.

Fits a small MLP on 2 CPU ranks (gloo) with ``GradCompStrategy(TopK(ratio))``, ``CompressionLogger``
and a CSVLogger, optionally with the L-GreCo callback re-choosing per-layer ratios, then writes the
report figures (``report_*.png``) into ``--out`` and prints the summary.

    python benchmarks/monitoring_demo.py [--steps 240] [--lgreco] [--out docs/figures]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import CompressionLogger
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.report import make_report


class Teacher(pl.LightningModule):
    """An MLP fitting a fixed random teacher network (so the loss and the gradients keep changing)."""

    def __init__(self, samples: int = 4096, features: int = 64, hidden: int = 256, batch: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, 128), nn.Tanh(), nn.Linear(128, 8))
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(samples, features, generator=gen)
        teacher = torch.randn(features, 8, generator=gen)
        self.y = torch.tanh(self.x @ teacher) + 0.1 * torch.randn(samples, 8, generator=gen)
        self.batch = batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch, shuffle=True)


def main(argv: Optional[list[str]] = None) -> None:
    """Fit, then write the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--ratio", type=float, default=0.05)
    parser.add_argument("--lgreco", action="store_true", help="add the L-GreCo callback (per-layer ratios)")
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    args = parser.parse_args(argv)
    os.environ.setdefault("PL_DISABLE_FORK", "0")
    callbacks: list[pl.Callback] = [CompressionLogger(log_every_n_steps=5, error_every_n_steps=5, per_layer=True)]
    if args.lgreco:
        from lightning_gradcomp.callbacks import LGreCo

        callbacks.append(LGreCo(period=60, warmup_steps=30, accumulate_steps=10))
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=args.steps, logger=CSVLogger(tmp),
                             strategy=GradCompStrategy(compressor=TopK(density=args.ratio), start_method="fork"),
                             enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                             log_every_n_steps=5, callbacks=callbacks)
        trainer.fit(Teacher())
        report = make_report(Path(tmp), args.out)
    figures = [p for p in report.files if p.suffix == ".png"]
    for path in set(report.files) - set(figures):
        path.unlink()  # the summary names a temporary path: it is printed instead
    print(report.summary)
    print("wrote:", ", ".join(str(p) for p in figures))


if __name__ == "__main__":
    main()
