"""SwarmStrategy's asynchronous mode (``mode="async"``) inside Lightning's loops.

Each rank trains at its own pace, so while it trains Lightning's global decisions (its broadcasts, barriers, all/any
reductions, ``sync_dist`` logging) are taken on each rank alone, Lightning's per-batch SIGTERM broadcast becomes a
store flag, and the end of ``fit`` waits for every rank through the store (docs/swarm.md); setup starts the
match-making and the background exchange engine (:mod:`lightning_gradcomp.swarm.asynchronous`).

A mixin, listed before the Lightning strategy base class in :class:`~lightning_gradcomp.swarm.strategy.SwarmStrategy`,
which sets the attributes declared here.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, TypeVar

import torch.distributed as dist
from lightning.pytorch.callbacks import EarlyStopping, Timer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_gradcomp.swarm.asynchronous import AsyncGossip, StoreMatchmaker
from lightning_gradcomp.swarm.exchange import PairwiseGossip
from lightning_gradcomp.swarm.pairing import Edges, Topology, topology_edges

__all__ = ["AsyncMode"]

_T = TypeVar("_T")


class AsyncMode(DDPStrategy):
    """Mixin: :class:`~lightning_gradcomp.swarm.strategy.SwarmStrategy`'s asynchronous mode (see the module
    docstring)."""

    _engine: Optional[PairwiseGossip]
    _async: Optional[AsyncGossip]
    _store: Optional[dist.Store]
    _edges: Optional[Edges]
    _rank_local: bool
    _warned_sync_dist: bool
    topology: Topology
    torus_shape: Optional[tuple[int, int]]
    replay: Any
    local_steps: int
    geometric_local_steps: bool
    seed: int
    exchange_timeout: float
    eval_model: Literal["mean", "rank0", "local"]
    lightning_module: Any  # as DivergentReplicas declares it for the strategy (Lightning's property is Optional)

    def _setup_async(self, restored: Optional[dict[str, Any]]) -> None:
        """Match-making store (fresh prefix per setup), the background exchange engine, restored counters."""
        assert self._engine is not None
        edges = (
            self._edges if self._edges is not None else topology_edges(self.topology, self.world_size, self.torus_shape)
        )
        rank = self.global_rank
        neighbours = sorted({j for i, j in edges if i == rank} | {i for i, j in edges if j == rank})
        default = dist.distributed_c10d._get_default_store()
        generation = (int(default.add("swarmsgd/setups", 1)) - 1) // self.world_size
        self._store = dist.PrefixStore(f"swarmsgd/{generation}/", default)
        replay, matchmaker = None, None
        if self.replay is not None:
            replay = self.replay.get(rank, []) if isinstance(self.replay, dict) else self.replay[rank]
        else:
            matchmaker = StoreMatchmaker(self._store, rank, neighbours, self.seed)
            matchmaker.reset()
        self._async = AsyncGossip(
            self._engine,
            matchmaker,
            self.local_steps,
            self.geometric_local_steps,
            self.seed,
            self.exchange_timeout,
            replay=replay,
        )
        if restored is not None and restored.get("async") is not None:
            self._async.load_state_dict(restored["async"])
        dist.barrier(group=self._engine.comm.group)  # every state key exists before anybody claims
        self._async.start()

    def _await_peers(self, poll: float = 0.2) -> None:
        """Wait until every rank has finished training (async mode), however long the slowest one takes.

        Each rank counts its batches in the store (``beat/<rank>``, see :meth:`_unlock_training_loop`). The wait
        fails when a rank that has not finished completes no batch for ``max(exchange_timeout, 600)`` seconds
        (dead or hung; an evaluation loop in between is allowed that long).
        """
        assert self._store is not None
        store, rank, world = self._store, self.global_rank, self.world_size
        store.set(f"done/{rank}", "1")
        patience = max(self.exchange_timeout, 600.0)
        seen: dict[int, tuple[int, float]] = {}
        while True:
            pending = [r for r in range(world) if not store.check([f"done/{r}"])]
            if not pending:
                return
            now = time.monotonic()
            for r in pending:
                beat = int(store.add(f"beat/{r}", 0))
                if r not in seen or seen[r][0] != beat:
                    seen[r] = (beat, now)
                elif now - seen[r][1] > patience:
                    raise RuntimeError(
                        f"SwarmStrategy (rank {rank}): rank {r} has completed no batch for "
                        f"{patience:.0f} s while this rank waits for every rank to finish training: "
                        f"presumed dead or hung"
                    )
            time.sleep(poll)

    def _unlock_training_loop(self) -> None:
        """Replace Lightning's per-batch SIGTERM broadcast by a store flag (async mode only).

        Lightning 2.6's training epoch loop broadcasts a SIGTERM flag from rank 0 before *every* batch
        (``_TrainingEpochLoop._broadcast_sigterm_tensor``): a global collective that would put the
        asynchronous ranks back in lock-step (measured: a 3x slower rank held every rank at its pace). On
        this trainer's loop instance, the check becomes: a rank that received SIGTERM sets a store key,
        and every rank raises ``SIGTERMException`` at its next batch once the key exists (no waiting).
        """
        loop = getattr(getattr(self.lightning_module.trainer, "fit_loop", None), "epoch_loop", None)
        if loop is None or not hasattr(loop, "_broadcast_sigterm_tensor"):
            return
        assert self._store is not None
        store, trainer, beat = self._store, self.lightning_module.trainer, f"beat/{self.global_rank}"

        def check_sigterm() -> None:
            store.add(beat, 1)  # liveness for the end-of-training wait (_await_peers)
            if getattr(trainer, "received_sigterm", False):
                store.set("sigterm", "1")
            if store.check(["sigterm"]):
                raise SIGTERMException()

        loop._broadcast_sigterm_tensor = check_sigterm

    # ------------------------------------------------------------------ Lightning's decisions during async training
    @override
    def broadcast(self, obj: _T, src: int = 0) -> _T:
        """Lightning's broadcast; during asynchronous training ``obj`` itself, so each rank decides on its own.

        Lightning decides through this collective after every batch (``Timer``, ``max_time``) and around
        checkpoints; that would put the asynchronous ranks back in lock-step (docs/swarm.md).
        """
        return obj if self._rank_local else super().broadcast(obj, src)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's all/any over ranks; during asynchronous training this rank's ``decision`` (``EarlyStopping``,
        ``ModelCheckpoint``'s top-k)."""
        return decision if self._rank_local else super().reduce_boolean_decision(decision, all=all)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        """Lightning's barrier; no-op during asynchronous training (the end of ``fit`` waits for every rank)."""
        if not self._rank_local:
            super().barrier(name)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Lightning's reduction (``self.log(..., sync_dist=True)``); during asynchronous training this rank's value,
        with one warning naming the metrics (an all-reduce per step would put the ranks back in lock-step)."""
        if not self._rank_local:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        if not self._warned_sync_dist:
            self._warned_sync_dist = True
            names = _sync_dist_names(getattr(self.lightning_module.trainer, "_results", None))
            rank_zero_warn(
                f"SwarmStrategy(mode='async'): self.log(..., sync_dist=True) of {names or 'a metric'} would "
                "all-reduce over every rank at every step, which puts the asynchronous ranks back in lock-step (and "
                "hangs once they stop at different steps). During training each rank logs its own value, "
                "unreduced; log with sync_dist=False to silence this warning."
            )
        return tensor

    def _warn_collective_validation(self) -> None:
        """Warn when validation during ``fit`` is collective while the ranks may stop at different epochs."""
        trainer = self.lightning_module.trainer
        if self.eval_model == "local" or self.world_size < 2 or not getattr(trainer, "enable_validation", False):
            return
        own_clock = any(
            isinstance(c, EarlyStopping) or (isinstance(c, Timer) and c._duration is not None)
            for c in trainer.callbacks
        )
        if own_clock:
            rank_zero_warn(
                f"SwarmStrategy(mode='async', eval_model={self.eval_model!r}): every validation during fit "
                "averages over all ranks (a collective), but with a time limit or EarlyStopping each rank stops "
                "on its own clock, possibly after another number of validations: a rank left waiting there hangs. "
                "Use eval_model='local', or validate the averaged model after fit."
            )


def _sync_dist_names(results: Any) -> list[str]:
    """Names of the logged metrics that ask for ``sync_dist`` in Lightning's result collection ``results``."""
    metas = [getattr(v, "meta", None) for v in (results or {}).values()]
    return sorted({m.name for m in metas if m is not None and getattr(m.sync, "should", False)})
