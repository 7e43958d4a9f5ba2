"""The base classes that do the exchange: a new quantizer or sparsifier states only its math.

``QuantizedCompressor`` (encode, all-gather, rank-ordered decode and mean) is exercised by the documented example,
``examples/custom_compressor.py`` (tests/test_examples.py); here a sparsifier on ``SharedIndexCompressor`` and a
quantizer's error feedback and L-GreCo costs from its ``encode`` alone.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import Tensor

from helpers.distributed import run_workers
from helpers.reduce import rank_inputs, reduce_worker
from lightning_gradcomp.comm import all_reduce_bytes
from lightning_gradcomp.compressors import QuantizedCompressor, RandomK, SharedIndexCompressor, SlotCodec
from lightning_gradcomp.compressors.base import ReduceContext
from lightning_gradcomp.functional.quantize import Quantized


class Strided(SharedIndexCompressor):
    """Every ``n // k``-th entry of each layer, from a shared random offset: its math is the choice of entries."""

    def shared_indices(self, tensors: list[Tensor], ks: list[int], ctx: ReduceContext) -> tuple[Tensor, None]:
        out = []
        for t, k, slot in zip(tensors, ks, ctx.slots):
            stride = t.numel() // k
            gen = ctx.generator(t.device, shared=True, salt=slot.name)
            offset = int(torch.randint(stride, (1,), generator=gen, device=t.device))
            out.append(torch.arange(k, device=t.device) * stride + offset)
        return torch.cat(out), None


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_shared_index_sparsifier_states_only_its_entries(world_size: int) -> None:
    shapes = [(40, 10), (7,), (1,), (13, 11)]
    comp = Strided(density=0.1)
    results = run_workers(reduce_worker, world_size, comp, shapes, None, 1, 0, True)
    inputs = [rank_inputs(r, shapes) for r in range(world_size)]
    for layer, shape in enumerate(shapes):
        got = results[0]["steps"][0]["averaged"][layer]
        kept = got != 0
        mean = sum(x[layer] for x in inputs) / world_size
        assert int(kept.sum()) == max(1, round(0.1 * mean.numel()))  # k entries, the exact mean there
        assert torch.allclose(got[kept], mean[kept], rtol=0, atol=1e-6)
        residual = results[0]["steps"][0]["residuals"][layer]
        assert torch.equal(residual[~kept], inputs[0][layer][~kept]) and bool((residual[kept] == 0).all())
        for other in results[1:]:
            assert torch.equal(got, other["steps"][0]["averaged"][layer])
    ks = [max(1, round(0.1 * torch.Size(s).numel())) for s in shapes]
    assert results[0]["stats"]["wire_bytes"] == pytest.approx(all_reduce_bytes(4 * sum(ks), world_size))


def test_the_shared_index_costs_are_randomk_s_and_randomk_runs_on_the_base() -> None:
    stat = torch.randn(500, generator=torch.Generator().manual_seed(0))
    assert Strided(0.05).layer_costs(stat, (500,), [0.01, 0.1]) == RandomK(0.05).layer_costs(stat, (500,), [0.01, 0.1])
    assert isinstance(RandomK(), SharedIndexCompressor) and Strided().tunable


class Nearest(QuantizedCompressor):
    """Round to nearest on ``bits`` bits, one absmax per 4 entries; error feedback from the base class."""

    param_name = "bits"
    uses_error_feedback = True  # type: ignore[assignment]

    def __init__(self, bits: int = 3) -> None:
        super().__init__("allgather")
        self.bits = bits

    def codec(self, bits: Any) -> SlotCodec:
        return SlotCodec(2 ** (int(bits) - 1) - 1, 4)

    def encode(self, x: Tensor, codec: SlotCodec, generator: Optional[torch.Generator]) -> Quantized:
        groups = torch.nn.functional.pad(x, (0, -x.numel() % 4)).view(-1, 4)
        scales = groups.abs().amax(1).clamp_min(1e-30)
        codes = torch.round(groups / scales[:, None] * codec.levels) + codec.levels
        return Quantized(codes.to(torch.uint8).view(-1)[: x.numel()], scales, codec.levels, 4)


def test_a_quantizer_gets_its_residuals_and_its_l_greco_costs_from_encode() -> None:
    comp = Nearest()
    x = torch.tensor([4.0, -2.0, 1.0, 0.5, 3.0, 0.0, 0.0, -3.0, 1.0])
    decoded = comp.encode(x, comp.codec(3), None).decode()
    sizes, errors = comp.layer_costs(x, (9,), [2, 3])
    assert sizes == [3.0 + 12, 4.0 + 12]  # ceil(9 b / 8) bytes of codes + 3 fp32 scales
    assert errors[1] == pytest.approx(float((x - decoded).norm())) and errors[0] > errors[1]
    results = run_workers(reduce_worker, 2, comp, [(9,), (5,)], [3, 2])
    step = results[0]["steps"][0]
    mine = rank_inputs(0, [(9,), (5,)])
    for layer, bits in enumerate([3, 2]):
        c = comp.encode(mine[layer], comp.codec(bits), None).decode()
        assert torch.equal(step["residuals"][layer], mine[layer] - c)  # p - c, written over the input
    assert results[0]["steps"][0]["averaged"][0].equal(results[1]["steps"][0]["averaged"][0])
