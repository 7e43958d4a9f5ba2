"""``Compressor.precompute``: with error feedback the engine runs each slot's local work (a selection, PowerSGD's
``P = M Q``, SignSGD's message) right after compensating it, before the NaN/Inf flag's all-reduce, and the
reduction uses it. Training is the same bits as when the compressor does that work inside ``reduce``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from helpers.distributed import run_workers
from helpers.engine import train_through_hook
from lightning_gradcomp.compressors import CLTK, PowerSGD, SignSGD, TopK
from lightning_gradcomp.compressors.base import ReduceContext, Reduction

WORK = {TopK: "_select", CLTK: "_select", PowerSGD: "_project", SignSGD: "_quantize"}
"""The method that does each compressor's local work, in ``precompute`` or else in ``reduce``."""

CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "TopK": (TopK, {"ratio": 0.05}),
    "TopK delta16 fp16": (TopK, {"ratio": 0.05, "value_dtype": torch.float16, "index_coding": "delta16"}),
    "CLTK": (CLTK, {"ratio": 0.05}),
    "CLTK approx": (CLTK, {"ratio": 0.05, "selection": "approx", "value_dtype": torch.bfloat16}),
    "CLTK spread": (CLTK, {"ratio": 0.05, "spread_leaders": True, "index_coding": "delta16"}),
    "PowerSGD": (PowerSGD, {"rank": 2}),
    "SignSGD allgather": (SignSGD, {"bucket_size": 64, "aggregation": "allgather"}),
    "SignSGD alltoall": (SignSGD, {"bucket_size": 64, "aggregation": "alltoall"}),
}


def _recording(base: type, early: bool) -> type:
    """``base`` logging, in order, each ``precompute`` that did some work and each ``reduce`` (with how many of its
    slots it found precomputed), each with the bytes this rank had sent so far, and counting the local work done
    inside ``reduce``; with ``early=False`` it does no work ahead."""

    class Recording(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.log: list[tuple[str, float, int, int]] = []  # (event, bytes sent so far, slots, found)
            self.late = 0  # local work done inside reduce()
            self._reducing = False

        def precompute(self, index: int, tensor: Tensor, ctx: ReduceContext) -> Any:
            if not early:
                return None
            result = super().precompute(index, tensor, ctx)
            if result is not None:
                self.log.append(("ahead", ctx.comm.stats.wire_bytes, 1, 0))
            return result

        def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
            found = sum(ctx.precomputed(i) is not None for i in range(len(tensors)))
            self.log.append(("reduce", ctx.comm.stats.wire_bytes, len(tensors), found))
            self._reducing = True
            try:
                return super().reduce(tensors, ctx)
            finally:
                self._reducing = False

    work = WORK[base]

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.late += self._reducing
        return getattr(super(Recording, self), work)(*args, **kwargs)

    setattr(Recording, work, counted)
    return Recording


def _train(rank: int, world: int, poison: bool, dtype: torch.dtype) -> dict[tuple[str, bool], Any]:
    """Every case with and without early work, 6 steps (4 compressed), the model in ``dtype``; with ``poison``, rank
    1's gradient of the first layer holds an Inf at step 3 (``nonfinite="zero"``)."""
    out = {}
    for name, (base, kwargs) in CASES.items():
        for early in (False, True):
            model, hook = train_through_hook(
                rank,
                _recording(base, early)(**kwargs),
                steps=6,
                nonfinite="zero",
                dtype=dtype,
                poison_steps=(3,) if poison else (),
            )
            out[(name, early)] = {
                "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                "memory": {k: v.clone() for k, v in hook.memory.memories.items()},
                "state": hook.compressor.state_dict(),
                "log": hook.compressor.log,
                "late": hook.compressor.late,
                "nonfinite": hook.stats.nonfinite_steps,
            }
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize(
    ("world", "poison", "dtype"),
    [
        (2, False, torch.float32),
        (3, False, torch.float32),
        (5, False, torch.float32),
        (3, True, torch.float32),
        (2, True, torch.bfloat16),
    ],
)
def test_early_work_gives_the_same_bits(world: int, poison: bool, dtype: torch.dtype) -> None:
    """fp32 gradients take the compensation kernel (which flags NaN/Inf: no early work on a bad slot), bf16 ones the
    torch steps (not checked: the early work runs on the poisoned ``p`` and is dropped with it)."""
    results = run_workers(_train, world, poison, dtype)
    for name, (base, _) in CASES.items():
        plain = [r[(name, False)] for r in results]
        ahead = [r[(name, True)] for r in results]
        for a, b in zip(plain, ahead):
            assert torch.equal(a["params"], b["params"]), name
            assert _equal(a["memory"], b["memory"]), name
            assert _equal(a["state"], b["state"]), name
            assert a["nonfinite"] == b["nonfinite"], name
            assert (a["nonfinite"] > 0) == poison, name
        assert torch.equal(ahead[0]["params"], ahead[-1]["params"]), name  # replicas identical
        assert all(event == "reduce" and found == 0 for r in plain for event, _, _, found in r["log"]), name
        used = [sum(found for event, _, _, found in r["log"] if event == "reduce") for r in ahead]
        slots = [sum(n for event, _, n, _ in r["log"] if event == "reduce") for r in ahead]
        if base is CLTK:
            assert sum(used) == slots[0], name  # the leader's selections, one leader per reduction
            assert sum(r["late"] for r in plain) == slots[0], name
        else:
            assert used == slots, name  # every slot of every reduction, on every rank
            assert [r["late"] for r in plain] == slots, name
        assert not any(r["late"] for r in ahead), name  # reduce() did none of that work again
        for r, n_used in zip(ahead, used):
            log = r["log"]
            # each reduction's early work came before the flag's all-reduce: fewer bytes sent at the time
            for i, (event, sent, _, found) in enumerate(log):
                if event == "reduce" and found:
                    before = [entry for entry in log[:i] if entry[0] == "ahead"][-found:]
                    assert len(before) == found and all(entry[1] < sent for entry in before), name
            done = sum(event == "ahead" for event, *_ in log)
            # a poisoned bucket's early work is dropped with it (and none is done for the bad slot)
            assert done == n_used if not poison else done >= n_used, name
