"""LGreCo: layer-wise adaptive compression parameters chosen by dynamic programming (Markov et al., MLSys 2024).

Every ``period`` optimizer steps after ``warmup_steps`` the callback

1. sums, per compressed layer, a statistic ``A`` over the last ``accumulate_steps`` steps, collected through
   the engine's observers: with ``statistic="gradient"`` the raw local gradients ``A = sum_t g_t``; with
   ``statistic="input"`` (the official code) the compressor inputs ``A = sum_t p_t``, i.e. ``p = m + g``, the
   error-compensated gradient, under error feedback (without error feedback both are the same);
2. builds for every layer a table of candidate parameters around the compressor's default (PowerSGD ranks,
   TopK/CLTK/RandomK densities, QSGD bits) with their bytes and their error ``||A - C(A)||`` (un-squared, see
   :mod:`lightning_gradcomp.functional.layerwise`). The compressor describes its own costs, so any
   :attr:`~lightning_gradcomp.compressors.base.Compressor.tunable` compressor works: candidates come from its
   ``candidate_grid`` and ``layer_candidates``, sizes and errors from its ``layer_costs``;
3. **averages the error tables over ranks** with one counted all-reduce of ``layers x candidates`` numbers, so
   every rank holds bit-identical tables (this deviates from the official code, which uses rank 0's
   statistics only, and then broadcasts its decision);
4. sets the budget ``alpha * sum_l e_l(default)`` (the error of the uniform setting) and solves the knapsack
   with :func:`~lightning_gradcomp.functional.solve_layerwise` **on every rank** (a deterministic function of
   identical inputs, hence the same choice everywhere, with no second collective);
5. applies the choice with ``trainer.strategy.set_layer_params`` and logs it. The solver rounds errors up
   (so its answers truly fit), which can exclude the uniform setting itself; when the uniform setting fits
   the budget and is cheaper than the solver's answer, the uniform setting is applied. If nothing fits, the
   previous choice is kept and a warning is issued.

The choice is part of the callback's checkpoint state (and of the strategy's), and is re-applied when a
resumed run starts. Use it as a Trainer callback, or hand it to the strategy as
``GradCompStrategy(..., layerwise=LGreCo(...))`` (that is what the ``"lgreco"`` strategy name does).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_gradcomp.checks import ArgumentTypeError, check_bool, check_int, check_number
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.functional.layerwise import feedback_errors, solve_or_uniform
from lightning_gradcomp.hook import BucketRecord

__all__ = ["LGreCo", "layer_candidates", "layer_table"]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- tables
def layer_candidates(compressor: Compressor, shape: Sequence[int], candidates: Sequence[Any]) -> list[Any]:
    """The candidate values valid for a layer of ``shape`` (the default always included, sorted):
    :meth:`Compressor.layer_candidates <lightning_gradcomp.compressors.base.Compressor.layer_candidates>`.

    Raises:
        ValueError: the compressor is not tunable (:attr:`Compressor.tunable`).
    """
    return compressor.layer_candidates(shape, candidates)


def layer_table(
    compressor: Compressor, stat: Tensor, shape: Sequence[int], candidates: Sequence[Any]
) -> tuple[list[float], list[float]]:
    """``(sizes in bytes, errors)`` of each candidate for one layer whose statistic is ``stat``:
    :meth:`Compressor.layer_costs <lightning_gradcomp.compressors.base.Compressor.layer_costs>`.

    Raises:
        ValueError: the compressor is not tunable (:attr:`Compressor.tunable`).
    """
    return compressor.layer_costs(stat, shape, candidates)


# ---------------------------------------------------------------------------------------------- collector
class _Collector:
    """Engine observer summing each compressed layer's statistic (raw gradient or compressor input) over the
    steps of the statistics window.

    Several synchronized backward passes before one optimizer step (manual accumulation) each hand over their
    bucket, which holds the passes so far added up: a step's statistic is its **last** pass's, the gradient the
    optimizer consumes. So each layer's latest record waits in :attr:`current` until a record of a later step or
    :meth:`fold` (after the optimizer stepped) adds it to the window; a step the optimizer skipped is replaced by
    the next one's passes (the hook's step does not advance).
    """

    def __init__(self, owner: LGreCo) -> None:
        self.owner = owner
        self.sums: dict[str, Tensor] = {}
        self.per_step: dict[str, list[Tensor]] = {}  # window="steps" (instead of sums): one copy per step
        self.current: dict[str, tuple[int, Tensor]] = {}  # layer -> (step, its latest pass's statistic)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.steps: set[int] = set()

    @property
    def needs_gradients(self) -> bool:
        """Ask the engine for the raw gradients (``BucketRecord.gradients``) with ``statistic="gradient"``."""
        return self.owner.statistic == "gradient"

    def wants(self, step: int) -> bool:
        return self.owner.in_window(step)

    def __call__(self, record: BucketRecord) -> None:
        self.steps.add(record.step)
        # Without the raw gradients (an engine that does not provide them) the inputs are used; they are the
        # same tensors when the compressor has no error feedback.
        tensors = record.gradients if self.needs_gradients and record.gradients is not None else record.inputs
        for slot, x in zip(record.slots, tensors):
            self.shapes[slot.name] = tuple(slot.shape)
            self.fold(record.step, (slot.name,))
            self.current[slot.name] = record.step, x.detach().to(torch.float32, copy=True)  # a later pass replaces

    def fold(self, before: Optional[int] = None, names: Optional[Sequence[str]] = None) -> None:
        """Add the waiting statistics of steps before ``before`` (all when ``None``) to the window, for the layers
        ``names`` (all when ``None``)."""
        for name in list(self.current) if names is None else names:
            waiting = self.current.get(name)
            if waiting is None or (before is not None and waiting[0] >= before):
                continue
            del self.current[name]
            x = waiting[1]
            if self.owner.window == "steps":
                self.per_step.setdefault(name, []).append(x)
                continue
            total = self.sums.get(name)
            if total is None or total.shape != x.shape:
                self.sums[name] = x
            else:
                total.add_(x)

    def reset(self) -> None:
        self.sums, self.per_step, self.current, self.shapes, self.steps = {}, {}, {}, {}, set()


# ---------------------------------------------------------------------------------------------- callback
class LGreCo(Callback):
    """Layer-wise adaptive compression (L-GreCo) for any tunable compressor (``Compressor.tunable``: a per-layer
    parameter such as PowerSGD's ``rank``, the sparsifiers' ``density`` or QSGD's ``bits``, and ``layer_costs``).

    Candidates per layer default to the compressor's ``candidate_grid(min_factor, max_factor, num_candidates)``:
    the integers in ``[floor(min_factor d), ceil(max_factor d)]`` around the default ``d`` for ranks and bits,
    ``num_candidates`` geometrically spaced densities in ``[min_factor d, max_factor d]`` for densities; they are
    then clipped to what the compressor and the layer allow (``layer_candidates``). The official code used
    factors 0.5-2 (ResNet) and 0.25-4 (Transformer-XL) for PowerSGD ranks.

    Args:
        period: optimizer steps between two adjustments (>= 1).
        warmup_steps: step of the first adjustment (>= 1; should exceed the strategy's ``start_step`` plus
            ``accumulate_steps`` so that the statistics see compressed steps).
        accumulate_steps: steps before each adjustment whose inputs are summed into the statistic
            (1 .. ``period``; the official code used 10).
        alpha: error budget as a multiple of the uniform setting's error (> 0; 1 keeps the total error).
        candidates: explicit candidate values for every layer (overrides the factor grid).
        min_factor: lower end of the grid as a multiple of the default (in (0, 1]).
        max_factor: upper end of the grid as a multiple of the default (>= 1).
        num_candidates: number of densities in the density grid (>= 1).
        resolution: error units of the DP solver (>= 1; keep it >= 100 x the number of layers).
        error: ``"norm"`` (default, as in the paper's code): the budget bounds the sum of the layers'
            un-squared errors ``sum_l ||A_l - C(A_l)||``; ``"squared"``: it bounds the model's total squared
            error ``sum_l ||A_l - C(A_l)||^2`` (the squared norm of the whole compression error), which does
            not let large-gradient layers absorb error that small layers give up; ``"feedback"``: with an
            error-feedback compressor, each error ``e`` is replaced by the steady-state memory it implies,
            ``e / (1 - e / ||A_l||)`` (:func:`~lightning_gradcomp.functional.layerwise.feedback_errors`), which grows
            without bound as a layer is starved (the same as ``"norm"`` without error feedback).
        statistic: what is summed over the window and compressed to fill the error tables.
            ``"gradient"`` (default): the raw local gradients ``g``, which do not depend on the run's own
            error-feedback memory, so the budget and the candidates' errors describe the gradients that any
            setting would compress. ``"input"``: the compressor inputs ``p = m + g`` (the official code); a
            layer given a small value then fills its memory, which inflates its error and the budget at the
            next re-plan (see docs/lgreco.md). Without error feedback both are the same.
        log_layers: also log every layer's chosen value (``lgreco/<layer>``).
    """

    def __init__(
        self,
        period: int = 1000,
        warmup_steps: int = 1000,
        accumulate_steps: int = 10,
        alpha: float = 1.0,
        candidates: Optional[Sequence[float]] = None,
        min_factor: float = 0.25,
        max_factor: float = 4.0,
        num_candidates: int = 9,
        resolution: int = 10_000,
        log_layers: bool = True,
        error: str = "norm",
        statistic: str = "gradient",
        window: str = "sum",
    ) -> None:
        inf = float("inf")
        self.period = check_int("period", period, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 1)
        self.accumulate_steps = check_int("accumulate_steps", accumulate_steps, 1, self.period, high_name="period")
        self.alpha = float(check_number("alpha", alpha, 0.0, inf, high_open=True))
        if candidates is not None:
            if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence) or not candidates:
                raise ArgumentTypeError(f"`candidates` must be a non-empty sequence of numbers, got {candidates!r}")
            for c in candidates:
                check_number("candidates", c, 0.0, inf, high_open=True)
        self.candidates = None if candidates is None else list(candidates)
        self.min_factor = float(check_number("min_factor", min_factor, 0.0, 1.0))
        self.max_factor = float(check_number("max_factor", max_factor, 1.0, inf, low_open=False, high_open=True))
        self.num_candidates = check_int("num_candidates", num_candidates, 1)
        self.resolution = check_int("resolution", resolution, 1)
        self.log_layers = check_bool("log_layers", log_layers)
        if error not in ("norm", "squared", "feedback"):
            raise ValueError(f"`error` must be 'norm', 'squared' or 'feedback', got {error!r}")
        self.error = error
        if statistic not in ("gradient", "input"):
            raise ValueError(f"`statistic` must be 'gradient' or 'input', got {statistic!r}")
        self.statistic = statistic
        if window not in ("sum", "steps"):
            raise ValueError(f"`window` must be 'sum' or 'steps', got {window!r}")
        self.window = window
        self.choice: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self._last_step = -1
        self._collector = _Collector(self)
        self._hook: Any = None

    # ------------------------------------------------------------------ schedule
    def is_adjustment_step(self, step: int) -> bool:
        """Whether the callback adjusts once ``step`` optimizer steps have been reduced."""
        return step >= self.warmup_steps and (step - self.warmup_steps) % self.period == 0

    def in_window(self, step: int) -> bool:
        """Whether the reduction of step ``step`` (0-based) feeds the next adjustment's statistics."""
        if step < self.warmup_steps:
            nxt = self.warmup_steps
        else:
            nxt = self.warmup_steps + ((step - self.warmup_steps) // self.period + 1) * self.period
        return nxt - step <= self.accumulate_steps

    # ------------------------------------------------------------------ Lightning hooks
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        hook = getattr(strategy, "hook", None)
        if hook is None or not hasattr(strategy, "set_layer_params"):
            raise ValueError(f"LGreCo needs GradCompStrategy (with its hook installed), got {type(strategy).__name__}")
        if not hook.compressor.tunable:
            raise ValueError(
                f"LGreCo needs a tunable compressor (a per-layer parameter and its layer_costs); "
                f"{hook.compressor!r} is not tunable"
            )
        self._hook = hook
        self._collector.reset()
        if self._collector not in hook.observers:
            hook.observers.append(self._collector)
        if self.choice:
            strategy.set_layer_params(self.choice)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._hook is None:
            return
        step = self._hook.step
        self._collector.fold(before=step)  # the steps the optimizer consumed
        if step == self._last_step or not self.is_adjustment_step(step):
            return
        self._last_step = step
        entry = self.adjust(trainer.strategy)
        if entry is not None:
            self._log(pl_module, entry)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._hook is not None and self._collector in self._hook.observers:
            self._hook.observers.remove(self._collector)
        self._hook = None
        self._collector.reset()

    # ------------------------------------------------------------------ the adjustment
    def adjust(self, strategy: Any) -> Optional[dict[str, Any]]:
        """Build the tables from the collected statistics, average them over ranks, solve and apply.

        Must run on every rank at the same step (it issues one all-reduce). Returns the history entry, or
        ``None`` when no statistics were collected.
        """
        hook = self._hook
        collector = self._collector
        step = hook.step
        collector.fold()
        if not collector.shapes:
            rank_zero_warn(
                f"LGreCo: no compressed-gradient statistics before step {step} (warmup_steps="
                f"{self.warmup_steps} must exceed the strategy's start_step + accumulate_steps); "
                f"parameters unchanged"
            )
            return None
        compressor = hook.compressor
        names = sorted(collector.shapes)
        grids = [self.grid(compressor, collector.shapes[n]) for n in names]
        sizes, local = [], []
        for name, grid in zip(names, grids):
            stats = collector.per_step[name] if self.window == "steps" else [collector.sums[name]]
            tables = [self._errors(compressor, stat, collector.shapes[name], grid) for stat in stats]
            sizes.append(tables[0][0])
            local.append([sum(column) / len(tables) for column in zip(*(e for _, e in tables))])
        errors = self._average(hook, local)
        default = compressor.default_param
        defaults = [grid.index(default) for grid in grids]
        uniform_error = sum(errors[i][c] for i, c in enumerate(defaults))
        uniform_size = sum(sizes[i][c] for i, c in enumerate(defaults))
        budget = self.alpha * uniform_error
        entry: dict[str, Any] = {
            "step": step,
            "stat_steps": len(collector.steps),
            "statistic": self.statistic,
            "window": self.window,
            "layers": names,
            "budget": budget,
            "uniform_error": uniform_error,
            "uniform_bytes": uniform_size,
        }
        collector.reset()
        try:
            picks, fallback = solve_or_uniform(sizes, errors, defaults, budget, self.resolution)
        except ValueError as err:
            rank_zero_warn(f"LGreCo at step {step}: {err}; keeping the previous per-layer parameters")
            entry.update(feasible=False, uniform=False, values=[self.choice.get(n, default) for n in names])
            self.history.append(entry)
            return entry
        entry["uniform"] = fallback
        values = [grid[c] for grid, c in zip(grids, picks)]
        self.choice = dict(zip(names, values))
        strategy.set_layer_params(self.choice)
        entry.update(
            feasible=True,
            values=values,
            error=sum(errors[i][c] for i, c in enumerate(picks)),
            bytes=sum(sizes[i][c] for i, c in enumerate(picks)),
            layer_errors=[errors[i][c] for i, c in enumerate(picks)],
            layer_uniform_errors=[errors[i][c] for i, c in enumerate(defaults)],
        )
        self.history.append(entry)
        log.info(
            "LGreCo step %d: bytes %.0f -> %.0f (uniform -> chosen), error %.4g <= budget %.4g: %s",
            step,
            uniform_size,
            entry["bytes"],
            entry["error"],
            budget,
            self.choice,
        )
        return entry

    def _errors(
        self, compressor: Compressor, stat: Tensor, shape: Sequence[int], grid: Sequence[Any]
    ) -> tuple[list[float], list[float]]:
        """``(sizes, errors)`` of one layer's statistic, errors transformed as ``error`` asks."""
        sizes, errors = compressor.layer_costs(stat, shape, grid)
        if self.error == "feedback" and compressor.uses_error_feedback:
            errors = feedback_errors(errors, float(stat.double().norm()))
        return sizes, [x * x for x in errors] if self.error == "squared" else errors

    def grid(self, compressor: Compressor, shape: Sequence[int]) -> list[Any]:
        """The candidate values of one layer of ``shape``: ``candidates``, or the compressor's
        :meth:`~lightning_gradcomp.compressors.base.Compressor.candidate_grid` around its default, filtered by its
        :meth:`~lightning_gradcomp.compressors.base.Compressor.layer_candidates`."""
        base = (
            self.candidates
            if self.candidates is not None
            else compressor.candidate_grid(self.min_factor, self.max_factor, self.num_candidates)
        )
        return compressor.layer_candidates(shape, base)

    @staticmethod
    def _average(hook: Any, tables: list[list[float]]) -> list[list[float]]:
        """Mean of every rank's error table (one all-reduce of ``layers x max candidates`` float64)."""
        width = max(len(t) for t in tables)
        flat = torch.zeros(len(tables), width, dtype=torch.float64)
        for i, t in enumerate(tables):
            flat[i, : len(t)] = torch.tensor(t, dtype=torch.float64)
        flat = torch.nan_to_num(flat, nan=math.inf)
        device = getattr(hook, "device", None)
        if device is not None and device.type != "cpu":
            flat = flat.to(device)
        world = hook.comm.world_size
        if world > 1:
            hook.comm.all_reduce(flat)
        flat = flat.cpu() / world
        return [flat[i, : len(t)].tolist() for i, t in enumerate(tables)]

    def _log(self, pl_module: pl.LightningModule, entry: dict[str, Any]) -> None:
        metrics = {
            "lgreco/budget": float(entry["budget"]),
            "lgreco/uniform_bytes": float(entry["uniform_bytes"]),
            "lgreco/feasible": float(entry["feasible"]),
        }
        if entry["feasible"]:
            metrics["lgreco/error"] = float(entry["error"])
            metrics["lgreco/bytes"] = float(entry["bytes"])
            metrics["lgreco/bytes_saving"] = float(entry["uniform_bytes"]) / max(float(entry["bytes"]), 1e-12)
        if self.log_layers:
            for name, value in zip(entry["layers"], entry["values"]):
                metrics[f"lgreco/{name}"] = float(value)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The current choice, the last adjusted step and the history (plain types)."""
        return {"choice": dict(self.choice), "last_step": self._last_step, "history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the choice is re-applied when training starts."""
        self.choice = dict(state_dict.get("choice", {}))
        self._last_step = int(state_dict.get("last_step", -1))
        self.history = list(state_dict.get("history", []))

    def __repr__(self) -> str:
        return (
            f"LGreCo(period={self.period}, warmup_steps={self.warmup_steps}, "
            f"accumulate_steps={self.accumulate_steps}, alpha={self.alpha}, statistic={self.statistic!r}, "
            f"window={self.window!r})"
        )
