"""Test configuration: a fresh MASTER_PORT per test, one thread per process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# MKL's fast memory manager keeps per-thread buffers keyed by thread id, and a rank forked by run_workers once spun
# in it for good (py-spy: mkl_serv_allocate -> mm_account_ptr_by_tid inside a Linear's sgemm), so
# test_determinism failed after its 300 s timeout. Without it MKL allocates through malloc, which is fork-safe.
# MKL reads this when it first allocates: set here, before any test computes anything (children inherit it).
os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)

from helpers.distributed import free_port  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_master_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's launchers read MASTER_PORT and never clear it: give every test its own."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
