"""TernGrad: arguments, encoding, registry and preset, and identical replicas in Lightning."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.distributed import run_workers
from helpers.models import TinyNet, assert_replicas_identical, fit
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors import TernGrad, create
from lightning_gradcomp.compressors.base import ReduceContext
from lightning_gradcomp.plan import LayerSlot
from lightning_gradcomp.presets import PRESETS


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"bucket_size": 0}, ValueError, "bucket_size"),
    ({"bucket_size": "64"}, TypeError, "bucket_size"),
    ({"aggregation": "reduce"}, ValueError, "aggregation"),
])
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        TernGrad(**kwargs)


def test_ternary_codec_registry_and_preset() -> None:
    comp = TernGrad(bucket_size=256)
    codec = comp.codec(None)
    assert (codec.levels, codec.bits, codec.group_size, codec.p) == (1, 2, 256, math.inf)
    assert comp.param_name is None and not comp.uses_error_feedback
    assert isinstance(create("terngrad"), TernGrad)
    assert isinstance(PRESETS["terngrad"][1]()["compressor"], TernGrad)


def _local_is_ternary(rank: int, world: int) -> dict[str, Any]:
    comm = Comm(None, CommStats())
    slot = LayerSlot("w", 0, (40, 10), True)
    x = torch.randn(400, generator=torch.Generator().manual_seed(rank))
    red = TernGrad(bucket_size=100).reduce([x.clone()], ReduceContext(comm, 3, 0, [slot], [None]))
    local = red.local[0]
    scales = x.reshape(4, 100).abs().amax(1).repeat_interleave(100)
    return {"ok": bool(((local == 0) | (local.abs() == scales)).all()), "sign": bool((local * x >= 0).all()),
            "out": red.averaged.wait()[0]}


def test_local_contribution_is_scaled_ternary_and_ranks_agree() -> None:
    results = run_workers(_local_is_ternary, 2)
    assert all(r["ok"] and r["sign"] for r in results)
    assert torch.equal(results[0]["out"], results[1]["out"])


@pytest.mark.parametrize("world", [2, 3])
def test_replicas_identical_in_lightning(tmp_path: Path, world: int) -> None:
    model = TinyNet(samples=16 * world, batch_size=4)
    records = fit(GradCompStrategy(compressor=TernGrad(bucket_size=128), start_method="fork"), tmp_path,
                  devices=world, model=model)
    assert_replicas_identical(records)
    assert records[0]["stats"]["compressed_steps"] >= 2
