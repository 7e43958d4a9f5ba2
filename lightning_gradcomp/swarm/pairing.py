"""Gossip pairings: a random matching of the communication graph per round, drawn from ``(seed, round)``.

Every rank calls :func:`matching` with the same arguments and gets the same list, so partners are
known without messages. ``partners[i]`` is the rank ``i`` averages with in that round, or ``-1`` when
``i`` sits out (odd world size, or a graph without a perfect matching).

Topologies:

* ``"complete"``: a uniformly random perfect matching (pairs of a random permutation).
* ``"ring"``: one of the two perfect matchings of the cycle ``0-1-...-(W-1)-0`` (odd ``W``: a random
  rank sits out and its neighbours pair around the ring).
* ``"torus"``: a ``rows x cols`` grid with wrap-around (:func:`torus_shape` picks the most square
  factorization); pairs run along a random even-length dimension, or, when both are odd, along a
  randomly shifted snake path with one rank left out.
* a user graph: a list of undirected edges ``(i, j)``; the matching is a random maximal matching
  (the best of a few random greedy passes), which can leave more than one rank out.

The number of local steps of a round (fixed or geometric) comes from the same kind of shared
generator (:func:`round_local_steps`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional, Union

import torch

from lightning_gradcomp.checks import is_int

__all__ = [
    "TOPOLOGIES",
    "Edges",
    "Topology",
    "is_matching",
    "matching",
    "round_generator",
    "round_local_steps",
    "topology_edges",
    "torus_shape",
    "validate_edges",
]

Edges = list[tuple[int, int]]
Topology = Union[str, Sequence[Sequence[int]]]
TOPOLOGIES = ("complete", "ring", "torus")
"""Built-in topology names."""

_MASK = (1 << 63) - 1
_GREEDY_ATTEMPTS = 8


def _mix(*values: int) -> int:
    """A 63-bit seed mixing ``values`` (splitmix64 steps), identical on every process."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (int(value) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
    return state & _MASK


def round_generator(seed: int, round_index: int, salt: int = 0) -> torch.Generator:
    """A CPU generator seeded by ``(seed, round_index, salt)``; the same on every rank."""
    return torch.Generator().manual_seed(_mix(seed, round_index, salt))


def round_local_steps(mean_steps: int, geometric: bool, seed: int, round_index: int) -> int:
    """Local optimizer steps before round ``round_index``'s exchange (``>= 1``).

    Fixed: ``mean_steps``. Geometric: ``P(h) = p (1 - p)**(h - 1)`` with ``p = 1 / mean_steps`` (mean
    ``mean_steps``), drawn from the shared generator so every rank draws the same ``h``.
    """
    if not geometric or mean_steps <= 1:
        return int(mean_steps)
    gen = round_generator(seed, round_index, salt=1)
    u = float(torch.rand((), generator=gen, dtype=torch.float64))
    p = 1.0 / mean_steps
    return 1 + int(math.floor(math.log1p(-u) / math.log1p(-p)))


def torus_shape(world_size: int) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows * cols == world_size`` and ``rows`` the largest divisor ``<= sqrt``."""
    rows = max(d for d in range(1, math.isqrt(world_size) + 1) if world_size % d == 0)
    return rows, world_size // rows


def _torus_edges(rows: int, cols: int) -> Edges:
    edges: set[tuple[int, int]] = set()
    for r in range(rows):
        for c in range(cols):
            here = r * cols + c
            for other in (r * cols + (c + 1) % cols, ((r + 1) % rows) * cols + c):
                if other != here:
                    edges.add((min(here, other), max(here, other)))
    return sorted(edges)


def validate_edges(edges: Sequence[Sequence[int]], world_size: int) -> Edges:
    """Check a user graph and return it as sorted unique ``(i, j)`` pairs with ``i < j``.

    Raises:
        ValueError: an edge is not a pair of ranks in ``[0, world_size)``, is a self-loop, or the graph
            does not connect all ranks (gossip would never reach the mean model).
    """
    clean: set[tuple[int, int]] = set()
    for edge in edges:
        if len(edge) != 2 or not all(is_int(v) for v in edge):
            raise ValueError(f"`topology` edges must be pairs of integer ranks, got {edge!r}")
        i, j = int(edge[0]), int(edge[1])
        if not (0 <= i < world_size and 0 <= j < world_size):
            raise ValueError(f"`topology` edge {edge!r} names a rank outside [0, {world_size - 1}]")
        if i == j:
            raise ValueError(f"`topology` edge {edge!r} is a self-loop")
        clean.add((min(i, j), max(i, j)))
    if world_size > 1 and not _connected(clean, world_size):
        raise ValueError(f"`topology` must connect all {world_size} ranks; got edges {sorted(clean)}")
    return sorted(clean)


def _connected(edges: set[tuple[int, int]], world_size: int) -> bool:
    neighbours: dict[int, list[int]] = {r: [] for r in range(world_size)}
    for i, j in edges:
        neighbours[i].append(j)
        neighbours[j].append(i)
    seen, todo = {0}, [0]
    while todo:
        for nxt in neighbours[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return len(seen) == world_size


def topology_edges(topology: Topology, world_size: int, shape: Optional[tuple[int, int]] = None) -> Edges:
    """The undirected edges ``(i, j)``, ``i < j``, of a topology on ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"`world_size` must be >= 1, got {world_size}")
    if isinstance(topology, str):
        if topology == "complete":
            return [(i, j) for i in range(world_size) for j in range(i + 1, world_size)]
        if topology == "ring":
            return sorted(
                {
                    (min(i, (i + 1) % world_size), max(i, (i + 1) % world_size))
                    for i in range(world_size)
                    if world_size > 1
                }
            )
        if topology == "torus":
            rows, cols = _checked_shape(shape, world_size)
            return _torus_edges(rows, cols)
        raise ValueError(f"`topology` must be one of {TOPOLOGIES} or a list of edges, got {topology!r}")
    return validate_edges(topology, world_size)


def _checked_shape(shape: Optional[tuple[int, int]], world_size: int) -> tuple[int, int]:
    if shape is None:
        return torus_shape(world_size)
    rows, cols = int(shape[0]), int(shape[1])
    if rows < 1 or cols < 1 or rows * cols != world_size:
        raise ValueError(f"`torus_shape` must be (rows, cols) with rows * cols == {world_size}, got {shape!r}")
    return rows, cols


def _pair_up(partners: list[int], path: Sequence[int], skip: Optional[int] = None) -> None:
    """Pair consecutive entries of ``path``, leaving out position ``skip``."""
    order = [v for pos, v in enumerate(path) if pos != skip]
    for a, b in zip(order[0::2], order[1::2]):
        partners[a], partners[b] = b, a


def _complete(world_size: int, gen: torch.Generator) -> list[int]:
    partners = [-1] * world_size
    _pair_up(partners, torch.randperm(world_size, generator=gen).tolist())
    return partners


def _ring(world_size: int, gen: torch.Generator) -> list[int]:
    partners = [-1] * world_size
    start = int(torch.randint(world_size if world_size % 2 else 2, (), generator=gen))
    _pair_up(partners, [(start + i) % world_size for i in range(world_size)])
    return partners


def _torus(rows: int, cols: int, gen: torch.Generator) -> list[int]:
    world_size = rows * cols
    partners = [-1] * world_size
    even_dims = [d for d, n in enumerate((rows, cols)) if n % 2 == 0]
    if even_dims:
        dim = even_dims[int(torch.randint(len(even_dims), (), generator=gen))]
        parity = int(torch.randint(2, (), generator=gen))
        for r in range(rows):
            for c in range(cols):
                pos = (r, c)[dim]
                if pos % 2 == parity:
                    other = r * cols + (c + 1) % cols if dim == 1 else ((r + 1) % rows) * cols + c
                    partners[r * cols + c], partners[other] = other, r * cols + c
        return partners
    dr, dc = (int(v) for v in torch.randint(world_size, (2,), generator=gen))
    snake = [
        ((r + dr) % rows) * cols + (c + dc) % cols
        for r in range(rows)
        for c in (range(cols) if r % 2 == 0 else reversed(range(cols)))
    ]
    skip = 2 * int(torch.randint((world_size + 1) // 2, (), generator=gen))
    _pair_up(partners, snake, skip=skip)
    return partners


def _greedy(world_size: int, edges: Edges, gen: torch.Generator) -> list[int]:
    best: list[int] = [-1] * world_size
    for _ in range(_GREEDY_ATTEMPTS):
        partners = [-1] * world_size
        for idx in torch.randperm(len(edges), generator=gen).tolist():
            i, j = edges[idx]
            if partners[i] < 0 and partners[j] < 0:
                partners[i], partners[j] = j, i
        if sum(p >= 0 for p in partners) > sum(p >= 0 for p in best):
            best = partners
        if sum(p < 0 for p in best) <= world_size % 2:
            break
    return best


def matching(
    topology: Topology,
    world_size: int,
    seed: int,
    round_index: int,
    shape: Optional[tuple[int, int]] = None,
    edges: Optional[Edges] = None,
) -> list[int]:
    """Partners of every rank in round ``round_index`` (``-1``: sits out); identical on all ranks.

    Args:
        topology: ``"complete"``, ``"ring"``, ``"torus"`` or a list of edges.
        world_size: number of ranks.
        seed: shared seed.
        round_index: gossip round counter.
        shape: ``(rows, cols)`` of the torus (default :func:`torus_shape`).
        edges: pre-validated edges of a user graph (skips re-validation).
    """
    gen = round_generator(seed, round_index)
    if world_size < 2:
        return [-1] * world_size
    if isinstance(topology, str) and topology == "complete":
        return _complete(world_size, gen)
    if isinstance(topology, str) and topology == "ring":
        return _ring(world_size, gen)
    if isinstance(topology, str) and topology == "torus":
        return _torus(*_checked_shape(shape, world_size), gen)
    return _greedy(world_size, edges if edges is not None else topology_edges(topology, world_size), gen)


def is_matching(partners: Sequence[int], edges: Sequence[tuple[int, int]]) -> bool:
    """Whether ``partners`` is a symmetric matching that only uses ``edges``."""
    allowed = {(min(i, j), max(i, j)) for i, j in edges}
    for i, j in enumerate(partners):
        if j < 0:
            continue
        if not (0 <= j < len(partners)) or partners[j] != i or j == i or (min(i, j), max(i, j)) not in allowed:
            return False
    return True
