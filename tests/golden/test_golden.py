"""Issue 47's bit-for-bit guard: the current code reproduces ``golden.pt`` (recorded by ``record.py`` before the engine
was redesigned): every preset at W = 2, 3, 4 on tiny, odd and prime layers with a sparse embedding, a frozen and a
tied weight; each rank's parameters after every step and the bytes after every step, exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_gradcomp.gloo_workers import run_workers
from tests.golden.cases import PRESET_NAMES, WORLD_SIZES, cases, merge_ranks, run_world

GOLDEN = torch.load(Path(__file__).with_name("golden.pt"), weights_only=False)


def test_every_preset_is_recorded() -> None:
    listed = subprocess.run(
        [sys.executable, "-c", "import lightning_gradcomp; from lightning_gradcomp.presets import PRESETS; print(*PRESETS)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    assert tuple(listed) == PRESET_NAMES, "a preset was added or removed: update cases.PRESET_NAMES and re-record"
    for world in WORLD_SIZES:
        assert sorted(GOLDEN[world]) == sorted(case for case, _ in cases(world)), f"W={world}: re-record golden.pt"


def _first_difference(got: list, want: list) -> str:
    for step, (a, b) in enumerate(zip(got, want)):
        if a != b:
            shown = [x.hex()[:12] if isinstance(x, bytes) else x for x in (a, b)]
            return f"first at step {step + 1}: {shown[0]} != {shown[1]} (golden)"
    return f"{len(got)} steps recorded, {len(want)} in golden"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parameters_and_bytes_equal_the_recorded_ones(world_size: int) -> None:
    current = merge_ranks(run_workers(run_world, world_size, timeout=300))
    wrong = []
    for case, want in GOLDEN[world_size].items():
        got = current[case]
        for rank, (mine, theirs) in enumerate(zip(got["digests"], want["digests"], strict=True)):
            if mine != theirs:
                wrong.append(f"{case} rank {rank}: parameters differ, {_first_difference(mine, theirs)}")
        if got["final"] != want["final"]:
            wrong.append(f"{case}: final parameters differ")
        if got["bytes"] != want["bytes"]:
            wrong.append(f"{case}: bytes (wire, intra, dense) differ, {_first_difference(got['bytes'], want['bytes'])}")
    assert not wrong, f"W={world_size}, golden commit {GOLDEN['commit'][:10]}:\n" + "\n".join(wrong)
