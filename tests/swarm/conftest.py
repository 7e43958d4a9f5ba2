"""Hang guard for the SwarmSGD tests: every test fails (and its rank processes are killed) after a time limit."""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Iterator
from typing import Any

import pytest

HANG_SECONDS = 60
"""Per-test limit; override with ``@pytest.mark.hang_limit(seconds)``."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hang_limit(seconds): fail a swarm test that runs longer (hang guard)")


@pytest.fixture(autouse=True)
def hang_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """SIGALRM after the limit: kill the forked ranks, then fail the test instead of hanging the suite."""
    marker = request.node.get_closest_marker("hang_limit")
    seconds = int(marker.args[0]) if marker else HANG_SECONDS

    def expire(signum: int, frame: Any) -> None:
        for child in multiprocessing.active_children():
            child.kill()
        raise TimeoutError(f"{request.node.nodeid} ran past its {seconds} s hang limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
