"""A model with an unused parameter: the error points to a compressing fix, and that fix trains (issue 52, item 2).

DDP's error for it advises Lightning's ``strategy='ddp_find_unused_parameters_true'``, which is plain DDP. Every
GradCompStrategy preset has ``_find_unused_parameters_true`` variants, and the error names the one to use.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.strategies import StrategyRegistry

from helpers.models import TinyNet, assert_replicas_identical, fit
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.presets import PRESETS, preset_class

UNUSED_SUFFIX = "_find_unused_parameters_true"  # Lightning's naming (ddp_find_unused_parameters_true)


@pytest.mark.parametrize("devices", [1, 2])
def test_the_unused_parameter_error_names_the_compressing_variant(tmp_path: Path, devices: int) -> None:
    with pytest.raises(Exception) as caught:
        fit("scalecom_fork", tmp_path, devices=devices, max_epochs=1, model=TinyNet(unused_branch=True))
    message = str(caught.value)
    assert "'scalecom_fork_find_unused_parameters_true'" in message, message
    assert "GradCompStrategy(..., find_unused_parameters=True)" in message


def test_a_directly_built_strategy_gets_the_generic_hint() -> None:
    strategy = GradCompStrategy(compressor="topk")
    error = RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one.")
    strategy.on_exception(error)
    assert "find_unused_parameters=True" in str(error) and f"<preset>{UNUSED_SUFFIX}" in str(error)


def test_the_variant_trains_with_compression(tmp_path: Path) -> None:
    records = fit("gradcomp_topk_fork" + UNUSED_SUFFIX, tmp_path, devices=2, max_epochs=2,
                  model=TinyNet(unused_branch=True))
    assert_replicas_identical(records)
    stats = records[0]["stats"]
    assert stats["compressed_steps"] == stats["steps"] - 2 > 0 and stats["wire_bytes"] < stats["dense_bytes"]


def test_every_ddp_preset_has_the_variants_and_the_others_none() -> None:
    for name in PRESETS:
        for start in ("", "_spawn", "_fork"):
            variant = name + start + UNUSED_SUFFIX
            if issubclass(preset_class(name), GradCompStrategy):
                strategy = StrategyRegistry.get(variant)
                assert type(strategy) is preset_class(name) and strategy._ddp_kwargs["find_unused_parameters"]
                assert strategy._preset_name == name + start
            else:  # LocalSGD and Swarm keep the module unwrapped: no DDP reducer, nothing to find
                assert variant not in StrategyRegistry, variant
