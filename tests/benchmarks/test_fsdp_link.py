"""benchmarks/fsdp_link.py: FSDP2 on 2 x 2 processes, native HSDP against the replica reduction (loopback, and an
emulated link where network namespaces can be made)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fsdp_link import summarise  # benchmarks/ (on sys.path: conftest.py)

from lightning_gradcomp.bench.netem import can_emulate

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fsdp_link.py"
ROOT = SCRIPT.parents[1]


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "fsdp_link.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, str(SCRIPT), "--nodes", "2", "--per-node", "2", "--steps", "1", "--warmup", "3",
                    "--model", "mlp-small", "--out", str(out), *args], check=True, env=env, timeout=240)
    return json.loads(out.read_text())


def test_loopback_run_has_the_structure_and_fsdp_none_sends_what_hsdp_models(tmp_path: Path) -> None:
    result = _run(tmp_path, "--link", "none", "--configs", "hsdp", "fsdp_none", "scalecom")
    summary = result["summary"]
    assert list(summary) == ["hsdp", "fsdp_none", "scalecom"] and len(result["raw"]) == 4
    hsdp, none, cltk = summary["hsdp"], summary["fsdp_none"], summary["scalecom"]
    assert hsdp["wire_bytes_modelled"] and not none["wire_bytes_modelled"]
    assert none["wire_bytes_per_rank_step_mean"] == hsdp["wire_bytes_per_rank_step_mean"] > 0  # counted = formula
    assert none["dense_bytes_per_rank_step_mean"] == hsdp["wire_bytes_per_rank_step_mean"]
    assert none["intra_bytes_per_rank_step_mean"] == hsdp["intra_bytes_per_rank_step_mean"] > 0
    assert cltk["wire_fewer_than_hsdp"] > 30  # CLT-k 1%
    for row in summary.values():
        assert row["replicas_identical"] and row["nic_tx_payload_bytes_per_node_step"] is None  # no interface
        assert row["step_time_median_s"] > 0 and row["nic_fewer_than_hsdp"] is None
    assert hsdp["step_time_vs_hsdp"] == 1.0


@pytest.mark.skipif(not can_emulate()[0], reason=f"cannot emulate links here: {can_emulate()[1]}")
def test_emulated_link_carries_what_the_all_reduce_sends(tmp_path: Path) -> None:
    summary = _run(tmp_path, "--link", "1gbit", "--configs", "hsdp", "fsdp_none")["summary"]
    for row in summary.values():  # per node: its 2 ranks' all-reduce bytes (R = 2), plus gloo's framing
        nic = row["nic_tx_payload_bytes_per_node_step"]
        assert nic == pytest.approx(2 * summary["hsdp"]["wire_bytes_per_rank_step_mean"], rel=0.05)


def test_summary_ratios_against_hsdp() -> None:
    def rank(times: list[float], wire: float, nic: float | None) -> dict:
        row = {"step_times": times, "wire_bytes_per_step": wire, "intra_bytes_per_step": 5.0,
               "dense_bytes_per_step": 100.0, "wire_bytes_modelled": False, "nic_tx_payload_bytes_per_step": nic,
               "params": 3, "weights_sha256": "same"}
        return {"configs": {"hsdp": dict(row, wire_bytes_per_step=100.0, wire_bytes_modelled=True,
                                         nic_tx_payload_bytes_per_step=None if nic is None else 200.0),
                            "scalecom": row}}

    ranks = [rank([1.0, 2.0], 2.0, 4.0), rank([1.5, 1.0], 2.0, None), rank([1.0, 1.0], 2.0, 4.0),
             rank([1.0, 1.0], 2.0, None)]
    row = summarise(ranks, per_node=2)["scalecom"]
    assert row["wire_fewer_than_hsdp"] == 50.0 and row["nic_fewer_than_hsdp"] == 50.0
    assert row["step_time_vs_hsdp"] == 1.0  # the same step times: slowest rank per step [1.5, 2.0] in both
