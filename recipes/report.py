"""End-of-run summary of a recipe: final metrics and bytes on the wire vs dense DDP, printed and saved as JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch

from lightning_gradcomp.comm import compression_ratio

__all__ = ["RecipeReport", "format_bytes", "summarize_comm"]


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


def summarize_comm(wire_bytes: float, dense_bytes: float) -> dict[str, float]:
    """Totals plus ``saved_fraction`` (1 - wire/dense) and ``compression_ratio`` (the package's one rule:
    :func:`lightning_gradcomp.comm.compression_ratio`)."""
    return {
        "wire_bytes": wire_bytes,
        "dense_bytes": dense_bytes,
        "saved_fraction": 1.0 - wire_bytes / dense_bytes if dense_bytes else 0.0,
        "compression_ratio": compression_ratio(dense_bytes, wire_bytes),
    }


def _strategy_bytes(trainer: pl.Trainer) -> Optional[tuple[float, float]]:
    stats = getattr(trainer.strategy, "comm_stats", None)
    if stats is None:
        return None
    return float(stats.wire_bytes), float(stats.dense_bytes)


class RecipeReport(pl.Callback):
    """At the end of ``fit``: sum every rank's wire / dense-equivalent bytes, read the last logged metrics, print
    one summary on rank 0 and write it to ``path`` as JSON.

    The byte figures come from the strategy's ``comm_stats`` (``GradCompStrategy``, ``SwarmStrategy``);
    for other strategies only metrics are reported.

    Args:
        path: JSON file (``None``: ``<log_dir or default_root_dir>/summary.json``).
        metrics: logged metric names to report (``None``: every ``val/*`` metric).
        enabled: turn the report off.
        epoch_lines: also print one line of validation metrics per epoch (rank 0).
    """

    def __init__(self, path: Optional[str] = None, metrics: Optional[list[str]] = None, enabled: bool = True,
                 epoch_lines: bool = True) -> None:
        self.path, self.metrics, self.enabled, self.epoch_lines = path, metrics, enabled, epoch_lines
        self._start = 0.0
        self.summary: dict[str, Any] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not (self.enabled and self.epoch_lines) or trainer.sanity_checking or trainer.global_rank != 0:
            return
        shown = ", ".join(f"{k}={float(v):.4f}" for k, v in sorted(trainer.callback_metrics.items())
                          if k.startswith("val/"))
        print(f"[recipe] epoch {trainer.current_epoch} step {trainer.global_step} "
              f"({time.perf_counter() - self._start:.0f} s): {shown}", flush=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled:
            return
        summary: dict[str, Any] = {
            "model": type(pl_module).__name__,
            "strategy": type(trainer.strategy).__name__,
            "compressor": repr(getattr(trainer.strategy, "compressor", None)),
            "world_size": trainer.world_size,
            "epochs": trainer.current_epoch,
            "steps": trainer.global_step,
            "fit_seconds": round(time.perf_counter() - self._start, 2),
        }
        local = _strategy_bytes(trainer)
        if local is not None:
            totals = torch.tensor(local, dtype=torch.float64)
            if trainer.world_size > 1:
                totals = trainer.strategy.reduce(totals, reduce_op="sum")
            summary["comm"] = summarize_comm(float(totals[0]), float(totals[1]))
        names = self.metrics or sorted(k for k in trainer.callback_metrics if k.startswith("val/"))
        summary["metrics"] = {k: float(trainer.callback_metrics[k]) for k in names if k in trainer.callback_metrics}
        self.summary = summary
        if trainer.global_rank != 0:
            return
        path = Path(self.path) if self.path else Path(trainer.log_dir or trainer.default_root_dir) / "summary.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2))
        print(self.render(summary) + f"\n  summary written to {path}", flush=True)

    @staticmethod
    def render(summary: dict[str, Any]) -> str:
        """A few human-readable lines."""
        lines = [f"[recipe] {summary['model']} with {summary['strategy']} ({summary['compressor']}) on "
                 f"{summary['world_size']} processes: {summary['steps']} steps in {summary['fit_seconds']} s"]
        lines += [f"  {k} = {v:.4f}" for k, v in summary.get("metrics", {}).items()]
        comm = summary.get("comm")
        if comm:
            lines.append(f"  bytes sent (all ranks): {format_bytes(comm['wire_bytes'])} vs dense DDP "
                         f"{format_bytes(comm['dense_bytes'])}: saved {100 * comm['saved_fraction']:.1f}% "
                         f"({comm['compression_ratio']:.1f}x)")
        return "\n".join(lines)
