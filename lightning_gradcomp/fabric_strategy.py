"""GradCompFabricStrategy: the compression hook of :class:`~lightning_gradcomp.GradCompStrategy` under Lightning Fabric.

Fabric's own ``DDPStrategy`` has no communication-hook support at all. This subclass registers the same
:class:`~lightning_gradcomp.hook.GradCompHook` that the Trainer's strategy builds (through
:meth:`GradCompStrategy.make_hook <lightning_gradcomp.GradCompStrategy.make_hook>`, from the same validated
settings) on the ``DistributedDataParallel`` that ``fabric.setup`` creates, attaches the optimizers given to
``fabric.setup`` / ``fabric.setup_optimizers`` (staged state commits at ``optimizer.step()``), and saves each rank's
compression state with ``fabric.save`` (per-rank shards next to the file, as the Trainer does) and restores it with
``fabric.load``.

Importing :mod:`lightning_gradcomp` registers every preset that builds a ``GradCompStrategy`` (``"scalecom"``,
``"gradcomp_topk"``..., with their ``_spawn`` / ``_fork`` / ``_find_unused_parameters_true`` variants) in Fabric's
``STRATEGY_REGISTRY`` too, so ``Fabric(strategy="scalecom")`` works; presets declared later follow
(:func:`~lightning_gradcomp.presets.on_declare`). Presets of other strategy classes (``localsgd``, ``diloco``,
``swarmsgd``) change the training loop itself and have no Fabric counterpart.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union, cast

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp import shard_files
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.distributed import release_group
from lightning_gradcomp.functional.realview import real_view_numel
from lightning_gradcomp.gradcomp_checkpoints import _PER_RANK_KEYS, CHECKPOINT_KEY
from lightning_gradcomp.gradcomp_groups import _private_group
from lightning_gradcomp.hierarchy import Hierarchy, HierarchyLayout, group_size_for
from lightning_gradcomp.hook import PYTHON_REDUCER_REFUSAL, GradCompHook, gradcomp_comm_hook
from lightning_gradcomp.memory import ErrorFeedback
from lightning_gradcomp.presets import UNUSED_SUFFIX, on_declare, preset_class, register_presets
from lightning_gradcomp.sharded_checkpoints import ShardedCheckpoints
from lightning_gradcomp.strategy import GradCompStrategy

__all__ = ["GradCompFabricStrategy"]

_FABRIC_ARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision")


class GradCompFabricStrategy(ShardedCheckpoints, DDPStrategy):
    """Fabric's ``DDPStrategy`` whose gradient all-reduce is replaced by a compressor, as in ``GradCompStrategy``.

    Example::

        fabric = Fabric(accelerator="cpu", devices=2, strategy="scalecom")   # or GradCompFabricStrategy(...)
        fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)
        ...
        fabric.backward(loss)
        optimizer.step()                       # commits this step's compression state
        fabric.strategy.comm_stats.wire_bytes  # on each rank

    Args:
        compressor: as for :class:`~lightning_gradcomp.GradCompStrategy`.
        start_method: ``"popen"`` (default), ``"spawn"``, ``"fork"`` or ``"forkserver"``, as for Fabric's
            ``DDPStrategy``.
        **kwargs: every other argument of :class:`~lightning_gradcomp.GradCompStrategy` (``start_step``, ``beta``,
            ``seed``, ``nonfinite``, ``schedule``, ``timeout``, ``hierarchy``, ``single_process``, DDP's
            ``bucket_cap_mb``, ``find_unused_parameters``...), checked the same way, and Fabric's
            ``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``, ``precision``,
            ``process_group_backend``. Not ``layerwise``: the per-layer tuning callbacks (L-GreCo) are Trainer
            callbacks, and Fabric has no Trainer to run them.

    One model per strategy: the hook belongs to the first module set up; setting up a second one raises.
    """

    _name_in_messages = "GradCompFabricStrategy"

    def __init__(
        self,
        compressor: Union[Compressor, str, None] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        if kwargs.get("layerwise") is not None:
            raise ValueError(
                f"GradCompFabricStrategy: `layerwise={type(kwargs['layerwise']).__name__}(...)` is a Trainer callback "
                "and Fabric has no Trainer to run it; use Trainer(strategy=...) for per-layer tuning, or leave "
                "`layerwise` out (the compressor's own parameter is used for every layer)"
            )
        fabric = {name: kwargs.pop(name) for name in _FABRIC_ARGS if name in kwargs}
        backend = kwargs.pop("process_group_backend", None)
        self.settings = GradCompStrategy(compressor, **kwargs)
        """The compression settings, checked as for the Trainer, and the builder of the hook (``make_hook``)."""
        super().__init__(
            process_group_backend=backend,
            timeout=self.settings._timeout,
            start_method=start_method,
            **fabric,
            **self.settings._ddp_kwargs,
        )
        self._hook: Optional[GradCompHook] = None
        self._ddp: Optional[DistributedDataParallel] = None
        self._waiting: list[Optimizer] = []  # optimizers set up before the module: attached when the hook exists
        self._pending: Optional[tuple[dict[str, Any], bool]] = None  # state loaded before the hook exists
        self._released = False
        self._preset_name: Optional[str] = None  # the preset it was built from (presets._Builder sets it)

    # ------------------------------------------------------------------ public state
    @property
    def compressor(self) -> Compressor:
        """The compressor as configured (the hook holds its own prepared clone)."""
        return self.settings.compressor

    @property
    def hook(self) -> Optional[GradCompHook]:
        """This rank's hook engine (``None`` before ``fabric.setup``)."""
        return self._hook

    @property
    def comm_stats(self) -> CommStats:
        """This rank's cumulative ``wire_bytes``, ``dense_bytes``, ``steps`` and per-layer figures."""
        return self._hook.stats if self._hook is not None else CommStats()

    @property
    def error_feedback(self) -> Optional[ErrorFeedback]:
        """This rank's error-feedback memory."""
        return self._hook.memory if self._hook is not None else None

    def set_beta(self, beta: float) -> None:
        """Set the memory low-pass factor from now on (:meth:`GradCompStrategy.set_beta`)."""
        self.settings.set_beta(beta)

    def set_layer_params(self, params: dict[str, Any]) -> None:
        """Override named layers' compression parameters on this rank (:meth:`GradCompStrategy.set_layer_params`)."""
        self.settings.set_layer_params(params)

    # ------------------------------------------------------------------ Fabric hooks
    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        """Wrap ``module`` in DDP (Fabric's own step), then build this rank's hook and register it."""
        if self._ddp is not None:
            raise ValueError(
                "GradCompFabricStrategy compresses the gradients of one model; a second `fabric.setup` of a model "
                "needs a Fabric of its own (or wrap both models in one nn.Module)"
            )
        ddp = super().setup_module(module)
        if getattr(ddp, "_use_python_reducer", False):
            raise ValueError(f"GradCompFabricStrategy: {PYTHON_REDUCER_REFUSAL}")
        names = {id(p): n for n, p in module.named_parameters()}
        comm, hierarchy = self._new_groups(ddp, module)
        dense_only = self.world_size == 1 and self.settings.single_process == "dense"
        if dense_only:
            rank_zero_info(
                "GradCompFabricStrategy: one process (world size 1) has no gradient communication to compress: "
                "gradients pass through densely, as with DDP. single_process='compress' runs the compressor"
            )
        self._hook = self.settings.make_hook(comm, names, self.root_device, hierarchy, dense_only=dense_only)
        self._hook.loss_scale = self._loss_scale
        self.settings.bind_hook(self._hook)
        if self._pending is not None:
            self._hook.load_state_dict(*self._pending)
            self._pending = None
        for optimizer in self._waiting:
            self._hook.attach_optimizer(optimizer)
        self._waiting.clear()
        ddp.register_comm_hook(self._hook, gradcomp_comm_hook)
        self._ddp = ddp
        return ddp

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Attach ``optimizer`` to the hook: its ``step()`` commits the state staged by the backward passes."""
        optimizer = super().setup_optimizer(optimizer)
        if self._hook is not None:
            self._hook.attach_optimizer(optimizer)
        else:
            self._waiting.append(optimizer)
        return optimizer

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step as Fabric does; when the optimizer skipped the step (fp16 AMP's GradScaler found NaN/Inf), the state
        staged for it is dropped (:meth:`GradCompHook.drop_unstepped`)."""
        result = super().optimizer_step(optimizer, **kwargs)
        if self._hook is not None and self._hook.unstepped:
            self._hook.drop_unstepped()
        return result

    @override
    def teardown(self) -> None:
        """Stop the hook's communication thread and destroy its process groups, then Fabric's teardown.

        Fabric does not call this itself; call ``fabric.strategy.teardown()`` to release the groups before the
        process ends (a process that trains many models in turn). Groups whose thread did not stop are left alone."""
        if self._hook is not None and self._hook.close() and not self._released:
            hierarchy = self._hook.hierarchy
            groups = [
                self._hook.comm.group,
                *(() if hierarchy is None else (hierarchy.intra.group, hierarchy.cross.group)),
            ]
            for group in groups:
                release_group(group)
            self._released = True
        super().teardown()

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Any]] = None,
    ) -> None:
        """Save ``state`` (rank 0's file) and this rank's compression state (its shard next to ``path``).

        Every rank must call it (``fabric.save`` does). The file gets the shard manifest under ``"gradcomp"``, as
        the Trainer's checkpoints do; see :mod:`lightning_gradcomp.shard_files`.
        """
        checkpoint = self._convert_stateful_objects_in_state(state, filter=filter or {})
        hook_state = self._hook.state_dict() if self._hook is not None else {}
        replicated = {key: value for key, value in hook_state.items() if key not in _PER_RANK_KEYS}
        compressor = type(self.compressor).__name__
        self._save_with_shards(checkpoint, path, storage_options, CHECKPOINT_KEY, hook_state, compressor, replicated)

    def _write_file(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any]) -> None:
        """Rank 0 writes the file: atomically through the default ``TorchCheckpointIO``, else through the plugin."""
        if type(self.checkpoint_io) is TorchCheckpointIO and storage_options is None:
            super()._write_file(checkpoint, filepath, storage_options)
        elif self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint=checkpoint, path=filepath, storage_options=storage_options)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Optional[Union[Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore ``state`` as Fabric does, and this rank's compression state from its shard.

        Every rank must call it (``fabric.load`` does). The compression state goes into the hook, or waits for it
        when the model is set up later. With another number of ranks only the replicated part (step counter,
        per-layer parameters) is kept, with a warning, as for the Trainer.

        Raises:
            RuntimeError: the file fails its CRC check; a shard does not match the manifest (every rank raises).
            FileNotFoundError: a shard is missing.
            ValueError: the checkpoint was written with another compressor, or its ``"gradcomp"`` entry is malformed.
        """
        shard_files.verify_checkpoint_file(path)
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        saved = remainder.pop(CHECKPOINT_KEY, None) if isinstance(remainder, dict) else None
        if saved is None:
            if self._hook is not None and isinstance(state, dict):
                rank_zero_warn(
                    f"GradCompFabricStrategy: '{path}' has no {CHECKPOINT_KEY!r} entry (not written by "
                    "fabric.save with this strategy): compression state starts fresh"
                )
            return remainder
        restored = self._select_state(path, saved, weights_only)
        if self._hook is not None:
            self._hook.load_state_dict(*restored)
        else:
            self._pending = restored
        return remainder

    def _select_state(self, path: Any, saved: Any, weights_only: Optional[bool]) -> tuple[dict[str, Any], bool]:
        """This rank's ``(state, per_rank)`` from a ``"gradcomp"`` manifest (reads this rank's shard)."""
        try:
            shard_files.check_manifest(saved)
        except ValueError as err:
            raise ValueError(f"cannot resume from '{path}': {err}") from None
        ours = type(self.compressor).__name__
        if saved["compressor"] != ours:
            raise ValueError(
                f"cannot resume from '{path}': it was written with compressor {saved['compressor']}, but this "
                f"strategy uses {ours}; resume with the same compressor or start a new run"
            )
        if saved["world_size"] != self.world_size:
            rank_zero_warn(
                f"GradCompFabricStrategy: '{path}' was written by {saved['world_size']} ranks, resuming on "
                f"{self.world_size}: per-rank state (error-feedback memories, compressor state) is reset; the step "
                "counter and per-layer parameters are kept"
            )
            return saved["replicated"], False
        return self._load_own_shard(path, saved, weights_only), True

    # ------------------------------------------------------------------ helpers
    def _new_groups(self, ddp: DistributedDataParallel, module: Module) -> tuple[Comm, Optional[Hierarchy]]:
        """The hook's collectives on a private group of DDP's ranks, and (``hierarchy=``) its node groups."""
        stats = CommStats()
        hierarchy = None
        if self.settings.hierarchy is not None:
            size = group_size_for(self.settings.hierarchy, self.world_size, self.num_processes)
            numels = {n: real_view_numel(p) for n, p in module.named_parameters() if p.requires_grad}
            layout = HierarchyLayout(self.world_size, size)
            hierarchy = Hierarchy.create(layout, self.global_rank, numels, stats, self._timeout)
        return Comm(_private_group(ddp.process_group, self._timeout), stats), hierarchy

    def _loss_scale(self) -> Optional[torch.Tensor]:
        """The fp16 AMP GradScaler's current scale (a one-element tensor, read without a host sync), if any."""
        scaler = getattr(self.precision, "scaler", None)
        if scaler is None or not getattr(scaler, "_enabled", False):
            return None
        return getattr(scaler, "_scale", None)


def _variants(name: str) -> list[str]:
    return [name + suffix + unused for suffix in ("", "_spawn", "_fork") for unused in ("", UNUSED_SUFFIX)]


def _follow_preset(name: str) -> None:
    """Keep Fabric's registry in step with preset ``name``: registered when it builds a ``GradCompStrategy``."""
    if preset_class(name) is GradCompStrategy:
        register_presets(STRATEGY_REGISTRY, cast(Any, GradCompFabricStrategy), declared_for=GradCompStrategy)
        return
    for variant in _variants(name):  # re-declared for another class: not a Fabric name any more
        if variant in STRATEGY_REGISTRY:
            STRATEGY_REGISTRY.remove(variant)


on_declare(_follow_preset)
