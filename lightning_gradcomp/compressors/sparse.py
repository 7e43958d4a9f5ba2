"""Shared pieces of the sparsifying compressors (TopK, RandomK, CLTK): ``density`` (the fraction of each layer's
elements kept; the deprecated ``ratio=`` still accepted), its L-GreCo costs and wire packing, and
:class:`SharedIndexCompressor`, the exchange of a sparsifier whose ranks keep the same entries (RandomK)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.checks import check_dtype, check_number
from lightning_gradcomp.comm import then_same_numerics
from lightning_gradcomp.compressors.base import (
    Capabilities,
    Compressor,
    ReduceContext,
    Reduction,
)
from lightning_gradcomp.functional.layerwise import randomk_errors, sparse_sizes, topk_errors
from lightning_gradcomp.functional.slot_views import split_flat, storage_window
from lightning_gradcomp.functional.sparsify import int32_index_words, kept_count, repeated_offsets, scatter_dense

__all__ = [
    "INDEX_CODINGS",
    "SharedIndexCompressor",
    "SparseCompressor",
    "check_index_coding",
    "resolve_density",
    "check_value_dtype",
    "pack_bytes",
    "saturated_wire_values",
    "slot_positions",
    "slot_shift",
    "unpack_bytes",
]

_VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_value_dtype(value_dtype: torch.dtype | str) -> torch.dtype:
    """Validate the wire dtype of sparse values (fp32, fp16 or bf16; strings such as ``"float16"`` accepted)."""
    return check_dtype("value_dtype", value_dtype, _VALUE_DTYPES)


INDEX_CODINGS = ("int32", "delta16")
"""How a sparsifier's indices travel: int32, or ``delta16`` (uint16 gaps between sorted indices, about half the
bytes: :func:`~lightning_gradcomp.functional.sparsify.encode_delta16`)."""


def check_index_coding(index_coding: Any) -> str:
    """Validate the ``index_coding`` argument (``"int32"`` or ``"delta16"``)."""
    if index_coding not in INDEX_CODINGS:
        raise ValueError(f"`index_coding` must be 'int32' or 'delta16', got {index_coding!r}")
    return str(index_coding)


def saturated_wire_values(values: Tensor, dtype: torch.dtype, world_size: int = 1) -> Tensor:
    """``values / world_size`` in the 16-bit wire ``dtype``, clamped so that no value, and no sum of ``world_size`` of
    them (an all-reduce in ``dtype``, each partial sum rounded), overflows to Inf: magnitudes at most
    ``finfo(dtype).max * (1 - eps / 2) ** (world_size + 1) / world_size`` (fp16: about 65,400 / W). With error
    feedback the part clamped off stays in the residual ``p - c``, to be sent at later steps; where nothing is
    clamped the result is the plain ``(values / world_size).to(dtype)``. fp32: ``values`` unchanged (sums of them
    overflow only beyond ``3.4e38``). NaN stays NaN.

    Example::

        >>> saturated_wire_values(torch.tensor([1e5, -1e5, 3.0, float("nan")]), torch.float16, 2).tolist()
        [32704.0, -32704.0, 1.5, nan]
    """
    if dtype == torch.float32:
        return values
    info = torch.finfo(dtype)
    limit = info.max * (1.0 - info.eps / 2) ** (world_size + 1) / world_size
    scaled = values if world_size == 1 else values.div(world_size)
    return scaled.clamp(-limit, limit).to(dtype)


def pack_bytes(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate tensors of any dtypes into one uint8 tensor (their raw bytes)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack_bytes(raw: Tensor, specs: Sequence[tuple[torch.dtype, int]]) -> list[Tensor]:
    """Inverse of :func:`pack_bytes` for ``specs`` = ``(dtype, numel)`` per piece."""
    out, pos = [], 0
    for dtype, numel in specs:
        size = torch.empty((), dtype=dtype).element_size()
        piece = raw[pos : pos + numel * size]
        out.append((piece if piece.storage_offset() % size == 0 else piece.clone()).view(dtype))  # aligned views only
        pos += numel * size
    return out


def slot_shift(tensors: Sequence[Tensor], counts: Sequence[int]) -> Optional[tuple[Tensor, Tensor]]:
    """``(window, shift)``: one view over ``tensors`` (:func:`~.functional.slot_views.storage_window`) and each slot's
    offset in it repeated ``counts[l]`` times, which turns concatenated per-slot indices (``counts[l]`` of them in slot
    ``l``) into positions in the window; ``None`` when ``tensors`` are not views of one buffer.

    Example::

        >>> buf = torch.arange(10.0)
        >>> window, shift = slot_shift([buf[0:3], buf[6:10]], [1, 2])
        >>> shift.tolist(), window.index_select(0, torch.tensor([2, 0, 3]) + shift).tolist()
        ([0, 6, 6], [2.0, 6.0, 9.0])
    """
    found = storage_window(tensors)
    if found is None:
        return None
    window, offsets = found
    return window, repeated_offsets(tuple(offsets), tuple(counts), tensors[0].device)


def slot_positions(tensors: Sequence[Tensor], local: Tensor, ks: Sequence[int]) -> Optional[tuple[Tensor, Tensor]]:
    """``(window, positions)``: :func:`slot_shift`'s window and the concatenated per-slot indices ``local`` (``ks[l]``
    of them in slot ``l``) as positions in it, for one gather or scatter over all the slots; ``None`` when ``tensors``
    are not views of one buffer.

    Example::

        >>> buf = torch.arange(10.0)
        >>> window, positions = slot_positions([buf[0:3], buf[6:10]], torch.tensor([2, 0, 3]), [1, 2])
        >>> window.index_select(0, positions).tolist()
        [2.0, 6.0, 9.0]
    """
    found = slot_shift(tensors, ks)
    return None if found is None else (found[0], local + found[1])


def resolve_density(owner: str, density: Any, ratio: Any, default: float) -> float:
    """The validated kept fraction from a sparsifier's ``density=`` and its deprecated alias ``ratio=``.

    ``ratio`` (when not ``None``) warns with a :class:`DeprecationWarning` naming ``density`` and wins over a
    ``density`` left at its ``default``; both set to different values raise ``TypeError``. The value is checked
    under the name the caller used.

    Example::

        >>> resolve_density("TopK", 0.05, None, 0.01)
        0.05
    """
    if ratio is None:
        return float(check_number("density", density, 0.0, 1.0))
    warnings.warn(
        f"{owner}(ratio=...) is deprecated: use {owner}(density={ratio!r}), the fraction of each layer's elements "
        f"kept (dense / wire bytes are the 'compression')",
        DeprecationWarning,
        stacklevel=3,
    )
    if density != default and density != ratio:
        raise TypeError(
            f"{owner}: pass `density` only (`ratio` is its deprecated name), got both {density} and {ratio}"
        )
    return float(check_number("ratio", ratio, 0.0, 1.0))


class SparseCompressor(Compressor):
    """A compressor keeping a fraction ``density`` of each layer's elements (per-layer settable).

    Its L-GreCo costs are those of keeping the ``k`` largest entries with a 4-byte index each; subclasses that
    select or send otherwise (RandomK) override :meth:`layer_costs`.

    ``ratio`` (argument and attribute) is the deprecated name of ``density``: it warns with a
    :class:`DeprecationWarning`, and a compressor pickled with a ``ratio`` attribute loads as ``density``.
    """

    param_name = "density"
    capabilities = Capabilities(sparse_outputs=True)  # zeros plus k entries per layer, through ctx.output

    def __init__(
        self, density: float = 0.01, value_dtype: torch.dtype | str = torch.float32, *, ratio: Optional[float] = None
    ) -> None:
        self.density: float = resolve_density(type(self).__name__, density, ratio, 0.01)
        self.value_dtype: torch.dtype = check_value_dtype(value_dtype)

    @property
    def ratio(self) -> float:
        """Deprecated name of :attr:`density` (warns)."""
        warnings.warn("`.ratio` is deprecated: use `.density`", DeprecationWarning, stacklevel=2)
        return self.density

    @ratio.setter
    def ratio(self, value: float) -> None:
        warnings.warn("`.ratio` is deprecated: use `.density`", DeprecationWarning, stacklevel=2)
        self.density = self.check_param(value)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled compressor, one saved before ``ratio`` became ``density`` included."""
        state = dict(state)
        if "ratio" in state:
            state.setdefault("density", state.pop("ratio"))
        self.__dict__.update(state)

    @property
    def uses_error_feedback(self) -> bool:
        return True

    def check_param(self, value: Any) -> float:
        return float(check_number("density", value, 0.0, 1.0))

    def candidate_grid(self, min_factor: float, max_factor: float, num: int) -> list[Any]:
        """``num`` densities spaced geometrically from ``min_factor d`` to ``max_factor d`` (``[d]`` when ``num``
        is 1), ``d`` the default density."""
        d, low, high = self.density, min_factor, max_factor
        return [d * (low * (high / low) ** (i / (num - 1))) if num > 1 else d for i in range(num)]

    def layer_costs(
        self, stat: Tensor, shape: Sequence[int], candidates: Sequence[Any]
    ) -> tuple[list[float], list[float]]:
        """Bytes ``k (value bytes + 4)`` (``+ 8`` above ``2**31`` elements: int64 positions) and top-``k`` errors (the
        norm outside the ``k`` largest ``|A_i|``), ``k`` the kept count of each density (see
        :meth:`Compressor.layer_costs`)."""
        ks = [kept_count(stat.numel(), r) for r in candidates]
        index_bytes = 4 * int32_index_words(stat.numel())
        return sparse_sizes(ks, self.value_dtype.itemsize, index_bytes), topk_errors(stat, ks)

    def extra_repr(self) -> str:
        extra = "" if self.value_dtype == torch.float32 else f", value_dtype={self.value_dtype}"
        return f"density={self.density}{extra}"


class SharedIndexCompressor(SparseCompressor):
    """A sparsifier whose ranks keep the same entries of each layer: it does the exchange, a subclass states which
    entries (:meth:`shared_indices`).

    The kept values (fp32, or 16-bit divided by W and saturated: :func:`saturated_wire_values`) travel in one
    sum-all-reduce, no indices travel; each rank's residual ``p - c`` is its input with the kept entries' sent values
    taken out (with error feedback), and the averaged sums are scattered into zeroed outputs. Bytes per rank:
    ``2 (W-1)/W * sum_l k_l * value bytes``, independent of W. Its :meth:`layer_costs` are those of keeping ``k``
    entries chosen without looking at them (each kept with probability ``k/n``).
    """

    def shared_indices(
        self, tensors: list[Tensor], ks: list[int], ctx: ReduceContext
    ) -> tuple[Tensor, Optional[Tensor]]:
        """``(indices, weights)``: the ``ks[i]`` indices kept in slot ``i`` (int64, within the slot), concatenated
        over the slots, identical on every rank (draw them from ``ctx.generator(device, shared=True,
        salt=slot.name)``); and ``None``, or one factor per index that scales the kept value before it is sent."""
        raise NotImplementedError

    def layer_costs(
        self, stat: Tensor, shape: Sequence[int], candidates: Sequence[Any]
    ) -> tuple[list[float], list[float]]:
        """Bytes ``k * value bytes`` (no indices travel) and expected errors ``sqrt(1 - k/n) ||A||`` of keeping ``k``
        entries chosen without looking at them (see :meth:`Compressor.layer_costs`)."""
        ks = [kept_count(stat.numel(), r) for r in candidates]
        return sparse_sizes(ks, self.value_dtype.itemsize, index_bytes=0), randomk_errors(stat, ks)

    def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
        """Shared indices, one all-reduce of the concatenated values.

        The sums are scattered into the outputs (the bucket's slices) by one call for the whole bucket
        (:func:`~.functional.slot_views.storage_window`); inputs that are slices of one buffer are gathered and given
        their residuals by one call each too. Otherwise one call per slot."""
        ks = [kept_count(t.numel(), r) for t, r in zip(tensors, ctx.params)]
        numels = [t.numel() for t in tensors]
        local, weights = self.shared_indices(tensors, ks, ctx)  # indices within each slot
        gathered = slot_positions(tensors, local, ks)
        if gathered is not None:
            values = gathered[0].index_select(0, gathered[1])
        else:
            values = torch.cat([t.index_select(0, i) for t, i in zip(tensors, split_flat(local, ks))])
        if weights is not None:
            values = values * weights.to(values.dtype)
        world = ctx.world_size
        # 16 bits: divided by W and saturated (the all-reduce's sums never overflow to Inf)
        sent = saturated_wire_values(values, self.value_dtype, world)
        residuals = None
        if self.uses_error_feedback:
            contribution = sent if self.value_dtype == torch.float32 else sent.to(torch.float32).mul_(world)
            lost = values - contribution  # p - c at the kept entries (zeros in fp32), c as the wire carries it
            if gathered is not None:
                gathered[0].scatter_(0, gathered[1], lost)
            else:
                for t, i, r in zip(tensors, split_flat(local, ks), split_flat(lost, ks)):
                    t.scatter_(0, i, r)
            residuals = tensors
        fut = ctx.comm.all_reduce(sent, async_op=True, shares=ctx.shares(ks))
        scale = 1.0 if self.value_dtype != torch.float32 else 1.0 / world
        outputs = [ctx.output(slot, t) for slot, t in enumerate(tensors)]  # zeroed while the values travel
        scattered = slot_positions(outputs, local, ks)

        def decode(f: torch.futures.Future) -> list[Tensor]:
            summed = f.value().to(torch.float32).mul_(scale)
            if scattered is not None:
                scattered[0].scatter_add_(0, scattered[1], summed)
                return outputs
            return [
                scatter_dense(n, i, v, out=out)
                for n, out, i, v in zip(numels, outputs, split_flat(local, ks), split_flat(summed, ks))
            ]

        return Reduction(averaged=then_same_numerics(fut, decode, ctx.comm.stats), residuals=residuals)
