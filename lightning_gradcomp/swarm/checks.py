"""The checks of :class:`~lightning_gradcomp.swarm.strategy.SwarmStrategy`'s arguments beyond
:mod:`lightning_gradcomp.checks`: the topology, the torus shape and the pairing logs to replay."""

from __future__ import annotations

import numbers
from typing import Any

from lightning_gradcomp.checks import ArgumentTypeError, is_int
from lightning_gradcomp.swarm.pairing import TOPOLOGIES, Topology

__all__: list[str] = []  # SwarmStrategy's own checks: _check_topology, _check_shape, _check_replay, ...


def _check_replay(replay: Any) -> Any:
    """``replay`` as lists of :data:`~.asynchronous.PairingRecord` tuples (a list indexed by rank, or a dict rank ->
    list), or ``None``; raises ``TypeError`` / ``ValueError`` naming ``replay`` for anything else. The ranks are
    checked against the world size at setup (:func:`_check_replay_ranks`)."""
    if replay is None:
        return None
    if not isinstance(replay, (list, tuple, dict)):
        raise ArgumentTypeError(
            f"`replay` must be a list (or dict) of per-rank pairing logs, got {type(replay).__name__}"
        )
    if isinstance(replay, dict):
        for key in replay:
            if not _is_index(key):
                raise ArgumentTypeError(f"`replay` dict keys must be integer ranks >= 0, got {key!r}")
        return {int(k): _check_log(v) for k, v in replay.items()}
    return [_check_log(v) for v in replay]


def _is_index(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


def _check_log(entries: Any) -> list[tuple[int, ...]]:
    """One rank's pairing log: a list of ``(pub_step, partner, partner_pub_step, ticket, apply_step, drained)``, the
    first five integers >= 0, ``drained`` 0 or 1."""
    if not isinstance(entries, (list, tuple)):
        raise ArgumentTypeError(f"`replay` must hold one list of pairing records per rank, got {entries!r}")
    out = []
    for entry in entries:
        fields = tuple(entry) if isinstance(entry, (list, tuple)) else ()
        if (
            len(fields) != 6
            or not all(_is_index(v) for v in fields[:5])
            or not (isinstance(fields[5], numbers.Integral) and fields[5] in (0, 1))
        ):
            raise ValueError(
                "`replay` entries must be (pub_step, partner, partner_pub_step, ticket, apply_step, drained): five "
                f"integers >= 0 and drained 0 or 1, got {entry!r}"
            )
        out.append(tuple(int(v) for v in fields))
    return out


def _check_replay_ranks(replay: Any, world_size: int) -> None:
    """Raise ``ValueError`` unless ``replay`` holds one log per rank of ``world_size`` (a dict: ranks below it) whose
    partners are other ranks below it."""
    if isinstance(replay, dict):
        logs = replay
        outside = sorted(r for r in logs if r >= world_size)
        if outside:
            raise ValueError(
                f"`replay` has logs of ranks {outside}, outside 0..{world_size - 1} (world size {world_size})"
            )
    else:
        if len(replay) != world_size:
            raise ValueError(
                f"`replay` must hold one pairing log per rank (world size {world_size}), got {len(replay)}"
            )
        logs = dict(enumerate(replay))
    for rank, entries in logs.items():
        for entry in entries:
            if entry[1] >= world_size or entry[1] == rank:
                raise ValueError(
                    f"`replay`: rank {rank}'s log names partner {entry[1]}, which is not another rank of "
                    f"0..{world_size - 1}: {entry!r}"
                )


def _check_topology(topology: Any) -> Topology:
    if isinstance(topology, str):
        if topology not in TOPOLOGIES:
            raise ValueError(f"`topology` must be one of {TOPOLOGIES} or a list of edges, got {topology!r}")
        return topology
    try:
        edges = [tuple(edge) for edge in topology]
    except TypeError:
        raise ArgumentTypeError(
            f"`topology` must be a name {TOPOLOGIES} or a list of (i, j) edges, got {topology!r}"
        ) from None
    for edge in edges:
        if len(edge) != 2 or not all(is_int(v) and v >= 0 for v in edge):
            raise ValueError(f"`topology` edges must be pairs of non-negative integer ranks, got {edge!r}")
        if edge[0] == edge[1]:
            raise ValueError(f"`topology` edge {edge!r} is a self-loop")
    if not edges:
        raise ValueError("`topology` edge list is empty")
    return [(int(i), int(j)) for i, j in edges]


def _check_shape(shape: Any) -> tuple[int, int]:
    try:
        rows, cols = shape
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"`torus_shape` must be a (rows, cols) pair, got {shape!r}") from None
    for v in (rows, cols):
        if not is_int(v):
            raise ArgumentTypeError(f"`torus_shape` entries must be integers >= 1, got {shape!r}")
        if v < 1:
            raise ValueError(f"`torus_shape` entries must be integers >= 1, got {shape!r}")
    return int(rows), int(cols)
