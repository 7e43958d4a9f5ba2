"""SwarmStrategy's training: each local step (a NaN/Inf gradient zeroed first), the gossip every ``local_steps`` steps
(a lock-step round, or the asynchronous engine's step boundary), and the end of ``fit``.

A mixin, listed before the Lightning strategy base class in :class:`~lightning_gradcomp.swarm.strategy.SwarmStrategy`,
which sets the attributes declared here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.comm import Comm, CommStats, all_reduce_bytes
from lightning_gradcomp.functional.finite import DeferredCount
from lightning_gradcomp.functional.realview import real_view
from lightning_gradcomp.replicas import DivergentReplicas
from lightning_gradcomp.swarm.asynchronous import AsyncGossip
from lightning_gradcomp.swarm.exchange import PairwiseGossip, PendingExchange, SwarmStats
from lightning_gradcomp.swarm.flat_vectors import _write_flat, _write_named
from lightning_gradcomp.swarm.pairing import round_local_steps

__all__ = ["GossipTraining"]


class GossipTraining(DivergentReplicas, DDPStrategy):
    """Mixin: :class:`~lightning_gradcomp.swarm.strategy.SwarmStrategy`'s training steps (see the module docstring)."""

    _engine: Optional[PairwiseGossip]
    _async: Optional[AsyncGossip]
    _pending: Optional[PendingExchange]
    _aux: Optional[Comm]
    _comm_stats: CommStats
    _swarm_stats: SwarmStats
    _nonfinite: DeferredCount
    _params: list[Tensor]
    _gossip_names: list[str]
    _param_numel: int
    _round_index: int
    _steps_in_round: int
    _round_length: int
    _rank_local: bool
    local_steps: int
    geometric_local_steps: bool
    seed: int
    non_blocking: bool
    monitor_every: int
    average_at_end: bool
    partners: Callable[[int], list[int]]
    _await_peers: Callable[..., None]
    _mean_of: Callable[[dict[str, Tensor]], dict[str, Tensor]]
    _model_tensors: Callable[[], dict[str, Tensor]]

    # ------------------------------------------------------------------ training
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """Run the local step, then a gossip round every ``local_steps`` steps (first optimizer only).

        A gradient holding NaN/Inf is zeroed before the update (counted in ``swarm_stats.nonfinite_steps``),
        so it never reaches this rank's model and, through gossip, its partners. With a loss scaler (fp16 AMP)
        the scaler's own skip logic is left in charge.
        """
        closure = self._guarded(optimizer, closure, self._nonfinite.add)  # counted without a host sync
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._engine is not None and self._is_first_optimizer(optimizer):
            self._local_step_done()
        return output

    def _is_first_optimizer(self, optimizer: Optimizer) -> bool:
        if not self.optimizers:
            return True
        first = self.optimizers[0]
        return getattr(optimizer, "_optimizer", optimizer) is getattr(first, "_optimizer", first)

    def _local_step_done(self) -> None:
        assert self._engine is not None
        self._comm_stats.steps += 1
        self._comm_stats.dense_bytes += all_reduce_bytes(4 * self._param_numel, self.world_size)
        if self._async is not None:
            updated = self._async.boundary(self._comm_stats.steps, self._flat_params)
            if updated is not None:
                _write_flat(self._params, updated)
            return
        self._steps_in_round += 1
        if self._steps_in_round < self._round_length:
            return
        self._gossip_round()
        self._steps_in_round = 0
        self._round_index += 1
        self._round_length = round_local_steps(
            self.local_steps, self.geometric_local_steps, self.seed, self._round_index
        )

    def _gossip_round(self) -> None:
        assert self._engine is not None
        x = self._flat_params()
        if self._pending is not None:
            x = self._engine.complete(self._pending, x)
            self._pending = None
            _write_flat(self._params, x)
        partner = self.partners(self._round_index)[self.global_rank] if self.world_size > 1 else -1
        self._swarm_stats.rounds += 1
        if partner < 0:
            self._swarm_stats.sat_out += 1
        else:
            self._swarm_stats.exchanges += 1
            pending = self._engine.post(x, partner, self._round_index)
            if self.non_blocking:
                self._pending = pending
            else:
                _write_flat(self._params, self._engine.complete(pending))
        if self.monitor_every and (self._round_index + 1) % self.monitor_every == 0:
            self._measure_consensus()

    def flush(self, final: bool = False) -> None:
        """Apply a posted, not yet applied exchange now (no-op in blocking mode).

        Async: withdraw an unclaimed offer and finish and apply an exchange in flight (``final``: this rank
        takes part in no further exchange).
        """
        if self._async is not None:
            updated = self._async.drain(self._comm_stats.steps, self._training_flat, final=final)
            if updated is not None:
                self._write_training_flat(updated)
            return
        if self._pending is not None and self._engine is not None:
            _write_flat(self._params, self._engine.complete(self._pending, self._flat_params()))
            self._pending = None

    def _measure_consensus(self) -> None:
        assert self._aux is not None
        x = self._flat_params().double()
        mean = x.clone()
        self._aux.all_reduce(mean)
        mean /= self.world_size
        distance = torch.linalg.vector_norm(x - mean).reshape(1)
        self._aux.all_reduce(distance, op=dist.ReduceOp.MAX)
        self._swarm_stats.consensus = float(distance)
        self._swarm_stats.consensus_history.append(float(distance))

    @override
    def on_train_end(self) -> None:
        """Apply the last exchange and (``average_at_end``) give every rank the mean model.

        Async: every rank waits here for the others, so no rank leaves, taking the store server or its end of
        the exchange group with it, while another still trains. A fast rank may wait for a straggler far
        longer than any collective timeout, so it polls the store (:meth:`_await_peers`) and fails only when a
        rank that is still training stops completing batches; then one barrier, which every rank reaches.
        """
        self._rank_local = False
        self.flush(final=True)
        if self._async is not None:
            assert self._engine is not None  # _setup_async ran with it
            self._await_peers()
            dist.barrier(group=self._engine.comm.group)
        if self.average_at_end and self._aux is not None and self.world_size > 1:
            _write_named(self.lightning_module, self._mean_of(self._model_tensors()))
        super().on_train_end()

    # ------------------------------------------------------------------ helpers
    def _flat_params(self) -> Tensor:
        return torch.cat([real_view(p.detach()).reshape(-1).float() for p in self._params])

    def _training_tensors(self) -> list[Tensor]:
        """The gossiped tensors of this rank's *training* model (the saved copies during evaluation)."""
        if self._eval_backup is None:
            return self._params
        return [self._eval_backup.get(n, p) for n, p in zip(self._gossip_names, self._params)]

    def _training_flat(self) -> Tensor:
        return torch.cat([real_view(t.detach()).reshape(-1).float() for t in self._training_tensors()])

    def _write_training_flat(self, flat: Tensor) -> None:
        _write_flat(self._training_tensors(), flat)
