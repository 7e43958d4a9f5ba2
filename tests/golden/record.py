"""Record the golden results of the current code: ``python -m tests.golden.record`` (from the repository root).

Writes ``tests/golden/golden.pt``: ``{world_size: {case: {"digests", "bytes", "final"}}}`` (see ``cases.py``), after
checking that the ranks agree (``cases.merge_ranks``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

from lightning_gradcomp.gloo_workers import run_workers
from tests.golden.cases import WORLD_SIZES, merge_ranks, run_world

OUT = Path(__file__).with_name("golden.pt")


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    results: dict = {"commit": commit, "torch": torch.__version__}
    for world in WORLD_SIZES:
        start = time.time()
        ranks = run_workers(run_world, world, timeout=600)
        results[world] = merge_ranks(ranks)
        print(f"W={world}: {len(ranks[0])} cases in {time.time() - start:.1f} s", file=sys.stderr)
    torch.save(results, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes) at commit {commit}", file=sys.stderr)


if __name__ == "__main__":
    main()
