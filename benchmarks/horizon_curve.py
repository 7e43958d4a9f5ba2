"""The held-out curve of a recipe run, as a Markdown table: one row per validation (issue 49's horizon check).

    python benchmarks/horizon_curve.py runs/language/dense_long_cpu/logs/version_0/metrics.csv val/acc val/ppl

Reads a ``CSVLogger`` ``metrics.csv`` (the recipes log one) and prints ``step`` and the named metrics for every row
that has the first of them, then the change from the first row at or after step 1000 to the last row.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def curve(path: Path, metrics: list[str]) -> list[tuple[int, list[float]]]:
    """(step, values) for every row of ``path`` where ``metrics[0]`` is logged, by step."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get(metrics[0])]
    return sorted((int(r["step"]), [float(r[m]) if r.get(m) else float("nan") for m in metrics]) for r in rows)


def render(points: list[tuple[int, list[float]]], metrics: list[str]) -> str:
    """Markdown table of ``points``, plus the step-1000 -> last change of each metric."""
    lines = ["| step | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    lines += [f"| {step + 1} | " + " | ".join(f"{v:.4f}" for v in values) + " |" for step, values in points]
    later = [p for p in points if p[0] + 1 >= 1000]
    if later and later[0] is not points[-1]:
        (s0, v0), (s1, v1) = later[0], points[-1]
        change = ", ".join(f"{m} {a:.4f} -> {b:.4f}" for m, a, b in zip(metrics, v0, v1))
        lines.append(f"\nstep {s0 + 1} -> {s1 + 1}: {change}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path, help="a CSVLogger metrics.csv")
    parser.add_argument("metrics", nargs="+", help="logged metric names; rows are those with the first")
    args = parser.parse_args()
    print(render(curve(args.csv, args.metrics), args.metrics))


if __name__ == "__main__":
    main()
