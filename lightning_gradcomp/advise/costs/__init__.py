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

**Schemes.** A reduction scheme is a mapping from the group names a trace uses to :class:`Group` shapes
(:func:`groups_for`): ``"world"`` (flat DDP), ``"intra"`` and ``"cross"`` (hierarchical), ``"shard"`` and
``"replicate"`` (FSDP2 as HSDP, :mod:`~lightning_gradcomp.advise.costs.fsdp`: per unit a reduce-scatter of the
gradients and all-gathers of the parameters inside the node, then the replica reduction of the shard across the
nodes, serialized at each unit's hook: a ``serial`` :class:`StepTrace`).

**Modules:** :mod:`~lightning_gradcomp.advise.costs.topology` (links, topology, groups),
:mod:`~lightning_gradcomp.advise.costs.collectives` (one collective's seconds and NIC bytes),
:mod:`~lightning_gradcomp.advise.costs.step_replay` (step traces and :func:`simulate_step`),
:mod:`~lightning_gradcomp.advise.costs.fsdp` (the FSDP2 step in closed form) and
:mod:`~lightning_gradcomp.advise.costs.comparison` (predictions, recommendation, efficiency curve); every name is
re-exported here.
"""

from __future__ import annotations

from lightning_gradcomp.advise.costs.collectives import (
    COLLECTIVES,
    Collective,
    all_gather_seconds,
    all_reduce_seconds,
    all_to_all_seconds,
    broadcast_seconds,
    collective_seconds,
    loopback_seconds,
    nic_bytes,
    p2p_seconds,
    reduce_scatter_seconds,
)
from lightning_gradcomp.advise.costs.collectives import Kind as Kind
from lightning_gradcomp.advise.costs.collectives import _group_of as _group_of
from lightning_gradcomp.advise.costs.collectives import _slowest as _slowest
from lightning_gradcomp.advise.costs.comparison import efficiency_curve, predict, recommend, speedups
from lightning_gradcomp.advise.costs.fsdp import (
    FSDPUnit,
    fsdp_step_seconds,
    native_hsdp_collectives,
    shard_group_collectives,
    shard_of,
)
from lightning_gradcomp.advise.costs.step_replay import BucketTrace, Join, Prediction, StepTrace, simulate_step
from lightning_gradcomp.advise.costs.step_replay import _channel as _channel
from lightning_gradcomp.advise.costs.step_replay import _no_network_step as _no_network_step
from lightning_gradcomp.advise.costs.step_replay import _TokenBucket as _TokenBucket
from lightning_gradcomp.advise.costs.topology import _PER_SECOND as _PER_SECOND
from lightning_gradcomp.advise.costs.topology import _RATE as _RATE
from lightning_gradcomp.advise.costs.topology import _SCALE as _SCALE
from lightning_gradcomp.advise.costs.topology import _TIME as _TIME
from lightning_gradcomp.advise.costs.topology import Group, Link, Topology, groups_for, parse_link

__all__ = [
    "COLLECTIVES",
    "Collective",
    "BucketTrace",
    "FSDPUnit",
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
    "loopback_seconds",
    "efficiency_curve",
    "fsdp_step_seconds",
    "groups_for",
    "native_hsdp_collectives",
    "nic_bytes",
    "p2p_seconds",
    "parse_link",
    "predict",
    "recommend",
    "reduce_scatter_seconds",
    "shard_group_collectives",
    "shard_of",
    "simulate_step",
    "speedups",
]
