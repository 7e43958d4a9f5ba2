"""LowPassMemoryFilter: ScaleCom's low-pass error-feedback memory, with a beta schedule and monitoring.

The engine updates each rank's memory as ``m <- (1 - beta) m + beta (p - c)`` (``beta = 1``: classic
error feedback). ScaleCom uses ``beta < 1`` (0.1 in its large-batch runs) to damp the memory and keep
the ranks' memories similar, which is what lets one leader's indices serve everyone. This callback
owns ``beta``, applies it through :meth:`GradCompStrategy.set_beta` before every optimizer step, and
logs what the filter is meant to protect:

* ``lowpass/beta``: the value in force;
* ``lowpass/memory_norm``: L2 norm of rank 0's memory (every ``trainer.log_every_n_steps`` steps);
* ``lowpass/similarity``: mean pairwise cosine similarity of the ranks' memories, every
  ``similarity_every_n_steps`` steps, from **one** all-reduce of the normalized memories ``u_i``:

  .. math::  \\frac{1}{W(W-1)} \\sum_{i \\ne j} u_i \\cdot u_j
             = \\frac{\\lVert \\sum_i u_i \\rVert^2 - \\sum_i \\lVert u_i \\rVert^2}{W (W - 1)}

  With ``sketch_size = d`` the all-reduce carries a ``d``-entry count sketch of ``u_i`` (fixed hash
  and signs shared by all ranks) instead of ``u_i`` itself: ``4 (d + 1)`` bytes instead of
  ``4 (n + 1)``, and ``||sketch||^2`` estimates ``||sum u_i||^2`` without bias (relative standard
  deviation about ``sqrt(2 / d)``, i.e. 2 % at the default 4096). ``sketch_size=None`` (or a
  memory of at most ``d`` entries) is exact.
  These bytes are counted in :attr:`LowPassMemoryFilter.comm_stats`, not in the strategy's figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_gradcomp.checks import ArgumentTypeError, check_int, check_value, is_int
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.memory import ErrorFeedback, require_error_feedback, validate_beta

__all__ = ["BETA", "LowPassMemoryFilter", "MEMORY_NORM", "SIMILARITY", "count_sketch", "mean_pairwise_cosine"]

BETA = "lowpass/beta"
MEMORY_NORM = "lowpass/memory_norm"
SIMILARITY = "lowpass/similarity"


def mean_pairwise_cosine(sum_sq_norm: float, norms_sq_total: float, world_size: int) -> float:
    """Mean of ``u_i . u_j`` over ordered pairs ``i != j`` from ``||sum u_i||^2`` and ``sum ||u_i||^2``."""
    if world_size < 2:
        return float("nan")
    return (sum_sq_norm - norms_sq_total) / (world_size * (world_size - 1))


def count_sketch(x: Tensor, size: int, seed: int) -> Tensor:
    """A ``size``-entry count sketch of flat ``x``: entry ``j`` adds ``s_i x_i`` over ``h(i) = j``.

    ``h`` and the signs ``s`` come from a generator seeded with ``seed`` (same on every rank), so
    sketches add up like the vectors and ``||sketch(x)||^2`` estimates ``||x||^2`` without bias.
    """
    gen = torch.Generator().manual_seed(seed)
    buckets = torch.randint(size, (x.numel(),), generator=gen).to(x.device)
    signs = torch.randint(2, (x.numel(),), generator=gen).to(x.device, torch.float32).mul_(2).sub_(1)
    out = torch.zeros(size, dtype=torch.float32, device=x.device)
    return out.index_add_(0, buckets, x.to(torch.float32) * signs)


def _check_schedule(schedule: Optional[Mapping[Any, float]]) -> dict[int, float]:
    if schedule is None:
        return {}
    if not isinstance(schedule, Mapping):
        raise ArgumentTypeError(f"`schedule` must be a mapping {{step: beta}}, e.g. {{500: 0.1}}, got {schedule!r}")
    out = {}
    for step, beta in schedule.items():
        if isinstance(step, str) and step.strip().isdigit():
            step = int(step)
        check_value(step, is_int, lambda v: v >= 0, "`schedule` keys must be optimizer steps (integers >= 0)")
        try:
            out[step] = validate_beta(beta)
        except ValueError as err:  # the same kind: a wrong type, or a number out of range
            kind = ArgumentTypeError if isinstance(err, TypeError) else ValueError
            raise kind(f"`schedule` values must be numbers in (0, 1], got {beta!r} at step {step}") from None
    return dict(sorted(out.items()))


class LowPassMemoryFilter(Callback):
    """Own the error-feedback low-pass factor ``beta`` of a :class:`~lightning_gradcomp.GradCompStrategy`.

    Example (``beta = 1``, i.e. classic error feedback, for 500 warm-up steps, then 0.1)::

        LowPassMemoryFilter(beta=1.0, schedule={500: 0.1}, similarity_every_n_steps=100)

    or in a LightningCLI YAML::

        trainer:
          callbacks:
            - class_path: lightning_gradcomp.callbacks.LowPassMemoryFilter
              init_args: {beta: 1.0, schedule: {500: 0.1}, similarity_every_n_steps: 100}

    Args:
        beta: value in (0, 1] used before the first schedule milestone (always, without a schedule).
        schedule: ``{step: beta}`` milestones: from optimizer step ``step`` on (``trainer.global_step``),
            use ``beta``. Piecewise constant; keys are integers >= 0.
        similarity_every_n_steps: measure the ranks' mean pairwise memory cosine every this many
            optimizer steps (one collective on every rank; 0 disables).
        sketch_size: entries of the count sketch sent for the similarity (``None``: send the whole
            normalized memory, exact).
        seed: seed of the sketch's hash and signs.
    """

    def __init__(
        self,
        beta: float = 0.1,
        schedule: Optional[Mapping[int, float]] = None,
        similarity_every_n_steps: int = 0,
        sketch_size: Optional[int] = 4096,
        seed: int = 0,
    ) -> None:
        self.beta = validate_beta(beta)
        self.schedule = _check_schedule(schedule)
        self.similarity_every_n_steps = check_int("similarity_every_n_steps", similarity_every_n_steps, 0, 10**12)
        if sketch_size is not None:
            check_int("sketch_size", sketch_size, 1, 2**31 - 1)
        self.sketch_size = sketch_size
        self.seed = check_int("seed", seed, 0, 2**63 - 1)
        self.comm_stats = CommStats()
        self.current_beta: Optional[float] = None
        self.last_memory_norm: Optional[float] = None
        self.last_similarity: Optional[float] = None
        self._comm: Optional[Comm] = None
        self._seen_step = -1

    def beta_at(self, step: int) -> float:
        """The ``beta`` in force at optimizer step ``step``."""
        value = self.beta
        for milestone, beta in self.schedule.items():
            if step >= milestone:
                value = beta
        return value

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check that the strategy has an error-feedback memory to filter."""
        if not callable(getattr(trainer.strategy, "set_beta", None)):
            raise ArgumentTypeError(
                f"LowPassMemoryFilter needs a GradCompStrategy (with `set_beta`), got {type(trainer.strategy).__name__}"
            )
        compressor = getattr(trainer.strategy, "compressor", None)
        if compressor is not None:
            require_error_feedback(compressor, "LowPassMemoryFilter filters", "use it with")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Apply the scheduled ``beta`` before this step's gradients are reduced."""
        beta = self.beta_at(trainer.global_step)
        if beta != self.current_beta:
            strategy: Any = trainer.strategy  # duck-typed: setup() checked that it has set_beta
            strategy.set_beta(beta)
            self.current_beta = beta

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log beta and the memory norm; measure the similarity when due (all ranks)."""
        memory: Optional[ErrorFeedback] = getattr(trainer.strategy, "error_feedback", None)
        step = trainer.global_step  # already advanced by this batch's optimizer step
        if step == self._seen_step:
            return  # no optimizer step in this batch (gradient accumulation)
        self._seen_step = step
        metrics: dict[str, float] = {}
        # Trainer.log_every_n_steps is set by Lightning's logger connector at run time, not declared on Trainer
        if memory is not None and memory.memories and step % max(int(trainer.log_every_n_steps), 1) == 0:  # type: ignore[attr-defined]
            self.last_memory_norm = memory.norm()
            metrics = {BETA: float(self.current_beta or self.beta), MEMORY_NORM: self.last_memory_norm}
        every = self.similarity_every_n_steps
        if memory is not None and memory.memories and every and step % every == 0 and trainer.world_size > 1:
            self.last_similarity = self.similarity(memory, trainer.world_size)
            metrics[SIMILARITY] = self.last_similarity
        if metrics and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    # ------------------------------------------------------------------ similarity
    def similarity(self, memory: ErrorFeedback, world_size: int) -> float:
        """Mean pairwise cosine of the ranks' memories (a collective: call on every rank)."""
        if self._comm is None:
            self._comm = Comm(None, self.comm_stats)
        flat = memory.flat(sorted(memory.memories))
        norm = torch.linalg.vector_norm(flat)
        unit = flat / norm if float(norm) > 0 else torch.zeros_like(flat)
        size = self.sketch_size
        body = unit if size is None or size >= unit.numel() else count_sketch(unit, size, self.seed)  # None: exact
        payload = torch.cat([body.to(torch.float32), unit.square().sum().reshape(1)])
        self._comm.all_reduce(payload)
        total = float(payload[:-1].double().square().sum())
        return mean_pairwise_cosine(total, float(payload[-1]), world_size)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Current beta, last measurements and the similarity's byte count (plain numbers)."""
        return {
            "current_beta": self.current_beta,
            "last_memory_norm": self.last_memory_norm,
            "last_similarity": self.last_similarity,
            "comm_stats": self.comm_stats.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; beta is re-applied from the schedule at the next batch."""
        self.last_memory_norm = state_dict.get("last_memory_norm")
        self.last_similarity = state_dict.get("last_similarity")
        self.comm_stats.load_state_dict(state_dict.get("comm_stats", {}))
        self.current_beta = None  # force set_beta() on the restored strategy
