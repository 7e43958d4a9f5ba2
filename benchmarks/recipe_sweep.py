"""Train named settings of a recipe over several seeds and print one markdown table (mean and per seed).

    python benchmarks/recipe_sweep.py translation --seeds 0 1 \\
        --setting dense=dense_cpu \\
        --setting "w100=scalecom_cpu --trainer.strategy.init_args.start_step=2"

A setting is ``name=config [LightningCLI overrides...]`` (``config`` names ``recipes/configs/<task>/<config>.yaml``).
Every run is ``python -m recipes.<task> fit -c ... --seed_everything=<seed> <overrides>`` from the repository root;
its summary goes to ``<out>/<task>/<name>/seed<seed>.json`` and an existing summary is reused (``--table`` trains
nothing; ``--plot`` draws metric against ratio). Ratios are whole-run: the sum over the run of the dense-equivalent bytes over the bytes sent.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

from _common import METRICS, ROOT  # benchmarks/_common.py

from lightning_gradcomp.comm import compression_ratio


def parse_setting(text: str) -> tuple[str, str, list[str]]:
    """``"name=config --a=1 --b=2"`` -> ``(name, config, overrides)``."""
    name, _, rest = text.partition("=")
    words = shlex.split(rest)
    if not name or not words:
        raise ValueError(f"a setting is 'name=config [overrides]', got {text!r}")
    return name, words[0], words[1:]


def train(task: str, config: str, overrides: list[str], seed: int, out: Path) -> None:
    """One run; raises if it fails."""
    cmd = [sys.executable, "-m", f"recipes.{task}", "fit", "-c", f"recipes/configs/{task}/{config}.yaml",
           "--trainer.enable_progress_bar=false", f"--seed_everything={seed}", f"--report.path={out}",
           f"--trainer.default_root_dir={out.parent / f'root{seed}'}", *overrides]
    print("$", shlex.join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def summarize(task: str, summary: dict) -> tuple[float, float]:
    """``(metric in %, whole-run compression ratio)``."""
    key, _, scale = METRICS[task]
    comm = summary["comm"]
    return scale * summary["metrics"][key], compression_ratio(comm["dense_bytes"], comm["wire_bytes"])


def table(task: str, rows: list[tuple[str, str, list[str], dict[int, dict]]], reference: Optional[str]) -> str:
    """Markdown: setting, config, metric per seed and mean, gap to ``reference``'s mean, ratio."""
    _, metric_name, _ = METRICS[task]
    means = {name: statistics.mean(summarize(task, s)[0] for s in runs.values()) for name, _, _, runs in rows if runs}
    lines = [f"| setting | config | {metric_name} per seed | mean | vs {reference or '-'} | "
             f"whole-run ratio | fit s |", "|---|---|---|---|---|---|---|"]
    for name, config, overrides, runs in rows:
        if not runs:
            continue
        metrics = [summarize(task, runs[s])[0] for s in sorted(runs)]
        ratios = [summarize(task, runs[s])[1] for s in sorted(runs)]
        gap = f"{means[name] - means[reference]:+.2f}" if reference in means and name != reference else ""
        seconds = statistics.mean(runs[s]["fit_seconds"] for s in runs)
        per_seed = ", ".join(f"s{s}: {m:.2f}" for s, m in zip(sorted(runs), metrics))
        text = config + (" + overrides" if overrides else "")  # the overrides are in the command line
        lines.append(f"| {name} | `{text}` | {per_seed} | {means[name]:.2f} | {gap} | "
                     f"{statistics.mean(ratios):.1f}x | {seconds:.0f} |")
    return "\n".join(lines)


def plot(task: str, rows: list[tuple[str, str, list[str], dict[int, dict]]], path: Path,
         reference: Optional[str]) -> None:
    """Metric against whole-run compression ratio (log x), one point per seed and the mean per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, metric_name, _ = METRICS[task]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, _, _, runs in rows:
        if not runs:
            continue
        points = [summarize(task, runs[s]) for s in sorted(runs)]
        xs, ys = [r for _, r in points], [m for m, _ in points]
        line = ax.scatter(xs, ys, s=14, alpha=0.5)
        ax.scatter([statistics.mean(xs)], [statistics.mean(ys)], s=60, color=line.get_facecolor()[0], label=name,
                   marker="D" if name == reference else "o")
    ax.axvline(65, color="grey", linestyle=":", label="65x")
    ax.set_xscale("log")
    ax.set_xlabel("whole-run compression ratio (dense bytes / bytes sent)")
    ax.set_ylabel(metric_name)
    ax.set_title(f"{task}: accuracy against bytes (small dots: seeds, large: mean)")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"[sweep] wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=sorted(METRICS))
    parser.add_argument("--setting", action="append", default=[], help="name=config [overrides]")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--reference", default="dense", help="setting the gaps are measured against")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "sweep")
    parser.add_argument("--table", action="store_true", help="only print the table of existing summaries")
    parser.add_argument("--plot", type=Path, default=None, help="also draw metric against ratio into this PNG")
    args = parser.parse_args()
    rows = []
    for text in args.setting:
        name, config, overrides = parse_setting(text)
        runs = {}
        for seed in args.seeds:
            out = args.out / args.task / name / f"seed{seed}.json"
            if not out.exists() and not args.table:
                train(args.task, config, overrides, seed, out)
            if out.exists():
                runs[seed] = json.loads(out.read_text())
                metric, ratio = summarize(args.task, runs[seed])
                print(f"[sweep] {args.task} {name} seed {seed}: {metric:.2f} at {ratio:.1f}x", flush=True)
        rows.append((name, config, overrides, runs))
    print(table(args.task, rows, args.reference))
    if args.plot is not None:
        plot(args.task, rows, args.plot, args.reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
