"""Byte accounting: the formulas, and Comm's counts for each collective on real gloo ranks."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers.distributed import run_workers
from lightning_gradcomp.comm import (Comm, CommStats, LayerStats, all_gather_bytes, all_reduce_bytes,
                                     all_to_all_bytes, broadcast_bytes, compression_ratio, p2p_bytes,
                                     sparse_payload_bytes, then_same_numerics)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_formulas(world: int) -> None:
    b = 1000
    assert all_reduce_bytes(b, world) == pytest.approx(2 * (world - 1) / world * b)
    assert all_gather_bytes(b, world) == (world - 1) * b
    assert broadcast_bytes(b, world) == (world - 1) / world * b  # (W - 1) copies cross the network
    assert all_to_all_bytes(b, world) == pytest.approx((world - 1) / world * b)
    assert p2p_bytes(b, world) == b


def test_stats_attribution_and_round_trip() -> None:
    stats = CommStats()
    stats.add_wire(300.0, [("a", 1), ("b", 2)])
    stats.dense_bytes = 900.0
    assert stats.layers["a"].wire_bytes == pytest.approx(100.0)
    assert stats.layers["b"].wire_bytes == pytest.approx(200.0)
    assert stats.compression_ratio == pytest.approx(3.0)
    stats.add_callback(0.25)
    copy = CommStats()
    copy.load_state_dict(stats.state_dict())
    assert copy == stats


def test_callbacks_that_run_on_another_thread_are_timed_and_inline_ones_are_not() -> None:
    """A decode callback run by the thread that completes the collective (gloo's) is work the communication
    thread's own clock misses: it goes to ``callback_seconds``. One run inline is already in the caller's time."""

    def slow(done: torch.futures.Future) -> int:
        time.sleep(0.05)
        return done.value() + 1

    stats = CommStats()
    ready: torch.futures.Future = torch.futures.Future()
    ready.set_result(1)
    assert then_same_numerics(ready, slow, stats).wait() == 2  # complete already: runs inline, here
    assert stats.callback_seconds == 0.0

    pending: torch.futures.Future = torch.futures.Future()
    chained = then_same_numerics(pending, slow, stats)
    worker = threading.Thread(target=pending.set_result, args=(5,))
    worker.start()
    worker.join()
    assert chained.wait() == 6
    assert 0.05 <= stats.callback_seconds < 5.0


@pytest.mark.parametrize("dense, wire, expected", [
    (900.0, 300.0, 3.0), (100.0, 400.0, 0.25),  # something sent: dense / wire (below 1 when it costs bytes)
    (0.0, 0.0, 1.0),  # nothing due, nothing sent: no saving
    (400.0, 0.0, math.inf),  # bytes due, none sent (a layer another rank owns, LocalSGD between syncs)
])
def test_one_ratio_rule_everywhere(dense: float, wire: float, expected: float) -> None:
    """``compression_ratio`` is the only rule: CommStats, LayerStats, the summary table, the logger, the guard and
    the report all give its value."""
    from lightning_gradcomp.callbacks import guard, logger
    from lightning_gradcomp.callbacks.summary import summary_rows
    from lightning_gradcomp.report import text_summary

    assert compression_ratio(dense, wire) == expected
    stats = CommStats(wire_bytes=wire, dense_bytes=dense, steps=1)
    stats.layers["w"] = LayerStats(numel=4, wire_bytes=wire, dense_bytes=dense)
    assert stats.compression_ratio == stats.layers["w"].compression == expected
    rows, total = summary_rows(stats, {})
    assert rows[0].compression == total.compression == expected
    assert logger.compression_ratio is guard.compression_ratio is compression_ratio  # no private copies
    series = {logger.WIRE_BYTES_TOTAL: ([5], [wire]), logger.DENSE_BYTES_TOTAL: ([5], [dense])}
    assert f"-> compression {expected:.2f}x" in text_summary(series, Path("metrics.csv"))


def _collectives(rank: int, world: int) -> dict:
    comm = Comm()
    x = torch.full((10,), float(rank + 1))
    comm.all_reduce(x)
    fut = comm.all_reduce(torch.ones(6, dtype=torch.float16), async_op=True)
    summed16 = fut.wait()
    gathered = comm.all_gather(torch.tensor([rank], dtype=torch.int32))
    gathered_async = comm.all_gather(torch.full((2, 3), rank, dtype=torch.uint8), async_op=True).wait()
    b = torch.arange(5, dtype=torch.int64) * (rank == 1)
    comm.broadcast(b, src=1)
    out = torch.empty(world * 2)
    comm.all_to_all(out, torch.arange(world * 2, dtype=torch.float32) + 100 * rank)
    peer = rank ^ 1
    recv = torch.empty(3)
    if peer < world:
        comm.exchange(torch.full((3,), float(rank)), recv, peer)
    return {"x": x, "h": summed16, "g": gathered, "ga": gathered_async, "b": b, "out": out, "recv": recv,
            "wire": comm.stats.wire_bytes, "n": comm.stats.collectives}


@pytest.mark.parametrize("world", [2, 3])
def test_comm_counts_match_formulas(world: int) -> None:
    results = run_workers(_collectives, world)
    expected = (all_reduce_bytes(40, world) + all_reduce_bytes(12, world) + all_gather_bytes(4, world)
                + all_gather_bytes(6, world) + broadcast_bytes(40, world) + all_to_all_bytes(8 * world, world))
    for rank, res in enumerate(results):
        assert torch.equal(res["x"], torch.full((10,), float(sum(range(1, world + 1)))))
        assert torch.equal(res["h"], torch.full((6,), float(world), dtype=torch.float16))
        assert res["g"].reshape(-1).tolist() == list(range(world))
        assert res["ga"].shape == (world, 2, 3) and res["ga"].dtype == torch.uint8
        assert torch.equal(res["ga"], torch.arange(world, dtype=torch.uint8).reshape(world, 1, 1).expand(world, 2, 3))
        assert res["b"].tolist() == [0, 1, 2, 3, 4]
        assert res["out"].tolist() == [float(100 * r + 2 * rank + j) for r in range(world) for j in range(2)]
        has_peer = (rank ^ 1) < world
        if has_peer:
            assert res["recv"].tolist() == [float(rank ^ 1)] * 3
        assert res["wire"] == pytest.approx(expected + (12 if has_peer else 0))
        assert res["n"] == 6 + int(has_peer)


def _sparse_sum(rank: int, world: int) -> dict:
    """Each rank's rows ``rank .. rank + 2`` of a 10 x 3 table hold ``rank + 1`` (a sparse gradient's shape)."""
    comm = Comm()
    rows = torch.arange(rank, rank + 3)
    grad = torch.sparse_coo_tensor(rows[None], torch.full((3, 3), float(rank + 1)), (10, 3)).coalesce()
    payload = sparse_payload_bytes(grad)
    summed = comm.all_reduce(grad, async_op=True).wait()
    return {"sum": summed.to_dense(), "payload": payload, "wire": comm.stats.wire_bytes}


@pytest.mark.parametrize("world", [2, 3])
def test_a_sparse_all_reduce_sums_and_counts_an_all_gather_of_indices_and_values(world: int) -> None:
    results = run_workers(_sparse_sum, world)
    expected = torch.zeros(10, 3)
    for rank in range(world):
        expected[rank : rank + 3] += rank + 1
    for res in results:
        assert torch.equal(res["sum"], expected)
        assert res["payload"] == 3 * 8 + 9 * 4  # 3 int64 row indices, 9 fp32 values
        assert res["wire"] == all_gather_bytes(res["payload"], world)


def _failing_gather(rank: int, world: int) -> str:
    comm = Comm()
    fut = comm.all_gather(torch.full((4,), rank, dtype=torch.int16), async_op=True)  # gloo has no int16 gather
    try:
        fut.wait()
    except RuntimeError as err:
        return str(err)
    return "resolved"


def test_an_async_collectives_error_reaches_its_future_not_a_half_written_tensor() -> None:
    for message in run_workers(_failing_gather, 2):
        assert message != "resolved" and "scalar type" in message


def _uneven(rank: int, world: int) -> dict:
    """Rank r sends r + j + 1 elements (value 10 r + j) to rank j; both the blocking and the async form."""
    comm = Comm()
    send = torch.cat([torch.full((rank + j + 1,), float(10 * rank + j)) for j in range(world)])
    out_splits = [r + rank + 1 for r in range(world)]
    out = torch.empty(sum(out_splits))
    comm.all_to_all_uneven(out, send, out_splits, [rank + j + 1 for j in range(world)])
    blocking_wait = comm.stats.wait_seconds
    fut = comm.all_to_all_uneven(torch.empty(sum(out_splits)), send, out_splits,
                                 [rank + j + 1 for j in range(world)], async_op=True)
    again = fut.wait()
    return {"out": out, "again": again, "wire": comm.stats.wire_bytes, "wait": blocking_wait,
            "wait_after_async": comm.stats.wait_seconds}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_uneven_all_to_all_delivers_and_counts_what_leaves_the_rank(world: int) -> None:
    for rank, res in enumerate(run_workers(_uneven, world)):
        expected = torch.cat([torch.full((r + rank + 1,), float(10 * r + rank)) for r in range(world)])
        assert torch.equal(res["out"], expected) and torch.equal(res["again"], expected)
        sent = sum(rank + j + 1 for j in range(world) if j != rank)
        assert res["wire"] == 2 * 4 * sent
        assert res["wait"] > 0  # the blocking call is counted as waiting; issuing the async one is not
        assert res["wait_after_async"] == res["wait"]
