"""Renamed arguments and functions keep working for one release, with a ``DeprecationWarning`` naming the new name.

The quantizers' ``bucket_size`` (QSGD, TernGrad, SignSGD) and DIANA's ``block_size`` are ``group_size`` (the number of
consecutive elements sharing one scale, as in ``SlotCodec.group_size``); ``registry.list`` is ``registry.names``.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from lightning_gradcomp.checks import check_bucket_size, check_group_size
from lightning_gradcomp.compressors import DIANA, QSGD, SignSGD, TernGrad, registry
from lightning_gradcomp.compressors.diana import BlockQuantizer
from lightning_gradcomp.functional.layerwise import quantization_errors, quantized_sizes
from lightning_gradcomp.functional.quantize import block_quantize, qsgd_quantize, sign_quantize, terngrad_quantize


@pytest.mark.parametrize("cls, kwargs", [(QSGD, {"bits": 3}), (TernGrad, {}), (SignSGD, {})])
def test_bucket_size_is_the_deprecated_name_of_group_size(cls: type, kwargs: dict[str, Any]) -> None:
    with pytest.warns(DeprecationWarning, match=rf"{cls.__name__}\(bucket_size=...\) is deprecated: use "
                                                rf"{cls.__name__}\(group_size=64\)") as caught:
        old = cls(bucket_size=64, **kwargs)
    assert caught[0].filename == __file__  # points at the call
    new = cls(group_size=64, **kwargs)
    assert repr(old) == repr(new) and old.group_size == 64 and "group_size=64" in repr(new)
    assert old.codec(None) == new.codec(None)
    with pytest.raises(TypeError, match="pass `group_size` only"):
        cls(group_size=32, bucket_size=64, **kwargs)
    with pytest.raises(ValueError, match="`bucket_size` must be in"):  # checked under the name the caller used
        cls(bucket_size=0, **kwargs)
    with pytest.warns(DeprecationWarning, match="use `.group_size`"):
        assert new.bucket_size == 64


def test_a_quantizer_pickled_with_bucket_size_loads() -> None:
    comp = QSGD(bits=4, group_size=128)
    state = dict(comp.__dict__)
    state["bucket_size"] = state.pop("group_size")
    old = QSGD.__new__(QSGD)
    old.__setstate__(state)  # what unpickling an object saved by the previous release does
    assert old.group_size == 128 and repr(old) == repr(comp)
    assert pickle.loads(pickle.dumps(comp)).group_size == 128


def test_block_size_is_the_deprecated_name_of_diana_s_group_size() -> None:
    with pytest.warns(DeprecationWarning, match=r"BlockQuantizer\(block_size=...\) is deprecated"):
        old = BlockQuantizer(p="l2", block_size=64)
    assert old == BlockQuantizer(2.0, 64) == BlockQuantizer(p=2, group_size=64)
    with pytest.warns(DeprecationWarning):
        assert DIANA({"p": 2, "block_size": 64}).quantizer == DIANA({"p": 2, "group_size": 64}).quantizer
    with pytest.warns(DeprecationWarning, match="use `.group_size`"):
        assert old.block_size == 64
    state = {"p": 2.0, "block_size": 32}  # a BlockQuantizer pickled by the previous release
    restored = BlockQuantizer.__new__(BlockQuantizer)
    restored.__setstate__(state)
    assert restored == BlockQuantizer(2.0, 32) and str(restored) == "l2:32"


def test_the_functional_quantizers_take_the_old_keywords_with_a_warning() -> None:
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))

    def same(a: Any, b: Any) -> bool:
        return torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)

    with pytest.warns(DeprecationWarning, match=r"qsgd_quantize\(bucket_size=...\) is deprecated"):
        old = qsgd_quantize(x, 4, bucket_size=16, generator=torch.Generator().manual_seed(1))
    assert same(old, qsgd_quantize(x, 4, group_size=16, generator=torch.Generator().manual_seed(1)))
    with pytest.warns(DeprecationWarning):
        old = terngrad_quantize(x, bucket_size=16, generator=torch.Generator().manual_seed(1))
    assert same(old, terngrad_quantize(x, 16, torch.Generator().manual_seed(1)))
    with pytest.warns(DeprecationWarning, match="block_quantize"):
        old = block_quantize(x, 2, block_size=16, generator=torch.Generator().manual_seed(1))
    assert same(old, block_quantize(x, 2, 16, torch.Generator().manual_seed(1)))
    with pytest.warns(DeprecationWarning):
        assert same(sign_quantize(x, bucket_size=16), sign_quantize(x, 16))
    with pytest.warns(DeprecationWarning):
        assert quantized_sizes(1000, [2, 4], bucket_size=512) == quantized_sizes(1000, [2, 4], 512)
    with pytest.warns(DeprecationWarning):
        assert quantization_errors(x, [2], bucket_size=8) == quantization_errors(x, [2], group_size=8)
    with pytest.raises(TypeError, match="pass `group_size` only"):
        sign_quantize(x, group_size=16, bucket_size=16)


def test_check_bucket_size_and_registry_list_are_deprecated_names() -> None:
    assert check_group_size(512) == 512
    with pytest.raises(ValueError, match="`group_size` must be in"):
        check_group_size(0)
    with pytest.warns(DeprecationWarning, match="use check_group_size"):
        assert check_bucket_size(64) == 64
    with pytest.warns(DeprecationWarning, match=r"use registry.names\(\)"):
        assert registry.list() == registry.names()
    assert "none" in registry.names() and registry.names() == sorted(registry.names())


def test_old_yaml_keys_still_configure_the_quantizers_through_jsonargparse() -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(QSGD, "qsgd")
    for key in ("group_size", "bucket_size"):
        parsed = parser.parse_string(f"qsgd:\n  bits: 3\n  {key}: 64\n")
        built = getattr(parser, "instantiate", parser.instantiate_classes)(parsed).qsgd
        assert built.group_size == 64 and built.bits == 3
