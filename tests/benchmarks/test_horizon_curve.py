"""``benchmarks/horizon_curve.py``: the validation rows of a CSVLogger file, by step, and the change after step 1000."""

from __future__ import annotations

from pathlib import Path

from horizon_curve import curve, render


def test_curve_keeps_validation_rows_and_reports_the_change_after_step_1000(tmp_path: Path):
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,step,train/loss,val/acc,val/ppl\n0,49,2.5,,\n0,999,,0.4,7.0\n0,499,,0.3,9.0\n"
                    "1,1999,,0.5,5.5\n1,1949,2.0,,\n")
    points = curve(path, ["val/acc", "val/ppl"])
    assert points == [(499, [0.3, 9.0]), (999, [0.4, 7.0]), (1999, [0.5, 5.5])]
    text = render(points, ["val/acc", "val/ppl"])
    assert "| 1000 | 0.4000 | 7.0000 |" in text
    assert "step 1000 -> 2000: val/acc 0.4000 -> 0.5000, val/ppl 7.0000 -> 5.5000" in text
