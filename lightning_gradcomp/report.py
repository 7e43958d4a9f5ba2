"""``lightning-gradcomp report LOG_DIR``: plots and a text summary of logged compression metrics.

Reads what :class:`~lightning_gradcomp.callbacks.CompressionLogger` (and the L-GreCo callback, which
writes ``gradcomp/layer_param/<layer>``) logged, with the training loss the LightningModule logged beside it: a
CSVLogger ``metrics.csv`` or, when the ``tensorboard`` package is installed, TensorBoard event files. The run is
named by its log folder (``name/version``) and, from the logger's ``hparams.yaml``, the strategy and compressor
``CompressionLogger`` recorded. Writes into the output directory:

* ``report_bytes.png``: the training loss, wire bytes per step against the dense equivalent, and the compression
  (dense / wire bytes: of the recent steps, of the whole run, of each epoch);
* ``report_error.png``: the training loss and the relative compression error (and the error-feedback memory norm);
* ``report_layer_params.png``: per-layer compression parameters (when logged);
* ``report_overview.png``: every panel on one page;
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

RENAMED = {
    "gradcomp/ratio": names.COMPRESSION_STEP,
    "gradcomp/ratio_total": names.COMPRESSION_WHOLE_RUN,
    "gradcomp/epoch/ratio": names.EPOCH_COMPRESSION,
}
"""Metric names of logs written before the compression got one word, and their names now."""
_RENAMED_PREFIXES = {"gradcomp/layer_ratio/": names.LAYER_COMPRESSION}


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


def _current_names(series: Series) -> Series:
    """``series`` with the metric names of older logs (:data:`RENAMED`) turned into today's."""
    out: Series = {}
    for key, value in series.items():
        key = RENAMED.get(key, key)
        for old, new in _RENAMED_PREFIXES.items():
            if key.startswith(old):
                key = new + key[len(old) :]
        out.setdefault(key, value)
    return out


def load_metrics(log_dir: Path) -> tuple[Series, Path]:
    """Find and read the newest ``metrics.csv`` (else the newest TensorBoard run) under ``log_dir``; metric names
    of older logs come back under today's names (:data:`RENAMED`).

    Raises:
        ReportError: nothing readable was found.
    """
    series, source = _load_metrics(log_dir)
    return _current_names(series), source


def _load_metrics(log_dir: Path) -> tuple[Series, Path]:
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


def loss_series(series: Series) -> Series:
    """The training loss as the LightningModule logged it (``self.log("train_loss", ...)``): every name with
    ``loss`` in it that is not ours nor a validation or test metric, the per-step one of an
    ``on_step=True, on_epoch=True`` pair (``<name>_step``) in place of its ``<name>_epoch``; the first is the
    one the summary quotes (a name starting with ``train``, else the shortest)."""
    found = {
        k: v
        for k, v in series.items()
        if "loss" in k.lower() and not k.startswith(PREFIX) and not k.lower().startswith(("val", "test"))
    }
    found = {k: v for k, v in found.items() if not (k.endswith("_epoch") and k[: -len("_epoch")] + "_step" in found)}
    order = sorted(found, key=lambda k: (not k.lower().startswith("train"), len(k), k))
    return {k: found[k] for k in order}


def run_info(source: Path) -> dict[str, str]:
    """What ``CompressionLogger`` recorded about the run in the logger's ``hparams.yaml`` beside ``source``
    (``gradcomp_strategy``, ``gradcomp_compressor``, ``gradcomp_world_size``); empty when absent."""
    folder = source if source.is_dir() else source.parent
    path = folder / "hparams.yaml"
    if not path.is_file():
        return {}
    info: dict[str, str] = {}
    for line in path.read_text().splitlines():  # plain lines: the module's own entries may not be safe YAML
        key, sep, value = line.partition(":")
        if sep and key.startswith("gradcomp_") and value.strip():
            info[key.strip()] = value.strip().strip("'\"")
    return info


def run_name(source: Path) -> str:
    """The run: its log folder (``name/version``, as Lightning's loggers lay it out) and, when recorded, its
    strategy, compressor and world size."""
    folder = source if source.is_dir() else source.parent
    folder = folder.resolve()
    name = f"{folder.parent.name}/{folder.name}" if folder.parent.name else folder.name
    info = run_info(source)
    what = ", ".join(
        v
        for v in (
            info.get("gradcomp_strategy"),
            info.get("gradcomp_compressor"),
            f"W={info['gradcomp_world_size']}" if "gradcomp_world_size" in info else None,
        )
        if v
    )
    return f"{name} ({what})" if what else name


def text_summary(series: Series, source: Path) -> str:
    """A short human summary of the logged run (rank 0 figures unless marked "all ranks")."""
    ours = {k for k in series if k.startswith(PREFIX)}
    if not ours:
        raise ReportError(
            f"{source} has no {PREFIX}* metric: was CompressionLogger among the Trainer's callbacks, "
            f"and did the run reach its first log step?"
        )
    steps = sorted({s for k in ours for s in series[k][0]})
    lines = [
        f"GradComp report: {run_name(source)}",
        f"source: {source}",
        f"logged steps: {steps[0]} .. {steps[-1]} ({len(steps)} log points)",
    ]
    loss = loss_series(series)
    if loss:
        name, (_, values) = next(iter(loss.items()))
        lines.append(f"training loss ({name}): first {values[0]:.4g}, last {values[-1]:.4g}, min {min(values):.4g}")
    wire, dense = _last(series, names.WIRE_BYTES), _last(series, names.DENSE_BYTES)
    if wire is not None and dense is not None:
        step = _last(series, names.COMPRESSION_STEP)
        lines.append(
            f"bytes per step (rank 0, steps since the previous log): wire {format_bytes(wire)} vs dense "
            f"{format_bytes(dense)} -> compression {step if step is not None else float('nan'):.2f}x"
        )
    wire_t, dense_t = _last(series, names.WIRE_BYTES_TOTAL), _last(series, names.DENSE_BYTES_TOTAL)
    if wire_t is not None and dense_t is not None:
        lines.append(
            f"whole run (rank 0, dense warm-up included): wire {format_bytes(wire_t)} vs dense "
            f"{format_bytes(dense_t)} -> compression {compression_ratio(dense_t, wire_t):.2f}x"
        )
    ep_wire, ep_comp = series.get(names.EPOCH_WIRE_BYTES), series.get(names.EPOCH_COMPRESSION)
    if ep_wire and ep_comp:
        lines.append(
            f"epochs (all ranks): {len(ep_wire[1])}, last epoch sent {format_bytes(ep_wire[1][-1])}, "
            f"compression {ep_comp[1][-1]:.2f}x (whole epoch)"
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


def _bytes_axis(ax: Any) -> None:
    """Binary units on the y axis (``1.5 KiB``), as in the text summary, at the log scale's decades of 1024."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_locator(LogLocator(base=1024.0, subs=(1.0, 4.0, 16.0, 64.0, 256.0)))
    ax.yaxis.set_minor_locator(LogLocator(base=1024.0, subs=()))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: format_bytes(value)))


def _plot_loss(ax: Any, series: Series) -> bool:
    loss = loss_series(series)
    for name, data in loss.items():
        ax.plot(*data, marker="." if len(data[0]) < 50 else None, label=name)
    ax.set_title("training loss (as the LightningModule logged it)")
    ax.set_xlabel("step")
    if loss:
        ax.legend(loc="best", fontsize="small")
    return bool(loss)


def _plot_bytes(ax: Any, series: Series) -> bool:
    drawn = False
    for name, label, style in (
        (names.DENSE_BYTES, "dense all-reduce (fp32)", "--"),
        (names.WIRE_BYTES, "sent (wire)", "-"),
    ):
        if name in series:
            ax.plot(*series[name], style, marker=".", label=label)
            drawn = True
    ax.set_title("bytes per step, rank 0 (steps since the previous log)")
    ax.set_xlabel("step")
    if drawn:
        _bytes_axis(ax)
        ax.legend(loc="best")
    return drawn


def _plot_compression(ax: Any, series: Series) -> bool:
    drawn = False
    for name, label in (
        (names.COMPRESSION_STEP, "recent steps (since the previous log)"),
        (names.COMPRESSION_WHOLE_RUN, "whole run, dense warm-up included"),
        (names.EPOCH_COMPRESSION, "whole epoch, all ranks"),
    ):
        if name in series:
            ax.plot(*series[name], marker=".", label=label)
            drawn = True
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_title("compression (dense / wire bytes)")
    ax.set_xlabel("step")
    ax.yaxis.set_major_formatter("{x:g}x")
    if drawn:
        ax.legend(loc="best", fontsize="small")
    return drawn


def _plot_error(ax: Any, series: Series) -> bool:
    drawn = False
    for layer, data in sorted(_layers(series, names.LAYER_ERROR).items()):
        ax.plot(*data, linewidth=0.8, alpha=0.6, label=layer)
        drawn = True
    points = len(series.get(names.ERROR, ([], []))[0])
    if points:
        ax.plot(*series[names.ERROR], color="black", marker="o", label="all compressed layers")
        drawn = True
    ax.set_title(f"relative compression error ||p - C(p)|| / ||p|| ({points} point{'s' if points != 1 else ''})")
    ax.set_xlabel("step")
    if drawn:
        ax.legend(loc="best", fontsize="small")
    if 0 < points < 3:
        ax.text(
            0.5,
            0.02,
            f"only {points} measurement{'s' if points > 1 else ''}: the error is measured every "
            "CompressionLogger(error_every_n_steps) compressed steps\n(default: at the logged steps); "
            "a lower Trainer(log_every_n_steps) gives a short run more",
            ha="center",
            va="bottom",
            fontsize="small",
            transform=ax.transAxes,
        )
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

    fig = figure_cls(figsize=(8, 9))
    loss_ax, bytes_ax, comp_ax = fig.subplots(3, 1, sharex=True)
    for ax, plot, what in ((loss_ax, _plot_loss, "training loss"), (bytes_ax, _plot_bytes, "bytes")):
        if not plot(ax, series):
            _empty(ax, what)
    _plot_compression(comp_ax, series)
    fig.suptitle(title)
    save(fig, "report_bytes.png")

    has_memory = names.MEMORY_NORM in series
    fig = figure_cls(figsize=(8, 9 if has_memory else 6.5))
    axes = fig.subplots(3 if has_memory else 2, 1, sharex=True)
    if not _plot_loss(axes[0], series):
        _empty(axes[0], "training loss")
    if not _plot_error(axes[1], series):
        _empty(axes[1], "compression error")
    if has_memory:
        _plot_memory(axes[2], series)
    fig.suptitle(title)
    save(fig, "report_error.png")

    if _layers(series, names.LAYER_PARAM):
        fig = figure_cls(figsize=(8, 4))
        _plot_params(fig.subplots(1, 1), series)
        fig.suptitle(title)
        save(fig, "report_layer_params.png")

    fig = figure_cls(figsize=(16, 8))
    (a, b, c), (d, e, f) = fig.subplots(2, 3)
    panels = (
        (a, _plot_loss, "training loss"),
        (b, _plot_bytes, "bytes"),
        (c, _plot_compression, "compression"),
        (d, _plot_error, "compression error"),
        (e, _plot_params, "per-layer parameters"),
        (f, _plot_memory, "error-feedback memory norm"),
    )
    for ax, plot, what in panels:
        if not plot(ax, series):
            _empty(ax, what)
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
    files = plot_report(series, out, title=f"GradComp report: {run_name(source)}") if plots else []
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
