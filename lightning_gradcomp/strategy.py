"""GradCompStrategy: Lightning's DDPStrategy with compressed gradient reduction on every device."""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_gradcomp.checks import ArgumentTypeError, check_bool, check_int, check_single_process, check_timeout
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.registry import as_compressor
from lightning_gradcomp.distributed import DEFAULT_TIMEOUT, release_group
from lightning_gradcomp.failures import failure_hint, is_collective_failure
from lightning_gradcomp.functional.selection import prepare_native
from lightning_gradcomp.gradcomp_checkpoints import _PER_RANK_KEYS as _PER_RANK_KEYS
from lightning_gradcomp.gradcomp_checkpoints import CHECKPOINT_KEY, GradCompCheckpoints
from lightning_gradcomp.gradcomp_checks import (
    _check_hierarchy_callbacks,
    _check_hierarchy_combination,
    _check_small_param,
    _warn_unused_without_views,
)
from lightning_gradcomp.gradcomp_groups import GradCompGroups
from lightning_gradcomp.gradcomp_groups import _private_group as _private_group
from lightning_gradcomp.hierarchy import Hierarchy, HierarchySpec, check_hierarchy
from lightning_gradcomp.hook import PYTHON_REDUCER_REFUSAL, GradCompHook, gradcomp_comm_hook
from lightning_gradcomp.memory import ErrorFeedback, LowPassSetting, validate_beta_for
from lightning_gradcomp.plan import SlotPolicy, size_rule
from lightning_gradcomp.presets import PRESETS, UNUSED_SUFFIX, preset_class, register_presets
from lightning_gradcomp.schedule import CompressionSchedule, as_schedule
from lightning_gradcomp.shard_files import load_verified, verify_checkpoint_file

__all__ = [
    "CHECKPOINT_KEY",
    "DEFAULT_TIMEOUT",
    "GradCompStrategy",
    "check_timeout",
    "load_verified",
    "verify_checkpoint_file",
]

log = logging.getLogger(__name__)

_INCOMPATIBLE = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


class GradCompStrategy(LowPassSetting, GradCompCheckpoints, GradCompGroups, DDPStrategy):
    """DDP whose gradient all-reduce is replaced by a compressor, on CPU (gloo) and GPU (NCCL) alike.

    A drop-in replacement for :class:`~lightning.pytorch.strategies.DDPStrategy`, with three defaults of its own:

    * ``timeout``: 10 minutes (DDP's is 30): a collective waiting on a hung rank fails sooner.
    * ``gradient_as_bucket_view=True`` (DDP's is ``False``): gradients are views of DDP's buckets (same numerics).
    * ``single_process="dense"``: on one process (``devices=1``) nothing is communicated, so nothing is compressed:
      the fit is DDP's, bit for bit. ``single_process="compress"`` runs the compressor anyway.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2,
                          strategy=GradCompStrategy(compressor=TopK(density=0.01)))
        trainer.fit(model)
        trainer.strategy.comm_stats.compression_ratio   # on each rank

    Args:
        compressor: a :class:`~lightning_gradcomp.compressors.Compressor` or a registered compressor
            name (``"topk"``...). ``None`` means :class:`NoCompression` (plain DDP numerics).
        start_step: first optimizer step that is compressed; steps before it are all-reduced densely.
            At least 2, because DDP rebuilds its buckets after the first step.
        min_numel: smallest tensor (elements) that is compressed; smaller ones go dense. Default 1024, or 1 for a
            compressor that :attr:`~lightning_gradcomp.compressors.base.Compressor.compresses_small_layers` (the
            fp16/bf16 casts, which then cast every layer, like PyTorch's ``fp16_compress_hook``).
        compress_1d: also compress 1-D tensors (biases, norm weights); default off, on for a compressor that
            ``compresses_small_layers``.
        small_param: compress the tensors that ``min_numel`` / ``compress_1d`` leave out too, with this
            compression parameter (a density such as 0.25 for the sparsifiers, bits for the quantizers) instead
            of all-reducing them dense: on small models they otherwise cap the ratio. ``None``: dense.
        beta: error-feedback low-pass factor in (0, 1] (1 = classic error feedback); below 1 only with a compressor
            that keeps an error-feedback memory (else a ``ValueError``: the filter would change nothing).
        seed: base seed of the compressors' generators (shared and per-rank streams derive from it).
        nonfinite: what happens to a bucket whose gradient holds NaN/Inf on some rank (memories and
            compressor state are never updated from it): ``"dense"`` reduces it densely, as DDP would (use
            with fp16 AMP, whose GradScaler then skips the step; a sparsifier's slots carry the gradients
            recovered from their compensation: NaN/Inf where DDP's have them, the rest within rounding);
            ``"zero"`` zeroes it on every rank, so the step contributes no gradient and training continues.
        schedule: the compression parameter over optimizer steps, e.g. a density warm-up:
            :class:`~lightning_gradcomp.schedule.WarmupSchedule` (``WarmupSchedule(steps=300, start=0.25)``), a
            ``{step: value}`` mapping, or a callable ``step -> value``; per-layer parameters (L-GreCo) follow it
            relative to the compressor's own value. ``None``: the compressor's value at every compressed step.
        layerwise: a callback that tunes per-layer parameters, e.g.
            :class:`~lightning_gradcomp.callbacks.LGreCo`; the strategy keeps a private copy and adds it to
            the Trainer's callbacks itself (so a strategy name can bundle it).
        timeout: process-group timeout, a ``timedelta`` or seconds (> 0); ``None`` uses PyTorch's backend
            default. A collective raises after waiting this long for a rank that hangs (a rank that dies is
            noticed at once). Default :data:`DEFAULT_TIMEOUT` (10 minutes).
        hierarchy: compress only the slow, inter-node hops (:mod:`lightning_gradcomp.hierarchy`): ``None``
            (default) reduces flat over all ranks; ``"node"`` sums each bucket densely over the processes of one
            machine (``devices`` per node) and compresses across machines; an ``int`` ``k`` treats ranks
            ``[0..k-1]``, ``[k..2k-1]``, ... as nodes (it must divide the world size; for tests on one machine).
            Each local rank compresses the layers it owns (a balanced split by size, fixed for the run).
        gradient_as_bucket_view: DDP's argument, ``True`` here (DDP's own default is ``False``; ``None`` also means
            ``True``): the parameters' gradients are views of DDP's buckets, into which the hook writes its averaged
            result, so DDP copies nothing between them (a gradient's worth of memory less; one pass over the
            gradient less per step, two with ``zero_grad(set_to_none=False)``). The numerics are the same.
        single_process: what happens when one process trains (world size 1, e.g. ``devices=1`` while debugging):
            ``"dense"`` (default) passes every gradient through densely, as DDP does (there is no communication to
            save; the fit is bit-identical to ``strategy="ddp"``, and an info line says so); ``"compress"`` runs
            the compressor and its error feedback as on several processes (to test the compression path on one
            device).
        **kwargs: any :class:`~lightning.pytorch.strategies.DDPStrategy` argument, except the comm-hook
            and model-averaging ones, which this strategy replaces. Without ``bucket_cap_mb`` the compressor's
            preferred DDP bucket size is used (:attr:`Compressor.bucket_cap_mb`: 4 MB for the quantizers, DDP's
            25 MB for the others).
    """

    strategy_name = "gradcomp"
    _name_in_messages = "GradCompStrategy"

    def __init__(
        self,
        compressor: Union[Compressor, str, None] = None,
        start_step: int = 2,
        min_numel: Optional[int] = None,
        compress_1d: Optional[bool] = None,
        small_param: Union[int, float, None] = None,
        beta: float = 1.0,
        seed: int = 0,
        nonfinite: str = "dense",
        layerwise: Optional[Callback] = None,
        schedule: Union[CompressionSchedule, dict[int, float], None] = None,
        timeout: Union[timedelta, float, None] = DEFAULT_TIMEOUT,
        hierarchy: HierarchySpec = None,
        gradient_as_bucket_view: Optional[bool] = True,
        single_process: Literal["dense", "compress"] = "dense",
        **kwargs: Any,
    ) -> None:
        for name in _INCOMPATIBLE:
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"`{name}` cannot be combined with GradCompStrategy: it installs its own "
                    f"communication hook; use `compressor=` instead, or plain DDPStrategy"
                )
        self.compressor = as_compressor(compressor)
        self.start_step = check_int("start_step", start_step, 2)
        min_numel, compress_1d = size_rule(self.compressor.compresses_small_layers, min_numel, compress_1d)
        self.policy = SlotPolicy(
            min_numel=check_int("min_numel", min_numel, 1),
            compress_1d=check_bool("compress_1d", compress_1d),
            small_param=_check_small_param(small_param, self.compressor),
        )
        self._beta = validate_beta_for(beta, self.compressor)
        self.schedule = as_schedule(schedule, self.compressor)
        self.seed = check_int("seed", seed, 0, 2**63 - 1)
        if nonfinite not in ("dense", "zero"):
            raise ValueError(f"`nonfinite` must be 'dense' or 'zero', got {nonfinite!r}")
        self.nonfinite = nonfinite
        self.single_process = check_single_process(single_process)
        if layerwise is not None and not isinstance(layerwise, Callback):
            raise ArgumentTypeError(f"`layerwise` must be a Lightning Callback such as LGreCo(...), got {layerwise!r}")
        if layerwise is not None and not self.compressor.tunable:  # known now: fail here, not at the fit's start
            raise ValueError(
                f"`layerwise` tunes per-layer compression parameters, but {self.compressor._not_tunable()}: use "
                "TopK, RandomK, CLTK, QSGD or PowerSGD"
            )
        self.layerwise: Optional[Callback] = copy.deepcopy(layerwise)
        self.hierarchy = _check_hierarchy_combination(check_hierarchy(hierarchy), self.compressor, self.layerwise)
        if kwargs.get("bucket_cap_mb") is None and self.compressor.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.compressor.bucket_cap_mb
        # the hook's result is the bucket: with the gradients as views of it, DDP copies nothing back
        kwargs["gradient_as_bucket_view"] = check_bool(
            "gradient_as_bucket_view", True if gradient_as_bucket_view is None else gradient_as_bucket_view
        )
        if not kwargs["gradient_as_bucket_view"] and kwargs.get("find_unused_parameters"):
            _warn_unused_without_views(self.compressor)
        super().__init__(timeout=check_timeout(timeout), **kwargs)
        self._hook: Optional[GradCompHook] = None
        self._released = False  # the hook's process groups were destroyed at teardown: a later fit makes new ones
        self._pending: Optional[tuple[dict[str, Any], bool]] = None
        self._preset_name: Optional[str] = None  # the preset it was built from (presets._Builder sets it)

    # ------------------------------------------------------------------ public state
    @property
    def hook(self) -> Optional[GradCompHook]:
        """The per-rank hook engine (``None`` before the model is wrapped, in the worker)."""
        return self._hook

    @property
    def comm_stats(self) -> CommStats:
        """This rank's cumulative ``wire_bytes``, ``dense_bytes``, ``steps`` and per-layer figures."""
        return self._hook.stats if self._hook is not None else CommStats()

    @property
    def error_feedback(self) -> Optional[ErrorFeedback]:
        """This rank's error-feedback memory (its ``beta`` is settable at run time)."""
        return self._hook.memory if self._hook is not None else None

    def _memory_owner(self) -> Optional[GradCompHook]:
        return getattr(self, "_hook", None)

    def set_layer_params(self, params: dict[str, Any]) -> None:
        """Override the compression parameter (density / rank / bits) of named layers on this rank.

        Every rank must receive the same dictionary (callbacks decide on one rank and broadcast). Raises ``ValueError``
        for a value outside the compressor's range, or a name that is no parameter of the model (a typo would
        otherwise change nothing, silently).
        """
        checked = {name: self.compressor.check_param(value) for name, value in params.items()}
        if self._hook is None:
            raise RuntimeError("set_layer_params() needs the hook: call it during fit")
        known = set(self._hook.param_names.values())
        unknown = sorted(name for name in checked if name not in known)
        if unknown:
            raise ValueError(
                f"set_layer_params(): {unknown} name no parameter of the model (names as in "
                f"`named_parameters()`, e.g. {sorted(known)[:3]})"
            )
        self._hook.layer_params.update(checked)

    def make_hook(
        self,
        comm: Comm,
        param_names: dict[int, str],
        device: Optional[torch.device] = None,
        hierarchy: Optional[Hierarchy] = None,
        dense_only: bool = False,
    ) -> GradCompHook:
        """Build this strategy's hook engine for one rank: the single place a :class:`GradCompHook` is assembled.

        The strategy itself, ``lightning-gradcomp bench`` and the benchmark scripts all call this, so what is
        benchmarked is what users run. The compressor is a private clone, prepared (e.g. native kernels built)
        here, before any backward pass.

        Args:
            comm: this rank's byte-counting collectives.
            param_names: ``id(parameter) -> qualified name``.
            device: where restored state tensors go (the gradients' device).
            hierarchy: this rank's node/cross-node groups (:meth:`Hierarchy.create`), or ``None`` (flat).
            dense_only: reduce every bucket densely, as DDP does (a fit on one process with
                ``single_process="dense"``); the default compresses at every world size, W = 1 included.
        """
        compressor = self.compressor.clone()
        compressor.prepare()
        prepare_native()  # the engine's NaN/Inf scan of every compressed bucket runs in the compiled kernel too
        hook = GradCompHook(
            compressor,
            comm,
            param_names,
            start_step=self.start_step,
            policy=self.policy,
            seed=self.seed,
            beta=self.beta,
            device=device,
            nonfinite=self.nonfinite,
            schedule=self.schedule,
            hierarchy=hierarchy,
            dense_only=dense_only,
        )
        hook.loss_scale = self._loss_scale
        return hook

    def bind_hook(self, hook: GradCompHook) -> None:
        """Make ``hook`` this strategy's engine (what a fit does; the bench, which has no Trainer, calls it)."""
        self._hook = hook

    def _loss_scale(self) -> Optional[torch.Tensor]:
        """The fp16 AMP GradScaler's current scale (a one-element tensor, read without a host sync), if any."""
        scaler = getattr(self._precision_plugin, "scaler", None)
        if scaler is None or not getattr(scaler, "_enabled", False):
            return None
        return getattr(scaler, "_scale", None)

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def connect(self, model: Any) -> None:
        """Attach the model, and add the ``layerwise`` callback to its Trainer (once)."""
        super().connect(model)
        trainer = getattr(model, "_trainer", None)
        if self.layerwise is None or trainer is None or any(cb is self.layerwise for cb in trainer.callbacks):
            return
        if any(type(cb) is type(self.layerwise) for cb in trainer.callbacks):
            raise ValueError(
                f"GradCompStrategy(layerwise={type(self.layerwise).__name__}(...)) and a "
                f"{type(self.layerwise).__name__} in Trainer(callbacks=...) cannot be combined: use one"
            )
        trainer.callbacks.append(self.layerwise)

    @override
    def setup(self, trainer: Any) -> None:
        """DDP's setup, then attach the hook to every optimizer: state is committed by optimizer steps."""
        if self.hierarchy is not None:
            _check_hierarchy_callbacks(trainer.callbacks)
        super().setup(trainer)
        if self._hook is not None:
            for optimizer in self.optimizers:
                self._hook.attach_optimizer(optimizer)

    @override
    def teardown(self) -> None:
        """Stop the hook's communication thread and destroy its process groups, then DDP's teardown.

        The hook and its state stay: a later ``fit`` with this strategy gives it new groups. Groups whose thread did
        not stop (a collective stuck on a rank that stopped responding) are left alone."""
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

    @override
    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Step as DDPStrategy does; when the optimizer skipped the step (fp16 AMP's GradScaler found NaN/Inf), the
        state staged by the backward passes it would have consumed is dropped (:meth:`GradCompHook.drop_unstepped`).
        """
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._hook is not None and self._hook.unstepped:
            self._hook.drop_unstepped()
        return result

    @override
    def _register_ddp_hooks(self) -> None:
        """Register the compression hook on every device (Lightning itself only does so on CUDA)."""
        assert isinstance(self.model, DistributedDataParallel)
        if getattr(self.model, "_use_python_reducer", False):
            raise ValueError(f"GradCompStrategy: {PYTHON_REDUCER_REFUSAL}")
        if self._hook is None:
            assert self.lightning_module is not None
            names = {id(p): n for n, p in self.lightning_module.named_parameters()}
            comm, hierarchy = self._new_groups(CommStats())
            dense_only = self.world_size == 1 and self.single_process == "dense"
            if dense_only:
                rank_zero_info(
                    "GradCompStrategy: one process (world size 1) has no gradient communication to compress: "
                    "gradients pass through densely, as with DDP. single_process='compress' runs the compressor"
                )
            self._hook = self.make_hook(comm, names, self.root_device, hierarchy, dense_only=dense_only)
            if self._pending is not None:
                state, per_rank = self._pending
                self._hook.load_state_dict(state, per_rank=per_rank)
                self._pending = None
        elif self._released:  # a later fit with this strategy: the hook keeps its state, on new groups
            self._hook.comm, self._hook.hierarchy = self._new_groups(self._hook.stats)
        self._released = False
        self.model.register_comm_hook(self._hook, gradcomp_comm_hook)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Say what a failed collective most likely means (a rank died or hung) in front of its message
        (:func:`~lightning_gradcomp.failures.failure_hint`); for DDP's unused-parameter error, point to
        ``find_unused_parameters=True`` and the preset's ``_find_unused_parameters_true`` variant (not plain DDP)."""
        super().on_exception(exception)
        if _is_unused_parameter_error(exception):
            exception.args = (self._unused_parameters_hint(), *exception.args[1:])
            return
        if not is_collective_failure(exception) or not exception.args or not isinstance(exception.args[0], str):
            return
        if exception.args[0].startswith("GradCompStrategy"):
            return
        hint = failure_hint(
            "GradCompStrategy", self.global_rank, self.world_size, getattr(self, "_timeout", None), exception
        )
        exception.args = (hint, *exception.args[1:])

    def _unused_parameters_hint(self) -> str:
        """What to do about DDP's unused-parameter error without leaving compression (Lightning's own hint,
        ``strategy='ddp_find_unused_parameters_true'``, trains plain DDP)."""
        preset = f"'{self._preset_name}{UNUSED_SUFFIX}'" if self._preset_name else f"'<preset>{UNUSED_SUFFIX}'"
        return (
            "GradCompStrategy: your LightningModule has parameters that were not used in producing the loss "
            "returned by training_step. If this is intentional, enable DDP's detection of unused parameters and "
            f"keep compressing: `strategy={preset}` (every preset has this variant) or "
            "`GradCompStrategy(..., find_unused_parameters=True)`. (Lightning's `strategy='ddp_find_unused_parameters_"
            "true'` would train without compression.)"
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Re-register this class's presets (+ ``_spawn``/``_fork``); declaring one already registers it.

        Idempotent; see :mod:`lightning_gradcomp.presets`. On a subclass that declares no preset of its own this
        keeps the old behaviour (every ``GradCompStrategy`` preset re-registered to build the subclass), with a
        ``DeprecationWarning``: declare the subclass's names with ``register_preset(..., strategy=Subclass)``.
        """
        if cls is not GradCompStrategy and not any(preset_class(name) is cls for name in PRESETS):
            warnings.warn(
                f"{cls.__name__}.register_strategies() re-registers every GradCompStrategy preset to build "
                f"{cls.__name__}; this is deprecated: declare its names with "
                f"register_preset(name, description, factory, strategy={cls.__name__})",
                DeprecationWarning,
                stacklevel=2,
            )
            register_presets(strategy_registry, cls, declared_for=GradCompStrategy)
            return
        register_presets(strategy_registry, cls)


_UNUSED_MESSAGES = (
    "Expected to have finished reduction in the prior iteration",  # torch's DDP
    "It looks like your LightningModule has parameters that were not used",  # Lightning's rewrite of it
)


def _is_unused_parameter_error(exception: BaseException) -> bool:
    """DDP's error for a parameter that got no gradient (``find_unused_parameters=False``), or Lightning's version."""
    first = exception.args[0] if exception.args else None
    return isinstance(first, str) and any(text in first for text in _UNUSED_MESSAGES)
