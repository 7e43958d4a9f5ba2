"""Layer plans: slot layout and the compression policy."""

from __future__ import annotations

import torch

from lightning_gradcomp.plan import SlotPolicy, build_plan


def test_policy_defaults() -> None:
    policy = SlotPolicy()
    assert policy.wants((32, 32)) and policy.wants((4, 16, 4, 4))
    assert not policy.wants((4096,))          # 1-D stays dense by default
    assert not policy.wants((16, 16))         # 256 < min_numel
    assert SlotPolicy(compress_1d=True).wants((4096,))
    assert SlotPolicy(min_numel=1).wants((2, 2))


def test_build_plan_offsets_names_and_veto() -> None:
    params = [torch.zeros(64, 32), torch.zeros(64), torch.zeros(8, 8), torch.zeros(40, 40)]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    plan = build_plan(3, params, names, SlotPolicy(min_numel=1000), accepts=lambda slot: slot.name != "p3")
    assert plan.index == 3 and plan.numel == 2048 + 64 + 64 + 1600
    assert [s.offset for s in plan.slots] == [0, 2048, 2112, 2176]
    assert [s.name for s in plan.compressed] == ["p0"]
    assert [s.name for s in plan.dense] == ["p1", "p2", "p3"]
    assert plan.slots[3].end == plan.numel


def test_small_param_compresses_what_the_size_rule_leaves_out_except_empty_tensors() -> None:
    params = [torch.zeros(64, 32), torch.zeros(0, 5), torch.zeros(7), torch.zeros(0)]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    plan = build_plan(0, params, names, SlotPolicy(min_numel=1000, small_param=0.5))
    assert [(s.name, s.small) for s in plan.compressed] == [("p0", False), ("p2", True)]
    assert [s.name for s in plan.dense] == ["p1", "p3"]


def test_a_complex_parameter_takes_the_slot_of_its_real_view() -> None:
    """DDP's bucket holds a complex gradient as ``2 n`` real numbers: the slot covers both parts."""
    params = [torch.zeros(3, 4, dtype=torch.complex64), torch.zeros(5, dtype=torch.complex64), torch.zeros(2, 2)]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    plan = build_plan(0, params, names, SlotPolicy(min_numel=1, compress_1d=True))
    assert [s.shape for s in plan.slots] == [(3, 4, 2), (5, 2), (2, 2)]
    assert [s.offset for s in plan.slots] == [0, 24, 34] and plan.numel == 38
    # the size rule judges the parameter's own shape: a complex vector stays 1-D, dense unless compress_1d
    plan = build_plan(0, params, names, SlotPolicy(min_numel=1))
    assert [s.compressed for s in plan.slots] == [True, False, True]
