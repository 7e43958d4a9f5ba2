"""Every recipe trains (``fast_dev_run``) on tiny offline data with 2 forked CPU processes and reports metrics
and bytes; compressed configs put fewer bytes on the wire than their dense equivalent."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest

from recipes import RECIPES, config_path

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


def _image_source() -> str:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        return "shapes"
    return "digits"


def _tiny(task: str, tmp_path: Path) -> list[str]:
    if task == "image":
        return [f"--data.source={_image_source()}", "--data.batch_size=8", "--data.train_subset=64",
                "--data.val_subset=32"]
    if task == "translation":
        return ["--data.num_train=128", "--data.num_val=16", "--data.batch_size=16"]
    if task == "language":
        return ["--data.source=text", f"--data.root={_text_file(tmp_path)}", "--data.context=32",
                "--data.batch_size=4"]
    return ["--data.engine=tones", "--data.num_train=32", "--data.num_val=8", "--data.held_out=2",
            f"--data.cache_dir={tmp_path / 'cache'}", "--data.batch_size=4"]


def _text_file(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("".join(f"Sentence number {i} is here. Satz Nummer {i} ist hier.\n" for i in range(400)),
                    encoding="utf-8")
    return path


def fast_fit(task: str, config: str, tmp_path: Path, *extra: str) -> dict:
    """Run ``fit`` with ``fast_dev_run=4`` and compression from step 2; return the rank-0 summary."""
    module = importlib.import_module(RECIPES[task].module)
    args = ["fit", "-c", str(config_path(task, config)), "--trainer.fast_dev_run=4",
            "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
            f"--report.path={tmp_path / 'summary.json'}", *_tiny(task, tmp_path), *extra]
    if "swarm" not in config:
        args.append("--trainer.strategy.init_args.start_step=2")
    module.main(args=args)
    return json.loads((tmp_path / "summary.json").read_text())


def _check(summary: dict, compressed: bool) -> None:
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert summary["metrics"] and all(math.isfinite(v) for v in summary["metrics"].values())
    comm = summary["comm"]
    assert comm["dense_bytes"] > 0
    if compressed:
        assert comm["wire_bytes"] < 0.8 * comm["dense_bytes"]
    else:
        assert comm["wire_bytes"] == pytest.approx(comm["dense_bytes"])


@pytest.mark.parametrize("task", sorted(RECIPES))
def test_dense_recipe_runs_on_two_processes(task: str, tmp_path: Path):
    summary = fast_fit(task, "dense_cpu", tmp_path)
    _check(summary, compressed=False)
    expected = {"image": "val/acc1", "translation": "val/exact", "speech": "val/wer", "language": "val/acc"}[task]
    assert expected in summary["metrics"]


@pytest.mark.parametrize("task", sorted(RECIPES))
def test_scalecom_recipe_runs_on_two_processes(task: str, tmp_path: Path):
    summary = fast_fit(task, "scalecom_cpu", tmp_path)
    _check(summary, compressed=True)
    assert "CLTK" in summary["compressor"]


@pytest.mark.parametrize("config", ["qsgd_cpu", "diana_cpu", "powersgd_lgreco_cpu", "swarmsgd_cpu"])
def test_other_image_configs_run_on_two_processes(config: str, tmp_path: Path):
    if config not in RECIPES["image"].configs:
        pytest.skip(f"{config} is not shipped")
    _check(fast_fit("image", config, tmp_path), compressed=True)


@pytest.mark.parametrize("task, config", [("language", "dense_long_cpu"), ("language", "scalecom_long_cpu"),
                                          ("speech", "dense_long_cpu"), ("speech", "scalecom_long_cpu")])
def test_long_configs_run_on_two_processes(task: str, config: str, tmp_path: Path):
    """Issue 49's configs with a horizon, a few steps each on tiny data (spoken words: 12 words, 2-word phrases)."""
    extra = []
    if task == "speech":
        from recipes.data.digit_speech import espeak_available

        if not espeak_available():
            pytest.skip("the spoken-words corpus needs espeak-ng (apt-get install espeak-ng)")
        extra = ["--data.vocab_size=12", "--data.max_words=2"]
    summary = fast_fit(task, config, tmp_path, *extra)
    _check(summary, compressed="scalecom" in config)
    assert {"language": "val/ppl", "speech": "val/wer"}[task] in summary["metrics"]
