"""LocalSGDFSDPStrategy: DiLoCo / Local SGD on sharded replicas (FSDP2 inside a replica, outer syncs across).

The strategy is :class:`~lightning_gradcomp.GradCompFSDPStrategy` (the ``("replicate", "shard")`` mesh, the FSDP2
sharding over ``"shard"``, the launchers, Lightning's distributed checkpoint) with the per-step replica reduction
replaced by :class:`~lightning_gradcomp.localsgd.OuterSync`:

* **inner steps** are FSDP2's alone: each replica trains its own model, sharded over its shard group; FSDP2's
  reduce-scatter averages the gradients inside the replica, and nothing crosses replicas (the all-reduce hook set on
  every ``FSDPModule`` only counts the shard group's bytes, :func:`~lightning_gradcomp.fsdp_reduction.
  count_shard_traffic`);
* **the outer sync** runs on shards: the engine is fed each rank's local shards (``DTensor.to_local()`` views of the
  sharded parameters), so ``theta``, the outer momentum and the error-feedback memories are shards too, and its
  collectives go over the replicate group (the ``R`` ranks holding the same shard index); every rank of a replicate
  group holds the same shard shapes, hence the same plans. After the sync every rank's shard is its group's
  ``theta``: the full parameters (``full_tensor()``) are identical on every rank.

Checkpoints: Lightning's distributed checkpoint holds the **global** model (the ranks of a replicate group hold the
same shard of it); each rank's own state (its local shards, its inner optimizer state, its engine's ``theta``,
momentum, memories and compressor state) goes into its shard file (:mod:`lightning_gradcomp.sharded_checkpoints`),
so a resume on the same layout is exact.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp import shard_files
from lightning_gradcomp.checks import check_bool
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors import CLTK, NoCompression
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.distributed import DEFAULT_TIMEOUT, release_group
from lightning_gradcomp.fsdp_reduction import count_shard_traffic, replicate_group
from lightning_gradcomp.fsdp_strategy import GradCompFSDPStrategy
from lightning_gradcomp.functional.finite import zero_if_nonfinite
from lightning_gradcomp.localsgd.engine import OuterSync
from lightning_gradcomp.localsgd.strategy import check_outer_settings
from lightning_gradcomp.memory import ErrorFeedback
from lightning_gradcomp.presets import register_preset
from lightning_gradcomp.replicas import DivergentReplicas

__all__ = ["CHECKPOINT_KEY", "LocalSGDFSDPStrategy"]

CHECKPOINT_KEY = "localsgd_fsdp"
"""Checkpoint entry (in the metadata file of Lightning's distributed checkpoint): settings and the shards' manifest."""
_SHARD_WORDS = {
    "what": "local-state",
    "contents": "local shards, inner optimizer state, outer state, error-feedback memory and compressor state",
}


def _local(tensor: Tensor) -> Tensor:
    """This rank's piece of ``tensor``: the local shard of a ``DTensor`` (a view of FSDP2's storage), else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class LocalSGDFSDPStrategy(DivergentReplicas, GradCompFSDPStrategy):
    """DiLoCo / Local SGD whose replicas are sharded with FSDP2: inner steps inside a replica, outer steps across.

    The ``W`` processes form ``R = W / S`` replicas of ``S`` processes (as :class:`~lightning_gradcomp.
    GradCompFSDPStrategy`: ranks ``r * S .. r * S + S - 1`` are replica ``r``, and the LightningModule shards itself
    over ``self.device_mesh["shard"]`` in ``configure_model``, or ``shard_modules=`` shards it). Each replica takes
    ``local_steps`` inner optimizer steps alone (FSDP2 averages the gradients inside it; nothing is sent across
    replicas), then the replicas reduce the pseudo-gradients ``theta - x`` of their shards through ``compressor``
    over the replicate group and take the outer step (:class:`~lightning_gradcomp.LocalSGDStrategy`'s, on shards).
    Designed for replicas joined by slow links; run here on CPU (gloo) only: on GPUs it is designed for, not yet run.

    Example::

        trainer = Trainer(accelerator="cpu", devices=4,
                          strategy=LocalSGDFSDPStrategy(local_steps=20, compressor=CLTK(density=0.01), shard_size=2,
                                                        start_method="fork"))

    Bytes (``comm_stats``): ``wire_bytes`` across replicas (the outer syncs), ``dense_bytes`` what per-step HSDP's
    fp32 all-reduce of the same shards would have sent across replicas over the same steps, ``intra_bytes`` FSDP2's
    all-gathers and reduce-scatters inside the shard group (by the formulas, not measured).

    Args:
        local_steps, outer, outer_lr, outer_momentum, compressor, fragments, beta, seed, sync_at_end: as for
            :class:`~lightning_gradcomp.LocalSGDStrategy` (a compressor that needs every rank of the world is refused,
            as in :class:`~lightning_gradcomp.GradCompFSDPStrategy`).
        min_numel, compress_1d: which local shards are compressed (the size rule judges the shard this rank holds).
        overlap: must be 0: background exchanges are not supported on sharded replicas yet.
        shard_size, shard_modules, mp_policy, reshard_after_forward, timeout, start_method,
        save_distributed_checkpoint, process_group_backend: as for :class:`~lightning_gradcomp.GradCompFSDPStrategy`
            (``save_distributed_checkpoint`` must stay ``True``).
    """

    _name_in_messages = "LocalSGDFSDPStrategy"

    def __init__(
        self,
        local_steps: int = 20,
        outer: Literal["average", "nesterov"] = "nesterov",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        compressor: Union[Compressor, str, None] = None,
        fragments: int = 1,
        min_numel: Optional[int] = None,
        compress_1d: Optional[bool] = None,
        beta: float = 1.0,
        seed: int = 0,
        sync_at_end: bool = True,
        overlap: int = 0,
        shard_size: Optional[int] = None,
        shard_modules: Optional[Sequence[type[nn.Module]]] = None,
        mp_policy: Optional[Any] = None,
        reshard_after_forward: bool = True,
        timeout: Union[timedelta, float, None] = DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
    ) -> None:
        settings = check_outer_settings(local_steps, outer, outer_lr, outer_momentum, compressor, fragments, overlap)
        self.local_steps, self.outer, self.outer_lr, self.outer_momentum = settings[:4]
        resolved, self.fragments, self.overlap = settings[4:]
        if self.overlap:
            raise ValueError(
                f"`overlap` must be 0 in LocalSGDFSDPStrategy (background exchanges on sharded replicas are not "
                f"supported yet), got overlap={self.overlap}; use LocalSGDStrategy for overlapped syncs"
            )
        if save_distributed_checkpoint is not True:
            raise ValueError(
                "`save_distributed_checkpoint` must be True in LocalSGDFSDPStrategy: the replicas' local models are "
                "saved per rank beside Lightning's distributed checkpoint of the global model"
            )
        self.sync_at_end = check_bool("sync_at_end", sync_at_end)
        super().__init__(
            compressor=resolved,
            shard_size=shard_size,
            shard_modules=shard_modules,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
            start_step=0,
            min_numel=min_numel,
            compress_1d=compress_1d,
            beta=beta,
            seed=seed,
            timeout=timeout,
            start_method=start_method,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
        )
        self._engine: Optional[OuterSync] = None
        self._intra_stats = CommStats()
        self._aux_stats = CommStats()
        self._eval_backup: Optional[dict[str, Tensor]] = None
        self._restored: Optional[dict[str, Any]] = None  # DivergentReplicas' per-rank model: never used here
        self._pending_state: Optional[dict[str, Any]] = None

    # ------------------------------------------------------------------ public state
    per_step_reduction = False  # the replicas meet every `local_steps` steps: the guard leaves it alone, as LocalSGD

    @property
    def hook(self) -> Optional[OuterSync]:
        """This rank's sync engine (of its shards), shaped like GradCompStrategy's hook for ``CompressionLogger``."""
        return self._engine

    @property
    @override
    def comm_stats(self) -> CommStats:
        """``wire_bytes`` across replicas (the syncs), ``dense_bytes`` per-step HSDP's across replicas over the same
        ``steps``, ``intra_bytes`` FSDP2's inside the shard group."""
        if self._engine is None:
            return CommStats()
        stats = self._engine.stats
        stats.intra_bytes = self._intra_stats.intra_bytes
        return stats

    @property
    def aux_comm_stats(self) -> CommStats:
        """Traffic outside syncs: the start broadcast across replicas."""
        return self._aux_stats

    @property
    @override
    def error_feedback(self) -> Optional[ErrorFeedback]:
        """This rank's error-feedback memory of its shards' pseudo-gradients."""
        return self._engine.memory if self._engine is not None else None

    @property
    def sync_period(self) -> int:
        """Optimizer steps between two syncs (of consecutive fragments): ``local_steps / fragments``."""
        return self.local_steps // self.fragments

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self._layer_sync is not None:
            raise ValueError(
                "LocalSGDFSDPStrategy does not support `sync_batchnorm=True`: replicas train alone between syncs"
            )
        super().setup(trainer)

    @override
    def _install(self) -> None:
        """Count FSDP2's traffic (no replica reduction), give every replica replica 0's shards, build the engine."""
        assert self.model is not None and self.lightning_module is not None
        group = replicate_group(self._shard_size(), self._timeout)  # collective: every rank, every fit
        self._intra_stats = CommStats()
        count_shard_traffic(self.model, self._intra_stats)
        self._broadcast_start(group)
        compressor = self.compressor.clone()
        if self.num_replicas == 1 and not compressor.dense:
            rank_zero_info("LocalSGDFSDPStrategy: one replica has nothing to send: pseudo-gradients are not compressed")
            compressor = NoCompression()
        compressor.prepare()
        self._engine = OuterSync(
            compressor,
            Comm(group, CommStats()),
            self._params(),
            self._buffers(),
            fragments=self.fragments,
            policy=self.policy,
            outer=self.outer,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            seed=self.seed,
            beta=self.beta,
        )
        if self._pending_state is not None:
            self._restore(self._pending_state)
            self._pending_state = None

    def _params(self) -> list[tuple[str, Tensor]]:
        return [(n, _local(p)) for n, p in self.lightning_module.named_parameters() if p.requires_grad]

    def _buffers(self) -> list[tuple[str, Tensor]]:
        persistent = set(self.lightning_module.state_dict())
        buffers = self.lightning_module.named_buffers()
        return [(n, _local(b)) for n, b in buffers if b.is_floating_point() and n in persistent]

    def _bind(self) -> OuterSync:
        """The engine, pointed at the current local shards (FSDP2 may re-point a parameter's local tensor at its
        lazy initialization)."""
        assert self._engine is not None
        self._engine.params = dict(self._params())
        self._engine.buffers = dict(self._buffers())
        return self._engine

    def _broadcast_start(self, group: Any) -> None:
        """Give every rank the shards of replica 0 (group rank 0 of its replicate group): the common start."""
        if self.num_replicas < 2:
            return
        aux = Comm(group, self._aux_stats)
        tensors = [t for _, t in self._params()] + [t for _, t in self._buffers()]
        with torch.no_grad():
            for dtype in sorted({t.dtype for t in tensors}, key=str):
                same = [t for t in tensors if t.dtype == dtype]
                flat = torch.cat([t.detach().reshape(-1) for t in same])
                aux.broadcast(flat, 0)
                offset = 0
                for t in same:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    @override
    def teardown(self) -> None:
        """Destroy the replicate group, then Lightning's teardown."""
        if self._engine is not None:
            release_group(self._engine.comm.group)
        super().teardown()

    # ------------------------------------------------------------------ training
    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The inner step (FSDP2's); then, every ``local_steps / fragments`` steps, a sync (first optimizer only).
        A gradient holding NaN/Inf is zeroed before the inner update (as in LocalSGDStrategy)."""
        if self._engine is not None:
            closure = self._guarded(optimizer, closure, self._engine.note_nonfinite)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._engine is not None and self._is_first_optimizer(optimizer):
            engine = self._bind()
            engine.count_step()
            if engine.local_steps % self.sync_period == 0:
                engine.sync_next()
        return output

    @override
    def _guarded(
        self, optimizer: Optimizer, closure: Callable[[], Any], count: Callable[[Tensor], None]
    ) -> Callable[[], Any]:
        """``closure``, then this rank's gradient shards zeroed when one holds NaN/Inf (judged per rank, on the local
        shards: FSDP2's reduce-scatter already took the value into the shard that holds it)."""
        if getattr(self.precision_plugin, "scaler", None) is not None:
            return closure

        def guarded() -> Any:
            result = closure()
            grads = [_local(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                count(zero_if_nonfinite(grads))
            return result

        return guarded

    def _is_first_optimizer(self, optimizer: Optimizer) -> bool:
        if not self.optimizers:
            return True
        first = self.optimizers[0]
        return getattr(optimizer, "_optimizer", optimizer) is getattr(first, "_optimizer", first)

    def sync_now(self) -> None:
        """Synchronize every fragment now (collective: call on all ranks)."""
        if self._engine is not None:
            self._exit_eval()
            self._bind().sync(list(range(len(self._engine.fragments))))

    @override
    def on_train_end(self) -> None:
        """Leave every rank with the global model: sync the remaining local progress, or load ``theta``."""
        if self._engine is not None:
            self._exit_eval()
            engine = self._bind()
            pending = torch.tensor([float(engine.pending())], device=self.root_device)
            if self.world_size > 1 and dist.is_initialized():
                dist.all_reduce(pending)  # every shard of every replica takes the same branch
            if bool(pending.item() > 0):
                if self.sync_at_end:
                    engine.sync(list(range(len(engine.fragments))))
                else:
                    engine.write(engine.global_tensors())
        super().on_train_end()

    # ------------------------------------------------------------------ evaluation on the global model
    @override
    def _enter_eval(self) -> None:
        if self._engine is None or self._eval_backup is not None:
            return
        engine = self._bind()
        self._eval_backup = engine.local_tensors()
        engine.write(engine.global_tensors())

    @override
    def _exit_eval(self) -> None:
        if self._engine is not None and self._eval_backup is not None:
            self._bind().write(self._eval_backup)
            self._eval_backup = None

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``state_dict``: the **global** model (sharded ``DTensor`` s, copies)."""
        if self._engine is None:
            return super().lightning_module_state_dict()
        engine = self._bind()
        local = engine.local_tensors() if self._eval_backup is None else None
        engine.write(engine.global_tensors())
        try:
            state = super().lightning_module_state_dict()
            return {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in state.items()}
        finally:
            if local is not None:
                engine.write(local)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Lightning's distributed checkpoint of the global model, plus this rank's own state in its shard file
        (``<checkpoint>.gradcomp/rank-0000r-<token>.pt``; the manifest goes into the checkpoint's metadata)."""
        engine = self._engine
        state: dict[str, Any] = {}
        if engine is not None:
            engine = self._bind()
            local = engine.local_tensors() if self._eval_backup is None else dict(self._eval_backup)
            state = {
                "local": local,
                "optimizers": [_local_optimizer_state(o) for o in self.optimizers],
                "shared": engine.shared_state(),
                **engine.rank_state(),
            }
        self._save_with_shards(
            checkpoint,
            filepath,
            storage_options,
            CHECKPOINT_KEY,
            state,
            type(self.compressor).__name__,
            {},
            outer=self.outer,
            local_steps=self.local_steps,
            fragments=self.fragments,
            shard_size=self._shard_size(),
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Lightning's load (the global model and the optimizer shards), then this rank's own state from its shard.

        Raises:
            FileNotFoundError, RuntimeError: a rank's shard is missing or does not match the manifest (every rank
                raises; the message names the file).
            ValueError: the checkpoint was written with other settings, another world size or shard size.
        """
        checkpoint = ModelParallelStrategy.load_checkpoint(self, checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            return checkpoint
        shard_files.check_manifest(saved, CHECKPOINT_KEY)
        mine = (type(self.compressor).__name__, self.outer, self.local_steps, self.fragments)
        theirs = (saved["compressor"], saved["outer"], saved["local_steps"], saved["fragments"])
        if mine != theirs:
            raise ValueError(
                f"cannot resume from '{checkpoint_path}': it was written with (compressor, outer, local_steps, "
                f"fragments) = {theirs}, this strategy uses {mine}; resume with the same settings"
            )
        layout = (self.world_size, self._shard_size())
        if (saved["world_size"], saved["shard_size"]) != layout:
            raise ValueError(
                f"cannot resume from '{checkpoint_path}': it was written by (world size, shard_size) = "
                f"{(saved['world_size'], saved['shard_size'])}, this run has {layout}; the local shards need the "
                f"same layout (load the global model, the checkpoint's state_dict, into a fresh run instead)"
            )
        state = self._load_own_shard(checkpoint_path, saved, weights_only, self.root_device, **_SHARD_WORDS)
        if self._engine is None:
            self._pending_state = state
        else:
            self._restore(state)
        return checkpoint

    def _restore(self, state: dict[str, Any]) -> None:
        """Put this rank's saved state back: local shards, inner optimizer state, outer state, memories."""
        engine = self._bind()
        engine.load_shared_state(state["shared"])
        engine.load_rank_state(state)
        engine.write(state["local"])
        for optimizer, saved in zip(self.optimizers, state["optimizers"]):
            _load_local_optimizer_state(optimizer, saved)

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """The presets at the bottom of this module are registered with Lightning when declared."""


def _optimizer_params(optimizer: Any) -> list[Tensor]:
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    return [p for group in optimizer.param_groups for p in group["params"]]


def _local_optimizer_state(optimizer: Any) -> list[dict[str, Any]]:
    """Each parameter's optimizer state (in parameter order), its tensors as copies of this rank's local shards."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    out = []
    for param in _optimizer_params(optimizer):
        state = inner.state.get(param, {})
        out.append(
            {k: _local(v).detach().clone() if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in state.items()}
        )
    return out


def _load_local_optimizer_state(optimizer: Any, saved: list[dict[str, Any]]) -> None:
    """Write :func:`_local_optimizer_state` back into the optimizer's state (its tensors' local shards)."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    params = _optimizer_params(optimizer)
    if len(params) != len(saved):
        raise ValueError(
            f"the checkpoint holds optimizer state of {len(saved)} parameters, the optimizer has {len(params)}"
        )
    with torch.no_grad():
        for param, entries in zip(params, saved):
            state = inner.state[param]
            for key, value in entries.items():
                current = state.get(key)
                if isinstance(current, Tensor) and isinstance(value, Tensor):
                    _local(current).copy_(value)
                else:
                    state[key] = value


register_preset(
    "diloco_fsdp",
    "DiLoCo on FSDP2 replicas: 20 inner steps sharded inside a node, outer Nesterov on dense shard pseudo-gradients",
    lambda: {"outer": "nesterov", "compressor": NoCompression()},
    strategy=LocalSGDFSDPStrategy,
)
register_preset(
    "diloco_cltk_fsdp",
    "DiLoCo on FSDP2 replicas with CLT-k 1% shard pseudo-gradients and error feedback across nodes",
    lambda: {"outer": "nesterov", "compressor": CLTK(density=0.01)},
    strategy=LocalSGDFSDPStrategy,
)
