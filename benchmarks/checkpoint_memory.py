"""Peak memory of ``save_checkpoint``: every rank's state gathered into rank 0 (old) vs per-rank shards (now).

A ``--world``-rank CPU (gloo, forked ranks) fit of an MLP (about 4.2 M parameters with the defaults) with
``GradCompStrategy(CLTK(0.01))``, so every rank's error-feedback memory is model-sized (4 bytes per compressed
parameter). After ``--steps`` optimizer steps every rank calls ``trainer.save_checkpoint`` once, and measures:

* ``peak +MiB``: the rise of its peak resident set during the call (Linux: the peak is reset through
  ``/proc/self/clear_refs`` just before, after ``gc.collect()`` and ``malloc_trim(0)``; then ``VmHWM - VmRSS``);
* the wall time of the call, the size of the checkpoint file and of the rank's shard.

``gather`` is the previous implementation, reproduced here (``gather_object`` of every rank's hook state to rank
0, all of it inline in the checkpoint file); ``shards`` is :class:`GradCompStrategy` as it is. Each mode runs in
fresh processes, ``--repeats`` times; the table shows medians.

    python benchmarks/checkpoint_memory.py [--world 4] [--hidden 2048] [--features 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.bench.runner import free_port
from lightning_gradcomp.shard_files import shard_dir
from lightning_gradcomp.compressors import CLTK
from lightning_gradcomp.strategy import CHECKPOINT_KEY


class GatherStrategy(GradCompStrategy):
    """The previous ``save_checkpoint``: every rank's state gathered into rank 0's file (format version 1)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        local = self._hook.state_dict() if self._hook is not None else {}
        per_rank: list[Any] = [local]
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            per_rank = [None] * self.world_size if self.global_rank == 0 else []
            dist.gather_object(local, per_rank if self.global_rank == 0 else None, dst=0)
        checkpoint[CHECKPOINT_KEY] = {"version": 1, "compressor": type(self.compressor).__name__,
                                      "world_size": self.world_size, "per_rank": per_rank}
        DDPStrategy.save_checkpoint(self, checkpoint, filepath, storage_options)


class MLP(pl.LightningModule):
    """Two large matrices (compressed) and a small head, regression on fixed random data."""

    def __init__(self, features: int, hidden: int, samples: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, features), nn.ReLU(),
                                 nn.Linear(features, 10))
        gen = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(samples, features, generator=gen), torch.randn(samples, 10, generator=gen)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=16)


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


class MeasureSave(pl.Callback):
    """At the end of the fit, every rank saves once and records its peak RSS rise and wall time."""

    def __init__(self, path: Path, out: Path) -> None:
        self.path, self.out = path, out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages do not hide the next allocations
        trainer.strategy.barrier()
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # reset VmHWM to the current RSS
        before, start = _status("VmRSS"), time.perf_counter()
        trainer.save_checkpoint(self.path, weights_only=False)
        seconds, peak = time.perf_counter() - start, _status("VmHWM")
        rank = trainer.global_rank
        manifest = torch.load(self.path, weights_only=True)[CHECKPOINT_KEY] if rank == 0 else None
        shard = None
        if manifest is not None and "shards" in manifest:
            shard = manifest["shards"][0]["bytes"]
        memory = trainer.strategy.error_feedback.state_dict()
        record = {"rank": rank, "peak_rise": peak - before, "seconds": seconds,
                  "memory_bytes": sum(t.numel() * t.element_size() for t in memory.values()),
                  "file_bytes": os.path.getsize(self.path) if rank == 0 else None, "shard_bytes": shard}
        (self.out / f"rank{rank}.json").write_text(json.dumps(record))


def measure(mode: str, args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """One fit of ``mode`` (``gather`` or ``shards``) in fresh processes; every rank's record."""
    out = root / mode
    out.mkdir(parents=True)
    cls = GatherStrategy if mode == "gather" else GradCompStrategy
    os.environ["MASTER_PORT"] = str(free_port())  # Lightning keeps the first run's port otherwise
    strategy = cls(compressor=CLTK(0.01), start_method="fork")
    model = MLP(args.features, args.hidden, samples=16 * args.world * args.steps)
    trainer = pl.Trainer(accelerator="cpu", devices=args.world, strategy=strategy, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[MeasureSave(out / "model.ckpt", out)])
    trainer.fit(model)
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.world)]
    if mode == "shards":
        records[0]["shards_total"] = sum(p.stat().st_size for p in Path(shard_dir(out / "model.ckpt")).iterdir())
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    params = sum(p.numel() for p in MLP(args.features, args.hidden, samples=1).parameters())
    results: dict[str, list[list[dict[str, Any]]]] = {"gather": [], "shards": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for mode in results:
                results[mode].append(measure(mode, args, Path(tmp) / f"{repeat}"))
    mib = 1024 * 1024
    memory = results["shards"][0][0]["memory_bytes"]
    print(f"W = {args.world}, MLP {args.features}-{args.hidden}-{args.features}-10 ({params / 1e6:.2f} M parameters), "
          f"CLTK(0.01); one rank's error-feedback memory: {memory / mib:.1f} MiB; medians of {args.repeats} runs\n")
    print("| save path | rank 0 peak RSS rise (MiB) | other ranks, max (MiB) | rank 0 save time (s) "
          "| checkpoint file (MiB) | shard files, total (MiB) |")
    print("|---|---|---|---|---|---|")
    for mode, runs in results.items():
        def med(key: str, pick: Any = lambda recs: recs[0]) -> float:
            return statistics.median(pick(recs)[key] for recs in runs)
        others = statistics.median(max(r["peak_rise"] for r in recs[1:]) for recs in runs)
        shards = f"{med('shards_total') / mib:.1f}" if mode == "shards" else "-"
        print(f"| {mode} | {med('peak_rise') / mib:.1f} | {others / mib:.1f} | {med('seconds'):.2f} "
              f"| {med('file_bytes') / mib:.1f} | {shards} |")


if __name__ == "__main__":
    main()
