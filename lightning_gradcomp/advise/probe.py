"""``advise --probe``: measure the links of a real job (torchrun, SLURM) with a timed ping-pong.

Every rank of the job runs the command. Rank 0 and the first rank of the second node (``LOCAL_WORLD_SIZE``, the
processes per node) exchange a small message and a large one back and forth; with two or more processes per node,
ranks 0 and 1 do the same inside the node. Half the median round trip of the small message is the latency; the
large message's one-way time less that latency gives the bandwidth. The other ranks wait at a barrier.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from lightning_gradcomp.advise.costs import Link

__all__ = ["fit_link", "ping_pong", "probe_links"]


def fit_link(small_bytes: int, small_seconds: float, large_bytes: int, large_seconds: float) -> Link:
    """The :class:`Link` through two one-way times: ``t = alpha + B / bw`` at both sizes.

    >>> fit_link(8, 1e-4, 1_000_008, 1e-4 + 1e-2)
    Link(bandwidth=100000000.0, latency=9.992e-05, burst=0.0)

    Raises:
        ValueError: the large message was not slower than the small one (too small to measure).
    """
    if large_bytes <= small_bytes or large_seconds <= small_seconds:
        raise ValueError(
            f"the large message ({large_bytes} B, {large_seconds:.3g} s) must be larger and slower than the small one "
            f"({small_bytes} B, {small_seconds:.3g} s): use a larger `--probe-bytes`"
        )
    bandwidth = (large_bytes - small_bytes) / (large_seconds - small_seconds)
    return Link(bandwidth, max(0.0, small_seconds - small_bytes / bandwidth))


def ping_pong(peer: int, nbytes: int, repeats: int, device: torch.device, initiator: bool) -> float:
    """Median one-way seconds of ``nbytes`` between this rank and ``peer`` (half a round trip)."""
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats + 1):  # the first round trip sets up the connection
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if initiator:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / 2


def _probe_pair(peer_of_zero: int, large: int, repeats: int, device: torch.device) -> Optional[Link]:
    """Ping-pong between rank 0 and ``peer_of_zero``; the link on rank 0, ``None`` elsewhere."""
    rank = dist.get_rank()
    if rank not in (0, peer_of_zero):
        return None
    peer = peer_of_zero if rank == 0 else 0
    small_t = ping_pong(peer, 8, repeats, device, rank == 0)
    large_t = ping_pong(peer, large, max(3, repeats // 4), device, rank == 0)
    return fit_link(8, small_t, 4 * max(1, large // 4), large_t) if rank == 0 else None


def probe_links(
    large: int = 16 * 2**20, repeats: int = 20, device: Optional[torch.device] = None
) -> tuple[int, int, Optional[Link], Optional[Link]]:
    """In a running job (``init_process_group`` done): ``(nodes, procs_per_node, inter, intra)``, the links on rank 0
    (``None`` on the other ranks, and ``inter`` / ``intra`` ``None`` where there is no second node / process).

    Nodes are read as ``WORLD_SIZE / LOCAL_WORLD_SIZE`` (torchrun and Lightning's SLURM launch set both).
    """
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if per_node < 1 or world % per_node:
        raise ValueError(f"LOCAL_WORLD_SIZE={per_node} does not divide the world size {world}")
    dev = device or torch.device("cpu")
    inter = intra = None
    if world // per_node > 1:
        inter = _probe_pair(per_node, large, repeats, dev)
    dist.barrier()
    if per_node > 1:
        intra = _probe_pair(1, large, repeats, dev)
    dist.barrier()
    return world // per_node, per_node, inter, intra
