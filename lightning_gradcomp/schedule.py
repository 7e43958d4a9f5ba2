"""Compression schedules: the compression parameter (density, rank, bits) as a function of the optimizer step.

A schedule maps ``(step, target)`` to the uniform parameter used at that step, where ``target`` is the
compressor's own parameter (``CLTK(density=0.01)`` -> 0.01). The usual one is a **warm-up**: start lightly
compressed and ramp to the target in a few geometric stages (DGC's 25 % -> 6.25 % -> 1.56 % -> target), instead
of a dense phase that costs full bytes. ::

    GradCompStrategy(compressor=CLTK(density=0.01), schedule=WarmupSchedule(steps=300, start=0.25))
    GradCompStrategy(compressor=CLTK(density=0.01), schedule={0: 0.25, 100: 0.05, 200: 0.02})   # {step: value}
    GradCompStrategy(compressor=PowerSGD(rank=4), schedule=WarmupSchedule(steps=200, start=32))

Per-layer parameters (L-GreCo's choices, ``set_layer_params``) follow the schedule *relative to the target*:
see :func:`follow_schedule`. The schedule is configuration; what it gives at a step depends only on the step,
which is in the checkpoint, so a resumed run uses the same values as the uninterrupted one.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

from lightning_gradcomp.checks import ArgumentTypeError, check_int, check_number, is_int
from lightning_gradcomp.compressors.base import Compressor

__all__ = [
    "CallableSchedule",
    "CompressionSchedule",
    "StepSchedule",
    "WarmupSchedule",
    "as_schedule",
    "follow_schedule",
    "scheduled_param",
]


class CompressionSchedule(ABC):
    """The uniform compression parameter at an optimizer step."""

    @abstractmethod
    def value(self, step: int, target: Any) -> float:
        """The parameter at ``step`` (0-based optimizer steps), given the compressor's ``target``; may be
        fractional for integer parameters (the caller rounds)."""

    def check(self, compressor: Compressor) -> None:  # noqa: B027 - optional hook: by default every value is valid
        """Raise ``ValueError`` if a value this schedule can give is invalid for ``compressor``."""


class WarmupSchedule(CompressionSchedule):
    """Geometric ramp from ``start`` to the target in ``stages`` equal stages over the first ``steps`` steps.

    Stage ``i`` (steps ``[i * steps / stages, (i + 1) * steps / stages)``) uses
    ``start * (target / start) ** (i / stages)``; from ``steps`` on, the target. DGC's density warm-up
    (25 %, 6.25 %, 1.56 %, 0.4 % over 4 epochs) is ``WarmupSchedule(steps=4 * epoch, start=0.25, stages=4)``
    with target 0.001. For a rank or a bit width, ``start`` is the larger starting value.

    Args:
        steps: length of the warm-up in optimizer steps (>= 1).
        start: the parameter at step 0 (a density in (0, 1], a rank >= 1, a bit width).
        stages: number of constant stages (>= 1).
    """

    def __init__(self, steps: int, start: float, stages: int = 4) -> None:
        self.steps = check_int("steps", steps, 1)
        self.start = float(check_number("start", start, 0.0, float("inf"), high_open=True))
        self.stages = check_int("stages", stages, 1)

    def value(self, step: int, target: Any) -> float:
        if step >= self.steps:
            return target
        stage = min(self.stages - 1, step * self.stages // self.steps)
        return self.start * (float(target) / self.start) ** (stage / self.stages)

    def check(self, compressor: Compressor) -> None:
        compressor.check_param(_as_param(compressor, self.start))

    def __repr__(self) -> str:
        return f"WarmupSchedule(steps={self.steps}, start={self.start}, stages={self.stages})"


class StepSchedule(CompressionSchedule):
    """Piecewise constant: ``values[s]`` from step ``s`` until the next key; the target before the first key.

    Args:
        values: ``{step: parameter}`` with steps >= 0 (YAML: ``{0: 0.25, 100: 0.05, 200: 0.02}``).
    """

    def __init__(self, values: Mapping[int, float]) -> None:
        if not isinstance(values, Mapping) or not values:
            raise ValueError(f"`schedule` as a mapping must be a non-empty {{step: value}}, got {values!r}")
        checked = {}
        for step, value in values.items():
            key = int(step) if isinstance(step, str) and step.strip().isdigit() else step
            check_int("schedule step", key, 0)
            check_number(f"schedule value at step {key}", value, 0.0, float("inf"), high_open=True)
            checked[int(key)] = float(value)
        self.values = dict(sorted(checked.items()))

    def value(self, step: int, target: Any) -> float:
        current: float = target
        for start, value in self.values.items():
            if step < start:
                break
            current = value
        return current

    def check(self, compressor: Compressor) -> None:
        for step, value in self.values.items():
            try:
                compressor.check_param(_as_param(compressor, value))
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f"`schedule` value {value!r} at step {step} is invalid for {compressor!r}: {err}"
                ) from err

    def __repr__(self) -> str:
        return f"StepSchedule({self.values})"


class CallableSchedule(CompressionSchedule):
    """Any ``fn(step) -> parameter`` (validated at every use)."""

    def __init__(self, fn: Callable[[int], float]) -> None:
        if not callable(fn):
            raise ArgumentTypeError(f"`schedule` must be callable, got {fn!r}")
        self.fn = fn

    def value(self, step: int, target: Any) -> float:
        return self.fn(step)

    def __repr__(self) -> str:
        return f"CallableSchedule({self.fn!r})"


ScheduleSpec = Union[CompressionSchedule, Mapping[int, float], Callable[[int], float], None]
"""What ``GradCompStrategy(schedule=...)`` accepts."""


def as_schedule(spec: ScheduleSpec, compressor: Compressor) -> Optional[CompressionSchedule]:
    """Turn a user's ``schedule=`` into a checked :class:`CompressionSchedule` (``None`` stays ``None``).

    Raises:
        ValueError: ``compressor`` has no compression parameter, or a value is outside its range.
        TypeError: ``spec`` is none of the accepted kinds.
    """
    if spec is None:
        return None
    compressor.require_param("schedule")
    if isinstance(spec, CompressionSchedule):
        schedule = spec
    elif isinstance(spec, Mapping):
        schedule = StepSchedule(spec)
    elif callable(spec):
        schedule = CallableSchedule(spec)
    else:
        raise ArgumentTypeError(
            f"`schedule` must be a CompressionSchedule, a {{step: value}} mapping or a callable, got {spec!r}"
        )
    schedule.check(compressor)
    return schedule


def follow_schedule(choice: Any, target: Any, scheduled: Any, family: str) -> float:
    """A per-layer parameter ``choice`` (made for the uniform ``target``) moved along with the schedule.

    ``density`` and ``rank`` scale by ``scheduled / target``; ``bits`` shift by ``scheduled - target``. So a layer
    L-GreCo gave twice the target density keeps twice the scheduled density during a warm-up.
    """
    if family == "bits":
        return float(choice) + float(scheduled) - float(target)
    return float(choice) * float(scheduled) / float(target)


def scheduled_param(compressor: Compressor, base: Any, scheduled: Any) -> Any:
    """``base`` (a layer's parameter at the target) at the ``scheduled`` uniform value, valid for ``compressor``.

    Clips into the compressor's range (a density at most 1, a rank at least 1); if the moved value is still
    invalid, the scheduled uniform value is used.
    """
    target = compressor.default_param
    family = compressor.param_name or ""
    moved = scheduled if base == target else follow_schedule(base, target, scheduled, family)
    if family in ("density", "ratio"):  # "ratio": a compressor declared before the rename
        moved = min(1.0, float(moved))
    try:
        return compressor.check_param(_as_param(compressor, moved))
    except (TypeError, ValueError):
        return compressor.check_param(_as_param(compressor, scheduled))


def _as_param(compressor: Compressor, value: Any) -> Any:
    """Round to an integer for integer parameters (rank, bits), at least 1."""
    if is_int(compressor.default_param):
        return max(1, int(math.floor(float(value) + 0.5)))
    return float(value)
