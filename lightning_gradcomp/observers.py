"""What observers of the reduction pipeline see: one record per compressed tensor, at the steps they ask for.

Callbacks (compression-error logging, L-GreCo's profiler) implement :class:`HookObserver` and are appended to
``strategy.hook.observers`` (:attr:`~lightning_gradcomp.reduction.GradientReduction.observers`).
"""

from dataclasses import dataclass
from typing import Optional, Protocol

from torch import Tensor

from lightning_gradcomp.plan import LayerSlot

__all__ = ["BucketRecord", "HookObserver"]


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
