"""benchmarks/advise_check.py: rankings inverted beyond the measured spread, medians of predictions, the table."""

from __future__ import annotations

import pytest
from advise_check import compare, inversions, median_report  # benchmarks/ (on sys.path: conftest.py)


def _report(steps: dict[str, float], exposed: float = 0.0) -> dict:
    return {
        "compute_only_step_s": 1.0,
        "configs": {
            n: {"step_s": s, "exposed_s": exposed * s, "scaling_efficiency": 1.0 / s} for n, s in steps.items()
        },
    }


def test_an_inversion_needs_every_run_on_the_other_side() -> None:
    pred = {"a": 1.0, "b": 2.0, "c": 3.0}
    runs = {"a": [1.9, 2.5], "b": [2.0, 2.1], "c": [0.5, 0.6]}
    # a and b overlap (a tie within the spread); c is faster than both in every run
    assert inversions(pred, runs) == [("a", "c"), ("b", "c")]
    assert inversions(pred, {"a": [1.0], "b": [2.0]}) == []


def test_median_report_and_the_table() -> None:
    report = median_report([_report({"ddp": 2.0, "topk": 1.0}), _report({"ddp": 4.0, "topk": 1.2}),
                            _report({"ddp": 3.0, "topk": 5.0})])
    assert report["configs"]["ddp"]["step_s"] == 3.0 and report["configs"]["topk"]["step_s"] == pytest.approx(1.2)
    table = compare(_report({"ddp": 3.0, "topk": 1.0}, exposed=0.9), {"ddp": [2.9, 3.1, 3.6], "topk": [1.5, 1.6, 1.7]})
    assert "| ddp | 3000 | 3100 (2900-3600) | -3% | yes | yes | 2 | 2 | - |" in table
    assert "| topk | 1000 | 1600 (1500-1700) | -38% | yes | no | 1 | 1 | - |" in table
    assert table.endswith("matches the measured one within the measured spread")
