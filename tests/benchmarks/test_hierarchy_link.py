"""benchmarks/hierarchy_link.py: the summary over ranks (slowest step, one NIC reading per node)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hierarchy_link import merge_rounds, summarise, torchrun_commands  # benchmarks/ (on sys.path: conftest.py)


def _rank(times: list[float], wire: float, nic: float | None, thread: float = 0.1) -> dict:
    row = {"step_times": times, "wire_bytes_per_step": wire, "intra_bytes_per_step": 2 * wire,
           "hook_seconds_per_step": 0.01, "thread_seconds_per_step": thread, "nic_tx_payload_bytes_per_step": nic,
           "compute_seconds_per_step": thread / 2, "params": 10,
           "compressor_step_seconds": [t / 10 for t in times], "weights_sha256": "same"}
    return {"configs": {"cltk_hier": row}}


def test_summary_takes_the_slowest_rank_and_node_nic_readers_only() -> None:
    ranks = [_rank([1.0, 3.0, 2.0], 10.0, 100.0), _rank([2.0, 1.0, 1.0], 20.0, None, thread=0.3),
             _rank([1.0, 1.0, 5.0], 30.0, 300.0), _rank([1.0, 1.0, 1.0], 40.0, None)]
    row = summarise(ranks, per_node=2)["cltk_hier"]
    assert row["step_time_median_s"] == 3.0  # per step the slowest rank: [2, 3, 5]
    assert row["thread_seconds_per_step_max"] == 0.3
    assert row["compute_seconds_per_step_max"] == 0.15
    assert row["compressor_seconds_busiest_rank"] == pytest.approx(0.3)  # per step max [0.2, 0.3, 0.5]
    assert row["compute_seconds_per_step_mean"] == pytest.approx((0.05 * 3 + 0.15) / 4)
    assert row["wire_bytes_per_rank_step_mean"] == 25.0 and row["intra_bytes_per_rank_step_mean"] == 50.0
    assert row["nic_tx_payload_bytes_per_node_step"] == pytest.approx(200.0)  # ranks 0 and 2 read their node's NIC
    assert summarise([_rank([1.0], 1.0, None), _rank([1.0], 1.0, None)], 1)["cltk_hier"][
        "nic_tx_payload_bytes_per_node_step"] is None  # loopback: no interface
    assert row["replicas_identical"]
    ranks[3]["configs"]["cltk_hier"]["weights_sha256"] = "other"
    assert not summarise(ranks, per_node=2)["cltk_hier"]["replicas_identical"]


def test_one_torchrun_per_node_with_static_rendezvous() -> None:
    commands = torchrun_commands(Path("/tmp/spec.json"), nodes=2, per_node=3, port=1234, link=None)
    assert len(commands) == 2
    for node, (argv, env) in enumerate(commands):
        assert argv[1:3] == ["-m", "torch.distributed.run"]
        assert {"--nnodes=2", "--nproc-per-node=3", f"--node-rank={node}", "--master-addr=127.0.0.1",
                "--master-port=1234"} <= set(argv)
        assert argv[-2:] == ["--worker", "/tmp/spec.json"] and "GLOO_SOCKET_IFNAME" not in env


def test_rounds_merge_into_one_measurement() -> None:
    a = {"step_times": [1.0, 2.0], "wire_bytes_per_step": 10.0, "nic_tx_payload_bytes_per_step": None,
         "params": 7, "weights_sha256": "x"}
    b = {"step_times": [3.0], "wire_bytes_per_step": 20.0, "nic_tx_payload_bytes_per_step": None,
         "params": 7, "weights_sha256": "y"}
    merged = merge_rounds([a, b])
    assert merged == {"step_times": [1.0, 2.0, 3.0], "wire_bytes_per_step": 15.0,
                      "nic_tx_payload_bytes_per_step": None, "params": 7, "weights_sha256": "x,y"}
