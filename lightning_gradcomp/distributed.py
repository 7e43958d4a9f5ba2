"""Process-group settings shared by the strategies: the default timeout and releasing the private groups a strategy
created (telling a failed collective apart: :mod:`lightning_gradcomp.failures`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT", "release_group"]

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""Default process-group timeout of every strategy: how long a collective waits for a rank that stopped responding.

A rank that *dies* is noticed at once (its connections close); this bounds the wait on a rank that *hangs*.
Lightning's default is 30 minutes; see docs/reliability.md for the trade-off.
"""


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
