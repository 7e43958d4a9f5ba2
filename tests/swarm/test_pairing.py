"""Gossip pairings: deterministic from (seed, round), matchings of the topology, perfect when possible."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from lightning_gradcomp.swarm import pairing
from lightning_gradcomp.swarm.pairing import (
    is_matching,
    matching,
    round_local_steps,
    topology_edges,
    torus_shape,
    validate_edges,
)


@pytest.mark.parametrize("topology", ["complete", "ring", "torus"])
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 8, 9])
def test_builtin_topologies_give_maximum_matchings(topology: str, world_size: int) -> None:
    edges = topology_edges(topology, world_size)
    for round_index in range(60):
        partners = matching(topology, world_size, seed=3, round_index=round_index)
        assert is_matching(partners, edges), (topology, world_size, round_index, partners)
        assert partners.count(-1) == world_size % 2  # perfect for even W, exactly one sits out for odd W


@pytest.mark.parametrize("topology", ["complete", "ring", "torus"])
def test_every_rank_sits_out_sometimes_with_odd_world_size(topology: str) -> None:
    out = Counter(matching(topology, 5, seed=0, round_index=r).index(-1) for r in range(200))
    assert set(out) == set(range(5))


def test_complete_graph_visits_every_perfect_matching() -> None:
    seen = {tuple(matching("complete", 4, seed=0, round_index=r)) for r in range(100)}
    assert seen == {(1, 0, 3, 2), (2, 3, 0, 1), (3, 2, 1, 0)}


def test_pairings_depend_only_on_seed_and_round() -> None:
    here = [matching("complete", 8, seed=11, round_index=r) for r in range(20)]
    assert here == [matching("complete", 8, seed=11, round_index=r) for r in range(20)]
    assert here != [matching("complete", 8, seed=12, round_index=r) for r in range(20)]
    # a fresh interpreter (new hash seed, new torch default generator) loading only the pairing module and the
    # modules it imports (an empty package object stands in for lightning_gradcomp/__init__.py, which imports Lightning)
    code = ("import sys, types, importlib.util as u; p = types.ModuleType('lightning_gradcomp'); p.__path__ = [%r]; "
            "sys.modules['lightning_gradcomp'] = p; s = u.spec_from_file_location('pairing', %r); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); "
            "print([m.matching('complete', 8, seed=11, round_index=r) for r in range(20)])"
            % (str(Path(pairing.__file__).parents[1]), pairing.__file__))
    other_process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other_process.stdout.strip() == str(here)


def test_user_graph_matchings_are_maximal() -> None:
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (1, 4), (0, 5)]
    clean = validate_edges(edges, 6)
    for round_index in range(50):
        partners = matching(edges, 6, seed=0, round_index=round_index)
        assert is_matching(partners, clean)
        assert not any(partners[i] < 0 and partners[j] < 0 for i, j in clean)  # maximal


def test_torus_shape_and_odd_torus() -> None:
    assert torus_shape(4) == (2, 2) and torus_shape(6) == (2, 3) and torus_shape(9) == (3, 3)
    assert torus_shape(7) == (1, 7)
    edges = topology_edges("torus", 9)
    assert len(edges) == 18
    for r in range(30):
        partners = matching("torus", 9, seed=1, round_index=r)
        assert is_matching(partners, edges) and partners.count(-1) == 1


@pytest.mark.parametrize("edges, match", [
    ([(0, 1), (2, 3)], "connect"),
    ([(0, 1), (1, 5)], "outside"),
    ([(0, 0), (0, 1)], "self-loop"),
    ([(0, 1, 2)], "pairs"),
])
def test_bad_user_graphs_are_rejected(edges: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_edges(edges, 4)


def test_bad_torus_shape_and_name() -> None:
    with pytest.raises(ValueError, match="torus_shape"):
        topology_edges("torus", 6, shape=(2, 2))
    with pytest.raises(ValueError, match="topology"):
        topology_edges("star", 4)


def test_local_steps_fixed_and_geometric() -> None:
    assert all(round_local_steps(3, False, 0, r) == 3 for r in range(10))
    draws = [round_local_steps(4, True, 5, r) for r in range(4000)]
    assert min(draws) >= 1 and len(set(draws)) > 5
    assert sum(draws) / len(draws) == pytest.approx(4.0, rel=0.06)
    assert draws == [round_local_steps(4, True, 5, r) for r in range(4000)]
