"""The advise cost model against hand-computed cases (pure: no torch, no processes)."""

from __future__ import annotations

import doctest
import math

import pytest

from lightning_gradcomp.advise.costs import (
    BucketTrace,
    Collective,
    Group,
    Join,
    Link,
    StepTrace,
    Topology,
    all_gather_seconds,
    all_reduce_seconds,
    all_to_all_seconds,
    broadcast_seconds,
    collective_seconds,
    efficiency_curve,
    groups_for,
    loopback_seconds,
    nic_bytes,
    p2p_seconds,
    parse_link,
    predict,
    recommend,
    reduce_scatter_seconds,
    simulate_step,
    speedups,
)

MB = 1e6
LINK = Link(bandwidth=1e6, latency=1e-3)  # 1 MB/s, 1 ms


def flat(world: int, link: Link = LINK) -> Topology:
    return Topology(world, 1, link, Link(1e12, 0.0))


@pytest.mark.parametrize("world", [2, 3, 4, 8, 64])
def test_ring_all_reduce_is_2_w_minus_1_over_w_bytes_plus_2_w_minus_1_latencies(world: int) -> None:
    expected = 2 * (world - 1) / world * MB / 1e6 + 2 * (world - 1) * 1e-3
    assert all_reduce_seconds(MB, world, LINK) == pytest.approx(expected)
    assert collective_seconds(Collective("all_reduce", MB), flat(world), groups_for(flat(world))) == pytest.approx(
        expected
    )


def test_the_other_collectives_by_hand() -> None:
    # all-gather of 1 MB from each of 4 ranks: 3 MB through each rank's link, 3 hops
    assert all_gather_seconds(MB, 4, LINK) == pytest.approx(3.0 + 0.003)
    # reduce-scatter of a 1 MB input over 4 ranks: 3/4 MB, 3 hops
    assert reduce_scatter_seconds(MB, 4, LINK) == pytest.approx(0.75 + 0.003)
    # binomial broadcast over 8 ranks: 3 rounds of one message; over 5: ceil(log2 5) = 3
    assert broadcast_seconds(MB, 8, LINK) == pytest.approx(3 * 1.001)
    assert broadcast_seconds(MB, 5, LINK) == pytest.approx(3 * 1.001)
    # all-to-all where this rank sends 0.75 MB to 3 others
    assert all_to_all_seconds(0.75 * MB, 4, LINK) == pytest.approx(0.75 + 0.003)
    assert p2p_seconds(MB, 2, LINK) == pytest.approx(1.001)
    for fn in (all_reduce_seconds, all_gather_seconds, reduce_scatter_seconds, broadcast_seconds, p2p_seconds):
        assert fn(MB, 1, LINK) == 0.0  # one rank: nothing to send


def test_a_flat_ring_over_nodes_is_limited_by_the_nic_and_carries_one_ranks_bytes_per_nic() -> None:
    topo = Topology(2, 2, inter=Link(1e6, 1e-3), intra=Link(1e9, 1e-6))  # W = 4
    groups = groups_for(topo)
    c = Collective("all_reduce", MB)
    assert collective_seconds(c, topo, groups) == pytest.approx(1.5 + 6e-3)  # 2*3/4 MB at the NIC's 1 MB/s
    assert nic_bytes(c, groups) == pytest.approx(1.5 * MB)


def test_hierarchical_groups_share_the_nic_and_stay_off_it_inside_the_node() -> None:
    topo = Topology(2, 2, inter=Link(1e6, 1e-3), intra=Link(1e9, 1e-6))
    groups = groups_for(topo)
    assert groups["cross"] == Group(2, 2, 1, sharing=2) and groups["intra"] == Group(2, 1, 2)
    # each local rank all-reduces its half (0.5 MB) across the 2 nodes: 2 (2-1)/2 * 0.5 MB = 0.5 MB per rank, and
    # both local ranks' halves go through the one NIC: 1 MB at 1 MB/s, plus 2 hops of 1 ms
    half = Collective("all_reduce", 0.5 * MB, "cross")
    assert collective_seconds(half, topo, groups) == pytest.approx(1.0 + 2e-3)
    assert nic_bytes(half, groups) == pytest.approx(MB)  # 2(N-1)/N of the whole 1 MB gradient, as the docs say
    inside = Collective("all_to_all", 0.5 * MB, "intra")
    assert collective_seconds(inside, topo, groups) == pytest.approx(0.5 * MB / 1e9 + 1e-6)
    assert nic_bytes(inside, groups) == 0.0


def test_a_flat_broadcast_and_all_to_all_over_nodes() -> None:
    topo = Topology(2, 2, inter=Link(1e6, 1e-3), intra=Link(1e9, 0.0))
    groups = groups_for(topo)
    # the tree crosses the 2 nodes (1 round on the NIC), then the node (1 round inside)
    assert collective_seconds(Collective("broadcast", MB), topo, groups) == pytest.approx(1.001 + 0.001)
    assert nic_bytes(Collective("broadcast", MB), groups) == pytest.approx(0.5 * MB)
    # a rank sends 0.75 MB to 3 others, 2 of them on the other node: 0.5 MB out, from both processes of the node
    a2a = Collective("all_to_all", 0.75 * MB)
    assert collective_seconds(a2a, topo, groups) == pytest.approx(2 * 0.5 + 3e-3)
    assert nic_bytes(a2a, groups) == pytest.approx(MB)


def test_parse_link_units_and_errors() -> None:
    assert parse_link("100mbit") == Link(12.5e6, 0.0)
    fast = parse_link("25gbit,10us")
    assert fast == Link(25e9 / 8, 1e-5)
    assert parse_link("12.5GB,2us").bandwidth == 12.5e9
    assert parse_link("1gbit", default_latency=5e-5).latency == 5e-5
    assert parse_link("10mbit,0.2ms").latency == pytest.approx(2e-4)
    for bad in ("fast", "100", "100mbit,soon", "0mbit"):
        with pytest.raises(ValueError, match="`--inter-node`"):
            parse_link(bad, name="--inter-node")


def _bucket(ready: float, *items: object) -> BucketTrace:
    return BucketTrace(ready, tuple(items))  # type: ignore[arg-type]


def test_a_step_overlaps_the_first_buckets_transfer_with_backward() -> None:
    # two buckets of 1 MB ready at 1 s and 2 s (end of backward), 2 ranks at 1 MB/s, no latency:
    # the first transfer (1 s) fits before the second bucket is ready, the second ends at 3 s
    link = Link(1e6)
    trace = StepTrace(
        (_bucket(1.0, Collective("all_reduce", MB)), _bucket(2.0, Collective("all_reduce", MB))), 0.25, 2.25
    )
    p = simulate_step(trace, flat(2, link))
    assert p.step == pytest.approx(3.25) and p.nic_bytes == pytest.approx(2 * MB)
    assert p.comm == pytest.approx(2.0) and p.exposed == pytest.approx(1.0)
    assert p.efficiency == pytest.approx(2.25 / 3.25)
    # both ready at the end of backward: the transfers queue on the link
    late = StepTrace((_bucket(2.0, Collective("all_reduce", MB)), _bucket(2.0, Collective("all_reduce", MB))), 0, 2)
    assert simulate_step(late, flat(2, link)).step == pytest.approx(4.0)


def test_blocking_collectives_and_joins_hold_the_thread() -> None:
    link = Link(1e6)
    # 0.5 s of compute, a blocking 1 MB broadcast over 2 ranks (1 s), 0.5 s compute, async all-reduce (1 s)
    trace = StepTrace(
        (_bucket(1.0, 0.5, Collective("broadcast", MB, blocking=True), 0.5, Collective("all_reduce", MB)),), 0.0, 1.0
    )
    assert simulate_step(trace, flat(2, link)).step == pytest.approx(1.0 + 0.5 + 1.0 + 0.5 + 1.0)
    # an async all-reduce, then a wait for it, then 0.25 s of compute
    joined = StepTrace((_bucket(0.0, Collective("all_reduce", MB), Join(), 0.25),), 0.0, 0.0)
    assert simulate_step(joined, flat(2, link)).step == pytest.approx(1.25)


def test_free_links_give_back_the_calibrated_step() -> None:
    trace = StepTrace((_bucket(1.0, 0.1, Collective("all_gather", MB), 0.05),), 0.2, 1.0)
    fast = Topology(4, 1, Link(1e15), Link(1e15))
    assert simulate_step(trace, fast).step == pytest.approx(1.35)


def test_predict_speedups_and_the_recommendation() -> None:
    link = Link(1e6)
    traces = {
        "ddp": StepTrace((_bucket(1.0, Collective("all_reduce", 4 * MB)),), 0.0, 1.0),
        "fp16": StepTrace((_bucket(1.0, 0.1, Collective("all_reduce", 2 * MB)),), 0.0, 1.0),
    }
    preds = predict(traces, flat(2, link))
    assert preds["ddp"].step == pytest.approx(5.0) and preds["fp16"].step == pytest.approx(3.1)
    assert speedups(preds, "ddp")["fp16"] == pytest.approx(5.0 / 3.1)
    line = recommend(preds)
    assert line.startswith("use fp16") and "1.61x faster than the next (ddp)" in line
    fast = predict(traces, flat(2, Link(1e12)))
    assert recommend(fast).startswith("keep ddp")


def test_the_efficiency_curve_falls_with_nodes_for_a_ring() -> None:
    traces = {"ddp": StepTrace((_bucket(1.0, Collective("all_reduce", MB)),), 0.0, 1.0)}
    curve = efficiency_curve(traces, flat(2, Link(1e6, 1e-3)), [1, 2, 4, 1024])["ddp"]
    assert curve[0] == (1, 1.0)
    effs = [e for _, e in curve]
    assert effs == sorted(effs, reverse=True) and effs[-1] < 0.3
    assert all(math.isfinite(e) for e in effs)


def test_the_docstring_examples() -> None:
    from lightning_gradcomp.advise import costs, probe
    from lightning_gradcomp.advise.costs import collectives, comparison, step_replay, topology

    for module in (costs, topology, collectives, step_replay, comparison, probe):  # costs' examples live in its parts
        assert doctest.testmod(module).failed == 0
    assert sum(doctest.testmod(m).attempted for m in (topology, collectives, step_replay, comparison)) >= 6


def test_a_token_bucket_link_lets_a_burst_through_after_idle_time() -> None:
    # tc tbf at 1 MB/s with a 0.5 MB bucket: after 1 s of compute the bucket is full, so a 1 MB all-reduce over 2
    # ranks (1 MB through the NIC) takes 0.5 s instead of 1 s; a second one right after finds the bucket empty
    shaped = Topology(2, 1, Link(1e6, 0.0, burst=0.5 * MB), Link(1e12))
    one = StepTrace((_bucket(1.0, Collective("all_reduce", MB)),), 0.0, 1.0)
    assert simulate_step(one, shaped).step == pytest.approx(1.5)
    two = StepTrace((_bucket(1.0, Collective("all_reduce", MB), Collective("all_reduce", MB)),), 0.0, 1.0)
    assert simulate_step(two, shaped).step == pytest.approx(2.5)
    assert simulate_step(one, flat(2, Link(1e6))).step == pytest.approx(2.0)  # no bucket: the plain link


# ---------------------------------------------------------------------------------------------- CPU copies
def _two_by_two(cpu_copies: bool) -> Topology:
    return Topology(2, 2, LINK, Link(1e9, 0.0), cpu_copies=cpu_copies)  # intra: 1 GB/s


@pytest.mark.parametrize(
    ("collective", "expected"),
    [
        (Collective("all_to_all", 4e6, group="intra"), 2 * 4e6 / 1e9),  # 4 MB out to the node's other rank, 4 in
        (Collective("all_reduce", 4e6, group="intra"), 2 * (2 * 1 / 2 * 4e6) / 1e9),  # n = 2: B out, B in
        (Collective("all_gather", 4e6, group="intra"), 2 * 4e6 / 1e9),
        # the flat ring over 2 x 2 leaves the node on one hop in two: half of its 2 (n-1)/n B stays inside
        (Collective("all_reduce", 4e6, group="world"), 2 * (2 * 3 / 4 * 4e6) * (1 / 2) / 1e9),
        # an all-to-all over the world sends 1 of its 3 peers' shares inside the node
        (Collective("all_to_all", 3e6, group="world"), 2 * 3e6 * (1 / 3) / 1e9),
        (Collective("all_reduce", 4e6, group="cross"), 0.0),  # one rank per node: nothing stays inside
    ],
)
def test_loopback_seconds_are_the_intra_node_bytes_sent_and_received_at_the_intra_rate(
    collective: Collective, expected: float
) -> None:
    topo = _two_by_two(cpu_copies=True)
    assert loopback_seconds(collective, topo, groups_for(topo)) == pytest.approx(expected, rel=1e-12)
    gpu = _two_by_two(cpu_copies=False)
    assert loopback_seconds(collective, gpu, groups_for(gpu)) == 0.0


def test_cpu_copies_lengthen_the_step_by_their_seconds_and_survive_with_nodes() -> None:
    trace = StepTrace(
        (BucketTrace(0.1, (Collective("all_to_all", 4e6, group="intra", blocking=True), 0.01,
                           Collective("all_reduce", 1e3, group="cross"))),),
        tail=0.05,
        compute_only=0.15,
    )
    gpu, cpu = (simulate_step(trace, _two_by_two(c)) for c in (False, True))
    assert cpu.step - gpu.step == pytest.approx(2 * 4e6 / 1e9, rel=1e-9)
    assert cpu.nic_bytes == gpu.nic_bytes
    assert _two_by_two(True).with_nodes(8).cpu_copies
