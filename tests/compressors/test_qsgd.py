"""QSGD: arguments, per-layer bits (L-GreCo), registry and preset, and Lightning runs at W = 2, 3, 4."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from helpers.distributed import run_workers
from helpers.models import TinyNet, assert_replicas_identical, fit
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors import QSGD, create
from lightning_gradcomp.compressors.base import ReduceContext
from lightning_gradcomp.compressors.quantized import SlotCodec
from lightning_gradcomp.functional.quantize import qsgd_quantize
from lightning_gradcomp.plan import LayerSlot
from lightning_gradcomp.presets import PRESETS


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"bits": 1}, ValueError, "bits"),
    ({"bits": 9}, ValueError, "bits"),
    ({"bits": 4.5}, TypeError, "bits"),
    ({"bits": "4"}, TypeError, "bits"),
    ({"bucket_size": 0}, ValueError, "bucket_size"),
    ({"bucket_size": 2.5}, TypeError, "bucket_size"),
    ({"p": 1}, ValueError, "`p`"),
    ({"p": "max"}, ValueError, "`p`"),
    ({"aggregation": "ring"}, ValueError, "aggregation"),
])
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        QSGD(**kwargs)


def test_per_layer_bits_parameter() -> None:
    comp = QSGD(bits=4, bucket_size=256, p=2)
    assert comp.param_name == "bits" and comp.default_param == 4
    assert comp.check_param(6) == 6 and comp.check_param(3.0) == 3
    with pytest.raises(ValueError, match=r"`bits` must be in \[2, 8\]"):
        comp.check_param(12)
    assert comp.codec(None) == SlotCodec(7, 256, 2.0)
    assert comp.codec(2) == SlotCodec(1, 256, 2.0) and comp.codec(8).bits == 8
    assert not comp.uses_error_feedback


def test_registry_and_preset() -> None:
    assert isinstance(create("qsgd", bits=3), QSGD)
    kwargs = PRESETS["qsgd"][1]()
    assert isinstance(kwargs["compressor"], QSGD) and kwargs["compressor"].bits == 4
    assert "bits=4" in repr(kwargs["compressor"])
    assert "allgather" in repr(QSGD(aggregation="allgather"))


class _SetBits(pl.Callback):
    """Gives the two hidden matrices different widths, as L-GreCo would (identical dict on every rank)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.set_layer_params({"body.0.weight": 2, "body.2.weight": 8})


@pytest.mark.parametrize("world", [2, 3, 4])
def test_replicas_identical_with_per_layer_bits(tmp_path: Path, world: int) -> None:
    model = TinyNet(hidden=64, in_features=48, samples=16 * world, batch_size=4)
    records = fit(GradCompStrategy(compressor=QSGD(bits=4, bucket_size=64), start_method="fork"), tmp_path,
                  devices=world, model=model, callbacks=[_SetBits()])
    assert_replicas_identical(records)
    layers = records[0]["stats"]["layers"]
    assert layers["body.0.weight"]["param"] == 2 and layers["body.2.weight"]["param"] == 8
    assert layers["body.0.bias"]["compressed"] is False
    # Per element and compressed step, 8 bits + a scale per 64 cost (1 + 1/16) / (1/4 + 1/16) = 3.4x 2 bits.
    steps = records[0]["stats"]["steps"]
    per_elem = {k: (layers[k]["wire_bytes"] - 2 * layers[k]["dense_bytes"] / steps) / layers[k]["numel"]
                for k in ("body.0.weight", "body.2.weight")}
    assert per_elem["body.2.weight"] == pytest.approx(3.4 * per_elem["body.0.weight"], rel=0.1)
    losses = records[0]["losses"]
    assert all(loss == loss for loss in losses)  # finite training


def _local_is_this_ranks_seeded_message(rank: int, world: int) -> bool:
    comm = Comm(None, CommStats())
    slots = [LayerSlot("a", 0, (40, 30), True), LayerSlot("b", 1200, (500,), True)]
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(s.numel, generator=gen) for s in slots]
    ctx = ReduceContext(comm, 7, 3, slots, [4, 2], seed=9)
    red = QSGD(bits=4, bucket_size=64).reduce([x.clone() for x in xs], ctx)
    expected = [qsgd_quantize(x, bits, 64, ctx.generator(torch.device("cpu"), shared=False, salt=s.name)).decode()
                for x, bits, s in zip(xs, [4, 2], slots)]
    return all(torch.equal(a, b) for a, b in zip(red.local, expected))


def test_local_contribution_is_the_per_layer_seeded_message() -> None:
    """``Reduction.local`` (used by the compression-error logger) is this rank's own decoded message."""
    assert run_workers(_local_is_this_ranks_seeded_message, 2) == [True, True]
