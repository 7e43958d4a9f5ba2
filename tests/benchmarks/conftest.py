"""The benchmark scripts are not a package: put ``benchmarks/`` on ``sys.path`` so the tests can import them."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
