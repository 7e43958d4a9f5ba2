"""``gloo_workers``: ``run_workers``'s results come in rank order, failures and dead ranks are reported, never waited
for; ``free_port`` keeps to ``$LIGHTNING_GRADCOMP_PORTS``."""

from __future__ import annotations

import faulthandler
import os
import queue
import socket
import time
from multiprocessing import util

import pytest
import torch
import torch.distributed as dist

from lightning_gradcomp import gloo_workers
from lightning_gradcomp.gloo_workers import PORTS_ENV, free_port, port_range, run_workers


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


def _free_range(size: int) -> tuple[int, int]:
    """``size`` consecutive ports below the kernel's usual range that bind now."""
    for lo in range(24000, 31000, 97):
        if all(gloo_workers._binds(port) for port in range(lo, lo + size)):
            return lo, lo + size - 1
    pytest.skip(f"no {size} consecutive free ports")


def test_free_port_goes_round_its_range_and_skips_ports_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    lo, hi = _free_range(5)
    monkeypatch.setenv(PORTS_ENV, f"{lo}-{hi}")
    monkeypatch.setattr(gloo_workers, "_next_port", {})
    first = [free_port() for _ in range(5)]
    assert sorted(first) == list(range(lo, hi + 1))  # each port once, in a round from a random start
    assert all(b - a in (1, -4) for a, b in zip(first, first[1:])), first
    assert free_port() == first[0]  # then round again
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first[1]))
        taken.listen()
        assert free_port() == first[2]  # the port in use is skipped
        monkeypatch.setenv(PORTS_ENV, f"{first[1]}-{first[1]}")
        with pytest.raises(OSError, match=f"no free port in {PORTS_ENV}={first[1]}-{first[1]}"):
            free_port()


def test_free_port_without_a_range_asks_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORTS_ENV, raising=False)
    assert port_range() is None
    port = free_port()
    assert 1024 <= port <= 65535 and gloo_workers._binds(port)


@pytest.mark.parametrize("spec", ["20000", "20000-", "a-b", "2000-1000", "80-1000", "60000-70000", "1-2-3"])
def test_a_malformed_port_range_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    monkeypatch.setenv(PORTS_ENV, spec)
    with pytest.raises(ValueError, match=rf"{PORTS_ENV} must be 'LO-HI' with 1024 <= LO <= HI <= 65535, got '{spec}'"):
        free_port()


_GARBAGE_GROUP_SCRIPT = """
import gc, os, sys
import torch.distributed as dist
from lightning_gradcomp.gloo_workers import free_port, run_workers

gc.disable()  # keep the cycle below uncollected in this process, as a long-lived parent may
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
cycle = {"group": dist.new_group([0])}
cycle["self"] = cycle
del cycle
dist.destroy_process_group()

def collect(rank, world):
    gc.collect()  # would free the parent's group: its destructor joins threads this process does not have
    return rank

print(run_workers(collect, 2, timeout=20.0))
"""


def test_a_parent_holding_a_garbage_gloo_group_does_not_hang_the_ranks(tmp_path) -> None:
    """A fresh interpreter (no conftest fork hook): its gloo group, garbage in a cycle, stays uncollected in the ranks."""
    import subprocess
    import sys

    script = tmp_path / "garbage_group.py"
    script.write_text(_GARBAGE_GROUP_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[0, 1]"
