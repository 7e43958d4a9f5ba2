"""Process-group settings shared by the strategies: the default timeout, and telling a failed collective apart."""

from __future__ import annotations

import re
from datetime import timedelta

import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT", "is_collective_failure"]

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
