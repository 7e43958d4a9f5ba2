"""``Compressor.sparse_outputs``: the engine zeroes a sparsifier's output slots of the bucket in the pass that
compensates them, and the training is the same bits as when the compressor zeroes them itself. Under
``nonfinite="dense"`` a non-finite step then reduces the gradients recovered from the compensation: NaN/Inf exactly
where the uncleared gradients give them, the rest within rounding, identical on every rank."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor

from helpers.distributed import run_workers
from helpers.engine import train_through_hook
from lightning_gradcomp.compressors import CLTK, RandomK, TopK
from lightning_gradcomp.compressors.base import ReduceContext, Reduction

CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "TopK": (TopK, {"ratio": 0.05}),
    "TopK fp16": (TopK, {"ratio": 0.05, "value_dtype": torch.float16}),
    "RandomK": (RandomK, {"ratio": 0.05}),
    "CLTK": (CLTK, {"ratio": 0.05}),
    "CLTK approx": (CLTK, {"ratio": 0.05, "selection": "approx", "value_dtype": torch.bfloat16}),
}


def _recording(base: type, sparse: bool) -> type:
    class Recording(base):  # type: ignore[misc, valid-type]
        capabilities = dataclasses.replace(base.capabilities, sparse_outputs=sparse)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.zeroed: list[bool] = []

        def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
            self.zeroed.append(ctx.outputs_zeroed and all(bool((o == 0).all()) for o in ctx.outputs or []))
            return super().reduce(tensors, ctx)

    return Recording


def _train(rank: int, world: int, nonfinite: str) -> dict[tuple[str, bool], Any]:
    out = {}
    for name, (base, kwargs) in CASES.items():
        for sparse in (False, True):
            model, hook = train_through_hook(rank, _recording(base, sparse)(**kwargs), steps=4, nonfinite=nonfinite)
            out[(name, sparse)] = {
                "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                "memory": {k: v.clone() for k, v in hook.memory.memories.items()},
                "zeroed": hook.compressor.zeroed,
            }
    return out


@pytest.mark.parametrize(("world", "nonfinite"), [(2, "zero"), (3, "zero"), (5, "zero"), (3, "dense"), (4, "dense")])
def test_zeroing_while_compensating_gives_the_same_bits(world: int, nonfinite: str) -> None:
    results = run_workers(_train, world, nonfinite)
    for name in CASES:
        plain, fused = [r[(name, False)] for r in results], [r[(name, True)] for r in results]
        assert all(f["zeroed"] for f in fused), name
        assert all(all(f["zeroed"]) for f in fused), name  # the engine zeroed every output
        assert not any(any(p["zeroed"]) for p in plain), name
        for a, b in zip(plain, fused):
            assert torch.equal(a["params"], b["params"]), name
            assert a["memory"].keys() == b["memory"].keys() and a["memory"]
            assert all(torch.equal(a["memory"][k], b["memory"][k]) for k in a["memory"]), name
        assert all(torch.equal(r["params"], fused[0]["params"]) for r in fused), name  # replicas identical


POISON_STEP = 3  # compressed (GradCompStrategy's default start_step is 2)


def _nonfinite_step(rank: int, world: int, poison: float) -> dict[tuple[str, bool], list[Tensor]]:
    out = {}
    for name, (base, kwargs) in CASES.items():
        for sparse in (False, True):
            grads: list[Tensor] = []
            train_through_hook(rank, _recording(base, sparse)(**kwargs), steps=POISON_STEP + 1, nonfinite="dense",
                               poison_steps=(POISON_STEP,), poison=poison, grads=grads)
            out[(name, sparse)] = grads
    return out


@pytest.mark.parametrize(("world", "poison"), [(2, float("nan")), (3, float("inf")), (4, -float("inf")), (5, float("nan"))])
def test_a_dense_nonfinite_step_recovers_the_cleared_gradients(world: int, poison: float) -> None:
    results = run_workers(_nonfinite_step, world, poison)
    for name in CASES:
        plain, fused = results[0][(name, False)], results[0][(name, True)]
        for step in range(POISON_STEP):  # finite steps: the same bits
            assert torch.equal(plain[step], fused[step]), (name, step)
        a, b = plain[POISON_STEP], fused[POISON_STEP]
        for where in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(where(a), where(b)), (name, where.__name__)
        assert not bool(torch.isfinite(b).all()), name  # the step was non-finite
        finite = torch.isfinite(a)
        torch.testing.assert_close(b[finite], a[finite], rtol=1e-5, atol=1e-6)
        for rank in range(1, world):  # replicas identical
            assert torch.equal(results[rank][(name, True)][POISON_STEP].view(torch.int32), b.view(torch.int32)), name
