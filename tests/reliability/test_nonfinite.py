"""Non-finite gradients: NaN/Inf in one rank's gradient at one step never reaches the compression state.

Rank 1's gradient of ``body.2.weight`` gets a NaN, +Inf or -Inf at step ``STEP`` (compressed; for L-GreCo
inside a statistics window). With ``nonfinite="zero"`` the step adds no gradient and training continues with
finite parameters; with ``"dense"`` the value reaches the optimizer as it would with DDP. In both cases no
error-feedback memory, DIANA shift, SignSGD server memory or PowerSGD factor becomes non-finite.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

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


def test_swarm_nan_gradient_stays_contained(tmp_path: Path) -> None:
    cfg = config(tmp_path, "swarm", inject={"rank": 1, "step": STEP, "value": "nan"})
    assert run(cfg) == [0, 0], errors(tmp_path, 2)
    assert all(r["finite"] for rank in range(2) for r in losses(tmp_path, rank))
