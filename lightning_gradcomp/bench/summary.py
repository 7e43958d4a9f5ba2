"""The bench's figures from every rank's raw measurements (:func:`summarise`, pure) and its one-line
recommendation (:func:`recommend`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, Optional

__all__ = ["recommend", "summarise", "work_ms_of"]


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarise(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-configuration figures from every rank's raw measurements (pure)."""
    world = len(ranks)
    # a step ends when the last rank ends, with or without communication
    # median over the compute-only steps, run before and after the configurations or in rounds between them
    # (see worker.run_rank)
    compute = statistics.median(max(ts) for ts in zip(*(r["compute_only"]["step_times"] for r in ranks)))
    rows: dict[str, dict[str, Any]] = {}
    for name, first in ranks[0]["configs"].items():
        per_rank = [r["configs"][name] for r in ranks]
        times = [max(ts) for ts in zip(*(p["step_times"] for p in per_rank))]  # a step ends when the last rank ends
        median = statistics.median(times)
        iface = [p["iface_tx_bytes_per_step"] for p in per_rank]
        payload = [p.get("iface_tx_payload_bytes_per_step") for p in per_rank]
        wire = statistics.mean(p["wire_bytes_per_step"] for p in per_rank)
        rows[name] = {
            "step_time_median_s": median,
            "step_time_p25_s": _quantile(times, 0.25),
            "step_time_p75_s": _quantile(times, 0.75),
            "throughput_samples_per_s": world * first["batch_size"] / median,
            "scaling_efficiency": compute / median,
            "wire_bytes_per_step": wire,
            "iface_tx_bytes_per_step": statistics.mean(iface) if all(v is not None for v in iface) else None,
            "iface_tx_payload_bytes_per_step": (
                statistics.mean(payload) if all(v is not None for v in payload) else None
            ),
            "hook_ms_per_step": 1e3 * statistics.mean(p["hook_seconds_per_step"] for p in per_rank),
            "thread_ms_per_step": 1e3 * statistics.mean(p.get("thread_seconds_per_step", 0.0) for p in per_rank),
            "wait_ms_per_step": 1e3 * statistics.mean(p.get("wait_seconds_per_step", 0.0) for p in per_rank),
            "work_ms_median": _median_work_ms(per_rank),
            "peak_rss_mb": (  # None: measured in rounds, with every configuration resident at once
                None if any(p["peak_rss_mb"] is None for p in per_rank) else max(p["peak_rss_mb"] for p in per_rank)
            ),
            "bucket_cap_mb": first.get("bucket_cap_mb"),
            "state_mb": max((p.get("state_mb") or 0.0) for p in per_rank) if "state_mb" in first else None,
        }
    dense = rows.get("ddp")
    for row in rows.values():
        measured = row["iface_tx_payload_bytes_per_step"]
        row["iface_payload_vs_ours"] = (
            measured / row["wire_bytes_per_step"] if measured is not None and row["wire_bytes_per_step"] else None
        )
        if dense:
            row["speedup_vs_ddp"] = dense["step_time_median_s"] / row["step_time_median_s"]
            row["bytes_ratio_vs_ddp"] = dense["wire_bytes_per_step"] / max(row["wire_bytes_per_step"], 1e-12)
        if "torch_powersgd" in rows:
            row["throughput_vs_torch_powersgd"] = (
                row["throughput_samples_per_s"] / rows["torch_powersgd"]["throughput_samples_per_s"]
            )
    references = _references(ranks)
    params = ranks[0]["configs"][next(iter(rows))]["params"] if rows else 0
    for row in rows.values():
        state = row.get("state_mb")  # tensors kept between steps, in fp32 copies of the whole gradient
        row["state_gradient_copies"] = state * 2**20 / (4 * params) if state is not None and params else None
        work_ms = row["work_ms_per_step"] = work_ms_of(row)
        row["work_vs_clone"] = work_ms / references["clone_ms"] if references else None
        row["work_vs_clone_rand"] = (
            work_ms / (references["clone_ms"] + references["rand_like_ms"]) if references else None
        )
    return {
        "world_size": world,
        "compute_only_step_s": compute,
        "params": params,
        "references": references,
        "configs": rows,
    }


def work_ms_of(row: dict[str, Any]) -> float:
    """Compression work per step (ms): our communication thread's time minus its blocking waits for collectives, plus
    our Future callbacks that ran on gloo's threads; for PyTorch's hooks, their body plus their Future callbacks
    minus the callbacks' waits.

    The median over the measured steps of the mean over ranks, like the step time: one step that a stall of the
    machine stretched does not move it. Results without per-step work (older ones) give the mean over all steps;
    without a thread time, the hook's time on the autograd thread."""
    if row.get("work_ms_median") is not None:
        return float(row["work_ms_median"])
    thread = row.get("thread_ms_per_step", 0.0)
    return thread - row.get("wait_ms_per_step", 0.0) if thread > 0 else row["hook_ms_per_step"]


def _median_work_ms(per_rank: list[dict[str, Any]]) -> Optional[float]:
    """Median over steps of the ranks' mean compression work in that step (ms); ``None`` without per-step work."""
    steps: list[list[float]] = [p.get("work_seconds_steps") or [] for p in per_rank]
    if not all(steps) or len({len(s) for s in steps}) != 1:
        return None
    return 1e3 * statistics.median(statistics.mean(works) for works in zip(*steps))


def _references(ranks: list[dict[str, Any]]) -> Optional[dict[str, float]]:
    """Mean over ranks of one pass over the gradient (clone, rand_like, fp16 cast), in ms; ``None`` if absent."""
    found = [r["compute_only"].get("references") for r in ranks]
    if not all(found):
        return None
    return {f"{name}_ms": 1e3 * statistics.mean(f[name] for f in found) for name in found[0]}


def recommend(summary: dict[str, Any]) -> str:
    """One line: the fastest configuration on this link and whether compression pays at all."""
    rows = summary["configs"]
    if "ddp" not in rows:
        best = min(rows, key=lambda n: rows[n]["step_time_median_s"])
        return f"fastest: {best} ({rows[best]['step_time_median_s'] * 1e3:.1f} ms/step); no dense baseline was run"
    dense = rows["ddp"]["step_time_median_s"]
    others = [n for n in rows if n != "ddp"]
    if not others:
        return f"only dense DDP was run ({dense * 1e3:.1f} ms/step)"
    rival = min(others, key=lambda n: rows[n]["step_time_median_s"])
    speedup = dense / rows[rival]["step_time_median_s"]
    if speedup < 1.05:
        return (
            f"compression does not pay here: dense DDP takes {dense * 1e3:.1f} ms/step and the fastest "
            f"alternative ({rival}) is {speedup:.2f}x as fast; keep dense DDP on this link"
        )
    return (
        f"use {rival}: {speedup:.2f}x faster than dense DDP ({rows[rival]['step_time_median_s'] * 1e3:.1f} vs "
        f"{dense * 1e3:.1f} ms/step), {rows[rival]['bytes_ratio_vs_ddp']:.1f}x fewer bytes, scaling efficiency "
        f"{rows[rival]['scaling_efficiency']:.0%}"
    )
