"""benchmarks/localsgd_fsdp_compare.py: native HSDP (Lightning's ModelParallelStrategy on FSDP2's 2-D mesh) against
GradCompFSDPStrategy, on the synthetic task for one epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from localsgd_fsdp_compare import make_fsdp_strategy, parse_setting  # benchmarks/ (on sys.path: conftest.py)

from lightning_gradcomp.compressors import CLTK
from lightning_gradcomp.schedule import WarmupSchedule

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "localsgd_fsdp_compare.py"
ROOT = SCRIPT.parents[1]


def test_settings_are_parsed_into_the_strategy() -> None:
    kind, opts = parse_setting("fsdp:cltk=0.02,f16=1,d16=1,warm=40,from=0.08,start=0")
    strategy = make_fsdp_strategy(opts, type("Task", (), {"min_numel": 256})(), 0, 2)
    assert kind == "fsdp" and isinstance(strategy.compressor, CLTK) and strategy.compressor.default_param == 0.02
    assert isinstance(strategy.schedule, WarmupSchedule) and strategy.schedule.steps == 40
    assert strategy.start_step == 0 and strategy.shard_size == 2
    assert parse_setting("hsdp") == ("hsdp", {}) and parse_setting("diloco:H=20")[0] == "diloco"
    with pytest.raises(SystemExit, match="unknown option"):
        parse_setting("fsdp:H=20")


def test_native_hsdp_and_the_dense_replica_reduction_agree(tmp_path: Path) -> None:
    """One epoch of the synthetic task: native HSDP and GradCompFSDPStrategy with NoCompression (the same data,
    order and sharding) end at the same accuracy, and HSDP's modelled bytes are what the library counts."""
    out = tmp_path / "runs.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, str(SCRIPT), "--task", "mlp", "--epochs", "1", "--settings", "hsdp", "fsdp:",
                    "--json", str(out)], check=True, env=env, timeout=300, cwd=SCRIPT.parent)
    hsdp, ours = json.loads(out.read_text())
    assert hsdp["steps"] == ours["steps"] > 0
    assert ours["accuracy"] == pytest.approx(hsdp["accuracy"], abs=1e-3)
    assert hsdp["wire_bytes"] == ours["wire_bytes"] == ours["dense_bytes"]
