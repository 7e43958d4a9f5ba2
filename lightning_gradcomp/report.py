"""``lightning-gradcomp report LOG_DIR``: plots and a text summary of logged compression metrics.

Reads what :class:`~lightning_gradcomp.callbacks.CompressionLogger` (and the L-GreCo callback, which
writes ``gradcomp/layer_param/<layer>``) logged: a CSVLogger ``metrics.csv`` or, when the
``tensorboard`` package is installed, TensorBoard event files. Writes into the output directory:

* ``report_bytes.png``: wire bytes per step against the dense equivalent, and the compression ratio;
* ``report_error.png``: relative compression error (and the error-feedback memory norm);
* ``report_layer_params.png``: per-layer compression parameters (when logged);
* ``report_overview.png``: the four panels on one page;
* ``report_summary.txt``: the text summary, also printed.

Plotting needs matplotlib (``pip install "lightning-gradcomp[plots]"``); ``--no-plots`` writes the
summary only.
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lightning_gradcomp.callbacks import logger as names
from lightning_gradcomp.callbacks.summary import format_bytes
from lightning_gradcomp.comm import compression_ratio

__all__ = [
    "Report",
    "ReportError",
    "Series",
    "add_arguments",
    "load_metrics",
    "make_report",
    "plot_report",
    "read_csv_metrics",
    "read_tensorboard_metrics",
    "run",
    "text_summary",
]

Series = dict[str, tuple[list[int], list[float]]]
"""Metric name -> (steps, values), in logging order."""

PREFIX = "gradcomp/"


class ReportError(ValueError):
    """The log directory holds nothing the report can use."""


@dataclass
class Report:
    """What :func:`make_report` produced."""

    source: Path
    summary: str
    files: list[Path]


# ---------------------------------------------------------------------- reading
def read_csv_metrics(path: Path) -> Series:
    """Every numeric column of a Lightning ``metrics.csv`` as a series over its ``step`` column."""
    series: Series = {}
    with open(path, newline="") as fh:
        for row_index, row in enumerate(csv.DictReader(fh)):
            raw_step = row.pop("step", "") or ""
            step = int(float(raw_step)) if raw_step.strip() else row_index
            for key, value in row.items():
                if key is None or value is None or not value.strip():
                    continue
                try:
                    number = float(value)
                except ValueError:
                    continue
                steps, values = series.setdefault(key, ([], []))
                steps.append(step)
                values.append(number)
    return series


def read_tensorboard_metrics(run_dir: Path) -> Series:
    """Every scalar of the TensorBoard event files in ``run_dir`` (needs the ``tensorboard`` package)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
    except ImportError as err:
        raise ReportError(
            f"{run_dir} holds TensorBoard event files, and reading them needs the `tensorboard` "
            f"package (pip install tensorboard); or log with CSVLogger"
        ) from err
    acc = EventAccumulator(str(run_dir), size_guidance={SCALARS: 0})
    acc.Reload()
    series: Series = {}
    for tag in acc.Tags().get("scalars", []):
        events = acc.Scalars(tag)
        series[tag] = ([int(e.step) for e in events], [float(e.value) for e in events])
    return series


def load_metrics(log_dir: Path) -> tuple[Series, Path]:
    """Find and read the newest ``metrics.csv`` (else the newest TensorBoard run) under ``log_dir``.

    Raises:
        ReportError: nothing readable was found.
    """
    log_dir = Path(log_dir)
    if log_dir.is_file():
        return read_csv_metrics(log_dir), log_dir
    if not log_dir.is_dir():
        raise ReportError(f"{log_dir} does not exist")
    csvs = sorted(log_dir.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if csvs:
        return read_csv_metrics(csvs[-1]), csvs[-1]
    events = sorted(log_dir.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    if events:
        return read_tensorboard_metrics(events[-1].parent), events[-1].parent
    raise ReportError(f"no metrics.csv (CSVLogger) or TensorBoard event file under {log_dir}")


# ---------------------------------------------------------------------- summary
def _last(series: Series, name: str) -> Optional[float]:
    return series[name][1][-1] if name in series and series[name][1] else None


def _layers(series: Series, prefix: str) -> dict[str, tuple[list[int], list[float]]]:
    return {k[len(prefix) :]: v for k, v in series.items() if k.startswith(prefix)}


def text_summary(series: Series, source: Path) -> str:
    """A short human summary of the logged run (rank 0 figures unless marked "all ranks")."""
    ours = {k for k in series if k.startswith(PREFIX)}
    if not ours:
        raise ReportError(
            f"{source} has no {PREFIX}* metric: was CompressionLogger among the Trainer's callbacks, "
            f"and did the run reach its first log step?"
        )
    steps = sorted({s for k in ours for s in series[k][0]})
    lines = [f"GradComp report: {source}", f"logged steps: {steps[0]} .. {steps[-1]} ({len(steps)} log points)"]
    wire, dense = _last(series, names.WIRE_BYTES), _last(series, names.DENSE_BYTES)
    if wire is not None and dense is not None:
        ratio = _last(series, names.RATIO)
        lines.append(
            f"bytes per step (rank 0, last interval): wire {format_bytes(wire)} vs dense "
            f"{format_bytes(dense)} -> ratio {ratio if ratio is not None else float('nan'):.2f}"
        )
    wire_t, dense_t = _last(series, names.WIRE_BYTES_TOTAL), _last(series, names.DENSE_BYTES_TOTAL)
    if wire_t is not None and dense_t is not None:
        lines.append(
            f"cumulative (rank 0, warm-up included): wire {format_bytes(wire_t)} vs dense "
            f"{format_bytes(dense_t)} -> ratio {compression_ratio(dense_t, wire_t):.2f}"
        )
    ep_wire, ep_ratio = series.get(names.EPOCH_WIRE_BYTES), series.get(names.EPOCH_RATIO)
    if ep_wire and ep_ratio:
        lines.append(
            f"epochs (all ranks): {len(ep_wire[1])}, last epoch sent {format_bytes(ep_wire[1][-1])}, "
            f"ratio {ep_ratio[1][-1]:.2f}"
        )
    err = series.get(names.ERROR)
    if err and err[1]:
        vals = err[1]
        lines.append(
            f"compression error ||p - C(p)||/||p||: mean {sum(vals) / len(vals):.4g}, last {vals[-1]:.4g}, "
            f"min {min(vals):.4g}, max {max(vals):.4g} ({len(vals)} samples)"
        )
    else:
        lines.append(
            "compression error: not logged (error_every_n_steps=0, no compressed step sampled yet, or "
            "the compressor reports neither residuals nor its local contribution)"
        )
    hook = series.get(names.HOOK_MS)
    if hook and hook[1]:
        lines.append(f"hook time: mean {sum(hook[1]) / len(hook[1]):.3g} ms/step")
    norm = _last(series, names.MEMORY_NORM)
    if norm is not None:
        lines.append(f"error-feedback memory norm (last): {norm:.4g}")
    nonfinite = _last(series, names.NONFINITE_BUCKETS)
    if nonfinite:
        lines.append(f"buckets reduced densely because of NaN/Inf: {nonfinite:.0f}")
    params = _layers(series, names.LAYER_PARAM)
    if params:
        lines.append(f"per-layer parameters ({names.LAYER_PARAM}*, first -> last):")
        lines.extend(f"  {layer}: {vals[0]:g} -> {vals[-1]:g}" for layer, (_, vals) in sorted(params.items()))
    return "\n".join(lines)


# ---------------------------------------------------------------------- plots
def _require_matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ReportError(
            'plots need matplotlib: pip install "lightning-gradcomp[plots]" '
            "(or pass --no-plots for the text summary only)"
        ) from err
    return Figure


def _plot_bytes(ax: Any, series: Series) -> bool:
    drawn = False
    for name, label, style in (
        (names.DENSE_BYTES, "dense all-reduce (fp32)", "--"),
        (names.WIRE_BYTES, "sent (wire)", "-"),
    ):
        if name in series:
            ax.plot(*series[name], style, marker=".", label=label)
            drawn = True
    ax.set_title("bytes per step, rank 0")
    ax.set_xlabel("step")
    ax.set_ylabel("bytes")
    if drawn:
        ax.set_yscale("log")
        ax.legend(loc="best")
    return drawn


def _plot_ratio(ax: Any, series: Series) -> bool:
    drawn = False
    for name, label in (
        (names.RATIO, "interval"),
        (names.RATIO_TOTAL, "cumulative"),
        (names.EPOCH_RATIO, "epoch, all ranks"),
    ):
        if name in series:
            ax.plot(*series[name], marker=".", label=label)
            drawn = True
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_title("compression ratio (dense / wire)")
    ax.set_xlabel("step")
    if drawn:
        ax.legend(loc="best")
    return drawn


def _plot_error(ax: Any, series: Series) -> bool:
    drawn = False
    for layer, data in sorted(_layers(series, names.LAYER_ERROR).items()):
        ax.plot(*data, linewidth=0.8, alpha=0.6, label=layer)
        drawn = True
    if names.ERROR in series:
        ax.plot(*series[names.ERROR], color="black", marker="o", label="all compressed layers")
        drawn = True
    ax.set_title("relative compression error ||p - C(p)|| / ||p||")
    ax.set_xlabel("step")
    if drawn:
        ax.legend(loc="best", fontsize="small")
    return drawn


def _plot_params(ax: Any, series: Series) -> bool:
    params = _layers(series, names.LAYER_PARAM)
    for layer, data in sorted(params.items()):
        ax.plot(*data, marker=".", label=layer)
    ax.set_title("per-layer compression parameter")
    ax.set_xlabel("step")
    if params:
        values = [v for _, vals in params.values() for v in vals]
        if min(values) > 0 and max(values) / min(values) > 8:
            ax.set_yscale("log")
        ax.legend(loc="best", fontsize="small")
    return bool(params)


def _plot_memory(ax: Any, series: Series) -> bool:
    if names.MEMORY_NORM not in series:
        return False
    ax.plot(*series[names.MEMORY_NORM], marker=".", color="tab:red")
    ax.set_title("error-feedback memory norm, rank 0")
    ax.set_xlabel("step")
    return True


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}: not logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def plot_report(series: Series, out_dir: Path, title: str = "GradComp report") -> list[Path]:
    """Write the report PNGs into ``out_dir``; returns the written paths."""
    figure_cls = _require_matplotlib()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        written.append(path)

    fig = figure_cls(figsize=(8, 7))
    top, bottom = fig.subplots(2, 1, sharex=True)
    _plot_bytes(top, series)
    _plot_ratio(bottom, series)
    save(fig, "report_bytes.png")

    has_memory = names.MEMORY_NORM in series
    fig = figure_cls(figsize=(8, 7 if has_memory else 4))
    axes = fig.subplots(2, 1, sharex=True) if has_memory else [fig.subplots(1, 1)]
    if not _plot_error(axes[0], series):
        _empty(axes[0], "compression error")
    if has_memory:
        _plot_memory(axes[1], series)
    save(fig, "report_error.png")

    if _layers(series, names.LAYER_PARAM):
        fig = figure_cls(figsize=(8, 4))
        _plot_params(fig.subplots(1, 1), series)
        save(fig, "report_layer_params.png")

    fig = figure_cls(figsize=(12, 8))
    (a, b), (c, d) = fig.subplots(2, 2)
    for ax, plot, what in ((a, _plot_bytes, "bytes"), (b, _plot_ratio, "ratio"), (c, _plot_error, "error")):
        if not plot(ax, series):
            _empty(ax, what)
    if not _plot_params(d, series) and not _plot_memory(d, series):
        _empty(d, "per-layer parameters")
    fig.suptitle(title)
    save(fig, "report_overview.png")
    return written


# ---------------------------------------------------------------------- entry points
def make_report(log_dir: Path, out_dir: Optional[Path] = None, plots: bool = True) -> Report:
    """Read ``log_dir``, write the summary and (optionally) the plots into ``out_dir``.

    Args:
        log_dir: a Lightning log directory (searched recursively) or a ``metrics.csv``.
        out_dir: where to write (default: ``<log_dir>/report``).
        plots: also write the PNGs (needs matplotlib).
    """
    log_dir = Path(log_dir)
    if plots:
        _require_matplotlib()
    series, source = load_metrics(log_dir)
    summary = text_summary(series, source)
    out = Path(out_dir) if out_dir is not None else (log_dir.parent if log_dir.is_file() else log_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    files = plot_report(series, out, title=f"GradComp report: {source.parent.name}/{source.name}") if plots else []
    summary_path = out / "report_summary.txt"
    summary_path.write_text(summary + "\n")
    return Report(source, summary, [*files, summary_path])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments (and description) of the ``report`` subcommand."""
    parser.description = (
        "Plots and a text summary of the metrics CompressionLogger logged (CSVLogger metrics.csv, "
        "or TensorBoard event files when tensorboard is installed)."
    )
    parser.add_argument("log_dir", type=Path, help="Lightning log directory (CSVLogger or TensorBoard) or metrics.csv")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: LOG_DIR/report)")
    parser.add_argument("--no-plots", action="store_true", help="write the text summary only")


def run(args: argparse.Namespace) -> int:
    """Run the ``report`` subcommand; returns the exit code."""
    try:
        report = make_report(args.log_dir, args.out, plots=not args.no_plots)
    except ReportError as err:
        print(f"lightning-gradcomp report: error: {err}", file=sys.stderr)
        return 1
    print(report.summary)
    print("wrote:", ", ".join(str(p) for p in report.files))
    return 0
