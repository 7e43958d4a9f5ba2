"""``advise --probe``'s ping-pong between the ranks of a job: 2 x 2 processes on this machine's loopback."""

from __future__ import annotations

import os
from typing import Any

import pytest

from lightning_gradcomp.advise.probe import fit_link, probe_links
from lightning_gradcomp.gloo_workers import run_workers


def _probe(rank: int, world: int) -> Any:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    return probe_links(large=64 * 2**20, repeats=4)  # loopback: large enough to take longer than a small message


def test_the_probe_measures_both_links_on_rank_0_only() -> None:
    results = run_workers(_probe, 4, timeout=120.0)
    nodes, per_node, inter, intra = results[0]
    assert (nodes, per_node) == (2, 2)
    assert inter is not None and intra is not None
    assert inter.bandwidth > 1e6 and 0 <= inter.latency < 0.1  # loopback: fast, whatever the machine's load
    assert all(r[2] is None and r[3] is None for r in results[1:])


def test_fit_link_refuses_a_large_message_that_was_not_slower() -> None:
    with pytest.raises(ValueError, match="`--probe-bytes`"):
        fit_link(8, 1e-3, 1024, 1e-4)
