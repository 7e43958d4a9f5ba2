"""The README quick start (real popen launcher) and the documented custom compressor."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.distributed import run_workers
from helpers.models import assert_replicas_identical, fit
from helpers.reduce import rank_inputs, reduce_worker
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import all_gather_bytes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from custom_compressor import Int8AllGather  # noqa: E402


def test_docs_show_the_tested_compressor_verbatim() -> None:
    source = (ROOT / "examples" / "custom_compressor.py").read_text()
    page = (ROOT / "docs" / "custom-compressor.md").read_text()
    body = source[source.index("@register"):]
    assert body.strip() in page
    assert len(body.strip().splitlines()) < 50


def test_custom_compressor_reduces_and_counts_bytes() -> None:
    shapes = [(30, 40), (10, 10)]
    results = run_workers(reduce_worker, 3, Int8AllGather(), shapes)
    inputs = [rank_inputs(r, shapes) for r in range(3)]
    for layer in range(2):
        mean = sum(x[layer] for x in inputs) / 3
        bound = max(float(x[layer].abs().max()) for x in inputs) / 127  # half a step per rank, averaged
        got = results[0]["steps"][0]["averaged"][layer]
        assert float((got - mean).abs().max()) <= bound
        assert torch.equal(got, results[2]["steps"][0]["averaged"][layer])
    assert results[0]["stats"]["wire_bytes"] == pytest.approx(all_gather_bytes(1300 + 2 * 4, 3))


def test_custom_compressor_trains_with_identical_replicas(tmp_path: Path) -> None:
    records = fit(GradCompStrategy(compressor=Int8AllGather(), start_method="fork"), tmp_path, max_epochs=2)
    assert_replicas_identical(records)
    assert records[0]["stats"]["wire_bytes"] < records[0]["stats"]["dense_bytes"] / 2


@pytest.mark.slow
def test_quickstart_script_runs_two_processes_with_the_popen_launcher(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), "topk"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"rank (\d): ([\d,]+) B/step sent vs dense ([\d,]+)", proc.stdout)
    assert sorted(rank for rank, _, _ in lines) == ["0", "1"]
    for _, sent, dense in lines:
        assert int(sent.replace(",", "")) * 3 < int(dense.replace(",", ""))
