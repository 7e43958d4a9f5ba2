"""Non-finite gradients: NaN/Inf in one rank's gradient at one step never reaches the compression state.

Rank 1's gradient of ``body.2.weight`` gets a NaN, +Inf or -Inf at step ``STEP`` (compressed; for L-GreCo
inside a statistics window). With ``nonfinite="zero"`` the step adds no gradient and training continues with
finite parameters; with ``"dense"`` the value reaches the optimizer as it would with DDP. In both cases no
error-feedback memory, DIANA shift, SignSGD server memory or PowerSGD factor becomes non-finite.
"""

from __future__ import annotations

import math
from pathlib import Path

from typing import Any

import pytest
import torch

from helpers.distributed import run_workers
from helpers.engine import train_through_hook
from lightning_gradcomp.compressors import registry
from lightning_gradcomp.functional import _native
from reliability.launch import load, losses, run, tensors
from reliability.scenarios import MAX_EPOCHS, STEPS_PER_EPOCH, config, errors

STEP = 6
CASES = ["topk", "randomk", "cltk", "powersgd", "diana", "signsgd", "qsgd", "terngrad", "lgreco", "fp16", "bf16"]
VALUES = ["nan", "inf", "-inf"]
STATE = {  # where each stateful case keeps state that must exist (else the test would check nothing)
    "topk": ["memory"], "randomk": ["memory"], "cltk": ["memory"], "powersgd": ["memory", "compressor"],
    "lgreco": ["memory", "compressor"], "diana": ["compressor"], "signsgd": ["memory", "compressor"],
}


def _inject(out: Path, case: str, value: str, policy: str) -> list[dict]:
    cfg = config(out, case, nonfinite=policy, inject={"rank": 1, "step": STEP, "value": value})
    assert run(cfg) == [0, 0], errors(out, 2)
    return [load(out, "end", r) for r in range(2)]


def _assert_state_finite(ends: list[dict], case: str) -> None:
    for rank, end in enumerate(ends):
        hook = end["hook"]
        assert hook["stats"]["nonfinite_steps"] == 1
        for part in STATE.get(case, []):
            assert tensors(hook[part]), f"{case}: no {part} state to check on rank {rank}"
        for part in ("memory", "compressor"):
            assert all(bool(t.isfinite().all()) for t in tensors(hook[part])), f"{case} rank {rank}: non-finite {part}"


@pytest.mark.parametrize("case", CASES)
def test_zero_policy_skips_the_step_and_training_continues(tmp_path: Path, case: str) -> None:
    value = VALUES[CASES.index(case) % len(VALUES)]
    ends = _inject(tmp_path, case, value, "zero")
    _assert_state_finite(ends, case)
    for rank in range(2):
        records = losses(tmp_path, rank)
        assert len(records) == MAX_EPOCHS * STEPS_PER_EPOCH  # every step ran
        assert all(r["finite"] and math.isfinite(r["loss"]) for r in records)
        assert torch.equal(ends[rank]["params"], ends[0]["params"])
        assert ends[rank]["hook"]["stats"]["compressed_steps"] == MAX_EPOCHS * STEPS_PER_EPOCH - 2


@pytest.mark.parametrize("case", ["powersgd", "diana", "signsgd", "fp16"])
def test_dense_policy_passes_the_value_on_like_ddp_but_spares_the_state(tmp_path: Path, case: str) -> None:
    ends = _inject(tmp_path, case, "nan", "dense")
    for rank, end in enumerate(ends):
        assert end["hook"]["stats"]["nonfinite_steps"] >= 1
        assert all(bool(t.isfinite().all()) for part in ("memory", "compressor") for t in tensors(end["hook"][part]))
        assert not bool(end["params"].isfinite().all())  # what DDP does; fp16 AMP's GradScaler would skip the step
        assert [r["finite"] for r in losses(tmp_path, rank)][STEP - 1:STEP + 1] == [True, False]


def test_localsgd_zeroes_the_nan_gradient_and_every_rank_trains_on(tmp_path: Path) -> None:
    """LocalSGDStrategy's inner-step guard: rank 1's NaN gradient is zeroed before its inner step, so neither its
    model nor its optimizer, its error-feedback memory or, through the syncs, rank 0 ever holds a NaN."""
    assert run(config(tmp_path, "localsgd", inject={"rank": 1, "step": STEP, "value": "nan"})) == [0, 0], errors(
        tmp_path, 2)
    ends = [load(tmp_path, "end", r) for r in range(2)]
    assert [end["hook"]["stats"]["nonfinite_steps"] for end in ends] == [0, 1]
    for rank, end in enumerate(ends):
        assert tensors(end["hook"]["memory"]), f"rank {rank}: no error-feedback memory to check"
        assert all(bool(t.isfinite().all()) for part in ("memory", "compressor") for t in tensors(end["hook"][part]))
        assert all(r["finite"] and math.isfinite(r["loss"]) for r in losses(tmp_path, rank))
        assert torch.equal(end["params"], ends[0]["params"])  # the last step is a sync (local_steps = 2)


def test_swarm_nan_gradient_stays_contained(tmp_path: Path) -> None:
    cfg = config(tmp_path, "swarm", inject={"rank": 1, "step": STEP, "value": "nan"})
    assert run(cfg) == [0, 0], errors(tmp_path, 2)
    assert all(r["finite"] for rank in range(2) for r in losses(tmp_path, rank))


# ---------------------------------------------------------------------------- the engine, without Lightning
HOOK_START, HOOK_STEPS = 2, 5  # GradCompStrategy's default start_step: steps 0 and 1 are dense
HOOK_CASES = {  # every registered compressor's defaults, each on every layer of the helper's MLP
    name: (lambda n=name: registry.create(n)) for name in registry.list()
}


def _hook_run(rank: int, world: int, native: bool, bad_steps: tuple[int, ...], value: float) -> dict[str, Any]:
    """Every case trained through the hook (``nonfinite="zero"``); rank 1's gradient gets ``value`` at ``bad_steps``.
    ``native=False``: the torch steps (as on a GPU) instead of the kernel."""
    if not native:
        _native.load = lambda: None  # this forked process only
    out = {}
    for name, make in HOOK_CASES.items():
        model, hook = train_through_hook(rank, make(), steps=HOOK_STEPS, nonfinite="zero", poison_steps=bad_steps,
                                         poison=value)
        out[name] = {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                     "memory": hook.memory.state_dict(), "state": hook.compressor.state_dict(),
                     "nonfinite": hook.stats.nonfinite_steps, "dense": hook.compressor.dense}
    return out


@pytest.mark.parametrize(("world", "native", "bad_steps", "value"), [
    (2, True, (HOOK_START, HOOK_START + 2), float("nan")),  # the first compressed step: no memory yet
    (3, False, (HOOK_START, HOOK_START + 1), float("-inf")),
    (2, False, (HOOK_START + 1,), float("inf")),
    (4, True, (HOOK_START,), float("-inf")),
    (5, False, (HOOK_START, HOOK_START + 2), float("nan")),
])
def test_zero_policy_catches_every_bad_step_on_the_kernel_and_the_torch_steps(
        world: int, native: bool, bad_steps: tuple[int, ...], value: float) -> None:
    """Error feedback's compensation zeroes a sparsifier's output slots while it reads ``g``; on the torch steps it
    does not check ``g`` (a GPU, the first compressed step), so the flag must come from ``p``: a NaN/Inf there once
    slipped into the average and rank 1's memory."""
    results = run_workers(_hook_run, world, native, bad_steps, value, timeout=120)
    for name in HOOK_CASES:
        ranks = [r[name] for r in results]
        for rank, res in enumerate(ranks):
            where = f"{name} (W={world}, native={native}) rank {rank}"
            assert all(bool(t.isfinite().all()) for t in tensors(res["memory"]) + tensors(res["state"])), where
            if res["dense"]:  # plain DDP (no flag, no policy): the value reaches the parameters
                assert not torch.isfinite(res["params"]).all(), where
                continue
            assert torch.isfinite(res["params"]).all() and torch.equal(res["params"], ranks[0]["params"]), where
            assert res["nonfinite"] == len(bad_steps), where
