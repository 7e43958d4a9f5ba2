r"""DIANA: quantize gradient *differences* against learned shifts (Mishchenko et al., 2019).

Rank ``i`` keeps a shift ``h_i`` and sends ``Q(g_i - h_i)`` (block p-quantization, ternary codes);
the averaged gradient is ``g_hat = h + mean_i Q(g_i - h_i)`` with the master shift ``h = mean_i h_i``,
and both shifts move by ``alpha`` times the quantized differences. With full local gradients the
differences vanish at the optimum, so unlike QSGD/TernGrad the method converges to the exact optimum.

Aggregations (bytes as in :mod:`~lightning_gradcomp.compressors.quantized`):

``"auto"`` (default): ``"allgather"`` at W <= 2 (the same bytes as ``"alltoall"``, one collective), else
    ``"alltoall"``.
``"allgather"``: the paper's algorithm exactly. Every rank decodes all W messages in rank order,
    so the replicated ``h`` (fp32) is bit-identical on all ranks.
``"alltoall"``: the owner of a chunk keeps the exact master shift of its chunk,
    ``h_own += alpha * mean``, forms ``g_hat = h_own + mean`` and sends it back quantized *against a
    second, replicated shift* ``H`` (``Q(g_hat - H)``, ``H += alpha * Q(g_hat - H)``, identical on every
    rank because all decode the same bytes). Both quantized differences vanish at the optimum, so
    exact convergence is kept while the bytes per rank stay independent of W. [Design choice of this
    library, not in the paper: a plain re-quantization of ``mean`` would let ``h`` drift from
    ``mean_i h_i`` by a random walk and stall at a floor.]

State per compressed layer (fp32): ``h_i`` and ``h``/``H`` (two copies of the layer), plus ``h_own``
for the owned chunk (``1/W`` of the layer) with ``"alltoall"``. No error feedback (the quantizer is
unbiased); ``alpha = 0`` turns the shifts off (plain quantized SGD, the paper's special case).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union, cast

import torch
from torch import Tensor

from lightning_gradcomp.checks import ArgumentTypeError, check_group_size, is_number, renamed_argument
from lightning_gradcomp.compressors.base import ReduceContext
from lightning_gradcomp.compressors.owned_state import owned_moved, owned_state, stage_owned, state_copy
from lightning_gradcomp.compressors.quantized import DecodedMessages, QuantizedCompressor
from lightning_gradcomp.compressors.quantized_arguments import check_p
from lightning_gradcomp.compressors.registry import register
from lightning_gradcomp.compressors.staged import StagedState
from lightning_gradcomp.compressors.wire_layout import Segment, SlotCodec
from lightning_gradcomp.functional.axpy import add_scaled
from lightning_gradcomp.functional.dequantize import Quantized, rows_mean
from lightning_gradcomp.functional.quantization_groups import alpha_p

__all__ = ["DIANA", "BlockQuantizer"]


@dataclass(frozen=True, init=False)
class BlockQuantizer:
    """DIANA's block p-quantizer: ternary codes, one ``p``-norm scale per group of ``group_size`` elements (the
    paper's "block").

    Strings are accepted wherever a quantizer is expected: ``"linf"``, ``"l2"``, ``"linf:256"``
    (norm, optionally ``:group_size``).

    Args:
        p: ``"inf"`` (default, lower variance) or ``2``.
        group_size: elements per block.
        block_size: deprecated name of ``group_size`` (warns with a ``DeprecationWarning``).
    """

    p: Union[float, str]
    group_size: int

    def __init__(
        self, p: Union[float, str] = "inf", group_size: int = 128, *, block_size: Optional[int] = None
    ) -> None:
        name, size = renamed_argument(
            "BlockQuantizer", "group_size", group_size, 128, "block_size", block_size, stacklevel=3
        )
        object.__setattr__(self, "p", check_p(p))
        object.__setattr__(self, "group_size", check_group_size(size, name))

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled quantizer, one saved before ``block_size`` became ``group_size`` included."""
        state = dict(state)
        if "block_size" in state:
            state.setdefault("group_size", state.pop("block_size"))
        for key, value in state.items():
            object.__setattr__(self, key, value)

    @property
    def block_size(self) -> int:
        """Deprecated name of :attr:`group_size` (warns)."""
        warnings.warn("`BlockQuantizer.block_size` is deprecated: use `.group_size`", DeprecationWarning, stacklevel=2)
        return self.group_size

    @property
    def alpha_max(self) -> float:
        """``alpha_p(group_size)``: the largest admissible shift step (``1 / (omega + 1)``)."""
        return alpha_p(self.group_size, self.p)

    @property
    def codec(self) -> SlotCodec:
        """The wire encoding (2-bit ternary codes, fp32 block norms)."""
        return SlotCodec(1, self.group_size, cast(float, self.p))  # a float since __init__

    @classmethod
    def parse(cls, spec: Union[BlockQuantizer, str, Mapping[str, Any]]) -> BlockQuantizer:
        """Build from an instance, a string (``"linf"``, ``"l2:64"``) or a mapping ``{p:, group_size:}``."""
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, Mapping):
            try:
                return cls(**dict(spec))
            except (TypeError, ValueError) as err:  # name the argument the user set
                raise type(err)(f"`quantizer` {dict(spec)!r}: {err}") from None
        if isinstance(spec, str):
            norm, _, block = spec.partition(":")
            try:
                size = int(block) if block else 128
            except ValueError:
                raise ValueError(
                    f"`quantizer` string must look like 'linf', 'l2' or 'linf:128', got {spec!r}"
                ) from None
            try:
                return cls(norm, size)
            except ValueError as err:  # name the argument the user set
                raise ValueError(f"`quantizer` {spec!r}: {err}") from None
        raise ArgumentTypeError(
            f"`quantizer` must be a BlockQuantizer, a string like 'linf:128' or a mapping, got {spec!r}"
        )

    def __str__(self) -> str:
        return f"{'linf' if self.p == math.inf else 'l2'}:{self.group_size}"


@register("diana")
class DIANA(QuantizedCompressor):
    """DIANA with block p-quantization of ``g_i - h_i``.

    Args:
        quantizer: the block quantizer: a :class:`BlockQuantizer`, ``"linf"``/``"l2"`` with an optional
            ``":<group_size>"`` (default ``"linf:128"``), or a mapping ``{p: inf, group_size: 128}``.
        alpha: shift step in ``[0, alpha_p(group_size)]``; default ``alpha_p / 2`` (the paper's choice).
            0 disables the shifts (plain quantized SGD, for comparison).
        aggregation: ``"auto"`` (default: ``"allgather"`` at W <= 2, else ``"alltoall"``), ``"alltoall"``
            (W-independent bytes) or ``"allgather"`` (the paper's exact aggregation; bytes grow with W). Both keep
            ``h``/``H`` in the same state, so a checkpoint moves between them (``"auto"`` at another W).
    """

    def __init__(
        self,
        quantizer: Union[BlockQuantizer, str, Mapping[str, Any]] = "linf:128",
        alpha: Optional[float] = None,
        aggregation: str = "auto",
    ) -> None:
        super().__init__(aggregation)
        self.quantizer: BlockQuantizer = BlockQuantizer.parse(quantizer)
        limit = self.quantizer.alpha_max
        if alpha is None:
            alpha = limit / 2
        if not is_number(alpha):
            raise ArgumentTypeError(f"`alpha` must be a number (or None for alpha_p / 2), got {alpha!r}")
        if not 0.0 <= alpha <= limit:
            raise ValueError(
                f"`alpha` must be a number in [0, alpha_p = {limit:.6g}] for quantizer {self.quantizer} "
                f"(alpha_p(d) = 1/sqrt(d) for l2, 2/(1+sqrt(d)) for linf); got {alpha!r}"
            )
        self.alpha: float = float(alpha)
        self._local = StagedState()
        self._shift = StagedState()
        self._owned = StagedState()
        self._pending: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        """Per slot of the reduce in progress: committed ``h_i``, its new buffer, committed ``H``, its new buffer."""

    def codec(self, param: Any) -> SlotCodec:
        return self.quantizer.codec

    # ------------------------------------------------------------------ shifts
    # Each reduce reads the committed shifts (``peek``) and computes the new ones into new tensors, staged at the end:
    # one pass per update, no working copy of the state.
    def _committed(self, store: StagedState, name: str, like: Tensor) -> Tensor:
        """The committed shift of ``name`` (zeros when new or resized), on ``like``'s device."""
        value = store.peek(name)
        if value is None or value.numel() != like.numel():
            return torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
        return value if value.device == like.device else value.to(like.device)

    def _encode_inputs(self, tensors: list[Tensor], ctx: ReduceContext) -> tuple[list[Tensor], Optional[list[Tensor]]]:
        """``g_i - h_i``, subtracted in the quantization pass (the gradient is left as it is); the new shifts go into
        buffers staged by :meth:`_reduced`."""
        self._pending = {}
        shifts = []
        for slot, g in zip(ctx.slots, tensors):
            local = self._committed(self._local, slot.name, g)
            shift = self._committed(self._shift, slot.name, g)
            self._pending[slot.name] = (local, torch.empty_like(local), shift, torch.empty_like(shift))
            shifts.append(local)
        return tensors, shifts

    def _after_encode(
        self, tensors: list[Tensor], decoded: DecodedMessages, ctx: ReduceContext
    ) -> tuple[Optional[list[Tensor]], Optional[Sequence[Tensor]]]:
        """``local = h_i + Q(g_i - h_i)`` (this rank's gradient estimate; only when observed), and the new
        ``h_i + alpha Q(...)``."""
        local = []
        for i, slot in enumerate(ctx.slots):
            h, h_new, _, _ = self._pending[slot.name]
            estimate = torch.empty_like(h) if ctx.observed else None
            decoded.message(i).decode_add(h, self.alpha, h_new, 1.0, estimate)  # one pass from the codes
            if estimate is not None:
                local.append(estimate)
        return None, local if ctx.observed else None

    def _exact_mean(self, ctx: ReduceContext, slot: int, piece: Quantized, out: Tensor) -> None:
        _, _, h, h_new = self._pending[ctx.slots[slot].name]
        add_scaled(rows_mean(piece), h, self.alpha, h_new, 1.0, out)  # h + alpha * mean and h + mean, one pass

    def _owner_message(self, ctx: ReduceContext, seg: Segment, mean: Tensor) -> Tensor:
        name = ctx.slots[seg.slot].name
        if owned_moved(self._owned, name, seg):
            warnings.warn(
                f"DIANA: the chunk of {name!r} owned by this rank moved; its master shift restarts at 0", stacklevel=2
            )
        own = owned_state(self._owned, name, seg, mean.device)
        moved, g_hat = torch.empty_like(mean), torch.empty_like(mean)
        add_scaled(mean, own, self.alpha, moved, 1.0, g_hat)  # h_own + alpha * mean and g_hat = h_own + mean
        stage_owned(self._owned, name, seg, moved)
        return g_hat  # sent as g_hat - H (_owner_shift), subtracted in the quantization pass

    def _owner_shift(self, ctx: ReduceContext, seg: Segment) -> Optional[Tensor]:
        return self._pending[ctx.slots[seg.slot].name][2][seg.start : seg.end]  # H

    def _received(self, ctx: ReduceContext, seg: Segment, piece: Quantized, out: Tensor) -> None:
        _, _, shift, shift_new = self._pending[ctx.slots[seg.slot].name]
        # out = H + Q and H_new = H + alpha Q in one pass from the codes
        piece.decode_add(shift[seg.start : seg.end], 1.0, out, self.alpha, shift_new[seg.start : seg.end])

    def _reduced(self, ctx: ReduceContext) -> None:
        """Stage the new shifts ``h_i`` and ``H`` of every slot (every segment of them has been written)."""
        for slot in ctx.slots:
            _, h_new, _, shift_new = self._pending.pop(slot.name)
            self._local[slot.name] = h_new
            self._shift[slot.name] = shift_new

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """``local`` (h_i), ``shift`` (h or H, identical on all ranks) and ``owned`` (h_own) per layer."""
        return {
            "aggregation": self.aggregation,
            "local": state_copy(self._local),
            "shift": state_copy(self._shift),
            "owned": state_copy(self._owned),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("aggregation", self.aggregation) if state else self.aggregation
        if "auto" not in (saved, self.aggregation) and saved != self.aggregation:
            raise ValueError(
                f"DIANA state was saved with aggregation={state['aggregation']!r}, "
                f"this compressor uses {self.aggregation!r}"
            )
        self._local.load(state_copy(state.get("local", {})))
        self._shift.load(state_copy(state.get("shift", {})))
        self._owned.load(state_copy(state.get("owned", {})))

    def reset_state(self) -> None:
        for store in (self._local, self._shift, self._owned):
            store.clear()

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        return f"quantizer='{self.quantizer}', alpha={self.alpha:.6g}" + (f", {extra}" if extra else "")
