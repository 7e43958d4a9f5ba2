"""Rank failures: a killed rank surfaces in seconds, a hung one after the timeout; restarts are exact.

Commands: ``python -m pytest tests/reliability/test_rank_failure.py -q`` (all of it is marked ``slow``).
"""

from __future__ import annotations

import math
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from reliability.scenarios import (CKPT_STEP, MAX_EPOCHS, STARTUP_SECONDS, STEPS_PER_EPOCH, SURFACE_SECONDS,
                                  KilledRun, config, errors, kill_mid_step)
from reliability.launch import STATEFUL, launch, load, losses, run, tensors, text

pytestmark = pytest.mark.slow

GRADCOMP_HINT = "a collective failed. Another rank has most likely died"


def _assert_surfaced(killed: KilledRun, gradcomp: bool) -> None:
    """The survivor exited with an error naming the problem, quickly, and nothing was left running."""
    assert killed.victim_code == -signal.SIGKILL
    assert killed.survivor_code is not None, f"the surviving rank still ran {SURFACE_SECONDS:.0f} s after the kill"
    assert killed.survivor_code != 0 and killed.surfaced_after < SURFACE_SECONDS
    assert "Connection closed by peer" in killed.survivor_error or "Connection reset by peer" in killed.survivor_error
    if gradcomp:
        assert f"GradCompStrategy (rank {1 - killed.victim} of 2): {GRADCOMP_HINT}" in killed.survivor_error
    assert killed.leftovers == []


# ---------------------------------------------------------------------------------------------- no hangs
def test_killed_rank_in_a_fresh_interpreter_surfaces_within_60s(tmp_path: Path) -> None:
    """What a user runs: two ``python`` processes with torchrun-style variables; rank 1 is SIGKILLed."""
    killed = kill_mid_step(tmp_path / "run", tmp_path / "ckpt", "cltk", victim=1, mode="subprocess")
    _assert_surfaced(killed, gradcomp=True)
    assert "Traceback" in killed.survivor_error  # printed on the survivor's stderr, not only recorded
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)  # the checkpoint before the kill
    assert saved["global_step"] == CKPT_STEP and len(saved["gradcomp"]["shards"]) == 2


@pytest.mark.parametrize("case", STATEFUL)
def test_killed_rank_surfaces_within_60s(killed_run: Any, case: str) -> None:
    _assert_surfaced(killed_run(case), gradcomp=case != "swarm")


def test_hung_rank_fails_the_others_after_the_configured_timeout(tmp_path: Path) -> None:
    """A rank that stops (SIGSTOP) keeps its sockets open: only the process-group timeout can end the wait."""
    timeout = 6.0
    out = tmp_path / "run"
    with launch(config(out, "topk", timeout=timeout, pause={"rank": 1, "step": 6})) as ranks:
        assert ranks.wait_for_file(out / "paused1", STARTUP_SECONDS), errors(out, 2)
        ranks.signal(1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        survivor_code = ranks.wait(0, SURFACE_SECONDS)
        waited = time.monotonic() - stopped_at
        assert survivor_code == 1, f"rank 0 did not give up on the stopped rank within {SURFACE_SECONDS} s"
        ranks.signal(1, signal.SIGKILL)  # what a launcher does once a rank has failed
        assert ranks.wait(1, 10.0) == -signal.SIGKILL
        assert ranks.leftovers() == []
    error = text(out, "error", 0)
    assert "GradCompStrategy (rank 0 of 2): collective " in error and " timed out after 0:00:06: " in error
    assert "hung or dead" in error and "`timeout=` of the strategy" in error
    assert "timeout" in error.split("Backend error:")[1].lower()  # gloo's own words: a timeout, not a crash
    assert waited > 0.5 * timeout  # it really waited for the configured timeout, not the 10 minute default


HUNG_COLLECTIVE = re.compile(r"collective (all_reduce|all_gather|exchange \(send and receive\) with rank 1) on "
                             r"the group of ranks 0, 1, 2 timed out after 0:00:03: a rank is probably hung or dead")
"""What the others report about the hung rank 1 (which collective depends on where each was waiting)."""


@pytest.mark.parametrize("case", ["topk", "localsgd", "swarm"])  # the DDP hook, Local SGD, SwarmSGD
def test_a_hung_rank_is_reported_as_a_timeout_by_every_front_end(tmp_path: Path, case: str) -> None:
    """Issue 50: one of 3 ranks sleeps mid-step; the others fail after ``timeout=`` with a message saying which
    collective on which group timed out after how long, that a rank is probably hung or dead, and what to set."""
    timeout, out = 3.0, tmp_path / "run"
    with launch(config(out, case, world=3, timeout=timeout, pause={"rank": 1, "step": 4, "backward": True})) as ranks:
        assert ranks.wait_for_file(out / "paused1", STARTUP_SECONDS), errors(out, 3)
        paused_at = time.monotonic()
        codes = [ranks.wait(r, SURFACE_SECONDS) for r in (0, 2)]
        waited = time.monotonic() - paused_at
        assert codes == [1, 1], f"the others did not give up on the hung rank: {codes}\n{errors(out, 3)}"
    reports = [text(out, "error", r).split("\n\nTraceback")[0] for r in (0, 2)]
    timed_out = [r for r in reports if "timed out after" in r]
    assert timed_out, "\n".join(reports)
    for report in timed_out:
        assert HUNG_COLLECTIVE.search(report) and "The wait is set by `timeout=` of the strategy" in report, report
        if case == "topk":
            assert report.startswith("RuntimeError: GradCompStrategy (rank "), report
    assert waited < 30


# ---------------------------------------------------------------------------------------------- exact restart
def _assert_same_state(got: Any, want: Any, where: str) -> None:
    """Bit-identical per-rank strategy state (statistics, which hold timings, excluded)."""
    got = {k: v for k, v in got.items() if k != "stats"}
    want = {k: v for k, v in want.items() if k != "stats"}
    assert _structure(got) == _structure(want), where
    for a, b in zip(tensors(got), tensors(want), strict=True):
        assert torch.equal(a, b), where


def _structure(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return ("tensor", tuple(tree.shape), tree.dtype)
    if isinstance(tree, dict):
        return {k: _structure(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_structure(v) for v in tree]
    return tree


@pytest.mark.parametrize("case", STATEFUL)
def test_restart_after_a_kill_reproduces_the_uninterrupted_run(killed_run: Any, reference_run: Any, tmp_path: Path,
                                                               case: str) -> None:
    killed, reference = killed_run(case), reference_run(case)
    out = tmp_path / "resumed"
    assert run(config(out, case, ckpt_path=str(killed.ckpt_dir / "last.ckpt"))) == [0, 0], errors(out, 2)
    for rank in range(2):
        want = [r["loss"] for r in losses(reference, rank)]
        assert len(want) == MAX_EPOCHS * STEPS_PER_EPOCH
        before_kill = [r["loss"] for r in losses(killed.out, rank)]
        assert len(before_kill) > CKPT_STEP and before_kill == want[:len(before_kill)]  # same run until the kill
        got = losses(out, rank)
        assert [r["step"] for r in got] == list(range(CKPT_STEP + 1, len(want) + 1))
        assert [r["loss"] for r in got] == pytest.approx(want[CKPT_STEP:], abs=1e-6, rel=0)
        end, want_end = load(out, "end", rank), load(reference, "end", rank)
        assert torch.equal(end["params"], want_end["params"]), f"rank {rank}: final parameters differ"
        if case == "swarm":
            assert end["round_index"] == want_end["round_index"]
        else:
            assert load(out, "start", rank)["hook"]["step"] == CKPT_STEP
            _assert_same_state(end["hook"], want_end["hook"], f"{case} rank {rank}")
            if case == "lgreco":
                assert end["hook"]["layer_params"], "L-GreCo made no choice: the test would not cover it"


# ---------------------------------------------------------------------------------------------- world size
def _saved_params(ckpt: Path) -> torch.Tensor:
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    return torch.cat([v.reshape(-1) for v in state.values()])


def _check_resumed_on_new_world(out: Path, ckpt: Path, case: str, old: int, new: int, steps: int) -> None:
    saved = torch.load(ckpt, weights_only=True)
    warning = text(out, "warnings", 0)
    assert f"checkpoint was written by {old} ranks, resuming on {new}" in warning
    starts = [load(out, "start", r) for r in range(new)]
    for start in starts:  # everyone starts from the checkpoint's model
        assert torch.equal(start["params"], _saved_params(ckpt))
    if case == "swarm":
        assert "every rank starts from the mean model" in warning
        counters = saved["swarm"]["counters"]  # rank 0's
        assert all(s["round_index"] == counters["round_index"] for s in starts)
    else:
        assert "per-rank state (error-feedback memories, compressor state) is reset" in warning
        kept = saved["gradcomp"]["replicated"]
        for start in starts:
            hook = start["hook"]
            assert hook["step"] == kept["step"] and hook["layer_params"] == kept["layer_params"]
            assert hook["memory"] == {} and tensors(hook["compressor"]) == []
        if case == "lgreco":
            assert kept["layer_params"], "L-GreCo made no choice before the checkpoint"
    records = [losses(out, r) for r in range(new)]
    assert all(len(rec) == steps for rec in records)
    assert all(r["finite"] and math.isfinite(r["loss"]) for rec in records for r in rec)
    ends = [load(out, "end", r) for r in range(new)]
    if case != "swarm":  # still one model, still compressed
        assert all(torch.equal(end["params"], ends[0]["params"]) for end in ends)
        assert all(end["hook"]["step"] == saved["gradcomp"]["replicated"]["step"] + steps for end in ends)
        assert ends[0]["hook"]["stats"]["compressed_steps"] > 0


@pytest.mark.parametrize("case", STATEFUL)
def test_resume_after_a_kill_on_more_ranks_applies_the_policy(killed_run: Any, tmp_path: Path, case: str) -> None:
    killed = killed_run(case)
    ckpt = killed.ckpt_dir / "last.ckpt"
    out = tmp_path / "three"
    assert run(config(out, case, world=3, ckpt_path=str(ckpt))) == [0, 0, 0], errors(out, 3)
    _check_resumed_on_new_world(out, ckpt, case, old=2, new=3, steps=3)  # 64 samples on 3 ranks: 3 batches


@pytest.mark.parametrize("case", ["diana", "lgreco"])
def test_resume_from_four_ranks_on_two(tmp_path: Path, case: str) -> None:
    first, ckpt_dir = tmp_path / "four", tmp_path / "ckpt"
    assert run(config(first, case, world=4, ckpt_dir=str(ckpt_dir))) == [0] * 4, errors(first, 4)  # 6 steps
    out = tmp_path / "two"
    assert run(config(out, case, ckpt_path=str(ckpt_dir / "last.ckpt"), max_epochs=MAX_EPOCHS + 1)) == [0, 0], \
        errors(out, 2)
    _check_resumed_on_new_world(out, ckpt_dir / "last.ckpt", case, old=4, new=2, steps=STEPS_PER_EPOCH)
