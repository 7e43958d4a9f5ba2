"""Per-layer diagnosis of compressed training (issue 49): error-feedback memory norms and how much of each layer the
averaged gradient touched.

A Lightning callback for the recipes (``PYTHONPATH=benchmarks``, then ``--trainer.callbacks+=horizon_probe.LayerProbe
--trainer.callbacks.out=probe.csv``). Every ``every`` optimizer steps, rank 0 writes one CSV row per parameter:

* ``coverage``: the fraction of the parameter's coordinates whose averaged gradient was non-zero at least once in
  the window (1.0 for dense DDP; about ``1 - (1 - density) ** every`` for random indices);
* ``grad_norm``: the L2 norm of the averaged gradient summed over the window's steps (what the optimizer received);
* ``memory_norm``: the L2 norm of the rank's error-feedback memory for the parameter at the window's end (0 without
  error feedback; a memory holds the layer's coordinates not yet sent);
* ``update_norm``: the L2 norm of the parameter's change over the window.

    python benchmarks/horizon_probe.py plot probe.csv probe.png   # memory norm and coverage per layer over steps
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor


class LayerProbe(pl.Callback):
    """Record, every ``every`` steps, each parameter's gradient coverage, summed gradient, memory and update norms.

    Args:
        out: CSV path written by rank 0 (one row per parameter and window).
        every: window length in optimizer steps (>= 1).
    """

    def __init__(self, out: str = "probe.csv", every: int = 100) -> None:
        if every < 1:
            raise ValueError(f"`every` must be >= 1, got {every}")
        self.out, self.every = Path(out), every
        self._touched: dict[str, Tensor] = {}
        self._summed: dict[str, Tensor] = {}
        self._start: dict[str, Tensor] = {}
        self._rows: list[dict[str, Any]] = []

    def _reset(self, pl_module: pl.LightningModule) -> None:
        for name, p in pl_module.named_parameters():
            if p.requires_grad:
                self._touched[name] = torch.zeros_like(p, dtype=torch.bool)
                self._summed[name] = torch.zeros_like(p)
                self._start[name] = p.detach().clone()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset(pl_module)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        for name, p in pl_module.named_parameters():
            if p.grad is not None and name in self._touched:
                self._touched[name] |= p.grad != 0
                self._summed[name] += p.grad

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every:
            return
        memories = _memories(trainer)
        for name, p in pl_module.named_parameters():
            if name not in self._touched:
                continue
            memory = _memory_of(memories, name)
            self._rows.append({
                "step": step, "param": name, "numel": p.numel(),
                "coverage": float(self._touched[name].float().mean()),
                "grad_norm": float(self._summed[name].norm()),
                "memory_norm": 0.0 if memory is None else float(memory.norm()),
                "update_norm": float((p.detach() - self._start[name]).norm()),
            })
        self._reset(pl_module)
        if trainer.global_rank == 0:
            self._write()

    def _write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with self.out.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(self._rows[0]))
            writer.writeheader()
            writer.writerows(self._rows)


class LayerDensity(pl.Callback):
    """Set named layers' compression parameter at the start of fit (``strategy.set_layer_params``), e.g.
    ``{"net.embed.weight": 0.05}``: the other layers keep the compressor's."""

    def __init__(self, params: dict[str, float]) -> None:
        self.params = dict(params)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.set_layer_params(self.params)


def _memories(trainer: pl.Trainer) -> dict[str, Tensor]:
    hook = getattr(trainer.strategy, "hook", None)
    memory = getattr(hook, "memory", None)
    return dict(memory.memories) if memory is not None else {}


def _memory_of(memories: dict[str, Tensor], name: str) -> Optional[Tensor]:
    """The memory of parameter ``name``: keys may carry a wrapper's prefix (``module.``, ``_forward_module.``)."""
    for key, value in memories.items():
        if key == name or key.endswith("." + name) or name.endswith("." + key):
            return value
    return None


def plot(csv_path: str, png_path: str) -> None:
    """Memory norm and coverage per parameter against the step, one line per parameter with > 1000 elements."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(csv_path)))
    names = sorted({r["param"] for r in rows if int(r["numel"]) > 1000})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for name in names:
        mine = [r for r in rows if r["param"] == name]
        steps = [int(r["step"]) for r in mine]
        axes[0].plot(steps, [float(r["memory_norm"]) for r in mine], label=name)
        axes[1].plot(steps, [float(r["coverage"]) for r in mine], label=name)
    axes[0].set(xlabel="step", ylabel="memory L2 norm", title="error-feedback memory per layer")
    axes[1].set(xlabel="step", ylabel="fraction of coordinates touched", title=f"coverage per window ({Path(csv_path).name})")
    axes[1].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "plot":
        plot(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
