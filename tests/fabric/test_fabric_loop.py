"""A Fabric loop with ``strategy="scalecom"`` against the Trainer: same parameters and bytes per step, exact resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lightning_gradcomp  # noqa: F401 - registers the presets with Fabric
from helpers.fabric import assert_replicas_identical, run_fabric, run_trainer


@pytest.mark.parametrize("world", [2, 3])
def test_fabric_loop_matches_the_trainer_step_for_step(tmp_path: Path, world: int) -> None:
    steps = 5  # start_step=2: two dense steps, three compressed
    fabric = run_fabric("scalecom_fork", tmp_path, steps, devices=world)
    trainer = run_trainer("scalecom_fork", tmp_path, steps, devices=world)
    assert_replicas_identical(fabric)
    assert all(record["released"] for record in fabric), "teardown() releases the hook's process group"
    for rank, (ours, theirs) in enumerate(zip(fabric, trainer)):
        assert ours["wire"] == theirs["wire"], f"rank {rank}: bytes per step differ from the Trainer's"
        assert len(ours["params"]) == len(theirs["params"]) == steps
        assert all(torch.equal(a, b) for a, b in zip(ours["params"], theirs["params"])), f"rank {rank}"
        assert ours["stats"]["compressed_steps"] == steps - 2 and ours["wire"][-1] < ours["stats"]["dense_bytes"]


def test_no_backward_sync_accumulation_matches_accumulate_grad_batches(tmp_path: Path) -> None:
    steps = 4  # of two micro-batches each
    fabric = run_fabric("scalecom_fork", tmp_path, steps, accumulate=2)
    trainer = run_trainer("scalecom_fork", tmp_path, steps, accumulate=2)
    assert_replicas_identical(fabric)
    for rank, (ours, theirs) in enumerate(zip(fabric, trainer)):
        assert ours["hook_step"] == theirs["hook_step"] == steps, "one hook step per optimizer step"
        assert ours["wire"] == theirs["wire"]
        assert all(torch.equal(a, b) for a, b in zip(ours["params"], theirs["params"], strict=True)), f"rank {rank}"
        assert ours["memory"].keys() == theirs["memory"].keys()
        assert all(torch.equal(ours["memory"][k], theirs["memory"][k]) for k in ours["memory"])


@pytest.mark.parametrize("world", [2, 3])
def test_fabric_save_then_load_resumes_exactly(tmp_path: Path, world: int) -> None:
    # ReadyOrderNet: DDP's first bucket layout (after a resume) equals its rebuilt one, so W = 3 is bit-exact too
    steps, cut = 6, 3
    straight = run_fabric("scalecom_fork", tmp_path / "straight", steps, devices=world, model="ready")
    ckpt = str(tmp_path / "ckpt.pt")
    run_fabric("scalecom_fork", tmp_path / "first", cut, devices=world, model="ready", save=ckpt)
    assert (tmp_path / "ckpt.pt.gradcomp").is_dir(), "every rank's compression state goes to its shard"
    resumed = run_fabric("scalecom_fork", tmp_path / "resumed", steps, devices=world, model="ready", start=cut,
                         load=ckpt)
    assert_replicas_identical(resumed)
    for rank, (rec, ref) in enumerate(zip(resumed, straight)):
        assert rec["hook_step"] == ref["hook_step"] == steps
        tail = ref["params"][cut:]
        assert len(rec["params"]) == len(tail)
        assert all(torch.equal(a, b) for a, b in zip(rec["params"], tail)), f"rank {rank}: parameters differ"
        assert rec["memory"].keys() == ref["memory"].keys() and rec["memory"]
        assert all(torch.equal(rec["memory"][k], ref["memory"][k]) for k in ref["memory"]), f"rank {rank}: memory"


def test_setup_module_then_setup_optimizers_trains_as_setup_does(tmp_path: Path) -> None:
    joint = run_fabric("scalecom_fork", tmp_path / "joint", 4)
    separate = run_fabric("scalecom_fork", tmp_path / "separate", 4, separate=True)
    for a, b in zip(joint, separate):
        assert a["hook_step"] == b["hook_step"] == 4, "the optimizer set up apart commits the steps too"
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))


def test_load_refuses_another_compressor_and_keeps_the_step_on_another_world_size(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt.pt")
    run_fabric("scalecom_fork", tmp_path / "first", 3, save=ckpt)
    with pytest.raises(Exception, match="written with compressor CLTK, but this strategy uses TopK"):
        run_fabric("gradcomp_topk_fork", tmp_path / "other", 4, start=3, load=ckpt)
    wider = run_fabric("scalecom_fork", tmp_path / "wider", 4, devices=3, start=3, load=ckpt)
    assert [r["hook_step"] for r in wider] == [4, 4, 4], "the step counter is replicated state: kept"
    assert_replicas_identical(wider)
