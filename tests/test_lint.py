"""The lint gate: ``ruff check``, ``ruff format --check`` and ``mypy`` pass on the package.

They run here, through the README's test command, so CI runs them too (``pip install -e ".[test]"`` installs the
pinned ruff and mypy). Their configuration is in ``pyproject.toml``. Skipped only where ruff or mypy is not
installed. mypy keeps its cache in ``.mypy_cache`` at the repository root: a cold run takes about 15 s.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_tool(*args: str, timeout: float) -> None:
    """Run ``python -m <args>`` in the repository root; fail with its output when it exits non-zero."""
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"`{' '.join(args)}` exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize(
    "args",
    [("ruff", "check", "lightning_gradcomp"), ("ruff", "format", "--check", "--diff", "lightning_gradcomp")],
    ids=["check", "format"],
)
def test_ruff(args: tuple[str, ...]) -> None:
    pytest.importorskip("ruff")
    run_tool(*args, timeout=120)


def test_mypy() -> None:
    pytest.importorskip("mypy")
    run_tool("mypy", timeout=600)  # the files and settings: [tool.mypy] in pyproject.toml
