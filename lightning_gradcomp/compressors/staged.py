"""Per-layer compressor state whose changes take effect only when an optimizer step consumes the gradient.

A compressor keeps its persistent per-layer state (PowerSGD's warm-start ``Q``, DIANA's shifts, SignSGD's
server memories) in a :class:`StagedState` instead of a plain dict. Reading an entry during a reduction
returns a *working copy* of the committed value, which the compressor may change in place; assigning an
entry stages a new value. The engine then either commits the entries of the layers an optimizer stepped,
or discards everything staged (the gradient was thrown away: ``zero_grad()`` before a step, a skipped AMP
step, a parameter that no optimizer stepped). So a backward pass whose gradient nobody uses leaves no trace.

Staging is off until the engine turns it on (:attr:`StagedState.staging`, set when an optimizer is attached to
the hook): then reads and writes go straight to the committed values, as with a plain dict, which is what
code that calls ``Compressor.reduce`` directly (tests, benchmarks) expects.

Cost: one copy of each entry that a reduction reads, the first time it reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Optional

from torch import Tensor

__all__ = ["StagedState", "drop_staged"]


def drop_staged(staged: dict[str, Any], names: Optional[Iterable[str]] = None) -> None:
    """Remove the entries of ``names`` from ``staged`` (every entry when ``None``; absent names are skipped)."""
    if names is None:
        staged.clear()
        return
    for name in names:
        staged.pop(name, None)


def _copy(value: Any) -> Any:
    """A deep copy of a tensor, or of a dict of tensors and numbers, on the same device."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


class StagedState:
    """A ``name -> value`` store with staged writes (values: tensors, or dicts of tensors and numbers).

    ``store.get(name)`` / ``store[name]`` return the staged working copy (made from the committed value on
    first access); ``store[name] = value`` stages ``value``; :meth:`commit` and :meth:`discard` end the
    transaction. ``items()``, ``keys()``, ``len()`` and iteration show the **committed** values (what a
    checkpoint saves).
    """

    def __init__(self, committed: Optional[dict[str, Any]] = None) -> None:
        self.committed: dict[str, Any] = dict(committed or {})
        self.staged: dict[str, Any] = {}
        self.staging = False

    def get(self, name: str, default: Any = None) -> Any:
        """The working copy of ``name`` (``default`` when it has no value)."""
        if not self.staging:
            return self.committed.get(name, default)
        if name in self.staged:
            return self.staged[name]
        if name in self.committed:
            self.staged[name] = _copy(self.committed[name])
            return self.staged[name]
        return default

    def peek(self, name: str, default: Any = None) -> Any:
        """The value a reader should see, without making a working copy (do not modify it in place)."""
        return self.staged.get(name, self.committed.get(name, default))

    def __getitem__(self, name: str) -> Any:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def __setitem__(self, name: str, value: Any) -> None:
        (self.staged if self.staging else self.committed)[name] = value

    def __contains__(self, name: object) -> bool:
        return name in self.staged or name in self.committed

    def commit(self, names: Optional[Iterable[str]] = None) -> None:
        """Make the staged values of ``names`` (all when ``None``) the committed ones; keep the rest staged."""
        for name in list(self.staged) if names is None else names:
            if name in self.staged:
                self.committed[name] = self.staged.pop(name)

    def discard(self, names: Optional[Iterable[str]] = None) -> None:
        """Drop the staged values of ``names`` (all when ``None``)."""
        drop_staged(self.staged, names)

    def load(self, committed: dict[str, Any]) -> None:
        """Replace the committed values (a checkpoint) and drop anything staged."""
        self.committed = dict(committed)
        self.staged.clear()

    def clear(self) -> None:
        """Forget everything."""
        self.committed.clear()
        self.staged.clear()

    def items(self) -> Iterable[tuple[str, Any]]:
        """Committed ``(name, value)`` pairs."""
        return self.committed.items()

    def keys(self) -> Iterable[str]:
        """Names with a committed value."""
        return self.committed.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self.committed)

    def __len__(self) -> int:
        return len(self.committed)

    def __repr__(self) -> str:
        return f"StagedState(committed={sorted(self.committed)}, staged={sorted(self.staged)})"
