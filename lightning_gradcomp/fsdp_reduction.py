"""The FSDP2 front-end of the reduction pipeline: an all-reduce hook per ``FSDPModule`` that averages the module's
reduce-scatter output over the replicas through :class:`~lightning_gradcomp.reduction.GradientReduction`.

HSDP the way this module builds it: every replica of the model is sharded with ``fully_shard`` over a *shard group*
(fast links, usually one node) on a 1-D mesh; the replicas are joined by a *replicate group* (slow links) that FSDP2
itself knows nothing of. FSDP2 reduce-scatters each module's gradients over the shard group and hands the result to
the module's all-reduce hook (``FSDPModule.set_all_reduce_hook``), which averages it over the replicate group
here, compressed: the same pipeline (plan, error feedback, compressor, non-finite policy, byte accounting) and the
same :class:`~lightning_gradcomp.step_transaction.StepTransaction` as the DDP hook. A rank's error-feedback memory
and compressor state belong to its own shard.

What ``set_all_reduce_hook`` passes, measured with torch 2.13 (CPU, gloo; 4 processes as 2 replicas x 2 shards, a
scratch probe of ``fully_shard`` on ``Linear(5, 7) -> Linear(7, 3)``, each layer and the root sharded):

* one **flat, contiguous** tensor per call: the reduce-scatter output of the module's one parameter group, in the
  reduce dtype (``float32`` under ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``;
  the parameters' dtype without a policy). It is FSDP2's own buffer, not a copy: the hook writes its result into
  it in place, and FSDP2 then views it as the sharded gradients (``.grad`` of the ``DTensor`` parameters).
* it holds the **mean over the shard group** (FSDP2 reduce-scatters fp32 and bf16 with ``ReduceOp.AVG``); after a
  1-D mesh FSDP2 does no all-reduce of its own, so averaging over the replicas gives the global mean.
* layout: the module's parameters in registration order, each taking ``padded_sharded_param_size`` elements (FSDP2
  shards dim 0 in ``torch.chunk`` pieces of ``ceil(rows / S)`` rows): this rank's rows first (``sharded_size``,
  possibly fewer rows, possibly none), then zero padding. ``Linear(5, 7)`` over S = 2 gives 24 elements: rank 0 of
  the shard group holds ``weight[0:4]`` (20) and ``bias[0:4]`` (4), rank 1 ``weight[4:7]`` (15), 5 padding,
  ``bias[4:7]`` (3), 1 padding. Only parameters that received a gradient are laid out: the adapter asks FSDP2 to
  reduce-scatter unused ones too (``set_reduce_scatter_unused_params(True)``), so the layout is fixed; frozen
  parameters (``requires_grad=False``) are never in it (the plan follows ``requires_grad``). A sharded module that
  did not run in forward gets no post-backward at all: no hook call, no collective, its ``.grad`` stays ``None``.
* order: the modules fire in backward order (the last layer first), the same on every rank; a module without
  parameters of its own (a root that only holds sharded children) has no parameter group and never fires. All
  hooks of a backward pass run on the autograd thread before the autograd engine's final callbacks, and FSDP2's
  root callback (queued before the first hook) runs before one the first hook queues.
* with FSDP2's *native* HSDP (a 2-D mesh) the hook runs **after** the built-in all-reduce, so it cannot replace
  it: this adapter refuses such modules.

The hook runs nothing of the pipeline itself: it hands the module's reduction to the process's
:class:`~lightning_gradcomp.commthread.CommThread` (as the DDP hook does), which issues the replica collectives in
module order, the same on every rank (the gloo rule of docs/design.md: no Future callback issues one), and reads the
non-finite decision there, never on the autograd thread. Whether the hook may return before that job is done depends
on what FSDP2 does with the buffer once the hook returns; measured with the probe above (a marker written into the
buffer after ``backward()`` returned, then read from the sharded ``.grad``):

* fp32 parameters, no policy: ``.grad`` views the buffer (the marker shows): the hook **overlaps**;
* ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: views: **overlaps**;
* accumulation with ``set_requires_gradient_sync(False)`` steps, then the sync step (``.grad`` was ``None``): views:
  **overlaps**;
* a ``reduce_dtype`` other than the parameters' dtype (bf16 on fp32 parameters): FSDP2 casts a copy right after the
  hook (the marker does not show): the hook **waits**;
* a sync step onto a ``.grad`` kept from an earlier one (accumulation without ``no_sync``): FSDP2 adds the buffer to
  it right after the hook (``.grad += buffer``; the marker does not show): the hook **waits**.

The hook checks these conditions per call (:func:`_grads_view`: reduce dtype == parameter dtype, no ``.grad`` yet, no
CPU offload, no post-accumulate-grad hook, no post-division by FSDP2); where they hold it returns at once and the
reduction overlaps the rest of backward, otherwise it waits for the job (on the thread's Future: no device value is
read on the autograd thread either way). Every pending job is waited for in a callback the first hook queues on the
autograd engine, which runs after FSDP2's own final callback: ``backward()`` returns with every gradient reduced,
before clipping and the optimizer step read them, as with DDP.

Byte accounting: the pipeline counts the replica collectives (``wire_bytes``, against ``dense_bytes``: the fp32 or
reduce-dtype all-reduce of the reduce-scatter output that native HSDP would send); the hook adds the shard group's
collectives to ``intra_bytes`` by the formulas of :mod:`lightning_gradcomp.comm`: the reduce-scatter, ``(S - 1)``
times the output's bytes, and the all-gathers of the module's parameters, ``(S - 1)`` times the padded shard's bytes
in the all-gather dtype, once for forward and once more for backward when the module reshards after forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.futures import Future

from lightning_gradcomp.comm import Comm, CommStats, all_gather_bytes
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.front_end import PipelineFrontEnd
from lightning_gradcomp.plan import BucketPlan, LayerSlot, SlotPolicy
from lightning_gradcomp.resident import resident_nbytes
from lightning_gradcomp.schedule import CompressionSchedule

__all__ = [
    "FSDPReplicaReduction",
    "ShardLayout",
    "count_shard_group",
    "count_shard_traffic",
    "fsdp_modules",
    "replicate_group",
    "shard_plan",
]


@dataclass(frozen=True)
class ShardLayout:
    """One parameter's place in an FSDP2 reduce-scatter output.

    Attributes:
        name: the parameter's qualified name.
        shape: this rank's shard (``sharded_size``: rows of dim 0, possibly none).
        padded_numel: elements the parameter takes in the output (its padded shard).
    """

    name: str
    shape: tuple[int, ...]
    padded_numel: int


def shard_plan(
    index: int,
    layout: Sequence[ShardLayout],
    policy: SlotPolicy,
    accepts: Callable[[LayerSlot], bool] = lambda slot: True,
) -> BucketPlan:
    """The layer plan of one reduce-scatter output: one slot per parameter's local shard, at the start of its padded
    piece (the padding belongs to no slot).

    The size rule judges the shard's own shape (what is compressed); ranks of one replicate group hold the same shard
    index, hence the same shapes and the same plan.

    Example::

        >>> plan = shard_plan(0, [ShardLayout("w", (3, 5), 20), ShardLayout("b", (3,), 4)], SlotPolicy(min_numel=8))
        >>> [(s.name, s.offset, s.numel, s.compressed) for s in plan.slots], plan.numel
        ([('w', 0, 15, True), ('b', 20, 3, False)], 24)
    """
    slots: list[LayerSlot] = []
    offset = 0
    for piece in layout:
        slot = LayerSlot(piece.name, offset, piece.shape, compressed=False)
        if slot.numel > 0 and policy.wants(piece.shape) and accepts(slot):
            slot = LayerSlot(piece.name, offset, piece.shape, compressed=True)
        elif policy.small_param is not None and slot.numel > 0 and accepts(slot):
            slot = LayerSlot(piece.name, offset, piece.shape, compressed=True, small=True)
        slots.append(slot)
        offset += piece.padded_numel
    return BucketPlan(index=index, numel=offset, slots=tuple(slots))


def fsdp_modules(model: nn.Module) -> list[Any]:
    """The ``FSDPModule`` s of ``model`` (``fully_shard`` applied), in ``modules()`` order."""
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def replicate_group(shard_size: int, timeout: Optional[timedelta] = None) -> Any:
    """A new process group of the ranks holding this rank's shard index (``rank % shard_size``), for the replica
    reduction alone; every rank must call it (it creates one group per shard index, in order).

    Ranks ``r * shard_size + s`` form replica ``r``'s shard group; the replicate group of shard index ``s`` is
    ``[s, s + shard_size, s + 2 shard_size, ...]``, the layout of a ``("replicate", "shard")`` device mesh.
    ``timeout``: the groups' timeout (``None``: the backend's default).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if shard_size < 1 or world % shard_size:
        raise ValueError(f"shard_size must divide the world size {world}, got {shard_size}")
    mine = None
    for index in range(shard_size):
        group = dist.new_group(list(range(index, world, shard_size)), timeout=timeout)
        if rank % shard_size == index:
            mine = group
    return mine


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _param_group(module: Any) -> Optional[Any]:
    """The module's one FSDP2 parameter group (``None`` when it holds no parameters of its own)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise ValueError(
            f"{type(module).__name__}: FSDP2 gave it {len(groups)} parameter groups (a per-parameter mesh from "
            "shard_placement_fn); the compressed replica reduction needs one group per module"
        )
    return groups[0] if groups else None


def _grads_view(group: Any, output: Tensor) -> bool:
    """Whether FSDP2 takes ``output`` as the sharded gradients themselves once the hook returns (views, no copy, no
    read), so that the hook may finish writing it later (the measured table of the module docstring): the reduce dtype
    is the parameters' dtype, FSDP2 does not divide the buffer after the hook, and no reduced parameter holds a
    ``.grad`` to add to, is offloaded to the CPU or has a post-accumulate-grad hook."""
    # FSDP2's private attributes (torch 2.13); where one is missing (another torch), wait: the safe answer
    fsdp_params = getattr(group, "fsdp_params", None)
    if not fsdp_params:
        return False
    if getattr(group, "force_sum_reduction_for_comms", True) or output.dtype not in (torch.float32, torch.bfloat16):
        return False  # FSDP2 post-divides the buffer (or sums without dividing): its values are read at once
    for fsdp_param in fsdp_params:
        param = getattr(fsdp_param, "sharded_param", None)
        if param is None:
            return False
        if not param.requires_grad:
            continue
        if (
            param.grad is not None
            or param.dtype != output.dtype
            or getattr(fsdp_param, "offload_to_cpu", True)
            or getattr(param, "_post_accumulate_grad_hooks", None)
        ):
            return False
    return True


def _refuse_native_hsdp(module: Any, group: Any) -> None:
    if type(group.mesh_info).__name__ == "HSDPMeshInfo":
        raise ValueError(
            f"{type(module).__name__} is sharded on a 2-D mesh (FSDP2's native HSDP), whose own all-reduce "
            "runs before the hook: shard it with fully_shard(mesh=device_mesh['shard']) instead"
        )


def count_shard_group(stats: CommStats, group: Any, output: Tensor) -> None:
    """Add the shard group's collectives of one module's backward to ``stats.intra_bytes`` (by the formulas of
    :mod:`lightning_gradcomp.comm`, not measured): the reduce-scatter that produced ``output``, and the all-gathers
    of the module's parameters (forward, and backward again when the module reshards after forward)."""
    size = group.mesh_info.shard_mesh_size
    if size <= 1:
        return
    stats.add_intra(all_gather_bytes(output.numel() * output.element_size(), size))  # the reduce-scatter
    dtype = group.mp_policy.param_dtype or group.fsdp_params[0].sharded_param.dtype
    numel = 0
    for fsdp_param in group.fsdp_params:
        numel += _numel(fsdp_param.padded_sharded_param_size)
    gathered = numel * torch.empty((), dtype=dtype).element_size()
    gathers = 1 + (group.post_forward_mesh_info is not None)  # forward, and backward after a reshard
    for _ in range(gathers):
        stats.add_intra(all_gather_bytes(gathered, size))


def count_shard_traffic(model: nn.Module, stats: CommStats) -> int:
    """Set an all-reduce hook on every ``FSDPModule`` of ``model`` holding parameters that only counts the shard
    group's collectives into ``stats`` (:func:`count_shard_group`) and leaves FSDP2's reduce-scatter output as it is:
    nothing crosses replicas. For strategies that reduce across replicas less often than every step (DiLoCo on
    sharded replicas); how many modules were hooked.

    Raises:
        ValueError: a module is sharded on a 2-D mesh (FSDP2's native HSDP would all-reduce across replicas).
    """
    count = 0
    for module in fsdp_modules(model):
        group = _param_group(module)
        if group is None:
            continue
        _refuse_native_hsdp(module, group)

        def hook(output: Tensor, group: Any = group) -> None:
            count_shard_group(stats, group, output)

        module.set_all_reduce_hook(hook)
        count += 1
    return count


class FSDPReplicaReduction(PipelineFrontEnd):
    """Per-rank state of the replica reduction of an FSDP2-sharded model (the FSDP2 side of the pipeline).

    Args:
        compressor: the compressor (owned: a private clone).
        comm: byte-counting collectives over the replicate group (R ranks holding the same shard index).
        param_names: ``id(sharded parameter) -> qualified name``.
        start_step: first optimizer step that is compressed (dense all-reduce of the shard before it).
        policy: which shards are compressed (the size rule judges the local shard's shape).
        seed: base seed of the compressors' generators.
        beta: low-pass factor of the error-feedback memory.
        nonfinite: ``"dense"`` or ``"zero"``: what a shard holding NaN/Inf on some replica becomes.
        device: where restored state tensors go.
        schedule: the compression parameter over optimizer steps (a checked
            :class:`~lightning_gradcomp.schedule.CompressionSchedule`), or ``None`` for the compressor's own.
    """

    _thread_name = "gradcomp-fsdp-comm"

    def __init__(
        self,
        compressor: Compressor,
        comm: Comm,
        param_names: dict[int, str],
        *,
        start_step: int = 2,
        policy: Optional[SlotPolicy] = None,
        seed: int = 0,
        beta: float = 1.0,
        nonfinite: str = "dense",
        device: Optional[torch.device] = None,
        schedule: Optional[CompressionSchedule] = None,
    ) -> None:
        self.param_names = param_names
        self.start_step = start_step
        self.policy = policy or SlotPolicy()
        self.device = device
        self.layer_params: dict[str, Any] = {}
        self.schedule = schedule
        self._scheduled: Any = compressor.default_param  # the schedule's uniform value at self.step
        self._plans: dict[int, tuple[tuple[int, ...], BucketPlan]] = {}
        self._small: set[str] = set()
        self._pending: list[Future] = []  # jobs of this backward pass the hook returned before
        super().__init__(compressor, comm, param_names, self.param_of, seed=seed, beta=beta, nonfinite=nonfinite)
        self._follow_schedule()

    def plans(self) -> list[BucketPlan]:
        """The current plans of the hooked modules that were reduced so far, in installation order."""
        return [self._plans[index][1] for index in sorted(self._plans)]

    # ------------------------------------------------------------------ installation
    def install(self, model: nn.Module) -> int:
        """Set the all-reduce hook of every ``FSDPModule`` of ``model`` that holds parameters; how many were hooked.

        Raises:
            ValueError: a module is sharded on a 2-D mesh (native HSDP all-reduces before the hook), shards a
                parameter on a dim other than 0, or has several parameter groups.
        """
        count = 0
        self._plans, self._small = {}, set()
        for module in fsdp_modules(model):
            group = _param_group(module)
            if group is None:
                continue
            _refuse_native_hsdp(module, group)
            for fsdp_param in group.fsdp_params:
                if fsdp_param.fsdp_placement.dim != 0:
                    raise ValueError(
                        f"parameter {self._name(fsdp_param)} is sharded on dim {fsdp_param.fsdp_placement.dim}: the "
                        "compressed replica reduction supports FSDP2's default Shard(0) only"
                    )
            module.set_reduce_scatter_unused_params(True, recurse=False)  # a fixed layout, used or not
            module.set_all_reduce_hook(self._hook_for(count, group))
            count += 1
        return count

    def plan_for(self, index: int, group: Any) -> tuple[BucketPlan, list[Tensor]]:
        """The (cached) plan of hooked module ``index`` and its reduced parameters: those that require a gradient
        (FSDP2 leaves frozen ones out of the reduce-scatter, unused ones in, as zeros); rebuilt when that changes."""
        reduced = [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad]
        key = tuple(id(fp) for fp in reduced)
        cached = self._plans.get(index)
        if cached is None or cached[0] != key:
            layout = [
                ShardLayout(self._name(fp), tuple(fp.sharded_size), _numel(fp.padded_sharded_param_size))
                for fp in reduced
            ]
            plan = shard_plan(index, layout, self.policy, self.compressor.accepts)
            self._small.update(slot.name for slot in plan.slots if slot.small)
            self._plans[index] = cached = (key, plan)
        return cached[1], [fp.sharded_param for fp in reduced]

    def _name(self, fsdp_param: Any) -> str:
        return self.param_names.get(id(fsdp_param.sharded_param), f"param{id(fsdp_param.sharded_param)}")

    # ------------------------------------------------------------------ the hook
    def _hook_for(self, index: int, group: Any) -> Callable[[Tensor], None]:
        def hook(output: Tensor) -> None:
            plan, params = self.plan_for(index, group)
            self.reduce(output, plan, params, group=group, defer=_grads_view(group, output))

        return hook

    def reduce(
        self,
        output: Tensor,
        plan: BucketPlan,
        params: Sequence[Tensor],
        *,
        group: Any = None,
        defer: bool = False,
    ) -> None:
        """Average one module's reduce-scatter ``output`` (laid out by ``plan``) over the replicas, in place, on the
        communication thread; ``group``: its FSDP2 parameter group (its collectives are counted), ``defer``: return
        before the reduction is done (:meth:`finish_backward` waits for it), else wait for it here."""
        if output.numel() != plan.numel:
            raise RuntimeError(
                f"FSDP2 passed a reduce-scatter output of {output.numel()} elements to the all-reduce hook of "
                f"{[s.name for s in plan.slots]}, whose layout has {plan.numel}"
            )
        transaction = self.transaction
        if not transaction.in_backward:
            self._follow_schedule()
            transaction.begin_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)  # after every hook
        if transaction.carrying:
            transaction.carry_or_drop(list(params))
        step = self.step
        compresses = step >= self.start_step and not self.compressor.dense
        transaction.compressed(compresses)
        compressing = compresses and bool(plan.compressed)
        fut = self.comm_thread().submit(
            lambda: self._reduce(output, plan, step, compressing, group), output.device if output.is_cuda else None
        )
        if defer:
            self._pending.append(fut)
        else:
            fut.wait()

    def _reduce(self, output: Tensor, plan: BucketPlan, step: int, compressing: bool, group: Any) -> Future:
        """One module's replica reduction, on the communication thread (the non-finite decision is read here)."""
        if group is not None:
            count_shard_group(self.stats, group, output)

        def written(fut: Future) -> Tensor:
            result = fut.value()
            if result.data_ptr() != output.data_ptr():
                output.copy_(result)
            return output

        return self.reduction.reduce(output, plan, step, compressing, None).then(written)

    def finish_backward(self) -> None:
        """Wait for the replica reductions the hooks returned before (the autograd engine runs this after every hook
        of the backward pass, and after FSDP2's own final callback), then close the pass's staged state."""
        pending, self._pending = self._pending, []
        errors = []
        for fut in pending:  # every one, so that no job still writes a buffer when an error leaves backward
            try:
                fut.wait()
            except Exception as err:  # noqa: BLE001 - the first is raised once all are done
                errors.append(err)
        if errors:
            raise errors[0]
        self.transaction.end_backward()

    # ------------------------------------------------------------------ state
    def state_nbytes(self) -> int:
        """Bytes of this rank's compression state (memories, compressor state)."""
        return resident_nbytes(self.memory, self.compressor)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: step, memories, compressor state, per-layer parameters, stats."""
        return {
            "step": self.step,
            "beta": self.memory.beta,
            "memory": self.memory.state_dict(),
            "compressor": self.compressor.state_dict(),
            "layer_params": dict(self.layer_params),
            "stats": self.stats.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], per_rank: bool = True) -> None:
        """Restore :meth:`state_dict`; with ``per_rank=False`` only the replicated parts (step, beta, parameters)."""
        self.step = int(state.get("step", 0))
        self.memory.beta = float(state.get("beta", self.memory.beta))
        self.layer_params = dict(state.get("layer_params", {}))
        self._follow_schedule()
        if per_rank:
            self.memory.load_state_dict(state.get("memory", {}), device=self.device)
            self.compressor.load_state_dict(state.get("compressor", {}))
            self.stats.load_state_dict(state.get("stats", {}))
        else:
            self.memory.reset()
            self.compressor.reset_state()
