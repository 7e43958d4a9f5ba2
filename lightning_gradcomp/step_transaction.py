"""One transaction per optimizer step for every per-rank state a backward pass changes.

A reduction changes two kinds of per-rank state, both kept in :class:`~lightning_gradcomp.compressors.staged.
StagedState` stores: the error-feedback memories (:class:`~lightning_gradcomp.memory.ErrorFeedback`) and the
compressor's own state (PowerSGD's warm-start ``Q``, DIANA's shifts, SignSGD's server memories). Those changes must
take effect only for gradients that an optimizer step consumes. :class:`StepTransaction` is the one place that
decides, for every front-end (the DDP comm hook, and any other that reduces gradients through
:class:`~lightning_gradcomp.reduction.GradientReduction`):

- once :meth:`StepTransaction.attach_optimizer` was called, a backward pass's changes are **staged**; the optimizer's
  step commits them for the parameters it stepped (those with a gradient);
- a backward pass that starts without a step since the last one drops what that one staged (``zero_grad()`` before
  stepping, a skipped AMP step, a parameter unused on every rank, a GAN's other optimizer), except for layers whose
  ``.grad`` still holds that pass's gradient: those accumulate, and the new pass compensates against the state the
  previous one staged (:meth:`StepTransaction.carry_or_drop`);
- without an attached optimizer (raw use) every backward pass commits and counts as a step.

The step counter counts optimizer steps.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.memory import ErrorFeedback

__all__ = ["StepTransaction"]


class StepTransaction:
    """Stages the state changes of each backward pass and commits or discards them at the optimizer step.

    Args:
        memory: the error-feedback memories.
        compressor: the compressor whose :class:`~lightning_gradcomp.compressors.staged.StagedState` stores change.
        param_names: ``id(parameter) -> qualified name`` of the parameters whose gradients are reduced.
        on_step: called with "this step compressed something" each time a step is counted.
    """

    def __init__(
        self,
        memory: ErrorFeedback,
        compressor: Compressor,
        param_names: dict[int, str],
        on_step: Callable[[bool], None],
    ) -> None:
        self.memory = memory
        self.compressor = compressor
        self.param_names = param_names
        self.on_step = on_step
        self.step = 0
        """Optimizer steps counted so far (backward passes, without an attached optimizer)."""
        self.auto_commit = True  # no optimizer attached: every backward pass is a step
        self.in_backward = False  # between the first and the last bucket of a backward pass
        self.carrying = False  # this backward pass follows one that no optimizer stepped
        self._unstepped = False  # a backward pass finished since the last step
        self._compressed = False  # ... and it compressed something
        self._optimizer_hooks: list[Any] = []
        self._watched: set[int] = set()  # id(param) of the parameters with a gradient-arrival hook
        self._kept: set[str] = set()  # layers whose gradient arrived onto a kept .grad since the unstepped pass
        self._cleared: set[str] = set()  # ... onto a cleared one (None): that pass's gradient was thrown away

    # ------------------------------------------------------------------ the optimizer
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Commit staged state when ``optimizer`` steps, for the parameters it steps (those with a gradient).

        Call once per optimizer. From then on a backward pass counts as a step only when an attached optimizer steps
        after it.
        """
        self.auto_commit = False
        self.memory.staging = True
        self.compressor.set_staging(True)
        self._optimizer_hooks.append(optimizer.register_step_post_hook(self._on_optimizer_step))
        for group in optimizer.param_groups:
            for param in group["params"]:
                self._watch(param)

    def _watch(self, param: Tensor) -> None:
        """Put the gradient-arrival hook on ``param`` (once; a parameter that is reduced and requires grad)."""
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
        self.end_step(names)

    # ------------------------------------------------------------------ the transaction
    def commit(self, names: Optional[Iterable[str]] = None) -> None:
        """Make the staged state of layers ``names`` (all when ``None``) the committed state."""
        wanted = None if names is None else list(names)
        self.memory.commit(wanted)
        self.compressor.commit_state(wanted)

    def discard(self, names: Optional[Iterable[str]] = None) -> None:
        """Drop the staged state of layers ``names`` (all when ``None``)."""
        wanted = None if names is None else list(names)
        self.memory.discard(wanted)
        self.compressor.discard_state(wanted)

    def end_step(self, names: Optional[list[str]]) -> None:
        """An optimizer consumed the last backward pass's gradients of ``names`` (all when ``None``): commit them,
        and count the step (once, however many optimizers step after the same pass)."""
        self.commit(names)
        if not self._unstepped:  # a second optimizer stepping after the same backward pass
            return
        self._unstepped = False
        self._kept.clear()
        self._cleared.clear()
        self.step += 1
        self.on_step(self._compressed)

    @property
    def unstepped(self) -> bool:
        """Whether a backward pass finished since the last optimizer step (its state is staged)."""
        return self._unstepped

    def drop_unstepped(self) -> None:
        """The gradients of the backward passes since the last step were thrown away without a step (fp16 AMP found
        NaN/Inf and skipped it): drop their staged state now, so that the next pass starts from the committed state
        whatever ``zero_grad`` leaves in ``.grad``."""
        self._unstepped = False
        self._kept.clear()
        self._cleared.clear()
        self.discard()

    def begin_backward(self) -> None:
        """A new backward pass starts from the committed state: whatever the last one staged is dropped, unless no
        optimizer stepped since that pass (then each layer decides: :meth:`carry_or_drop`)."""
        self.in_backward = True
        self._compressed = False
        self.carrying = self._unstepped and not self.auto_commit
        if not self.carrying:
            self.discard()

    def compressed(self, compresses: bool) -> None:
        """Note whether this backward pass compresses (counted in the step's ``compressed_steps``)."""
        self._compressed |= compresses

    def carry_or_drop(self, params: list[Tensor]) -> None:
        """For a backward pass after one that no optimizer stepped: the layers of ``params`` whose ``.grad`` still
        holds that pass's gradient (accumulation) keep that pass's staged state as the base of this pass's
        compensation (:meth:`~lightning_gradcomp.memory.ErrorFeedback.base`; a compressor's ``StagedState`` reads its
        staged copy), so that error feedback's ledger holds over the accumulated passes and the optimizer step
        commits the chain (a skipped step drops all of it); the layers whose ``.grad`` was cleared since drop it. A
        ``.grad`` zeroed in place (``zero_grad(set_to_none=False)``) cannot be told from a kept one: it counts as
        kept."""
        drop = []
        for param in params:
            name = self.param_names.get(id(param))
            if name is not None and (name in self._cleared or (name not in self._kept and param.grad is None)):
                drop.append(name)  # cleared since; a layer without an arrival (unused here) is judged by its .grad
        self.discard(drop)

    def end_backward(self) -> None:
        """The backward pass's last gradients were reduced: its state waits for the optimizer step (or, without an
        attached optimizer, is committed now)."""
        self.in_backward = False
        self.carrying = False
        self._kept.clear()
        self._cleared.clear()
        self._unstepped = True
        if self.auto_commit:
            self.end_step(None)
