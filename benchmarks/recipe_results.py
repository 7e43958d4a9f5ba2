"""Train recipe configs one after another and print a markdown table of metric and bytes.

    python benchmarks/recipe_results.py image dense_cpu scalecom_cpu
    python benchmarks/recipe_results.py speech dense_cpu scalecom_cpu -- --trainer.max_epochs=5

Each config runs as ``python -m recipes.<task> fit -c recipes/configs/<task>/<config>.yaml`` from the repository
root, with the overrides after ``--``; its summary goes to ``runs/bench/<task>/<config>.json`` (or under
``--out``). With ``--table`` only the table of existing summaries is printed (nothing is trained).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from _common import METRICS, ROOT  # benchmarks/_common.py


def run(task: str, config: str, overrides: list[str], out: Path) -> None:
    """Train one config; raise if the run fails."""
    cmd = [sys.executable, "-m", f"recipes.{task}", "fit", "-c", f"recipes/configs/{task}/{config}.yaml",
           "--trainer.enable_progress_bar=false", f"--report.path={out}", *overrides]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def row(task: str, config: str, summary: dict) -> str:
    """One markdown table row."""
    key, _, scale = METRICS[task]
    comm = summary.get("comm", {})
    extra = summary["metrics"].get("val/bleu")
    metric = f"{scale * summary['metrics'][key]:.2f}" + (f" (BLEU {100 * extra:.1f})" if extra is not None else "")
    return (f"| {task} | `{config}` | {metric} | {comm.get('wire_bytes', 0) / 2**20:.1f} | "
            f"{comm.get('dense_bytes', 0) / 2**20:.1f} | {100 * comm.get('saved_fraction', 0):.1f} | "
            f"{summary['steps']} | {summary['fit_seconds']:.0f} |")


def main() -> int:
    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=sorted(METRICS))
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--table", action="store_true", help="only print the table of existing summaries")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench"), help="summaries go to OUT/<task>/<config>.json")
    args = parser.parse_args(argv)
    out_dir = Path(args.out) / args.task
    rows = []
    for config in args.configs:
        out = out_dir / f"{config}.json"
        if not args.table:
            run(args.task, config, overrides, out)
        rows.append(row(args.task, config, json.loads(out.read_text())))
    _, name, _ = METRICS[args.task]
    print(f"\n| task | config | {name} | wire MiB (all ranks) | dense-equivalent MiB | saved % | steps | fit s |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
