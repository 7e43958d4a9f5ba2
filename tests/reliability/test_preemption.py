"""Preemption through Lightning's SLURM requeue path (issue 50, item 4b).

Two ranks run as ``srun`` starts them (``SLURM_*`` variables, ``SLURMEnvironment`` detected by Lightning, a
recording ``scontrol`` on ``PATH``). At the end of step ``k`` every rank gets SLURM's requeue signal (SIGUSR1:
Lightning saves ``hpc_ckpt_1.ckpt`` in ``default_root_dir``, rank 0 runs ``scontrol requeue <job>``), then SIGTERM
(Lightning ends training with ``SIGTERMException``). A second launch with the same ``default_root_dir`` and no
``ckpt_path`` resumes from the HPC checkpoint by itself, as the requeued job does. Plain ``strategy="ddp"`` goes
through the same three runs in every test: where it resumes exactly, compression must too; where Lightning's own
resume is not exact (mid-epoch, a plain DataLoader), the difference must be Lightning's alone.

Commands: ``python -m pytest tests/reliability/test_preemption.py -q`` (marked ``slow``; about 40 s).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from reliability.launch import SLURM_JOB_ID, load, losses, run, text
from reliability.scenarios import MAX_EPOCHS, STEPS_PER_EPOCH, config, errors
from reliability.test_rank_failure import _assert_same_state

from lightning_gradcomp.shard_files import read_shards, write_shard
from lightning_gradcomp.strategy import verify_checkpoint_file

pytestmark = pytest.mark.slow

END_OF_EPOCH = STEPS_PER_EPOCH * 2  # the last batch of epoch 1
MID_EPOCH = STEPS_PER_EPOCH + 2  # the second batch of epoch 1
TOTAL = MAX_EPOCHS * STEPS_PER_EPOCH
HPC = "hpc_ckpt_1.ckpt"


@dataclass
class Preemption:
    """The three runs of one case: uninterrupted, preempted at ``step``, requeued (resumed)."""

    case: str
    step: int
    reference: Path
    preempted: Path
    resumed: Path
    root: Path  # default_root_dir of the preempted and the requeued run


@pytest.fixture(scope="module")
def preemption(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], Preemption]:
    """``preemption(case, step)``: the (cached) runs of ``case`` preempted at the end of ``step``."""
    cache: dict[tuple[str, int], Preemption] = {}

    def get(case: str, step: int) -> Preemption:
        if (case, step) not in cache:
            tmp = tmp_path_factory.mktemp(f"preempt_{case}_{step}")
            runs = Preemption(case, step, tmp / "reference", tmp / "preempted", tmp / "resumed", tmp / "root")
            assert run(config(runs.reference, case, slurm=True)) == [0, 0], errors(runs.reference, 2)
            preempted = config(runs.preempted, case, slurm=True, root_dir=str(runs.root), preempt={"step": step})
            assert run(preempted) == [0, 0], errors(runs.preempted, 2)
            assert run(config(runs.resumed, case, slurm=True, root_dir=str(runs.root))) == [0, 0], \
                errors(runs.resumed, 2)
            cache[case, step] = runs
        return cache[case, step]

    return get


def _assert_requeued(runs: Preemption) -> None:
    """Both ranks stopped after step ``k`` through SIGTERM, rank 0 requeued the job once, and the HPC checkpoint
    holds step ``k`` (with a shard per rank holding that rank's compression state at the save)."""
    compressed = runs.case != "ddp"
    assert (runs.preempted / "scontrol.log").read_text() == f"0 requeue {SLURM_JOB_ID}\n"
    for rank in range(2):
        assert (runs.preempted / f"sigterm{rank}").exists(), f"rank {rank} did not stop through SIGTERMException"
        steps = [r["step"] for r in losses(runs.preempted, rank)]
        assert steps == list(range(1, runs.step + 1)), f"rank {rank} trained on after the requeue: {steps}"
        want = [r["loss"] for r in losses(runs.reference, rank)][:runs.step]
        assert [r["loss"] for r in losses(runs.preempted, rank)] == want  # the same run until the signal
    names = sorted(p.name for p in runs.root.iterdir())
    assert names == ([HPC, f"{HPC}.gradcomp"] if compressed else [HPC]), names
    ckpt = runs.root / HPC
    verify_checkpoint_file(ckpt)
    saved = torch.load(ckpt, weights_only=True)
    assert saved["global_step"] == runs.step
    if not compressed:
        assert "gradcomp" not in saved
        return
    shards = read_shards(ckpt)
    assert len(shards) == 2 and saved["gradcomp"]["world_size"] == 2
    for rank, shard in enumerate(shards):
        at_save = load(runs.preempted, "preempted", rank)["hook"]
        assert shard["step"] == runs.step and at_save["step"] == runs.step
        _assert_same_state(shard, at_save, f"{runs.case} rank {rank}: the shard is not the state at the save")
        if runs.case == "powersgd":
            assert shard["compressor"], "PowerSGD saved no factors: the test would not cover them"
        else:
            assert shard["memory"], "no error-feedback memory saved: the test would not cover it"
        start = load(runs.resumed, "start", rank)  # the requeued job found the HPC checkpoint by itself
        assert start["global_step"] == runs.step
        _assert_same_state(start["hook"], shard, f"{runs.case} rank {rank}: the shard was not restored")


def _assert_resumed_like(runs: Preemption, want: Path) -> None:
    """The requeued run's losses after step ``k``, final parameters and state are those of the run in ``want``."""
    for rank in range(2):
        got = losses(runs.resumed, rank)
        assert [r["step"] for r in got] == list(range(runs.step + 1, TOTAL + 1))
        expected = losses(want, rank)[runs.step:]
        assert [r["samples"] for r in got] == [r["samples"] for r in expected], f"rank {rank}: other batches"
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], abs=1e-6, rel=0)
        end, want_end = load(runs.resumed, "end", rank), load(want, "end", rank)
        assert torch.equal(end["params"], want_end["params"]), f"{runs.case} rank {rank}: final parameters differ"
        if runs.case != "ddp":
            _assert_same_state(end["hook"], want_end["hook"], f"{runs.case} rank {rank}")


@pytest.mark.parametrize("case", ["topk", "powersgd"])
def test_a_slurm_requeue_at_an_epoch_end_resumes_exactly_as_plain_ddp_does(preemption: Any, case: str) -> None:
    """Preempted at the last batch of an epoch: plain DDP's requeued run repeats the uninterrupted one (losses,
    bit-identical parameters), so the compressed run must too, memories and compressor state included."""
    ddp = preemption("ddp", END_OF_EPOCH)
    _assert_requeued(ddp)
    _assert_resumed_like(ddp, ddp.reference)
    ours = preemption(case, END_OF_EPOCH)
    _assert_requeued(ours)
    _assert_resumed_like(ours, ours.reference)


def _batches(runs: Preemption, rank: int) -> list[list[int]]:
    """The samples of every step that the preempted and the requeued run together trained ``rank`` on."""
    return [r["samples"] for r in losses(runs.preempted, rank) + losses(runs.resumed, rank)]


@pytest.mark.parametrize("case", ["topk", "powersgd"])
def test_a_mid_epoch_slurm_requeue_differs_from_the_uninterrupted_run_only_by_lightnings_data_order(
        preemption: Any, tmp_path: Path, case: str) -> None:
    """Preempted mid-epoch with a plain DataLoader, Lightning's resume does not restore the data order (it warns):
    the requeued epoch restarts from the epoch's first batches. Plain DDP's requeued run therefore differs from the
    uninterrupted one, and so does ours. The difference is exactly that: each equals, bit for bit, an uninterrupted
    run fed the batches that the preempted and requeued runs saw, and both strategies saw the same batches."""
    for runs in (preemption("ddp", MID_EPOCH), preemption(case, MID_EPOCH)):
        _assert_requeued(runs)
        assert "checkpoint that ended before the epoch ended" in text(runs.resumed, "warnings", 0)
        batches = [_batches(runs, rank) for rank in range(2)]
        assert all(len(b) == TOTAL for b in batches)
        assert batches != [[r["samples"] for r in losses(runs.reference, rank)] for rank in range(2)]
        assert not torch.equal(load(runs.resumed, "end", 0)["params"], load(runs.reference, "end", 0)["params"])
        scripted = tmp_path / f"scripted_{runs.case}"
        cfg = config(scripted, runs.case, slurm=True, batches=batches, steps_per_epoch=STEPS_PER_EPOCH)
        assert run(cfg) == [0, 0], errors(scripted, 2)
        assert [_batches(runs, rank)[:runs.step] for rank in range(2)] == [
            [r["samples"] for r in losses(scripted, rank)][:runs.step] for rank in range(2)]
        _assert_resumed_like(runs, scripted)
    ddp, ours = preemption("ddp", MID_EPOCH), preemption(case, MID_EPOCH)
    assert [_batches(ddp, rank) for rank in range(2)] == [_batches(ours, rank) for rank in range(2)]


KILLED_SAVE = """
import os, sys
import lightning_gradcomp.atomic_files as files
files.os.replace = lambda *args: os._exit(9)  # SIGKILLed after writing the temporary file, before the rename
files.atomic_save({"global_step": 99}, sys.argv[1])
"""


def test_a_requeue_after_an_interrupted_hpc_save_resumes_from_the_save_before(preemption: Any, tmp_path: Path) -> None:
    """A second preemption's save is killed before its file is in place (SLURM's SIGKILL after the grace time): both
    shards of ``hpc_ckpt_2.ckpt`` and rank 0's temporary file are written, ``hpc_ckpt_2.ckpt`` is not. Lightning then
    picks a file that does not exist (its number larger still when the temporary file's name holds digits). Plain
    DDP's killed save leaves no such name, and Lightning resumes from ``hpc_ckpt_1.ckpt``; so must the compressed run,
    with a warning, and repeat the uninterrupted run."""
    runs = preemption("topk", END_OF_EPOCH)
    root = tmp_path / "root"
    shutil.copytree(runs.root, root)
    second = root / "hpc_ckpt_2.ckpt"
    for rank in range(2):
        write_shard({"step": 99}, second, rank, token="killed")
    killed = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(second)], capture_output=True, text=True)
    assert killed.returncode == 9, killed.stderr
    left = sorted(p.name for p in root.iterdir())
    assert len(left) == 4 and left[:3] == [HPC, f"{HPC}.gradcomp", "hpc_ckpt_2.ckpt.gradcomp"], left
    resumed = tmp_path / "resumed"
    assert run(config(resumed, "topk", slurm=True, root_dir=str(root))) == [0, 0], errors(resumed, 2)
    warning = text(resumed, "warnings", 0)
    assert "does not exist: its save was interrupted" in warning and f"{root / HPC}', the newest complete" in warning
    assert load(resumed, "start", 0)["global_step"] == END_OF_EPOCH
    _assert_resumed_like(replace(runs, resumed=resumed), runs.reference)
