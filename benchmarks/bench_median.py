"""Median of repeated ``lightning-gradcomp bench --json`` runs, as Markdown tables (one per link).

A single bench run moves by a few points of scaling efficiency (its compute-only baseline and every step time
drift with the machine's state), so the engine figures in docs/benchmarks.md are medians of repeated runs:

    for i in 1 2 3; do lightning-gradcomp bench ... --json run_$i.json; done
    python benchmarks/bench_median.py run_1.json run_2.json run_3.json [--chart ladder.png]

Per link and configuration: the median over the runs of the step time, the scaling efficiency (each run's
compute-only step / step), the work per step and its ratios against the references timed in the same run
(``clone``, ``clone + rand_like``, PyTorch's ``fp16_compress_hook`` and ``powerSGD_hook`` work), with the spread
(min-max) of the efficiency, and the tensors each configuration keeps between steps in fp32 copies of the gradient.
``--chart`` draws the median efficiencies as the bench's ladder chart.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Optional


def _runs(paths: list[str]) -> list[dict[str, Any]]:
    """Each file as ``{link: result}`` (a single-link ``--json`` file is keyed by its link note)."""
    out = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        out.append(data if "summary" not in data else {data.get("link", "link"): data})
    return out


def _ratio(work: Optional[float], ref: Optional[float]) -> Optional[float]:
    return work / ref if work is not None and ref else None


def rows(runs: list[dict[str, Any]], link: str) -> list[dict[str, Any]]:
    """Per configuration, the medians over ``runs`` of one link."""
    summaries = [run[link]["summary"] for run in runs]
    names = [n for n in summaries[0]["configs"] if all(n in s["configs"] for s in summaries)]  # in every run
    table = []
    for name in names:
        per_run = []
        for s in summaries:
            row = s["configs"][name]
            refs = s.get("references") or {}
            work = row.get("work_ms_per_step")
            fp16 = s["configs"].get("torch_fp16", {}).get("work_ms_per_step")
            psgd = s["configs"].get("torch_powersgd", {}).get("work_ms_per_step")
            per_run.append(
                {
                    "step": row["step_time_median_s"] * 1e3,
                    "eff": row["scaling_efficiency"],
                    "work": work,
                    "clone": _ratio(work, refs.get("clone_ms")),
                    "clone_rand": _ratio(work, (refs.get("clone_ms") or 0) + (refs.get("rand_like_ms") or 0)),
                    "fp16": _ratio(work, fp16),
                    "psgd": _ratio(work, psgd),
                    "bucket": row.get("bucket_cap_mb"),
                    "wire": row["wire_bytes_per_step"] / 1e3,
                    "state": row.get("state_gradient_copies"),
                }
            )
        med = {k: statistics.median(r[k] for r in per_run) for k in per_run[0] if per_run[0][k] is not None}
        med["eff_min"] = min(r["eff"] for r in per_run)
        med["eff_max"] = max(r["eff"] for r in per_run)
        med["name"] = name
        table.append(med)
    return table


def markdown(runs: list[dict[str, Any]], link: str) -> str:
    """One link's table."""
    computes = [run[link]["summary"]["compute_only_step_s"] * 1e3 for run in runs]
    refs = [run[link]["summary"].get("references") or {} for run in runs]
    clone = statistics.median(r.get("clone_ms", 0.0) for r in refs)
    rand = statistics.median(r.get("rand_like_ms", 0.0) for r in refs)
    lines = [
        f"*{link}, {len(runs)} runs; compute-only step {min(computes):.0f}-{max(computes):.0f} ms; references "
        f"(median) clone {clone:.2f} ms, rand_like {rand:.2f} ms.*",
        "",
        "| config | bucket MB | step ms | scaling eff. (min-max) | wire KB/step | work ms | / clone | / (clone + "
        "rand_like) | / `fp16_compress_hook` | / `powerSGD_hook` | state (gradient copies) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value: Optional[float], spec: str, unit: str = "") -> str:
        return "-" if value is None else format(value, spec) + unit

    for r in rows(runs, link):
        lines.append(
            f"| {r['name']} | {fmt(r.get('bucket'), 'g')} | {r['step']:.0f} | {r['eff']:.0%} "
            f"({r['eff_min']:.0%}-{r['eff_max']:.0%}) | {r['wire']:,.1f} | {fmt(r.get('work'), '.1f')} | "
            f"{fmt(r.get('clone'), '.1f', 'x')} | {fmt(r.get('clone_rand'), '.2f', 'x')} | "
            f"{fmt(r.get('fp16'), '.2f', 'x')} | {fmt(r.get('psgd'), '.2f', 'x')} | {fmt(r.get('state'), '.1f')} |"
        )
    return "\n".join(lines)


def median_results(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The runs as one bench result per link (what ``bench --json`` holds), each configuration's scaling efficiency the
    median over the runs: the input of :func:`lightning_gradcomp.bench.runner.plot_ladder`, titled with the count."""
    out = {}
    for link, first in runs[0].items():
        effs = {r["name"]: r["eff"] for r in rows(runs, link)}
        out[link] = {
            "model": f"{first['model']}, median of {len(runs)} runs",
            "summary": {
                "world_size": first["summary"]["world_size"],
                "configs": {name: {"scaling_efficiency": eff} for name, eff in effs.items()},
            },
        }
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="bench --json files of the same command")
    parser.add_argument("--chart", help="also draw the median scaling efficiencies as a PNG ladder chart (matplotlib)")
    args = parser.parse_args(argv)
    runs = _runs(args.runs)
    for link in runs[0]:
        print(markdown(runs, link))
        print()
    if args.chart:
        from lightning_gradcomp.bench.runner import plot_ladder

        plot_ladder(median_results(runs), args.chart)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
