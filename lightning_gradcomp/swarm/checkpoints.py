"""SwarmStrategy's checkpoints: the mean model as ``state_dict``, every rank's model, optimizer and gossip state in
its own shard, and the resume (world-size policy: docs/swarm.md); during asynchronous training, rank 0's own model
and optimizer states, without a collective.

A mixin, listed before the Lightning strategy base class in :class:`~lightning_gradcomp.swarm.strategy.SwarmStrategy`,
which sets the attributes declared here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Optional

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp import shard_files
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.replicas import DivergentReplicas
from lightning_gradcomp.shard_files import load_verified, resumable_hpc_checkpoint
from lightning_gradcomp.sharded_checkpoints import ShardedCheckpoints
from lightning_gradcomp.swarm.asynchronous import AsyncGossip
from lightning_gradcomp.swarm.exchange import LatticeCodec, PairwiseGossip, PendingExchange

__all__ = ["CHECKPOINT_KEY", "SwarmCheckpoints"]

CHECKPOINT_KEY = "swarm"
"""Top-level checkpoint key holding ``bits``, rank 0's round counters and the manifest of the per-rank shards."""

_CHECKPOINT_VERSION = 1
"""Version of the old single-file entry (every rank's state inline); still loaded, no longer written."""
_SHARD_WORDS = {"what": "rank-state", "contents": "model, optimizer states and gossip state"}


class SwarmCheckpoints(DivergentReplicas, ShardedCheckpoints, DDPStrategy):
    """Mixin: :class:`~lightning_gradcomp.swarm.strategy.SwarmStrategy`'s checkpoint methods (see the module
    docstring)."""

    _async: Optional[AsyncGossip]
    _engine: Optional[PairwiseGossip]
    _pending: Optional[PendingExchange]
    _aux: Optional[Comm]
    _comm_stats: CommStats
    _rank_local: bool
    _round_index: int
    _steps_in_round: int
    _round_length: int
    _restored_counters: Optional[dict[str, Any]]
    codec: Optional[LatticeCodec]
    bits: Optional[int]
    flush: Callable[..., None]
    _ensure_comms: Callable[[], None]
    _fold_nonfinite: Callable[[], None]
    _mean_of: Callable[[dict[str, Tensor]], dict[str, Tensor]]

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``state_dict``: the mean over ranks of every floating tensor (an all-reduce).

        Integer buffers (e.g. ``num_batches_tracked``) are this rank's. Every rank must call this (as
        ``Trainer.save_checkpoint`` does). During asynchronous training: rank 0's own model, no collective
        (:meth:`save_checkpoint`).
        """
        if self._rank_local:
            if self.global_rank == 0:
                self.flush()  # its exchange in flight, if any, is applied first (waits for that partner only)
            return self._local_model_state()
        if self._async is not None:
            self.flush()  # async: apply exchanges in flight first, so the mean and the per-rank models agree
        state = self._local_model_state()
        self._ensure_comms()
        if self._aux is None or self.world_size < 2:
            return state
        floating = {k: v for k, v in state.items() if isinstance(v, Tensor) and v.is_floating_point()}
        state.update(self._mean_of(floating))
        return state

    def _rank_state(self) -> dict[str, Any]:
        if self._async is not None:
            self.flush()  # async: no exchange in flight while saving (lock-step keeps its pending exchange)
        self._fold_nonfinite()
        return {
            "async": self._async.state_dict() if self._async is not None else None,
            "model": self._local_model_state(),
            "optimizers": [copy.deepcopy(self.optimizer_state(o)) for o in self.optimizers],
            "counters": {
                "round_index": self._round_index,
                "steps_in_round": self._steps_in_round,
                "round_length": self._round_length,
            },
            "gossip": self._engine.state_dict() if self._engine is not None else None,
            "pending": self._pending.state_dict() if self._pending is not None else None,
            "comm_stats": self._comm_stats.state_dict(),
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write this rank's model, optimizer and gossip state to its shard next to ``filepath`` (all ranks).

        Rank 0's checkpoint gets, under ``"swarm"``, ``bits``, its round counters and the manifest of the shards
        (:mod:`lightning_gradcomp.sharded_checkpoints`); every rank gets the same error if one cannot write.

        During asynchronous training (a ``ModelCheckpoint`` firing on each rank's own step count or metrics) the save
        is rank 0's alone, without a collective: its file holds rank 0's model and optimizer states, and resuming from
        it starts every rank from them (:meth:`_save_replica`).
        """
        if self._rank_local:
            self._save_replica(checkpoint, filepath, storage_options)
            return
        local = self._rank_state()
        codec = type(self.codec).__name__ if self.codec is not None else "NoCompression"
        self._save_with_shards(
            checkpoint,
            filepath,
            storage_options,
            CHECKPOINT_KEY,
            local,
            codec,
            {},
            bits=self.bits,
            counters=local["counters"],
        )  # rank 0's counters: rank 0 writes

    def _save_replica(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any]) -> None:
        """Rank 0 writes ``checkpoint`` (its own model and optimizers) with ``bits``, its counters and
        ``"replica": 0`` under ``"swarm"``; the other ranks write nothing."""
        if self.global_rank != 0:
            return
        counters = {
            "round_index": self._round_index,
            "steps_in_round": self._steps_in_round,
            "round_length": self._round_length,
        }
        checkpoint[CHECKPOINT_KEY] = {"bits": self.bits, "counters": counters, "replica": 0}
        self._write_file(checkpoint, filepath, storage_options)  # atomically, as the sharded saves

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load the (CRC-checked) checkpoint and this rank's shard (world-size policy: docs/swarm.md).

        An old single-file checkpoint (version 1, every rank's state inline) still loads.

        Raises:
            FileNotFoundError, RuntimeError: this or another rank's shard is missing or does not match the
                manifest (every rank raises; the message names the file).
            ValueError: the entry is malformed, or ``bits`` differs from this strategy's.
        """
        checkpoint_path = resumable_hpc_checkpoint(checkpoint_path)
        checkpoint = load_verified(
            lambda: super(SwarmCheckpoints, self).load_checkpoint(checkpoint_path, weights_only=weights_only),
            checkpoint_path,
        )
        saved = checkpoint.get(CHECKPOINT_KEY)
        self._restored = self._restored_counters = None
        if saved is None:
            return checkpoint
        if isinstance(saved, dict) and "replica" in saved:
            return self._load_replica(checkpoint, saved)
        sharded = shard_files.is_sharded(saved)
        shard_files.check_entry(saved, sharded, CHECKPOINT_KEY, ("bits", "counters"), _CHECKPOINT_VERSION)
        if saved["bits"] != self.bits:
            raise ValueError(
                f"checkpoint was written with bits={saved['bits']}, this strategy uses "
                f"bits={self.bits}; resume with the same setting"
            )
        self._restored_counters = saved["counters"] if sharded else saved["per_rank"][0]["counters"]
        if saved["world_size"] == self.world_size:
            self._restored = (
                self._load_own_shard(checkpoint_path, saved, weights_only, self.root_device, **_SHARD_WORDS)
                if sharded
                else saved["per_rank"][self.global_rank]
            )
        else:
            rank_zero_warn(
                f"SwarmStrategy: checkpoint was written by {saved['world_size']} ranks, resuming on "
                f"{self.world_size}: every rank starts from the mean model with rank 0's optimizer "
                f"state; the round counter is kept, the in-flight exchange is dropped"
            )
        return checkpoint

    def _load_replica(self, checkpoint: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint saved during asynchronous training (:meth:`_save_replica`): every rank resumes from it."""
        if saved.get("bits") != self.bits or not isinstance(saved.get("counters"), dict):
            raise ValueError(
                f"checkpoint entry {CHECKPOINT_KEY!r} must hold this strategy's bits={self.bits} and the counters, "
                f"got bits={saved.get('bits')!r}"
            )
        self._restored_counters = saved["counters"]
        rank_zero_info(
            "SwarmStrategy: this checkpoint was saved during asynchronous training and holds rank 0's model and "
            "optimizer states: every rank resumes from them"
        )
        return checkpoint
