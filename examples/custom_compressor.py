"""A complete custom compressor: a preset name, a per-layer bit width L-GreCo tunes (docs/custom-compressor.md)."""

import torch

from lightning_gradcomp.checks import check_int
from lightning_gradcomp.comm import completed_future
from lightning_gradcomp.compressors import Compressor, ReduceContext, Reduction
from lightning_gradcomp.functional.packing import pack_bits, packed_nbytes, unpack_bits
from lightning_gradcomp.presets import register_preset


class AbsmaxInt(Compressor):
    """Per layer, ``bits``-bit integers times an fp32 absmax scale, all-gathered: ``(W-1)(ceil(n bits/8)+4)`` B."""

    param_name = "bits"  # a per-layer parameter: ctx.params holds each layer's value, and L-GreCo can tune it
    uses_error_feedback = True  # the engine keeps p = memory + gradient and memory = residual

    def __init__(self, bits: int = 4) -> None:
        self.bits = self.check_param(bits)

    def check_param(self, value: int) -> int:
        return check_int("bits", value, 2, 8)

    @staticmethod
    def encode(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        scale = (x.abs().max() / (2 ** (bits - 1) - 1)).clamp_min(1e-30)  # -> (packed codes, scale)
        return pack_bits((torch.round(x / scale) + 2 ** (bits - 1) - 1).to(torch.uint8), bits, check=False), scale

    @staticmethod
    def decode(packed: torch.Tensor, scale: torch.Tensor, bits: int, n: int) -> torch.Tensor:
        return (unpack_bits(packed, bits, n).float() - (2 ** (bits - 1) - 1)) * scale

    def layer_costs(self, stat: torch.Tensor, shape: tuple, candidates: list[int]) -> tuple[list, list]:
        x = stat.reshape(-1).float()  # for L-GreCo: the bytes and the error ||x - C(x)|| of each candidate
        return ([packed_nbytes(x.numel(), b) + 4.0 for b in candidates],
                [float((x - self.decode(*self.encode(x, b), b, x.numel())).norm()) for b in candidates])

    def reduce(self, tensors: list[torch.Tensor], ctx: ReduceContext) -> Reduction:
        bits, numels = [int(b) for b in ctx.params], [t.numel() for t in tensors]
        packed, scales = zip(*(self.encode(t, b) for t, b in zip(tensors, bits)))
        sizes = [p.numel() for p in packed]
        all_codes = ctx.comm.all_gather(torch.cat(packed), shares=ctx.shares(sizes))  # (W, bytes) uint8
        all_scales = ctx.comm.all_gather(torch.stack(scales), shares=ctx.shares([1] * len(sizes)))  # (W, L)
        residuals = [t.sub_(self.decode(p, s, b, n)) for t, p, s, b, n in zip(tensors, packed, scales, bits, numels)]
        ranks = [[self.decode(p, s, b, n) for p, s, b, n in zip(codes.split(sizes), scale, bits, numels)]
                 for codes, scale in zip(all_codes, all_scales)]  # summed in rank order: the same on every rank
        return Reduction(completed_future([sum(x) / ctx.world_size for x in zip(*ranks)]), residuals=residuals)


register_preset("absmax_int4", "DDP + 4-bit absmax integers with error feedback", lambda: {"compressor": AbsmaxInt(4)})
