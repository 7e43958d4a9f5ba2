"""The sparsifiers' kept fraction is `density`; `ratio=` (its old name, which also meant dense / wire bytes) warns."""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.compressors import CLTK, RandomK, TopK, create
from lightning_gradcomp.compressors.sparse import SparseCompressor

SPARSIFIERS = [TopK, RandomK, CLTK]


class _Mine(SparseCompressor):
    """A user's sparsifier built on the base class."""

    def reduce(self, tensors: list[torch.Tensor], ctx: Any) -> Any:
        raise NotImplementedError


@pytest.mark.parametrize("cls", [*SPARSIFIERS, _Mine])
def test_density_is_the_kept_fraction_and_the_per_layer_parameter(cls: type) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new word never warns
        compressor = cls(density=0.05)
        assert cls(0.05).density == compressor.density == compressor.default_param == 0.05
    assert cls.param_name == "density"
    assert repr(compressor).startswith(f"{cls.__name__}(density=0.05")
    with pytest.raises(ValueError, match=r"`density` must be in \(0.0, 1.0\]"):
        cls(density=0.0)
    with pytest.raises(ValueError, match="`density`"):
        compressor.check_param(1.5)


@pytest.mark.parametrize("cls", [*SPARSIFIERS, _Mine])
def test_ratio_still_works_and_warns_naming_density(cls: type) -> None:
    with pytest.warns(DeprecationWarning, match=rf"{cls.__name__}\(ratio=\.\.\.\) is deprecated: use "
                                                rf"{cls.__name__}\(density=0\.05\)") as caught:
        compressor = cls(ratio=0.05)
    assert compressor.density == 0.05
    assert caught[0].filename == __file__  # the warning points at the caller's line
    with pytest.warns(DeprecationWarning, match=r"`\.ratio` is deprecated: use `\.density`"):
        assert compressor.ratio == 0.05
    with pytest.raises(TypeError, match="pass `density` only"), pytest.warns(DeprecationWarning):
        cls(density=0.2, ratio=0.05)


def test_deprecated_ratio_in_a_registry_call_and_a_yaml_config() -> None:
    with pytest.warns(DeprecationWarning, match="density"):
        assert create("topk", ratio=0.2).density == 0.2
    parser = ArgumentParser()
    parser.add_argument("--strategy", type=GradCompStrategy)
    old = {"strategy": {"class_path": "lightning_gradcomp.GradCompStrategy", "init_args": {"compressor": {
        "class_path": "lightning_gradcomp.compressors.CLTK", "init_args": {"ratio": 0.05}}}}}
    new = {"strategy": {"class_path": "lightning_gradcomp.GradCompStrategy", "init_args": {"compressor": {
        "class_path": "lightning_gradcomp.compressors.CLTK", "init_args": {"density": 0.05}}}}}
    for config in (old, new):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            built = parser.instantiate_classes(parser.parse_string(yaml.safe_dump(config)))
        assert built.strategy.compressor.density == 0.05


@pytest.mark.parametrize("cls", SPARSIFIERS)
def test_a_compressor_pickled_with_a_ratio_attribute_still_loads(cls: type) -> None:
    """A checkpoint's hyperparameters or a spawn launch may hold a sparsifier pickled before the rename."""
    compressor = cls(density=0.05)
    vars(compressor)["ratio"] = vars(compressor).pop("density")  # the attributes of the previous release
    old = pickle.dumps(compressor)
    assert b"ratio" in old and b"density" not in old
    restored = pickle.loads(old)
    assert restored.density == 0.05 and "ratio" not in vars(restored)
    assert pickle.loads(pickle.dumps(restored)).density == 0.05
