"""``lightning-gradcomp advise``: argument errors at parse time, and a short calibration of every configuration."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_gradcomp.advise.calibrate import calibrate, check_advise_config, workload_of
from lightning_gradcomp.advise.command import build_report, format_report, with_device
from lightning_gradcomp.advise.costs import Collective, Join, Link, Topology, parse_link, shard_of
from lightning_gradcomp.advise.fsdp import FSDP_DEFAULTS, fsdp_configs
from lightning_gradcomp.bench.configs import available_configs
from lightning_gradcomp.cli import main

TINY = ["--model", "mlp-small", "--batch-size", "4", "--steps", "1", "--warmup", "3", "--threads", "1"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "0"], "`--nodes` must be an integer from 1 to 1,000,000, got '0'"),
        (["--procs-per-node", "many"], "`--procs-per-node` must be an integer from 1 to 1,024"),
        (["--inter-node", "fast"], "`--inter-node` must look like 25gbit,5us or 100mbit"),
        (["--intra-node", "1gbit,soon"], "`--intra-node`: the latency must look like"),
        (["--warmup", "2"], "`--warmup` must be an integer from 3"),
        (["--model-arg", "layers"], "`--model-arg` must look like KEY=VALUE"),
    ],
)
def test_argument_errors_name_the_argument_and_the_range(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["advise", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--inter-node", "1gbit", "--configs", "nope"], "`--configs`: unknown configuration 'nope'"),
        (["--inter-node", "1gbit", "--configs", "ddp+hier", "--procs-per-node", "2"], "applies to strategy presets"),
        (["--inter-node", "1gbit", "--configs", "scalecom+hier"], "needs `--procs-per-node` >= 2"),
        (["--nodes", "2"], "`--inter-node` is required"),
        (["--probe", "--nodes", "2"], "leave out `--nodes` and `--inter-node`"),
        (["--inter-node", "1gbit", "--model-arg", "heads=4"], "`--model-arg`: mlp-small takes"),
        (["--inter-node", "1gbit", "--configs", "diloco_fsdp"], "advise prices a reduction at every step"),
        (["--inter-node", "1gbit", "--configs", "scalecom_fsdp+hier"], "FSDP2 is hierarchical already"),
        (["--inter-node", "1gbit", "--configs", "scalecom_fsdp@density=2"], "configuration 'scalecom_fsdp@density=2'"),
    ],
)
def test_configuration_errors_come_before_any_calibration(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["advise", *TINY, *argv]) == 2
    assert message in capsys.readouterr().err


def test_advise_runs_on_every_registered_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    configs = [*available_configs(), "gradcomp_none+hier", "scalecom+hier", "qsgd+hier", *fsdp_configs()]
    assert {"hsdp", "gradcomp_fsdp", "scalecom_fsdp", "powersgd_fsdp", "qsgd_fsdp"} <= set(configs)
    argv = ["advise", *TINY, "--nodes", "2", "--procs-per-node", "2", "--inter-node", "100mbit,50us", "--json"]
    assert main([*argv, "--configs", ",".join(configs)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["configs"]) == set(configs)
    assert report["topology"]["world_size"] == 4 and report["params"] > 0
    for name, row in report["configs"].items():
        assert row["step_s"] > 0 and 0 < row["scaling_efficiency"], name
        assert row["collectives"], f"{name} recorded no collective"
    dense = report["configs"]["ddp"]
    grad_bytes = 4 * report["params"]
    # a node-ordered ring over 4 ranks carries 2 (W-1)/W of the gradient through each NIC
    assert dense["nic_bytes_per_step"] == pytest.approx(1.5 * grad_bytes)
    assert report["configs"]["torch_fp16"]["nic_bytes_per_step"] == pytest.approx(0.75 * grad_bytes)
    # hierarchical dense: 2 (N-1)/N of the gradient per NIC (the node's shards together), the rest inside the node
    assert report["configs"]["gradcomp_none+hier"]["nic_bytes_per_step"] == pytest.approx(grad_bytes, rel=0.01)
    hier_groups = {c["group"] for c in report["configs"]["scalecom+hier"]["collectives"]}
    assert hier_groups == {"intra", "cross"}
    assert report["topology"]["cpu_copies"] is True  # calibrated on this CPU: intra-node bytes cost its cores
    assert report["recommendation"]
    # FSDP2 over 2 nodes x 2: native HSDP all-reduces each rank's shard across the 2 replicas, the node's 2 ranks
    # through its NIC: 2 (N-1)/N * G = 2 times the first shard's padded bytes, summed over the parameters
    shard_bytes = sum(4 * shard_of(tuple(p.shape), 2)[1] for p in workload_of("mlp-small").parameters())
    for name in fsdp_configs():
        assert {c["group"] for c in report["configs"][name]["collectives"]} == {"shard", "replicate"}, name
    assert report["configs"]["hsdp"]["nic_bytes_per_step"] == pytest.approx(2 * shard_bytes)
    assert report["configs"]["gradcomp_fsdp"]["nic_bytes_per_step"] == pytest.approx(2 * shard_bytes)
    for name in ("scalecom_fsdp", "powersgd_fsdp", "qsgd_fsdp"):
        assert report["configs"][name]["nic_bytes_per_step"] < 0.5 * shard_bytes, name


def test_fsdp_calibrates_the_replica_reduction_on_the_shards_sizes() -> None:
    topology = Topology(2, 4, parse_link("100mbit"), parse_link("10gbit"))  # 4 shards per replica
    cal = calibrate("mlp-small", ["hsdp", "gradcomp_fsdp"], topology, batch_size=4, steps=1, threads=1)
    linears = [m for m in workload_of("mlp-small").modules() if isinstance(m, torch.nn.Linear)]
    shards = [sum(4 * shard_of(tuple(p.shape), 4)[1] for p in m.parameters()) for m in linears]
    for name in ("hsdp", "gradcomp_fsdp"):
        trace = cal.traces[name]
        assert trace.serial and len(trace.buckets) == len(linears), name  # one hook per unit, in backward order
        across = [[c.nbytes for c in b.items if isinstance(c, Collective) and c.group == "replicate"]
                  for b in trace.buckets]  # fmt: skip
        assert across == [[s] for s in reversed(shards)], name  # the dense shard, as native HSDP sends it
        scatters = [c.nbytes for b in trace.buckets for c in b.items
                    if isinstance(c, Collective) and c.kind == "reduce_scatter"]  # fmt: skip
        assert scatters == [4 * s for s in reversed(shards)]  # the unit's padded gradient, S shards
    assert any(isinstance(i, Join) for b in cal.traces["gradcomp_fsdp"].buckets for i in b.items)  # the hook waits


def test_advise_fsdp_prints_the_fsdp2_configurations_against_native_hsdp(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["advise", *TINY, "--nodes", "2", "--procs-per-node", "2", "--inter-node", "10mbit", "--fsdp"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "vs hsdp" in text and "PREDICTED" in text
    for name in FSDP_DEFAULTS:
        assert f"\n{name} " in text, name
    assert "faster than dense hsdp" in text  # 10 Mbit/s: a compressed FSDP2 configuration wins


def test_the_table_says_the_figures_are_predicted(capsys: pytest.CaptureFixture[str]) -> None:
    topology = Topology(2, 1, parse_link("10mbit"), parse_link("10gbit"))
    cal = calibrate("mlp-small", ["ddp", "gradcomp_topk"], topology, batch_size=4, steps=1, threads=1)
    assert cal.traces["gradcomp_topk"].buckets and cal.params > 0
    topk = [i for b in cal.traces["gradcomp_topk"].buckets for i in b.items if isinstance(i, Collective)]
    assert any(c.kind == "all_gather" for c in topk)
    text = format_report(build_report(cal.traces, topology, model="mlp-small", params=cal.params, device="cpu"))
    assert "PREDICTED" in text and "recommendation: use gradcomp_topk" in text


def test_a_built_in_model_takes_its_size_from_model_args() -> None:
    topology = Topology(2, 1, parse_link("1gbit"), parse_link("10gbit"))
    cal = calibrate("mlp", ["ddp"], topology, batch_size=2, steps=1, threads=1, model_args={"width": 64, "depth": 3})
    assert cal.params == 256 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10


def test_an_all_to_all_aggregation_keeps_its_protocol_under_the_mirror() -> None:
    # SignSGD aggregates with all-to-all from W = 3: rank r serves chunk r, whose reply the mirror cannot know; the
    # weights stay put (lr 0), so no garbage reply turns a later gradient NaN (a dense fallback, the wrong protocol)
    topology = Topology(4, 1, parse_link("100mbit"), parse_link("10gbit"))
    cal = calibrate("mlp-small", ["signsgd"], topology, batch_size=4, steps=4, threads=1)
    kinds = [[i.kind for i in b.items if isinstance(i, Collective)] for b in cal.traces["signsgd"].buckets]
    assert all("all_to_all" in k for k in kinds), kinds


def test_check_advise_config() -> None:
    assert check_advise_config("qsgd@bits=2") == "qsgd@bits=2"
    with pytest.raises(ValueError, match="unknown configuration"):
        check_advise_config("qsgd+node", 2)


@pytest.mark.parametrize(
    ("device", "choice", "expected"),
    [("cpu", "auto", True), ("cuda", "auto", False), ("cuda:1", "auto", False), ("cpu", "off", False),
     ("cuda", "on", True)],
)
def test_cpu_copies_follow_the_calibration_device_unless_told(device: str, choice: str, expected: bool) -> None:
    topology = Topology(2, 2, Link(1e7), Link(1e9))
    assert with_device(topology, device, choice) == Topology(2, 2, Link(1e7), Link(1e9), cpu_copies=expected)


def test_cpu_copies_off_is_accepted_and_reported(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["advise", *TINY, "--nodes", "2", "--procs-per-node", "2", "--inter-node", "100mbit,50us", "--json"]
    assert main([*argv, "--configs", "ddp", "--cpu-copies", "off"]) == 0
    assert json.loads(capsys.readouterr().out)["topology"]["cpu_copies"] is False
