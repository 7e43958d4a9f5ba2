"""A huge but finite gradient never becomes a non-finite result or state: 16-bit sparse values saturate instead of
overflowing to Inf (``compressors.sparse.saturated_wire_values``), and 2-norm quantization scales do not overflow
(``functional.quantize.group_norms``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers.distributed import run_workers
from helpers.engine import train_through_hook
from helpers.trees import tensors

from lightning_gradcomp.compressors import CLTK, DIANA, QSGD, Compressor, RandomK, TopK
from lightning_gradcomp.compressors.sparse import saturated_wire_values

HALVES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8, 64])
def test_no_sum_of_world_saturated_values_overflows(dtype: torch.dtype, world: int) -> None:
    """The largest values, summed ``world`` at a time in ``dtype`` in any order (each partial sum rounded), stay
    finite; values below the limit are the plain cast of ``values / world``, NaN stays NaN."""
    huge = torch.tensor([3e38, -3e38, 1e6, -7e4, 65504.0])
    for value in saturated_wire_values(huge, dtype, world):
        total = torch.zeros((), dtype=dtype)
        for _ in range(world):
            total = (total + value).to(dtype)
        assert torch.isfinite(total) and torch.isfinite(value)
    plain = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 100
    assert torch.equal(saturated_wire_values(plain, dtype, world), plain.div(world).to(dtype))
    assert torch.isnan(saturated_wire_values(torch.tensor([float("nan")]), dtype, world)).all()


def test_fp32_values_are_sent_as_they_are() -> None:
    values = torch.tensor([3e38, 1.0])
    assert saturated_wire_values(values, torch.float32, 3) is values


COMPRESSORS: dict[str, Callable[[], Compressor]] = {
    "topk fp16": lambda: TopK(0.2, value_dtype=torch.float16),
    "topk fp16 delta16": lambda: TopK(0.2, value_dtype=torch.float16, index_coding="delta16"),
    "randomk fp16": lambda: RandomK(0.3, value_dtype=torch.float16),
    "randomk unbiased fp16": lambda: RandomK(0.3, unbiased=True, value_dtype=torch.float16),
    "cltk fp16": lambda: CLTK(0.2, value_dtype=torch.float16),
    "cltk approx fp16": lambda: CLTK(0.2, selection="approx", value_dtype=torch.float16),
    "cltk bf16": lambda: CLTK(0.2, value_dtype=torch.bfloat16),
    "qsgd l2": lambda: QSGD(8, bucket_size=64, p=2),
    "diana l2": lambda: DIANA("l2:64"),
}
SELECTS_LARGEST = {"topk fp16", "topk fp16 delta16", "cltk fp16", "cltk approx fp16", "cltk bf16"}
POISON_STEP = 3


BIG = [1e6, 1e30]


def _train(rank: int, world: int) -> dict[tuple[str, float], tuple]:
    out: dict[tuple[str, float], tuple] = {}
    for big in BIG:
        for name, make in COMPRESSORS.items():
            grads: list[torch.Tensor] = []
            model, hook = train_through_hook(rank, make(), steps=6, poison_steps={POISON_STEP}, poison=big, grads=grads)
            state = [t for t in tensors(hook.state_dict()) if t.is_floating_point()]  # memories, DIANA's shifts...
            first = next(iter(hook.memory.memories.values()), None)  # the first layer's memory
            out[name, big] = ([p.detach() for p in model.parameters()], grads, state, hook.stats.nonfinite_steps, first)
    return out


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_a_huge_finite_gradient_stays_finite(world: int) -> None:
    """Rank 1's gradient entry of 1e6 or 1e30 (finite; beyond fp16's 65504, and 1e30's square beyond fp32's range):
    through 16-bit sparse values and 2-norm quantizers every step's averaged gradient, every parameter and state
    tensor stay finite, replicas identical, no step counted non-finite, and a compressor that keeps the
    largest entries sends that one (saturated in fp16: the rest stays in rank 1's memory)."""
    results = run_workers(_train, world, timeout=120)
    for key in results[0]:
        name = key[0]
        params0 = results[0][key][0]
        for rank, result in enumerate(results):
            params, grads, state, nonfinite, _ = result[key]
            assert all(torch.equal(a, b) for a, b in zip(params, params0)), (key, rank)
            assert all(torch.isfinite(t).all() for t in [*params, *grads, *state]), (key, rank)
            assert nonfinite == 0, key
        # weight[0, 0], the first entry, carries the poison; CLT-k sends it once rank 1 leads
        if name in SELECTS_LARGEST:
            sent = max(float(step[0]) for step in results[0][key][1][POISON_STEP:])
            assert sent > 1e4 / world, key
        if name.startswith("topk fp16"):  # beyond 65504: the part clamped off stays in rank 1's memory for later steps
            assert float(results[1][key][4].reshape(-1)[0]) > 1e4, key
