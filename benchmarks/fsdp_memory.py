"""Per-rank memory of GradCompFSDPStrategy (FSDP2 in the shard group) against GradCompStrategy (DDP), W = 4 on CPU.

Each run fits an MLP of ``--layers`` square ``--width`` layers with CLT-k 1% (error feedback) and SGD with momentum
for a few steps on 4 forked gloo ranks, then every rank reports:

* ``tensors``: the bytes of the tensors it keeps between steps: its parameters (the local shard under FSDP2), their
  gradients, the optimizer state and the compression state (error-feedback memories, compressor state);
* ``peak_rss``: the peak resident set of the process (``VmHWM``) minus its resident set before the fit (``VmRSS``),
  which adds the transient buffers (FSDP2's all-gathered layers, DDP's buckets, the staged memories) to the above.

Run::

    python benchmarks/fsdp_memory.py --width 1024 --layers 16

It re-executes itself with ``MALLOC_MMAP_THRESHOLD_=65536`` (see :data:`MMAP_THRESHOLD`).

Prints one line per configuration (the median over ranks) and the ratio to DDP.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import GradCompFSDPStrategy, GradCompStrategy
from lightning_gradcomp.compressors import CLTK
from lightning_gradcomp.resident import resident_nbytes


MMAP_THRESHOLD = 65536
"""glibc's ``MALLOC_MMAP_THRESHOLD_`` for the run (bytes). By default glibc raises its mmap threshold to the size of
the largest block freed (up to 32 MiB), so FSDP2's per-layer buffers, allocated and freed at every step on the CPU,
then come from the heap, which keeps them resident: peak RSS measured the allocator, not the strategy (with glibc's
default FSDP2 at ``shard_size=2`` peaked at 1.4x DDP's). A fixed threshold maps every block of 64 KiB or more
separately and returns it when freed. ``--glibc-default`` keeps glibc's behaviour."""


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _local(value: Any) -> Any:
    """A DTensor's local shard (a plain tensor otherwise)."""
    return value.to_local() if hasattr(value, "to_local") else value


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class MLP(pl.LightningModule):
    def __init__(self, width: int, layers: int, shard: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(layers)))
        self.shard = shard
        self.data = TensorDataset(torch.randn(64, width), torch.randn(64, width))

    def configure_model(self) -> None:
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            for block in self.blocks:
                fully_shard(block, mesh=self.device_mesh["shard"])
            fully_shard(self, mesh=self.device_mesh["shard"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.blocks(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4)


class Measure(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.baseline = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.baseline = _status("VmRSS")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        engine = getattr(strategy, "reduction", None) or getattr(strategy, "hook", None)
        params = [_local(p) for p in pl_module.parameters()]
        grads = [_local(p.grad) for p in pl_module.parameters()]
        optim = [
            _local(value) for opt in trainer.optimizers for state in opt.state.values() for value in state.values()
        ]
        figures = {
            "params": resident_nbytes(params),
            "grads": resident_nbytes([g for g in grads if g is not None]),
            "optimizer": resident_nbytes(optim),
            "compression": engine.state_nbytes() if engine is not None else 0,
            "peak_rss": _status("VmHWM") - self.baseline,
            "peak_abs": _status("VmHWM"),
        }
        figures["tensors"] = figures["params"] + figures["grads"] + figures["optimizer"] + figures["compression"]
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(figures))


def run(name: str, strategy: Any, width: int, layers: int, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=4,
            strategy=strategy,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[Measure(out)],
        )
        trainer.fit(MLP(width, layers, shard=isinstance(strategy, GradCompFSDPStrategy)))
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return {key: statistics.median(r[key] for r in ranks) for key in ranks[0]}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--glibc-default", action="store_true", help="keep glibc's dynamic mmap threshold")
    args = parser.parse_args(argv)
    if not args.glibc_default and "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # read by glibc at start: re-exec
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")
    configs = {
        "GradCompStrategy (DDP)": lambda: GradCompStrategy(compressor=CLTK(density=0.01), start_method="fork"),
        "GradCompFSDPStrategy shard_size=2": lambda: GradCompFSDPStrategy(
            compressor=CLTK(density=0.01), shard_size=2, start_method="fork"
        ),
        "GradCompFSDPStrategy shard_size=4": lambda: GradCompFSDPStrategy(
            compressor=CLTK(density=0.01), shard_size=4, start_method="fork"
        ),
    }
    results = {name: run(name, make(), args.width, args.layers, args.steps) for name, make in configs.items()}
    base = results["GradCompStrategy (DDP)"]
    mib = 2.0**20
    print(f"W = 4, {args.layers} x Linear({args.width}, {args.width}), CLT-k 1%, SGD momentum; median over ranks, MiB")
    print(
        f"{'configuration':36s} {'params':>8s} {'grads':>8s} {'optim':>8s} {'compr':>8s} {'tensors':>8s} "
        f"{'ratio':>6s} {'peakRSS':>8s} {'ratio':>6s} {'VmHWM':>8s}"
    )
    for name, r in results.items():
        print(
            f"{name:36s} {r['params'] / mib:8.1f} {r['grads'] / mib:8.1f} {r['optimizer'] / mib:8.1f} "
            f"{r['compression'] / mib:8.1f} {r['tensors'] / mib:8.1f} {r['tensors'] / base['tensors']:6.2f} "
            f"{r['peak_rss'] / mib:8.1f} {r['peak_rss'] / base['peak_rss']:6.2f} {r['peak_abs'] / mib:8.1f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
