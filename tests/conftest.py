"""Test configuration: a fresh MASTER_PORT per test, one thread per process, one port range per xdist worker."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# MKL's fast memory manager keeps per-thread buffers keyed by thread id, and a rank forked by run_workers once spun
# in it for good (py-spy: mkl_serv_allocate -> mm_account_ptr_by_tid inside a Linear's sgemm), so
# test_determinism failed after its 300 s timeout. Without it MKL allocates through malloc, which is fork-safe.
# MKL reads this when it first allocates: set here, before any test computes anything (children inherit it).
os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lightning_gradcomp.gloo_workers import PORTS_ENV  # noqa: E402


def _worker_ports(worker: str, workers: int, lo: int = 20000, hi: int = 31999) -> str:
    """Worker ``gwK`` of ``workers`` gets the K-th of equal slices of ``[lo, hi]``, below the kernel's usual range
    for the ports it hands out (32768 and up), so neither another worker nor any kernel-picked port meets it."""
    index = int(worker.removeprefix("gw"))
    size = (hi - lo + 1) // workers
    return f"{lo + index * size}-{lo + (index + 1) * size - 1}"


# pytest-xdist workers (``-n 2``) run side by side: the kernel could hand the port one worker is about to bind to
# the other. Each takes its ports from its own range instead (children, subprocess ranks included, inherit it).
if "PYTEST_XDIST_WORKER" in os.environ and PORTS_ENV not in os.environ:
    os.environ[PORTS_ENV] = _worker_ports(os.environ["PYTEST_XDIST_WORKER"],
                                          int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)

# A process forked from this one (Lightning's fork launcher, multiprocessing) must never garbage-collect what it
# inherited: a gloo process group that an earlier test left in a reference cycle would be freed there, and its
# destructor joins worker threads that fork did not copy. py-spy of a CI hang: four forked FSDP2 ranks in
# std::thread::join <- ~ProcessGroupGloo <- gc_collect_main, for 7 minutes.
os.register_at_fork(after_in_child=gc.freeze)

from helpers.distributed import free_port  # noqa: E402
from helpers.isolation import restored_global_state  # noqa: E402


@pytest.fixture(autouse=True)
def own_global_state() -> Iterator[None]:
    """Undo what a test left in process-global state (``helpers.isolation``): Lightning's ``rank_zero_only.rank``
    (``LightningEnvironment.set_global_rank``), the strategy/preset/compressor registries, ``os.environ``
    (``seed_everything`` sets ``PL_GLOBAL_SEED``, the launchers rank variables), the warning filters, torch's
    default dtype, thread count and determinism; so that no test depends on which ran before it on its worker."""
    with restored_global_state():
        yield


@pytest.fixture(autouse=True)
def fresh_master_port(own_global_state: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's launchers read MASTER_PORT and never clear it: give every test its own."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Say the test order's seed even under ``-q`` (which hides pytest-randomly's header line), so that a failure
    that depends on the order can be replayed."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int) and not getattr(config.option, "randomly_dont_reorganize", False):
        terminalreporter.write_line(f"test order: random, seed {seed} (replay: add --randomly-seed={seed})")
