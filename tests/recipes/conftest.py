"""Make the top-level ``recipes`` package importable (it lives next to ``lightning_gradcomp`` in the clone)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
