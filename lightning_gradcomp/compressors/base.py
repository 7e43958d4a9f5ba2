"""The compressor contract.

A compressor reduces the *compressed slots* of one DDP bucket across ranks in one batched protocol.
The hook engine hands it one flat fp32 tensor per slot (already error-compensated, ``p = m + g``,
when the compressor uses error feedback) and gets back:

* a ``Future`` resolving to the per-slot *sums over ranks divided by W* (the averaged gradient), and
* when it uses error feedback, the per-slot residuals ``p - c`` (``c``: this rank's own compressed
  contribution). A compressor may build the residual in ``p``'s storage: the engine owns ``p``.

Rules: every collective goes through ``ctx.comm`` and is *issued from* :meth:`Compressor.reduce`
(never from a ``Future`` callback, which deadlocks gloo with several buckets); callbacks do local
math only. Randomness comes from :meth:`ReduceContext.generator` only.

Layer semantics must not depend on how DDP groups layers into buckets: DDP re-buckets after its first
iteration, so the first step after a resume sees a different grouping than the uninterrupted run did.
Select, quantize and seed *per layer* (keyed by ``slot.name``); batching is for transport only.

This module holds :class:`Compressor`; it re-exports the rest of the contract: the two ends of a ``reduce`` call
(:mod:`.reduce_call`: :class:`ReduceContext`, :class:`Reduction`), the fast paths a compressor opts into
(:mod:`.capabilities`) and the views over a bucket's slots (:mod:`lightning_gradcomp.functional.slot_views`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Optional

from torch import Tensor

from lightning_gradcomp.checks import check_number
from lightning_gradcomp.compressors.capabilities import CAPABILITY_NAMES, Capabilities
from lightning_gradcomp.compressors.reduce_call import ReduceContext, Reduction
from lightning_gradcomp.compressors.staged import StagedState
from lightning_gradcomp.functional.slot_views import contiguous_span as contiguous_span
from lightning_gradcomp.functional.slot_views import split_flat, storage_window
from lightning_gradcomp.plan import LayerSlot

__all__ = [
    "CAPABILITY_NAMES",
    "Capabilities",
    "Compressor",
    "ReduceContext",
    "Reduction",
    "check_number",
    "split_flat",
    "storage_window",
]


_UNSET = object()


def _is_flag(value: Any) -> bool:
    """Whether a class attribute is an old-style capability flag (a value, not the base class's property)."""
    return value is not _UNSET and not isinstance(value, property)


class Compressor(ABC):
    """Base class: configuration plus optional per-layer persistent state.

    Subclasses set :attr:`param_name` when they have a per-layer parameter, declare the engine fast paths they opt
    into in :attr:`capabilities` (all off by default), and validate every constructor argument eagerly. Those that
    also implement :meth:`layer_costs` are :attr:`tunable`: L-GreCo can then choose their parameter per layer
    (:meth:`candidate_grid` and :meth:`layer_candidates` have defaults for integer parameters). For the common
    exchanges a base class does the communication: :class:`~.quantized.QuantizedCompressor` and
    :class:`~.sparse.SharedIndexCompressor`.
    """

    param_name: ClassVar[Optional[str]] = None
    """Name of the per-layer parameter (``"density"``, ``"rank"``, ``"bits"``), or ``None``."""

    capabilities: ClassVar[Capabilities] = Capabilities()
    """What the engine may assume about this compressor (its fast paths); declare one per class."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Fold capability flags a subclass still sets as class attributes (``borrows_inputs = True``, the form
        before :class:`Capabilities`) into its :attr:`capabilities`, with a ``DeprecationWarning``."""
        super().__init_subclass__(**kwargs)
        flags = {name: cls.__dict__[name] for name in CAPABILITY_NAMES if _is_flag(cls.__dict__.get(name, _UNSET))}
        if not flags:
            return
        flags = {name: value if name == "bucket_cap_mb" else bool(value) for name, value in flags.items()}
        declared = ", ".join(f"{name}={value!r}" for name, value in flags.items())
        inherited = cls.capabilities
        suggestion = (
            f"Capabilities({declared})"
            if inherited == Capabilities()
            else f"dataclasses.replace({cls.__mro__[1].__name__}.capabilities, {declared})"
        )
        warnings.warn(
            f"{cls.__name__} sets {', '.join(flags)} as class attributes; this is deprecated: declare "
            f"`capabilities = {suggestion}` (lightning_gradcomp.compressors.Capabilities) instead",
            DeprecationWarning,
            stacklevel=3,  # the class statement (through ABCMeta.__new__)
        )
        cls.capabilities = dataclasses.replace(inherited, **flags)
        for name in flags:  # the properties below read them from the capabilities again
            delattr(cls, name)

    @property
    def dense(self) -> bool:
        """:attr:`Capabilities.dense` of this compressor."""
        return self.capabilities.dense

    @property
    def borrows_inputs(self) -> bool:
        """:attr:`Capabilities.borrows_inputs` of this compressor."""
        return self.capabilities.borrows_inputs

    @property
    def compresses_small_layers(self) -> bool:
        """:attr:`Capabilities.compresses_small_layers` of this compressor."""
        return self.capabilities.compresses_small_layers

    @property
    def sparse_outputs(self) -> bool:
        """:attr:`Capabilities.sparse_outputs` of this compressor."""
        return self.capabilities.sparse_outputs

    @property
    def propagates_nonfinite(self) -> bool:
        """:attr:`Capabilities.propagates_nonfinite` of this compressor."""
        return self.capabilities.propagates_nonfinite

    @property
    def bucket_cap_mb(self) -> Optional[float]:
        """:attr:`Capabilities.bucket_cap_mb` of this compressor."""
        return self.capabilities.bucket_cap_mb

    @property
    def hierarchical(self) -> bool:
        """:attr:`Capabilities.hierarchical` of this compressor."""
        return self.capabilities.hierarchical

    @property
    def uses_error_feedback(self) -> bool:
        """Whether the engine keeps an error-feedback memory for this compressor."""
        return False

    @property
    def default_param(self) -> Any:
        """The uniform per-layer parameter (``None`` when there is none)."""
        return None if self.param_name is None else getattr(self, self.param_name)

    def check_param(self, value: Any) -> Any:
        """Validate a per-layer parameter value (overridden by compressors that have one)."""
        return value

    def require_param(self, argument: str) -> None:
        """Raise ``ValueError`` naming ``argument`` (a strategy argument that sets the compression parameter)
        when this compressor has no per-layer parameter."""
        if self.param_name is None:
            raise ValueError(
                f"`{argument}` needs a compressor with a compression parameter (density, rank or bits); "
                f"{self!r} has none"
            )

    # ------------------------------------------------------------------ costs (L-GreCo)
    @property
    def tunable(self) -> bool:
        """Whether L-GreCo can tune it: it has a per-layer parameter and implements :meth:`layer_costs`."""
        return self.param_name is not None and type(self).layer_costs is not Compressor.layer_costs

    def candidate_grid(self, min_factor: float, max_factor: float, num: int) -> list[Any]:
        """Default candidate values around the default ``d``: the integers in ``[floor(min_factor d),
        ceil(max_factor d)]`` (at least 1; ``num`` is unused). Override for non-integer parameters.

        Raises:
            ValueError: the compressor is not :attr:`tunable`.
        """
        if not self.tunable:
            raise self._not_tunable()
        default = self.default_param
        return list(range(max(1, math.floor(min_factor * default)), math.ceil(max_factor * default) + 1))

    def layer_candidates(self, shape: Sequence[int], candidates: Iterable[Any]) -> list[Any]:
        """The ``candidates`` valid for a layer of ``shape``: those :meth:`check_param` accepts, plus the default,
        deduplicated and sorted. Override to also drop values that do not suit the layer.

        Raises:
            ValueError: the compressor is not :attr:`tunable`.
        """
        if not self.tunable:
            raise self._not_tunable()
        out = set()
        for value in [*candidates, self.default_param]:
            try:
                out.add(self.check_param(value))
            except (TypeError, ValueError):
                continue
        return sorted(out)

    def layer_costs(
        self, stat: Tensor, shape: Sequence[int], candidates: Sequence[Any]
    ) -> tuple[list[float], list[float]]:
        """``(sizes, errors)`` of each candidate value for one layer: what L-GreCo trades off.

        Args:
            stat: the layer's statistic ``A`` (any float tensor of ``prod(shape)`` elements, flat or shaped).
            shape: the layer's parameter shape.
            candidates: values of the per-layer parameter (as returned by :meth:`layer_candidates`).

        Returns:
            ``sizes[c]``: bytes of one rank's compressed message for the layer per step (the collective's
            W-dependent factor, the same for every candidate, left out; ``inf`` for a value the layer cannot
            take); ``errors[c]``: the un-squared compression error ``||A - C_c(A)||`` (its expectation, as a
            root mean square, for randomized compressors), in the units of ``stat``.

        Raises:
            ValueError: the compressor is not :attr:`tunable` (this base implementation always raises).
        """
        raise self._not_tunable()

    def _not_tunable(self) -> ValueError:
        """The error for a compressor that is not :attr:`tunable`, naming it and saying why."""
        reason = (
            "it has no per-layer parameter (param_name is None)"
            if self.param_name is None
            else f"it does not implement layer_costs for its per-layer parameter {self.param_name!r}"
        )
        return ValueError(f"{type(self).__name__} is not tunable: {reason}")

    def accepts(self, slot: LayerSlot) -> bool:
        """Whether this compressor wants to compress ``slot`` (after the size policy agreed)."""
        return True

    def prepare(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Get ready to reduce: called once per rank before training (build native kernels, warm caches).

        Runs in the strategy's setup, never during backward, so nothing slow happens while other ranks
        wait in a collective. Default: nothing to do.
        """

    def precompute(self, index: int, tensor: Tensor, ctx: ReduceContext) -> Any:
        """Local work on slot ``index`` that :meth:`reduce` would otherwise do itself, from ``tensor`` (the slot's
        input) alone: a sparsifier's indices, PowerSGD's ``P = M Q``, a quantizer's message. ``None`` (the default):
        nothing to do ahead.

        With error feedback the engine calls it right after compensating each slot, while ``p`` is still in cache
        and before the blocking NaN/Inf flag all-reduce, and hands the results to :meth:`reduce`
        (:meth:`ReduceContext.precomputed`). So the pass reads a ``p`` just written instead of a cold one, and a
        rank that finishes backward early does this work while it waits for the others. It must issue no collective
        and change no state; it may change ``tensor`` only into what :meth:`reduce` leaves there anyway (SignSGD
        writes its residual ``p - c``), and only when ``ctx.observed`` is false (observers copy the inputs after
        it). :meth:`reduce` must give the same bits whether it was called or not. When some rank's bucket holds a
        NaN/Inf the results are dropped.
        """
        return None

    @abstractmethod
    def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
        """Average ``tensors`` (one flat fp32 tensor per compressed slot) across ranks."""

    def state_dict(self) -> dict[str, Any]:
        """Per-rank persistent state (tensors, numbers, strings only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless by default, like state_dict
        """Restore :meth:`state_dict`."""

    def reset_state(self) -> None:  # noqa: B027 - stateless by default
        """Forget per-rank persistent state (world-size change policy)."""

    def commit_state(self, names: Optional[Iterable[str]] = None) -> None:
        """Commit the state staged for layers ``names`` (all when ``None``): an optimizer stepped them.

        Acts on every :class:`~lightning_gradcomp.compressors.staged.StagedState` attribute; override only
        for state kept elsewhere.
        """
        wanted = None if names is None else list(names)
        for store in self._staged_stores():
            store.commit(wanted)

    def set_staging(self, enabled: bool) -> None:
        """Turn staged state updates on (the engine does, once an optimizer step commits them) or off."""
        for store in self._staged_stores():
            store.staging = enabled

    def discard_state(self, names: Optional[Iterable[str]] = None) -> None:
        """Drop the state staged for layers ``names`` (all when ``None``): the gradient it came from was thrown away
        before any optimizer step used it."""
        wanted = None if names is None else list(names)
        for store in self._staged_stores():
            store.discard(wanted)

    def _staged_stores(self) -> list[StagedState]:
        return [value for value in vars(self).values() if isinstance(value, StagedState)]

    def clone(self) -> Compressor:
        """A fresh deep copy (strategies never share compressor state)."""
        return copy.deepcopy(self)

    def extra_repr(self) -> str:
        """Arguments shown by ``repr``."""
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"
