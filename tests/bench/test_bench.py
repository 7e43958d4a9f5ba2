"""The bench command: pure summary/recommendation logic, namespace commands, and a short real run."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_gradcomp.bench.models import load_workload
from lightning_gradcomp.bench.netem import EmulatedLink, can_emulate, parse_rate, setup_commands, teardown_commands
from lightning_gradcomp.bench.runner import (plot_ladder, print_ladder, recommend, run_bench, run_ladder, summarise,
                                             work_ms_of)
from lightning_gradcomp.bench.worker import block_sizes, header_bytes_per_packet

FIELDS = {"step_time_median_s", "step_time_p25_s", "step_time_p75_s", "throughput_samples_per_s", "scaling_efficiency",
          "wire_bytes_per_step", "iface_tx_bytes_per_step", "iface_tx_payload_bytes_per_step",
          "iface_payload_vs_ours", "hook_ms_per_step", "thread_ms_per_step", "peak_rss_mb", "speedup_vs_ddp",
          "bytes_ratio_vs_ddp", "work_vs_clone", "work_vs_clone_rand", "wait_ms_per_step", "work_ms_per_step"}


def _rank(times: dict[str, list[float]], compute: list[float]) -> dict:
    return {"compute_only": {"step_times": compute},
            "configs": {name: {"step_times": t, "wire_bytes_per_step": 1000.0 if name == "ddp" else 10.0,
                               "hook_seconds_per_step": 0.001, "iface_tx_bytes_per_step": None,
                               "iface_tx_payload_bytes_per_step": None,
                               "peak_rss_mb": 100.0, "batch_size": 8, "params": 10} for name, t in times.items()}}


def test_work_is_the_threads_time_without_its_waits_or_the_torch_hooks_time() -> None:
    assert work_ms_of({"hook_ms_per_step": 0.5, "thread_ms_per_step": 9.0, "wait_ms_per_step": 6.0}) == 3.0
    assert work_ms_of({"hook_ms_per_step": 1.5, "thread_ms_per_step": 0.0, "wait_ms_per_step": 0.0}) == 1.5
    assert work_ms_of({"hook_ms_per_step": 1.5}) == 1.5  # results written before the thread existed
    # with per-step work, the median over steps
    assert work_ms_of({"hook_ms_per_step": 0.5, "thread_ms_per_step": 9.0, "wait_ms_per_step": 6.0,
                       "work_ms_median": 2.5}) == 2.5


def test_work_is_the_median_over_steps_of_the_mean_over_ranks() -> None:
    ranks = [_rank({"topk": [0.02, 0.02, 0.02, 0.02]}, [0.01] * 4), _rank({"topk": [0.02] * 4}, [0.01] * 4)]
    ranks[0]["configs"]["topk"]["work_seconds_steps"] = [0.001, 0.002, 0.250, 0.003]  # one step stalled
    ranks[1]["configs"]["topk"]["work_seconds_steps"] = [0.003, 0.002, 0.004, 0.001]
    row = summarise(ranks)["configs"]["topk"]
    # per-step means 2, 2, 127, 2 ms: the stalled step does not move the median
    assert row["work_ms_median"] == pytest.approx(2.0) and row["work_ms_per_step"] == pytest.approx(2.0)
    del ranks[1]["configs"]["topk"]["work_seconds_steps"]  # a rank without them: no median
    assert summarise(ranks)["configs"]["topk"]["work_ms_median"] is None


def test_summary_uses_the_slowest_rank_per_step_and_recommends() -> None:
    ranks = [_rank({"ddp": [0.10, 0.10, 0.30], "topk": [0.02, 0.03, 0.02]}, [0.01, 0.005, 0.01]),
             _rank({"ddp": [0.20, 0.10, 0.10], "topk": [0.02, 0.02, 0.04]}, [0.005, 0.01, 0.002])]
    summary = summarise(ranks)
    ddp, topk = summary["configs"]["ddp"], summary["configs"]["topk"]
    assert ddp["step_time_median_s"] == pytest.approx(0.2)  # max over ranks per step: .2, .1, .3
    assert topk["step_time_median_s"] == pytest.approx(0.03)
    assert topk["speedup_vs_ddp"] == pytest.approx(0.2 / 0.03)
    assert summary["compute_only_step_s"] == pytest.approx(0.01)  # the slowest rank per step, as for the configs
    assert topk["scaling_efficiency"] == pytest.approx(0.01 / 0.03)
    assert topk["throughput_samples_per_s"] == pytest.approx(2 * 8 / 0.03)
    assert topk["bytes_ratio_vs_ddp"] == pytest.approx(100.0)
    assert recommend(summary).startswith("use topk: 6.67x faster")
    slow = summarise([_rank({"ddp": [0.1], "topk": [0.2]}, [0.05])])
    assert recommend(slow).startswith("compression does not pay here")


def test_rate_parsing_and_namespace_commands() -> None:
    assert parse_rate("100mbit") == 1e8 and parse_rate("1gbit") == 1e9 and parse_rate("512kbit") == 512e3
    with pytest.raises(ValueError, match="`link` must look like 100mbit"):
        parse_rate("fast")
    cmds = setup_commands("t1", 2, "1gbit")
    flat = [" ".join(c) for c in cmds]
    assert "ip link add t1br type bridge" in flat and "ip netns add t1ns1" in flat
    assert any("tbf rate 1gbit" in c for c in flat)
    assert all(len(name) <= 15 for c in cmds for name in c if name.startswith("t1"))
    assert [" ".join(c) for c in teardown_commands("t1", 2)] == ["ip netns del t1ns0", "ip netns del t1ns1",
                                                                 "ip link del t1br"]


@pytest.mark.skipif(not can_emulate()[0], reason=f"cannot emulate links here: {can_emulate()[1]}")
def test_namespaces_are_created_and_removed() -> None:
    link = EmulatedLink(2, "100mbit", prefix="lgct")
    with link:
        assert link.exists()
        out = subprocess.run(["ip", "netns", "exec", link.namespace(1), "ip", "-o", "addr"], capture_output=True,
                             text=True, check=True).stdout
        assert "10.213.0.2" in out
    assert not link.exists()
    with pytest.raises(RuntimeError), EmulatedLink(2, "100mbit", prefix="lgcu") as failing:
        assert failing.exists()
        raise RuntimeError("boom")
    assert not failing.exists()


SHARED_CONFIGS = ["ddp", "torch_fp16", "gradcomp_topk"]


@pytest.fixture(scope="module")
def ladder_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One real run shared by the tests below (each launch of ranks costs ~10 s of imports here): the module entry
    point as a subprocess, a one-link ladder (``--chart``) on 1 Gbit/s where this machine can emulate it, else on
    loopback, 3 measured steps per configuration, the chart and the JSON."""
    out = tmp_path_factory.mktemp("ladder")
    emulated = can_emulate()[0]
    links = ["1gbit"]
    proc = subprocess.run([sys.executable, "-m", "lightning_gradcomp.cli", "bench", "--model", "mlp-small", "--steps",
                           "3", "--warmup", "3", "--configs", ",".join(SHARED_CONFIGS), "--link", ",".join(links),
                           "--chart", str(out / "ladder.png"), "--json", str(out / "bench.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"stdout": proc.stdout, "results": json.loads((out / "bench.json").read_text()), "links": links,
            "emulated": emulated, "chart": out / "ladder.png"}


@pytest.mark.slow
def test_short_run_has_every_field(ladder_run: dict[str, Any]) -> None:
    assert "recommendation:" in ladder_run["stdout"]
    result = ladder_run["results"]["1gbit"]
    assert result["link"].startswith("emulated 1gbit" if ladder_run["emulated"] else "loopback")
    rows = result["summary"]["configs"]
    assert set(rows) == set(SHARED_CONFIGS)
    for row in rows.values():
        assert FIELDS <= set(row)
    assert rows["gradcomp_topk"]["wire_bytes_per_step"] < rows["torch_fp16"]["wire_bytes_per_step"] < \
        rows["ddp"]["wire_bytes_per_step"]
    refs = result["summary"]["references"]
    assert set(refs) == {"clone_ms", "rand_like_ms", "half_ms"} and all(v > 0 for v in refs.values())
    topk = rows["gradcomp_topk"]
    assert topk["work_vs_clone"] > 0 and topk["thread_ms_per_step"] > topk["wait_ms_per_step"] > 0
    # the per-step work adds up to the run's totals, and the table's figure is its median
    per_step = [r["configs"]["gradcomp_topk"]["work_seconds_steps"] for r in result["raw"]]
    assert all(len(works) == 3 for works in per_step)
    mean_ms = 1e3 * sum(sum(works) for works in per_step) / 6
    # (a counter may move by a few microseconds between a step's end and the next step's start)
    assert mean_ms == pytest.approx(topk["thread_ms_per_step"] - topk["wait_ms_per_step"], rel=0.02)
    median_ms = 1e3 * sorted(sum(ws) / 2 for ws in zip(*per_step))[1]
    assert topk["work_ms_per_step"] == pytest.approx(median_ms)
    assert "compression work per step against one pass over the gradient" in ladder_run["stdout"]


@pytest.mark.slow
def test_link_ladder_prints_one_column_per_link_and_draws_the_chart(ladder_run: dict[str, Any], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The real run's one-link ladder, then the same table and chart for three links made of its result."""
    assert list(ladder_run["results"]) == ladder_run["links"]
    assert "scaling efficiency (compute-only step / step) per link:" in ladder_run["stdout"]
    assert ladder_run["chart"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    real = ladder_run["results"]["1gbit"]
    links = ["loopback", "1gbit", "100mbit"]
    ladder = {link: copy.deepcopy(real) for link in links}
    for i, link in enumerate(links):
        for row in ladder[link]["summary"]["configs"].values():
            row["scaling_efficiency"] = 0.9 - 0.3 * i
    print_ladder(ladder)
    table = capsys.readouterr().out.split("scaling efficiency (compute-only step / step) per link:")[1]
    header = next(line for line in table.splitlines() if "config" in line)
    assert all(link in header for link in links)
    for name in SHARED_CONFIGS:
        row = next(line for line in table.splitlines() if f" {name} " in line)
        assert [cell.strip() for cell in row.split("│")[2:-1]] == ["90%", "60%", "30%"]
    plot_ladder(ladder, str(tmp_path / "three.png"))
    assert (tmp_path / "three.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_invalid_bench_arguments() -> None:
    with pytest.raises(ValueError, match="unknown configurations"):
        run_bench(configs=["nope"])
    with pytest.raises(ValueError, match="`world_size` must be >= 2"):
        run_bench(world_size=1)
    with pytest.raises(ValueError, match="`batch_size` must be >= 1"):
        run_bench(batch_size=0)
    for rounds in (0, 6):
        with pytest.raises(ValueError, match=r"`rounds` must be between 1 and `steps` \(5\), got"):
            run_bench(steps=5, rounds=rounds)
    with pytest.raises(ValueError, match="`batch_size` applies to built-in models only"):
        load_workload("my_package.models:MyModule", batch_size=8)
    for cap in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"`bucket_cap_mb` must be > 0 \(MB\) or None"):
            run_bench(bucket_cap_mb=cap)
    with pytest.raises(ValueError, match="`threads` must be >= 1, got 0"):
        run_bench(threads=0)
    for model in ("nosuch", "module.path:", ":Class"):  # refused before any rank starts
        with pytest.raises(ValueError, match=r"`model` must be one of mlp, .* or 'module.path:ClassName', got"):
            run_bench(model=model)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "-1"], "`--steps` must be >= 1"), (["--warmup", "1"], "`--warmup` >= 3"),
    (["-w", "1"], "`--world-size` must be >= 2"), (["--rounds", "0"], "`--rounds` must be between 1 and `--steps`"),
    (["--threads", "0"], "`--threads` must be >= 1"), (["--batch-size", "0"], "`--batch-size` must be >= 1"),
    (["--bucket-cap-mb", "-1"], "`--bucket-cap-mb` must be > 0"), (["--configs", "bogus"], "unknown configurations"),
    (["--model", "bogus"], "`--model` must be one of"),
    (["--configs", "signsgd@bogus=1"], "configuration 'signsgd@bogus=1': .*unexpected keyword argument 'bogus'"),
    (["--configs", "qsgd@bits=99"], r"configuration 'qsgd@bits=99': `bits` must be in \[2, 8\]"),
    (["--link", "loopback,bogus"], "`--link` must look like 100mbit"),
    (["--json", "/nonexistent-folder/x.json"], "`--json`: the folder of /nonexistent-folder/x.json does not exist"),
    (["--link", "loopback,1gbit", "--chart", "/nonexistent-folder/c.png"], "`--chart`: the folder"),
])
def test_bad_bench_options_are_usage_errors_before_any_rank_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, a compressor argument the compressor refuses failed in every rank after its start, a ladder's second
    link after the first link's whole run, a ``--json`` folder after the run, and the rest with a traceback."""
    from lightning_gradcomp.cli import main

    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-gradcomp bench: error: ") and re.search(message, err), err


def test_a_ladder_checks_every_link_before_the_first_runs() -> None:
    with pytest.raises(ValueError, match="`link` must look like 100mbit"):
        run_ladder(["loopback", "bogus"], configs=["ddp"])


def test_batch_size_overrides_a_builtin_model() -> None:
    assert load_workload("mlp-small", 12).batch_size == 12
    assert load_workload("cnn").batch_size == 32


def test_interface_payload_is_frames_minus_one_header_per_packet() -> None:
    header = header_bytes_per_packet()
    assert header in (54, 66)  # Ethernet 14 + IPv4 20 + TCP 20 (+ 12 with timestamps)
    rank = _rank({"ddp": [0.1]}, [0.05])
    rank["configs"]["ddp"].update(iface_tx_bytes_per_step=1300.0, iface_tx_payload_bytes_per_step=990.0)
    row = summarise([rank, rank])["configs"]["ddp"]
    assert row["iface_tx_payload_bytes_per_step"] == 990.0 and row["iface_payload_vs_ours"] == pytest.approx(0.99)


def test_each_link_of_a_process_gets_its_own_names() -> None:
    """A ladder's next link must not reuse the names of one the kernel may still be tearing down."""
    first, second = EmulatedLink(2, "100mbit"), EmulatedLink(2, "1gbit")
    assert first.prefix != second.prefix
    assert len(second.interface(99)) <= 15 and len(f"{second.prefix}b99") <= 15  # Linux's interface name limit


@pytest.mark.parametrize(("steps", "rounds"), [(1, 1), (5, 1), (5, 2), (5, 5), (10, 3), (7, 4)])
def test_block_sizes_cover_the_steps_in_near_equal_blocks(steps: int, rounds: int) -> None:
    sizes = block_sizes(steps, rounds)
    assert len(sizes) == rounds and sum(sizes) == steps and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@pytest.mark.slow
def test_rounds_interleave_blocks_and_count_each_configurations_own_bytes(ladder_run: dict[str, Any]) -> None:
    """In rounds, every configuration keeps all its measured steps, and its byte counters (ours and, on an emulated
    link where this machine can make one, the interface's) add up over its blocks only: the same bytes per step as
    measured in one go (the shared run's second link)."""
    link = "1gbit" if ladder_run["emulated"] else None
    once = ladder_run["results"]["1gbit"]
    rounds = run_bench(model="mlp-small", steps=3, warmup=3, configs=SHARED_CONFIGS, link=link, rounds=3)
    assert rounds["summary"]["rounds"] == 3 and once["summary"]["rounds"] == 1
    for rank in rounds["raw"]:
        assert len(rank["compute_only"]["step_times"]) == 3  # once: 3 before and 3 after the configurations
        assert all(len(rank["configs"][c]["step_times"]) == 3 for c in SHARED_CONFIGS)
        assert all(rank["configs"][c]["peak_rss_mb"] is None for c in SHARED_CONFIGS)  # every configuration resident
    assert all(len(rank["compute_only"]["step_times"]) == 6 for rank in once["raw"])
    for name in SHARED_CONFIGS:
        a, b = once["summary"]["configs"][name], rounds["summary"]["configs"][name]
        assert a["peak_rss_mb"] > 0 and b["peak_rss_mb"] is None
        assert b["wire_bytes_per_step"] == a["wire_bytes_per_step"] > 0
        if link:  # what the interface carried, less the measurement's barriers, is the configuration's payload
            assert a["iface_payload_vs_ours"] == pytest.approx(1.0, abs=0.05)
            assert b["iface_payload_vs_ours"] == pytest.approx(1.0, abs=0.05)
            # the same payload per step in one go and in blocks, within 1 KB (runs differ by up to ~150 B: ACK
            # options); packets of the step before a block, still queued on its link, once took 2-18 KB per step off
            assert abs(b["iface_tx_payload_bytes_per_step"] - a["iface_tx_payload_bytes_per_step"]) <= 1024


def _fake_result() -> dict[str, Any]:
    """What a loopback run of three configurations returns (no interface counters: loopback)."""
    times = {"ddp": [0.10, 0.12, 0.11], "torch_powersgd": [0.09, 0.10, 0.095], "gradcomp_topk": [0.05, 0.06, 0.05]}
    ranks = [_rank(times, [0.01, 0.012, 0.011]) for _ in range(2)]
    for rank in ranks:
        rank["compute_only"]["references"] = {"clone": 0.001, "rand_like": 0.002, "half": 0.001}
    summary = summarise(ranks)
    summary["rounds"] = 1
    return {"link": "loopback (no link emulation requested)", "model": "mlp", "summary": summary,
            "recommendation": recommend(summary), "raw": ranks}


def test_bench_prints_compact_tables_no_json_and_the_recommendation_last(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Before: ~80 lines of JSON on stdout after the recommendation, a 12-column table about 150 characters wide
    with '-' columns on loopback and cut headers ('payload/wi…')."""
    from lightning_gradcomp.bench import runner
    from lightning_gradcomp.cli import main

    monkeypatch.setattr(runner, "run_bench", lambda *args, **kwargs: _fake_result())
    argv = ["bench", "--configs", "ddp,torch_powersgd,gradcomp_topk"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.rstrip().splitlines()
    last = out[out.rindex("recommendation:"):]  # the last line(s): the recommendation, wrapped at 100 characters
    assert " ".join(last.split()) == "recommendation: " + _fake_result()["recommendation"]
    assert "{" not in out and '"summary"' not in out  # no JSON
    assert max(len(line) for line in lines) <= 100 and "…" not in out  # compact, no cut header
    assert "iface" not in out and "payload/wire" not in out  # all '-' on loopback: left out
    header = next(line for line in lines if "ms/step" in line)
    for column in ("config", "ms/step", "p25-p75 ms", "samples/s", "scaling", "wire KB/step", "compression", "vs ddp"):
        assert column in header
    # --json FILE writes the file and still no JSON on stdout; --json - puts the JSON alone on stdout
    assert main([*argv, "--json", str(tmp_path / "b.json")]) == 0
    assert "{" not in capsys.readouterr().out and json.loads((tmp_path / "b.json").read_text())["summary"]
    assert main([*argv, "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["recommendation"].startswith("use gradcomp_topk")
    assert " ".join(captured.err[captured.err.rindex("recommendation:"):].split()).startswith(
        "recommendation: use gradcomp_topk")


def test_bench_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_gradcomp.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--steps", "20"), ("--warmup", "5"), ("--world-size", "2"), ("--rounds", "1"),
                          ("--threads", "1"), ("--model", "mlp")):
        assert re.search(rf"{flag} .*?\(default: {default}\)", text), flag
    assert "(default: None)" not in text
