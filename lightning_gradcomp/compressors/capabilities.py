"""What the engine may assume about a compressor (:class:`Capabilities`): the fast paths it opts into, each off by
default."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from lightning_gradcomp.checks import check_bool, check_number

__all__ = ["CAPABILITY_NAMES", "Capabilities"]


@dataclass(frozen=True)
class Capabilities:
    """What the engine may assume about a compressor: the fast paths it may take. Every field defaults to the safe
    choice, so a compressor declares only what it opts into (``capabilities = Capabilities(borrows_inputs=True)``).

    Attributes:
        dense: the compressor is a plain dense all-reduce (the engine takes its fast path).
        borrows_inputs: :meth:`Compressor.reduce` uses its inputs only until its result resolves (it may read or
            overwrite them, for example with the result itself, but keeps no reference to them or to views of them
            afterwards): without error feedback the engine then passes views of the bucket (fp32, no loss scale)
            instead of fresh copies, saving a pass over the gradient; the bucket's compressed slots are overwritten
            with the result anyway (a result that is those very views is not copied again).
        compresses_small_layers: the compressor suits the layers the default size rule keeps dense (vectors, layers
            under 1024 elements) as well as the large ones: a cast rounds every element alike, whatever its layer.
            The strategies then compress every layer unless the user sets ``min_numel`` / ``compress_1d``; a bucket
            is then one slot back to back, with no dense part to all-reduce beside it.
        sparse_outputs: the compressor writes its averaged results through :meth:`ReduceContext.output` (zeroed
            tensors it adds a few entries into: a sparsifier) and uses error feedback. The engine then zeroes the
            bucket's compressed slots in the same pass that compensates them (the gradient is dead once
            ``p = m + g`` is formed), instead of a second pass over the bucket when :meth:`ReduceContext.output` is
            called.
        propagates_nonfinite: the compressor keeps no state (no error feedback, nothing it stages or commits) and
            its averaged result is non-finite wherever some rank's input was (a plain cast: NaN and Inf survive the
            sum). The engine then sends no NaN/Inf flag ahead of the payload: it checks the averaged bucket
            afterwards, which holds the same bits on every rank and so gives every rank the same decision. That
            saves a pass over the gradient and a blocking collective per bucket.
        bucket_cap_mb: the DDP bucket size (MB) the compressor runs best with, which
            :class:`~lightning_gradcomp.GradCompStrategy` passes to DDP when the user sets no ``bucket_cap_mb``
            (``None``: DDP's own default, 25 MB). A compressor whose payload stays large (the quantizers send 1/16
            to 1/8 of the dense bytes) prefers smaller buckets: the exchange of a bucket can then overlap the
            backward pass of the next, whereas with 25 MB buckets most of a model's gradient arrives in the last
            bucket, after backward has finished.
        hierarchical: whether it can run under ``GradCompStrategy(hierarchy=...)``: on the node-mean gradients of
            the slots a rank owns, over the cross-node group (``ctx.comm``, ``ctx.rank`` = node,
            ``ctx.world_size`` = number of nodes). Any compressor that communicates only through ``ctx.comm`` and
            keys its state by ``slot.name`` can; ``False`` when it needs every rank of the world (collectives outside
            ``ctx.comm``, or state that must see each rank's own gradient), and the strategy refuses the
            combination at construction.

    Leave a field at its default when unsure.
    """

    dense: bool = False
    borrows_inputs: bool = False
    compresses_small_layers: bool = False
    sparse_outputs: bool = False
    propagates_nonfinite: bool = False
    bucket_cap_mb: Optional[float] = None
    hierarchical: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "bucket_cap_mb":
                check_bool(f.name, getattr(self, f.name))
        if self.bucket_cap_mb is not None:
            check_number("bucket_cap_mb", self.bucket_cap_mb, 0.0, math.inf, high_open=True)


CAPABILITY_NAMES = tuple(f.name for f in dataclasses.fields(Capabilities))
"""The fields of :class:`Capabilities`, also readable as (deprecated-to-set) attributes of a compressor."""
