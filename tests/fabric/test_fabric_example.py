"""docs/fabric.md's example: shown verbatim, and it runs (popen, as a script; forked, in-process)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import fabric_quickstart  # noqa: E402


def test_the_page_shows_the_example_verbatim() -> None:
    source = (ROOT / "examples" / "fabric_quickstart.py").read_text().strip()
    assert source in (ROOT / "docs" / "fabric.md").read_text()


@pytest.mark.slow
def test_the_example_runs_two_processes_with_the_popen_launcher(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "fabric_quickstart.py"), "scalecom"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"rank (\d): ([\d,]+) B/step sent vs dense ([\d,]+) \(8 steps, 2 of them dense\)", proc.stdout)
    assert sorted(rank for rank, _, _ in lines) == ["0", "1"]
    for _, sent, dense in lines:
        assert int(sent.replace(",", "")) * 3 < int(dense.replace(",", ""))
    assert not list(tmp_path.iterdir()), "the example left files in the current folder"


def test_the_example_forked_returns_rank_zeros_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    stats = fabric_quickstart.main("gradcomp_topk", start_method="fork")
    assert stats["steps"] == 8 and stats["compressed_steps"] == 6 and stats["wire_bytes"] < stats["dense_bytes"]
    assert not list(tmp_path.iterdir())
