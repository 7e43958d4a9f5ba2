"""Presets: one declaration registers a Trainer strategy name at once, and each build gets a fresh compressor."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import StrategyRegistry

import lightning_gradcomp  # noqa: F401 - declares the package's presets
from lightning_gradcomp import GradCompStrategy, LocalSGDStrategy, SwarmStrategy, presets
from lightning_gradcomp.cli import main
from lightning_gradcomp.compressors import CLTK, TopK
from lightning_gradcomp.presets import PRESETS, preset_class, register_preset

VARIANTS = {"": "popen", "_spawn": "spawn", "_fork": "fork"}


@pytest.fixture
def name() -> Iterator[str]:
    """A preset name unique to the test, removed from every registry afterwards."""
    key = f"unit_test_{uuid.uuid4().hex[:8]}"
    yield key
    PRESETS.pop(key, None)
    presets._CLASSES.pop(key, None)
    for suffix in VARIANTS:
        StrategyRegistry.pop(key + suffix, None)


def _trainer(strategy: str) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)


def test_preset_declared_after_import_works_with_trainer(name: str) -> None:
    register_preset(name, "unit test: top-5%", lambda: {"compressor": TopK(ratio=0.05)})
    for suffix, method in VARIANTS.items():
        strategy = _trainer(name + suffix).strategy
        assert type(strategy) is GradCompStrategy and strategy._start_method == method
        assert isinstance(strategy.compressor, TopK) and strategy.compressor.ratio == 0.05
    assert StrategyRegistry[name]["description"] == "unit test: top-5%"
    assert name + "_fork" in StrategyRegistry.available_strategies()


def test_every_trainer_gets_its_own_compressor(name: str) -> None:
    calls = []
    register_preset(name, "unit test", lambda: calls.append(1) or {"compressor": TopK(ratio=0.05)})
    assert not calls  # declaring builds nothing
    first, second = _trainer(name).strategy, _trainer(name).strategy
    assert first.compressor is not second.compressor and len(calls) == 2


def test_other_strategy_class(name: str) -> None:
    register_preset(name, "unit test: gossip every 2 steps", lambda: {"local_steps": 2}, strategy=SwarmStrategy)
    assert preset_class(name) is SwarmStrategy
    strategy = _trainer(name + "_spawn").strategy
    assert type(strategy) is SwarmStrategy and strategy._start_method == "spawn"


def test_every_preset_is_a_strategy_name() -> None:
    assert {"gradcomp_topk", "scalecom", "lgreco", "swarmsgd", "localsgd", "diloco", "diloco_cltk"} <= set(PRESETS)
    for key, (description, _) in PRESETS.items():
        for suffix, method in VARIANTS.items():
            entry = StrategyRegistry[key + suffix]
            assert entry["description"] == description and entry["init_params"] == {"start_method": method}
    assert preset_class("diloco") is LocalSGDStrategy and preset_class("gradcomp_none") is GradCompStrategy


def test_register_strategies_reregisters_the_presets_of_its_class() -> None:
    registry = _StrategyRegistry()
    GradCompStrategy.register_strategies(registry)
    GradCompStrategy.register_strategies(registry)  # idempotent
    assert {"gradcomp_topk", "gradcomp_topk_fork", "scalecom_spawn"} <= set(registry)
    assert "swarmsgd" not in registry and "diloco" not in registry
    assert isinstance(registry.get("gradcomp_topk").compressor, TopK)
    SwarmStrategy.register_strategies(registry)
    LocalSGDStrategy.register_strategies(registry)
    assert type(registry.get("swarmsgd_fork")) is SwarmStrategy and type(registry.get("diloco")) is LocalSGDStrategy
    GradCompStrategy.register_strategies(StrategyRegistry)  # the global registry: same names, still fresh builds
    assert StrategyRegistry.get("gradcomp_topk").compressor is not StrategyRegistry.get("gradcomp_topk").compressor


def test_a_subclass_without_presets_keeps_the_old_registration_with_a_deprecation_warning(name: str) -> None:
    class MyStrategy(GradCompStrategy):
        pass

    registry = _StrategyRegistry()
    with pytest.warns(DeprecationWarning, match=r"register_preset\(name, description, factory, strategy=MyStrategy\)"):
        MyStrategy.register_strategies(registry)
    assert type(registry.get("gradcomp_topk")) is MyStrategy and isinstance(registry.get("scalecom").compressor, CLTK)
    assert "swarmsgd" not in registry
    register_preset(name, "unit test", lambda: {"compressor": TopK(0.1)}, strategy=MyStrategy)
    registry = _StrategyRegistry()
    MyStrategy.register_strategies(registry)  # declares its own now: only those, no warning
    unused = {name + suffix + "_find_unused_parameters_true" for suffix in VARIANTS}  # a DDP subclass: DDP's variants
    assert set(registry) == {name + suffix for suffix in VARIANTS} | unused and type(registry.get(name)) is MyStrategy


def test_redeclaring_warns_and_lightning_names_are_refused(name: str) -> None:
    register_preset(name, "unit test", dict)
    with pytest.warns(UserWarning, match="re-declared"):
        register_preset(name, "unit test, again", dict)
    assert StrategyRegistry[name]["description"] == "unit test, again"
    with pytest.raises(ValueError, match="'ddp' is already a Lightning strategy name"):
        register_preset("DDP", "not ours", dict)
    assert StrategyRegistry["ddp"]["strategy"] is not GradCompStrategy and "ddp" not in PRESETS


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    (("", "d", dict), {}, "name"), (("x", None, dict), {}, "description"), (("x", "d", None), {}, "factory"),
    (("x", "d", dict), {"strategy": TopK}, "strategy"),
])
def test_bad_declarations(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        register_preset(*args, **kwargs)
    assert "x" not in PRESETS


def test_unknown_preset_lists_the_names() -> None:
    with pytest.raises(KeyError, match="available: .*gradcomp_topk"):
        preset_class("nope")


def test_cli_lists_the_presets_with_their_descriptions(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    register_preset(name, "unit test preset", dict)
    assert main(["list"]) == 0
    strategies, compressors = capsys.readouterr().out.split("Strategy names")[1].split("Compressor names")
    lines = {line.split()[0]: line.split(None, 1)[1] for line in strategies.splitlines() if line.startswith("  ")}
    assert set(lines) == set(PRESETS)
    for key in ("gradcomp_topk", "swarmsgd", "diloco", name):
        assert lines[key] == PRESETS[key][0]
    assert "GradCompStrategy(beta=) or LowPassMemoryFilter" in compressors  # plain text, no reST
