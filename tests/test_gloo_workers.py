"""``gloo_workers.run_workers``: results in rank order, failures and dead ranks reported, never waited for."""

from __future__ import annotations

import faulthandler
import os
import queue
import time
from multiprocessing import util

import pytest
import torch
import torch.distributed as dist

from lightning_gradcomp.gloo_workers import run_workers


def _sum(rank: int, world: int) -> dict:
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return {"rank": rank, "world": world, "sum": t, "big": torch.full((300_000,), float(rank))}  # > a pipe's buffer


@pytest.mark.parametrize("world", [2, 3])
def test_results_come_back_in_rank_order(world: int) -> None:
    results = run_workers(_sum, world)
    assert [r["rank"] for r in results] == list(range(world))
    assert all(r["world"] == world and r["sum"].item() == world * (world + 1) / 2 for r in results)
    assert all(torch.equal(r["big"], torch.full((300_000,), float(i))) for i, r in enumerate(results))


def _raise_on_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def test_a_rank_that_raises_is_named_with_its_traceback() -> None:
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed:.*ValueError: boom on purpose"):
        run_workers(_raise_on_one, 2)


def _abort_on_one(rank: int, world: int) -> int:
    if rank == 1:
        faulthandler.disable()  # no dump of this intended abort in the test log
        os.abort()  # native code dying: no traceback, no result
    return rank


def test_a_rank_that_dies_is_reported_at_once_not_waited_for() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1 died before sending its result \(exit code -6\)"):
        run_workers(_abort_on_one, 2, timeout=60.0)
    assert time.monotonic() - start < 30.0


def _abort_at_exit(rank: int, world: int) -> int:
    faulthandler.disable()
    util.Finalize(None, os.abort, exitpriority=0)  # runs while this process exits, after its result was sent
    return rank * 10


def test_a_rank_that_dies_after_sending_its_result_loses_nothing() -> None:
    assert run_workers(_abort_at_exit, 2) == [0, 10]


def _slow_on_one(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(4.0)
    return rank


def test_a_rank_that_sends_nothing_in_time_raises_empty() -> None:
    with pytest.raises(queue.Empty, match=r"no result from ranks \[1\] within 1.0 s"):
        run_workers(_slow_on_one, 2, timeout=1.0)
