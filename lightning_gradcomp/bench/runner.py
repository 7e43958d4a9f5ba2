"""``lightning-gradcomp bench``: launch W ranks (loopback or emulated link), summarise, recommend.

This module is the command (its options, :func:`run_command`); the parts it runs live in
:mod:`~lightning_gradcomp.bench.benchmark` (:func:`run_bench`, :func:`run_ladder`),
:mod:`~lightning_gradcomp.bench.launch` (the ranks' processes), :mod:`~lightning_gradcomp.bench.summary`
(:func:`summarise`, :func:`recommend`) and :mod:`~lightning_gradcomp.bench.report` (the tables and the chart), and are
re-exported here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from lightning_gradcomp.bench.benchmark import DEFAULT_CONFIGS, check_options, run_bench, run_ladder
from lightning_gradcomp.bench.benchmark import _launch as _launch
from lightning_gradcomp.bench.benchmark import check_links as check_links
from lightning_gradcomp.bench.launch import launch_ranks as launch_ranks
from lightning_gradcomp.bench.launch import wait_all as wait_all
from lightning_gradcomp.bench.report import WIDTH as WIDTH
from lightning_gradcomp.bench.report import _console, plot_ladder, print_ladder, print_recommendation, print_report
from lightning_gradcomp.bench.report import _ms as _ms
from lightning_gradcomp.bench.report import _print_table as _print_table
from lightning_gradcomp.bench.report import _table as _table
from lightning_gradcomp.bench.summary import _median_work_ms as _median_work_ms
from lightning_gradcomp.bench.summary import _quantile as _quantile
from lightning_gradcomp.bench.summary import _references as _references
from lightning_gradcomp.bench.summary import recommend, summarise
from lightning_gradcomp.bench.summary import work_ms_of as work_ms_of
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
