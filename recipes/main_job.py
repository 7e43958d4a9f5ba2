"""The README's one-command demo: train the image recipe with ScaleCom on 2 local processes, print the accuracy
and the bytes saved against dense all-reduce.

    python -m recipes.main_job              # Fashion-MNIST (installs Debian's package when it can), ScaleCom
    python -m recipes.main_job --dense      # also train the dense baseline and compare accuracies

Data, in order of preference: Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (installed with apt-get when
running as root and apt works), scikit-learn's bundled 8x8 digits, generated shapes. The job says which it used.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from recipes import config_path
from recipes.data.idx import find_idx_pair
from recipes.data.image_data import FASHION_MNIST_DIR
from recipes.report import format_bytes

__all__ = ["DataChoice", "choose_data", "main", "run_config"]

DEBIAN_PACKAGE = "dataset-fashion-mnist"


@dataclass(frozen=True)
class DataChoice:
    """The data the job trains on: a :class:`~recipes.data.image_data.ImageDataModule` source, root and why."""

    source: str
    root: Optional[str]
    description: str


def _has_fashion_mnist(root: str) -> bool:
    try:
        find_idx_pair(root, "train")
        find_idx_pair(root, "t10k")
    except FileNotFoundError:
        return False
    return True


def _apt_install(package: str) -> bool:
    """``apt-get install -y package`` (after ``apt-get update`` if the first try fails); True on success."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for update in (False, True):
        if update:
            subprocess.run(["apt-get", "update", "-q"], env=env, check=False, stdout=subprocess.DEVNULL)
        done = subprocess.run(["apt-get", "install", "-y", "-q", package], env=env, check=False,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode == 0:
            return True
    return False


def _can_apt() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get") is not None


def choose_data(allow_install: bool = True, fashion_dir: str = FASHION_MNIST_DIR) -> DataChoice:
    """Fashion-MNIST if present (or installable), else scikit-learn digits, else generated shapes."""
    if _has_fashion_mnist(fashion_dir):
        return DataChoice("fashion_mnist", fashion_dir, f"Fashion-MNIST from Debian's {DEBIAN_PACKAGE} ({fashion_dir})")
    why = f"{fashion_dir} has no Fashion-MNIST IDX files"
    if allow_install and _can_apt():
        print(f"[main-job] installing Debian's {DEBIAN_PACKAGE} (apt-get install -y {DEBIAN_PACKAGE}) ...", flush=True)
        if _apt_install(DEBIAN_PACKAGE) and _has_fashion_mnist(fashion_dir):
            return DataChoice("fashion_mnist", fashion_dir,
                              f"Fashion-MNIST from Debian's {DEBIAN_PACKAGE}, installed just now ({fashion_dir})")
        why += f" and apt-get install {DEBIAN_PACKAGE} failed"
    elif allow_install:
        why += " and apt-get is not usable here (needs root and apt)"
    try:
        import sklearn.datasets  # noqa: F401
    except ImportError:
        return DataChoice("shapes", None, f"generated 28x28 shapes (fallback: {why}; scikit-learn not installed)")
    return DataChoice("digits", None, f"scikit-learn's bundled 8x8 digits (fallback: {why})")


def run_config(config: str, data: DataChoice, out: Path, epochs: Optional[int], train_subset: Optional[int],
               extra: Sequence[str] = ()) -> dict:
    """Train ``configs/image/<config>.yaml`` on ``data``; return the run's summary."""
    from recipes.image import main as image_main

    args = ["fit", "-c", str(config_path("image", config)), f"--data.source={data.source}",
            f"--trainer.default_root_dir={out / config}", f"--report.path={out / config / 'summary.json'}"]
    if epochs is not None:
        args.append(f"--trainer.max_epochs={epochs}")
    if data.root:
        args.append(f"--data.root={data.root}")
    if train_subset is not None:
        args.append(f"--data.train_subset={train_subset}")
    if data.source == "digits":  # 1400 tiny images: smaller batches
        args += ["--data.batch_size=32"]
    with warnings.catch_warnings():  # we pass args on purpose, next to this job's own sys.argv
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        image_main(args=[*args, *extra])
    return json.loads((out / config / "summary.json").read_text())


def _table(runs: dict[str, dict]) -> list[str]:
    """Side-by-side rows: top-1, bytes sent, dense DDP's bytes, whole-run compression (dense/wire), saved, wall time."""
    lines = [f"  {'run':<10} {'top-1':>8} {'sent':>11} {'dense DDP':>11} {'compr.':>8} {'saved':>7} {'wall':>7}"]
    for name, summary in runs.items():
        acc = summary["metrics"].get("val/acc1", float("nan"))
        comm = summary["comm"]
        lines.append(f"  {name:<10} {100 * acc:7.2f}% {format_bytes(comm['wire_bytes']):>11} "
                     f"{format_bytes(comm['dense_bytes']):>11} {comm['compression_ratio']:7.1f}x "
                     f"{100 * comm['saved_fraction']:6.1f}% {summary['fit_seconds']:6.0f}s")
    return lines


def _positive_int(text: str) -> int:
    """An option's integer value, at least 1 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse options, pick the data, train, print the result."""
    parser = argparse.ArgumentParser(prog="python -m recipes.main_job", description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=_positive_int, default=None,
                        help="epochs (default: the config's 6, or 20 on the digits fallback)")
    parser.add_argument("--train-subset", type=_positive_int, default=None, help="train on this many images only")
    parser.add_argument("--dense", action="store_true", help="also train the dense baseline and compare")
    parser.add_argument("--no-install", action="store_true", help="never run apt-get")
    parser.add_argument("--out", default="runs/main_job", help="output folder (summaries)")
    parser.add_argument("--data-dir", default=FASHION_MNIST_DIR, help="folder of the Fashion-MNIST IDX files")
    parser.add_argument("overrides", nargs="*", help="extra LightningCLI overrides, e.g. --trainer.devices=4")
    args, unknown = parser.parse_known_args(argv)
    data = choose_data(allow_install=not args.no_install, fashion_dir=args.data_dir)
    print(f"[main-job] data: {data.description}", flush=True)
    epochs = args.epochs if args.epochs is not None else (20 if data.source == "digits" else None)
    out = Path(args.out)
    runs = {"ScaleCom": run_config("scalecom_cpu", data, out, epochs, args.train_subset, [*args.overrides, *unknown])}
    if args.dense:
        runs["dense"] = run_config("dense_cpu", data, out, epochs, args.train_subset, [*args.overrides, *unknown])
    print("\n[main-job] ResNet-8, 2 processes, data: " + data.description)
    print("[main-job] whole run: every step's bytes, warm-up included; dense DDP = fp32 ring all-reduce of every "
          "bucket")
    for line in _table(runs):
        print(line)
    if args.dense:
        gap = runs["dense"]["metrics"]["val/acc1"] - runs["ScaleCom"]["metrics"]["val/acc1"]
        print(f"  ScaleCom is {100 * gap:.2f} points below dense" if gap >= 0 else
              f"  ScaleCom is {-100 * gap:.2f} points above dense")
    print(f"[main-job] summaries in {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
