"""``small_param``: tensors the size rule leaves dense are compressed at their own parameter instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.models import TinyNet, assert_replicas_identical, fit
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import all_reduce_bytes, broadcast_bytes
from lightning_gradcomp.compressors import CLTK, QSGD, NoCompression, PowerSGD, TopK
from lightning_gradcomp.functional import kept_count
from lightning_gradcomp.plan import SlotPolicy, build_plan
from lightning_gradcomp.schedule import WarmupSchedule


def test_the_plan_marks_small_slots_and_keeps_vetoed_ones_dense() -> None:
    params = [torch.zeros(64, 32), torch.zeros(64), torch.zeros(4, 8), torch.zeros(128)]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    plain = build_plan(0, params, names, SlotPolicy())
    assert [(s.compressed, s.small) for s in plain.slots] == [(True, False), (False, False), (False, False),
                                                              (False, False)]
    small = build_plan(0, params, names, SlotPolicy(small_param=0.25), accepts=lambda slot: slot.numel != 128)
    assert [(s.compressed, s.small) for s in small.slots] == [(True, False), (True, True), (True, True),
                                                              (False, False)]  # the compressor's veto still holds


@pytest.mark.parametrize("kwargs, error, match", [
    ({"compressor": TopK(0.01), "small_param": 1.5}, ValueError, "small_param.*density"),
    ({"compressor": TopK(0.01), "small_param": "x"}, TypeError, "small_param"),
    ({"compressor": NoCompression(), "small_param": 0.5}, ValueError, "compression parameter"),
    ({"compressor": QSGD(bits=4), "small_param": 0}, ValueError, "small_param"),
])
def test_invalid_small_param_is_rejected(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        GradCompStrategy(**kwargs)


def test_powersgd_still_declines_vectors() -> None:
    strategy = GradCompStrategy(compressor=PowerSGD(rank=2), small_param=1)
    plan = build_plan(0, [torch.zeros(300), torch.zeros(64, 64)], {}, strategy.policy, strategy.compressor.accepts)
    assert [s.compressed for s in plan.slots] == [False, True]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bytes_and_replicas_with_every_tensor_compressed(tmp_path: Path, world: int) -> None:
    strategy = GradCompStrategy(compressor=CLTK(0.02), small_param=0.25, start_method="fork")
    records = fit(strategy, tmp_path, devices=world, model=TinyNet(samples=8 * world * 4), max_epochs=1)
    assert_replicas_identical(records)
    net = TinyNet()
    big = [p.numel() for p in net.parameters() if p.dim() > 1 and p.numel() >= 1024]
    small = [p.numel() for p in net.parameters() if not (p.dim() > 1 and p.numel() >= 1024)]
    assert small, "TinyNet must have small tensors for this test"
    k = sum(kept_count(n, 0.02) for n in big) + sum(kept_count(n, 0.25) for n in small)
    total = sum(big) + sum(small)
    per_step = all_reduce_bytes(4, world) + broadcast_bytes(4 * k, world) + all_reduce_bytes(4 * k, world)
    stats = records[0]["stats"]
    assert stats["steps"] == 4
    assert stats["wire_bytes"] == pytest.approx(2 * all_reduce_bytes(4 * total, world) + 2 * per_step)
    layers = stats["layers"]
    assert all(layers[name]["compressed"] for name in layers)
    assert {layers[name]["param"] for name in layers if layers[name]["numel"] < 1024} == {0.25}


def test_small_tensors_follow_a_schedule_relative_to_the_target(tmp_path: Path) -> None:
    strategy = GradCompStrategy(compressor=CLTK(0.02), small_param=0.1, schedule=WarmupSchedule(100, start=0.08),
                                start_method="fork")
    records = fit(strategy, tmp_path, model=TinyNet(samples=32), max_epochs=1)
    assert_replicas_identical(records)
    layers = records[0]["stats"]["layers"]
    params = [layers[n]["param"] for n in layers if layers[n]["numel"] < 1024]
    assert params and params == pytest.approx([0.4] * len(params))  # 0.1 * 0.08 / 0.02 in the first stage
