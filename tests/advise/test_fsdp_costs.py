"""The FSDP2 (HSDP) scheme of the advise cost model against hand-computed cases (pure: no torch, no processes)."""

from __future__ import annotations

import doctest
import math

import pytest

from lightning_gradcomp.advise.costs import (
    BucketTrace,
    Collective,
    FSDPUnit,
    Join,
    Link,
    StepTrace,
    Topology,
    collective_seconds,
    fsdp_step_seconds,
    groups_for,
    native_hsdp_collectives,
    nic_bytes,
    shard_group_collectives,
    shard_of,
    simulate_step,
)

MB = 1e6
INTER = Link(bandwidth=10e6, latency=2e-3)  # 10 MB/s, 2 ms per hop between nodes
INTRA = Link(bandwidth=100e6, latency=1e-4)  # 100 MB/s, 0.1 ms per hop inside a node


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_the_shard_groups_reduce_scatter_and_all_gather_are_rings_inside_the_node(shards: int) -> None:
    topo = Topology(2, shards, INTER, INTRA)
    groups = groups_for(topo)
    gradient = 8 * MB  # the unit's whole gradient, one rank's reduce-scatter input
    by_hand = (shards - 1) / shards * gradient / INTRA.bandwidth + (shards - 1) * INTRA.latency
    scatter = Collective("reduce_scatter", gradient, "shard")
    assert collective_seconds(scatter, topo, groups) == pytest.approx(by_hand)
    # the all-gather of the parameters: each rank brings its shard (1/S of them), the same bytes and hops
    gather = Collective("all_gather", gradient / shards, "shard")
    assert collective_seconds(gather, topo, groups) == pytest.approx(by_hand)
    assert nic_bytes(scatter, groups) == nic_bytes(gather, groups) == 0.0  # nothing leaves the node


def test_the_replicate_group_is_one_rank_per_node_and_the_nodes_processes_share_the_nic() -> None:
    topo = Topology(4, 2, INTER, INTRA)
    groups = groups_for(topo)
    assert groups["replicate"] == groups["cross"] and groups["shard"] == groups["intra"]
    shard = 3 * MB
    # native HSDP: a ring all-reduce of the shard over the 4 replicas, both local ranks' rings through the one NIC
    by_hand = 2 * 3 / 4 * shard * 2 / INTER.bandwidth + 2 * 3 * INTER.latency
    (dense,) = native_hsdp_collectives(FSDPUnit(shard, shard))
    assert collective_seconds(dense, topo, groups) == pytest.approx(by_hand)
    assert nic_bytes(dense, groups) == pytest.approx(2 * 3 / 4 * shard * 2)  # = 2 (N-1)/N of the unit's gradient


@pytest.mark.parametrize(
    ("shape", "shards", "expected"),
    [
        ((7, 5), 2, ((4, 5), 20)),  # ceil(7/2) = 4 rows
        ((7, 5), 3, ((3, 5), 15)),
        ((7,), 8, ((1,), 1)),  # fewer rows than shards: one row each (the last shards hold none)
        ((13, 2, 3), 4, ((4, 2, 3), 24)),
        ((6,), 1, ((6,), 6)),
    ],
)
def test_shard_of_takes_fsdp2s_first_and_largest_dim0_chunk(
    shape: tuple[int, ...], shards: int, expected: tuple[tuple[int, ...], int]
) -> None:
    assert shard_of(shape, shards) == expected
    assert shards * expected[1] >= math.prod(shape)  # the padded shards cover the parameter


def test_the_fsdp2_step_by_hand() -> None:
    # 2 nodes x 2 processes; two units: a 2 MB shard gathered twice and a 1 MB shard (the root) gathered once
    topo = Topology(2, 2, INTER, INTRA)
    big, root = FSDPUnit(2 * MB, 2 * MB, gathers=2), FSDPUnit(MB, MB, gathers=1)

    def ring(nbytes: float, hops: int, link: Link) -> float:
        return nbytes / link.bandwidth + hops * link.latency

    # reduce-scatter of 2 shards' gradient: (2-1)/2 of it; all-gather: the other rank's shard; 1 hop each
    inside = ring(2 * MB, 1, INTRA) + 2 * ring(2 * MB, 1, INTRA) + ring(MB, 1, INTRA) + ring(MB, 1, INTRA)
    # native HSDP across 2 replicas: 2 (2-1)/2 of the shard each, both local ranks through the NIC; 2 hops
    across = ring(2 * 2 * MB, 2, INTER) + ring(2 * MB, 2, INTER)
    assert fsdp_step_seconds(0.5, [big, root], topo) == pytest.approx(0.5 + inside + across)
    # compressed: the replica reduction's own collectives replace the dense all-reduce
    cltk = (Collective("broadcast", 0.02 * MB, "replicate"), Collective("all_reduce", 0.02 * MB, "replicate"))
    compressed = [FSDPUnit(2 * MB, 2 * MB, 2, cltk), FSDPUnit(MB, MB, 1, cltk)]
    per_unit = ring(2 * 0.02 * MB, 1, INTER) + ring(2 * 0.02 * MB, 2, INTER)  # broadcast: 1 round; all-reduce
    assert fsdp_step_seconds(0.5, compressed, topo) == pytest.approx(0.5 + inside + 2 * per_unit)


def _serial(units: list[FSDPUnit], gaps: list[float], hook: float, tail: float, shards: int) -> StepTrace:
    """A calibrated FSDP2 step: unit ``i``'s hook fires ``gaps[i]`` after the previous one returned, runs ``hook``
    seconds of compression around its collectives, and waits for them (as ``advise.fsdp`` records it)."""
    buckets, now = [], 0.0
    for unit, gap in zip(units, gaps):
        now += gap
        scatter, *gathers = shard_group_collectives(unit, shards)
        replica = native_hsdp_collectives(unit) if unit.replica is None else unit.replica
        buckets.append(BucketTrace(now, (scatter, hook / 2, *replica, hook / 2, Join(), *gathers)))
        now += hook
    return StepTrace(tuple(buckets), tail, compute_only=sum(gaps) + tail, serial=True)


def test_the_serial_replay_equals_the_closed_form() -> None:
    topo = Topology(2, 2, INTER, INTRA)
    units = [FSDPUnit(2 * MB, 2 * MB), FSDPUnit(0.5 * MB, 0.5 * MB), FSDPUnit(MB, MB, gathers=1)]
    gaps, hook, tail = [0.3, 0.1, 0.05], 0.01, 0.02
    trace = _serial(units, gaps, hook, tail, 2)
    calibrated = sum(gaps) + len(units) * hook + tail  # the step with free collectives
    predicted = simulate_step(trace, topo)
    assert predicted.step == pytest.approx(fsdp_step_seconds(calibrated, units, topo))
    assert predicted.nic_bytes == pytest.approx(sum(2 * 1 / 2 * u.shard_bytes * 2 for u in units))


def test_a_serial_wait_delays_the_rest_of_backward_and_an_overlapped_one_does_not() -> None:
    link = Link(1e6)
    topo = Topology(2, 1, link, Link(1e12))
    one = Collective("all_reduce", MB, blocking=True)  # 1 s over 2 ranks at 1 MB/s
    buckets = (BucketTrace(1.0, (one,)), BucketTrace(1.5, (0.1,)))
    # serial (FSDP2's hook): the second unit's backward starts after the wait, 0.5 s of it then the 0.1 s hook
    assert simulate_step(StepTrace(buckets, 0.0, 1.6, serial=True), topo).step == pytest.approx(2.0 + 0.5 + 0.1)
    # DDP's communication thread: backward went on during the wait
    assert simulate_step(StepTrace(buckets, 0.0, 1.6), topo).step == pytest.approx(2.1)


def test_the_docstring_examples() -> None:
    from lightning_gradcomp.advise.costs import fsdp

    assert doctest.testmod(fsdp).failed == 0 and doctest.testmod(fsdp).attempted >= 2
