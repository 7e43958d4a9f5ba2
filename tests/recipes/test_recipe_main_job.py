"""The README's main job: data choice (present / installed / fallbacks) and one tiny end-to-end run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recipes import main_job
from recipes.data.idx import write_idx

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


def _write_fashion(root: Path, n: int = 256) -> None:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    labels = (np.arange(n) % 10).astype(np.uint8)
    images = (rng.integers(0, 60, (n, 28, 28)) + labels[:, None, None] * 19).astype(np.uint8)  # learnable
    for split, count in (("train", n), ("t10k", n // 4)):
        write_idx(root / f"{split}-images-idx3-ubyte.gz", images[:count])
        write_idx(root / f"{split}-labels-idx1-ubyte.gz", labels[:count])


def test_uses_fashion_mnist_when_present(tmp_path: Path):
    _write_fashion(tmp_path)
    choice = main_job.choose_data(allow_install=False, fashion_dir=str(tmp_path))
    assert (choice.source, choice.root) == ("fashion_mnist", str(tmp_path))


def test_installs_the_debian_package_when_it_can(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    calls = []

    def fake_install(package: str) -> bool:
        calls.append(package)
        _write_fashion(tmp_path)
        return True

    monkeypatch.setattr(main_job, "_can_apt", lambda: True)
    monkeypatch.setattr(main_job, "_apt_install", fake_install)
    choice = main_job.choose_data(allow_install=True, fashion_dir=str(tmp_path))
    assert calls == ["dataset-fashion-mnist"]
    assert choice.source == "fashion_mnist" and "installed just now" in choice.description


def test_falls_back_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(main_job, "_can_apt", lambda: True)
    monkeypatch.setattr(main_job, "_apt_install", lambda package: False)
    choice = main_job.choose_data(allow_install=True, fashion_dir=str(tmp_path / "none"))
    assert choice.source in ("digits", "shapes")
    assert "apt-get install dataset-fashion-mnist failed" in choice.description
    quiet = main_job.choose_data(allow_install=False, fashion_dir=str(tmp_path / "none"))
    assert quiet.source == choice.source and "failed" not in quiet.description


def test_main_job_trains_and_prints_accuracy_and_bytes_saved(tmp_path: Path, capsys: pytest.CaptureFixture):
    _write_fashion(tmp_path / "fmnist")
    rc = main_job.main(["--no-install", f"--data-dir={tmp_path / 'fmnist'}", "--epochs=1", f"--out={tmp_path / 'out'}",
                        "--data.batch_size=16", "--trainer.strategy.init_args.start_step=2",
                        "--trainer.enable_progress_bar=false"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "data: Fashion-MNIST" in out
    header = next(s for s in out.splitlines() if s.split()[:2] == ["run", "top-1"])
    assert all(word in header for word in ("sent", "dense DDP", "compr.", "wall"))
    line = next(s for s in out.splitlines() if s.strip().startswith("ScaleCom"))
    assert line.count("%") == 2 and "x" in line and line.rstrip().endswith("s")
    assert (tmp_path / "out" / "scalecom_cpu" / "summary.json").is_file()


@pytest.mark.parametrize("argv", [["--epochs", "0"], ["--epochs", "-1"], ["--train-subset", "0"],
                                  ["--train-subset", "-5"], ["--epochs", "x"]])
def test_bad_counts_are_usage_errors(argv: list, capsys: pytest.CaptureFixture):
    """``--epochs 0`` and ``--train-subset 0`` were read as "not set", ``-1`` crashed inside training, ``-5`` dropped
    five images."""
    with pytest.raises(SystemExit) as stop:
        main_job.main(argv)
    assert stop.value.code == 2
    assert f"argument {argv[0]}: must be an integer >= 1" in capsys.readouterr().err
