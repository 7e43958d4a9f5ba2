"""SignSGD: scaled sign (1 bit per element) with worker- and server-side error feedback."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import ReduceContext
from lightning_gradcomp.compressors.owned_state import owned_state, stage_owned, state_copy
from lightning_gradcomp.compressors.quantized import DecodedMessages, QuantizedCompressor
from lightning_gradcomp.compressors.quantized_arguments import resolve_group_size
from lightning_gradcomp.compressors.registry import register
from lightning_gradcomp.compressors.staged import StagedState
from lightning_gradcomp.compressors.wire_layout import Segment, SlotCodec
from lightning_gradcomp.functional.dequantize import Quantized
from lightning_gradcomp.functional.scaled_sign import sign_quantize

__all__ = ["SignSGD"]


@register("signsgd")
class SignSGD(QuantizedCompressor):
    """Scaled sign compression ``c = mean(|p|) * sign(p)`` per group, with error feedback (EF-SignSGD).

    The engine keeps the worker memory ``m`` (``p = m + g``, residual ``p - c``). With the all-to-all
    aggregation the owner of a chunk re-compresses the average with its own *server* error memory
    (``v = mean + e``, send ``sign(v)``, ``e <- v - c(v)``), as in DeepSpeed's 1-bit Adam, so the second
    quantization's bias is fed back too. The server memory is per-rank state (checkpointed).
    Bytes per rank (all-to-all): ``~ 2 (W-1)/W * (n/8 + 4 n/group_size)``: 30x less than fp32 at 512.

    Args:
        group_size: elements per fp32 scale (mean absolute value of the group).
        aggregation: ``"auto"`` (default: ``"allgather"`` at W <= 2, else ``"alltoall"``), ``"alltoall"`` or
            ``"allgather"`` (exact mean of the per-rank signs; no server memory).
        bucket_size: deprecated name of ``group_size`` (warns with a ``DeprecationWarning``).
    """

    def __init__(self, group_size: int = 512, aggregation: str = "auto", *, bucket_size: Optional[int] = None) -> None:
        super().__init__(aggregation)
        self.group_size: int = resolve_group_size("SignSGD", group_size, bucket_size)
        self._server = StagedState()

    @property
    def uses_error_feedback(self) -> bool:
        return True

    def codec(self, param: Any) -> SlotCodec:
        return SlotCodec(0, self.group_size)

    def _quantize(
        self, index: int, x: Tensor, codec: SlotCodec, ctx: ReduceContext, shift: Optional[Tensor]
    ) -> Quantized:
        """Slot ``index``'s message; unless an observer reads the inputs, the pass also writes the residual ``p - c``
        over ``x`` (the engine's ``p``), each scale group's while it is in cache (see :meth:`_after_encode`)."""
        if ctx.observed:
            return super()._quantize(index, x, codec, ctx, shift)
        assert shift is None  # SignSGD encodes its inputs as given
        return sign_quantize(x, codec.group_size, residual=x)

    def _after_encode(
        self, tensors: list[Tensor], decoded: DecodedMessages, ctx: ReduceContext
    ) -> tuple[Optional[list[Tensor]], Optional[Sequence[Tensor]]]:
        """The residuals ``p - c`` in the engine's storage: written by :meth:`_quantize` already, or here (when an
        observer read the inputs), straight from the codes. The same bits either way (exactly ``p.sub_(c)``)."""
        if ctx.observed:
            for i, p in enumerate(tensors):
                decoded.message(i).decode_add(p, -1.0, p)
        return tensors, None

    def _owner_message(self, ctx: ReduceContext, seg: Segment, mean: Tensor) -> Tensor:
        return mean + owned_state(self._server, ctx.slots[seg.slot].name, seg, mean.device)

    def _owner_sent(self, ctx: ReduceContext, seg: Segment, message: Tensor, sent: Quantized) -> None:
        server = torch.empty_like(message)
        sent.decode_add(message, -1.0, server)  # e <- v - c(v), straight from the codes
        stage_owned(self._server, ctx.slots[seg.slot].name, seg, server)

    def state_dict(self) -> dict[str, Any]:
        return {"server": state_copy(self._server)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._server.load(state_copy(state.get("server", {})))

    def reset_state(self) -> None:
        self._server.clear()

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        return f"group_size={self.group_size}" + (f", {extra}" if extra else "")
