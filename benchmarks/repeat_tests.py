"""Run a pytest target many times in a row, each run under a hang timeout, and summarise.

Used for the SwarmSGD issue's "nothing deadlocks in 100 consecutive runs of the 4-process suite":

    python benchmarks/repeat_tests.py tests/swarm --runs 100 --timeout 300

A run that hangs is killed at ``--timeout`` seconds and counted as a hang; the script exits non-zero if any run
failed or hung. Prints one line per run, then the counts and the wall-time spread.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def run_once(target: str, timeout: float, keep: Optional[Path] = None, index: int = 0) -> tuple[str, float, str]:
    """``(outcome, seconds, last output line)``; outcome is ``passed``, ``failed`` or ``hung``.

    With ``keep``, the whole output of a run that did not pass is written to ``keep/run-<index>.log``.
    """
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", target],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"run-{index}.log").write_text(_text(exc.stdout) + _text(exc.stderr))
        return "hung", time.monotonic() - start, f"killed after {timeout:.0f} s"
    if keep is not None and proc.returncode != 0:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"run-{index}.log").write_text(proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    last = lines[-1] if lines else ""
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    if failed:  # name the failing tests, not just the count
        last += "  [" + "; ".join(failed) + "]"
    return ("passed" if proc.returncode == 0 else "failed"), time.monotonic() - start, last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="pytest target, e.g. tests/swarm")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a run counts as hung")
    parser.add_argument("--keep", type=Path, default=None,
                        help="folder for the whole output of every run that failed or hung")
    args = parser.parse_args()
    outcomes, seconds = [], []
    for i in range(1, args.runs + 1):
        outcome, took, last = run_once(args.target, args.timeout, args.keep, i)
        outcomes.append(outcome)
        seconds.append(took)
        print(f"run {i:3d}: {outcome:6s} {took:6.1f} s  {last}", flush=True)
    counts = {o: outcomes.count(o) for o in ("passed", "failed", "hung")}
    print(f"{args.runs} runs of {args.target}: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['hung']} hung; wall {min(seconds):.0f}-{max(seconds):.0f} s per run "
          f"(median {statistics.median(seconds):.0f} s)")
    return 0 if counts["passed"] == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
