"""The engine's observers: what a BucketRecord holds, and the raw gradients given on request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from helpers.models import assert_replicas_identical, fit
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.hook import BucketRecord


class _Observer:
    """Keeps copies of every record at the steps it wants (``needs_gradients`` as given)."""

    def __init__(self, needs_gradients: bool, steps: set[int]) -> None:
        self.needs_gradients = needs_gradients
        self.steps = steps
        self.seen: list[dict[str, Any]] = []

    def wants(self, step: int) -> bool:
        return step in self.steps

    def __call__(self, record: BucketRecord) -> None:
        def copy(xs: Any) -> Any:
            return None if xs is None else [x.detach().clone() for x in xs]

        self.seen.append({"step": record.step, "names": [s.name for s in record.slots], "inputs": copy(record.inputs),
                          "residuals": copy(record.residuals), "gradients": copy(record.gradients)})


class _Attach(pl.Callback):
    """Attaches the observers on every rank and saves what they saw (``<out>/obs<rank>.pt``)."""

    def __init__(self, out: Path, observers: dict[str, _Observer]) -> None:
        self.out, self.observers = Path(out), observers

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.hook.observers.extend(self.observers.values())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({k: o.seen for k, o in self.observers.items()}, self.out / f"obs{trainer.global_rank}.pt")


def _by_step(seen: list[dict[str, Any]]) -> dict[int, dict[str, torch.Tensor]]:
    """``step -> {"inputs"/"residuals"/"gradients": {layer: tensor}}`` over all buckets of that step."""
    out: dict[int, dict[str, Any]] = {}
    for rec in seen:
        row = out.setdefault(rec["step"], {"inputs": {}, "residuals": {}, "gradients": {}})
        for key in ("inputs", "residuals", "gradients"):
            if rec[key] is not None:
                row[key].update(zip(rec["names"], rec[key]))
    return out


def test_raw_gradients_only_on_request_and_inputs_are_memory_plus_gradient(tmp_path: Path) -> None:
    steps = set(range(2, 12))
    observers = {"raw": _Observer(True, steps), "plain": _Observer(False, steps | {12, 13})}
    records = fit(GradCompStrategy(compressor=TopK(ratio=0.1), start_step=2, start_method="fork"), tmp_path,
                  max_epochs=4, callbacks=[_Attach(tmp_path, observers)])
    assert_replicas_identical(records)
    for rank in range(2):
        seen = torch.load(tmp_path / f"obs{rank}.pt", weights_only=True)
        raw, plain = _by_step(seen["raw"]), _by_step(seen["plain"])
        assert sorted(raw) == sorted(steps) and sorted(plain) == sorted(steps | {12, 13})
        for step in (12, 13):  # no observer that needs gradients records these steps: nothing is copied
            assert plain[step]["gradients"] == {}
        for step in sorted(steps):
            row = raw[step]
            assert set(row["gradients"]) == set(row["inputs"]) and row["gradients"]
            for name, g in row["gradients"].items():
                assert g.dtype == torch.float32
                memory = raw[step - 1]["residuals"][name] if step - 1 in raw else torch.zeros_like(g)
                # with beta = 1 the memory is the last residual, so p = m + g exactly
                assert torch.equal(row["inputs"][name], memory + g)
                assert torch.equal(plain[step]["gradients"][name], g)  # one record, shared by the watchers
            if step > 2:  # the memory is not zero after a compressed step: inputs and gradients differ
                assert any(not torch.equal(row["inputs"][n], g) for n, g in row["gradients"].items())


def test_copying_gradients_does_not_change_training(tmp_path: Path) -> None:
    def run(out: Path, needs: bool) -> list[dict[str, Any]]:
        observers = {"o": _Observer(needs, set(range(20)))}
        return fit(GradCompStrategy(compressor=TopK(ratio=0.1), start_step=2, start_method="fork"), out,
                   max_epochs=2, callbacks=[_Attach(out, observers)])

    with_grads, without = run(tmp_path / "a", True), run(tmp_path / "b", False)
    for a, b in zip(with_grads[0]["params"], without[0]["params"]):
        assert torch.equal(a, b)


def test_resident_nbytes_counts_each_storage_once_through_objects_dicts_and_slots() -> None:
    from lightning_gradcomp.hook import resident_nbytes
    from lightning_gradcomp.memory import ErrorFeedback

    class Slotted:
        __slots__ = ("a", "b")

        def __init__(self, a: object, b: object) -> None:
            self.a, self.b = a, b

    base = torch.zeros(10)
    assert resident_nbytes(base, base[2:5], {"x": [base]}) == 40  # views share the storage
    assert resident_nbytes(Slotted(torch.zeros(3, dtype=torch.float64), None)) == 24
    ef = ErrorFeedback()
    ef.staging = True
    for _ in range(3):
        p = ef.compensate("w", torch.ones(25))
        ef.update("w", p)
        ef.commit()
    assert resident_nbytes(ef) == 25 * 4  # the memory alone between steps
