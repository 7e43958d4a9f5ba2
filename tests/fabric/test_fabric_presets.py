"""Every ``GradCompStrategy`` preset is a Fabric strategy name (declared now or later) and trains through Fabric."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import StrategyRegistry

import lightning_gradcomp  # noqa: F401 - registers the presets with Fabric
from helpers.fabric import assert_replicas_identical, run_fabric
from lightning_gradcomp import GradCompFabricStrategy, GradCompStrategy, LocalSGDStrategy
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.presets import PRESETS, UNUSED_SUFFIX, preset_class, register_preset

OURS = sorted(name for name in PRESETS if preset_class(name) is GradCompStrategy)
OTHERS = sorted(name for name in PRESETS if preset_class(name) is not GradCompStrategy)
TRAINER_ONLY = sorted(name for name in OURS if PRESETS[name][1]().get("layerwise") is not None)  # lgreco
RUNNABLE = [name for name in OURS if name not in TRAINER_ONLY]


def _variants(name: str) -> list[str]:
    return [name + suffix + unused for suffix in ("", "_spawn", "_fork") for unused in ("", UNUSED_SUFFIX)]


def test_every_gradcomp_preset_has_the_trainers_names_and_descriptions_in_fabric() -> None:
    assert "scalecom" in OURS and {"localsgd", "diloco", "swarmsgd"} <= set(OTHERS)
    for name in OURS:
        for variant in _variants(name):
            ours, theirs = STRATEGY_REGISTRY[variant], StrategyRegistry[variant]
            assert ours["description"] == theirs["description"], variant
            assert ours["init_params"] == theirs["init_params"], variant
    for name in OTHERS:
        assert not any(variant in STRATEGY_REGISTRY for variant in _variants(name)), f"{name} has no Fabric form"
    strategy = STRATEGY_REGISTRY.get("scalecom_fork")
    assert isinstance(strategy, GradCompFabricStrategy) and strategy._start_method == "fork"
    assert strategy._preset_name == "scalecom_fork"


def test_a_preset_declared_later_follows_into_fabric() -> None:
    register_preset("fabric_later", "DDP + top-10% (declared by a user)", lambda: {"compressor": TopK(density=0.1)})
    assert STRATEGY_REGISTRY["fabric_later_spawn"]["description"] == "DDP + top-10% (declared by a user)"
    strategy = STRATEGY_REGISTRY.get("fabric_later_fork" + UNUSED_SUFFIX)
    assert isinstance(strategy.compressor, TopK) and strategy.compressor.density == 0.1
    assert strategy._ddp_kwargs["find_unused_parameters"] is True
    with pytest.warns(UserWarning, match="re-declared"):
        register_preset("fabric_later", "Local SGD now", dict, strategy=LocalSGDStrategy)
    assert not any(variant in STRATEGY_REGISTRY for variant in _variants("fabric_later"))


def test_a_preset_name_taken_by_fabric_is_refused() -> None:
    with pytest.raises(ValueError, match="already a Lightning strategy name"):
        register_preset("dp", "taken by Fabric's DataParallel", dict)


def test_a_trainer_callback_preset_says_why_it_cannot_run_under_fabric() -> None:
    assert TRAINER_ONLY == ["lgreco"]
    with pytest.raises(ValueError, match="Trainer callback"):
        Fabric(accelerator="cpu", devices=2, strategy="lgreco_fork")
    with pytest.raises(ValueError, match="Trainer callback"):
        GradCompFabricStrategy(compressor="powersgd", layerwise=Callback())


def test_arguments_are_checked_as_for_the_trainer() -> None:
    with pytest.raises(ValueError, match="start_step"):
        GradCompFabricStrategy(compressor="topk", start_step=1)
    with pytest.raises(ValueError, match="ddp_comm_hook"):
        GradCompFabricStrategy(ddp_comm_hook=lambda *a: None)
    strategy = GradCompFabricStrategy(compressor="qsgd", bucket_cap_mb=2, find_unused_parameters=True)
    assert strategy._ddp_kwargs == {"bucket_cap_mb": 2, "find_unused_parameters": True, "gradient_as_bucket_view": True}


@pytest.mark.parametrize("name", RUNNABLE)
def test_every_preset_trains_through_fabric(tmp_path: Path, name: str) -> None:
    records = run_fabric(f"{name}_fork", tmp_path, 3)
    assert_replicas_identical(records)
    for record in records:
        assert record["hook_step"] == record["stats"]["steps"] == 3
        assert record["stats"]["wire_bytes"] > 0


@pytest.mark.slow
def test_an_instance_under_the_spawn_launcher(tmp_path: Path) -> None:
    records = run_fabric(GradCompFabricStrategy(compressor="topk", start_method="spawn"), tmp_path, 3)
    assert_replicas_identical(records)
    assert all(r["stats"]["compressed_steps"] == 1 and r["wire"][-1] < r["stats"]["dense_bytes"] for r in records)


def test_hierarchy_under_fabric(tmp_path: Path) -> None:
    strategy = GradCompFabricStrategy(compressor="topk", hierarchy=2, start_method="fork")
    records = run_fabric(strategy, tmp_path, 3, devices=4)
    assert_replicas_identical(records)
    assert all(r["stats"]["intra_bytes"] > 0 and r["stats"]["compressed_steps"] == 1 for r in records)
