"""Test configuration: a fresh MASTER_PORT per test, one thread per process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)

from helpers.distributed import free_port  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_master_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's launchers read MASTER_PORT and never clear it: give every test its own."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
