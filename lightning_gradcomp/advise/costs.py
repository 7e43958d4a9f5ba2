r"""The cost model of ``lightning-gradcomp advise``: pure functions of a topology and a calibrated step trace.

Everything here is arithmetic on floats (seconds, bytes, bytes per second): no torch, no processes, so every
formula is unit-tested against hand-computed cases.

**Links.** A :class:`Link` costs ``alpha + nbytes / bandwidth`` per message hop (the latency-bandwidth, or
alpha-beta, model). A :class:`Topology` is ``N`` nodes of ``G`` processes: the processes of a node share one
network interface (NIC) to the others (``inter``) and talk over ``intra`` among themselves.

**Collectives** (``B``: the payload of one rank in bytes, ``n``: the ranks of the group, ``s``: the number of
groups that cross the same NIC at once, see :class:`Group`):

=======================  ===============================================================
collective               seconds on one link (bandwidth ``bw``, latency ``a``)
=======================  ===============================================================
all-reduce (ring)        ``2 (n - 1) / n * B * s / bw + 2 (n - 1) a``
all-gather (ring)        ``(n - 1) * B * s / bw + (n - 1) a``
reduce-scatter (ring)    ``(n - 1) / n * B * s / bw + (n - 1) a``
broadcast (binomial)     ``ceil(log2 n) * (B * s / bw + a)``
all-to-all (pairwise)    ``S * s / bw + (n - 1) a``, ``S`` the bytes one rank sends
send / receive           ``B * s / bw + a``
=======================  ===============================================================

A flat group spanning several nodes runs its ring with the ranks in node order, so each node's NIC carries one
hop of the ring (the bytes of one rank) and the ring's speed is its slowest hop's; its latency is the slower
link's. A broadcast tree crosses the nodes first, then the node. An all-to-all sends ``(n - G) / n`` of its bytes
out of the node, from all ``G`` processes of the node through the one NIC.

**A step** (:func:`simulate_step`) replays what the calibration recorded (:class:`StepTrace`): when each DDP
bucket became ready during backward, the compute segments the reduction ran on its communication thread and the
collectives between them (blocking or asynchronous, with the decode that follows an asynchronous one). Collectives
of one group run one after the other in issue order; the autograd thread waits at the last bucket until every
collective is issued (the hook's drain), and the step ends when the last result is decoded, plus the optimizer's
tail. Communication therefore overlaps the rest of backward exactly as far as the buckets' order and sizes allow.

**Left out:** congestion (other jobs' traffic, switch oversubscription), stragglers (every rank computes as fast
as the calibrated one), CPU or memory-bandwidth contention between the reduction and the computation beyond
what the calibration itself saw, and the backends' per-message software cost beyond ``alpha``.

**Extension point.** A reduction scheme is a mapping from the group names a trace uses (``"world"``,
``"intra"``, ``"cross"``) to :class:`Group` shapes (:func:`groups_for`). FSDP2's sharded gradients would be a
third scheme: per bucket a ``reduce_scatter`` over ``"world"`` (gradients) and an ``all_gather`` (parameters,
before the next forward), both already priced here (:func:`collective_seconds`); a calibration for it would
record those collectives, and :func:`groups_for` would give it its groups. It does not exist yet.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Optional, Union

__all__ = [
    "COLLECTIVES",
    "Collective",
    "BucketTrace",
    "Group",
    "Join",
    "Link",
    "Prediction",
    "StepTrace",
    "Topology",
    "all_gather_seconds",
    "all_reduce_seconds",
    "all_to_all_seconds",
    "broadcast_seconds",
    "collective_seconds",
    "efficiency_curve",
    "groups_for",
    "nic_bytes",
    "p2p_seconds",
    "parse_link",
    "predict",
    "recommend",
    "reduce_scatter_seconds",
    "simulate_step",
    "speedups",
]

Kind = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p"]
COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p")
"""The collective kinds the model prices."""

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
    """``nodes`` x ``procs_per_node`` ranks: one NIC per node on ``inter``, ``intra`` inside a node."""

    nodes: int
    procs_per_node: int
    inter: Link
    intra: Link

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.procs_per_node < 1:
            raise ValueError(f"need nodes >= 1 and procs_per_node >= 1, got {self.nodes}, {self.procs_per_node}")

    @property
    def world_size(self) -> int:
        """W = N * G."""
        return self.nodes * self.procs_per_node

    def with_nodes(self, nodes: int) -> Topology:
        """The same cluster with ``nodes`` nodes."""
        return Topology(nodes, self.procs_per_node, self.inter, self.intra)


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
    ``"cross"`` (one rank per node; the ``G`` of them share each NIC)."""
    n, g = topology.nodes, topology.procs_per_node
    return {
        "world": Group(n * g, n, g),
        "intra": Group(g, 1, g),
        "cross": Group(n, n, 1, sharing=g),
    }


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


def nic_bytes(c: Collective, groups: Mapping[str, Group]) -> float:
    """Bytes ``c`` sends out of one node's NIC (0 inside a node): a node-ordered ring carries one rank's bytes per
    NIC, a broadcast tree ``(N-1)/N B`` on average, an all-to-all its processes' bytes to other nodes; times the
    groups sharing the NIC."""
    group = _group_of(c, groups)
    n = group.size
    if group.nodes <= 1 or n <= 1:
        return 0.0
    per_rank = {
        "all_reduce": 2 * (n - 1) / n * c.nbytes,
        "all_gather": (n - 1) * c.nbytes,
        "reduce_scatter": (n - 1) / n * c.nbytes,
        "broadcast": (group.nodes - 1) / group.nodes * c.nbytes,
        "p2p": c.nbytes,
    }
    if c.kind == "all_to_all":
        return c.nbytes * (n - group.per_node) / (n - 1) * group.per_node * group.sharing
    return per_rank[c.kind] * group.sharing


@dataclass(frozen=True)
class Join:
    """The communication thread waits here for every asynchronous collective it issued so far (and their decode)."""


@dataclass(frozen=True)
class BucketTrace:
    """One DDP bucket: when it became ready (seconds from the step's start) and what its reduction did, in order:
    ``float`` items are seconds of compute on the communication thread, :class:`Collective` items its collectives,
    :class:`Join` items waits for the asynchronous ones."""

    ready: float
    items: tuple[Union[float, Collective, Join], ...] = ()


@dataclass(frozen=True)
class StepTrace:
    """A calibrated step of one configuration (one rank; seconds).

    Attributes:
        buckets: in the order they became ready.
        tail: from the last bucket's result to the step's end (DDP's finalisation, the optimizer step, ``zero_grad``).
        compute_only: the same step with no reduction at all (the model's forward, backward and optimizer step).
    """

    buckets: tuple[BucketTrace, ...]
    tail: float
    compute_only: float


@dataclass(frozen=True)
class Prediction:
    """A configuration's predicted step on a topology."""

    step: float
    compute_only: float
    nic_bytes: float
    comm: float = 0.0
    exposed: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def efficiency(self) -> float:
        """Scaling efficiency: the compute-only step over the predicted step."""
        return self.compute_only / self.step if self.step > 0 else 1.0


def simulate_step(trace: StepTrace, topology: Topology, groups: Optional[Mapping[str, Group]] = None) -> Prediction:
    """Replay ``trace`` on ``topology`` (see the module docstring): the predicted step time and the bytes per NIC.

    Example: one bucket ready at 1 s, 0.5 s of compression, one asynchronous all-reduce of 1 MB over 2 ranks on
    1 MB/s; the step ends 1.5 s + 1 s later, plus a 0.1 s tail::

        >>> t = StepTrace((BucketTrace(1.0, (0.5, Collective("all_reduce", 1e6))),), tail=0.1, compute_only=1.1)
        >>> p = simulate_step(t, Topology(2, 1, Link(1e6), Link(1e9)))
        >>> round(p.step, 6), p.nic_bytes
        (2.6, 1000000.0)
    """
    groups = groups_for(topology) if groups is None else groups
    thread = 0.0
    link_free: dict[str, float] = {}
    done = 0.0
    comm = nic = 0.0
    bucket_state = _TokenBucket(topology.inter)
    for bucket in trace.buckets:
        thread = max(thread, bucket.ready)
        for item in bucket.items:
            if isinstance(item, Join):
                thread = max(thread, done)
                continue
            if not isinstance(item, Collective):
                thread += item
                continue
            cost = collective_seconds(item, topology, groups)
            sent = nic_bytes(item, groups)
            comm += cost
            nic += sent
            channel = _channel(item.group)
            start = max(thread, link_free.get(channel, 0.0))
            cost = max(0.0, cost - bucket_state.take(start, sent, cost))
            end = link_free[channel] = start + cost
            bucket_state.busy_until(end)
            if item.blocking:
                thread = end + item.decode
            else:
                done = max(done, end + item.decode)
    last_ready = trace.buckets[-1].ready if trace.buckets else 0.0
    finish = max(thread, done, last_ready)
    step = finish + trace.tail
    return Prediction(step, trace.compute_only, nic, comm, max(0.0, step - _no_network_step(trace)))


class _TokenBucket:
    """The inter-node link's token bucket (``Link.burst``): how much of a transfer passes at once."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.tokens = link.burst
        self.idle_since = 0.0

    def take(self, start: float, nbytes: float, cost: float) -> float:
        """Seconds saved by a transfer of ``nbytes`` through the NIC starting at ``start`` (and its tokens spent)."""
        if self.link.burst <= 0 or nbytes <= 0:
            return 0.0
        if start > self.idle_since:
            self.tokens = min(self.link.burst, self.tokens + (start - self.idle_since) * self.link.bandwidth)
        used = min(self.tokens, nbytes)
        self.tokens -= used
        return min(cost, used / self.link.bandwidth)

    def busy_until(self, end: float) -> None:
        self.idle_since = max(self.idle_since, end)


def _channel(group: str) -> str:
    """Collectives on one channel run one after another (one process group's queue)."""
    return group


def _no_network_step(trace: StepTrace) -> float:
    """The step with free collectives (what the calibration measured, up to noise)."""
    thread = done = 0.0
    for bucket in trace.buckets:
        thread = max(thread, bucket.ready)
        for item in bucket.items:
            if isinstance(item, Join):
                thread = max(thread, done)
            elif isinstance(item, Collective):
                if item.blocking:
                    thread += item.decode
                else:
                    done = max(done, thread + item.decode)
            else:
                thread += item
    last_ready = trace.buckets[-1].ready if trace.buckets else 0.0
    return max(thread, done, last_ready) + trace.tail


def predict(traces: Mapping[str, StepTrace], topology: Topology) -> dict[str, Prediction]:
    """:func:`simulate_step` for every configuration."""
    return {name: simulate_step(trace, topology) for name, trace in traces.items()}


def speedups(predictions: Mapping[str, Prediction], baseline: str) -> dict[str, float]:
    """Each configuration's speed-up over ``baseline`` (its step over theirs); empty when ``baseline`` is absent."""
    if baseline not in predictions:
        return {}
    base = predictions[baseline].step
    return {name: base / p.step for name, p in predictions.items()}


def recommend(predictions: Mapping[str, Prediction], dense: str = "ddp") -> str:
    """One line: the fastest configuration and its margin over the runner-up and over dense ``dense``; "keep"
    ``dense`` when no configuration beats it by 5 %.

    >>> recommend({"ddp": Prediction(2.0, 1.0, 8e6), "topk": Prediction(1.0, 1.0, 1e5)})
    'use topk: 1000.0 ms/step predicted, scaling efficiency 100%; 2.00x faster than the next (ddp)'
    """
    if not predictions:
        return "no configuration to compare"
    ranked = sorted(predictions, key=lambda name: predictions[name].step)
    best, p = ranked[0], predictions[ranked[0]]
    if dense in predictions and predictions[dense].step < 1.05 * p.step:
        rival = best if best != dense else (ranked[1] if len(ranked) > 1 else dense)
        return (
            f"keep {dense}: compression does not pay by 5 % here ({dense} {predictions[dense].step * 1e3:.1f} ms/step, "
            f"best alternative {rival} {predictions[rival].step * 1e3:.1f} ms/step predicted)"
        )
    text = f"use {best}: {p.step * 1e3:.1f} ms/step predicted, scaling efficiency {p.efficiency:.0%}"
    if len(ranked) > 1:
        runner = ranked[1]
        text += f"; {predictions[runner].step / p.step:.2f}x faster than the next ({runner})"
        if dense in predictions and runner != dense:
            text += f", {predictions[dense].step / p.step:.2f}x faster than dense {dense}"
    return text


def efficiency_curve(
    traces: Mapping[str, StepTrace], topology: Topology, nodes: Iterable[int]
) -> dict[str, list[tuple[int, float]]]:
    """Predicted scaling efficiency of every configuration at each node count (same calibration: compute and
    payloads as calibrated, only the topology changes)."""
    counts: Sequence[int] = list(nodes)
    return {
        name: [(n, simulate_step(trace, topology.with_nodes(n)).efficiency) for n in counts]
        for name, trace in traces.items()
    }
