"""The ``lightning-gradcomp`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: ``list`` (compressors and strategy names), ``report LOG_DIR`` (plots), ``bench`` (measure)."""
    parser = argparse.ArgumentParser(prog="lightning-gradcomp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list registered compressors and strategy names")
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
        import lightning_gradcomp  # noqa: F401 - declares the presets
        from lightning_gradcomp.compressors import registry
        from lightning_gradcomp.presets import PRESETS

        print("compressors:", ", ".join(registry.list()))
        print("strategies: ", ", ".join(sorted(PRESETS)), "(each also with _spawn and _fork)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
