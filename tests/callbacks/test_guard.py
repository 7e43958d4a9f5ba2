"""The "nothing compressed" guard: diagnoses, warm-up logic, warn-once (no processes; real runs in test_logger)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import CompressionGuard, CompressionWarning
from lightning_gradcomp.callbacks.guard import diagnose_layout, diagnose_strategy
from lightning_gradcomp.comm import CommStats
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.plan import SlotPolicy, build_plan

SHAPES = {"enc.weight": (64, 64), "enc.bias": (64,), "head.weight": (4, 64)}


class FakeHook:
    """Just what the guard reads from a GradCompHook."""

    def __init__(self, policy: SlotPolicy, start_step: int = 2) -> None:
        params = [torch.zeros(shape) for shape in SHAPES.values()]
        names = {id(p): n for p, n in zip(params, SHAPES)}
        self.plan = build_plan(0, params, names, policy)
        self.compressor = TopK(density=0.05)
        self.stats = CommStats()
        self.step = 0
        self.start_step = start_step

    def plans(self) -> list[Any]:
        return [self.plan] if self.stats.steps else []

    def param_of(self, name: str) -> Any:
        return self.compressor.density

    def advance(self, dense: float, wire: float) -> None:
        self.stats.dense_bytes += dense
        self.stats.wire_bytes += wire
        self.stats.steps += 1
        self.step += 1


def fake_trainer(hook: FakeHook, policy: SlotPolicy) -> Any:
    strategy = SimpleNamespace(hook=hook, policy=policy, start_step=hook.start_step)
    return SimpleNamespace(strategy=strategy, global_step=hook.step)


def test_all_small_layers_are_explained() -> None:
    policy = SlotPolicy(min_numel=10**6)
    hook = FakeHook(policy)
    hook.advance(100.0, 100.0)
    text = diagnose_layout(hook, policy, 1.0, 3)
    assert "NO gradient tensor is compressed" in text
    assert "2 tensor(s) have fewer than min_numel=1000000" in text and "1 are 1-D" in text
    assert "'enc.weight' with 4096 elements" in text and "at most 4096" in text


def test_partial_compression_is_explained() -> None:
    policy = SlotPolicy(min_numel=1024)
    hook = FakeHook(policy)
    hook.advance(100.0, 99.0)
    text = diagnose_layout(hook, policy, 1.01, 3)
    assert "Only 1 of 3 tensors" in text and "TopK" in text and "density: 0.05" in text


def test_hook_that_never_ran_is_explained() -> None:
    policy = SlotPolicy()
    assert "never ran" in diagnose_layout(FakeHook(policy), policy, 1.0, 0)


def test_strategy_diagnosis() -> None:
    assert "not GradCompStrategy" in diagnose_strategy(DDPStrategy())
    env = LightningEnvironment()
    strategy = GradCompStrategy(cluster_environment=env)
    assert "world size 1" in diagnose_strategy(strategy)
    env.set_world_size(2)
    assert "no communication hook" in diagnose_strategy(strategy)
    strategy._hook = object()  # type: ignore[assignment]
    assert diagnose_strategy(strategy) is None


@pytest.mark.parametrize("ratio, fires", [(1.0, True), (1.02, True), (4.0, False), (float("inf"), False)])
def test_guard_judges_after_warmup_and_warns_once(ratio: float, fires: bool, recwarn: pytest.WarningsRecorder) -> None:
    policy = SlotPolicy(min_numel=10**6) if ratio == 1.0 else SlotPolicy()
    hook = FakeHook(policy)
    guard = CompressionGuard(warmup_steps=3, min_ratio=1.05)
    trainer = fake_trainer(hook, policy)
    for step in range(10):
        hook.advance(400.0, 400.0 if step < hook.start_step else 400.0 / ratio)
        trainer.global_step = hook.step
        guard.check(trainer, final=False)
        judged = hook.step >= hook.start_step + 3
        assert (guard.message is not None) == (fires and judged)
    fired = [w for w in recwarn if issubclass(w.category, CompressionWarning)]
    assert len(fired) == int(fires)
    if fires:
        assert ("NO gradient tensor" in str(fired[0].message)) == (ratio == 1.0)


def test_short_runs_are_judged_at_the_end() -> None:
    policy = SlotPolicy(min_numel=10**6)
    hook = FakeHook(policy)
    guard = CompressionGuard(warmup_steps=5)
    trainer = fake_trainer(hook, policy)
    for _ in range(4):  # 2 dense + 2 compressed steps: shorter than the warm-up
        hook.advance(400.0, 400.0)
        guard.check(trainer, final=False)
    assert guard.message is None
    with pytest.warns(CompressionWarning, match="over 2 step"):
        guard.check(trainer, final=True)


@pytest.mark.parametrize("kwargs, error", [({"warmup_steps": 0}, ValueError), ({"warmup_steps": 1.5}, TypeError),
                                           ({"min_ratio": 1.0}, ValueError), ({"min_ratio": "2"}, TypeError)])
def test_bad_arguments(kwargs: dict[str, Any], error: type) -> None:
    with pytest.raises(error, match=next(iter(kwargs))):
        CompressionGuard(**kwargs)
