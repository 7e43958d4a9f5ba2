"""``lightning-gradcomp bench``: launch W ranks (loopback or emulated link), summarise, recommend."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional

from lightning_gradcomp.bench.configs import BASELINES, available_configs, build_strategy, is_config
from lightning_gradcomp.bench.models import check_model
from lightning_gradcomp.bench.netem import EmulatedLink, can_emulate, parse_rate, rank_address
from lightning_gradcomp.gloo_workers import free_port  # re-exported (in __all__)

__all__ = [
    "free_port",
    "plot_ladder",
    "print_ladder",
    "print_recommendation",
    "print_report",
    "recommend",
    "run_bench",
    "run_ladder",
    "summarise",
]

DEFAULT_CONFIGS = ("ddp", "torch_fp16", "torch_powersgd", "gradcomp_fp16", "gradcomp_topk", "gradcomp_randomk")


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


def wait_all(procs: Sequence[subprocess.Popen], timeout: float, what: str) -> None:
    """Wait for every process (all are killed once ``timeout`` seconds have passed).

    Raises:
        RuntimeError: a process exited with a non-zero code; the message names ``what`` and the codes.
    """
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise RuntimeError(f"{what} exited with codes {codes}")


def launch_ranks(
    spec: dict[str, Any],
    world: int,
    link: Optional[EmulatedLink],
    timeout: float,
    command: Callable[[Path], list[str]],
    host_of: Callable[[int], int] = lambda rank: rank,
    threads: int = 1,
) -> list[dict[str, Any]]:
    """Run ``world`` processes of ``command(spec_path)`` (env ``RANK``, ``WORLD_SIZE``, ``MASTER_*``), each inside the
    namespace of host ``host_of(rank)`` of ``link`` when given; return their ``<out_dir>/rank<r>.json`` files.

    Raises:
        RuntimeError: a rank exited with a non-zero code (all ranks are killed after ``timeout`` seconds).
    """
    port = free_port()
    spec_path = Path(spec["out_dir"]) / "spec.json"
    spec_path.write_text(json.dumps(spec))
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_PORT": str(port),
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": str(threads),
        }
        cmd = command(spec_path)
        if link is not None:
            env.update(MASTER_ADDR=rank_address(0), GLOO_SOCKET_IFNAME=link.interface(host_of(rank)))
            cmd = ["ip", "netns", "exec", link.namespace(host_of(rank)), *cmd]
        procs.append(subprocess.Popen(cmd, env=env))
    wait_all(procs, timeout, "benchmark ranks")
    return [json.loads((Path(spec["out_dir"]) / f"rank{r}.json").read_text()) for r in range(world)]


def _launch(spec: dict[str, Any], link: Optional[EmulatedLink], timeout: float) -> list[dict[str, Any]]:
    return launch_ranks(
        spec,
        spec["world_size"],
        link,
        timeout,
        lambda path: [sys.executable, "-m", "lightning_gradcomp.bench.worker", str(path)],
        threads=spec.get("threads", 1),
    )


def run_bench(
    model: str = "mlp",
    world_size: int = 2,
    steps: int = 20,
    warmup: int = 5,
    configs: Sequence[str] = DEFAULT_CONFIGS,
    link: Optional[str] = None,
    bucket_cap_mb: Optional[float] = None,
    threads: int = 1,
    timeout: float = 1800.0,
    batch_size: Optional[int] = None,
    rounds: int = 1,
) -> dict[str, Any]:
    """Run the benchmark and return ``{"summary", "recommendation", "link", "raw"}``.

    ``rounds``: 1 runs each configuration's ``steps`` in one go, between two runs of the compute-only step; more
    cuts them into that many blocks, run round-robin with the compute-only step's blocks (every configuration
    resident at once), so that the machine's drift over the run falls on all of them alike.
    """
    check_options(model, world_size, steps, warmup, configs, bucket_cap_mb, threads, batch_size, rounds, [link or ""])
    note = "loopback (no link emulation requested)"
    emulate = False
    if link:
        ok, why = can_emulate()
        emulate = ok
        note = f"emulated {link} per rank (netns + veth + tc tbf)" if ok else f"loopback: cannot emulate {link}: {why}"
    with tempfile.TemporaryDirectory(prefix="lgc-bench-") as out_dir:
        spec = {
            "model": model,
            "world_size": world_size,
            "steps": steps,
            "warmup": warmup,
            "configs": list(configs),
            "bucket_cap_mb": bucket_cap_mb,
            "threads": threads,
            "out_dir": out_dir,
            "batch_size": batch_size,
            "rounds": rounds,
        }
        with EmulatedLink(world_size, link) if emulate and link else nullcontext() as emulated:
            raw = _launch(spec, emulated, timeout)
    summary = summarise(raw)
    summary["rounds"] = rounds
    return {"link": note, "model": model, "summary": summary, "recommendation": recommend(summary), "raw": raw}


def check_options(
    model: str,
    world_size: int,
    steps: int,
    warmup: int,
    configs: Sequence[str],
    bucket_cap_mb: Optional[float],
    threads: int,
    batch_size: Optional[int],
    rounds: int,
    links: Sequence[str] = (),
) -> None:
    """Raise ``ValueError`` for anything :func:`run_bench` refuses, before a rank starts: the numbers, the model, every
    configuration (its compressor's arguments built here) and every link of a ladder (``""`` and ``"loopback"``:
    none)."""
    unknown = [c for c in configs if not is_config(c)]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; available: {', '.join(available_configs())}")
    for name in configs:
        if name not in BASELINES:
            build_strategy(name)  # an argument its compressor refuses, here rather than in every rank
    check_links(links)
    check_model(model)  # here, not in the ranks after their imports
    if world_size < 2:
        raise ValueError(f"`world_size` must be >= 2, got {world_size}")
    if steps < 1 or warmup < 3:
        raise ValueError(
            f"`steps` must be >= 1 and `warmup` >= 3 (compression starts at step 2), got {steps}, {warmup}"
        )
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ValueError(f"`bucket_cap_mb` must be > 0 (MB) or None for each configuration's own, got {bucket_cap_mb}")
    if threads < 1:
        raise ValueError(f"`threads` must be >= 1, got {threads}")
    if not 1 <= rounds <= steps:
        raise ValueError(f"`rounds` must be between 1 and `steps` ({steps}), got {rounds}")


def check_links(links: Sequence[str]) -> None:
    """Raise ``ValueError`` unless every link is a rate such as ``100mbit`` (``""`` and ``"loopback"``: none)."""
    for link in links:
        if link and link != "loopback":
            parse_rate(link)


WIDTH = 100
"""Characters per line of the printed report (its tables fit; longer notes wrap)."""


def _console(file: Any = None) -> Any:
    from rich.console import Console

    return Console(file=file, width=WIDTH, soft_wrap=False)


def _print_table(console: Any, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A blank line, ``title`` on its own line (never folded to the table's width), then :func:`_table`."""
    console.print()
    console.print(title)
    console.print(_table(columns, rows))


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> Any:
    """A compact rich table of ``rows``: columns whose every cell is ``-`` are left out, headers never cut (the
    first column, the configuration, folds instead)."""
    from rich import box
    from rich.table import Table

    keep = [i for i, _ in enumerate(columns) if i == 0 or any(row[i] != "-" for row in rows)]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for i in keep:
        name = columns[i]
        if i == 0:
            table.add_column(name, overflow="fold")
        else:
            table.add_column(name, justify="right", no_wrap=True, min_width=len(name))
    for row in rows:
        table.add_row(*(row[i] for i in keep))
    return table


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def print_report(result: dict[str, Any], console: Any = None, recommendation: bool = True) -> None:
    """Two compact tables (at most :data:`WIDTH` characters: columns that hold nothing on this link, such as the
    interface counters on loopback, are left out), their notes, then the recommendation (last, unless
    ``recommendation`` is False: a ladder prints every link's recommendation after its own table)."""
    console = console or _console()
    summary = result["summary"]
    summary_rows = summary["configs"]
    main_rows, detail_rows = [], []
    for name, row in summary_rows.items():
        iface, payload, agree = (
            row["iface_tx_bytes_per_step"],
            row["iface_tx_payload_bytes_per_step"],
            row["iface_payload_vs_ours"],
        )
        fewer = row.get("bytes_ratio_vs_ddp")
        speedup = row.get("speedup_vs_ddp")
        main_rows.append(
            (
                name,
                _ms(row["step_time_median_s"]),
                f"{_ms(row['step_time_p25_s'])}-{_ms(row['step_time_p75_s'])}",
                f"{row['throughput_samples_per_s']:.0f}",
                f"{row['scaling_efficiency']:.0%}",
                f"{row['wire_bytes_per_step'] / 1e3:,.1f}",
                "-" if fewer is None else f"{fewer:.1f}x",
                "-" if speedup is None else f"{speedup:.2f}x",
            )
        )
        detail_rows.append(
            (
                name,
                f"{row['hook_ms_per_step']:.1f}",
                f"{row.get('thread_ms_per_step', 0.0):.1f}",
                "-" if iface is None else f"{iface / 1e3:,.1f}",
                "-" if payload is None else f"{payload / 1e3:,.1f}",
                "-" if agree is None else f"{agree:.3f}",
                "-" if row["peak_rss_mb"] is None else f"{row['peak_rss_mb']:.0f}",
            )
        )
    title = f"{result['model']} ({summary['params']:,} params), W={summary['world_size']}, {result['link']}"
    _print_table(
        console,
        title,
        ("config", "ms/step", "p25-p75 ms", "samples/s", "scaling", "wire KB/step", "compression", "vs ddp"),
        main_rows,
    )
    rounds = summary.get("rounds", 1)
    where = (
        "median of runs before and after the configurations"
        if rounds == 1
        else f"median of its {rounds} blocks, interleaved with the configurations'"
    )
    console.print(
        f"scaling = compute-only step ({summary['compute_only_step_s'] * 1e3:.1f} ms, {where}) / step; "
        "compression = dense DDP's wire bytes / this configuration's; vs ddp = speed-up over dense DDP"
    )
    _print_table(
        console,
        "where the time goes (per rank and step)",
        ("config", "hook ms", "thread ms", "iface KB/step", "iface payload KB", "payload/wire", "peak RSS MB"),
        detail_rows,
    )
    iface_note = (
        "; iface payload = the veth's tx bytes minus one Ethernet/IPv4/TCP header per packet (the TCP payload "
        "gloo sent)"
        if any(row[3] != "-" for row in detail_rows)
        else ""
    )
    console.print(
        "hook ms = time the hook blocks the autograd thread; thread ms = our communication thread's time "
        f"(compression plus its in-line waits; it overlaps backward){iface_note}"
    )
    caps: dict[str, list[str]] = {}
    for name, row in summary_rows.items():
        if row.get("bucket_cap_mb") is not None:
            caps.setdefault(f"{row['bucket_cap_mb']:g} MB", []).append(name)
    if caps:
        console.print("DDP buckets: " + "; ".join(f"{cap}: {', '.join(names)}" for cap, names in caps.items()))
    refs = summary.get("references")
    if refs:
        fp16 = summary_rows.get("torch_fp16")
        rows = []
        for name, row in summary_rows.items():
            work = row["work_ms_per_step"]
            vs_fp16 = f"{work / fp16['work_ms_per_step']:.1f}x" if fp16 and fp16["work_ms_per_step"] > 0 else "-"
            state, copies = row.get("state_mb"), row.get("state_gradient_copies")
            memory = "-" if state is None or copies is None else f"{state:.1f} ({copies:.1f})"
            rows.append(
                (
                    name,
                    f"{work:.1f}",
                    f"{row['work_vs_clone']:.1f}x",
                    f"{row['work_vs_clone_rand']:.2f}x",
                    vs_fp16,
                    memory,
                )
            )
        _print_table(
            console,
            "compression work per step against one pass over the gradient (same run, per rank)",
            ("config", "work ms", "/ clone", "/ (clone + rand)", "/ torch fp16", "state MB (copies)"),
            rows,
        )
        console.print(
            f"references: clone {refs['clone_ms']:.2f} ms, rand_like {refs['rand_like_ms']:.2f} ms, "
            f"fp16 cast {refs['half_ms']:.2f} ms, each into a buffer allocated once; work = our "
            "communication thread's time minus its blocking waits for collectives, plus our Future callbacks "
            "run on gloo's threads (compression, decoding, packing); for PyTorch's hooks, their body plus their "
            "Future callbacks, minus waits; state = the "
            "tensors a configuration keeps between steps beyond DDP's (memories, compressor state), "
            "in MiB and in fp32 copies of the model's gradient"
        )
    if recommendation:
        print_recommendation(result, console)


def print_recommendation(result: dict[str, Any], console: Any = None, link: Optional[str] = None) -> None:
    """The recommendation line (``link``: name it, for a ladder)."""
    console = console or _console()
    where = f"{link}: " if link else ""
    console.print(f"[bold]recommendation:[/bold] {where}{result['recommendation']}")


def run_ladder(links: Sequence[str], **kwargs: Any) -> dict[str, dict[str, Any]]:
    """:func:`run_bench` once per link (``"loopback"``: no emulation), in order; ``{link: result}``. Every link is
    checked before the first runs."""
    check_links(links)
    return {link: run_bench(link=None if link == "loopback" else link, **kwargs) for link in links}


def print_ladder(results: dict[str, dict[str, Any]], console: Any = None) -> None:
    """Scaling efficiency of every configuration on every link (one column per link)."""
    from rich.table import Table

    table = Table()
    table.add_column("config")
    for link in results:
        table.add_column(link, justify="right")
    names = list(next(iter(results.values()))["summary"]["configs"])
    for name in names:
        table.add_row(name, *(f"{r['summary']['configs'][name]['scaling_efficiency']:.0%}" for r in results.values()))
    console = console or _console()
    console.print("scaling efficiency (compute-only step / step) per link:")
    console.print(table)


def plot_ladder(results: dict[str, dict[str, Any]], path: str) -> None:
    """A PNG bar chart of the scaling efficiency per configuration per link (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(results)
    names = list(next(iter(results.values()))["summary"]["configs"])
    width = 0.8 / len(links)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names)), 4.0))
    for i, link in enumerate(links):
        effs = [100 * results[link]["summary"]["configs"][n]["scaling_efficiency"] for n in names]
        ax.bar([j + i * width for j in range(len(names))], effs, width, label=link)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("scaling efficiency (%)")
    ax.axhline(100, color="grey", linewidth=0.8)
    first = next(iter(results.values()))
    ax.set_title(f"{first['model']}, W={first['summary']['world_size']}")
    ax.legend(title="link", loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never over one
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, except the ``None`` ones (their help says what they mean)."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def add_arguments(parser: Any) -> None:
    """The ``bench`` subcommand's options (``--help`` shows their defaults)."""
    parser.formatter_class = _DefaultsHelp
    parser.add_argument(
        "--model",
        default="mlp",
        help="built-in: mlp, mlp-small, mlp-large, cnn, transformer; or module.path:LightningModuleClass",
    )
    parser.add_argument("--world-size", "-w", type=int, default=2, help="number of local ranks")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per configuration")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps first (>= 3)")
    parser.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help="comma-separated: ddp, torch_fp16, torch_powersgd and any strategy preset name "
        "(`lightning-gradcomp list`), optionally with compressor arguments: signsgd@aggregation=alltoall",
    )
    parser.add_argument(
        "--link",
        default=None,
        help="emulate a link per rank, e.g. 100mbit or 1gbit (Linux, root); "
        "a comma-separated ladder such as loopback,1gbit,100mbit,10mbit "
        "runs every configuration on each link in turn",
    )
    parser.add_argument(
        "--chart",
        default=None,
        help="with a link ladder: write a PNG of the scaling efficiency per configuration per link (needs matplotlib)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per rank and step (built-in models; default: the model's own)",
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="DDP bucket size for every configuration (default: each its own: DDP's 25 MB for ddp and PyTorch's "
        "hooks, the strategy's choice for ours, e.g. 4 MB for the quantizers)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="cut each configuration's measured steps into this many blocks, run round-robin with the compute-only "
        "step's (every configuration resident at once), so that the machine's drift falls on all alike "
        "(1: each configuration's steps in one go)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="write the result as JSON (with the raw per-rank data) to this file; '-': to stdout, with the "
        "tables on stderr. Without it no JSON is printed",
    )


def _as_flags(message: str) -> str:
    """``message`` with the Python names of the options (`` `world_size` ``) spelled as their flags
    (`` `--world-size` ``)."""
    for name in ("world_size", "steps", "warmup", "batch_size", "bucket_cap_mb", "threads", "rounds", "link", "model"):
        message = message.replace(f"`{name}`", f"`--{name.replace('_', '-')}`")
    return message


def _emit_json(data: Any, path: str) -> None:
    """``data`` as JSON into ``path`` (``-``: stdout)."""
    text = json.dumps(data, indent=1)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text)


def run_command(args: Any) -> int:
    """Run ``bench`` from parsed arguments; prints the tables and, last, the recommendation (JSON only with
    ``--json``: into its file, or to stdout with ``--json -``, the tables then going to stderr)."""
    import lightning_gradcomp  # noqa: F401 - declares every preset

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    links = [link.strip() for link in (args.link or "").split(",") if link.strip()]
    try:  # everything a run would refuse, before any rank starts, as a usage error
        check_options(
            args.model,
            args.world_size,
            args.steps,
            args.warmup,
            configs,
            args.bucket_cap_mb,
            args.threads,
            args.batch_size,
            args.rounds,
            links,
        )
        for flag, path in (("--json", args.json), ("--chart", getattr(args, "chart", None))):
            if path and path != "-" and not Path(path).resolve().parent.is_dir():
                raise ValueError(f"`{flag}`: the folder of {path} does not exist")
    except ValueError as err:
        print(f"lightning-gradcomp bench: error: {_as_flags(str(err))}", file=sys.stderr)
        return 2
    console = _console(sys.stderr if args.json == "-" else None)
    if len(links) > 1 or getattr(args, "chart", None):
        ladder = run_ladder(
            links or ["loopback"],
            model=args.model,
            world_size=args.world_size,
            steps=args.steps,
            warmup=args.warmup,
            configs=configs,
            bucket_cap_mb=args.bucket_cap_mb,
            threads=args.threads,
            batch_size=args.batch_size,
            rounds=args.rounds,
        )
        for result in ladder.values():
            print_report(result, console, recommendation=False)
        print_ladder(ladder, console)
        if args.chart:
            plot_ladder(ladder, args.chart)
            console.print(f"chart: {args.chart}")
        if args.json:
            _emit_json(ladder, args.json)
        for link, result in ladder.items():
            print_recommendation(result, console, link)
        return 0
    result = run_bench(
        args.model,
        args.world_size,
        args.steps,
        args.warmup,
        configs,
        links[0] if links and links[0] != "loopback" else None,
        args.bucket_cap_mb,
        args.threads,
        batch_size=args.batch_size,
        rounds=args.rounds,
    )
    if args.json:
        _emit_json(result, args.json)
    print_report(result, console)
    return 0
