"""The seconds of one collective on a topology, and the bytes it sends through a node's NIC (the table of formulas
is :mod:`lightning_gradcomp.advise.costs`'s)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal, Optional

from lightning_gradcomp.advise.costs.topology import Group, Link, Topology

__all__ = [
    "COLLECTIVES",
    "Collective",
    "all_gather_seconds",
    "all_reduce_seconds",
    "all_to_all_seconds",
    "broadcast_seconds",
    "collective_seconds",
    "loopback_seconds",
    "nic_bytes",
    "p2p_seconds",
    "reduce_scatter_seconds",
]

Kind = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p"]
COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p")
"""The collective kinds the model prices."""


def _slowest(topology: Topology, group: Group) -> Link:
    """The hop that limits a ring over ``group``: the inter-node link when it spans nodes (bandwidth shared by
    ``sharing`` groups), else the intra-node one; with the slower of the two latencies."""
    if group.nodes <= 1:
        return topology.intra
    inter = Link(topology.inter.bandwidth / group.sharing, topology.inter.latency)
    if group.per_node <= 1:
        return inter
    return Link(min(inter.bandwidth, topology.intra.bandwidth), max(inter.latency, topology.intra.latency))


def all_reduce_seconds(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` per rank over ``n`` ranks: ``2 (n-1)/n B / bw + 2 (n-1) alpha``.

    >>> all_reduce_seconds(1e6, 4, Link(1e6, 1e-3))  # 1.5 s of bytes + 6 hops of 1 ms
    1.506
    """
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def all_gather_seconds(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather, ``nbytes`` from every rank: ``(n-1) B / bw + (n-1) alpha``."""
    if n <= 1:
        return 0.0
    return (n - 1) * nbytes / link.bandwidth + (n - 1) * link.latency


def reduce_scatter_seconds(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of an ``nbytes`` input per rank: ``(n-1)/n B / bw + (n-1) alpha`` (FSDP's)."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def broadcast_seconds(nbytes: float, n: int, link: Link) -> float:
    """Binomial-tree broadcast (gloo's): ``ceil(log2 n)`` rounds of one message, ``ceil(log2 n) (B / bw + alpha)``."""
    if n <= 1:
        return 0.0
    return math.ceil(math.log2(n)) * link.seconds(nbytes)


def all_to_all_seconds(sent_bytes: float, n: int, link: Link) -> float:
    """Pairwise all-to-all where this rank sends ``sent_bytes`` to the others: ``S / bw + (n-1) alpha``."""
    if n <= 1:
        return 0.0
    return sent_bytes / link.bandwidth + (n - 1) * link.latency


def p2p_seconds(nbytes: float, n: int, link: Link) -> float:
    """One send of ``nbytes`` (and the matching receive): ``B / bw + alpha``."""
    return link.seconds(nbytes) if n > 1 else 0.0


@dataclass(frozen=True)
class Collective:
    """One collective a reduction issued, as the calibration recorded it.

    Attributes:
        kind: one of :data:`COLLECTIVES`.
        nbytes: the payload of one rank (bytes): the input of an all-reduce, broadcast or reduce-scatter, one rank's
            contribution to an all-gather, the bytes this rank sends to *other* ranks in an all-to-all.
        group: ``"world"``, ``"intra"`` or ``"cross"`` (:func:`groups_for`).
        blocking: the issuing thread waits for it.
        decode: seconds of work that follows its completion (an asynchronous collective's ``Future`` callback).
        sharing: when set, replaces the group's :attr:`Group.sharing`: how many times this rank's bytes cross its
            NIC in all (a hierarchy's cross-node collective of a rank owning a fraction ``f`` of the bucket: ``1/f``).
    """

    kind: str
    nbytes: float
    group: str = "world"
    blocking: bool = False
    decode: float = 0.0
    sharing: Optional[float] = None


def _group_of(c: Collective, groups: Mapping[str, Group]) -> Group:
    group = groups[c.group]
    return group if c.sharing is None else replace(group, sharing=c.sharing)


def collective_seconds(c: Collective, topology: Topology, groups: Mapping[str, Group]) -> float:
    """Seconds of ``c`` on ``topology``, its group shaped by ``groups``."""
    group = _group_of(c, groups)
    n = group.size
    if n <= 1:
        return 0.0
    if c.kind == "broadcast" and group.nodes > 1 and group.per_node > 1:  # the tree crosses nodes, then the node
        inter = Link(topology.inter.bandwidth / group.sharing, topology.inter.latency)
        return broadcast_seconds(c.nbytes, group.nodes, inter) + broadcast_seconds(
            c.nbytes, group.per_node, topology.intra
        )
    if c.kind == "all_to_all" and group.nodes > 1 and group.per_node > 1:
        out = c.nbytes * (n - group.per_node) / (n - 1)  # the share of its bytes that leaves the node
        inside = c.nbytes - out
        nic = Link(topology.inter.bandwidth / group.sharing, topology.inter.latency)
        return max(out * group.per_node / nic.bandwidth, inside / topology.intra.bandwidth) + (n - 1) * max(
            nic.latency, topology.intra.latency
        )
    link = _slowest(topology, group)
    price = {
        "all_reduce": all_reduce_seconds,
        "all_gather": all_gather_seconds,
        "reduce_scatter": reduce_scatter_seconds,
        "broadcast": broadcast_seconds,
        "all_to_all": all_to_all_seconds,
        "p2p": p2p_seconds,
    }.get(c.kind)
    if price is None:
        raise ValueError(f"unknown collective kind {c.kind!r}; known: {', '.join(COLLECTIVES)}")
    return price(c.nbytes, n, link)


_SENT = {  # the bytes one rank of an n-rank group sends for a payload B (all_to_all's B is already what it sends)
    "all_reduce": lambda b, n: 2 * (n - 1) / n * b,
    "all_gather": lambda b, n: (n - 1) * b,
    "reduce_scatter": lambda b, n: (n - 1) / n * b,
    "broadcast": lambda b, n: (n - 1) / n * b,  # a tree's sends, averaged over the ranks
    "all_to_all": lambda b, n: b,
    "p2p": lambda b, n: b,
}


def nic_bytes(c: Collective, groups: Mapping[str, Group]) -> float:
    """Bytes ``c`` sends out of one node's NIC (0 inside a node): a node-ordered ring carries one rank's bytes per
    NIC, a broadcast tree ``(N-1)/N B`` on average, an all-to-all its processes' bytes to other nodes; times the
    groups sharing the NIC."""
    group = _group_of(c, groups)
    n = group.size
    if group.nodes <= 1 or n <= 1:
        return 0.0
    if c.kind == "all_to_all":
        return c.nbytes * (n - group.per_node) / (n - 1) * group.per_node * group.sharing
    if c.kind == "broadcast":  # the tree crosses the nodes: (N-1)/N of B per NIC on average
        return (group.nodes - 1) / group.nodes * c.nbytes * group.sharing
    return _SENT[c.kind](c.nbytes, n) * group.sharing


def loopback_seconds(c: Collective, topology: Topology, groups: Mapping[str, Group]) -> float:
    """CPU seconds one rank spends copying ``c``'s bytes that stay inside its node (sent and received alike, at the
    intra-node link's rate); 0 unless ``topology.cpu_copies``. A group spanning nodes keeps the share of a ring's
    hops (``(G-1)/G``) or of an all-to-all's peers (``(G-1)/(n-1)``) that are inside the node.

    >>> from lightning_gradcomp.advise.costs.topology import groups_for
    >>> topo = Topology(2, 2, Link(1e6), Link(1e9), cpu_copies=True)
    >>> loopback_seconds(Collective("all_to_all", 5e8, group="intra"), topo, groups_for(topo))  # 0.5 s out, 0.5 in
    1.0
    """
    group = _group_of(c, groups)
    n = group.size
    if not topology.cpu_copies or n <= 1 or group.per_node <= 1:
        return 0.0
    sent = _SENT[c.kind](c.nbytes, n)
    if group.nodes > 1:
        sent *= (group.per_node - 1) / (n - 1) if c.kind == "all_to_all" else (group.per_node - 1) / group.per_node
    return 2 * sent / topology.intra.bandwidth
