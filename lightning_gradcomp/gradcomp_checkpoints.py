"""GradCompStrategy's checkpoints: each rank's compression state (error-feedback memory, compressor state, counters)
in its own shard next to the checkpoint file, the manifest and the replicated state in the file; and the resume from a
sharded or an old single-file entry, on the same or another number of ranks.

A mixin, listed before the Lightning strategy base class in :class:`~lightning_gradcomp.strategy.GradCompStrategy`,
which sets the attributes declared here.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_gradcomp import shard_files
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.hook import GradCompHook
from lightning_gradcomp.shard_files import load_verified
from lightning_gradcomp.sharded_checkpoints import ShardedCheckpoints

__all__ = ["CHECKPOINT_KEY", "GradCompCheckpoints"]

CHECKPOINT_KEY = "gradcomp"
"""Top-level checkpoint key holding the manifest of the compression-state shards (see :mod:`.shard_files`)."""

_CHECKPOINT_VERSION = 1
"""Version of the old single-file entry (every rank's state inline); still loaded, no longer written."""
_PER_RANK_KEYS = ("memory", "compressor", "stats")
"""Keys of ``GradCompHook.state_dict()`` that differ per rank (the rest is replicated and kept in the manifest)."""
_SHARD: dict[str, Any] = {}
"""Stand-in for the state held in this rank's shard (``_select_state`` -> ``load_checkpoint`` reads it)."""


class GradCompCheckpoints(ShardedCheckpoints, DDPStrategy):
    """Mixin: :class:`~lightning_gradcomp.strategy.GradCompStrategy`'s checkpoint methods."""

    _hook: Optional[GradCompHook]
    _pending: Optional[tuple[dict[str, Any], bool]]
    compressor: Compressor

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write this rank's compression state to its shard next to ``filepath`` (must run on all ranks).

        Rank 0's checkpoint file gets only the manifest (sizes and checksums of the shards) and the replicated
        state; see :mod:`lightning_gradcomp.shard_files`. Every rank gets the same error if one cannot write.
        """
        state = self._hook.state_dict() if self._hook is not None else {}
        replicated = {key: value for key, value in state.items() if key not in _PER_RANK_KEYS}
        self._save_with_shards(
            checkpoint, filepath, storage_options, CHECKPOINT_KEY, state, type(self.compressor).__name__, replicated
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load the checkpoint and stash this rank's compression state for the hook.

        A sharded checkpoint (format version 2) is read from this rank's shard only, when fitting on the same
        number of ranks; an old single-file checkpoint (version 1, every rank's state inline) still loads.

        Raises:
            RuntimeError: the file is truncated or corrupted (CRC check of a local file), or unreadable; a shard
                (any rank's: every rank raises) does not match the manifest's size and checksum. The message names
                the file.
            FileNotFoundError: a shard (any rank's) is missing; the message names it.
            ValueError: the checkpoint was written with another compressor, or its ``"gradcomp"`` entry is
                malformed.
        """
        checkpoint_path = shard_files.resumable_hpc_checkpoint(checkpoint_path)
        checkpoint = load_verified(
            lambda: super(GradCompCheckpoints, self).load_checkpoint(checkpoint_path, weights_only=weights_only),
            checkpoint_path,
        )
        try:
            self._pending = self._select_state(checkpoint.get(CHECKPOINT_KEY))
        except ValueError as err:
            raise ValueError(f"cannot resume from '{checkpoint_path}': {err}") from None
        if self._pending is not None and self._pending[0] is _SHARD:
            self._pending = self._load_own_shard(checkpoint_path, checkpoint[CHECKPOINT_KEY], weights_only), True
        if self._pending is not None and self._hook is not None:
            self._hook.load_state_dict(*self._pending)
            self._pending = None
        return checkpoint

    def _select_state(self, saved: Optional[dict[str, Any]]) -> Optional[tuple[dict[str, Any], bool]]:
        """This rank's ``(state, per_rank)`` from a ``"gradcomp"`` entry, or ``None`` (nothing to restore).

        ``state`` is ``_SHARD`` when it is in this rank's shard, which :meth:`load_checkpoint` then reads.
        """
        if shard_files.is_sharded(saved):
            return self._select_sharded(saved)  # type: ignore[arg-type]
        if saved is None:
            if self._fitting():
                rank_zero_warn(
                    f"GradCompStrategy: the checkpoint has no {CHECKPOINT_KEY!r} entry (written by plain "
                    f"DDP or another strategy): compression state (error-feedback memories, compressor "
                    f"state, per-layer parameters, step counter) starts fresh"
                )
            return None
        per_rank = saved.get("per_rank") if isinstance(saved, dict) else None
        if (
            not isinstance(saved, dict)
            or saved.get("version") != _CHECKPOINT_VERSION
            or not isinstance(per_rank, list)
            or len(per_rank) != saved.get("world_size")
            or not all(isinstance(entry, dict) for entry in per_rank)
            or "compressor" not in saved
        ):
            raise ValueError(
                f"checkpoint entry {CHECKPOINT_KEY!r} is malformed or from an unknown version "
                f"(expected version {shard_files.FORMAT_VERSION} with one shard per rank, or "
                f"version {_CHECKPOINT_VERSION} with one state per rank)"
            )
        if not self._same_ranks(saved):
            return saved["per_rank"][0], False
        return saved["per_rank"][self.global_rank], True

    def _select_sharded(self, saved: dict[str, Any]) -> Optional[tuple[dict[str, Any], bool]]:
        shard_files.check_manifest(saved)
        if not self._same_ranks(saved):
            return saved["replicated"], False
        return (_SHARD, True) if self._fitting() else None  # evaluation needs no shard: the folder may be absent

    def _same_ranks(self, saved: dict[str, Any]) -> bool:
        """Refuse another compressor; warn and say ``False`` when the world size changed (replicated state only)."""
        ours = type(self.compressor).__name__
        if saved["compressor"] != ours:
            raise ValueError(
                f"checkpoint was written with compressor {saved['compressor']}, but this strategy "
                f"uses {ours}; resume with the same compressor or start a new run"
            )
        if saved["world_size"] != self.world_size:
            rank_zero_warn(
                f"GradCompStrategy: checkpoint was written by {saved['world_size']} ranks, resuming on "
                f"{self.world_size}: per-rank state (error-feedback memories, compressor state) is reset; "
                f"the step counter and per-layer parameters are kept"
            )
            return False
        return True

    def _fitting(self) -> bool:
        trainer = getattr(self._lightning_module, "_trainer", None)
        return trainer is None or trainer.state.fn in (None, "fit")
