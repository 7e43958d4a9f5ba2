"""Compressors describe their own L-GreCo costs: the same numbers as the callback's former per-family tables."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, ClassVar, Sequence

import pytest
import torch
from torch import Tensor

from lightning_gradcomp.callbacks import LGreCo
from lightning_gradcomp.callbacks.lgreco import layer_candidates, layer_table
from lightning_gradcomp.compressors import (CLTK, DIANA, QSGD, Cast, Compressor, NoCompression, PowerSGD, RandomK,
                                            ReduceContext, Reduction, SignSGD, TernGrad, TopK)
from lightning_gradcomp.functional.layerwise import (lowrank_errors, lowrank_sizes, quantization_errors,
                                                     quantized_sizes, randomk_errors, sparse_sizes, topk_errors)
from lightning_gradcomp.functional.lowrank import lowrank_saves, matrix_shape
from lightning_gradcomp.functional.sparsify import kept_count


# ---------------------------------------------------------------------------------------------- the former tables
def _old_table(compressor: Any, stat: Tensor, shape: Sequence[int], candidates: Sequence[Any]) -> tuple:
    """``layer_table`` as ``callbacks/lgreco.py`` computed it before compressors described their costs."""
    family, numel = compressor.param_name, stat.numel()
    if family == "rank":
        return lowrank_sizes(shape, candidates), lowrank_errors(stat.reshape(matrix_shape(shape)), candidates)
    if family == "density":
        ks = [kept_count(numel, r) for r in candidates]
        value_bytes = torch.empty((), dtype=getattr(compressor, "value_dtype", torch.float32)).element_size()
        if isinstance(compressor, RandomK):
            return sparse_sizes(ks, value_bytes, index_bytes=0), randomk_errors(stat, ks)
        return sparse_sizes(ks, value_bytes), topk_errors(stat, ks)
    bucket, p = int(getattr(compressor, "bucket_size", 512)), getattr(compressor, "p", "inf")
    return quantized_sizes(numel, candidates, bucket), quantization_errors(stat, candidates, bucket, p)


def _old_candidates(compressor: Any, shape: Sequence[int], candidates: Sequence[Any]) -> list:
    out = set()
    for value in [*candidates, compressor.default_param]:
        try:
            value = compressor.check_param(value)
        except (TypeError, ValueError):
            continue
        if compressor.param_name == "rank":
            n, m = matrix_shape(shape)
            if not lowrank_saves(n, m, value, 1.0) and value != compressor.default_param:
                continue
        out.add(value)
    return sorted(out)


def _old_grid(default: Any, family: str, low: float, high: float, num: int) -> list:
    if family == "density":
        return [default * (low * (high / low) ** (i / (num - 1))) if num > 1 else default for i in range(num)]
    return list(range(max(1, math.floor(low * default)), math.ceil(high * default) + 1))


COMPRESSORS = {
    "powersgd": lambda: PowerSGD(rank=4),
    "powersgd_r2": lambda: PowerSGD(rank=2, min_compression_rate=1.0),
    "topk": lambda: TopK(0.1),
    "topk_fp16": lambda: TopK(0.05, value_dtype=torch.float16),
    "cltk": lambda: CLTK(0.01),
    "cltk_bf16_delta16": lambda: CLTK(0.1, value_dtype=torch.bfloat16, index_coding="delta16"),
    "randomk": lambda: RandomK(0.1),
    "randomk_unbiased_fp16": lambda: RandomK(0.02, unbiased=True, value_dtype="float16"),
    "qsgd": lambda: QSGD(bits=4),
    "qsgd_l2_128": lambda: QSGD(bits=3, bucket_size=128, p=2),
    "qsgd_odd_bucket": lambda: QSGD(bits=8, bucket_size=7),
}
SHAPES = [(16, 24), (64, 3, 3, 3), (7,), (5, 300), (1, 1)]
RAW: dict[Any, list[Any]] = {"rank": [1, 2, 3, 4, 8, 16, 40], "density": [0.001, 0.01, 0.05, 0.1, 0.5, 1.0],
                             "bits": [2, 3, 4, 5, 6, 7, 8]}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_costs_equal_the_former_tables(name: str, shape: tuple[int, ...]) -> None:
    compressor = COMPRESSORS[name]()
    assert compressor.tunable
    stat = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) + shape[0])) * 3.0
    candidates = RAW[compressor.param_name]
    expected = _old_table(compressor, stat.reshape(-1), shape, candidates)
    assert compressor.layer_costs(stat.reshape(-1), shape, candidates) == expected
    assert layer_table(compressor, stat.reshape(-1), shape, candidates) == expected
    assert compressor.layer_costs(stat, shape, candidates) == expected  # shaped statistics work too
    grid = compressor.layer_candidates(shape, candidates)
    assert grid == layer_candidates(compressor, shape, candidates) == _old_candidates(compressor, shape, candidates)


@pytest.mark.parametrize("factors", [(0.25, 4.0, 9), (0.5, 2.0, 5), (1.0, 1.0, 1), (0.1, 3.0, 2)])
@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_candidate_grid_equals_the_former_grid(name: str, factors: tuple[float, float, int]) -> None:
    compressor = COMPRESSORS[name]()
    expected = _old_grid(compressor.default_param, str(compressor.param_name), *factors)
    assert compressor.candidate_grid(*factors) == expected
    cb = LGreCo(min_factor=factors[0], max_factor=factors[1], num_candidates=factors[2])
    assert cb.grid(compressor, (64, 48)) == _old_candidates(compressor, (64, 48), expected)


class _NoCosts(Compressor):
    """A per-layer parameter, but no ``layer_costs``."""

    param_name: ClassVar[str] = "level"

    def __init__(self) -> None:
        self.level = 3

    def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
        raise NotImplementedError


@pytest.mark.parametrize("make, reason", [
    (TernGrad, "no per-layer parameter"), (DIANA, "no per-layer parameter"), (SignSGD, "no per-layer parameter"),
    (NoCompression, "no per-layer parameter"), (Cast, "no per-layer parameter"),
    (_NoCosts, "does not implement layer_costs"),
])
def test_untunable_compressors_say_so(make: Any, reason: str) -> None:
    compressor = make()
    assert not compressor.tunable
    name = type(compressor).__name__
    calls = [lambda: compressor.layer_costs(torch.ones(4), (4,), [1]), lambda: compressor.candidate_grid(0.5, 2, 3),
             lambda: compressor.layer_candidates((4,), [1]), lambda: layer_table(compressor, torch.ones(4), (4,), [1])]
    for call in calls:
        with pytest.raises(ValueError, match=f"{name} is not tunable: it .*{reason}"):
            call()
    hook = SimpleNamespace(compressor=compressor, observers=[])
    trainer = SimpleNamespace(strategy=SimpleNamespace(hook=hook, set_layer_params=lambda params: None))
    with pytest.raises(ValueError, match=f"LGreCo needs a tunable compressor.*{name}"):
        LGreCo().on_train_start(trainer, None)  # type: ignore[arg-type]
