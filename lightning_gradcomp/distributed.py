"""Process-group settings shared by the strategies: the default timeout, telling a failed collective apart, and
releasing the private groups a strategy created."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT", "is_collective_failure", "release_group"]

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""Default process-group timeout of every strategy: how long a collective waits for a rank that stopped responding.

A rank that *dies* is noticed at once (its connections close); this bounds the wait on a rank that *hangs*.
Lightning's default is 30 minutes; see docs/reliability.md for the trade-off.
"""

_COLLECTIVE_ERROR = re.compile(
    r"gloo|nccl|c10d|ProcessGroup|pair closure|Timed out waiting|"
    r"Connection (closed|reset) by peer|Broken pipe",
    re.IGNORECASE,
)
"""Messages of failed collectives (gloo's timeout reads "Application timeout caused pair closure")."""


def is_collective_failure(exception: BaseException) -> bool:
    """Whether ``exception`` comes from a failed collective (a peer died, hung or the network broke)."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exception, dist_error):
        return True
    return isinstance(exception, RuntimeError) and bool(_COLLECTIVE_ERROR.search(str(exception)))


def release_group(group: Optional[Any]) -> bool:
    """Destroy ``group``, a process group this process created for itself; return whether one was destroyed.

    The strategies create private groups at setup (the hook's, the hierarchy's, the background exchanges') and
    release them at teardown, so a process that runs many fits (a sweep under ``torchrun``) holds none of the
    earlier fits' groups (on NCCL each holds a communicator and its device buffers). Destroying a group is local:
    nothing is exchanged with the other ranks. Nothing happens for ``None``, the default group, a group this rank is
    not a member of, one destroyed already, or when ``torch.distributed`` is not initialized. Call it only once no
    thread can issue a collective on ``group`` any more.
    """
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return False
    if group is dist.GroupMember.WORLD or group is dist.GroupMember.NON_GROUP_MEMBER:
        return False
    try:
        dist.destroy_process_group(group)
    except ValueError:  # "Invalid process group specified": not registered (any more)
        return False
    return True
