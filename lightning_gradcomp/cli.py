"""The lightning-gradcomp command: list the strategy and compressor names, plot logged metrics, measure a link."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: ``list`` (compressors and strategy names), ``report LOG_DIR`` (plots), ``bench`` (measure)."""
    parser = argparse.ArgumentParser(
        prog="lightning-gradcomp",
        description=__doc__,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the strategy names (with what each does) and the compressor names")
    from lightning_gradcomp import report

    report.add_arguments(
        sub.add_parser(
            "report",
            help="plots and a summary of logged compression metrics",
            description=report.__doc__.split("\n\n")[0],
        )
    )
    from lightning_gradcomp.bench import runner as bench

    bench.add_arguments(sub.add_parser("bench", help="is compression worth it on this network? (measured)"))
    from lightning_gradcomp.advise import command as advise

    advise.add_arguments(sub.add_parser("advise", help="will compression pay on a given cluster? (predicted)"))
    args = parser.parse_args(argv)
    if args.command == "advise":
        return advise.run_command(args)
    if args.command == "bench":
        return bench.run_command(args)
    if args.command == "report":
        return report.run(args)
    if args.command == "list":
        _list()
    return 0


_EPILOG = """\
GradCompStrategy is a drop-in DDPStrategy with three defaults of its own:
  timeout                  10 minutes (DDPStrategy: 30): a collective waiting on a hung rank fails sooner
  gradient_as_bucket_view  True (DDPStrategy: False): gradients are views of DDP's buckets, same numerics
  single_process           "dense": on one process (devices=1) nothing is compressed, as with DDP;
                           "compress" runs the compressor anyway
Pass timeout=timedelta(minutes=30) or gradient_as_bucket_view=False for DDP's behaviour."""


def _list() -> None:
    """Print every strategy name with its description, then the compressor names (also with descriptions)."""
    import lightning_gradcomp  # noqa: F401 - declares the presets
    from lightning_gradcomp.compressors import registry
    from lightning_gradcomp.presets import PRESETS, UNUSED_SUFFIX

    width = max(map(len, [*PRESETS, *registry.names()]))
    print("Strategy names, Trainer(strategy=NAME); each also as NAME_spawn and NAME_fork (launchers), and the")
    print(f"GradCompStrategy ones as NAME{UNUSED_SUFFIX} (DDP's find_unused_parameters=True):")
    for name in sorted(PRESETS):
        print(f"  {name:<{width}}  {PRESETS[name][0]}")
    print("\nCompressor names, GradCompStrategy(compressor=NAME) or LocalSGDStrategy(compressor=NAME):")
    for name in registry.names():
        print(f"  {name:<{width}}  {registry.describe(name)}")
    print("\nEither kind runs in examples/quickstart.py: python examples/quickstart.py NAME")


if __name__ == "__main__":
    sys.exit(main())
