"""benchmarks/bench_median.py: medians of repeated bench runs as tables, and as the bench's ladder chart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_median import main, median_results, rows  # benchmarks/ (on sys.path: conftest.py)


def _run(effs: dict[str, float], clone_ms: float) -> dict:
    """One ``bench --json`` ladder result over two links, the same efficiencies on both."""
    configs = {
        name: {"step_time_median_s": 0.3 / eff, "scaling_efficiency": eff, "work_ms_per_step": 2.0 * i + 1.0,
               "wire_bytes_per_step": 1000.0, "bucket_cap_mb": 25.0, "state_gradient_copies": 1.0}
        for i, (name, eff) in enumerate(effs.items())
    }
    summary = {"world_size": 2, "compute_only_step_s": 0.3, "references": {"clone_ms": clone_ms, "rand_like_ms": 9.0},
               "configs": configs}
    return {link: {"link": link, "model": "transformer", "summary": summary} for link in ("1gbit", "100mbit")}


def test_medians_per_configuration_and_link(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    runs = [_run({"topk": 0.9, "qsgd": 0.7}, 1.0), _run({"topk": 0.5, "qsgd": 0.8}, 2.0),
            _run({"topk": 0.95, "qsgd": 0.6}, 3.0)]
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run_{i}.json")
        paths[-1].write_text(json.dumps(run))
    table = {r["name"]: r for r in rows(runs, "1gbit")}
    assert table["topk"]["eff"] == 0.9 and (table["topk"]["eff_min"], table["topk"]["eff_max"]) == (0.5, 0.95)
    assert table["qsgd"]["eff"] == 0.7 and table["qsgd"]["clone"] == 1.5  # work 3.0 ms over clones 1, 2, 3 ms
    medians = median_results(runs)
    assert list(medians) == ["1gbit", "100mbit"]
    assert medians["100mbit"]["model"] == "transformer, median of 3 runs"
    assert {n: c["scaling_efficiency"] for n, c in medians["100mbit"]["summary"]["configs"].items()} == {
        "topk": 0.9, "qsgd": 0.7}
    pytest.importorskip("matplotlib")
    chart = tmp_path / "ladder.png"
    assert main([*map(str, paths), "--chart", str(chart)]) == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "*1gbit, 3 runs;" in out and "| topk | 25 | 333 | 90% (50%-95%) |" in out
