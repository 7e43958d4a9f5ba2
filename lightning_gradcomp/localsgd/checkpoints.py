"""LocalSGDStrategy's checkpoints: the global model as ``state_dict``, every rank's local state in its own shard,
and the resume (world-size policy: docs/localsgd.md).

A mixin, listed before the Lightning strategy base class in
:class:`~lightning_gradcomp.localsgd.strategy.LocalSGDStrategy`, which sets the attributes declared here.
"""

from __future__ import annotations

import copy
from typing import Any, Literal, Optional

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_gradcomp import shard_files
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.localsgd.engine import OuterSync
from lightning_gradcomp.replicas import DivergentReplicas
from lightning_gradcomp.shard_files import load_verified, resumable_hpc_checkpoint
from lightning_gradcomp.sharded_checkpoints import ShardedCheckpoints

__all__ = ["CHECKPOINT_KEY", "LocalSGDCheckpoints"]

CHECKPOINT_KEY = "localsgd"
"""Top-level checkpoint key holding the settings, the shared (outer) state and the manifest of the per-rank shards."""

_CHECKPOINT_VERSION = 1
"""Version of the old single-file entry (every rank's local state inline); still loaded, no longer written."""
_SETTINGS = ("outer", "local_steps", "fragments", "overlap", "shared")
"""Keys of a sharded entry besides the manifest's: settings checked on resume, and the shared state."""
_SHARD_WORDS = {
    "what": "local-state",
    "contents": "local model, inner optimizer states, error-feedback memory and compressor state",
}


class LocalSGDCheckpoints(DivergentReplicas, ShardedCheckpoints, DDPStrategy):
    """Mixin: :class:`~lightning_gradcomp.localsgd.strategy.LocalSGDStrategy`'s checkpoint methods."""

    _engine: Optional[OuterSync]
    _restored_shared: Optional[dict[str, Any]]
    compressor: Compressor
    outer: Literal["average", "nesterov"]
    local_steps: int
    fragments: int
    overlap: int

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``state_dict``: the **global** model (identical on all ranks, no communication)."""
        state = self._local_model_state()
        if self._engine is not None:
            state.update({k: v.clone() for k, v in self._engine.global_tensors().items() if k in state})
        return state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write this rank's local state to its shard next to ``filepath`` (must run on all ranks).

        Rank 0's checkpoint gets, under ``"localsgd"``, the settings, the shared state and the manifest of the
        shards (:mod:`lightning_gradcomp.sharded_checkpoints`); every rank gets the same error if one cannot write.
        """
        engine = self._engine
        local = {
            "model": self._local_model_state(),
            "optimizers": [copy.deepcopy(self.optimizer_state(o)) for o in self.optimizers],
            **(engine.rank_state() if engine is not None else {}),
        }
        self._save_with_shards(
            checkpoint,
            filepath,
            storage_options,
            CHECKPOINT_KEY,
            local,
            type(self.compressor).__name__,
            {},
            outer=self.outer,
            local_steps=self.local_steps,
            fragments=self.fragments,
            overlap=self.overlap,
            shared=engine.shared_state() if engine is not None else None,
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load the (CRC-checked) checkpoint and this rank's shard (world-size policy: docs/localsgd.md).

        An old single-file checkpoint (version 1, every rank's local state inline) still loads.

        Raises:
            FileNotFoundError, RuntimeError: this or another rank's shard is missing or does not match the
                manifest (every rank raises; the message names the file).
            ValueError: the entry is malformed, or the settings differ from this strategy's.
        """
        checkpoint_path = resumable_hpc_checkpoint(checkpoint_path)
        checkpoint = load_verified(
            lambda: super(LocalSGDCheckpoints, self).load_checkpoint(checkpoint_path, weights_only=weights_only),
            checkpoint_path,
        )
        saved = checkpoint.get(CHECKPOINT_KEY)
        self._restored = self._restored_shared = None
        if saved is None:
            return checkpoint
        sharded = shard_files.is_sharded(saved)
        try:
            shard_files.check_entry(saved, sharded, CHECKPOINT_KEY, _SETTINGS, _CHECKPOINT_VERSION)
        except ValueError as err:
            raise ValueError(f"cannot resume from '{checkpoint_path}': {err}") from None
        mine = (type(self.compressor).__name__, self.outer, self.local_steps, self.fragments, self.overlap)
        theirs = (
            saved["compressor"],
            saved["outer"],
            saved["local_steps"],
            saved["fragments"],
            saved.get("overlap", 0),
        )
        if mine != theirs:
            raise ValueError(
                f"cannot resume from '{checkpoint_path}': it was written with (compressor, outer, "
                f"local_steps, fragments, overlap) = {theirs}, this strategy uses {mine}; resume with the "
                f"same settings"
            )
        self._restored_shared = saved["shared"]
        if saved["world_size"] == self.world_size:
            self._restored = (
                self._load_own_shard(checkpoint_path, saved, weights_only, self.root_device, **_SHARD_WORDS)
                if sharded
                else saved["per_rank"][self.global_rank]
            )
        else:
            rank_zero_warn(
                f"LocalSGDStrategy: checkpoint was written by {saved['world_size']} ranks, resuming on "
                f"{self.world_size}: every rank starts from the global model with rank 0's inner "
                f"optimizer state; error-feedback memories and compressor state are reset; the global "
                f"model, outer momentum, step counter and fragment cursor are kept"
            )
        return checkpoint
