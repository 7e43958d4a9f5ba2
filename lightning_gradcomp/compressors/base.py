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
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Union

import torch
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.checks import check_bool, check_number
from lightning_gradcomp.comm import Comm
from lightning_gradcomp.compressors.staged import StagedState
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


@dataclass
class ReduceContext:
    """What a compressor may use while reducing one bucket.

    Attributes:
        comm: byte-counting collectives.
        step: global optimizer-step counter (identical on all ranks).
        bucket_index: DDP bucket index.
        slots: the compressed slots, in buffer order.
        params: per-slot compression parameter (``ratio``, ``rank``, ``bits``...), in slot order.
        seed: the strategy's seed.
        observed: whether an observer reads this reduction's :attr:`Reduction.local` (a compressor may skip
            computing it when not).
        outputs: per slot, the bucket's flat fp32 slice, which the compressor may fill with its averaged result and
            return once it no longer reads its inputs: the engine then copies nothing back. Its contents are dead,
            except for a compressor that borrows its inputs (:attr:`Compressor.borrows_inputs`): then these are the
            inputs themselves. ``None`` when there are none (see :meth:`output`).
        outputs_zeroed: whether the engine already zeroed :attr:`outputs` (for a compressor with
            :attr:`Compressor.sparse_outputs`, while it compensated): :meth:`output` then hands them out as they are.
        early: per slot, what :meth:`Compressor.precompute` returned when the engine called it ahead of
            :meth:`Compressor.reduce` (see :meth:`precomputed`); ``None`` when it did not.
    """

    comm: Comm
    step: int
    bucket_index: int
    slots: Sequence[LayerSlot]
    params: Sequence[Any]
    seed: int = 0
    observed: bool = True
    outputs: Optional[Sequence[Tensor]] = None
    outputs_zeroed: bool = False
    early: Optional[list[Any]] = None

    def precomputed(self, index: int) -> Any:
        """What :meth:`Compressor.precompute` returned for slot ``index`` ahead of the reduction, or ``None`` (not
        called, or nothing to do on this rank): the compressor then does that work itself."""
        return None if self.early is None else self.early[index]

    def output(self, index: int, like: Tensor) -> Tensor:
        """A zeroed fp32 tensor for slot ``index``'s averaged result: :attr:`outputs` ``[index]`` when there is one,
        else a fresh one of ``like``'s size and device."""
        if self.outputs is not None:
            return self.outputs[index] if self.outputs_zeroed else self.outputs[index].zero_()
        return torch.zeros(like.numel(), dtype=torch.float32, device=like.device)

    @property
    def rank(self) -> int:
        """This rank in the reducing group."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.comm.world_size

    def generator(self, device: torch.device, *, shared: bool, salt: Union[int, str]) -> torch.Generator:
        """A generator seeded from ``(seed, step, rank or "shared", salt)``, identical across runs.

        ``shared=True`` gives every rank the same stream (shared indices, shared initialisation);
        ``shared=False`` gives independent per-rank streams (stochastic rounding). Pass the layer name
        as ``salt`` for per-layer streams: they then do not depend on how DDP groups layers into buckets
        (which differs in the first step after a resume), so resumed runs reproduce uninterrupted ones.
        """
        who = "shared" if shared else f"rank{self.rank}"
        key = f"{self.seed}/{self.step}/{who}/{salt}".encode()
        gen = torch.Generator(device=device)
        gen.manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1))
        return gen

    def shares(self, counts: Sequence[int]) -> list[tuple[str, int]]:
        """Attribution of a concatenated payload (``counts[i]`` elements of slot ``i``)."""
        return [(slot.name, int(c)) for slot, c in zip(self.slots, counts)]


@dataclass
class Reduction:
    """The result of :meth:`Compressor.reduce`.

    Attributes:
        averaged: resolves to one flat fp32 tensor per slot: ``(1/W) * sum_i c_i``.
        residuals: per-slot ``p - c`` for error feedback (``None`` when unused).
        local: optionally, this rank's decoded contribution ``c`` per slot, for compressors without
            error feedback; observers (compression-error logging) use it when present.
        result_nonfinite: set, by the time :attr:`averaged` resolves, by a compressor that
            :attr:`Capabilities.propagates_nonfinite` and checked its averaged values for NaN/Inf while decoding
            (whether it found any); the engine then checks only the dense slots itself. ``None``: the engine checks
            the whole bucket. (The compressor reports through its result; :class:`ReduceContext` only flows in.)
    """

    averaged: Future
    residuals: Optional[list[Tensor]] = None
    local: Optional[Sequence[Tensor]] = None
    result_nonfinite: Optional[bool] = None


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


def split_flat(flat: Tensor, counts: Sequence[int]) -> list[Tensor]:
    """Split a 1-D tensor into consecutive pieces of ``counts`` elements."""
    return list(torch.split(flat, list(counts)))


def contiguous_span(tensors: Sequence[Tensor]) -> Optional[Tensor]:
    """One 1-D view covering ``tensors`` when they lie back to back in one storage (the slots of a bucket), else
    ``None``; a compressor then reads or writes them all without a concatenated copy.

    Example::

        >>> buf = torch.arange(6.0)
        >>> contiguous_span([buf[0:2], buf[2:5]]).tolist(), contiguous_span([buf[0:2], buf[3:5]])
        ([0.0, 1.0, 2.0, 3.0, 4.0], None)
    """
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        if (
            t.dim() != 1
            or t.dtype != first.dtype
            or (t.numel() > 1 and t.stride(0) != 1)
            or t.storage_offset() != offset
            or t.untyped_storage().data_ptr() != storage
        ):
            return None
        offset += t.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


def storage_window(tensors: Sequence[Tensor]) -> Optional[tuple[Tensor, list[int]]]:
    """``(window, offsets)`` when ``tensors`` are non-overlapping 1-D dense views of one storage with one dtype (the
    slots of a bucket, back to back or not): ``window`` is one 1-D view from the first element of any of them to the
    last, and ``tensors[i]`` is ``window[offsets[i] : offsets[i] + tensors[i].numel()]``. Else ``None``.

    An index op on ``window`` at positions inside the tensors touches nothing between them, so one gather or
    scatter serves all the slots of a bucket instead of one call per slot.

    Example::

        >>> buf = torch.arange(8.0)
        >>> window, offsets = storage_window([buf[1:3], buf[5:8]])
        >>> window.tolist(), offsets
        ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], [0, 4])
        >>> storage_window([buf[0:2], torch.zeros(2)]) is None
        True
    """
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    for t in tensors:
        if (
            t.dim() != 1
            or t.dtype != first.dtype
            or (t.numel() > 1 and t.stride(0) != 1)
            or t.untyped_storage().data_ptr() != storage
        ):
            return None
    offsets = [int(t.storage_offset()) for t in tensors]
    spans = sorted((o, o + t.numel()) for o, t in zip(offsets, tensors))
    if any(nxt[0] < prev[1] for prev, nxt in zip(spans, spans[1:])):  # overlapping views
        return None
    start, end = spans[0][0], max(stop for _, stop in spans)
    return first.as_strided((end - start,), (1,), start), [o - start for o in offsets]
