"""One calibrated step's timeline, as the calibration records it (:class:`_Recorder`), and the median of the
measured steps as a :class:`~lightning_gradcomp.advise.costs.StepTrace` (:func:`_trace`; see
:mod:`lightning_gradcomp.advise.calibrate`)."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Union

from lightning_gradcomp.advise.costs import BucketTrace, Collective, Join, StepTrace

__all__: list[str] = []  # the calibration's own parts: _Recorder, _Step, _trace


@dataclass
class _Bucket:
    ready: float
    items: list[Union[float, Collective, Join]] = field(default_factory=list)


class _Recorder:
    """One step's timeline: buckets ready (any thread), each bucket's compute and collectives (its reducing thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.buckets: list[_Bucket] = []
        self._queued: list[_Bucket] = []
        self._current: Optional[_Bucket] = None
        self._last = 0.0
        self.finished = 0.0
        self.sharing: Optional[float] = None  # the current bucket's cross-node NIC multiplier (hierarchy)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def start_step(self) -> None:
        with self._lock:
            self.t0 = time.perf_counter()
            self.buckets, self._queued, self._current, self.finished = [], [], None, 0.0

    def ready(self) -> None:
        with self._lock:
            bucket = _Bucket(self.now())
            self.buckets.append(bucket)
            self._queued.append(bucket)

    def begin(self) -> None:
        with self._lock:
            self._current = self._queued.pop(0) if self._queued else _Bucket(self.now())
            self._last = self.now()

    def exclude(self, start: float) -> None:
        """The time since ``start`` was the calibration's own work, not the step's: remove it from the timeline."""
        with self._lock:
            self.t0 += max(0.0, self.now() - start)

    def collective(self, record: Collective, start: float, end: float) -> None:
        with self._lock:
            if self._current is None:
                return
            self._current.items += [max(0.0, start - self._last), record]
            self._last = end

    def join(self, start: float, end: float) -> None:
        with self._lock:
            if self._current is not None:
                self._current.items += [max(0.0, start - self._last), Join()]
                self._last = end

    def end(self) -> None:
        with self._lock:
            if self._current is not None:
                self._current.items.append(max(0.0, self.now() - self._last))
                self.finished = max(self.finished, self.now())
                self._current = None


@dataclass
class _Step:
    """One measured step: its buckets, when its last reduction ended and its length (seconds from its start)."""

    buckets: list[_Bucket]
    finished: float
    length: float


def _trace(steps: list[_Step], compute_only: float) -> StepTrace:
    """The item-by-item median of the measured steps; the median step when their shapes differ."""
    shapes = [[[i if not isinstance(i, float) else None for i in b.items] for b in s.buckets] for s in steps]
    same = all(shape == shapes[0] for shape in shapes)
    if not same:
        ordered = sorted(steps, key=lambda s: s.length)
        steps = [ordered[len(ordered) // 2]]
    buckets = []
    for b, first in enumerate(steps[0].buckets):
        items: list[Union[float, Collective, Join]] = []
        for i, item in enumerate(first.items):
            if isinstance(item, float):
                items.append(statistics.median(float(s.buckets[b].items[i]) for s in steps))  # type: ignore[arg-type]
            else:
                items.append(item)
        buckets.append(BucketTrace(statistics.median(s.buckets[b].ready for s in steps), tuple(items)))
    last = statistics.median(max(s.finished, s.buckets[-1].ready if s.buckets else 0.0) for s in steps)
    tail = max(0.0, statistics.median(s.length for s in steps) - last)
    return StepTrace(tuple(buckets), tail, compute_only)
