"""Shared, cached runs of the reliability tests: one uninterrupted and one killed run per case."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from reliability.launch import run
from reliability.scenarios import VICTIM, KilledRun, config, errors, kill_mid_step


@pytest.fixture(scope="session")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], KilledRun]:
    """``killed_run(case)``: the (cached) killed run of ``case``."""
    cache: dict[str, KilledRun] = {}

    def get(case: str) -> KilledRun:
        if case not in cache:
            root = tmp_path_factory.mktemp(f"killed_{case}")
            cache[case] = kill_mid_step(root / "run", root / "ckpt", case, VICTIM[case])
        return cache[case]

    return get


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``reference_run(case)``: the output directory of the (cached) uninterrupted run of ``case``."""
    cache: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in cache:
            out = tmp_path_factory.mktemp(f"reference_{case}")
            codes = run(config(out, case))
            assert codes == [0, 0], errors(out, 2)
            cache[case] = out
        return cache[case]

    return get
