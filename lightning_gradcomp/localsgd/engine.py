"""The outer synchronization of Local SGD / DiLoCo: pseudo-gradients through a compressor, then an outer step.

One :class:`OuterSync` per rank. It keeps the **global model** ``theta`` (an fp32 copy of every trainable
parameter, identical on all ranks), the outer optimizer's momentum buffers, the error-feedback memories and the
compressor. A sync of fragment ``f`` (a contiguous group of parameters; the whole model when there is one
fragment) does, in the same order on every rank:

1. ``delta_i = theta - x_i`` per parameter (``x_i``: this rank's local parameter after its local steps; the
   *pseudo-gradient*, pointing downhill like a gradient);
2. the tensors the policy leaves dense (small, 1-D, vetoed by ``compressor.accepts``), plus the fragment's
   floating-point buffers, are averaged in **one** all-reduce;
3. the others go through the compressor in **one** batched ``compressor.reduce`` (error-compensated,
   ``p = m + delta_i``, when ``compressor.uses_error_feedback``; the memory becomes
   ``m <- (1 - beta) m + beta (p - c)``), and the averaged result ``delta`` is waited for;
4. the outer step: ``"average"``: ``theta <- theta - delta`` (model averaging when nothing is compressed);
   ``"nesterov"`` (DiLoCo): ``b <- mu b + delta`` (``b <- delta`` the first time), ``theta <- theta - lr (delta
   + mu b)``, exactly ``torch.optim.SGD(lr, momentum=mu, nesterov=True)`` applied to ``theta`` with gradient
   ``delta``;
5. every rank's parameters (and the fragment's buffers) become ``theta``: replicas are bit-identical after it.

**Non-finite contributions are contained** before step 2, on the thread that runs the exchange: when some
pseudo-gradient of this rank holds NaN/Inf, all of its pseudo-gradients of the exchange become zeros (the rank
contributes "no progress"), and a floating buffer holding NaN/Inf is replaced by its value at the last sync. No
memory, compressor state, momentum or other rank ever sees the value; the rank's parameters become ``theta`` at
step 5 as everyone's do. Counted in ``stats.nonfinite_steps`` when the exchange is applied; the inner steps whose
gradient :meth:`note_nonfinite` reports (the strategy zeroes those before its inner optimizer steps) are counted on
the device and added when :attr:`stats` is read or the rank's state saved.

**Overlap** (``overlap=tau >= 1``): a fragment's exchange (steps 1-3) is *issued* at its sync step and runs
in a background thread on a dedicated process group while the rank takes its next ``tau`` local steps; the
outer step and the write-back (4-5) are *applied* at step ``issue + tau``, on the main thread. At application
the fragment's parameters become the new ``theta`` (the fragment's local progress of those ``tau`` steps is
dropped), so replicas are bit-identical in that fragment right after it. At most one exchange is in flight
(``tau <= local_steps / fragments``). :meth:`drain` waits for the exchange without applying it (checkpoints
store its averaged result and apply it at the same step after a resume).

Its compressed part runs through the reduction pipeline (compensation, compressor, memory update, observers:
:meth:`GradientReduction.reduce_layers <lightning_gradcomp.reduction.GradientReduction.reduce_layers>`). The
object also quacks like :class:`~lightning_gradcomp.hook.GradCompHook` where
:class:`~lightning_gradcomp.callbacks.CompressionLogger` reads it (``stats``, ``step``, ``start_step``,
``observers``, ``memory``, ``compressor``, ``comm``, ``plans()``, ``param_of()``): the logger's bytes, ratio,
memory norm and compression error (sampled per sync) work unchanged. ``step`` counts syncs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.comm import Comm, CommStats, all_reduce_bytes
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.functional.finite import DeferredCount, nonfinite_flag, zero_if_nonfinite
from lightning_gradcomp.functional.realview import from_real, real_view
from lightning_gradcomp.memory import ErrorFeedback
from lightning_gradcomp.observers import HookObserver
from lightning_gradcomp.plan import BucketPlan, SlotPolicy, build_plan
from lightning_gradcomp.reduction import GradientReduction

__all__ = ["OUTERS", "OuterSync", "split_fragments"]

OUTERS = ("average", "nesterov")


def split_fragments(numels: list[int], fragments: int) -> list[list[int]]:
    """Cut tensors (in order) into ``fragments`` contiguous, non-empty groups of roughly equal size.

    Returns the tensor indices of each group. Raises ``ValueError`` if there are fewer tensors than groups.
    """
    if fragments > len(numels):
        raise ValueError(
            f"`fragments` must be at most the number of trainable parameter tensors ({len(numels)}), got {fragments}"
        )
    total = sum(numels)
    groups: list[list[int]] = [[] for _ in range(fragments)]
    done, g = 0, 0
    for i, n in enumerate(numels):
        later_groups = fragments - 1 - g
        past_boundary = done + n / 2 > total * (g + 1) / fragments  # most of this tensor lies past the cut
        if groups[g] and later_groups > 0 and (past_boundary or len(numels) - i <= later_groups):
            g += 1
        groups[g].append(i)
        done += n
    return groups


@dataclass
class _Exchange:
    """One fragment exchange: what was issued, and (once done) its averaged result."""

    indices: list[int]
    step: int  # sync index (ReduceContext.step)
    apply_at: int  # optimizer step at which the result is applied
    deltas: dict[str, Tensor] = field(default_factory=dict)
    buffer_values: dict[str, Tensor] = field(default_factory=dict)
    averaged: Optional[dict[str, Tensor]] = None
    buffers: Optional[dict[str, Tensor]] = None
    thread: Optional[threading.Thread] = None
    error: Optional[BaseException] = None
    seconds: float = 0.0
    nonfinite: bool = False  # this rank's contribution held NaN/Inf and was contained


class OuterSync:
    """Per-rank state and logic of the periodic outer synchronization (see the module docstring).

    Args:
        compressor: a private compressor (the strategy clones it per rank).
        comm: byte-counting collectives of this rank.
        params: ``(name, parameter)`` of every trainable parameter, in model order (or of this rank's shard of it:
            any tensor the engine may read and write in place).
        buffers: ``(name, buffer)`` of the floating-point buffers (averaged with the last fragment).
        fragments: number of fragments the parameters are cut into.
        policy: which tensors are compressed.
        outer: ``"average"`` or ``"nesterov"``.
        outer_lr: outer learning rate (``"nesterov"``).
        outer_momentum: outer Nesterov momentum.
        seed: base seed of the compressor's generators.
        beta: error-feedback low-pass factor.
        overlap: local steps between issuing a fragment's exchange and applying it (0: synchronous).
        async_comm: the byte-counting collectives of the background exchanges (a dedicated process group
            sharing ``comm``'s stats); required when ``overlap > 0``.
    """

    start_step = 0
    """The first sync that is compressed (every sync is): for ``CompressionLogger``."""

    def __init__(
        self,
        compressor: Compressor,
        comm: Comm,
        params: Sequence[tuple[str, Tensor]],
        buffers: list[tuple[str, Tensor]],
        *,
        fragments: int = 1,
        policy: Optional[SlotPolicy] = None,
        outer: str = "nesterov",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        seed: int = 0,
        beta: float = 1.0,
        overlap: int = 0,
        async_comm: Optional[Comm] = None,
    ) -> None:
        if overlap and async_comm is None:
            raise ValueError("`overlap > 0` needs `async_comm` (collectives on a dedicated process group)")
        self.compressor = compressor
        self.comm = comm
        self.overlap = overlap
        self.async_comm = async_comm
        self._inflight: Optional[_Exchange] = None
        self.policy = policy or SlotPolicy()
        self.outer, self.outer_lr, self.outer_momentum, self.seed = outer, outer_lr, outer_momentum, seed
        self.memory = ErrorFeedback(beta)
        self.reduction = GradientReduction(compressor, comm, self.memory, self.param_of, seed=seed)
        self.observers: list[HookObserver] = self.reduction.observers
        self.layer_params: dict[str, Any] = {}
        self.params = dict(params)
        self.buffers = dict(buffers)
        names = {id(p): n for n, p in params}
        tensors = [p for _, p in params]
        accepts = (lambda slot: False) if compressor.dense else compressor.accepts
        self.fragments: list[BucketPlan] = [
            build_plan(f, [tensors[i] for i in group], names, self.policy, accepts)
            for f, group in enumerate(split_fragments([p.numel() for p in tensors], fragments))
        ]
        with torch.no_grad():
            self.theta = {n: real_view(p.detach()).to(torch.float32, copy=True) for n, p in params}
            self.theta_buffers = {n: b.detach().clone() for n, b in buffers}
        self.momentum: dict[str, Tensor] = {}
        self.step = 0  # syncs done (identical on all ranks)
        self.local_steps = 0  # optimizer steps done
        self.cursor = 0  # the fragment synced next
        self._inner_nonfinite = DeferredCount()  # inner steps zeroed since the last fold
        self._step_dense = sum(all_reduce_bytes(p.numel() * p.element_size(), comm.world_size) for p in tensors)

    # ------------------------------------------------------------------ GradCompHook-like surface
    @property
    def stats(self) -> CommStats:
        """This rank's cumulative communication figures (inner steps zeroed for NaN/Inf counted up to now: a host
        read of the count when there are some; the engine itself writes ``comm.stats``)."""
        self.fold_nonfinite()
        return self.comm.stats

    def plans(self) -> list[BucketPlan]:
        """One plan per fragment."""
        return list(self.fragments)

    def param_of(self, name: str) -> Any:
        """The compression parameter of layer ``name``."""
        return self.layer_params.get(name, self.compressor.default_param)

    # ------------------------------------------------------------------ steps
    def count_step(self) -> None:
        """An optimizer step happened: count what per-step DDP would have sent for it."""
        self.local_steps += 1
        stats = self.comm.stats
        stats.steps += 1
        stats.dense_bytes += self._step_dense
        world = self.comm.world_size
        for plan in self.fragments:
            for slot in plan.slots:
                layer = stats.layer(slot.name)
                layer.numel, layer.compressed = slot.numel, slot.compressed
                layer.param = self.param_of(slot.name) if slot.compressed else None
                param = self.params[slot.name]  # its own bytes: a complex slot counts 2 real numbers per element
                layer.dense_bytes += all_reduce_bytes(param.numel() * param.element_size(), world)

    def sync_next(self) -> None:
        """Synchronize (or, with ``overlap``, issue the exchange of) the fragment under the cursor; advance it."""
        if self.overlap:
            self.issue([self.cursor])
        else:
            self.sync([self.cursor])
        self.cursor = (self.cursor + 1) % len(self.fragments)

    def sync(self, indices: list[int]) -> None:
        """Reduce the pseudo-gradients of fragments ``indices`` and take the outer step now (collective).

        An exchange still in flight is applied first.
        """
        self.finish()
        start = time.perf_counter()
        job = self._prepare(indices, self.local_steps)
        self._run(job, self.comm)
        if job.error is not None:
            raise job.error
        self._apply(job)
        self.comm.stats.hook_seconds += time.perf_counter() - start

    def issue(self, indices: list[int]) -> None:
        """Start the exchange of fragments ``indices`` in the background; applied ``overlap`` steps later."""
        self.finish()
        start = time.perf_counter()
        job = self._prepare(indices, self.local_steps + self.overlap)
        assert self.async_comm is not None
        job.thread = threading.Thread(
            target=self._run, args=(job, self.async_comm), daemon=True, name=f"localsgd-sync-{job.step}"
        )
        self._inflight = job
        job.thread.start()
        self.comm.stats.hook_seconds += time.perf_counter() - start

    def due(self) -> bool:
        """Whether an exchange in flight is to be applied at the current optimizer step."""
        return self._inflight is not None and self.local_steps >= self._inflight.apply_at

    def in_flight(self) -> bool:
        """Whether an issued exchange has not been applied yet."""
        return self._inflight is not None

    def exchanging(self) -> bool:
        """Whether an exchange's background thread still runs (its collectives may still be on ``async_comm``)."""
        job = self._inflight
        return job is not None and job.thread is not None and job.thread.is_alive()

    def drain(self) -> None:
        """Wait for the exchange in flight to complete, without applying it (e.g. before a checkpoint)."""
        job = self._inflight
        if job is None or job.thread is None:
            return
        start = time.perf_counter()
        job.thread.join()
        job.thread = None
        self.comm.stats.hook_seconds += time.perf_counter() - start
        self.comm.stats.comm_thread_seconds += job.seconds
        if job.error is not None:
            self._inflight = None
            raise job.error

    def finish(self) -> None:
        """Wait for the exchange in flight (if any) and apply it: outer step, parameters become ``theta``."""
        job = self._inflight
        if job is None:
            return
        self.drain()
        start = time.perf_counter()
        self._inflight = None
        self._apply(job)
        self.comm.stats.hook_seconds += time.perf_counter() - start

    def _prepare(self, indices: list[int], apply_at: int) -> _Exchange:
        """Snapshot the pseudo-gradients (and, with the last fragment, the buffers); count the sync."""
        job = _Exchange(list(indices), self.step, apply_at)
        last = len(self.fragments) - 1 in indices
        with torch.no_grad():
            for i in indices:
                for slot in self.fragments[i].slots:
                    live = real_view(self.params[slot.name].detach())
                    job.deltas[slot.name] = self.theta[slot.name] - live.to(torch.float32)
            if last:
                job.buffer_values = {
                    n: b.detach().reshape(-1).to(torch.float32, copy=True) for n, b in self.buffers.items()
                }
        self.step += 1
        self.comm.stats.compressed_steps += int(not self.compressor.dense)
        return job

    def _run(self, job: _Exchange, comm: Comm) -> None:
        """The collectives of one exchange (main thread, or the background thread with ``overlap``)."""
        start = time.perf_counter()
        try:
            with torch.no_grad():
                job.nonfinite = self._contain(job)
                job.averaged, job.buffers = self._reduce(job, comm)
        except BaseException as error:  # re-raised on the main thread by sync / drain
            job.error = error
        job.seconds = time.perf_counter() - start

    def _apply(self, job: _Exchange) -> None:
        """Outer step on ``theta`` for the exchanged fragments; parameters (and buffers) become the global model."""
        assert job.averaged is not None and job.buffers is not None
        self.comm.stats.nonfinite_steps += int(job.nonfinite)
        with torch.no_grad():
            for i in job.indices:
                for slot in self.fragments[i].slots:
                    self._outer_step(slot.name, job.averaged[slot.name])
                    real_view(self.params[slot.name].detach()).copy_(self.theta[slot.name])
            for name, value in job.buffers.items():
                self.buffers[name].copy_(value.view_as(self.buffers[name]))
                self.theta_buffers[name] = self.buffers[name].detach().clone()

    def _contain(self, job: _Exchange) -> bool:
        """Replace this rank's non-finite contributions to ``job``: every pseudo-gradient by zeros when one holds
        NaN/Inf, a floating buffer holding NaN/Inf by its value at the last sync. Returns whether any was replaced
        (two host reads at most, on the thread that runs the exchange)."""
        deltas = list(job.deltas.values())
        replaced = bool(zero_if_nonfinite(deltas).item())
        names = list(job.buffer_values)
        per_buffer = [nonfinite_flag(job.buffer_values[n]).to(torch.float32) for n in names]
        flags = torch.cat(per_buffer).tolist() if per_buffer else []  # one host read for all buffers
        for name, flag in zip(names, flags):
            if flag:
                job.buffer_values[name] = self.theta_buffers[name].reshape(-1).to(torch.float32, copy=True)
                replaced = True
        return replaced

    def note_nonfinite(self, flag: Tensor) -> None:
        """Count an inner step whose gradient held NaN/Inf (``flag``: a one-element 0/1 tensor, e.g. from
        :func:`~lightning_gradcomp.functional.finite.zero_if_nonfinite`), without a host sync: added to
        ``stats.nonfinite_steps`` when :attr:`stats` is read or :meth:`rank_state` saved (:meth:`fold_nonfinite`)."""
        self._inner_nonfinite.add(flag)

    def fold_nonfinite(self) -> None:
        """Add the inner steps counted by :meth:`note_nonfinite` to ``stats.nonfinite_steps`` (a host read)."""
        self.comm.stats.nonfinite_steps += self._inner_nonfinite.take()

    def _reduce(self, job: _Exchange, comm: Comm) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        world = comm.world_size
        plans = [self.fragments[i] for i in job.indices]
        deltas = job.deltas
        dense = [s for plan in plans for s in plan.dense]
        compressed = [s for plan in plans for s in plan.compressed]
        out: dict[str, Tensor] = {}
        buffers: dict[str, Tensor] = {}
        names = list(job.buffer_values)
        parts = [deltas[s.name].reshape(-1) for s in dense] + [job.buffer_values[n] for n in names]
        if parts:
            flat = torch.cat(parts).div_(world)
            shares = [(s.name, s.numel) for s in dense] + [(n, job.buffer_values[n].numel()) for n in names]
            comm.all_reduce(flat, shares=shares)
            pieces = torch.split(flat, [s.numel for s in dense] + [job.buffer_values[n].numel() for n in names])
            for slot, piece in zip(dense, pieces):
                out[slot.name] = piece.view(slot.shape)
            for name, piece in zip(names, pieces[len(dense) :]):
                buffers[name] = piece.to(self.buffers[name].dtype)
        if not compressed:
            return out, buffers
        gradients = [deltas[s.name].reshape(-1) for s in compressed]
        reduction = self.reduction.reduce_layers(gradients, compressed, job.step, plans[0].index, comm)
        for slot, avg in zip(compressed, reduction.averaged.wait()):
            out[slot.name] = avg.reshape(slot.shape).to(torch.float32)
        return out, buffers

    def _outer_step(self, name: str, delta: Tensor) -> None:
        theta = self.theta[name]
        if self.outer == "average":
            theta.sub_(delta)
            return
        mu = self.outer_momentum
        buf = self.momentum.get(name)
        if buf is None:
            buf = self.momentum[name] = delta.clone()
        else:
            buf.mul_(mu).add_(delta)
        theta.add_(delta.add(buf, alpha=mu), alpha=-self.outer_lr)

    def pending(self) -> bool:
        """Whether some fragment has local steps not yet synchronized.

        A parameter is synchronized when it holds ``theta`` in its own dtype, as the write-back left it: a bf16 or
        fp16 parameter cannot hold the fp32 ``theta`` exactly, so comparing in fp32 would report progress right
        after every sync (and ``fit``'s end would take one more outer step, with the momentum, on nothing).
        """
        return any(not torch.equal(from_real(self.theta[n], p), p.detach()) for n, p in self.params.items())

    # ------------------------------------------------------------------ evaluation on the global model
    def global_tensors(self) -> dict[str, Tensor]:
        """The global model by name: parameters (in their own dtype) and floating buffers."""
        out = {n: from_real(self.theta[n], p) for n, p in self.params.items()}
        out.update(self.theta_buffers)
        return out

    def local_tensors(self) -> dict[str, Tensor]:
        """Copies of this rank's local parameters and floating buffers."""
        out = {n: p.detach().clone() for n, p in self.params.items()}
        out.update({n: b.detach().clone() for n, b in self.buffers.items()})
        return out

    def write(self, values: dict[str, Tensor]) -> None:
        """Copy ``values`` into the live parameters and buffers."""
        with torch.no_grad():
            for name, value in values.items():
                target = self.params.get(name)
                (target if target is not None else self.buffers[name]).copy_(value)

    # ------------------------------------------------------------------ state
    def shared_state(self) -> dict[str, Any]:
        """The replicated state (identical on all ranks): global model, outer momentum, counters."""
        self.drain()
        job = self._inflight
        pending = (
            None
            if job is None
            else {
                "indices": list(job.indices),
                "step": job.step,
                "apply_at": job.apply_at,
                "averaged": {k: v.clone() for k, v in (job.averaged or {}).items()},
                "buffers": {k: v.clone() for k, v in (job.buffers or {}).items()},
            }
        )
        return {
            "theta": {k: v.clone() for k, v in self.theta.items()},
            "theta_buffers": {k: v.clone() for k, v in self.theta_buffers.items()},
            "momentum": {k: v.clone() for k, v in self.momentum.items()},
            "step": self.step,
            "local_steps": self.local_steps,
            "cursor": self.cursor,
            "pending": pending,
        }

    def load_shared_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`shared_state` (tensors go to the parameters' device)."""
        device = {n: p.device for n, p in self.params.items()}
        device.update({n: b.device for n, b in self.buffers.items()})
        self.theta = {k: v.to(device=device.get(k), dtype=torch.float32, copy=True) for k, v in state["theta"].items()}
        self.theta_buffers = {k: v.to(device=device.get(k), copy=True) for k, v in state["theta_buffers"].items()}
        self.momentum = {
            k: v.to(device=device.get(k), dtype=torch.float32, copy=True) for k, v in state["momentum"].items()
        }
        self.step, self.local_steps, self.cursor = int(state["step"]), int(state["local_steps"]), int(state["cursor"])
        pending = state.get("pending")
        self._inflight = None
        if pending is not None:  # an exchange that was complete but not yet applied when the checkpoint was taken
            self._inflight = _Exchange(
                list(pending["indices"]),
                int(pending["step"]),
                int(pending["apply_at"]),
                averaged={
                    k: v.to(device=device.get(k), dtype=torch.float32, copy=True)
                    for k, v in pending["averaged"].items()
                },
                buffers={k: v.to(device=device.get(k), copy=True) for k, v in pending["buffers"].items()},
            )

    def rank_state(self) -> dict[str, Any]:
        """This rank's own state: error-feedback memories, compressor state, stats."""
        self.drain()
        self.fold_nonfinite()
        return {
            "memory": self.memory.state_dict(),
            "compressor": self.compressor.state_dict(),
            "stats": self.comm.stats.state_dict(),
            "pending_nonfinite": self._inflight is not None and self._inflight.nonfinite,
        }

    def load_rank_state(self, state: Optional[dict[str, Any]]) -> None:
        """Restore :meth:`rank_state`; ``None`` resets memories and compressor state (world-size change)."""
        if state is None:
            self.memory.reset()
            self.compressor.reset_state()
            return
        device = next(iter(self.params.values())).device if self.params else None
        self.memory.load_state_dict(state["memory"], device=device)
        self.compressor.load_state_dict(state["compressor"])
        self.comm.stats.load_state_dict(state["stats"])
        if self._inflight is not None:  # counted when it is applied, as in the uninterrupted run
            self._inflight.nonfinite = bool(state.get("pending_nonfinite", False))
