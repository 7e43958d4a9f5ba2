"""The compressor registry and the Lightning strategy names."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_gradcomp  # noqa: F401 - registers the strategy names
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.compressors import Cast, NoCompression, RandomK, TopK, create, register, registry


def test_create_and_list() -> None:
    assert {"none", "fp16", "cast", "topk", "randomk"} <= set(registry.list())
    assert isinstance(create("topk", ratio=0.2), TopK) and create("TOPK", ratio=0.2).ratio == 0.2
    with pytest.raises(KeyError, match="available: .*topk"):
        create("nope")


def test_register_custom_and_warn_on_overwrite() -> None:
    @register("unit_test_none")
    class Mine(NoCompression):
        pass

    assert isinstance(create("unit_test_none"), Mine)
    with pytest.warns(UserWarning, match="re-registered"):
        register("unit_test_none")(NoCompression)


@pytest.mark.parametrize(("name", "kind", "method"), [
    ("gradcomp_none", NoCompression, "popen"), ("gradcomp_fp16", Cast, "popen"), ("gradcomp_topk_fork", TopK, "fork"),
    ("gradcomp_randomk_spawn", RandomK, "spawn"), ("gradcomp_bf16", Cast, "popen"),
])
def test_strategy_names(name: str, kind: type, method: str) -> None:
    strategy = StrategyRegistry.get(name)
    assert isinstance(strategy, GradCompStrategy) and isinstance(strategy.compressor, kind)
    assert strategy._start_method == method
