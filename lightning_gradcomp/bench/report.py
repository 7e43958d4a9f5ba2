"""What the bench shows: compact tables of a result, their notes and the recommendation on a console, and a link
ladder's table and chart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

__all__ = ["WIDTH", "plot_ladder", "print_ladder", "print_recommendation", "print_report"]


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
