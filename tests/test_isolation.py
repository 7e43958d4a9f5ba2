"""Tests leave no process-global state behind (``helpers.isolation``, the autouse fixture in ``conftest.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from helpers.isolation import restored_global_state
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.compressors import registry

ROOT = Path(__file__).resolve().parents[1]


def test_the_state_a_test_changes_is_put_back() -> None:
    before = (rank_zero_only.rank, dict(StrategyRegistry), dict(registry._FACTORIES), dict(os.environ), list(warnings.filters),
              torch.get_default_dtype(), torch.get_num_threads())
    with restored_global_state():
        LightningEnvironment().set_global_rank(1)
        StrategyRegistry.register("isolation_probe", DDPStrategy)
        registry.register("isolation_probe")(TopK)
        os.environ["ISOLATION_PROBE"] = "1"
        warnings.simplefilter("ignore")
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(torch.get_num_threads() + 1)
    after = (rank_zero_only.rank, dict(StrategyRegistry), dict(registry._FACTORIES), dict(os.environ), list(warnings.filters),
             torch.get_default_dtype(), torch.get_num_threads())
    assert after == before
    with pytest.warns(UserWarning, match="seen on rank 0"):
        rank_zero_warn("seen on rank 0")


def test_a_rank_set_by_an_earlier_file_does_not_silence_later_warnings() -> None:
    """Issue 50: ``set_global_rank(2)`` in test_hierarchy.py made test_guard.py's ``rank_zero_warn`` tests fail."""
    first = "tests/test_hierarchy.py::test_node_hierarchy_uses_lightnings_processes_per_node"
    second = "tests/callbacks/test_guard.py::test_short_runs_are_judged_at_the_end"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                           "-p", "no:xdist", first, second], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "2 passed" in done.stdout
