"""The collective save/load protocol of per-rank checkpoint shards, shared by the strategies.

:class:`~lightning_gradcomp.GradCompStrategy` (compression state), :class:`~lightning_gradcomp.LocalSGDStrategy`
(local model, inner optimizer states, engine state) and :class:`~lightning_gradcomp.SwarmStrategy` (model,
optimizer and gossip state) keep state that differs on every rank. Each rank writes its own part to a shard file
next to the checkpoint (:mod:`lightning_gradcomp.shard_files`); rank 0's checkpoint file holds a manifest
and the replicated state only. The steps of a save (every rank runs them, as ``Trainer.save_checkpoint`` calls
``save_checkpoint`` on every rank):

1. rank 0 broadcasts the file it writes and a fresh save token;
2. every rank writes its shard (a failure on one rank raises on every rank);
3. the manifest entries (names, sizes, SHA-256s, not the states) are all-gathered;
4. rank 0 writes the checkpoint file, with the manifest under the strategy's key, atomically (a temporary file,
   fsync, ``os.replace``: :mod:`lightning_gradcomp.atomic_files`); a failure there (a full disk) raises on every
   rank, which deletes its new shard: the checkpoint saved before at that path still loads, shards included;
5. after a barrier (the new file is in place), every rank deletes its shards of earlier saves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightning_gradcomp import shard_files
from lightning_gradcomp.atomic_files import atomic_save

__all__ = ["ShardedCheckpoints"]

_T = TypeVar("_T")


class ShardedCheckpoints:
    """Mixin for a ``DDPStrategy`` subclass, listed before it: per-rank state in shards, a manifest in the file.

    The strategy's ``save_checkpoint`` calls :meth:`_save_with_shards`, its ``load_checkpoint``
    :meth:`_load_own_shard`; :meth:`remove_checkpoint` takes this rank's shards along with the file.
    """

    _name_in_messages = "Strategy"
    """How errors raised on behalf of another rank name the strategy (``"<name>: rank 1 failed: ..."``)."""

    global_rank: int
    world_size: int
    broadcast: Callable[..., Any]
    barrier: Callable[..., Any]

    def _save_with_shards(
        self,
        checkpoint: dict[str, Any],
        filepath: Any,
        storage_options: Optional[Any],
        key: str,
        state: dict[str, Any],
        compressor: str,
        replicated: dict[str, Any],
        **fields: Any,
    ) -> None:
        """Write ``state`` to this rank's shard and ``checkpoint`` (with the manifest under ``key``) from rank 0.

        Args:
            checkpoint: Lightning's checkpoint dict (rank 0 writes it).
            filepath: the checkpoint path (rank 0's is used on every rank).
            storage_options: passed on to Lightning's ``save_checkpoint``.
            key: the top-level checkpoint key of the manifest.
            state: this rank's own state (``weights_only``-loadable).
            compressor: recorded in the manifest (see :func:`~.shard_files.build_manifest`).
            replicated: state identical on every rank, recorded in the manifest.
            **fields: further manifest entries (the strategy's settings and shared state).
        """
        filepath, token = self.broadcast((filepath, shard_files.new_token()))  # the file rank 0 writes
        entry = self._on_every_rank(
            lambda: _saving(filepath, lambda: shard_files.write_shard(state, filepath, self.global_rank, token))
        )
        shards: list[Any] = [entry]
        if self._distributed():
            shards = [None] * self.world_size
            dist.all_gather_object(shards, entry)
        checkpoint[key] = {**shard_files.build_manifest(shards, compressor, replicated, filepath), **fields}
        try:
            self._on_every_rank(
                lambda: _saving(filepath, lambda: self._write_file(checkpoint, filepath, storage_options))
            )
        except BaseException:
            shard_files.remove_stale_shards(filepath, self.global_rank, keep="", token=token)
            raise
        if self._distributed():
            self.barrier(f"{self._name_in_messages}.save_checkpoint")  # the new file is in place: older shards go
        shard_files.remove_stale_shards(filepath, self.global_rank, keep=entry["file"])

    def _write_file(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any]) -> None:
        """Rank 0 writes the checkpoint file: atomically (:func:`~.atomic_files.atomic_save`) through Lightning's
        default ``TorchCheckpointIO``, otherwise through the ``CheckpointIO`` plugin given (its own guarantees)."""
        io = getattr(self, "checkpoint_io", None)
        if type(io) is not TorchCheckpointIO or storage_options is not None:
            super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        elif self.global_rank == 0:
            atomic_save(checkpoint, filepath)

    def _load_own_shard(
        self,
        checkpoint_path: Any,
        manifest: dict[str, Any],
        weights_only: Optional[bool],
        device: Optional[torch.device] = None,
        **describe: str,
    ) -> dict[str, Any]:
        """This rank's shard, verified against ``manifest``; a failure on any rank raises on every rank.

        Tensors are loaded on the CPU, then moved to ``device`` if given. ``describe`` (``what``, ``contents``)
        words the error messages, see :func:`~.shard_files.load_shard`.
        """
        state = self._on_every_rank(
            lambda: shard_files.load_shard(
                checkpoint_path,
                manifest,
                self.global_rank,
                weights_only=True if weights_only is None else weights_only,
                **describe,
            )
        )
        return state if device is None else move_data_to_device(state, device)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove the checkpoint file (rank 0) and this rank's shards of it (every rank, as Lightning calls it)."""
        super().remove_checkpoint(filepath)  # type: ignore[misc]
        shard_files.remove_shards(filepath, self.global_rank)

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.world_size > 1

    def _on_every_rank(self, action: Callable[[], _T]) -> _T:
        """Run ``action`` on this rank; if it fails on any rank, raise on every rank (instead of a hang).

        The failing rank re-raises its own exception; the others raise a ``RuntimeError`` that quotes it.
        """
        try:
            result, failure = action(), None
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            result, failure = None, err
        if not self._distributed():
            if failure is not None:
                raise failure
            return result  # type: ignore[return-value]
        failures: list[Optional[str]] = [None] * self.world_size
        dist.all_gather_object(failures, None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        for rank, message in enumerate(failures):
            if message is not None:
                raise RuntimeError(f"{self._name_in_messages}: rank {rank} failed: {message}")
        return result  # type: ignore[return-value]


def _saving(filepath: Any, write: Callable[[], _T]) -> _T:
    """``write()``; an ``OSError`` (a full disk, a lost mount) raised with the file named and what was kept."""
    try:
        return write()
    except OSError as err:
        raise OSError(
            err.errno,
            f"cannot save checkpoint '{filepath}': {err.strerror or err}. The checkpoint saved before at this path, "
            f"if any, and its shards are unchanged",
        ) from err
