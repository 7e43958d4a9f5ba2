"""A recipe run's folder is keyed by the strategy actually used, and it logs what ``report`` reads (issue 52,
item 10): ``--trainer.strategy=scalecom`` on the dense config no longer overwrites the dense baseline's summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes import config_path
from recipes.cli import strategy_override
from recipes.image import main
from recipes.report import RecipeReport
from lightning_gradcomp.cli import main as gradcomp_cli
from lightning_gradcomp.report import load_metrics

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


@pytest.mark.parametrize("argv, label", [
    ([], ""),
    (["--trainer.strategy=scalecom"], "scalecom"),
    (["--trainer.strategy", "scalecom_fork"], "scalecom_fork"),
    (["--trainer.strategy=lightning_gradcomp.SwarmStrategy"], "SwarmStrategy"),
    (["--trainer.max_epochs=1", "--trainer.strategy.init_args.compressor=TopK"], "strategy-"),
])
def test_the_label_names_the_strategy_the_command_line_sets(argv: list[str], label: str) -> None:
    got = strategy_override(argv)
    assert got.startswith(label) and (label != "" or got == "")
    if label == "strategy-":
        assert got != strategy_override([*argv, "--trainer.strategy.init_args.compressor.init_args.ratio=0.1"])


@pytest.mark.parametrize("extra, folder", [([], "dense_cpu"), (["--trainer.strategy=scalecom"], "dense_cpu+scalecom")])
def test_the_summary_and_the_logs_go_to_the_strategys_folder(extra: list[str], folder: str) -> None:
    cli = main(["-c", str(config_path("image", "dense_cpu")), *extra], run=False)
    (report,) = [c for c in cli.trainer.callbacks if isinstance(c, RecipeReport)]
    assert cli.trainer.default_root_dir.endswith(f"runs/image/{folder}")
    assert report.path == f"runs/image/{folder}/summary.json"
    assert type(cli.trainer.logger).__name__ == "CSVLogger" and cli.trainer.logger.save_dir == f"runs/image/{folder}"


def test_explicit_paths_on_the_command_line_win(tmp_path: Path) -> None:
    cli = main(["-c", str(config_path("image", "dense_cpu")), "--trainer.strategy=scalecom",
                f"--trainer.default_root_dir={tmp_path}", f"--report.path={tmp_path / 's.json'}"], run=False)
    (report,) = [c for c in cli.trainer.callbacks if isinstance(c, RecipeReport)]
    assert cli.trainer.default_root_dir == str(tmp_path) and report.path == str(tmp_path / "s.json")


def test_a_compressed_run_of_the_dense_config_keeps_the_baseline_and_report_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    main(["fit", "-c", str(config_path("image", "dense_cpu")), "--trainer.strategy=scalecom_fork",
          "--trainer.max_steps=4", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
          "--data.source=shapes", "--data.batch_size=8", "--data.train_subset=64", "--data.val_subset=32"])
    run = tmp_path / "runs" / "image" / "dense_cpu+scalecom_fork"
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert not (tmp_path / "runs" / "image" / "dense_cpu").exists()
    series, csv = load_metrics(run)
    assert csv.is_relative_to(run / "logs") and any(name.startswith("gradcomp/") for name in series)
    assert gradcomp_cli(["report", str(run)]) == 0
