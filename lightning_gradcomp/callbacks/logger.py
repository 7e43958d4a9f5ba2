"""CompressionLogger: what the compression does on the wire, logged through the Trainer's loggers.

At the steps Lightning writes its own step metrics (the Trainer's ``log_every_n_steps``), rank 0 logs the figures
of its own :class:`~lightning_gradcomp.comm.CommStats` (bytes sent, dense-equivalent bytes, the compression
``dense / wire``, hook time, error-feedback memory norm) with ``pl_module.log``, so they share Lightning's rows and
steps with the loss (CSV, TensorBoard, ...). Every logging period (or ``error_every_n_steps``) compressed steps it
also measures the relative compression error

.. math::  e = \\lVert p - C(p) \\rVert_2 \\,/\\, \\lVert p \\rVert_2

of the compressor input ``p`` (``p = m + g`` with error feedback) through the engine's observers,
and at every epoch end it aggregates bytes, hook time and error over *all* ranks with torchmetrics.
Metric names are the constants of this module (table in ``docs/monitoring.md``).

The metric names live in :mod:`~lightning_gradcomp.callbacks.metric_names` and the error's measurement in
:mod:`~lightning_gradcomp.callbacks.error_probe`; both are re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torchmetrics import MaxMetric, MeanMetric, SumMetric

from lightning_gradcomp.callbacks.error_probe import ErrorProbe, StepError, _relative_error
from lightning_gradcomp.callbacks.guard import CompressionGuard, judged
from lightning_gradcomp.callbacks.metric_names import (
    COMPRESSION_STEP,
    COMPRESSION_WHOLE_RUN,
    DENSE_BYTES,
    DENSE_BYTES_TOTAL,
    EPOCH_COMPRESSION,
    EPOCH_DENSE_BYTES,
    EPOCH_ERROR,
    EPOCH_HOOK_MS,
    EPOCH_HOOK_MS_MAX,
    EPOCH_RATIO,
    EPOCH_WIRE_BYTES,
    ERROR,
    HOOK_MS,
    INTRA_BYTES,
    LAYER_COMPRESSION,
    LAYER_ERROR,
    LAYER_METRICS,
    LAYER_PARAM,
    LAYER_RATIO,
    LAYER_WIRE_BYTES,
    MEMORY_NORM,
    METRICS,
    NONFINITE_BUCKETS,
    PROG_BAR_EVERY_N_STEPS,
    RATIO,
    RATIO_TOTAL,
    WIRE_BYTES,
    WIRE_BYTES_TOTAL,
)
from lightning_gradcomp.callbacks.summary import print_summary
from lightning_gradcomp.checks import check_bool, check_int
from lightning_gradcomp.comm import CommStats, compression_ratio
from lightning_gradcomp.hook import GradCompHook
from lightning_gradcomp.memory import ErrorFeedback

__all__ = [
    "CompressionLogger",
    "DENSE_BYTES",
    "DENSE_BYTES_TOTAL",
    "EPOCH_DENSE_BYTES",
    "EPOCH_ERROR",
    "EPOCH_HOOK_MS",
    "EPOCH_HOOK_MS_MAX",
    "COMPRESSION_STEP",
    "COMPRESSION_WHOLE_RUN",
    "EPOCH_COMPRESSION",
    "EPOCH_RATIO",
    "EPOCH_WIRE_BYTES",
    "ERROR",
    "ErrorProbe",
    "HOOK_MS",
    "LAYER_COMPRESSION",
    "LAYER_ERROR",
    "LAYER_METRICS",
    "LAYER_PARAM",
    "LAYER_RATIO",
    "LAYER_WIRE_BYTES",
    "MEMORY_NORM",
    "METRICS",
    "NONFINITE_BUCKETS",
    "PROG_BAR_EVERY_N_STEPS",
    "RATIO",
    "RATIO_TOTAL",
    "StepError",
    "WIRE_BYTES",
    "WIRE_BYTES_TOTAL",
]


@dataclass
class _Snapshot:
    """Cumulative CommStats figures at one moment."""

    steps: int
    wire: float
    dense: float
    hook_s: float
    layers: dict[str, tuple[float, float]]
    intra: float = 0.0

    @classmethod
    def of(cls, stats: CommStats, per_layer: bool) -> _Snapshot:
        layers = {n: (s.wire_bytes, s.dense_bytes) for n, s in stats.layers.items()} if per_layer else {}
        return cls(stats.steps, stats.wire_bytes, stats.dense_bytes, stats.hook_seconds, layers, stats.intra_bytes)


def memory_norm(memory: Optional[ErrorFeedback]) -> Optional[float]:
    """L2 norm of all error-feedback memories (``None`` when there are none); one host sync."""
    if memory is None or not memory.memories:
        return None
    norms = torch.stack([torch.linalg.vector_norm(m) for m in memory.memories.values()])
    return float(torch.linalg.vector_norm(norms))


def lightning_step(trainer: pl.Trainer) -> int:
    """The ``step`` Lightning writes the current training batch's metrics at (the batches that stepped before it)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    stepped = getattr(loop, "_batches_that_stepped", None)
    return int(stepped) if stepped is not None else max(trainer.global_step - 1, 0)


def lightning_writes(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes its step metrics (the loss) to the loggers after this training batch."""
    connector = getattr(trainer, "_logger_connector", None)
    due = getattr(connector, "should_update_logs", None)
    if isinstance(due, bool):
        return due
    every = int(getattr(trainer, "log_every_n_steps", 50) or 0)
    return every > 0 and (lightning_step(trainer) + 1) % every == 0


class CompressionLogger(Callback):
    """Log wire bytes, the compression (dense / wire bytes), hook time, memory norm and compression error.

    Add it to the Trainer of a :class:`~lightning_gradcomp.GradCompStrategy` run::

        trainer = Trainer(strategy="gradcomp_topk", devices=4, callbacks=[CompressionLogger()])

    Rank 0 logs its figures with ``pl_module.log`` from ``on_train_batch_end`` at the steps Lightning writes its
    own step metrics (the Trainer's ``log_every_n_steps``): in a ``metrics.csv`` they sit in the loss's rows, at
    its ``step`` and with its ``epoch``. Each figure says what it covers: ``gradcomp/compression_step`` is
    dense / wire of the steps since the previous log (the rate per compressed step once the dense warm-up is
    over, also in the progress bar, refreshed every :data:`PROG_BAR_EVERY_N_STEPS` steps),
    ``gradcomp/compression_whole_run`` that of the whole run, warm-up included. All ranks aggregate epoch
    figures with torchmetrics (logged at epoch end, in Lightning's epoch rows), a rich per-layer table is
    printed at the end of fit, and a :class:`~lightning_gradcomp.callbacks.guard.CompressionGuard` warns when
    nothing is compressed. Metric names: :data:`METRICS` and :data:`LAYER_METRICS` (``docs/monitoring.md``).
    Costs: a few float operations per step and a ``pl_module.log`` every :data:`PROG_BAR_EVERY_N_STEPS` steps;
    the memory norm (one pass over the memory) at log steps; one copy of the compressor input plus two norms
    per layer at error-sampled steps; a few small collectives at epoch ends.

    Args:
        log_every_n_steps: logging period in optimizer steps (``None``: the Trainer's ``log_every_n_steps``,
            whose rows the figures then share). Another period writes the figures in rows of their own, still
            at Lightning's ``step`` and with its ``epoch``.
        error_every_n_steps: measure the compression error at the first compressed step and every this many
            compressed steps after it (0 disables; ``None``: the logging period, so that every logged row of a
            run, a short one included, carries a fresh measurement). Lightning writes the latest value of a step
            metric at each logging step, so a period longer than the logging period repeats a measurement.
        per_layer: also log per-layer bytes, compression, error and parameter.
        prog_bar: show the compression of the recent steps in the progress bar.
        summary: print the per-layer table on rank 0 at the end of fit.
        guard: warn loudly when nothing is being compressed.
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        error_every_n_steps: Optional[int] = None,
        per_layer: bool = False,
        prog_bar: bool = True,
        summary: bool = True,
        guard: bool = True,
    ) -> None:
        if log_every_n_steps is not None:
            check_int("log_every_n_steps", log_every_n_steps, 1, 10**12)
        if error_every_n_steps is not None:
            check_int("error_every_n_steps", error_every_n_steps, 0, 10**12)
        self.log_every_n_steps = log_every_n_steps
        self.error_every_n_steps = error_every_n_steps
        self.per_layer = check_bool("per_layer", per_layer)
        self.prog_bar = check_bool("prog_bar", prog_bar)
        self.summary = check_bool("summary", summary)
        self.guard: Optional[CompressionGuard] = CompressionGuard() if check_bool("guard", guard) else None
        self.probe: Optional[ErrorProbe] = None
        self._every = log_every_n_steps or 50
        self._shared = True
        self._hook: Optional[GradCompHook] = None
        self._last: Optional[_Snapshot] = None
        self._warmup: Optional[_Snapshot] = None
        self._epoch_start: Optional[_Snapshot] = None
        self._epoch_errors: list[float] = []
        self._pending: dict[str, float] = {}
        self._seen_steps = -1
        self._show_bar = False
        self._epoch_metrics: dict[str, Any] = {}

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve the logging period and create the epoch aggregators."""
        # Trainer.log_every_n_steps is set by Lightning's logger connector at run time, not declared on Trainer
        lightning_every = max(int(trainer.log_every_n_steps), 1)  # type: ignore[attr-defined]
        self._every = self.log_every_n_steps or lightning_every
        self._shared = self._every == lightning_every
        self._epoch_metrics = {
            EPOCH_WIRE_BYTES: SumMetric(),
            EPOCH_DENSE_BYTES: SumMetric(),
            EPOCH_HOOK_MS: MeanMetric(),
            EPOCH_HOOK_MS_MAX: MaxMetric(),
            EPOCH_ERROR: MeanMetric(),
        }

    @property
    def error_period(self) -> int:
        """The compressed steps between two error measurements (0: none): ``error_every_n_steps``, or the logging
        period when that is ``None``."""
        return self._every if self.error_every_n_steps is None else self.error_every_n_steps

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Attach the error probe to the engine and take the first snapshots."""
        self._hook = getattr(trainer.strategy, "hook", None)
        if self.guard is not None and (self._hook is None or judged(trainer.strategy)):
            self.guard.on_train_start(trainer, pl_module)  # skipped for another strategy's engine (LocalSGD)
        self._show_bar = self.prog_bar and trainer.progress_bar_callback is not None
        if self._hook is None:
            return
        for metric in self._epoch_metrics.values():
            metric.to(pl_module.device)
        if self.error_period > 0:
            self.probe = ErrorProbe(self.error_period, self._hook.start_step)
            self._hook.observers.append(self.probe)
        self._last = self._epoch_start = _Snapshot.of(self._hook.stats, self.per_layer)
        self._warmup = None
        self._seen_steps = self._hook.stats.steps
        if trainer.is_global_zero:  # names the run in `lightning-gradcomp report` (a CSVLogger's hparams.yaml)
            run = {
                "gradcomp_strategy": type(trainer.strategy).__name__,
                "gradcomp_compressor": repr(self._hook.compressor),
                "gradcomp_world_size": int(trainer.world_size),
                "gradcomp_error_every_n_steps": self.error_period,
            }
            for logger in trainer.loggers:
                logger.log_hyperparams(run)

    def _due(self, trainer: pl.Trainer) -> bool:
        """Whether the figures are logged after this batch: with Lightning's step metrics, or every ``_every``."""
        if self._shared:
            return lightning_writes(trainer)
        return (lightning_step(trainer) + 1) % self._every == 0

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log when due; feed the progress bar and the guard."""
        if self.guard is not None:
            self.guard.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        hook = self._hook
        if hook is None or hook.stats.steps == self._seen_steps:
            return  # no reduction in this batch (gradient accumulation)
        self._seen_steps = hook.stats.steps
        if hook.stats.compressed_steps == 0:
            self._warmup = _Snapshot.of(hook.stats, False)  # the dense warm-up so far
        if self.probe is not None and self.probe.pending:
            self._pending.update(self._error_metrics(self.probe.drain()))
        if self._due(trainer):
            metrics, self._pending = {**self._interval_metrics(trainer, hook), **self._pending}, {}
            self._log(trainer, pl_module, metrics)
        elif self._show_bar and self._last is not None and hook.stats.steps % PROG_BAR_EVERY_N_STEPS == 0:
            compression = compression_ratio(
                hook.stats.dense_bytes - self._last.dense, hook.stats.wire_bytes - self._last.wire
            )
            if math.isfinite(compression):  # pl_module.log costs ~0.1-0.5 ms: not on every step
                self._log(trainer, pl_module, {COMPRESSION_STEP: compression}, bar_only=True)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Aggregate the epoch over all ranks (collective: every rank takes part)."""
        hook = self._hook
        if hook is None or self._epoch_start is None:
            return
        if self.probe is not None and self.probe.pending:
            self._pending.update(self._error_metrics(self.probe.drain()))
        now = _Snapshot.of(hook.stats, False)
        start, self._epoch_start = self._epoch_start, now
        steps = now.steps - start.steps
        if steps <= 0:
            return
        m = self._epoch_metrics
        hook_ms = 1e3 * (now.hook_s - start.hook_s) / steps
        m[EPOCH_WIRE_BYTES].update(now.wire - start.wire)
        m[EPOCH_DENSE_BYTES].update(now.dense - start.dense)
        m[EPOCH_HOOK_MS].update(hook_ms, weight=steps)
        m[EPOCH_HOOK_MS_MAX].update(hook_ms)
        errors = [e for e in self._epoch_errors if not math.isnan(e)]
        self._epoch_errors = []
        m[EPOCH_ERROR].update(errors or [0.0], weight=1.0 if errors else 0.0)  # lists go to the metric's device
        values = {name: float(metric.compute()) for name, metric in m.items()}
        for metric in m.values():
            metric.reset()
        values[EPOCH_COMPRESSION] = compression_ratio(values[EPOCH_DENSE_BYTES], values[EPOCH_WIRE_BYTES])
        finite = {k: v for k, v in values.items() if math.isfinite(v)}
        if finite:  # every rank holds the same all-rank figures; Lightning writes them in its epoch-end row
            pl_module.log_dict(finite, on_step=False, on_epoch=True, prog_bar=False, logger=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the last partial interval, detach the probe, print the summary."""
        hook = self._hook
        if hook is not None and self._last is not None:
            if self.probe is not None and self.probe.pending:
                self._pending.update(self._error_metrics(self.probe.drain()))
            metrics = self._interval_metrics(trainer, hook) if hook.stats.steps > self._last.steps else {}
            metrics, self._pending = {**metrics, **self._pending}, {}
            # pl_module.log is refused here: a row of its own at the last batch's step and epoch
            self._write(trainer, metrics, max(lightning_step(trainer) - 1, 0))
        if self.guard is not None:
            self.guard.on_train_end(trainer, pl_module)
        self._detach()
        if self.summary and hook is not None and trainer.is_global_zero:
            probe = self.probe
            print_summary(
                hook.stats,
                probe.layer_errors() if probe is not None else {},
                total_error=probe.total_error() if probe is not None else float("nan"),
                param_name=hook.compressor.param_name,
                title=f"GradComp summary: {hook.compressor!r}, world size {hook.comm.world_size} (rank 0)",
                compressed_steps_compression=self.compressed_steps_compression(),
            )

    def compressed_steps_compression(self) -> float:
        """Dense / wire bytes of the compressed steps alone (the run less its dense warm-up), ``nan`` before any."""
        hook = self._hook
        if hook is None or hook.stats.compressed_steps == 0:
            return float("nan")
        warm = self._warmup or _Snapshot(0, 0.0, 0.0, 0.0, {})
        return compression_ratio(hook.stats.dense_bytes - warm.dense, hook.stats.wire_bytes - warm.wire)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Never leave the probe attached (e.g. after an exception)."""
        self._detach()

    # ------------------------------------------------------------------ metrics
    def _interval_metrics(self, trainer: pl.Trainer, hook: GradCompHook) -> dict[str, float]:
        """Figures since the previous log; advances the snapshot (all ranks, written by rank 0)."""
        assert self._last is not None
        stats, last = hook.stats, self._last
        now = _Snapshot.of(stats, self.per_layer)
        self._last = now
        steps = max(now.steps - last.steps, 1)
        out = {
            WIRE_BYTES: (now.wire - last.wire) / steps,
            DENSE_BYTES: (now.dense - last.dense) / steps,
            WIRE_BYTES_TOTAL: now.wire,
            DENSE_BYTES_TOTAL: now.dense,
            COMPRESSION_STEP: compression_ratio(now.dense - last.dense, now.wire - last.wire),
            COMPRESSION_WHOLE_RUN: compression_ratio(now.dense, now.wire),
            HOOK_MS: 1e3 * (now.hook_s - last.hook_s) / steps,
            NONFINITE_BUCKETS: float(stats.nonfinite_steps),
        }
        if now.intra:  # two-level reductions: the node-internal bytes beside the cross-node ones
            out[INTRA_BYTES] = (now.intra - last.intra) / steps
        if trainer.is_global_zero:
            norm = memory_norm(hook.memory) if hook.compressor.uses_error_feedback else None
            if norm is not None:
                out[MEMORY_NORM] = norm
        if self.per_layer:
            for name, layer in stats.layers.items():
                wire0, dense0 = last.layers.get(name, (0.0, 0.0))
                wire, dense = now.layers[name]
                out[LAYER_WIRE_BYTES + name] = (wire - wire0) / steps
                out[LAYER_COMPRESSION + name] = compression_ratio(dense - dense0, wire - wire0)
                if layer.compressed and isinstance(layer.param, (int, float)):
                    out[LAYER_PARAM + name] = float(layer.param)
        return {k: v for k, v in out.items() if math.isfinite(v)}

    def _error_metrics(self, measured: list[StepError]) -> dict[str, float]:
        """The latest measured error (and per-layer errors); all samples feed the epoch mean."""
        self._epoch_errors.extend(e.error for e in measured)
        if not measured:
            return {}
        latest = measured[-1]
        out = {ERROR: latest.error}
        if self.per_layer:
            out.update({LAYER_ERROR + name: _relative_error(r2, p2) for name, (r2, p2) in latest.layers.items()})
        return {k: v for k, v in out.items() if math.isfinite(v)}

    def _log(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, metrics: dict[str, float], bar_only: bool = False
    ) -> None:
        """Rank 0's step figures: into Lightning's row (``pl_module.log``) when the periods agree, else a row of
        their own at Lightning's step; the compression of the recent steps also goes to the progress bar."""
        if not metrics or not trainer.is_global_zero:
            return
        if self._shared:  # one set of arguments per name: Lightning refuses a name logged two ways in one hook
            for name, value in metrics.items():
                bar = self._show_bar and name == COMPRESSION_STEP
                pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=bar, rank_zero_only=True)
            return
        if self._show_bar and COMPRESSION_STEP in metrics:
            pl_module.log(
                COMPRESSION_STEP, metrics[COMPRESSION_STEP], on_step=True, on_epoch=False, prog_bar=True, logger=False
            )
        if not bar_only:
            self._write(trainer, metrics, lightning_step(trainer))

    @staticmethod
    def _write(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
        """Write ``metrics`` straight to the loggers at Lightning's ``step`` (with ``epoch``, as Lightning does)."""
        if not metrics or not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics({**metrics, "epoch": float(trainer.current_epoch)}, step=step)

    def _detach(self) -> None:
        if self._hook is not None and self.probe is not None and self.probe in self._hook.observers:
            self._hook.observers.remove(self.probe)
