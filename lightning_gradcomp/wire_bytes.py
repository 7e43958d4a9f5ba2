"""The bytes one rank sends in each collective, and the compression they make.

Pure functions of a payload and a world size, so tests can check counts against them without processes. The
table of the formulas is :mod:`lightning_gradcomp.comm`'s, whose :class:`~lightning_gradcomp.comm.Comm` counts
every collective with them.
"""

from __future__ import annotations

import math

from torch import Tensor

__all__ = [
    "all_gather_bytes",
    "all_reduce_bytes",
    "all_to_all_bytes",
    "broadcast_bytes",
    "compression_ratio",
    "p2p_bytes",
    "sparse_payload_bytes",
]


def all_reduce_bytes(payload_bytes: int, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``payload_bytes``."""
    return 2.0 * (world_size - 1) / world_size * payload_bytes


def all_gather_bytes(payload_bytes: int, world_size: int) -> float:
    """Bytes one rank sends in an all-gather where every rank contributes ``payload_bytes``."""
    return float((world_size - 1) * payload_bytes)


def broadcast_bytes(payload_bytes: int, world_size: int) -> float:
    """Mean bytes per rank of a broadcast of ``payload_bytes``: ``(W - 1) B`` in total over ``W`` ranks."""
    return (world_size - 1) / world_size * payload_bytes


def all_to_all_bytes(payload_bytes: int, world_size: int) -> float:
    """Bytes one rank sends in an all-to-all of a ``payload_bytes`` input split into W chunks."""
    return (world_size - 1) / world_size * payload_bytes


def p2p_bytes(payload_bytes: int, world_size: int) -> float:
    """Bytes sent by a point-to-point send of ``payload_bytes``."""
    return float(payload_bytes)


def compression_ratio(dense_bytes: float, wire_bytes: float) -> float:
    """The compression, dense / wire bytes: how many times fewer bytes were sent than dense DDP would have sent.

    ``dense_bytes / wire_bytes`` when something was sent; ``1.0`` when nothing was due and nothing was sent (no
    traffic yet: nothing saved); ``inf`` when bytes were due but none were sent (a layer that another rank owns
    under ``hierarchy=``, a one-node hierarchy, LocalSGD's local steps before the first synchronization).
    :attr:`CommStats.compression_ratio`, :attr:`LayerStats.compression`, ``CompressionLogger``, ``CompressionGuard``
    and ``lightning-gradcomp report`` all use it.

    Example::

        >>> compression_ratio(400.0, 100.0), compression_ratio(0.0, 0.0), compression_ratio(400.0, 0.0)
        (4.0, 1.0, inf)
    """
    if wire_bytes > 0:
        return dense_bytes / wire_bytes
    return math.inf if dense_bytes > 0 else 1.0


def sparse_payload_bytes(tensor: Tensor) -> int:
    """Bytes of a sparse COO tensor's payload: its indices (int64, ``sparse_dim x nnz``) and its values."""
    return tensor._indices().numel() * 8 + tensor._values().numel() * tensor.element_size()
