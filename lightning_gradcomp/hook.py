"""The DDP front-end of the reduction pipeline: a communication hook that hands each bucket to
:class:`~lightning_gradcomp.reduction.GradientReduction` off the autograd thread.

The hook only queues the bucket on the process's :class:`~lightning_gradcomp.commthread.CommThread` and returns a
Future: no waiting, no host sync and no compression on the autograd thread, so backward goes on while the bucket is
reduced. The thread runs each bucket's protocol in bucket order (identical on every rank, so ranks never deadlock):
:meth:`GradientReduction.reduce <lightning_gradcomp.reduction.GradientReduction.reduce>`, or with a
:class:`~lightning_gradcomp.hierarchy.Hierarchy` :func:`~lightning_gradcomp.hierarchical_reduction.reduce_hierarchical`.
Here lives what is DDP's own: each bucket's layer plan, ``start_step``, the compression parameter's schedule, the
backward pass's bounds for :class:`~lightning_gradcomp.step_transaction.StepTransaction`, and the checkpointed state.
"""

import time
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.comm import Comm
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.front_end import PipelineFrontEnd
from lightning_gradcomp.hierarchical_reduction import reduce_hierarchical
from lightning_gradcomp.hierarchy import Hierarchy
from lightning_gradcomp.observers import BucketRecord, HookObserver
from lightning_gradcomp.plan import BucketPlan, LayerSlot, SlotPolicy, build_plan
from lightning_gradcomp.reduction import reduce_with_feedback
from lightning_gradcomp.resident import resident_nbytes
from lightning_gradcomp.schedule import CompressionSchedule

__all__ = [
    "PYTHON_REDUCER_REFUSAL",
    "BucketRecord",
    "GradCompHook",
    "HookObserver",
    "gradcomp_comm_hook",
    "reduce_with_feedback",
    "resident_nbytes",
]


def _compresses_nothing(slot: LayerSlot) -> bool:
    """The ``accepts`` of a sparse gradient's plan, or of ``dense_only``: nothing is compressed."""
    return False


class GradCompHook(PipelineFrontEnd):
    """Per-rank state and logic of the compression hook (DDP's side of the reduction pipeline).

    Args:
        compressor: the compressor (owned by this hook; not shared with other ranks' objects).
        comm: byte-counting collectives of this rank.
        param_names: ``id(parameter) -> qualified name``.
        start_step: first optimizer step that is compressed (dense all-reduce before it).
        policy: which tensors are compressed.
        seed: base seed for the compressors' generators.
        beta: low-pass factor of the error-feedback memory.
        device: where restored state tensors go (the gradients' device).
        nonfinite: ``"dense"`` or ``"zero"``: what a bucket holding NaN/Inf on some rank becomes.
        schedule: the compression parameter over steps (a checked
            :class:`~lightning_gradcomp.schedule.CompressionSchedule`), or ``None`` for the compressor's own.
        hierarchy: this rank's node and cross-node groups and the slot owners (``hierarchy=`` of the
            strategy), or ``None`` for the flat protocol over ``comm``. ``comm`` stays the world's (W).
        dense_only: reduce every bucket densely (DDP's bits), whatever the step: a fit on one process with
            ``single_process="dense"``. Nothing is compressed and no memory or compressor state changes.
    """

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
        device: Optional[torch.device] = None,
        nonfinite: str = "dense",
        schedule: Optional[CompressionSchedule] = None,
        hierarchy: Optional[Hierarchy] = None,
        dense_only: bool = False,
    ) -> None:
        self.dense_only = dense_only
        self.hierarchy = hierarchy
        self.param_names = param_names
        self.start_step = start_step
        self.policy = policy or SlotPolicy()
        self.device = device
        self.layer_params: dict[str, Any] = {}
        self.schedule = schedule
        self._scheduled: Any = compressor.default_param  # the schedule's uniform value at self.step
        self.loss_scale: Optional[Callable[[], Optional[Tensor]]] = None
        self._plans: dict[int, tuple[tuple[int, ...], BucketPlan]] = {}
        self._small: set[str] = set()  # compressed slots that use policy.small_param
        super().__init__(compressor, comm, param_names, self.param_of, seed=seed, beta=beta, nonfinite=nonfinite)
        self._follow_schedule()

    # ------------------------------------------------------------------ plan and parameters
    def plan_for(self, bucket: dist.GradBucket) -> BucketPlan:
        """The (cached) layer plan of ``bucket``; rebuilt when DDP changes the bucket's layout."""
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        cached = self._plans.get(bucket.index())
        if cached is None or cached[0] != key:
            accepts = _compresses_nothing if bucket.buffer().is_sparse or self.dense_only else self.compressor.accepts
            plan = build_plan(bucket.index(), params, self.param_names, self.policy, accepts)
            self._plans[bucket.index()] = (key, plan)
            self._small.update(slot.name for slot in plan.slots if slot.small)
            return plan
        return cached[1]

    def plans(self) -> list[BucketPlan]:
        """Current plans of all buckets seen so far."""
        return [plan for _, plan in self._plans.values()]

    # ------------------------------------------------------------------ hook
    def __call__(self, bucket: dist.GradBucket) -> Future:
        """Queue the bucket's protocol on the communication thread and return its Future at once."""
        start = time.perf_counter()
        transaction = self.transaction
        if not transaction.in_backward:
            self._follow_schedule()
            transaction.begin_backward()
        if transaction.carrying:
            transaction.carry_or_drop(bucket.parameters())
        buf = bucket.buffer()
        plan = self.plan_for(bucket)
        step = self.step
        compresses = (
            not self.dense_only
            and step >= self.start_step
            and not self.compressor.dense
            and (self.hierarchy is None or self.hierarchy.layout.num_nodes > 1)
        )  # one node: no slow hop to spare
        compressing = compresses and bool(plan.compressed)
        transaction.compressed(compresses)
        scale = self.loss_scale() if compressing and self.loss_scale is not None else None
        thread = self.comm_thread()
        fut = thread.submit(
            lambda: self._reduce(plan, buf, step, compressing, scale), buf.device if buf.is_cuda else None
        )
        if bucket.is_last():
            thread.drain()  # every collective of this backward pass is issued before DDP issues its own
            transaction.end_backward()
        self.stats.hook_seconds += time.perf_counter() - start
        return fut

    def _reduce(self, plan: BucketPlan, buf: Tensor, step: int, compressing: bool, scale: Optional[Tensor]) -> Future:
        """One bucket's whole protocol, on the communication thread."""
        if self.hierarchy is not None:
            return reduce_hierarchical(self.reduction, self.hierarchy, plan, buf, step, compressing, scale)
        return self.reduction.reduce(buf, plan, step, compressing, scale)

    # ------------------------------------------------------------------ state
    def _layout(self) -> Optional[list[int]]:
        return None if self.hierarchy is None else self.hierarchy.describe()

    def state_nbytes(self) -> int:
        """Bytes of the tensors this rank's compression keeps: error-feedback memories (committed and staged) and the
        compressor's state (between steps, the extra resident memory of compression)."""
        return resident_nbytes(self.memory, self.compressor)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: step, memories, compressor state, per-layer parameters, stats."""
        return {
            "step": self.step,
            "hierarchy": self._layout(),
            "beta": self.memory.beta,
            "memory": self.memory.state_dict(),
            "compressor": self.compressor.state_dict(),
            "layer_params": dict(self.layer_params),
            "stats": self.stats.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], per_rank: bool = True) -> None:
        """Restore :meth:`state_dict`; with ``per_rank=False`` only the replicated parts.

        Replicated parts (identical on every rank): step, beta, per-layer parameters.
        Per-rank parts: memories, compressor state, stats. They are reset, with a warning, when the state was
        saved with another ``hierarchy`` layout (a rank's memories then belong to other slots or units).
        """
        saved = state.get("hierarchy")  # absent before hierarchy= existed: flat
        if per_rank and saved != self._layout():
            warnings.warn(
                f"GradCompHook: the state was saved with hierarchy layout {saved} ([nodes, processes per "
                f"node]; None: flat) and is restored into {self._layout()}: per-rank state (error-feedback "
                f"memories, compressor state) is reset; the step counter and per-layer parameters are kept",
                stacklevel=2,
            )
            per_rank = False
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


PYTHON_REDUCER_REFUSAL = (
    "the compression hook needs DDP's bucketed reducer, but this DistributedDataParallel was built with "
    "torch._dynamo.config.optimize_ddp = 'python_reducer' (compiled DDP), which calls comm hooks once per "
    "parameter and ignores their result: nothing would be compressed or averaged by the hook. Build the model's "
    "DDP with the default optimize_ddp ('ddp_optimizer'), which works with torch.compile"
)
"""Why a DDP in compiled DDP's Python-reducer mode cannot run the hook (raised at setup and by the hook itself)."""


def gradcomp_comm_hook(state: GradCompHook, bucket: dist.GradBucket) -> Future[Tensor]:
    """The function registered with ``DistributedDataParallel.register_comm_hook``."""
    if not isinstance(bucket, dist.GradBucket):  # compiled DDP's Python reducer passes (grad, param)
        raise TypeError(PYTHON_REDUCER_REFUSAL)
    return state(bucket)
