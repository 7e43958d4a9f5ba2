"""Checkpoints that survive a bad moment: a full disk during a save (issue 50, item 4).

Commands: ``python -m pytest tests/reliability/test_bad_moments.py -q`` (root: it mounts a small tmpfs; skipped
where mounting is not permitted).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_gradcomp.shard_files import read_shards, shard_dir
from lightning_gradcomp.strategy import verify_checkpoint_file
from reliability.launch import launch, load, losses, run, text
from reliability.scenarios import CKPT_STEP, MAX_EPOCHS, STEPS_PER_EPOCH, config, errors
from reliability.test_rank_failure import _assert_same_state

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (its own file system, as a checkpoint volume is), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_fails_the_save_on_every_rank_and_the_last_checkpoint_resumes_exactly(
        small_disk: Path, reference_run: Any, tmp_path: Path) -> None:
    """The disk fills after ``last.ckpt`` of step 8: the next save (its file grown by 256 KiB) finds room for its
    shards but not for the file. Both ranks stop with the reason (not a hang), ``last.ckpt`` and its shards are those of step 8, with no
    leftovers of the failed save, and a restart from them repeats the uninterrupted run."""
    out, last = tmp_path / "full", small_disk / "last.ckpt"
    cfg = config(out, "topk", ckpt_dir=str(small_disk), last_only=True, timeout=20.0,
                 fill={"rank": 0, "step": CKPT_STEP})
    with launch(cfg) as ranks:
        codes = ranks.wait_all(120.0)
    assert codes == [1, 1], errors(out, 2)
    for rank in range(2):
        error = text(out, "error", rank)
        assert "cannot save checkpoint" in error and "No space left on device" in error, error[:3000]
    verify_checkpoint_file(last)
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == CKPT_STEP
    assert len(read_shards(last)) == 2
    assert sorted(p.name for p in Path(shard_dir(last)).iterdir()) == sorted(
        s["file"] for s in saved["gradcomp"]["shards"])  # the failed save's shards and temporary files are gone
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "last.ckpt", "last.ckpt.gradcomp"]

    (small_disk / "filler").unlink()
    resumed, reference = tmp_path / "resumed", reference_run("topk")
    assert run(config(resumed, "topk", ckpt_path=str(last))) == [0, 0], errors(resumed, 2)
    for rank in range(2):
        want = [r["loss"] for r in losses(reference, rank)]
        got = losses(resumed, rank)
        assert [r["step"] for r in got] == list(range(CKPT_STEP + 1, MAX_EPOCHS * STEPS_PER_EPOCH + 1))
        assert [r["loss"] for r in got] == pytest.approx(want[CKPT_STEP:], abs=1e-6, rel=0)
        end, want_end = load(resumed, "end", rank), load(reference, "end", rank)
        assert torch.equal(end["params"], want_end["params"]), f"rank {rank}: final parameters differ"
        _assert_same_state(end["hook"], want_end["hook"], f"rank {rank}")
