"""The DDP communication hook engine: bucket -> layer plan -> dense part + compressed part -> Future.

The hook itself only queues the bucket on the process's :class:`~lightning_gradcomp.commthread.CommThread`
and returns a Future: no waiting, no host sync and no compression on the autograd thread, so backward goes on
while the bucket is reduced. The thread runs each bucket's protocol, in bucket order (identical on every rank,
so ranks never deadlock):

1. Before ``start_step`` (or for a dense compressor) the bucket is scaled by ``1 / W`` and all-reduced in
   one async collective, exactly like DDP's default (:func:`~.functional.mean.predivide_`: DDP's bits at every W).
   A sparse gradient's bucket (``nn.Embedding(sparse=True)``) is always reduced so, as a sparse all-reduce
   (:meth:`GradCompHook._reduce_sparse`).
2. Otherwise the bucket's layer plan splits it into dense and compressed slots. The dense slots,
   plus one "this rank saw NaN/Inf" flag, are all-reduced in **one** collective, waited in-line (on the
   communication thread: the non-finite decision is made there). A compressor that
   :attr:`~lightning_gradcomp.compressors.base.Compressor.propagates_nonfinite` (stateless, NaN/Inf survive into
   its result: the casts) gets no flag: its dense slots go in an async collective and the decision is made on
   the averaged bucket afterwards (:meth:`GradCompHook._checked`).
3. If any rank flagged a non-finite value, no memory or compressor state is touched and the event is
   counted; with ``nonfinite="dense"`` the compressed slots are reduced densely too (what DDP would do:
   under fp16 AMP the GradScaler then sees the Inf and skips the step; a sparsifier's gradients, zeroed by the
   compensation pass, are recovered from ``p`` first: NaN/Inf where they were, the rest within rounding), with
   ``nonfinite="zero"`` the whole bucket's gradient becomes zero on every rank (the step adds no gradient;
   training goes on).
4. Otherwise the compressed slots, error-compensated (``p = m + g``) when the compressor uses error
   feedback, go through the compressor *together*. (With error feedback the compensation comes before step 2,
   slot by slot, each followed by the compressor's :meth:`~lightning_gradcomp.compressors.base.Compressor.precompute`
   of that slot: its local selection or projection, made while ``p`` is in cache and, on a rank that finished
   backward first, while it would otherwise wait in the flag's all-reduce.) Its collectives are issued in order
   from the thread; only the last may still be in flight when the thread moves on to the next bucket. The memory
   becomes ``m <- (1 - beta) m + beta (p - c)``.
5. A ``.then()`` callback (local math only, run with the training thread's intra-op settings) writes the
   averaged slots into the bucket and resolves the Future with it.

State changes are **staged** and take effect only for gradients that an optimizer step consumes. Once
:meth:`GradCompHook.attach_optimizer` has been called (the strategy does so for every optimizer), the new
error-feedback memories and compressor state of a backward pass are committed by the optimizer's step, for
the parameters it stepped (those with a gradient), and discarded when the next backward pass starts
without a step in between (``zero_grad()`` before stepping, a skipped AMP step, a parameter unused on every
rank, a GAN's other optimizer), except for layers whose ``.grad`` still holds that pass's gradient: those
accumulate, and the new pass compensates against the state the previous one staged
(:meth:`GradCompHook._carry_or_drop`). The step counter counts optimizer steps. Without an attached optimizer
(raw use of the hook) every backward pass commits and counts as a step.

With a :class:`~lightning_gradcomp.hierarchy.Hierarchy` (``GradCompStrategy(hierarchy=...)``) each bucket is first
reduce-scattered inside the node (one uneven all-to-all: every slot goes to the local rank that owns it, with
the sender's NaN/Inf flag, and the owner sums the node's copies); each rank then runs steps 2-4 over its
cross-node group for the slots it owns (the node-mean gradient of its owned compressed slots goes to the
compressor, its owned dense slots and the node's flag to the head all-reduce, both divided by W as above, so
their sum over nodes is the global mean); finally a second all-to-all hands every owner's averaged slots to the
rest of its node. Before ``start_step`` (or for a dense compressor) the owned slots are all-reduced across nodes
without the flag, like DDP. With a single node nothing is compressed: one dense all-reduce in the node, as DDP.
See :mod:`lightning_gradcomp.hierarchy`.

Under fp16 AMP (``loss_scale`` set) the compressed slots are divided by the loss scale before compression
and the averaged result is multiplied by it on write-back; both are exact (the scale is a power of two),
and every memory and compressor state stays in unscaled units, whatever the scaler does to the scale.
"""

import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.comm import Comm, CommStats, all_reduce_bytes, completed_future, then_same_numerics
from lightning_gradcomp.commthread import CommThread
from lightning_gradcomp.compressors.base import Compressor, ReduceContext, Reduction
from lightning_gradcomp.functional.axpy import predivide_
from lightning_gradcomp.functional.finite import nonfinite_flag
from lightning_gradcomp.hierarchy import Hierarchy
from lightning_gradcomp.memory import ErrorFeedback
from lightning_gradcomp.plan import BucketPlan, LayerSlot, SlotPolicy, build_plan
from lightning_gradcomp.schedule import CompressionSchedule, scheduled_param

__all__ = [
    "PYTHON_REDUCER_REFUSAL",
    "BucketRecord",
    "GradCompHook",
    "HookObserver",
    "gradcomp_comm_hook",
    "reduce_with_feedback",
]


@dataclass
class BucketRecord:
    """What an observer sees of one compressed bucket reduction.

    Attributes:
        step: global optimizer step.
        bucket_index: DDP bucket index.
        slots: the compressed slots.
        inputs: copies of the tensors given to the compressor (``p = m + g`` with error feedback).
        residuals: per-slot ``p - c`` (from error feedback, or ``inputs - local`` when the
            compressor reported its local contribution), or ``None`` when unknown.
        gradients: fp32 copies of this rank's raw local gradients ``g`` (before error compensation), filled
            only when an observer recording this step has ``needs_gradients = True``; else ``None``.
    """

    step: int
    bucket_index: int
    slots: tuple[LayerSlot, ...]
    inputs: list[Tensor]
    residuals: Optional[list[Tensor]]
    gradients: Optional[list[Tensor]] = None


class HookObserver(Protocol):
    """Something that inspects compressed buckets at the steps it asks for (callbacks use this).

    An observer may also define ``needs_gradients = True`` to receive :attr:`BucketRecord.gradients` (the
    raw gradients are copied only at the steps such an observer records).
    """

    def wants(self, step: int) -> bool:
        """Whether to record ``step`` (inputs are copied only then)."""

    def __call__(self, record: BucketRecord) -> None:
        """Receive one bucket's record (called in the hook body: local math only)."""


def _compresses_nothing(slot: LayerSlot) -> bool:
    """The ``accepts`` of a sparse gradient's plan: a sparse bucket is never compressed
    (:meth:`GradCompHook._reduce_sparse`)."""
    return False


class GradCompHook:
    """Per-rank state and logic of the compression hook.

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
        self.compressor = compressor
        self.dense_only = dense_only
        self.comm = comm
        self.hierarchy = hierarchy
        self.param_names = param_names
        self.start_step = start_step
        self.policy = policy or SlotPolicy()
        self.seed = seed
        self.device = device
        self.nonfinite = nonfinite
        self.memory = ErrorFeedback(beta)
        self.layer_params: dict[str, Any] = {}
        self.schedule = schedule
        self.step = 0
        self._scheduled: Any = compressor.default_param  # the schedule's uniform value at self.step
        self.observers: list[HookObserver] = []
        self.loss_scale: Optional[Callable[[], Optional[Tensor]]] = None
        self._plans: dict[int, tuple[tuple[int, ...], BucketPlan]] = {}
        self._small: set[str] = set()  # compressed slots that use policy.small_param
        self._auto_commit = True  # no optimizer attached: every backward pass is a step
        self._in_backward = False  # between the first and the last bucket of a backward pass
        self._unstepped = False  # a backward pass went through the hook since the last step
        self._compressed = False  # ... and it compressed something
        self._optimizer_hooks: list[Any] = []
        self._watched: set[int] = set()  # id(param) of the parameters with a gradient-arrival hook (attach_optimizer)
        self._kept: set[str] = set()  # layers whose gradient arrived onto a kept .grad since the unstepped pass
        self._cleared: set[str] = set()  # ... onto a cleared one (None): that pass's gradient was thrown away
        self._carrying = False  # this backward pass follows one that no optimizer stepped
        self._thread: Optional[CommThread] = None
        self._follow_schedule()

    @property
    def stats(self) -> CommStats:
        """This rank's cumulative communication figures."""
        return self.comm.stats

    # ------------------------------------------------------------------ plan
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

    def param_of(self, name: str) -> Any:
        """The compression parameter used for layer ``name`` at the current step (schedule applied)."""
        default = self.policy.small_param if name in self._small else self.compressor.default_param
        base = self.layer_params.get(name, default)
        if self.schedule is None or self._scheduled == self.compressor.default_param:
            return base
        return scheduled_param(self.compressor, base, self._scheduled)

    def _follow_schedule(self) -> None:
        """Set the schedule's uniform value for ``self.step`` (training thread, between backward passes)."""
        if self.schedule is not None:
            value = self.schedule.value(self.step, self.compressor.default_param)
            self._scheduled = scheduled_param(self.compressor, self.compressor.default_param, value)

    # ------------------------------------------------------------------ steps
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Commit staged state when ``optimizer`` steps, for the parameters it steps (those with a gradient).

        Call once per optimizer (the strategy does). From then on a backward pass counts as a step only when
        an attached optimizer steps after it.
        """
        self._auto_commit = False
        self.memory.staging = True
        self.compressor.set_staging(True)
        self._optimizer_hooks.append(optimizer.register_step_post_hook(self._on_optimizer_step))
        for group in optimizer.param_groups:
            for param in group["params"]:
                self._watch(param)

    def _watch(self, param: Tensor) -> None:
        """Put the gradient-arrival hook on ``param`` (once; a parameter DDP reduces and that requires grad)."""
        if id(param) in self.param_names and param.requires_grad and id(param) not in self._watched:
            param.register_hook(self._arrival_hook(param))  # kept for the parameter's life: never removed
            self._watched.add(id(param))

    def _arrival_hook(self, param: Tensor) -> Callable[[Tensor], None]:
        """A hook run as ``param``'s gradient arrives, before autograd adds it to ``.grad``: after a backward pass
        that no optimizer stepped, it notes whether that pass's gradient is still in ``.grad`` (accumulation: the
        pass's staged state carries over) or was cleared (``zero_grad()``: the state is dropped). Otherwise it
        returns at once."""
        ref, name = weakref.ref(param), self.param_names[id(param)]

        def arriving(grad: Tensor) -> None:
            if self._unstepped:
                live = ref()
                (self._cleared if live is None or live.grad is None else self._kept).add(name)

        return arriving

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        names = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in self._watched:
                    self._watch(p)  # a parameter group added after attach_optimizer
                if p.grad is not None and id(p) in self.param_names:
                    names.append(self.param_names[id(p)])
        self._end_step(names)

    def _end_step(self, names: Optional[list[str]]) -> None:
        """An optimizer consumed the last backward pass's gradients of ``names`` (all when ``None``)."""
        self.memory.commit(names)
        self.compressor.commit_state(names)
        if not self._unstepped:  # a second optimizer stepping after the same backward pass
            return
        self._unstepped = False
        self._kept.clear()
        self._cleared.clear()
        self.step += 1
        self.stats.steps += 1
        self.stats.compressed_steps += int(self._compressed)

    @property
    def unstepped(self) -> bool:
        """Whether a backward pass went through the hook since the last optimizer step (its state is staged)."""
        return self._unstepped

    def drop_unstepped(self) -> None:
        """The gradients of the backward passes since the last step were thrown away without a step (the strategy
        calls this when the optimizer skipped its step: fp16 AMP found NaN/Inf): drop their staged state now, so
        that the next pass starts from the committed state whatever ``zero_grad`` leaves in ``.grad``."""
        self._unstepped = False
        self._kept.clear()
        self._cleared.clear()
        self.memory.discard()
        self.compressor.discard_state()

    def _begin_backward(self) -> None:
        """A new backward pass starts from the committed state: whatever the last one staged is dropped, unless no
        optimizer stepped since that pass (then each bucket decides for its layers: :meth:`_carry_or_drop`)."""
        self._in_backward = True
        self._compressed = False
        self._follow_schedule()
        self._carrying = self._unstepped and not self._auto_commit
        if not self._carrying:
            self.memory.discard()
            self.compressor.discard_state()

    def _carry_or_drop(self, params: list[Tensor]) -> None:
        """For a backward pass after one that no optimizer stepped: the layers of ``params`` whose ``.grad`` still
        holds that pass's gradient (accumulation: DDP adds the new gradient to it) keep that pass's staged state as
        the base of this pass's compensation (:meth:`~lightning_gradcomp.memory.ErrorFeedback.base`; a compressor's
        ``StagedState`` reads its staged copy), so that error feedback's ledger holds over the accumulated passes
        and the optimizer step commits the chain (a skipped step drops all of it); the layers whose ``.grad`` was
        cleared since drop it. A ``.grad`` zeroed in place (``zero_grad(set_to_none=False)``) cannot be told from a
        kept one, and counts as kept."""
        drop = []
        for param in params:
            name = self.param_names.get(id(param))
            if name is not None and (name in self._cleared or (name not in self._kept and param.grad is None)):
                drop.append(name)  # cleared since; a layer without an arrival (unused here) is judged by its .grad
        self.memory.discard(drop)
        self.compressor.discard_state(drop)

    # ------------------------------------------------------------------ hook
    def __call__(self, bucket: dist.GradBucket) -> Future:
        """Queue the bucket's protocol on the communication thread and return its Future at once."""
        start = time.perf_counter()
        if not self._in_backward:
            self._begin_backward()
        if self._carrying:
            self._carry_or_drop(bucket.parameters())
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
        self._compressed |= compresses
        scale = self.loss_scale() if compressing and self.loss_scale is not None else None
        if self._thread is None or not self._thread.alive:
            self._thread = CommThread()
        fut = self._thread.submit(
            lambda: self._reduce(plan, buf, step, compressing, scale), buf.device if buf.is_cuda else None
        )
        if bucket.is_last():
            self._thread.drain()  # every collective of this backward pass is issued before DDP issues its own
            self._in_backward = False
            self._carrying = False
            self._kept.clear()
            self._cleared.clear()
            self._unstepped = True
            if self._auto_commit:
                self._end_step(None)
        self.stats.hook_seconds += time.perf_counter() - start
        return fut

    def close(self) -> bool:
        """Stop the communication thread (after the queued buckets); a later bucket starts a new one.

        Returns whether it stopped: ``False`` when a job still ran after the wait (a collective stuck on a rank that
        stopped responding), so that its process groups must not be destroyed under it."""
        stopped = True
        if self._thread is not None:
            self._thread.close()
            stopped = not self._thread.alive
            self._thread = None
        return stopped

    def _reduce(self, plan: BucketPlan, buf: Tensor, step: int, compressing: bool, scale: Optional[Tensor]) -> Future:
        """One bucket's whole protocol, on the communication thread."""
        start = time.perf_counter()
        if buf.is_sparse:
            fut = self._reduce_sparse(plan, buf)
            self.stats.comm_thread_seconds += time.perf_counter() - start
            return fut
        self._count_dense_equivalent(plan, buf)
        if self.hierarchy is not None and self.hierarchy.layout.num_nodes == 1:
            fut = self._reduce_dense(plan, buf, self.hierarchy.intra)
        elif self.hierarchy is not None:
            fut = self._reduce_hierarchical(self.hierarchy, plan, buf, step, compressing, scale)
        elif compressing:
            fut = self._reduce_compressed(plan, buf, step, scale, self.comm, plan.dense, plan.compressed)
        else:
            fut = self._reduce_dense(plan, buf, self.comm)
        self.stats.comm_thread_seconds += time.perf_counter() - start
        return fut

    def _count_dense_equivalent(self, plan: BucketPlan, buf: Tensor) -> None:
        world, size = self.comm.world_size, buf.element_size()
        self.stats.dense_bytes += all_reduce_bytes(buf.numel() * size, world)
        for slot in plan.slots:
            layer = self.stats.layer(slot.name)
            layer.numel, layer.compressed = slot.numel, slot.compressed
            layer.param = self.param_of(slot.name) if slot.compressed else None
            layer.dense_bytes += all_reduce_bytes(slot.numel * size, world)

    def _reduce_sparse(self, plan: BucketPlan, buf: Tensor) -> Future:
        """A sparse gradient (``nn.Embedding(sparse=True)``: DDP gives it a bucket of its own), reduced as DDP reduces
        it: the COO tensor divided by W entry by entry, then coalesced (dividing the summed duplicates instead rounds
        differently at W = 3), one sparse all-reduce over all ranks, with or without a hierarchy
        (the dense-equivalent bytes are the same bytes). Never compressed, so no state to spare from a NaN/Inf: the
        decision is made on the sum, the same bits on every rank (no flag collective), as :meth:`_checked` does:
        counted, and with ``nonfinite="zero"`` the gradient's values become zero."""
        scaled = (buf / self.comm.world_size).coalesce()  # as DDP: each entry divided, then duplicates summed
        shares = [(slot.name, slot.numel) for slot in plan.slots]  # one slot: DDP buckets a sparse gradient alone
        before = self.stats.wire_bytes
        fut = self.comm.all_reduce(scaled, async_op=True, shares=shares)
        sent = self.stats.wire_bytes - before
        self.stats.dense_bytes += sent
        for slot in plan.slots:
            layer = self.stats.layer(slot.name)
            layer.numel, layer.compressed, layer.param = slot.numel, False, None
            layer.dense_bytes += sent * slot.numel / plan.numel

        def decide(done: Future) -> Tensor:  # on the thread that completes, never the training thread
            total = done.value()
            if bool(nonfinite_flag(total._values())):
                self._nonfinite_event(total._values())
            return total

        return then_same_numerics(fut, decide, self.stats)

    def _nonfinite_event(self, values: Tensor) -> bool:
        """Count a bucket found holding NaN/Inf on some rank and, under ``nonfinite="zero"``, zero ``values`` (the
        bucket, or a sparse gradient's stored values); whether it zeroed them."""
        self.stats.nonfinite_steps += 1
        if self.nonfinite == "zero":
            values.zero_()
            return True
        return False

    def _reduce_dense(self, plan: BucketPlan, buf: Tensor, comm: Comm) -> Future:
        """DDP's default: scale by ``1 / W``, then one async all-reduce of the whole bucket over ``comm`` (all W)."""
        predivide_(buf, self.comm.world_size)
        fut = comm.all_reduce(buf, async_op=True, shares=[(s.name, s.numel) for s in plan.slots])
        assert fut is not None
        return fut

    def _reduce_compressed(
        self,
        plan: BucketPlan,
        buf: Tensor,
        step: int,
        scale: Optional[Tensor],
        comm: Comm,
        dense: tuple[LayerSlot, ...],
        comp: tuple[LayerSlot, ...],
        node_size: int = 1,
        node_flag: Optional[Tensor] = None,
    ) -> Future:
        """Reduce ``dense`` and ``comp`` (slots of ``buf``) over ``comm``; the Future resolves to ``buf``.

        ``buf`` holds the sum of ``node_size`` ranks' gradients (1: this rank's own; with a hierarchy, the node's),
        so the compressor's inputs are divided by ``node_size`` (node means) and every dense sum by W. ``node_flag``
        (with a hierarchy) is the node's NaN/Inf flag, sent instead of this rank's own.
        """
        use_ef = self.compressor.uses_error_feedback
        watchers = [obs for obs in self.observers if obs.wants(step)]
        check_after = (  # stateless, NaN/Inf show in the result: no flag ahead, nothing to protect (see _checked)
            self.compressor.propagates_nonfinite
            and not use_ef
            and node_size == 1
            and node_flag is None
            and not watchers
        )
        if scale is not None:
            scale = scale.to(device=buf.device, dtype=torch.float32).reshape(1)
        divisor = (
            scale
            if node_size == 1
            else torch.full((1,), float(node_size), device=buf.device).mul_(1.0 if scale is None else scale)
        )
        grads = [buf[s.offset : s.end] for s in comp]
        # results may go straight into the bucket's slices: dead once the inputs are copies made from them, and the
        # inputs themselves when borrowed (a borrowing compressor may overwrite them)
        outputs = grads if buf.dtype == torch.float32 else None
        needs_raw = any(getattr(obs, "needs_gradients", False) for obs in watchers)
        raw = [_unscaled(g, divisor) for g in grads] if needs_raw and use_ef else None  # before clearing them
        # error feedback compensates ahead of the flag: the kernel's pass checks g for NaN/Inf on the way (no pass
        # of the flag's own); a discarded p changes nothing. The pass zeroes a sparsifier's output slots too (a
        # non-finite step under nonfinite="dense" recovers g from p: _reduce_nonfinite). Each slot's precompute (a
        # selection, P = M Q, a message) follows its compensation, while p is in cache and before this rank waits
        # for the others
        early = use_ef and node_flag is None and bool(comp)
        clear = use_ef and self.compressor.sparse_outputs and outputs is not None
        ctx = ReduceContext(
            comm,
            step,
            plan.index,
            comp,
            [self.param_of(s.name) for s in comp],
            self.seed,
            observed=bool(watchers),
            outputs=outputs,
            outputs_zeroed=clear,
        )
        compensated, comp_flag = self._compensate(comp, grads, divisor, clear, ctx) if early else (None, None)
        head: Optional[Future] = None
        if check_after:
            head = self._head_async(buf, dense, comm)
        elif self._head(buf, dense, comm, flag=True, flag_value=node_flag, comp_flag=comp_flag):
            cleared = compensated if clear else None  # None when not early
            return self._reduce_nonfinite(buf, comp, comm, cleared, divisor)
        if not comp:  # a hierarchy rank owning no compressed slot of this bucket (same on its cross-node group)
            return completed_future(buf)

        borrow = not use_ef and self.compressor.borrows_inputs and divisor is None and buf.dtype == torch.float32
        if compensated is not None:
            tensors = compensated
        else:
            tensors = [
                self.memory.compensate(s.name, g, divisor, clear=clear)
                if use_ef
                else g
                if borrow
                else _unscaled(g, divisor)
                for s, g in zip(comp, grads)
            ]  # borrowed: views of the bucket, only read during reduce()
        inputs = [t.clone() for t in tensors] if watchers else []
        if needs_raw and not use_ef:  # without EF the inputs are g already
            raw = inputs
        reduction = reduce_with_feedback(
            self.compressor, self.memory if use_ef else None, tensors, ctx, watchers, inputs, raw
        )

        def write_back(fut: Future) -> Tensor:
            for slot, avg in zip(comp, fut.value()):
                in_place = avg.data_ptr() == buf.data_ptr() + slot.offset * buf.element_size()  # written there already
                if not in_place:
                    buf[slot.offset : slot.end].copy_(avg)
                if scale is not None:  # back to the loss-scaled units the GradScaler expects (exact: 2^k)
                    buf[slot.offset : slot.end].mul_(scale)
            return buf

        done = then_same_numerics(reduction.averaged, write_back, self.stats)
        return self._checked(buf, dense, head, done, ctx) if check_after else done

    def _compensate(
        self,
        comp: tuple[LayerSlot, ...],
        grads: list[Tensor],
        divisor: Optional[Tensor],
        clear: bool,
        ctx: ReduceContext,
    ) -> tuple[list[Tensor], Union[bool, Tensor, None]]:
        """Error feedback's ``p = m + g / divisor`` of every compressed slot (``clear``: zeroing ``g`` in the same
        pass), and the compressed slots' NaN/Inf flag for :meth:`_head`'s ``comp_flag``: whether some ``g`` holds
        NaN/Inf, as the kernel's pass found; or, where the torch steps did not check a ``g`` they zeroed (which a
        scan of the bucket would miss), a one-element device tensor, non-zero when that slot's ``p`` holds NaN/Inf
        (where ``g`` does); ``None`` where an unchecked ``g`` is still in the bucket (the head scans it there).
        Each slot's :meth:`Compressor.precompute` runs right after its ``p`` is formed (still in cache), into
        ``ctx.early``; not for a ``g`` found non-finite (the bucket's result is dropped anyway)."""
        tensors: list[Tensor] = []
        flags: list[Optional[bool]] = []
        zeroed: Optional[Tensor] = None  # the flag of the p whose g the torch steps zeroed unchecked
        early: list[Any] = []
        for index, (slot, g) in enumerate(zip(comp, grads)):
            p, bad = self.memory.compensate_checked(slot.name, g, divisor, clear=clear)
            if bad is None and clear:
                flag = nonfinite_flag(p)
                zeroed = flag if zeroed is None else zeroed.add_(flag)
            tensors.append(p)
            flags.append(bad)
            early.append(None if bad else self.compressor.precompute(index, p, ctx))
        ctx.early = early
        if any(flags):
            return tensors, True
        if zeroed is not None:  # clear: every unchecked g was zeroed, and its p carries the flag
            return tensors, zeroed
        return tensors, None if None in flags else False

    def _checked(
        self, buf: Tensor, dense: tuple[LayerSlot, ...], head: Optional[Future], done: Future, ctx: ReduceContext
    ) -> Future:
        """``done`` (the compressed slots written into ``buf``) and ``head`` (the dense slots' all-reduce, or
        ``None``), then the non-finite decision on the averaged bucket.

        For a compressor that :attr:`~lightning_gradcomp.compressors.base.Compressor.propagates_nonfinite`: some
        rank's NaN/Inf left a NaN/Inf in the averaged bucket, which holds the same bits on every rank, so every rank
        decides alike without a flag collective. There is no state to spare; the event is counted and, with
        ``nonfinite="zero"``, the bucket becomes zero. With ``"dense"`` the non-finite result goes on to the
        optimizer, as it would with DDP (its other entries are the compressor's average, not the fp32 one). When
        the compressor checked its own result while decoding (``ctx.result_nonfinite``), only the dense slots are
        summed here.
        """

        def nonfinite(values: Tensor) -> bool:  # on the thread that completes, never the training thread
            return bool(nonfinite_flag(values))

        def finish(_: Future) -> Tensor:
            if head is not None:
                self._write_dense(buf, dense, head.value())
            if ctx.result_nonfinite is None:
                bad = nonfinite(buf)
            else:
                bad = ctx.result_nonfinite or (head is not None and nonfinite(head.value()))
            if bad:
                self._nonfinite_event(buf)
            return buf

        parts = [done] if head is None else [head, done]
        return then_same_numerics(torch.futures.collect_all(parts), finish, self.stats)

    def _head_async(self, buf: Tensor, dense: tuple[LayerSlot, ...], comm: Comm) -> Optional[Future]:
        """All-reduce ``dense`` (divided by W) in one async collective over ``comm``; ``None`` without dense slots.
        The Future resolves to the summed, concatenated slots (:meth:`_write_dense` puts them back)."""
        if not dense:
            return None
        return comm.all_reduce(
            self._dense_payload(buf, dense), async_op=True, shares=[(s.name, s.numel) for s in dense]
        )

    def _dense_payload(self, buf: Tensor, dense: tuple[LayerSlot, ...], flag: Optional[Tensor] = None) -> Tensor:
        """The slots ``dense`` of ``buf``, then ``flag`` when given, concatenated and scaled by ``1 / W`` (the head)."""
        pieces = [buf[s.offset : s.end] for s in dense]
        return predivide_(torch.cat(pieces if flag is None else [*pieces, flag]), self.comm.world_size)

    @staticmethod
    def _write_dense(buf: Tensor, dense: tuple[LayerSlot, ...], head: Tensor) -> None:
        """Copy the concatenated dense slots ``head`` (a flag may follow them) back into ``buf``."""
        for slot, piece in zip(dense, torch.split(head[: sum(s.numel for s in dense)], [s.numel for s in dense])):
            buf[slot.offset : slot.end].copy_(piece)

    def _head(
        self,
        buf: Tensor,
        dense: tuple[LayerSlot, ...],
        comm: Comm,
        flag: bool,
        flag_value: Optional[Tensor] = None,
        comp_flag: Union[bool, Tensor, None] = None,
    ) -> bool:
        """All-reduce ``dense`` (divided by W), plus a "NaN/Inf in ``buf``" flag (or ``flag_value``) when ``flag``,
        in **one** collective over ``comm``; write them back. ``comp_flag``: whether the compressed slots hold
        NaN/Inf, checked already (error-feedback compensation), as a bool or a one-element device flag (non-zero:
        NaN/Inf): then only the dense slots are scanned. Returns whether any rank flagged (skipped when there is
        nothing to send)."""
        if not dense and not flag:
            return False
        # the flags are summed: NaN/Inf anywhere makes the sum non-zero
        if not flag:
            head = self._dense_payload(buf, dense)
        elif flag_value is not None or comp_flag is None:
            head = self._dense_payload(buf, dense, flag_value if flag_value is not None else nonfinite_flag(buf))
        else:  # x / W is NaN/Inf exactly where x is: scan the divided dense slots
            head = self._dense_payload(buf, dense, buf.new_zeros(1))
            if comp_flag is True:
                head[-1:] = buf.new_ones(1)
            else:  # False, or the compressed slots' device flag (no host sync)
                dense_flag = nonfinite_flag(head[:-1])
                head[-1:] = dense_flag if comp_flag is False else dense_flag.add_(comp_flag)
        comm.all_reduce(head, shares=[(s.name, s.numel) for s in dense])
        self._write_dense(buf, dense, head)
        return flag and bool(head[-1] != 0)

    def _reduce_nonfinite(
        self,
        buf: Tensor,
        comp: tuple[LayerSlot, ...],
        comm: Comm,
        cleared: Optional[list[Tensor]] = None,
        divisor: Optional[Tensor] = None,
    ) -> Future:
        """Some rank saw NaN/Inf: leave all state untouched; reduce ``comp`` densely over ``comm`` or zero ``buf``.

        ``cleared``: the compensations ``p`` of ``comp`` (divided by ``divisor``) whose gradients the compensation
        pass zeroed; the dense reduction sends the gradients recovered from them (:meth:`ErrorFeedback.recover`:
        NaN/Inf where the gradient had them, the rest within rounding)."""
        if self._nonfinite_event(buf):
            return completed_future(buf)
        if not comp:  # a hierarchy rank owning no compressed slot of this bucket
            return completed_future(buf)
        for slot, p in zip(comp, cleared or ()):
            buf[slot.offset : slot.end].copy_(self.memory.recover(slot.name, p, divisor))
        rest = predivide_(torch.cat([buf[s.offset : s.end] for s in comp]), self.comm.world_size)
        comm.all_reduce(rest, shares=[(s.name, s.numel) for s in comp])
        for slot, piece in zip(comp, torch.split(rest, [s.numel for s in comp])):
            buf[slot.offset : slot.end].copy_(piece)
        return completed_future(buf)

    def _reduce_hierarchical(
        self, hierarchy: Hierarchy, plan: BucketPlan, buf: Tensor, step: int, compressing: bool, scale: Optional[Tensor]
    ) -> Future:
        """Node reduce-scatter into this rank's shard, its slots across nodes, node all-gather of the shards."""
        intra, shards, size = hierarchy.intra, hierarchy.shards(plan), hierarchy.layout.group_size
        local = shards.local  # this rank's slots, back to back in its shard
        width = local.numel + 1  # the shard and the node's NaN/Inf flag
        # (1) every slot to its owner, with this rank's flag (read only when compressing); row j of `rows` is what
        # local rank j sent us
        flag = nonfinite_flag(buf) if compressing else buf.new_zeros(1)
        send = torch.cat(
            [piece for slots in shards.by_owner for piece in (*(buf[s.offset : s.end] for s in slots), flag)]
        )
        rows = send.view(1, width) if size == 1 else buf.new_empty(size, width)
        if size > 1:
            intra.all_to_all_uneven(rows.view(-1), send, [width] * size, shards.widths)
        shard = rows[0]
        for j in range(1, size):  # the node sum, in local-rank order (only the owner computes it)
            shard.add_(rows[j])
        if compressing:  # (2) the shard across nodes: the flat protocol on the cross-node group
            fut = self._reduce_compressed(
                local, shard, step, scale, hierarchy.cross, local.dense, local.compressed, size, node_flag=shard[-1:]
            )
            with intra.waiting():  # its averages are sent in (3)
                fut.wait()
        else:
            self._head(shard, local.slots, hierarchy.cross, flag=False)
        # (3) every owner's shard to the rest of the node
        if size == 1:
            gathered = shard
        else:
            rows[1:].copy_(shard.expand(size - 1, width))
            gathered = buf.new_empty(plan.numel + size)
            fut = intra.all_to_all_uneven(gathered, rows.view(-1), shards.widths, [width] * size, async_op=True)
        layout, sizes = shards.gathered  # each owner's slots, then its flag element (None)

        def unpack(received: Tensor) -> Tensor:
            for slot, piece in zip(layout, torch.split(received, list(sizes))):
                if slot is not None:
                    buf[slot.offset : slot.end].copy_(piece)
            return buf

        if size == 1:
            return completed_future(unpack(gathered))
        return then_same_numerics(fut, lambda done: unpack(done.value()), self.stats)

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


def reduce_with_feedback(
    compressor: Compressor,
    memory: Optional[ErrorFeedback],
    tensors: list[Tensor],
    ctx: ReduceContext,
    watchers: list[HookObserver],
    inputs: list[Tensor],
    raw: Optional[list[Tensor]] = None,
) -> Reduction:
    """Run ``compressor.reduce``, stage the new error-feedback memories and show the observers the result.

    Args:
        compressor: the compressor.
        memory: the error-feedback memory to update from the residuals, or ``None`` without error feedback.
        tensors: the compressor's inputs, one flat fp32 tensor per slot of ``ctx.slots``.
        ctx: the reduction context.
        watchers: observers recording this step.
        inputs: copies of ``tensors`` made before the reduction (empty when nobody watches).
        raw: raw gradients for observers that asked for them.
    """
    reduction = compressor.reduce(tensors, ctx)
    if memory is not None:
        if reduction.residuals is None:
            raise RuntimeError(f"{type(compressor).__name__} uses error feedback but returned no residuals")
        for slot, residual in zip(ctx.slots, reduction.residuals):
            memory.update(slot.name, residual)
    if watchers:
        residuals = reduction.residuals
        if residuals is None and reduction.local is not None:
            residuals = [x - c for x, c in zip(inputs, reduction.local)]
        record = BucketRecord(ctx.step, ctx.bucket_index, tuple(ctx.slots), inputs, residuals, raw)
        for obs in watchers:
            obs(record)
    return reduction


def _unscaled(grad: Tensor, scale: Optional[Tensor]) -> Tensor:
    """A new fp32 copy of ``grad / scale`` (``grad`` when there is no loss scale)."""
    out = grad.to(torch.float32, copy=True)
    return out if scale is None else out.div_(scale)


def resident_nbytes(*roots: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots`` through object attributes (``__dict__`` and
    ``__slots__``), dicts, lists and tuples (each storage counted once, whole).

    Example::

        >>> t = torch.zeros(4)
        >>> resident_nbytes({"a": t, "b": t[:2]}, [torch.zeros(2, dtype=torch.float64)])
        32
    """
    seen_objects: set[int] = set()
    seen_storages: set[tuple[str, int]] = set()
    total = 0
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if isinstance(obj, Tensor):
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr())
            if key not in seen_storages:
                seen_storages.add(key)
                total += storage.nbytes()
            continue
        if id(obj) in seen_objects or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype)):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        else:
            if hasattr(obj, "__dict__"):
                stack.extend(vars(obj).values())
            for cls in type(obj).__mro__:  # slotted classes (PyTorch's PowerSGDState)
                slots = cls.__dict__.get("__slots__", ())
                stack.extend(getattr(obj, name, None) for name in ((slots,) if isinstance(slots, str) else slots))
    return total


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
