"""Compression schedules: the math, validation, and a schedule driving the hook in Lightning runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.models import TinyNet, assert_replicas_identical, fit
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import all_reduce_bytes, broadcast_bytes
from lightning_gradcomp.compressors import CLTK, QSGD, NoCompression, PowerSGD, TopK
from lightning_gradcomp.functional import kept_count
from lightning_gradcomp.hook import GradCompHook
from lightning_gradcomp.schedule import (CallableSchedule, StepSchedule, WarmupSchedule, as_schedule,
                                         follow_schedule, scheduled_param)


# ---------------------------------------------------------------------------------------------- math
@pytest.mark.parametrize("stages", [1, 2, 4, 5])
@pytest.mark.parametrize("steps", [1, 7, 100])
def test_warmup_is_a_geometric_staircase_ending_at_the_target(steps: int, stages: int) -> None:
    schedule = WarmupSchedule(steps=steps, start=0.25, stages=stages)
    values = [schedule.value(s, 0.01) for s in range(steps + 3)]
    assert values[0] == 0.25 and values[steps:] == [0.01] * 3
    ramp = values[:steps]
    assert all(a >= b for a, b in zip(ramp, ramp[1:]))  # never rises
    levels = [0.25 * (0.01 / 0.25) ** (i / stages) for i in range(stages)]
    used = sorted(set(ramp), reverse=True)
    assert all(min(abs(u - level) for level in levels) < 1e-12 for u in used)  # only the stage levels
    if steps >= stages:  # every stage appears, each for steps/stages steps (rounded)
        assert used == pytest.approx(levels)
        assert all(abs(ramp.count(u) - steps / stages) < 1 for u in used)


def test_step_schedule_is_piecewise_constant_and_the_target_before_its_first_key() -> None:
    schedule = StepSchedule({"10": 0.1, 0 + 30: 0.05})  # YAML may give string keys
    assert [schedule.value(s, 0.01) for s in (0, 9, 10, 29, 30, 1000)] == [0.01, 0.01, 0.1, 0.1, 0.05, 0.05]


def test_per_layer_choices_follow_the_schedule_relative_to_the_target() -> None:
    assert follow_schedule(0.02, 0.01, 0.1, "ratio") == pytest.approx(0.2)
    assert follow_schedule(8, 4, 16, "rank") == 32
    assert follow_schedule(3, 4, 8, "bits") == 7
    topk = TopK(0.01)
    assert scheduled_param(topk, 0.5, 0.1) == 1.0  # clipped: a density is at most 1
    assert scheduled_param(topk, 0.01, 0.1) == 0.1
    assert scheduled_param(PowerSGD(rank=4), 1, 2) == 1  # 1 * 2/4 rounds to 1 (a rank is at least 1)
    assert scheduled_param(PowerSGD(rank=4), 4, 6.7) == 7


def test_integer_parameters_are_rounded() -> None:
    hook = GradCompHook(PowerSGD(rank=4), None, {}, schedule=as_schedule(WarmupSchedule(8, start=32), PowerSGD(4)))
    seen = []
    for step in range(10):
        hook.step = step
        hook._follow_schedule()
        seen.append(hook.param_of("layer"))
    assert seen == [32, 32, 19, 19, 11, 11, 7, 7, 4, 4]


def test_hook_applies_the_schedule_to_layer_params() -> None:
    compressor = CLTK(0.01)
    hook = GradCompHook(compressor, None, {}, schedule=as_schedule({0: 0.1, 5: 0.05}, compressor))
    hook.layer_params["big"] = 0.02
    assert hook.param_of("big") == pytest.approx(0.2) and hook.param_of("other") == pytest.approx(0.1)
    hook.step = 5
    hook._follow_schedule()
    assert hook.param_of("big") == pytest.approx(0.1) and hook.param_of("other") == pytest.approx(0.05)
    hook.load_state_dict({"step": 2}, per_rank=False)  # a resumed step re-reads the schedule
    assert hook.param_of("other") == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("spec, match", [
    (WarmupSchedule(10, start=2.0), "density"),        # a density above 1
    ({0: 0.5, 10: 1.5}, "step 10"),
    ({-1: 0.5}, "schedule step"),
    ({}, "non-empty"),
])
def test_invalid_values_are_rejected_at_construction(spec: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GradCompStrategy(compressor=TopK(0.01), schedule=spec)


@pytest.mark.parametrize("kwargs, match", [({"steps": 0, "start": 0.1}, "steps"), ({"steps": 5, "start": 0},
                                           "start"), ({"steps": 5, "start": 0.1, "stages": 0}, "stages")])
def test_warmup_arguments_are_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WarmupSchedule(**kwargs)


def test_a_compressor_without_a_parameter_refuses_a_schedule() -> None:
    with pytest.raises(ValueError, match="compression parameter"):
        GradCompStrategy(compressor=NoCompression(), schedule={0: 0.1})
    with pytest.raises(TypeError, match="schedule"):
        GradCompStrategy(compressor=TopK(0.01), schedule=0.1)


def test_callables_and_bits_are_accepted() -> None:
    strategy = GradCompStrategy(compressor=QSGD(bits=4), schedule=lambda step: 8 if step < 10 else 4)
    assert isinstance(strategy.schedule, CallableSchedule)
    GradCompStrategy(compressor=QSGD(bits=4), schedule=WarmupSchedule(20, start=8))


# ---------------------------------------------------------------------------------------------- Lightning
class WireRecorder(pl.Callback):
    """Per rank: cumulative wire bytes after every batch."""

    def __init__(self, out: Path) -> None:
        self.out, self.bytes = Path(out), []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.bytes.append(float(trainer.strategy.comm_stats.wire_bytes))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(self.bytes, self.out / f"wire{trainer.global_rank}.pt")


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_of_every_step_follow_the_schedule(tmp_path: Path, world: int) -> None:
    schedule = {2: 0.2, 4: 0.1, 6: 0.05}  # steps 0-1 dense (start_step), then 20 %, 10 %, 5 %, target 2 %
    strategy = GradCompStrategy(compressor=CLTK(0.02), schedule=schedule, start_method="fork")
    records = fit(strategy, tmp_path, devices=world, model=TinyNet(samples=8 * world * 10),
                  max_epochs=1, callbacks=[WireRecorder(tmp_path)])
    assert_replicas_identical(records)
    net = TinyNet()
    compressed = [p.numel() for p in net.parameters() if p.dim() > 1 and p.numel() >= 1024]
    dense = sum(p.numel() for p in net.parameters()) - sum(compressed)
    total = sum(p.numel() for p in net.parameters())
    wire = [torch.load(tmp_path / f"wire{r}.pt") for r in range(world)]
    per_step = [[b - a for a, b in zip([0, *w], w)] for w in wire]
    steps = len(per_step[0])
    assert steps == 10
    for step in range(steps):
        if step < 2:
            expected = [all_reduce_bytes(4 * total, world)] * world
        else:
            ratio = StepSchedule(schedule).value(step, 0.02)
            k = sum(kept_count(n, ratio) for n in compressed)
            expected = [all_reduce_bytes(4 * (dense + 1), world) + broadcast_bytes(4 * k, world)
                        + all_reduce_bytes(4 * k, world)] * world  # dense head, leader's indices, values
        assert [p[step] for p in per_step] == pytest.approx(expected), f"step {step}"


def test_resume_in_the_middle_of_a_warmup_is_exact(tmp_path: Path) -> None:
    def run(out: Path, epochs: int, **options: Any) -> list[dict[str, Any]]:
        strategy = GradCompStrategy(compressor=TopK(0.02), schedule=WarmupSchedule(steps=12, start=0.3, stages=3),
                                    start_method="fork")
        return fit(strategy, out, model=TinyNet(samples=64), max_epochs=epochs, **options)  # 4 steps per epoch

    straight = run(tmp_path / "straight", 4)
    ckpt = tmp_path / "ckpt"
    run(tmp_path / "first", 2, callbacks=[ModelCheckpoint(dirpath=ckpt, save_last=True)], enable_checkpointing=True)
    resumed = run(tmp_path / "resumed", 4, ckpt_path=str(ckpt / "last.ckpt"))  # resumes at step 8, in stage 2
    for rank in range(2):
        tail = straight[rank]["params"][-len(resumed[rank]["params"]):]
        assert all(torch.equal(a, b) for a, b in zip(resumed[rank]["params"], tail, strict=True))
        assert resumed[rank]["stats"]["wire_bytes"] == straight[rank]["stats"]["wire_bytes"]
