"""Failed collectives in plain words: telling them apart, and saying what a timeout most likely means.

A rank that *dies* closes its connections, and the others' next collective fails at once (gloo: ``Connection
closed by peer``). A rank that *hangs* (stopped, deadlocked, stuck on I/O, its node cut off the network) keeps them
open, and the others' collective fails only after the process group's timeout, in the backend's words (gloo:
``Timed out waiting 20000ms for recv operation to complete``, then ``Application timeout caused pair closure``).
Every collective of the library goes through :class:`~lightning_gradcomp.comm.Comm`, which turns such a timeout into
a :class:`CollectiveTimeoutError` saying which collective, on which group, after how long, what it most likely
means and which argument sets the timeout (:func:`timeout_message`); the strategies' failure hint
(:func:`failure_hint`) is built here too, so the DDP hook, Local SGD and SwarmSGD word them alike.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = [
    "TIMEOUT_SETTING",
    "CollectiveTimeoutError",
    "ExplainedWork",
    "explain",
    "explained",
    "failure_hint",
    "group_ranks",
    "group_timeout",
    "headline",
    "is_collective_failure",
    "is_timeout",
    "reraised",
    "timeout_message",
]

TIMEOUT_SETTING = "`timeout=` of the strategy"
"""Where a group's timeout comes from, as :func:`timeout_message` names it (the strategies' process-group timeout)."""

_COLLECTIVE_ERROR = re.compile(
    r"gloo|nccl|c10d|ProcessGroup|pair closure|Timed out waiting|"
    r"Connection (closed|reset) by peer|Broken pipe",
    re.IGNORECASE,
)
"""Messages of failed collectives (gloo's timeout reads "Application timeout caused pair closure")."""

_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_WAITED_MS = re.compile(r"Timed out waiting (\d+)\s*ms")
_HEADLINE = " timed out after "
"""In every message of :func:`timeout_message`: where it starts inside a message that wraps it."""


class CollectiveTimeoutError(RuntimeError):
    """A collective waited for another rank longer than its group's timeout (message: :func:`timeout_message`)."""


def is_collective_failure(exception: BaseException) -> bool:
    """Whether ``exception`` comes from a failed collective (a peer died, hung or the network broke)."""
    if isinstance(exception, CollectiveTimeoutError):
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exception, dist_error):
        return True
    return isinstance(exception, RuntimeError) and bool(_COLLECTIVE_ERROR.search(str(exception)))


def is_timeout(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective that ran out of time (a rank hung, or the network is partitioned).

    Example::

        >>> is_timeout(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv"))
        True
        >>> is_timeout(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:3"))
        False
    """
    return is_collective_failure(exception) and bool(_TIMEOUT.search(str(exception)))


def group_ranks(group: Optional[Any]) -> list[int]:
    """The global ranks of ``group`` (``None``: the default group); empty when there is no process group."""
    try:
        return list(dist.get_process_group_ranks(group or dist.group.WORLD))
    except (RuntimeError, ValueError, AttributeError):
        return []


def group_timeout(group: Optional[Any]) -> Optional[timedelta]:
    """The timeout ``group``'s collectives wait for (``None``: the default group), if the backend tells it."""
    try:
        pg = group or dist.group.WORLD
        return pg._get_backend(torch.device("cpu")).options._timeout  # type: ignore[union-attr]
    except (RuntimeError, ValueError, AttributeError):
        return None


def timeout_message(
    collective: str, ranks: Sequence[int], waited: Optional[timedelta], setting: str = TIMEOUT_SETTING
) -> str:
    """What a timed-out collective means: which one, on which group, after how long, and what to change.

    Example::

        >>> print(timeout_message("all_reduce", [0, 1, 2], timedelta(seconds=20)))  # doctest: +NORMALIZE_WHITESPACE
        collective all_reduce on the group of ranks 0, 1, 2 timed out after 0:00:20: a rank is probably hung or
        dead (stopped, deadlocked, stuck on I/O, or its node cut off the network), since a rank that exits closes
        its connections and fails the others at once. Check the other ranks' logs, then restart every rank from
        the last checkpoint (`trainer.fit(..., ckpt_path=...)`). The wait is set by `timeout=` of the strategy;
        raise it if a rank legitimately works alone that long (a checkpoint written on rank 0, a first compile).
    """
    members = ", ".join(map(str, ranks)) if ranks else "?"
    after = str(waited) if waited is not None else "its timeout"
    return (
        f"collective {collective} on the group of ranks {members}{_HEADLINE}{after}: a rank is probably hung or "
        f"dead (stopped, deadlocked, stuck on I/O, or its node cut off the network), since a rank that exits "
        f"closes its connections and fails the others at once. Check the other ranks' logs, then restart every "
        f"rank from the last checkpoint (`trainer.fit(..., ckpt_path=...)`). The wait is set by {setting}; raise "
        f"it if a rank legitimately works alone that long (a checkpoint written on rank 0, a first compile)."
    )


def explain(
    error: BaseException, collective: str, group: Optional[Any], setting: str = TIMEOUT_SETTING
) -> BaseException:
    """``error`` itself, or for a timeout not explained yet a :class:`CollectiveTimeoutError` that says what it
    means, ending in the backend's words (raise it ``from error``)."""
    if isinstance(error, CollectiveTimeoutError) or _HEADLINE in str(error) or not is_timeout(error):
        return error
    waited_ms = _WAITED_MS.search(str(error))
    waited = timedelta(milliseconds=int(waited_ms.group(1))) if waited_ms else group_timeout(group)
    message = timeout_message(collective, group_ranks(group), waited, setting)
    return CollectiveTimeoutError(f"{message} Backend error: {error}")


@contextmanager
def explained(collective: str, group: Optional[Any], setting: str = TIMEOUT_SETTING) -> Iterator[None]:
    """Run the block; a collective timeout in it is raised as :func:`explain`'s error."""
    try:
        yield
    except Exception as err:
        better = explain(err, collective, group, setting)
        if better is err:
            raise
        raise better from err


class ExplainedWork:
    """A ``dist.Work`` whose :meth:`wait` raises a timeout as :func:`explain`'s error."""

    def __init__(self, work: Any, collective: str, group: Optional[Any], setting: str = TIMEOUT_SETTING) -> None:
        self.work, self.collective, self.group, self.setting = work, collective, group, setting

    def wait(self) -> Any:
        """Wait for the collective (see ``dist.Work.wait``)."""
        with explained(self.collective, self.group, self.setting):
            return self.work.wait()

    def is_completed(self) -> bool:
        """Whether the collective has completed."""
        return bool(self.work.is_completed())


def headline(message: str) -> str:
    """``message`` from the start of a :func:`timeout_message` inside it (drops what wrapped it on its way: a
    ``Future`` callback's "Got the following error when running the callback: ...", pybind's "Unable to cast");
    ``message`` itself when it holds none."""
    at = message.find(_HEADLINE)
    start = message.rfind("collective ", 0, at) if at >= 0 else -1
    return message[start:] if start >= 0 else message


def reraised(error: BaseException, message: str) -> RuntimeError:
    """What a background thread's failed collective ``error`` is raised as on the main thread: ``message``, and
    for a timeout its explanation (a :class:`CollectiveTimeoutError`; raise it ``from error``)."""
    if is_timeout(error):
        return CollectiveTimeoutError(f"{message}: {headline(str(error))}")
    return RuntimeError(message)


def failure_hint(who: str, rank: int, world_size: int, timeout: Optional[timedelta], error: BaseException) -> str:
    """The message a strategy puts on a failed collective's ``error``: ``who`` and the rank in front, then the
    timeout explained (:func:`headline`; a collective of Lightning's or DDP's own explained here), or what any
    other failure most likely means."""
    message, prefix = str(error.args[0]) if error.args else str(error), f"{who} (rank {rank} of {world_size}): "
    if _HEADLINE in message:
        return prefix + headline(message)
    if is_timeout(error):
        explanation = timeout_message("(Lightning's or DDP's own)", range(world_size), timeout)
        return f"{prefix}{explanation} Backend error: {message}"
    return (
        f"{prefix}a collective failed. Another rank has most likely died (its connection closed) or stopped "
        f"responding for longer than the process-group timeout ({timeout}, `timeout=`). Check the other ranks' "
        f"logs, then restart every rank from the last checkpoint (`trainer.fit(..., ckpt_path=...)`). Original "
        f"error: {message}"
    )
