"""What every front-end of the reduction pipeline shares: a :class:`~lightning_gradcomp.reduction.GradientReduction`,
a :class:`~lightning_gradcomp.step_transaction.StepTransaction`, and the surface the callbacks read.

The DDP comm hook (:class:`~lightning_gradcomp.hook.GradCompHook`) and FSDP2's replica reduction
(:class:`~lightning_gradcomp.fsdp_reduction.FSDPReplicaReduction`) subclass :class:`PipelineFrontEnd`; each builds its
own plans and calls the pipeline its own way.
"""

from collections.abc import Callable
from typing import Any, Optional

import torch

from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.commthread import CommThread
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.memory import ErrorFeedback
from lightning_gradcomp.plan import SlotPolicy
from lightning_gradcomp.reduction import GradientReduction
from lightning_gradcomp.schedule import CompressionSchedule, scheduled_param
from lightning_gradcomp.step_transaction import StepTransaction

__all__ = ["PipelineFrontEnd"]


class PipelineFrontEnd:
    """The pipeline and the step transaction of one rank, with the attributes ``CompressionLogger``, the guard and
    ``LowPassMemoryFilter`` read (``stats``, ``step``, ``compressor``, ``memory``, ``observers``, ``comm``).

    Args:
        compressor: the compressor (owned: not shared with other ranks' objects).
        comm: byte-counting collectives over the ranks the mean is taken over.
        param_names: ``id(parameter) -> qualified name`` of the reduced parameters.
        param_of: the compression parameter of a layer (by name) at the current step.
        seed: base seed of the compressors' generators.
        beta: low-pass factor of the error-feedback memory.
        nonfinite: ``"dense"`` or ``"zero"``: what a tensor holding NaN/Inf on some rank becomes.
    """

    # set by the subclass before ``super().__init__``: what :meth:`param_of` reads
    policy: SlotPolicy
    layer_params: dict[str, Any]
    schedule: Optional[CompressionSchedule]
    _scheduled: Any  # the schedule's uniform value at ``self.step``
    _small: set[str]  # compressed slots that use ``policy.small_param``
    _thread_name = "gradcomp-comm"  # the communication thread's name

    def __init__(
        self,
        compressor: Compressor,
        comm: Comm,
        param_names: dict[int, str],
        param_of: Callable[[str], Any],
        *,
        seed: int = 0,
        beta: float = 1.0,
        nonfinite: str = "dense",
    ) -> None:
        self._thread: Optional[CommThread] = None
        memory = ErrorFeedback(beta)
        self.reduction = GradientReduction(compressor, comm, memory, param_of, seed=seed, nonfinite=nonfinite)
        self.transaction = StepTransaction(memory, compressor, param_names, self._count_step)

    compressor = property(lambda self: self.reduction.compressor, doc="The compressor.")
    memory = property(lambda self: self.reduction.memory, doc="The error-feedback memories.")
    observers = property(lambda self: self.reduction.observers, doc="Observers of the compressed tensors (callbacks).")
    seed = property(lambda self: self.reduction.seed, doc="Base seed of the compressors' generators.")
    nonfinite = property(lambda self: self.reduction.nonfinite, doc='``"dense"`` or ``"zero"``.')

    def comm_thread(self) -> CommThread:
        """The communication thread that runs the reductions, started on first use (and again after :meth:`close`)."""
        if self._thread is None or not self._thread.alive:
            self._thread = CommThread(self._thread_name)
        return self._thread

    def close(self) -> bool:
        """Stop the communication thread (after its queued jobs); a later reduction starts a new one.

        Returns whether it stopped: ``False`` when a job still ran after the wait (a collective stuck on a rank that
        stopped responding), so that its process groups must not be destroyed under it."""
        stopped = True
        if self._thread is not None:
            self._thread.close()
            stopped = not self._thread.alive
            self._thread = None
        return stopped

    def param_of(self, name: str) -> Any:
        """The compression parameter of layer ``name`` at the current step (``small_param`` for a tensor the size
        rule leaves out, per-layer values, the schedule applied)."""
        default = self.policy.small_param if name in self._small else self.compressor.default_param
        base = self.layer_params.get(name, default)
        if self.schedule is None or self._scheduled == self.compressor.default_param:
            return base
        return scheduled_param(self.compressor, base, self._scheduled)

    def _follow_schedule(self) -> None:
        """Set the schedule's uniform value for ``self.step`` (training thread, before a backward pass's first
        reduction)."""
        if self.schedule is not None:
            value = self.schedule.value(self.step, self.compressor.default_param)
            self._scheduled = scheduled_param(self.compressor, self.compressor.default_param, value)

    @property
    def comm(self) -> Comm:
        """Byte-counting collectives over the ranks the mean is taken over."""
        return self.reduction.comm

    @comm.setter
    def comm(self, comm: Comm) -> None:
        self.reduction.comm = comm

    @property
    def stats(self) -> CommStats:
        """This rank's cumulative communication figures."""
        return self.reduction.stats

    @property
    def step(self) -> int:
        """Optimizer steps so far (:attr:`StepTransaction.step`)."""
        return self.transaction.step

    @step.setter
    def step(self, value: int) -> None:
        self.transaction.step = value

    def _count_step(self, compressed: bool) -> None:
        self.stats.steps, self.stats.compressed_steps = self.stats.steps + 1, self.stats.compressed_steps + compressed

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Commit staged state when ``optimizer`` steps (:meth:`StepTransaction.attach_optimizer`)."""
        self.transaction.attach_optimizer(optimizer)

    @property
    def unstepped(self) -> bool:
        """Whether a backward pass went through since the last optimizer step (its state is staged)."""
        return self.transaction.unstepped

    def drop_unstepped(self) -> None:
        """Drop the state staged since the last step, which no optimizer took (``StepTransaction.drop_unstepped``)."""
        self.transaction.drop_unstepped()
