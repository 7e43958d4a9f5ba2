"""The reduction pipeline: one flat gradient tensor and its layer plan in, a Future of the mean out.

:class:`GradientReduction` runs, for one flat tensor (a DDP bucket, a node's shard of one, Local SGD's
pseudo-gradients), everything between "this rank's gradients" and "the average over the process group":
error-feedback compensation, the compressor and its collectives, the memory update, the non-finite policy, the
AMP unscale and the byte accounting. It knows nothing of DDP buckets, FSDP or Lightning: the front-ends are thin
adapters over it (:mod:`lightning_gradcomp.hook` for DDP, :func:`lightning_gradcomp.hierarchy.reduce_hierarchical`
for two-level reduction, :mod:`lightning_gradcomp.localsgd.engine` for pseudo-gradients). Its state changes are
staged and committed by :class:`~lightning_gradcomp.step_transaction.StepTransaction`.

The protocol of one tensor (:meth:`GradientReduction.reduce`; run off the training thread, in the same order on
every rank):

1. Not compressing (before ``start_step``, a dense compressor): the tensor is scaled by ``1 / W`` and all-reduced
   in one async collective, exactly like DDP (:func:`~.functional.axpy.predivide_`: DDP's bits at every W). A
   sparse gradient (``nn.Embedding(sparse=True)``) is always reduced so, as a sparse all-reduce.
2. Otherwise the plan splits the tensor into dense and compressed slots. With error feedback each compressed slot
   is compensated first (``p = m + g``, checking ``g`` for NaN/Inf in the same pass) and its
   :meth:`~lightning_gradcomp.compressors.base.Compressor.precompute` runs while ``p`` is in cache. The dense
   slots and one "this rank saw NaN/Inf" flag are all-reduced in **one** blocking collective. A compressor that
   :attr:`~lightning_gradcomp.compressors.base.Compressor.propagates_nonfinite` (stateless: the casts) gets no
   flag; its dense slots go in an async collective and the decision is made on the averaged result.
3. If any rank flagged, no state is touched and the event is counted: ``nonfinite="dense"`` reduces the compressed
   slots densely too (what DDP would do; a sparsifier's zeroed gradients are recovered from ``p``),
   ``nonfinite="zero"`` makes the whole tensor zero on every rank.
4. Otherwise the compressed slots go through the compressor together; the memory becomes
   ``m <- (1 - beta) m + beta (p - c)``; observers see the inputs and residuals.
5. A callback writes the averaged slots back and resolves the Future with the tensor.

Under fp16 AMP (``loss_scale``) the compressed slots are divided by the loss scale before compression and the
result multiplied by it on write-back (exact: a power of two), so every state stays in unscaled units.
"""

import time
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.comm import Comm, CommStats, all_reduce_bytes, completed_future, then_same_numerics
from lightning_gradcomp.compressors.base import Compressor, ReduceContext, Reduction
from lightning_gradcomp.functional.axpy import predivide_
from lightning_gradcomp.functional.finite import nonfinite_flag
from lightning_gradcomp.memory import ErrorFeedback
from lightning_gradcomp.observers import BucketRecord, HookObserver
from lightning_gradcomp.plan import BucketPlan, LayerSlot

__all__ = ["GradientReduction", "reduce_with_feedback"]


class GradientReduction:
    """The reduction pipeline of one rank: compensation, compression, collectives, memory update, non-finite policy.

    Args:
        compressor: the compressor (owned: not shared with other ranks' objects).
        comm: byte-counting collectives over all W ranks (the mean is over them).
        memory: the error-feedback memories.
        param_of: the compression parameter of a layer (by name) at the current step.
        seed: base seed of the compressors' generators.
        nonfinite: ``"dense"`` or ``"zero"``: what a tensor holding NaN/Inf on some rank becomes.
    """

    def __init__(
        self,
        compressor: Compressor,
        comm: Comm,
        memory: ErrorFeedback,
        param_of: Callable[[str], Any],
        *,
        seed: int = 0,
        nonfinite: str = "dense",
    ) -> None:
        self.compressor = compressor
        self.comm = comm
        self.memory = memory
        self.param_of = param_of
        self.seed = seed
        self.nonfinite = nonfinite
        self.observers: list[HookObserver] = []

    @property
    def stats(self) -> CommStats:
        """This rank's cumulative communication figures."""
        return self.comm.stats

    def reduce(self, flat: Tensor, plan: BucketPlan, step: int, compressing: bool, scale: Optional[Tensor]) -> Future:
        """Average ``flat`` (laid out by ``plan``) over :attr:`comm`, compressed when ``compressing``; ``scale`` is the
        AMP loss scale the gradients carry (or ``None``). Returns a Future of ``flat`` holding the mean."""
        start = time.perf_counter()
        if flat.is_sparse:
            fut = self.reduce_sparse(plan, flat)
        else:
            self.count_dense_equivalent(plan, flat)
            if compressing:
                fut = self.reduce_compressed(plan, flat, step, scale, self.comm, plan.dense, plan.compressed)
            else:
                fut = self.reduce_dense(plan, flat, self.comm)
        self.stats.comm_thread_seconds += time.perf_counter() - start
        return fut

    def count_dense_equivalent(self, plan: BucketPlan, buf: Tensor) -> None:
        """Add what dense DDP would send for ``buf`` (per layer too) to :attr:`stats`."""
        world, size = self.comm.world_size, buf.element_size()
        self.stats.dense_bytes += all_reduce_bytes(buf.numel() * size, world)
        for slot in plan.slots:
            layer = self.stats.layer(slot.name)
            layer.numel, layer.compressed = slot.numel, slot.compressed
            layer.param = self.param_of(slot.name) if slot.compressed else None
            layer.dense_bytes += all_reduce_bytes(slot.numel * size, world)

    def reduce_sparse(self, plan: BucketPlan, buf: Tensor) -> Future:
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

    def reduce_dense(self, plan: BucketPlan, buf: Tensor, comm: Comm) -> Future:
        """DDP's default: scale by ``1 / W``, then one async all-reduce of the whole bucket over ``comm`` (all W)."""
        predivide_(buf, self.comm.world_size)
        fut = comm.all_reduce(buf, async_op=True, shares=[(s.name, s.numel) for s in plan.slots])
        assert fut is not None
        return fut

    def reduce_compressed(
        self,
        plan: BucketPlan,
        buf: Tensor,
        step: int,
        scale: Optional[Tensor],
        comm: Comm,
        dense: tuple[LayerSlot, ...],
        compressed: tuple[LayerSlot, ...],
        node_size: int = 1,
        node_flag: Optional[Tensor] = None,
    ) -> Future:
        """Reduce ``dense`` and ``compressed`` (slots of ``buf``) over ``comm``; the Future resolves to ``buf``.

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
        grads = [buf[s.offset : s.end] for s in compressed]
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
        early = use_ef and node_flag is None and bool(compressed)
        clear = use_ef and self.compressor.sparse_outputs and outputs is not None
        ctx = ReduceContext(
            comm,
            step,
            plan.index,
            compressed,
            [self.param_of(s.name) for s in compressed],
            self.seed,
            observed=bool(watchers),
            outputs=outputs,
            outputs_zeroed=clear,
        )
        compensated, comp_flag = self._compensate(compressed, grads, divisor, clear, ctx) if early else (None, None)
        dense_part: Optional[Future] = None
        if check_after:
            dense_part = self._all_reduce_dense_async(buf, dense, comm)
        elif self._all_reduce_dense_and_flag(buf, dense, comm, flag=True, flag_value=node_flag, comp_flag=comp_flag):
            cleared = compensated if clear else None  # None when not early
            return self._reduce_nonfinite(buf, compressed, comm, cleared, divisor)
        if not compressed:  # a hierarchy rank owning no compressed slot of this bucket (same on its cross-node group)
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
                for s, g in zip(compressed, grads)
            ]  # borrowed: views of the bucket, only read during reduce()
        inputs = [t.clone() for t in tensors] if watchers else []
        if needs_raw and not use_ef:  # without EF the inputs are g already
            raw = inputs
        reduction = self._compress(tensors, ctx, watchers, inputs, raw, feedback=use_ef)

        def write_back(fut: Future) -> Tensor:
            for slot, avg in zip(compressed, fut.value()):
                in_place = avg.data_ptr() == buf.data_ptr() + slot.offset * buf.element_size()  # written there already
                if not in_place:
                    buf[slot.offset : slot.end].copy_(avg)
                if scale is not None:  # back to the loss-scaled units the GradScaler expects (exact: 2^k)
                    buf[slot.offset : slot.end].mul_(scale)
            return buf

        done = then_same_numerics(reduction.averaged, write_back, self.stats)
        return self._checked(buf, dense, dense_part, done, reduction) if check_after else done

    def _compensate(
        self,
        compressed: tuple[LayerSlot, ...],
        grads: list[Tensor],
        divisor: Optional[Tensor],
        clear: bool,
        ctx: ReduceContext,
    ) -> tuple[list[Tensor], Union[bool, Tensor, None]]:
        """Error feedback's ``p = m + g / divisor`` of every compressed slot (``clear``: zeroing ``g`` in the same
        pass), and the compressed slots' NaN/Inf flag for :meth:`_all_reduce_dense_and_flag`'s ``comp_flag``:
        whether some ``g`` holds NaN/Inf, as the kernel's pass found; or, where the torch steps did not check a ``g``
        they zeroed (which a scan of the bucket would miss), a one-element device tensor, non-zero when that slot's
        ``p`` holds NaN/Inf (where ``g`` does); ``None`` where an unchecked ``g`` is still in the bucket (the dense
        all-reduce scans it there).
        Each slot's :meth:`Compressor.precompute` runs right after its ``p`` is formed (still in cache), into
        ``ctx.early``; not for a ``g`` found non-finite (the bucket's result is dropped anyway)."""
        tensors: list[Tensor] = []
        flags: list[Optional[bool]] = []
        zeroed: Optional[Tensor] = None  # the flag of the p whose g the torch steps zeroed unchecked
        early: list[Any] = []
        for index, (slot, g) in enumerate(zip(compressed, grads)):
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
        self,
        buf: Tensor,
        dense: tuple[LayerSlot, ...],
        dense_part: Optional[Future],
        done: Future,
        reduction: Reduction,
    ) -> Future:
        """``done`` (the compressed slots written into ``buf``) and ``dense_part`` (the dense slots' all-reduce, or
        ``None``), then the non-finite decision on the averaged bucket.

        For a compressor that :attr:`~lightning_gradcomp.compressors.base.Compressor.propagates_nonfinite`: some
        rank's NaN/Inf left a NaN/Inf in the averaged bucket, which holds the same bits on every rank, so every rank
        decides alike without a flag collective. There is no state to spare; the event is counted and, with
        ``nonfinite="zero"``, the bucket becomes zero. With ``"dense"`` the non-finite result goes on to the
        optimizer, as it would with DDP (its other entries are the compressor's average, not the fp32 one). When
        the compressor checked its own result while decoding (``reduction.result_nonfinite``), only the dense slots are
        summed here.
        """

        def nonfinite(values: Tensor) -> bool:  # on the thread that completes, never the training thread
            return bool(nonfinite_flag(values))

        def finish(_: Future) -> Tensor:
            if dense_part is not None:
                self._write_dense(buf, dense, dense_part.value())
            if reduction.result_nonfinite is None:
                bad = nonfinite(buf)
            else:
                bad = reduction.result_nonfinite or (dense_part is not None and nonfinite(dense_part.value()))
            if bad:
                self._nonfinite_event(buf)
            return buf

        parts = [done] if dense_part is None else [dense_part, done]
        return then_same_numerics(torch.futures.collect_all(parts), finish, self.stats)

    def _all_reduce_dense_async(self, buf: Tensor, dense: tuple[LayerSlot, ...], comm: Comm) -> Optional[Future]:
        """All-reduce ``dense`` (divided by W) in one async collective over ``comm``; ``None`` without dense slots.
        The Future resolves to the summed, concatenated slots (:meth:`_write_dense` puts them back)."""
        if not dense:
            return None
        return comm.all_reduce(
            self._dense_payload(buf, dense), async_op=True, shares=[(s.name, s.numel) for s in dense]
        )

    def _dense_payload(self, buf: Tensor, dense: tuple[LayerSlot, ...], flag: Optional[Tensor] = None) -> Tensor:
        """The slots ``dense`` of ``buf``, then ``flag`` when given, concatenated and scaled by ``1 / W``."""
        pieces = [buf[s.offset : s.end] for s in dense]
        return predivide_(torch.cat(pieces if flag is None else [*pieces, flag]), self.comm.world_size)

    @staticmethod
    def _write_dense(buf: Tensor, dense: tuple[LayerSlot, ...], dense_part: Tensor) -> None:
        """Copy the concatenated dense slots ``dense_part`` (a flag may follow them) back into ``buf``."""
        for slot, piece in zip(dense, torch.split(dense_part[: sum(s.numel for s in dense)], [s.numel for s in dense])):
            buf[slot.offset : slot.end].copy_(piece)

    def all_reduce_dense(self, buf: Tensor, slots: tuple[LayerSlot, ...], comm: Comm) -> None:
        """All-reduce ``slots`` of ``buf`` divided by W in one blocking collective over ``comm``; write them back."""
        self._all_reduce_dense_and_flag(buf, slots, comm, flag=False)

    def _all_reduce_dense_and_flag(
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
            dense_part = self._dense_payload(buf, dense)
        elif flag_value is not None or comp_flag is None:
            dense_part = self._dense_payload(buf, dense, flag_value if flag_value is not None else nonfinite_flag(buf))
        else:  # x / W is NaN/Inf exactly where x is: scan the divided dense slots
            dense_part = self._dense_payload(buf, dense, buf.new_zeros(1))
            if comp_flag is True:
                dense_part[-1:] = buf.new_ones(1)
            else:  # False, or the compressed slots' device flag (no host sync)
                dense_flag = nonfinite_flag(dense_part[:-1])
                dense_part[-1:] = dense_flag if comp_flag is False else dense_flag.add_(comp_flag)
        comm.all_reduce(dense_part, shares=[(s.name, s.numel) for s in dense])
        self._write_dense(buf, dense, dense_part)
        return flag and bool(dense_part[-1] != 0)

    def _reduce_nonfinite(
        self,
        buf: Tensor,
        compressed: tuple[LayerSlot, ...],
        comm: Comm,
        cleared: Optional[list[Tensor]] = None,
        divisor: Optional[Tensor] = None,
    ) -> Future:
        """Some rank saw NaN/Inf: leave all state untouched; reduce ``compressed`` densely over ``comm`` (or zero
        ``buf``).

        ``cleared``: the compensations ``p`` of ``compressed`` (divided by ``divisor``) whose gradients the compensation
        pass zeroed; the dense reduction sends the gradients recovered from them (:meth:`ErrorFeedback.recover`:
        NaN/Inf where the gradient had them, the rest within rounding)."""
        if self._nonfinite_event(buf):
            return completed_future(buf)
        if not compressed:  # a hierarchy rank owning no compressed slot of this bucket
            return completed_future(buf)
        for slot, p in zip(compressed, cleared or ()):
            buf[slot.offset : slot.end].copy_(self.memory.recover(slot.name, p, divisor))
        rest = predivide_(torch.cat([buf[s.offset : s.end] for s in compressed]), self.comm.world_size)
        comm.all_reduce(rest, shares=[(s.name, s.numel) for s in compressed])
        for slot, piece in zip(compressed, torch.split(rest, [s.numel for s in compressed])):
            buf[slot.offset : slot.end].copy_(piece)
        return completed_future(buf)

    def reduce_layers(
        self, gradients: list[Tensor], slots: list[LayerSlot], step: int, index: int, comm: Optional[Comm] = None
    ) -> Reduction:
        """Compensation, compression and the memory update of whole flat tensors (one per slot of ``slots``), over
        ``comm`` (default :attr:`comm`), with no dense part and no non-finite policy (the caller keeps NaN/Inf out):
        the pipeline's core for a front-end that reduces tensors rather than a bucket (Local SGD's
        pseudo-gradients). ``gradients`` are only read."""
        use_ef = self.compressor.uses_error_feedback
        tensors = [self.memory.compensate(s.name, g) if use_ef else g.clone() for s, g in zip(slots, gradients)]
        watchers = [obs for obs in self.observers if obs.wants(step)]
        inputs = [t.clone() for t in tensors] if watchers else []
        ctx = ReduceContext(comm or self.comm, step, index, slots, [self.param_of(s.name) for s in slots], self.seed)
        return self._compress(tensors, ctx, watchers, inputs, None, feedback=use_ef)

    def _compress(
        self,
        tensors: list[Tensor],
        ctx: ReduceContext,
        watchers: list[HookObserver],
        inputs: list[Tensor],
        raw: Optional[list[Tensor]],
        *,
        feedback: bool,
    ) -> Reduction:
        """:func:`reduce_with_feedback` with this pipeline's compressor and (when ``feedback``) memory."""
        return reduce_with_feedback(
            self.compressor, self.memory if feedback else None, tensors, ctx, watchers, inputs, raw
        )


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
