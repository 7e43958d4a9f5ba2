"""Error-feedback memory with a low-pass factor ``beta``.

For each compressed layer the memory ``m`` (fp32, per rank) is added to the gradient before
compression, ``p = m + g``, and after compression it becomes

.. math::  m \\leftarrow (1 - \\beta)\\, m + \\beta\\, (p - c)

where ``c`` is this rank's local compressed contribution. ``beta = 1`` is classic error feedback;
``beta < 1`` is ScaleCom's low-pass filter. Memories are keyed by parameter name, so they survive
DDP's bucket rebuild and are independent of the bucket layout.

With :attr:`ErrorFeedback.staging` on (the engine's mode once an optimizer is attached), updates are
**staged**: :meth:`ErrorFeedback.update` records the new memory, :meth:`ErrorFeedback.commit` makes it
the memory once an optimizer step has consumed the gradient it came from, and :meth:`ErrorFeedback.discard`
drops it (the gradient was thrown away: ``zero_grad()`` before a step, a skipped AMP step, a parameter no
optimizer stepped). :meth:`ErrorFeedback.compensate` reads the committed memory, or a staged one the engine kept
because the next backward pass accumulates into the same ``.grad`` (:meth:`ErrorFeedback.base`).

Between steps a layer holds one fp32 copy of its gradient (the memory); during a step two (the committed memory
and the new one, which replaces it only when the step commits). The new ``p`` is a fresh tensor: keeping the
replaced memory as a reusable buffer saved about a quarter of the compensation's time on the CPU (page faults of
a fresh allocation), but it would keep two copies resident between steps, and on GPUs the caching allocator
reuses the freed block anyway.

Memories are kept in **unscaled** gradient units: under fp16 AMP the engine divides the loss-scaled gradient
by the current loss scale before compensation (``p = m + g / s``), so a change of the scale never releases a
residual at the wrong scale.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.checks import check_value, is_number
from lightning_gradcomp.compressors.staged import StagedState
from lightning_gradcomp.functional.feedback import compensate_checked, recover_gradient

__all__ = ["ErrorFeedback", "LowPassSetting", "require_error_feedback", "validate_beta", "validate_beta_for"]


def validate_beta(beta: float) -> float:
    """Return ``beta`` as a float or raise ``ValueError`` unless ``0 < beta <= 1`` (not a number:
    :class:`~lightning_gradcomp.checks.ArgumentTypeError`, a ``TypeError`` and a ``ValueError``)."""
    return float(check_value(beta, is_number, lambda v: 0.0 < float(v) <= 1.0, "`beta` must be a number in (0, 1]"))


def validate_beta_for(beta: float, compressor: Any) -> float:
    """:func:`validate_beta`, and a ``beta`` below 1 only for a ``compressor`` that keeps an error-feedback memory
    (:func:`require_error_feedback`). Raises ``ValueError``."""
    value = validate_beta(beta)
    if value != 1.0:
        require_error_feedback(compressor, "`beta` below 1 low-pass filters", "use beta=1 (the default) or")
    return value


def require_error_feedback(compressor: Any, subject: str, remedy: str) -> None:
    """Raise ``ValueError`` unless ``compressor`` keeps an error-feedback memory (``uses_error_feedback``): a low-pass
    filter of that memory would change nothing, silently. ``subject`` and ``remedy`` frame the message."""
    if not compressor.uses_error_feedback:
        raise ValueError(
            f"{subject} the error-feedback memory, and {compressor!r} keeps none: {remedy} an error-feedback "
            "compressor (TopK, RandomK, CLTK, SignSGD, PowerSGD)"
        )


class ErrorFeedback:
    """Per-layer residual memories of one rank.

    Args:
        beta: low-pass factor in (0, 1]; settable at run time through :attr:`beta`.
    """

    def __init__(self, beta: float = 1.0) -> None:
        self._beta = validate_beta(beta)
        self.store = StagedState()
        """The memories: committed, and staged by a backward pass until its optimizer step (a
        :class:`~lightning_gradcomp.step_transaction.StepTransaction` commits or discards them with the compressor's
        state)."""

    @property
    def memories(self) -> dict[str, Tensor]:
        """The committed memories, by layer name."""
        return self.store.committed

    @memories.setter
    def memories(self, memories: dict[str, Tensor]) -> None:
        self.store.load(memories)

    @property
    def staged(self) -> dict[str, Tensor]:
        """The memories a backward pass staged, by layer name (not yet committed)."""
        return self.store.staged

    @property
    def staging(self) -> bool:
        """Whether :meth:`update` stages (the engine turns this on when an optimizer commits); else it commits."""
        return self.store.staging

    @staging.setter
    def staging(self, enabled: bool) -> None:
        self.store.staging = enabled

    @property
    def beta(self) -> float:
        """The low-pass factor applied at the next update."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = validate_beta(value)

    def compensate(self, name: str, grad: Tensor, scale: Optional[Tensor] = None, *, clear: bool = False) -> Tensor:
        """Return a new fp32 tensor ``p = m + g / scale`` (``g / scale`` before the first update).

        Args:
            name: the layer.
            grad: this rank's gradient of the layer (any float dtype).
            scale: the loss scale ``g`` carries (a one-element tensor, fp16 AMP), or ``None`` for 1.
            clear: also zero ``grad`` (in the same pass on CPU; see :func:`~.functional.feedback.compensate`).
        """
        return self.compensate_checked(name, grad, scale, clear=clear)[0]

    def compensate_checked(
        self, name: str, grad: Tensor, scale: Optional[Tensor] = None, *, clear: bool = False
    ) -> tuple[Tensor, Optional[bool]]:
        """:meth:`compensate`, and whether ``grad`` holds NaN/Inf (``None``: not checked; see
        :func:`~.functional.feedback.compensate_checked`)."""
        memory = self.base(name)
        if memory is not None and memory.shape != grad.shape:
            memory = None
        return compensate_checked(memory, grad, scale, clear=clear)

    def base(self, name: str) -> Optional[Tensor]:
        """The memory layer ``name`` compensates with: a staged one (a backward pass accumulating into a ``.grad``
        that an earlier, unstepped pass left: the engine keeps that pass's staged memory), else the committed one."""
        return self.store.peek(name)

    def recover(self, name: str, p: Tensor, scale: Optional[Tensor] = None) -> Tensor:
        """The gradient of layer ``name`` that :meth:`compensate` turned into ``p`` (same ``scale``), recovered from
        the memory it compensated with (:meth:`base`): :func:`~.functional.feedback.recover_gradient`."""
        memory = self.base(name)
        return recover_gradient(memory if memory is not None and memory.shape == p.shape else None, p, scale)

    def update(self, name: str, residual: Tensor) -> None:
        """Stage ``m <- (1 - beta) m + beta * residual`` where ``residual = p - c`` (see :meth:`commit`).

        ``residual`` may be ``p``'s own storage (compressors zero the kept entries in place); with
        ``beta = 1`` it is staged without a copy. The committed memory is never modified in place.
        """
        memory = self.base(name)
        if self._beta == 1.0 or memory is None or memory.shape != residual.shape:
            self.store[name] = residual if self._beta == 1.0 else residual.mul(self._beta)
            return
        self.store[name] = memory.mul(1.0 - self._beta).add_(residual, alpha=self._beta)

    def commit(self, names: Optional[Iterable[str]] = None) -> None:
        """Make the staged memories of ``names`` (all when ``None``) the memories; keep the others staged."""
        self.store.commit(names)

    def discard(self, names: Optional[Iterable[str]] = None) -> None:
        """Drop the staged (uncommitted) memories of ``names`` (all when ``None``)."""
        self.store.discard(names)

    def norm(self, names: Optional[list[str]] = None) -> float:
        """L2 norm over all (or the named) memories."""
        keys = self.memories.keys() if names is None else [n for n in names if n in self.memories]
        total = sum(float(self.memories[k].double().pow(2).sum()) for k in keys)
        return math.sqrt(total)

    def flat(self, names: list[str]) -> Tensor:
        """The named memories concatenated (zeros where a memory does not exist yet)."""
        return (
            torch.cat([self.memories[n].reshape(-1) for n in names if n in self.memories])
            if any(n in self.memories for n in names)
            else torch.zeros(0)
        )

    def reset(self) -> None:
        """Drop every memory (committed and staged)."""
        self.store.clear()

    def state_dict(self) -> dict[str, Tensor]:
        """Copies of the memories (CPU tensors, ``weights_only``-loadable)."""
        return {k: v.detach().cpu().clone() for k, v in self.memories.items()}

    def load_state_dict(self, state: dict[str, Tensor], device: Optional[torch.device] = None) -> None:
        """Replace the memories with ``state`` (moved to ``device`` when given)."""
        self.store.load(
            {
                k: v.to(device=device, dtype=torch.float32) if device is not None else v.to(torch.float32).clone()
                for k, v in state.items()
            }
        )


class LowPassSetting:
    """``beta`` and ``set_beta`` of a strategy whose engine (``self._memory_owner()``: the DDP hook or the FSDP2 replica
    reduction, ``None`` before setup) owns an :class:`ErrorFeedback` memory: one value, the memory's own once the
    engine exists (restored with its state), the constructor's (``self._beta``) before."""

    compressor: Any
    _beta: float

    def _memory_owner(self) -> Any:
        raise NotImplementedError

    @property
    def beta(self) -> float:
        """The error-feedback low-pass factor in force."""
        engine = self._memory_owner()
        return engine.memory.beta if engine is not None else self._beta

    @beta.setter
    def beta(self, beta: float) -> None:
        self.set_beta(beta)

    def set_beta(self, beta: float) -> None:
        """Set the memory low-pass factor from now on (below 1 only for an error-feedback compressor;
        ``LowPassMemoryFilter`` calls this)."""
        self._beta = validate_beta_for(beta, self.compressor)
        engine = self._memory_owner()
        if engine is not None:
            engine.memory.beta = self._beta
