"""The cluster the cost model prices: links (latency and bandwidth), nodes of processes, and process groups on them.

Pure arithmetic on floats (:mod:`lightning_gradcomp.advise.costs`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["Group", "Link", "Topology", "groups_for", "parse_link"]

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|b|bps|byte|bytes)(?:/s)?\s*$", re.IGNORECASE)
_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|ms|us|µs|ns)\s*$", re.IGNORECASE)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}


@dataclass(frozen=True)
class Link:
    """One hop: ``latency`` (alpha, seconds) plus ``nbytes / bandwidth`` (bytes per second).

    ``burst`` (bytes) models a token-bucket-shaped link (``tc tbf``, the bench's emulated links; 0 for a real NIC): up
    to ``burst`` bytes that follow an idle period pass at once, the bucket refilling at ``bandwidth`` while the link
    is idle (:func:`simulate_step`).
    """

    bandwidth: float
    latency: float = 0.0
    burst: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not math.isfinite(self.bandwidth):
            raise ValueError(f"`bandwidth` must be a positive number of bytes/s, got {self.bandwidth!r}")
        if not self.latency >= 0 or not math.isfinite(self.latency):
            raise ValueError(f"`latency` must be >= 0 s, got {self.latency!r}")

    def seconds(self, nbytes: float) -> float:
        """One message of ``nbytes`` over this hop."""
        return self.latency + nbytes / self.bandwidth

    def describe(self) -> str:
        """E.g. ``"25 Gbit/s, 5 us"``."""
        bits = 8 * self.bandwidth
        unit, scale = next(((u, s) for u, s in (("Tbit", 1e12), ("Gbit", 1e9), ("Mbit", 1e6))
                            if bits >= s), ("kbit", 1e3))  # fmt: skip
        return f"{bits / scale:g} {unit}/s, {self.latency * 1e6:g} us"


def parse_link(text: str, default_latency: float = 0.0, name: str = "link") -> Link:
    """``"BANDWIDTH[,LATENCY]"`` as a :class:`Link`: ``"25gbit,5us"``, ``"100mbit"``, ``"12.5GB,2us"``.

    Bandwidth units: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` (bits per second) or ``b``/``kb``/``mb``/``gb``
    (bytes per second, also ``GB/s``); latency units ``s``, ``ms``, ``us``, ``ns``.

    Example::

        >>> parse_link("100mbit,50us")
        Link(bandwidth=12500000.0, latency=5e-05, burst=0.0)

    Raises:
        ValueError: anything else; the message names ``name``.
    """
    rate, _, delay = str(text).partition(",")
    match = _RATE.match(rate)
    if not match:
        raise ValueError(f"`{name}` must look like 25gbit,5us or 100mbit (BANDWIDTH[,LATENCY]), got {text!r}")
    value = float(match.group(1)) * _SCALE[match.group(2).lower()]
    bandwidth = value / 8 if match.group(3).lower() in ("bit", "bps") else value
    latency = default_latency
    if delay.strip():
        found = _TIME.match(delay)
        if not found:
            raise ValueError(f"`{name}`: the latency must look like 5us, 0.2ms or 1e-3s... got {delay!r}")
        latency = float(found.group(1)) / _PER_SECOND[found.group(2).lower()]
    try:
        return Link(bandwidth, latency)
    except ValueError as err:
        raise ValueError(f"`{name}`: {err}") from None


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``procs_per_node`` ranks: one NIC per node on ``inter``, ``intra`` inside a node.

    ``cpu_copies``: the ranks compute on CPU cores, which also copy the bytes that stay inside the node (loopback TCP,
    shared memory): each such byte costs those cores ``1 / intra.bandwidth`` seconds to send and again to receive,
    time the step's compute loses (:func:`~.collectives.loopback_seconds`). False for GPUs (NVLink, PCIe DMA).
    """

    nodes: int
    procs_per_node: int
    inter: Link
    intra: Link
    cpu_copies: bool = False

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.procs_per_node < 1:
            raise ValueError(f"need nodes >= 1 and procs_per_node >= 1, got {self.nodes}, {self.procs_per_node}")

    @property
    def world_size(self) -> int:
        """W = N * G."""
        return self.nodes * self.procs_per_node

    def with_nodes(self, nodes: int) -> Topology:
        """The same cluster with ``nodes`` nodes."""
        return Topology(nodes, self.procs_per_node, self.inter, self.intra, self.cpu_copies)


@dataclass(frozen=True)
class Group:
    """The shape of a process group on a topology.

    Attributes:
        size: ranks in the group (``n``).
        nodes: nodes it spans; 1 means all its traffic stays on ``intra``.
        per_node: its ranks on each node it spans.
        sharing: groups of the same kind that send through one NIC at the same time (``s``: the ``G`` cross-node
            groups of a hierarchy, one per local rank).
    """

    size: int
    nodes: int
    per_node: int
    sharing: float = 1


def groups_for(topology: Topology) -> dict[str, Group]:
    """The groups a trace may use on ``topology``: ``"world"`` (all ranks, node-ordered), ``"intra"`` (one node),
    ``"cross"`` (one rank per node; the ``G`` of them share each NIC); FSDP2's (HSDP's) ``"shard"`` group has the
    shape of ``"intra"`` (a replica sharded over the node) and its ``"replicate"`` group that of ``"cross"``."""
    n, g = topology.nodes, topology.procs_per_node
    return {
        "world": Group(n * g, n, g),
        "intra": Group(g, 1, g),
        "cross": Group(n, n, 1, sharing=g),
        "shard": Group(g, 1, g),
        "replicate": Group(n, n, 1, sharing=g),
    }
