"""End-of-fit summary: a rich table of every layer's traffic, parameter, compression and compression error.

Its figures cover the whole run, the dense warm-up (``start_step``) included: bytes per step average over every
step, and the compression is dense / wire bytes of the whole run; the caption also gives the compression of the
compressed steps alone (the rate the progress bar's ``gradcomp/compression_step`` shows)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from rich.console import Console
from rich.table import Table

from lightning_gradcomp.comm import CommStats

__all__ = ["SummaryRow", "format_bytes", "print_summary", "summary_rows", "summary_table"]


@dataclass(frozen=True)
class SummaryRow:
    """One line of the summary (``error`` is ``nan`` when it was not measured; ``compression`` is dense / wire
    bytes over the whole run)."""

    name: str
    numel: int
    compressed: bool
    param: Optional[float]
    bytes_per_step: float
    compression: float
    error: float

    @property
    def ratio(self) -> float:
        """Deprecated name of :attr:`compression` (warns)."""
        warnings.warn("`SummaryRow.ratio` is deprecated: use `.compression`", DeprecationWarning, stacklevel=2)
        return self.compression


def format_bytes(nbytes: float) -> str:
    """``1536 -> '1.5 KiB'`` (binary units)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _fmt(value: Optional[float], spec: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return "inf" if math.isinf(value) else format(value, spec)


def _times(compression: float) -> str:
    """A compression (dense / wire bytes) as ``12.15x``."""
    text = _fmt(compression, ".2f")
    return text if text == "-" else f"{text}x"


def summary_rows(
    stats: CommStats, errors: Mapping[str, float], total_error: float = float("nan")
) -> tuple[list[SummaryRow], SummaryRow]:
    """Per-layer rows (in insertion order) and the totals row.

    Args:
        stats: one rank's cumulative figures.
        errors: per-layer relative compression error (layers absent: not measured).
        total_error: the error over all compressed layers.
    """
    steps = max(stats.steps, 1)
    rows = [
        SummaryRow(
            name, s.numel, s.compressed, s.param, s.wire_bytes / steps, s.compression, errors.get(name, float("nan"))
        )
        for name, s in stats.layers.items()
    ]
    total = SummaryRow(
        "total",
        sum(r.numel for r in rows),
        any(r.compressed for r in rows),
        None,
        stats.wire_bytes / steps,
        stats.compression_ratio,
        total_error,
    )
    return rows, total


def summary_table(
    rows: list[SummaryRow],
    total: SummaryRow,
    *,
    param_name: Optional[str] = None,
    title: str = "GradComp summary",
    caption: Optional[str] = None,
) -> Table:
    """A rich table: layer, numel, compressed?, parameter, bytes/step and compression (whole run), error, plus
    totals."""
    table = Table(title=title, caption=caption, show_footer=True)
    n_comp = sum(r.compressed for r in rows)
    longest = max((len(r.name) for r in rows), default=5)
    table.add_column("layer", footer=total.name, overflow="fold", min_width=min(longest, 24))
    table.add_column("numel", justify="right", footer=f"{total.numel:,}")
    table.add_column("compressed", justify="center", footer=f"{n_comp}/{len(rows)}")
    table.add_column(f"param ({param_name})" if param_name else "param", justify="right", footer="")
    table.add_column("bytes/step (whole run)", justify="right", footer=format_bytes(total.bytes_per_step))
    table.add_column("compression (whole run)", justify="right", footer=_times(total.compression))
    table.add_column("error", justify="right", footer=_fmt(total.error))
    for r in rows:
        table.add_row(
            r.name,
            f"{r.numel:,}",
            "yes" if r.compressed else "no",
            _fmt(r.param),
            format_bytes(r.bytes_per_step),
            _times(r.compression),
            _fmt(r.error),
        )
    return table


def print_summary(
    stats: CommStats,
    errors: Mapping[str, float],
    *,
    total_error: float = float("nan"),
    param_name: Optional[str] = None,
    title: str = "GradComp summary",
    console: Optional[Console] = None,
    compressed_steps_compression: Optional[float] = None,
) -> Table:
    """Print the summary table of ``stats`` (call on rank 0 only) and return it.

    Args:
        stats: the rank's cumulative figures (bytes per step average over every step, warm-up included).
        errors: per-layer relative error pooled over the sampled steps, ``sqrt(sum ||r||^2 / sum ||p||^2)``.
        total_error: the same, pooled over all compressed layers.
        param_name: header of the parameter column (``density``, ``rank``, ``bits``).
        title: table title.
        console: where to print (a new stdout console by default); when it is not a terminal the
            table is printed at its natural width.
        compressed_steps_compression: dense / wire bytes of the compressed steps alone, for the caption
            (``None``: not given).
    """
    rows, total = summary_rows(stats, errors, total_error)
    dense_steps = stats.steps - stats.compressed_steps
    whole = f"compression {_times(total.compression)} over the whole run"
    if dense_steps:
        whole += f" ({dense_steps} dense warm-up steps included)"
    if compressed_steps_compression is not None and math.isfinite(compressed_steps_compression):
        whole += f", {_times(compressed_steps_compression)} over the compressed steps alone"
    if stats.intra_bytes:  # hierarchy= or FSDP2: the bytes inside the node / shard group, beside the wire's
        whole += (
            f"; wire bytes cross nodes (replicas), and {format_bytes(stats.intra_bytes / max(stats.steps, 1))}/step "
            "more stay inside the node (shard group)"
        )
    caption = (
        f"{whole}; {stats.steps} steps ({stats.compressed_steps} compressed), "
        f"hook {1e3 * stats.hook_seconds / max(stats.steps, 1):.2f} ms/step, "
        f"{stats.nonfinite_steps} non-finite buckets"
    )
    table = summary_table(rows, total, param_name=param_name, title=title, caption=caption)
    console = console or Console()
    if not console.is_terminal:  # a log file or a pipe: never fold or crop, use the table's natural width
        natural = console.measure(table, options=console.options.update_width(10_000)).maximum
        console = Console(file=console.file, width=max(console.width, natural))
    console.print(table)
    return table
