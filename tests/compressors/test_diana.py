"""DIANA: arguments and config forms, shift bookkeeping, exact convergence mechanism, replicas, resume."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from helpers.distributed import run_workers
from helpers.models import TinyNet, assert_replicas_identical, fit
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.shard_files import read_shards
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors import DIANA, BlockQuantizer, create
from lightning_gradcomp.compressors.base import ReduceContext
from lightning_gradcomp.functional.quantize import alpha_p
from lightning_gradcomp.plan import LayerSlot
from lightning_gradcomp.presets import PRESETS

SLOTS = [LayerSlot("w1", 0, (24, 20), True), LayerSlot("w2", 480, (333,), True)]


# ---------------------------------------------------------------------------- arguments
def test_default_alpha_is_half_alpha_p_of_the_block() -> None:
    assert DIANA().alpha == pytest.approx(alpha_p(128, "inf") / 2) == pytest.approx(0.0812, abs=1e-4)
    assert DIANA("l2:64").alpha == pytest.approx(1 / 16)
    assert DIANA(BlockQuantizer(2, 256), alpha=1 / 16).alpha == 1 / 16  # alpha_2(256) = 1/16 is allowed
    assert DIANA(alpha=0).alpha == 0.0  # shifts off: the paper's QSGD/TernGrad special case
    assert not DIANA().uses_error_feedback and DIANA().param_name is None


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"alpha": 0.2}, ValueError, r"`alpha` must be a number in \[0, alpha_p = 0.162"),
    ({"alpha": -0.01}, ValueError, "`alpha`"),
    ({"alpha": True}, TypeError, "`alpha` must be a number"),
    ({"alpha": "0.1"}, TypeError, "`alpha` must be a number"),
    ({"alpha": [0.1]}, TypeError, "`alpha` must be a number"),
    ({"alpha": float("nan")}, ValueError, r"`alpha` must be a number in \[0, alpha_p"),
    ({"quantizer": "l2:64", "alpha": 0.13}, ValueError, r"alpha_p = 0.125"),
    ({"quantizer": "l1"}, ValueError, "`p` must be 2 or inf"),
    ({"quantizer": "linf:abc"}, ValueError, "quantizer"),
    ({"quantizer": "linf:0"}, ValueError, "group_size"),
    ({"quantizer": 5}, TypeError, "quantizer"),
    ({"quantizer": {"p": 3}}, ValueError, "`p`"),
    ({"aggregation": "ring"}, ValueError, "aggregation"),
])
def test_bad_arguments_raise_clear_errors(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        DIANA(**kwargs)


def test_quantizer_forms_are_equivalent() -> None:
    forms = ["l2:64", "2:64", {"p": 2, "block_size": 64}, BlockQuantizer(p="l2", block_size=64)]
    assert {DIANA(f).quantizer for f in forms} == {BlockQuantizer(2.0, 64)}
    assert str(DIANA().quantizer) == "linf:128" and BlockQuantizer().alpha_max == alpha_p(128, math.inf)
    assert DIANA("linf").codec(None).bits == 2


def test_yaml_configuration_through_jsonargparse() -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(DIANA, "diana")
    for text, expected in [("diana:\n  quantizer: l2:64\n  alpha: 0.05\n", ("l2:64", 0.05)),
                           ("diana:\n  quantizer:\n    p: 2\n    block_size: 32\n", ("l2:32", 1 / math.sqrt(32) / 2)),
                           ("diana:\n  aggregation: allgather\n", ("linf:128", alpha_p(128, "inf") / 2))]:
        built = getattr(parser, "instantiate", parser.instantiate_classes)(parser.parse_string(text)).diana
        assert (str(built.quantizer), built.alpha) == pytest.approx(expected)


def test_registry_and_preset() -> None:
    assert isinstance(create("diana", quantizer="l2:16"), DIANA)
    comp = PRESETS["diana"][1]()["compressor"]
    assert isinstance(comp, DIANA) and comp.aggregation == "auto"


# ---------------------------------------------------------------------------- protocol
def _inputs(rank: int, step: int, fixed: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + (0 if fixed else step))
    return [torch.randn(s.numel, generator=gen) + rank for s in SLOTS]  # heterogeneous ranks


def _save_load(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _run(rank: int, world: int, kwargs: dict[str, Any], steps: int, fixed: bool, resume_at: int = -1) -> dict[str, Any]:
    comm = Comm(None, CommStats())
    comp = DIANA(**kwargs)
    outs, locals_ = [], []
    for step in range(steps):
        if step == resume_at:
            comp = DIANA(**kwargs)
            comp.load_state_dict(_save_load(state))  # noqa: F821 - saved in the previous iteration
        red = comp.reduce(_inputs(rank, step, fixed), ReduceContext(comm, step, 0, SLOTS, [None, None], seed=5))
        outs.append(torch.cat(red.averaged.wait()))
        locals_.append(torch.cat(red.local))
        state = comp.state_dict()
    return {"outs": outs, "locals": locals_, "state": state, "wire": comm.stats.wire_bytes}


@pytest.mark.parametrize("aggregation", ["alltoall", "allgather"])
def test_first_step_and_shift_bookkeeping(aggregation: str) -> None:
    world, steps = 3, 4
    results = run_workers(_run, world, {"quantizer": "linf:32", "aggregation": aggregation}, steps, False)
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["outs"], r["outs"]))
    if aggregation == "allgather":  # step 0: h = h_i = 0, so g_hat is the rank-ordered mean of the messages
        acc = results[0]["locals"][0].clone()
        for r in results[1:]:
            acc += r["locals"][0]
        assert torch.equal(results[0]["outs"][0], acc / world)
    states = [r["state"] for r in results]
    for name in ("w1", "w2"):
        mean_local = sum(s["local"][name] for s in states) / world
        for s in states[1:]:
            assert torch.equal(s["shift"][name], states[0]["shift"][name])  # replicated, bit-identical
        if aggregation == "allgather":
            assert torch.allclose(states[0]["shift"][name], mean_local, atol=1e-6)  # h = mean_i h_i
            assert states[0]["owned"] == {}
        else:
            for s in states:  # each owner's exact master shift equals mean_i h_i on its range
                if name in s["owned"]:
                    entry = s["owned"][name]
                    piece = mean_local[entry["start"]:entry["start"] + entry["value"].numel()]
                    assert torch.allclose(entry["value"], piece, atol=1e-6)
            owned = sum(s["owned"][name]["value"].numel() for s in states if name in s["owned"])
            assert owned == states[0]["local"][name].numel()  # the chunks partition the layer


@pytest.mark.parametrize("aggregation", ["alltoall", "allgather"])
def test_shifts_remove_the_quantization_error_for_fixed_gradients(aggregation: str) -> None:
    """Full local gradients at a fixed point: DIANA's estimate becomes exact; alpha = 0 keeps its error."""
    world, steps = 2, 120
    errors = {}
    for alpha in (None, 0.0):
        kwargs = {"quantizer": "linf:16", "alpha": alpha, "aggregation": aggregation}
        results = run_workers(_run, world, kwargs, steps, True)
        truth = sum(torch.cat(_inputs(r, 0, True)) for r in range(world)) / world
        errors[alpha] = float((results[0]["outs"][-1] - truth).norm() / truth.norm())
    assert errors[None] < 1e-4
    assert errors[0.0] > 0.05


@pytest.mark.parametrize(("world", "aggregation"), [(2, "auto"), (3, "auto"), (2, "alltoall")])
def test_state_round_trip_continues_bit_identically(world: int, aggregation: str) -> None:
    kwargs = {"quantizer": "linf:32", "aggregation": aggregation}
    straight = run_workers(_run, world, kwargs, 6, False)
    resumed = run_workers(_run, world, kwargs, 6, False, 3)
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a["outs"], b["outs"]))
    owned = bool(straight[0]["state"]["owned"])  # h_own: only the all-to-all keeps it
    assert owned == (aggregation == "alltoall" or world > 2)
    comp = DIANA(aggregation=aggregation)
    comp.load_state_dict(straight[0]["state"])
    comp.reset_state()
    assert comp.state_dict() == {"aggregation": aggregation, "local": {}, "shift": {}, "owned": {}}
    if aggregation == "alltoall":  # two explicit, different aggregations refuse each other's state
        with pytest.raises(ValueError, match="aggregation"):
            DIANA(aggregation="allgather").load_state_dict(straight[0]["state"])
    else:  # "auto" shares h/H between its two protocols: the state loads into either
        DIANA(aggregation="allgather").load_state_dict(straight[0]["state"])
        DIANA(aggregation="alltoall").load_state_dict(straight[0]["state"])


# ---------------------------------------------------------------------------- Lightning
@pytest.mark.parametrize(("world", "aggregation"),
                         [(2, "alltoall"), (3, "alltoall"), (4, "alltoall"), (3, "allgather")])
def test_replicas_identical_in_lightning(tmp_path: Path, world: int, aggregation: str) -> None:
    model = TinyNet(samples=16 * world, batch_size=4)
    records = fit(GradCompStrategy(compressor=DIANA("linf:64", aggregation=aggregation), start_method="fork"),
                  tmp_path, devices=world, model=model)
    assert_replicas_identical(records)


class _SaveAtEnd(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def test_resume_is_exact(tmp_path: Path) -> None:
    """Two epochs straight == one epoch, checkpoint, resume for the second (losses and parameters)."""
    def strategy() -> GradCompStrategy:
        return GradCompStrategy(compressor=DIANA("linf:64"), start_method="fork")

    straight = fit(strategy(), tmp_path / "straight", max_epochs=2, model=TinyNet(samples=32, batch_size=4))
    ckpt = tmp_path / "epoch1.ckpt"
    fit(strategy(), tmp_path / "first", max_epochs=1, model=TinyNet(samples=32, batch_size=4),
        callbacks=[_SaveAtEnd(ckpt)])
    saved = read_shards(ckpt)
    assert saved[0]["compressor"]["local"] and not torch.equal(saved[0]["compressor"]["local"]["body.2.weight"],
                                                               saved[1]["compressor"]["local"]["body.2.weight"])
    resumed = fit(strategy(), tmp_path / "resumed", max_epochs=2, model=TinyNet(samples=32, batch_size=4),
                  ckpt_path=str(ckpt))
    half = len(straight[0]["losses"]) // 2
    for a, b in zip(straight, resumed):
        assert len(b["losses"]) == half
        assert a["losses"][half:] == pytest.approx(b["losses"], abs=1e-6)
        assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a["params"][half:], b["params"]))
    assert_replicas_identical(resumed)
