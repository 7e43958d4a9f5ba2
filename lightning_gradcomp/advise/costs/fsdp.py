r"""The FSDP2 scheme of the cost model: HSDP as ``GradCompFSDPStrategy`` runs it (docs/fsdp.md), priced in closed form.

Each replica of the model is sharded with FSDP2 over a *shard group* of the ``S = G`` processes of one node
(``"shard"``: the ``--intra-node`` link); the ``R = N`` replicas of a shard index form a *replicate group* across
the nodes (``"replicate"``: one rank per node, the ``G`` replicate groups of a node sharing its NIC). Per step and
FSDP2 unit ``u`` (a ``fully_shard``-ed module), with ``B_u`` its padded shard in the reduce dtype and ``P_u`` in the
all-gather dtype:

* inside the shard group: one ring reduce-scatter of the unit's gradients, ``(S-1)/S * S B_u / bw + (S-1) a``, and
  ``g_u`` ring all-gathers of its parameters (forward; backward again when it reshards after forward),
  ``(S-1) P_u / bw + (S-1) a`` each;
* across the replicas: native HSDP's dense all-reduce of the shard, ``2 (R-1)/R * B_u G / bw + 2 (R-1) a``, or the
  collectives of the compressed replica reduction of that shard (its payloads as calibrated on the shard's sizes).

On CPU (gloo) every one of them blocks the autograd thread, and the compressed replica reduction blocks it on any
device (the strategy's all-reduce hook waits for it): the step is the calibrated compute plus their sum
(:func:`fsdp_step_seconds`). The calibrated replay (:func:`~.step_replay.simulate_step` on a ``serial`` trace)
prices the same collectives in the order the hooks fired, with the emulated links' token bucket.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_gradcomp.advise.costs.collectives import Collective, collective_seconds
from lightning_gradcomp.advise.costs.topology import Topology, groups_for

__all__ = [
    "FSDPUnit",
    "fsdp_step_seconds",
    "native_hsdp_collectives",
    "shard_group_collectives",
    "shard_of",
]


def shard_of(shape: Sequence[int], shards: int) -> tuple[tuple[int, ...], int]:
    """The first (largest) shard of a parameter of ``shape`` over ``shards`` processes, as FSDP2 cuts dim 0 (pieces
    of ``ceil(rows / S)`` rows): its shape and its padded element count.

    >>> shard_of((7, 5), 2), shard_of((3,), 4), shard_of((), 2)
    (((4, 5), 20), ((1,), 1), ((), 1))
    """
    if shards < 1:
        raise ValueError(f"`shards` must be >= 1, got {shards}")
    if not shape:
        return (), 1
    rows = math.ceil(shape[0] / shards)
    rest = math.prod(shape[1:])
    return (min(rows, shape[0]), *shape[1:]), rows * rest


@dataclass(frozen=True)
class FSDPUnit:
    """One FSDP2 unit's traffic per step, for one rank.

    Attributes:
        shard_bytes: its reduce-scatter output (the padded shard in the reduce dtype): native HSDP's all-reduce
            payload.
        gather_bytes: one rank's all-gather input (the padded shard in the all-gather dtype).
        gathers: all-gathers per step: 1 (forward), 2 when the unit reshards after forward.
        replica: its compressed replica reduction's collectives (group ``"replicate"``); ``None``: native HSDP's.
    """

    shard_bytes: float
    gather_bytes: float
    gathers: int = 2
    replica: Optional[tuple[Collective, ...]] = None


def shard_group_collectives(unit: FSDPUnit, shards: int, blocking: bool = True) -> tuple[Collective, ...]:
    """The unit's collectives inside the shard group: the reduce-scatter (an input of ``S * shard_bytes`` per rank),
    then its all-gathers."""
    scatter = Collective("reduce_scatter", shards * unit.shard_bytes, "shard", blocking)
    return (scatter,) + (Collective("all_gather", unit.gather_bytes, "shard", blocking),) * unit.gathers


def native_hsdp_collectives(unit: FSDPUnit, blocking: bool = True) -> tuple[Collective, ...]:
    """Native HSDP across the replicas: the dense all-reduce of the unit's shard."""
    return (Collective("all_reduce", unit.shard_bytes, "replicate", blocking),)


def fsdp_step_seconds(compute: float, units: Sequence[FSDPUnit], topology: Topology) -> float:
    """The FSDP2 step with every collective serialized (CPU, gloo): ``compute`` (the step with free collectives) plus
    each unit's shard-group and replica collectives; shard group = the ``G`` processes of a node.

    Example: 2 nodes x 2 processes, one unit with a 1 MB shard gathered twice, 1 MB/s and 1 ms inside the node,
    10 MB/s and 1 ms between nodes; native HSDP::

        >>> from lightning_gradcomp.advise.costs.topology import Link
        >>> topo = Topology(2, 2, Link(1e7, 1e-3), Link(1e6, 1e-3))
        >>> round(fsdp_step_seconds(0.5, [FSDPUnit(1e6, 1e6)], topo), 6)  # 0.5 + 1.001 + 2 x 1.001 + 0.202
        3.705
    """
    groups = groups_for(topology)
    total = compute
    for unit in units:
        replica = native_hsdp_collectives(unit) if unit.replica is None else unit.replica
        for c in (*shard_group_collectives(unit, topology.procs_per_node), *replica):
            total += collective_seconds(c, topology, groups)
    return total
