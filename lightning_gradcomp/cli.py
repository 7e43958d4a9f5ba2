"""The ``lightning-gradcomp`` command."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: ``lightning-gradcomp list`` prints the registered compressors and strategies."""
    parser = argparse.ArgumentParser(prog="lightning-gradcomp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list registered compressors and strategy names")
    args = parser.parse_args(argv)
    if args.command == "list":
        from lightning.pytorch.strategies import StrategyRegistry

        import lightning_gradcomp  # noqa: F401 - registers the strategy names
        from lightning_gradcomp.compressors import registry

        print("compressors:", ", ".join(registry.list()))
        print("strategies: ", ", ".join(n for n in StrategyRegistry.available_strategies() if n.startswith("gradcomp")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
