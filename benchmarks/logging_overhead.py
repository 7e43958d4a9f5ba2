"""Step-time overhead of CompressionLogger, measured within one run.

A 2-rank CPU (gloo) fit of a small MLP with ``GradCompStrategy(TopK(0.01))`` in which the callback is
switched on and off in alternating blocks of ``--block`` optimizer steps (off: its per-step hooks return
at once and its error probe is detached from the engine). Comparing the mean step time of each "on"
block with the mean of its two neighbouring "off" blocks cancels the load drift of a shared machine,
which makes separate runs useless for a few-percent effect. Reported per configuration (rank 0):

* ``on / off``: median over blocks of the mean step time ratio (wall time between consecutive
  ``on_train_batch_start`` calls, so it includes everything the callback causes, Lightning's
  processing of the progress-bar value included);
* ``self``: the callback's own wall time (its hooks and the probe inside the communication hook) as a
  fraction of the "on" blocks' step time.

All configurations use the Trainer's defaults otherwise (CSVLogger, progress bar,
``log_every_n_steps=50``). With blocks shorter than the logging period, logs still happen once per
period (at the first "on" step after each period boundary); error samples that fall in "off" blocks
are skipped, so with the default ``error_every_n_steps=50`` about half of them are not timed (one
input copy and two norms per layer every 50 steps).

    python benchmarks/logging_overhead.py [--blocks 120] [--block 10] [--repeats 1] [--hidden 512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
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

CONFIGS: dict[str, dict[str, Any]] = {
    "CompressionLogger() defaults": {},
    "per_layer=True": {"per_layer": True},
    "log + error every step, per_layer": {"log_every_n_steps": 1, "error_every_n_steps": 1, "per_layer": True},
}


class MLP(pl.LightningModule):
    """A 3-layer MLP regression on fixed random data."""

    def __init__(self, hidden: int, steps: int, batch: int = 32, features: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 10))
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(steps * batch * 2, features, generator=gen)
        self.y = torch.randn(steps * batch * 2, 10, generator=gen)
        self.batch = batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch)


class _TimedProbe:
    """Times the error probe's work inside the communication hook."""

    def __init__(self, probe: Any, owner: "ToggledLogger") -> None:
        self.probe, self.owner = probe, owner

    def wants(self, step: int) -> bool:
        return self.probe.wants(step)

    def __call__(self, record: Any) -> None:
        start = time.perf_counter()
        self.probe(record)
        self.owner.self_time += time.perf_counter() - start


class ToggledLogger(CompressionLogger):
    """CompressionLogger switched off in even blocks of ``block`` steps; adds up its own wall time."""

    def __init__(self, block: int, out: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.block, self.out = block, out
        self.self_time = 0.0
        self.enabled = False
        self.starts: list[tuple[float, bool]] = []
        self._timed_probe: Optional[_TimedProbe] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        hook = trainer.strategy.hook
        if self.probe is not None:
            hook.observers.remove(self.probe)
            self._timed_probe = _TimedProbe(self.probe, self)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.starts.append((time.perf_counter(), self.enabled))
        self.enabled = (trainer.global_step // self.block) % 2 == 1
        observers = trainer.strategy.hook.observers
        if self._timed_probe is not None:
            if self.enabled and self._timed_probe not in observers:
                observers.append(self._timed_probe)
            elif not self.enabled and self._timed_probe in observers:
                observers.remove(self._timed_probe)

    def on_train_batch_end(self, *args: Any) -> None:
        if self.enabled:
            start = time.perf_counter()
            super().on_train_batch_end(*args)
            self.self_time += time.perf_counter() - start

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timed_probe is not None and self._timed_probe in trainer.strategy.hook.observers:
            trainer.strategy.hook.observers.remove(self._timed_probe)
        if trainer.is_global_zero:
            # starts[i] = (time, whether step i-1 was "on"): step i-1 lasted starts[i] - starts[i-1]
            steps = [(b - a, on) for (a, _), (b, on) in zip(self.starts, self.starts[1:])]
            self.out.write_text(json.dumps({"steps": steps, "self": self.self_time}))


def run(options: dict[str, Any], blocks: int, block: int, hidden: int, workdir: Path) -> dict[str, Any]:
    """One fit; returns rank 0's (step seconds, on?) list and the logger's self time."""
    out = workdir / f"times_{time.monotonic_ns()}.json"
    steps = blocks * block
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=steps + 1, logger=CSVLogger(workdir),
                         strategy=GradCompStrategy(compressor=TopK(density=0.01), start_method="fork"),
                         enable_checkpointing=False, enable_model_summary=False,
                         callbacks=[ToggledLogger(block, out, summary=False, **options)])
    trainer.fit(MLP(hidden, steps + 1))
    return json.loads(out.read_text())


def block_ratios(steps: list[tuple[float, bool]], block: int) -> tuple[list[float], float]:
    """Per "on" block: its mean step time over the mean of its neighbouring "off" blocks; and the total on-time."""
    means = [statistics.fmean(t for t, _ in steps[i:i + block]) for i in range(0, len(steps) - block + 1, block)]
    flags = [steps[i][1] for i in range(0, len(steps) - block + 1, block)]
    ratios = [means[i] / statistics.fmean([means[i - 1], means[i + 1]])
              for i in range(1, len(means) - 1) if flags[i] and not flags[i - 1] and not flags[i + 1]]
    return ratios, sum(t for t, on in steps if on)


def main(argv: Optional[list[str]] = None) -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=120, help="number of on/off blocks per run (even)")
    parser.add_argument("--block", type=int, default=10, help="optimizer steps per block")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args(argv)
    os.environ.setdefault("PL_DISABLE_FORK", "0")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in CONFIGS.items():
            ratios, selfs, step_ms = [], [], []
            for _ in range(args.repeats):
                result = run(options, args.blocks, args.block, args.hidden, Path(tmp))
                steps = [(t, on) for t, on in result["steps"]][args.block:]  # drop the first (warm-up) block
                r, on_time = block_ratios(steps, args.block)
                ratios.extend(r)
                selfs.append(result["self"] / on_time)
                step_ms.append(1e3 * statistics.median(t for t, on in steps if not on))
            rows.append((name, statistics.median(step_ms), ratios, statistics.median(selfs)))
    print(f"\n2 ranks (gloo, CPU), MLP 256-{args.hidden}-{args.hidden}-10, TopK(0.01), {args.blocks} blocks of "
          f"{args.block} steps x {args.repeats} runs, rank 0")
    print("| configuration | median step, off (ms) | on / off step time: median (min-max over blocks) | self time |")
    print("|---|---|---|---|")
    for name, ms, ratios, own in rows:
        print(f"| {name} | {ms:.2f} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}, "
              f"{len(ratios)} blocks) | {100 * own:.2f}% |")


if __name__ == "__main__":
    main()
