"""A complete custom compressor: its math, a preset name, bit widths L-GreCo tunes (docs/custom-compressor.md)."""

import torch

from lightning_gradcomp.checks import check_int
from lightning_gradcomp.compressors import QuantizedCompressor, SlotCodec
from lightning_gradcomp.functional.quantize import Quantized
from lightning_gradcomp.presets import register_preset


class AbsmaxInt(QuantizedCompressor):
    """``bits``-bit integers times each 128 entries' absmax, all-gathered: ``(W-1)(ceil(n bits/8)+4 ceil(n/128))`` B."""

    param_name = "bits"  # ctx.params holds each layer's width; L-GreCo tunes it (the base class's layer_costs)
    uses_error_feedback = True  # the engine keeps p = memory + gradient; the base class returns the residual p - c

    def __init__(self, bits: int = 4) -> None:
        super().__init__(aggregation="allgather")  # the base class: all-gather, decode, sum in rank order, / W
        self.bits = self.check_param(bits)

    def check_param(self, value: int) -> int:
        return check_int("bits", value, 2, 8)

    def codec(self, bits: int) -> SlotCodec:  # the wire format: codes 0..2L, L = 2^(bits-1) - 1; a scale per 128
        return SlotCodec(levels=2 ** (int(bits) - 1) - 1, group_size=128)

    def encode(self, x: torch.Tensor, codec: SlotCodec, generator: object) -> Quantized:  # c -> (c - L) * s / L
        groups = torch.nn.functional.pad(x, (0, -x.numel() % 128)).view(-1, 128)
        scales = groups.abs().amax(1).clamp_min(1e-30)
        codes = torch.round(groups / scales[:, None] * codec.levels) + codec.levels
        return Quantized(codes.to(torch.uint8).view(-1)[: x.numel()], scales, codec.levels, 128)


register_preset("absmax_int4", "DDP + 4-bit absmax integers with error feedback", lambda: {"compressor": AbsmaxInt(4)})
