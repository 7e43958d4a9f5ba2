"""LGreCo: schedule, tables, the adjustment itself (no processes), and Lightning runs with every family."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from helpers.models import ReadyOrderNet, TinyNet, assert_replicas_identical, fit
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import LGreCo
from lightning_gradcomp.callbacks.lgreco import layer_candidates, layer_table
from lightning_gradcomp.compressors import PowerSGD, RandomK, TopK
from lightning_gradcomp.compressors.qsgd import QSGD
from lightning_gradcomp.functional.sparsify import kept_count
from lightning_gradcomp.hook import BucketRecord
from lightning_gradcomp.plan import LayerSlot


# ---------------------------------------------------------------------------------------------- units
def test_schedule() -> None:
    cb = LGreCo(period=5, warmup_steps=10, accumulate_steps=2)
    assert [s for s in range(30) if cb.is_adjustment_step(s)] == [10, 15, 20, 25]
    assert [s for s in range(22) if cb.in_window(s)] == [8, 9, 13, 14, 18, 19]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"period": 0}, ValueError, "period"),
    ({"warmup_steps": 0}, ValueError, "warmup_steps"),
    ({"accumulate_steps": 6, "period": 5}, ValueError, "accumulate_steps"),
    ({"alpha": 0.0}, ValueError, "alpha"),
    ({"candidates": []}, TypeError, "candidates"),
    ({"candidates": [1, -2]}, ValueError, "candidates"),
    ({"min_factor": 1.5}, ValueError, "min_factor"),
    ({"max_factor": 0.5}, ValueError, "max_factor"),
    ({"resolution": 0}, ValueError, "resolution"),
    ({"log_layers": 1}, TypeError, "log_layers"),
    ({"error": "l1"}, ValueError, "error"),
    ({"error": "feedback "}, ValueError, "error"),
    ({"statistic": "memory"}, ValueError, "statistic"),
    ({"window": "mean"}, ValueError, "window"),
])
def test_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        LGreCo(**kwargs)


def test_candidates_respect_layer_and_compressor_limits() -> None:
    assert layer_candidates(PowerSGD(rank=4), (64, 32), range(1, 17)) == list(range(1, 17))
    assert layer_candidates(PowerSGD(rank=4), (20, 30), range(1, 17)) == list(range(1, 13))  # 50 r <= 600
    assert layer_candidates(QSGD(bits=4), (64, 64), range(1, 17)) == list(range(2, 9))
    assert layer_candidates(TopK(0.1), (64, 64), [0.05, 0.2, 2.0]) == [0.05, 0.1, 0.2]


def test_tables_per_family() -> None:
    stat = torch.randn(16, 24, generator=torch.Generator().manual_seed(0))
    sizes, errors = layer_table(PowerSGD(rank=2), stat.reshape(-1), (16, 24), [1, 2, 4])
    assert sizes == [4.0 * 40, 8.0 * 40, 16.0 * 40]
    assert errors[0] > errors[1] > errors[2] > 0
    ks = [kept_count(384, r) for r in (0.05, 0.1)]
    sizes, errors = layer_table(TopK(0.1), stat.reshape(-1), (16, 24), [0.05, 0.1])
    assert sizes == [8.0 * k for k in ks] and errors[0] > errors[1]
    sizes, _ = layer_table(RandomK(0.1), stat.reshape(-1), (16, 24), [0.05, 0.1])
    assert sizes == [4.0 * k for k in ks]
    sizes, errors = layer_table(QSGD(bits=4, bucket_size=128), stat.reshape(-1), (16, 24), [2, 4, 8])
    assert sizes == [96.0 + 12, 192.0 + 12, 384.0 + 12] and errors[0] > errors[1] > errors[2]


class _Comm:
    world_size = 1


def _fake(compressor: Any, step: int = 10) -> tuple[LGreCo, Any, dict]:
    applied: dict = {}
    hook = SimpleNamespace(step=step, comm=_Comm(), compressor=compressor, device=torch.device("cpu"))
    strategy = SimpleNamespace(set_layer_params=applied.update)
    return hook, strategy, applied


def _feed(cb: LGreCo, stats: dict[str, torch.Tensor]) -> None:
    slots = tuple(LayerSlot(name, 0, tuple(x.shape), True) for name, x in stats.items())
    cb._collector(BucketRecord(9, 0, slots, [x.reshape(-1) for x in stats.values()], None))


@pytest.mark.parametrize("statistic", ["gradient", "input"])
def test_statistic_selects_raw_gradients_or_compressor_inputs(statistic: str) -> None:
    cb = LGreCo(period=5, warmup_steps=10, accumulate_steps=2, statistic=statistic)
    assert cb._collector.needs_gradients == (statistic == "gradient")
    assert cb._collector.wants(8) and cb._collector.wants(9) and not cb._collector.wants(7)
    slot = (LayerSlot("w", 0, (3, 2), True),)
    grads = [torch.arange(6.0), torch.ones(6)]
    inputs = [g + 10.0 for g in grads]  # p = m + g with a memory of 10
    for step, (g, x) in enumerate(zip(grads, inputs), start=8):
        cb._collector(BucketRecord(step, 0, slot, [x], None, [g]))
    cb._collector.fold()
    expected = grads[0] + grads[1] if statistic == "gradient" else inputs[0] + inputs[1]
    assert torch.equal(cb._collector.sums["w"], expected) and cb._collector.steps == {8, 9}
    cb._collector.reset()
    cb._collector(BucketRecord(9, 0, slot, [inputs[0]], None))  # an engine without raw gradients: the inputs
    cb._collector.fold()
    assert torch.equal(cb._collector.sums["w"], inputs[0])


@pytest.mark.parametrize("window", ["sum", "steps"])
def test_a_step_counts_the_last_of_its_backward_passes(window: str) -> None:
    """Several synchronized backward passes per optimizer step (manual accumulation) hand over the bucket as it
    accumulates: the window counts each step once, with its last pass's statistic, per layer (a layer may sit in
    another bucket than the others); a pass's record waits until a later step's record or ``fold(before=step)``."""
    cb = LGreCo(period=5, warmup_steps=10, accumulate_steps=3, window=window)
    collector = cb._collector
    slots = (LayerSlot("a", 0, (4,), True), LayerSlot("b", 4, (6,), True))
    gen = torch.Generator().manual_seed(0)
    last = {}
    for step, passes in ((7, 3), (8, 1), (9, 2)):
        for _ in range(passes):
            grads = [torch.randn(4, generator=gen), torch.randn(6, generator=gen)]
            for slot, g in zip(slots, grads):  # one bucket per layer
                collector(BucketRecord(step, slot.offset, (slot,), [g + 1.0], None, [g]))
            last[step] = grads
        if step == 7:  # a batch ended before the optimizer stepped (the hook's step is still 7): nothing folds
            collector.fold(before=7)
            assert not collector.sums and not collector.per_step
    collector.fold(before=9)  # after step 9's optimizer step the hook's step would be 10; 9 still waits here
    assert collector.current["a"][0] == 9 and torch.equal(collector.current["b"][1], last[9][1])
    collector.fold()
    for i, name in enumerate(("a", "b")):
        if window == "sum":
            assert torch.equal(collector.sums[name], last[7][i] + last[8][i] + last[9][i])
        else:
            assert [x.tolist() for x in collector.per_step[name]] == [last[s][i].tolist() for s in (7, 8, 9)]
    assert collector.steps == {7, 8, 9} and not collector.current


def test_adjustment_saves_bytes_at_equal_error() -> None:
    gen = torch.Generator().manual_seed(1)
    low = torch.randn(64, 1, generator=gen) @ torch.randn(1, 48, generator=gen)  # rank 1: rank 1 suffices
    full = torch.randn(64, 48, generator=gen)  # flat spectrum: extra rank buys error cheaply here
    cb = LGreCo(period=5, warmup_steps=10, accumulate_steps=1, min_factor=0.25, max_factor=2.0)
    hook, strategy, applied = _fake(PowerSGD(rank=4))
    cb._hook = hook
    _feed(cb, {"low": low, "full": full})
    entry = cb.adjust(strategy)
    assert entry["feasible"] and applied == cb.choice
    assert applied["low"] == 1
    assert entry["error"] <= entry["budget"] == pytest.approx(entry["uniform_error"])
    assert entry["bytes"] < entry["uniform_bytes"]
    assert not cb._collector.sums  # statistics restart after each adjustment


def test_squared_error_budget_bounds_the_total_squared_error() -> None:
    gen = torch.Generator().manual_seed(2)
    stats = {"a": torch.randn(64, 48, generator=gen) * 3.0, "b": torch.randn(32, 40, generator=gen)}
    cb = LGreCo(period=5, warmup_steps=10, accumulate_steps=1, error="squared", alpha=1.2)
    hook, strategy, applied = _fake(PowerSGD(rank=4))
    cb._hook = hook
    _feed(cb, stats)
    entry = cb.adjust(strategy)
    grids = {name: layer_candidates(PowerSGD(rank=4), tuple(x.shape), range(1, 17)) for name, x in stats.items()}
    uniform = sum(layer_table(PowerSGD(rank=4), x, tuple(x.shape), [4])[1][0] ** 2 for x in stats.values())
    assert entry["uniform_error"] == pytest.approx(uniform)
    chosen = sum(layer_table(PowerSGD(rank=4), stats[n], tuple(stats[n].shape), [applied[n]])[1][0] ** 2
                 for n in stats)
    assert chosen == pytest.approx(entry["error"]) and chosen <= 1.2 * uniform * (1 + 1e-9)
    assert all(applied[n] in grids[n] for n in stats)


def test_feedback_error_budget_protects_starved_layers() -> None:
    gen = torch.Generator().manual_seed(3)
    stats = {"a": torch.randn(64, 48, generator=gen), "b": torch.randn(32, 40, generator=gen) * 0.1}
    norm_cb, fb_cb = (LGreCo(period=5, warmup_steps=10, accumulate_steps=1, error=e) for e in ("norm", "feedback"))
    entries = {}
    for cb in (norm_cb, fb_cb):
        hook, strategy, _ = _fake(TopK(0.1))
        cb._hook = hook
        _feed(cb, stats)
        entries[cb.error] = cb.adjust(strategy)
    fb = entries["feedback"]
    # the feedback budget is the uniform setting's steady-state memory, sum_l e_l / (1 - e_l / ||A_l||)
    grid = {n: fb_cb.grid(TopK(0.1), tuple(x.shape)) for n, x in stats.items()}
    expected = 0.0
    for x in stats.values():
        e = layer_table(TopK(0.1), x.reshape(-1), tuple(x.shape), [0.1])[1][0]
        expected += e / (1 - e / float(x.double().norm()))
    assert fb["uniform_error"] == pytest.approx(expected) and fb["error"] <= fb["budget"]
    assert fb["uniform_error"] > entries["norm"]["uniform_error"]
    assert all(v in grid[n] for n, v in zip(fb["layers"], fb["values"]))
    # QSGD has no error feedback: "feedback" is the plain norm there
    tables = {}
    for error in ("norm", "feedback"):
        cb = LGreCo(period=5, warmup_steps=10, accumulate_steps=1, error=error)
        hook, strategy, _ = _fake(QSGD(bits=4, bucket_size=128))
        cb._hook = hook
        _feed(cb, stats)
        tables[error] = cb.adjust(strategy)
    assert tables["norm"]["uniform_error"] == tables["feedback"]["uniform_error"]
    assert tables["norm"]["values"] == tables["feedback"]["values"]


@pytest.mark.parametrize("error", ["norm", "squared"])
def test_steps_window_averages_single_step_errors(error: str) -> None:
    """window="steps": each candidate's error is the mean of its errors on the single steps, not the sum's."""
    gen = torch.Generator().manual_seed(4)
    steps = [{"a": torch.randn(1, 48, generator=gen).expand(64, 48) * torch.randn(64, 1, generator=gen),
              "b": torch.randn(32, 40, generator=gen)} for _ in range(3)]  # "a" has rank 1 on each step only
    entries = {}
    for window in ("sum", "steps"):
        cb = LGreCo(period=5, warmup_steps=10, accumulate_steps=3, window=window, error=error)
        hook, strategy, _ = _fake(PowerSGD(rank=4))
        cb._hook = hook
        for step, stats in enumerate(steps, start=7):
            slots = tuple(LayerSlot(name, 0, tuple(x.shape), True) for name, x in stats.items())
            cb._collector(BucketRecord(step, 0, slots, [x.reshape(-1) for x in stats.values()], None))
        entries[window] = cb.adjust(strategy)
    power = 2 if error == "squared" else 1
    expected = sum(sum(layer_table(PowerSGD(rank=4), stats[n], tuple(stats[n].shape), [4])[1][0] ** power
                       for stats in steps) / len(steps) for n in ("a", "b"))
    assert entries["steps"]["uniform_error"] == pytest.approx(expected)
    summed = {n: sum(stats[n] for stats in steps) for n in ("a", "b")}
    expected_sum = sum(layer_table(PowerSGD(rank=4), x, tuple(x.shape), [4])[1][0] ** power for x in summed.values())
    assert entries["sum"]["uniform_error"] == pytest.approx(expected_sum)
    assert entries["steps"]["window"] == "steps" and entries["steps"]["error"] <= entries["steps"]["budget"]
    assert dict(zip(entries["steps"]["layers"], entries["steps"]["values"]))["a"] == 1  # rank 1 is exact per step


def test_infeasible_keeps_previous_choice_with_warning() -> None:
    cb = LGreCo(period=5, warmup_steps=10, accumulate_steps=1, alpha=1e-9)
    hook, strategy, applied = _fake(TopK(0.1))
    cb._hook = hook
    cb.choice = {"w": 0.2}
    _feed(cb, {"w": torch.randn(32, 32)})
    with pytest.warns(UserWarning, match="keeping the previous"):
        entry = cb.adjust(strategy)
    assert not entry["feasible"] and entry["values"] == [0.2]
    assert cb.choice == {"w": 0.2} and applied == {}


def test_no_statistics_warns_and_skips() -> None:
    cb = LGreCo(period=5, warmup_steps=10, accumulate_steps=1)
    hook, strategy, applied = _fake(TopK(0.1))
    cb._hook = hook
    with pytest.warns(UserWarning, match="no compressed-gradient statistics"):
        assert cb.adjust(strategy) is None
    assert applied == {}


def test_state_dict_round_trip() -> None:
    cb = LGreCo()
    cb.choice, cb._last_step, cb.history = {"a": 3}, 7, [{"step": 7}]
    other = LGreCo()
    other.load_state_dict(cb.state_dict())
    assert other.choice == {"a": 3} and other._last_step == 7 and other.history == [{"step": 7}]


def test_strategy_validates_and_copies_layerwise() -> None:
    with pytest.raises(TypeError, match="layerwise"):
        GradCompStrategy(compressor=PowerSGD(), layerwise="lgreco")
    cb = LGreCo()
    strategy = GradCompStrategy(compressor=PowerSGD(), layerwise=cb)
    assert isinstance(strategy.layerwise, LGreCo) and strategy.layerwise is not cb


def test_registry_name() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = StrategyRegistry.get("lgreco")
    assert isinstance(strategy.compressor, PowerSGD) and isinstance(strategy.layerwise, LGreCo)


# ---------------------------------------------------------------------------------------------- Lightning
class _Dump(pl.Callback):
    """Saves per rank: the layer parameters at train start and end, and the LGreCo state."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.start: dict = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = dict(trainer.strategy.hook.layer_params)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        lg = [cb for cb in trainer.callbacks if isinstance(cb, LGreCo)]
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({"start": self.start, "end": dict(trainer.strategy.hook.layer_params),
                    "history": lg[0].history if lg else None, "n_lgreco": len(lg),
                    "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("lgreco")}},
                   self.out / f"dump{trainer.global_rank}.pt")


def _load(out: Path, world: int) -> list[dict]:
    return [torch.load(out / f"dump{r}.pt", weights_only=True) for r in range(world)]


def _model() -> TinyNet:
    return TinyNet(hidden=64, in_features=48, samples=64, batch_size=8)


def _lgreco(alpha: float = 1.3, **kwargs: Any) -> LGreCo:
    # alpha > 1 so that the tiny two-layer model has a cheaper non-uniform answer (the test checks it moved).
    return LGreCo(period=3, warmup_steps=4, accumulate_steps=2, alpha=alpha, **kwargs)


COMPRESSORS = {  # compressor, alpha
    "powersgd": (lambda: PowerSGD(rank=2), 1.3),
    "topk": (lambda: TopK(ratio=0.05), 1.3),
    "qsgd": (lambda: QSGD(bits=4, bucket_size=128), 2.5),  # one bit less roughly doubles the error
}


@pytest.mark.parametrize("family", sorted(COMPRESSORS))
def test_every_family_adjusts_identically_on_all_ranks(tmp_path: Path, family: str) -> None:
    world = 2
    make, alpha = COMPRESSORS[family]
    strategy = GradCompStrategy(compressor=make(), start_method="fork")
    records = fit(strategy, tmp_path, devices=world, model=_model(), max_epochs=3,
                  callbacks=[_lgreco(alpha), _Dump(tmp_path)])
    assert_replicas_identical(records)
    dumps = _load(tmp_path, world)
    history = dumps[0]["history"]
    assert [h["step"] for h in history] == [4, 7, 10]
    assert all(h["feasible"] and h["stat_steps"] == 2 and h["statistic"] == "gradient" for h in history)
    assert all(h["error"] <= h["budget"] for h in history)
    assert any(h["values"] != [make().default_param] * 2 for h in history)  # a non-uniform choice was applied
    assert all(h["bytes"] < h["uniform_bytes"] for h in history if not h["uniform"])
    assert dumps[0]["end"] == dict(zip(history[-1]["layers"], history[-1]["values"]))
    assert set(dumps[0]["end"]) == {"body.0.weight", "body.2.weight"}
    for d in dumps[1:]:
        assert d["end"] == dumps[0]["end"] and d["history"] == history
    for rec in records:  # the engine used the chosen values on every rank
        for name, value in dumps[0]["end"].items():
            assert rec["stats"]["layers"][name]["param"] == value
    assert dumps[0]["metrics"]["lgreco/budget"] == pytest.approx(history[-1]["budget"])


@pytest.mark.parametrize("setting", [{"statistic": "input"}, {"window": "steps"}])
def test_other_statistics_adjust_identically_on_all_ranks(tmp_path: Path, setting: dict[str, str]) -> None:
    records = fit(GradCompStrategy(compressor=TopK(ratio=0.05), start_method="fork"), tmp_path, model=_model(),
                  max_epochs=3, callbacks=[_lgreco(**setting), _Dump(tmp_path)])
    assert_replicas_identical(records)
    dumps = _load(tmp_path, 2)
    history = dumps[0]["history"]
    key, value = next(iter(setting.items()))
    assert [h[key] for h in history] == [value] * 3 and all(h["feasible"] for h in history)
    assert dumps[1]["history"] == history


def test_three_ranks_and_strategy_attached(tmp_path: Path) -> None:
    world = 3
    strategy = GradCompStrategy(compressor=PowerSGD(rank=2), start_method="fork",
                                layerwise=LGreCo(period=2, warmup_steps=4, accumulate_steps=1))
    records = fit(strategy, tmp_path, devices=world, model=_model(), max_epochs=3, callbacks=[_Dump(tmp_path)])
    assert_replicas_identical(records)
    dumps = _load(tmp_path, world)
    assert dumps[0]["n_lgreco"] == 1
    assert [h["step"] for h in dumps[0]["history"]] == [4, 6, 8]
    for d in dumps[1:]:
        assert d["end"] == dumps[0]["end"] and d["history"] == dumps[0]["history"]


@pytest.mark.parametrize("world", [2, 3])
def test_resume_keeps_choice_and_is_exact(tmp_path: Path, world: int) -> None:
    def strategy() -> GradCompStrategy:
        return GradCompStrategy(compressor=PowerSGD(rank=2), start_method="fork")

    def model() -> TinyNet:  # 4 steps per epoch
        return (TinyNet if world == 2 else ReadyOrderNet)(hidden=64, in_features=48, samples=32 * world, batch_size=8)

    full = fit(strategy(), tmp_path / "full", devices=world, model=model(), max_epochs=3,
               callbacks=[_lgreco(), _Dump(tmp_path / "full")])
    ckpt = tmp_path / "ckpt"
    fit(strategy(), ckpt, devices=world, model=model(), max_epochs=2, enable_checkpointing=True,
        callbacks=[_lgreco(), _Dump(ckpt), pl.callbacks.ModelCheckpoint(dirpath=ckpt, save_last=True)])
    first = _load(ckpt, world)
    assert len(set(first[0]["end"].values())) > 1  # a non-uniform choice was made before the checkpoint
    saved = torch.load(ckpt / "last.ckpt", weights_only=True)
    lg_state = next(v for k, v in saved["callbacks"].items() if "LGreCo" in k)
    assert lg_state["choice"] == first[0]["end"] and lg_state["last_step"] == 7

    resumed_dir = tmp_path / "resumed"
    resumed = fit(strategy(), resumed_dir, devices=world, model=model(), max_epochs=3,
                  ckpt_path=str(ckpt / "last.ckpt"), callbacks=[_lgreco(), _Dump(resumed_dir)])
    dumps = _load(resumed_dir, world)
    for d in dumps:
        assert d["start"] == first[0]["end"]  # re-applied before the first resumed step
        assert d["end"] == _load(tmp_path / "full", world)[0]["end"]
    assert [h["step"] for h in dumps[0]["history"]] == [4, 7, 10]
    assert_replicas_identical(resumed)
    tail = full[0]["params"][-len(resumed[0]["params"]):]
    assert all(torch.equal(a, b) for a, b in zip(resumed[0]["params"], tail, strict=True))
