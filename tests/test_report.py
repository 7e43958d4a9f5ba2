"""`lightning-gradcomp report`: real PNGs and a correct summary from a real run; clear errors otherwise."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
from helpers.models import TinyNet
from lightning.pytorch.loggers import CSVLogger

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import CompressionLogger
from lightning_gradcomp.callbacks import logger as names
from lightning_gradcomp.cli import main
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.report import (ReportError, load_metrics, loss_series, make_report, read_csv_metrics,
                                       run_name, text_summary)

pytest.importorskip("matplotlib")
from matplotlib import image  # noqa: E402


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Logs of a real 2-rank run (TopK 10%, per-layer metrics, error every 2 steps)."""
    out = tmp_path_factory.mktemp("run")
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=3, logger=CSVLogger(out / "logs"),
                         strategy=GradCompStrategy(compressor=TopK(density=0.1), start_method="fork"),
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                         callbacks=[CompressionLogger(log_every_n_steps=1, error_every_n_steps=2, per_layer=True)])
    trainer.fit(TinyNet())
    return out / "logs"


def assert_real_image(path: Path) -> None:
    pixels = image.imread(path)
    height, width = pixels.shape[:2]
    assert height >= 300 and width >= 500
    rgb = (pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    colours = np.unique(rgb, axis=0)
    assert len(colours) > 30  # lines, markers, text and anti-aliasing: not a blank canvas
    assert (rgb != 255).any(axis=1).mean() > 0.02  # at least 2% of the pixels are not white


def test_report_command_writes_real_plots(log_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(log_dir), "--out", str(tmp_path)]) == 0
    for name in ("report_bytes.png", "report_error.png", "report_layer_params.png", "report_overview.png"):
        assert_real_image(tmp_path / name)
    summary = (tmp_path / "report_summary.txt").read_text()
    assert summary.strip() == capsys.readouterr().out.split("\nwrote:")[0].strip()


def test_plots_differ_with_the_data(log_dir: Path, tmp_path: Path) -> None:
    make_report(log_dir, tmp_path / "a")
    series, _ = load_metrics(log_dir)
    flat = tmp_path / "flat.csv"
    with open(flat, "w", newline="") as fh:  # the same run with the error column removed
        writer = csv.writer(fh)
        keys = [k for k in series if k != names.ERROR and not k.startswith(names.LAYER_ERROR)]
        writer.writerow(["step", *keys])
        steps = sorted({s for k in keys for s in series[k][0]})
        for step in steps:
            writer.writerow([step, *(dict(zip(*series[k])).get(step, "") for k in keys)])
    make_report(flat, tmp_path / "b")
    a, b = image.imread(tmp_path / "a" / "report_error.png"), image.imread(tmp_path / "b" / "report_error.png")
    assert a.shape != b.shape or not np.array_equal(a, b)
    assert "compression error: not logged" in (tmp_path / "b" / "report_summary.txt").read_text()


def test_summary_reports_the_logged_figures(log_dir: Path) -> None:
    series, source = load_metrics(log_dir)
    text = text_summary(series, source)
    compression = series[names.COMPRESSION_STEP][1][-1]
    errors = series[names.ERROR][1]
    assert f"(rank 0, steps since the previous log)" in text and f"-> compression {compression:.2f}x" in text
    assert compression > 3 and "whole run (rank 0, dense warm-up included)" in text
    assert f"last {errors[-1]:.4g}" in text and f"({len(errors)} samples)" in text
    assert "body.0.weight: 0.1 -> 0.1" in text  # per-layer parameters (gradcomp/layer_param/*)


def test_layer_params_from_other_callbacks_are_plotted(tmp_path: Path) -> None:
    """L-GreCo writes gradcomp/layer_param/<layer>: the report plots whatever carries that prefix."""
    path = tmp_path / "metrics.csv"
    rows = [{"step": s, names.WIRE_BYTES: 100.0, names.DENSE_BYTES: 400.0, names.COMPRESSION_STEP: 4.0,
             names.LAYER_PARAM + "enc.weight": 0.1 / (1 + s), names.LAYER_PARAM + "dec.weight": 0.01 * (1 + s)}
            for s in range(10)]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    report = make_report(path, tmp_path / "out")
    assert_real_image(tmp_path / "out" / "report_layer_params.png")
    assert "enc.weight: 0.1 -> 0.01" in report.summary and "dec.weight: 0.01 -> 0.1" in report.summary


def test_read_csv_keeps_sparse_columns_apart(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,gradcomp/error,gradcomp/ratio,step\n0,,2.5,4\n0,0.5,,5\n0,,3.0,8\n")
    series = read_csv_metrics(path)
    assert series["gradcomp/ratio"] == ([4, 8], [2.5, 3.0])
    assert series["gradcomp/error"] == ([5], [0.5])


def test_a_short_run_shows_its_loss_beside_bytes_and_error_and_is_named(tmp_path: Path) -> None:
    """The first hour: 32 steps logged every 5. Before, the error panel held one dot (measured every 50 steps),
    nothing showed whether compression hurt the loss, and the title named metrics.csv."""
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=32, log_every_n_steps=5,
                         logger=CSVLogger(tmp_path / "logs", name="quick"),
                         strategy=GradCompStrategy(compressor=TopK(density=0.01), start_method="fork"),
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                         callbacks=[CompressionLogger(summary=False)])
    trainer.fit(TinyNet())
    series, source = load_metrics(tmp_path / "logs")
    assert list(loss_series(series)) == ["train_loss"]
    assert len(series[names.ERROR][0]) >= 5  # one measurement per logged step after the dense warm-up
    assert series[names.ERROR][0] == series["train_loss"][0]  # in the loss's rows, from the first compressed one
    assert run_name(source) == "quick/version_0 (GradCompStrategy, TopK(density=0.01), W=2)"
    report = make_report(tmp_path / "logs", tmp_path / "out")
    assert report.summary.startswith("GradComp report: quick/version_0 (GradCompStrategy, TopK(density=0.01), W=2)")
    assert "training loss (train_loss): first" in report.summary
    for name in ("report_bytes.png", "report_error.png", "report_overview.png"):
        assert_real_image(tmp_path / "out" / name)
    without = tmp_path / "no_loss.csv"  # the same run without its loss: the loss panel really draws it
    with open(source) as fh, open(without, "w") as out:
        rows = list(csv.DictReader(fh))
        writer = csv.DictWriter(out, fieldnames=[k for k in rows[0] if k != "train_loss"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    make_report(without, tmp_path / "out2")
    a, b = image.imread(tmp_path / "out" / "report_error.png"), image.imread(tmp_path / "out2" / "report_error.png")
    assert a.shape != b.shape or not np.array_equal(a, b)


def test_logs_with_the_former_metric_names_still_read(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,gradcomp/ratio,gradcomp/ratio_total,gradcomp/layer_ratio/w,step\n0,4.0,2.0,3.0,4\n")
    series, _ = load_metrics(path)
    assert series[names.COMPRESSION_STEP] == ([4], [4.0]) and series[names.COMPRESSION_WHOLE_RUN] == ([4], [2.0])
    assert series[names.LAYER_COMPRESSION + "w"] == ([4], [3.0])


def test_tensorboard_logs_are_read(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger

    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=8, logger=TensorBoardLogger(tmp_path / "tb"),
                         strategy=GradCompStrategy(compressor=TopK(density=0.1), start_method="fork"),
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                         callbacks=[CompressionLogger(log_every_n_steps=2, error_every_n_steps=2, summary=False)])
    trainer.fit(TinyNet())
    series, _ = load_metrics(tmp_path / "tb")
    assert series[names.WIRE_BYTES_TOTAL][0] == [1, 3, 5, 7]  # Lightning's steps
    assert series[names.ERROR][0] == [3, 5, 7]
    report = make_report(tmp_path / "tb", tmp_path / "out")
    assert_real_image(tmp_path / "out" / "report_overview.png")
    assert "compression error ||p - C(p)||/||p||" in report.summary


def test_clear_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 1
    assert "no metrics.csv" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.csv").write_text("step,train_loss\n0,1.0\n")
    with pytest.raises(ReportError, match="CompressionLogger"):
        make_report(other, plots=False)
    tb = tmp_path / "tb"
    tb.mkdir()
    (tb / "events.out.tfevents.1.host").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ReportError, match="pip install tensorboard"):
        load_metrics(tb)


def test_missing_matplotlib_is_explained(log_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["report", str(log_dir), "--out", str(tmp_path)]) == 1
    assert "lightning-gradcomp[plots]" in capsys.readouterr().err
    assert main(["report", str(log_dir), "--out", str(tmp_path), "--no-plots"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report_summary.txt"]
