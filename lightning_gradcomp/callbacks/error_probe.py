"""The relative compression error ``||p - C(p)|| / ||p||``, measured per layer at sampled steps by a hook observer
(:class:`ErrorProbe`; see :mod:`lightning_gradcomp.callbacks.logger`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_gradcomp.hook import BucketRecord

__all__ = ["ErrorProbe", "StepError"]


@dataclass
class StepError:
    """The measured compression error of one step on this rank.

    Attributes:
        step: the engine's step counter at the measurement.
        error: relative error over all compressed layers (``nan`` if the input was zero).
        layers: per-layer ``(||r||^2, ||p||^2)``.
    """

    step: int
    error: float
    layers: dict[str, tuple[float, float]] = field(default_factory=dict)


def _relative_error(r2: float, p2: float) -> float:
    """``sqrt(r2 / p2)`` from the squared norms of the residual and the input (``nan`` when ``p2`` is 0)."""
    return math.sqrt(r2 / p2) if p2 > 0 else float("nan")


class ErrorProbe:
    """A hook observer that measures ``||p - C(p)||`` and ``||p||`` per layer at sampled steps.

    Squared norms are kept as device tensors until :meth:`drain` (one host sync per drained step).
    Compressors that report neither residuals nor their local contribution are skipped
    (:attr:`unsupported` becomes True).

    Args:
        every: sample every ``every``-th compressed step (0 disables).
        start_step: the first compressed step (sampled).
    """

    def __init__(self, every: int, start_step: int = 0) -> None:
        self.every = every
        self.start_step = start_step
        self.unsupported = False
        self.totals: dict[str, list[float]] = {}
        self._pending: dict[int, list[tuple[str, Tensor, Tensor]]] = {}

    def wants(self, step: int) -> bool:
        """Sample ``start_step`` and every ``every``-th step after it."""
        return self.every > 0 and step >= self.start_step and (step - self.start_step) % self.every == 0

    def __call__(self, record: BucketRecord) -> None:
        """Queue the squared norms of one bucket's residuals and inputs."""
        if record.residuals is None:
            self.unsupported = True
            return
        items = self._pending.setdefault(record.step, [])
        names = {slot.name for slot in record.slots}
        items[:] = [item for item in items if item[0] not in names]  # a later synced pass of the same step replaces
        for slot, p, r in zip(record.slots, record.inputs, record.residuals):
            items.append((slot.name, torch.linalg.vector_norm(r).square(), torch.linalg.vector_norm(p).square()))

    @property
    def pending(self) -> bool:
        """Whether measurements wait to be drained."""
        return bool(self._pending)

    def drain(self) -> list[StepError]:
        """Turn queued measurements into :class:`StepError` (step order) and add them to :attr:`totals`."""
        out = []
        for step in sorted(self._pending):
            items = self._pending[step]
            values = torch.stack([torch.stack([r2, p2]).float() for _, r2, p2 in items]).double().tolist()
            layers = {}
            for (name, _, _), (r2, p2) in zip(items, values):
                layers[name] = (r2, p2)
                total = self.totals.setdefault(name, [0.0, 0.0])
                total[0] += r2
                total[1] += p2
            r2_sum, p2_sum = sum(v[0] for v in values), sum(v[1] for v in values)
            out.append(StepError(step, _relative_error(r2_sum, p2_sum), layers))
        self._pending.clear()
        return out

    def layer_errors(self) -> dict[str, float]:
        """Per-layer error pooled over every drained sample: ``sqrt(sum ||r||^2 / sum ||p||^2)``."""
        return {name: _relative_error(r2, p2) for name, (r2, p2) in self.totals.items()}

    def total_error(self) -> float:
        """Error pooled over every layer and sample (``nan`` before any)."""
        r2 = sum(v[0] for v in self.totals.values())
        p2 = sum(v[1] for v in self.totals.values())
        return _relative_error(r2, p2)
