"""LowPassMemoryFilter: arguments, schedule, similarity math, classic-EF limit, resume exactness."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from helpers.models import TinyNet, assert_replicas_identical, fit
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import LowPassMemoryFilter
from lightning_gradcomp.callbacks.lowpass import count_sketch, mean_pairwise_cosine
from lightning_gradcomp.comm import all_reduce_bytes
from lightning_gradcomp.compressors import CLTK, DIANA, QSGD, Cast, Compressor, NoCompression
from lightning_gradcomp.memory import ErrorFeedback


class _SaveAtEpochEnd(pl.Callback):
    """Write a full checkpoint at the end of every epoch (called on every rank, as required)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


class _DumpFilter(pl.Callback):
    """Write the filter's last figures and similarity bytes to ``<out>/filter<rank>.json``."""

    def __init__(self, out: Path, lowpass: LowPassMemoryFilter) -> None:
        self.out, self.lowpass = out, lowpass

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        f = self.lowpass
        data = {"similarity": f.last_similarity, "norm": f.last_memory_norm, "beta": trainer.strategy.beta,
                "wire": f.comm_stats.wire_bytes, "collectives": f.comm_stats.collectives}
        (self.out / f"filter{trainer.global_rank}.json").write_text(json.dumps(data))


def _strategy() -> GradCompStrategy:
    return GradCompStrategy(compressor=CLTK(0.02), start_method="fork")


# ---------------------------------------------------------------------------------------------- pure
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"beta": 0.0}, "beta"), ({"beta": 1.5}, "beta"), ({"beta": "high"}, "beta"),
    ({"schedule": [0.1]}, "schedule"), ({"schedule": {-1: 0.1}}, "schedule"), ({"schedule": {1.5: 0.1}}, "schedule"),
    ({"schedule": {True: 0.1}}, "schedule"), ({"schedule": {10: 0.0}}, "schedule"), ({"schedule": {10: 2}}, "schedule"),
    ({"similarity_every_n_steps": -1}, "similarity_every_n_steps"), ({"sketch_size": 0}, "sketch_size"),
    ({"similarity_every_n_steps": 1.5}, "similarity_every_n_steps")])
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        LowPassMemoryFilter(**kwargs)


def test_needs_a_gradcomp_strategy() -> None:
    trainer = SimpleNamespace(strategy=object())
    with pytest.raises(TypeError, match="GradCompStrategy"):
        LowPassMemoryFilter().setup(trainer, None, "fit")  # type: ignore[arg-type]


@pytest.mark.parametrize("compressor", [QSGD(), DIANA(), Cast(), NoCompression()])
def test_needs_an_error_feedback_compressor(compressor: Compressor) -> None:
    """Without an error-feedback memory the filter would change nothing: a clear error at setup, naming the
    compressor."""
    trainer = SimpleNamespace(strategy=GradCompStrategy(compressor))
    message = f"LowPassMemoryFilter filters the error-feedback memory, and {type(compressor).__name__}"
    with pytest.raises(ValueError, match=message):
        LowPassMemoryFilter().setup(trainer, None, "fit")  # type: ignore[arg-type]
    LowPassMemoryFilter().setup(SimpleNamespace(strategy=_strategy()), None, "fit")  # type: ignore[arg-type]


def test_schedule_is_piecewise_constant() -> None:
    f = LowPassMemoryFilter(beta=1.0, schedule={10: 0.1, 3: 0.5})
    assert [f.beta_at(s) for s in (0, 2, 3, 9, 10, 1000)] == [1.0, 1.0, 0.5, 0.5, 0.1, 0.1]
    assert LowPassMemoryFilter(beta=0.3).beta_at(123) == 0.3
    assert LowPassMemoryFilter(beta=1.0, schedule={"500": 0.1}).beta_at(500) == 0.1  # JSON-style keys


def test_mean_pairwise_cosine_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1000, generator=gen)
    vs = [base + 0.7 * torch.randn(1000, generator=gen) for _ in range(3)]
    us = [v / v.norm() for v in vs]
    direct = sum(float(us[i] @ us[j]) for i in range(3) for j in range(3) if i != j) / 6
    total = float(sum(us).square().sum())
    assert mean_pairwise_cosine(total, 3.0, 3) == pytest.approx(direct, abs=1e-6)


def test_count_sketch_is_linear_and_estimates_the_norm() -> None:
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(50_000, generator=gen), torch.randn(50_000, generator=gen)
    torch.testing.assert_close(count_sketch(a, 4096, 3) + count_sketch(b, 4096, 3), count_sketch(a + b, 4096, 3))
    estimate = float(count_sketch(a, 4096, 3).square().sum())
    assert estimate == pytest.approx(float(a.square().sum()), rel=0.1)  # rel. std ~ sqrt(2/4096) = 2 %


def test_beta_one_memory_is_classic_error_feedback() -> None:
    memory = ErrorFeedback(beta=1.0)
    g, c = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.0, -2.0, 0.0])
    memory.update("w", g - c)
    memory.commit()
    p = memory.compensate("w", g)  # m + g
    memory.update("w", p - c)
    memory.commit()
    torch.testing.assert_close(memory.memories["w"], p - c)
    memory.beta = 0.1  # low pass: m <- m + beta (g - c)
    m = memory.memories["w"].clone()
    p = memory.compensate("w", g)
    memory.update("w", p - c)
    memory.commit()
    torch.testing.assert_close(memory.memories["w"], m + 0.1 * (g - c))


# ---------------------------------------------------------------------------------------------- Lightning
def test_beta_one_reduces_to_classic_ef_and_beta_below_one_differs(tmp_path: Path) -> None:
    plain = fit(_strategy(), tmp_path / "plain", max_epochs=2)
    one = fit(_strategy(), tmp_path / "one", max_epochs=2, callbacks=[LowPassMemoryFilter(beta=1.0)])
    low = fit(_strategy(), tmp_path / "low", max_epochs=2, callbacks=[LowPassMemoryFilter(beta=0.1)])
    assert_replicas_identical(low)
    for a, b in zip(plain[0]["params"], one[0]["params"]):
        assert torch.equal(a, b)
    assert not torch.equal(plain[0]["params"][-1], low[0]["params"][-1])


def test_similarity_matches_the_memories_and_bytes_are_counted(tmp_path: Path) -> None:
    world = 3
    lowpass = LowPassMemoryFilter(beta=0.5, similarity_every_n_steps=1, sketch_size=None)
    records = fit(_strategy(), tmp_path, devices=world, max_epochs=2, model=TinyNet(samples=96),
                  callbacks=[lowpass, _DumpFilter(tmp_path, lowpass)])
    flat = []
    for rec in records:
        mem = rec["memory"]
        flat.append(torch.cat([mem[k].reshape(-1) for k in sorted(mem)]))
    us = [f / f.norm() for f in flat]
    direct = sum(float(us[i] @ us[j]) for i in range(world) for j in range(world) if i != j) / (world * (world - 1))
    dumped = [json.loads((tmp_path / f"filter{r}.json").read_text()) for r in range(world)]
    assert dumped[0]["beta"] == 0.5
    for d in dumped:
        assert d["similarity"] == pytest.approx(direct, abs=1e-5)
    # one all-reduce of the n normalized entries + 1 per measured step (steps 2..N: memories exist)
    n, measured = flat[0].numel(), records[0]["stats"]["steps"] - 2
    assert dumped[0]["collectives"] == measured
    assert dumped[0]["wire"] == pytest.approx(measured * all_reduce_bytes(4 * (n + 1), world))


def test_resume_is_exact_with_the_filter(tmp_path: Path) -> None:
    def lowpass() -> LowPassMemoryFilter:
        return LowPassMemoryFilter(beta=1.0, schedule={5: 0.3}, similarity_every_n_steps=2, sketch_size=512)

    straight = fit(_strategy(), tmp_path / "a", max_epochs=2, callbacks=[lowpass()])
    ckpt = tmp_path / "epoch1.ckpt"
    first = fit(_strategy(), tmp_path / "b", max_epochs=1, callbacks=[lowpass(), _SaveAtEpochEnd(ckpt)])
    second = fit(_strategy(), tmp_path / "c", max_epochs=2, callbacks=[lowpass()], ckpt_path=str(ckpt))
    saved = torch.load(ckpt, weights_only=True)
    assert any("LowPassMemoryFilter" in key for key in saved["callbacks"])
    for rank in range(2):
        losses = first[rank]["losses"] + second[rank]["losses"]
        assert len(losses) == len(straight[rank]["losses"]) == 8  # 4 steps per epoch, schedule switches at 5
        assert losses == pytest.approx(straight[rank]["losses"], abs=1e-6)
        for a, b in zip(first[rank]["params"] + second[rank]["params"], straight[rank]["params"]):
            assert torch.equal(a, b)
        for name, m in straight[rank]["memory"].items():
            assert torch.equal(m, second[rank]["memory"][name])
