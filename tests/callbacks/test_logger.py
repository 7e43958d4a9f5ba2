"""CompressionLogger: documented metric names in a CSVLogger, correct values, error probe, guard in a real run."""

from __future__ import annotations

import csv
import json
import math
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import Recorder, TinyNet
from lightning.pytorch.loggers import CSVLogger

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import CompressionLogger, CompressionWarning
from lightning_gradcomp.callbacks import logger as names
from lightning_gradcomp.comm import all_gather_bytes, all_reduce_bytes
from lightning_gradcomp.compressors import Cast, TopK
from lightning_gradcomp.functional.sparsify import kept_count
from lightning_gradcomp.hook import BucketRecord
from lightning_gradcomp.plan import LayerSlot

DOCS = Path(__file__).resolve().parents[2] / "docs" / "monitoring.md"


class Catcher(pl.Callback):
    """Per rank: records warnings raised during fit and the hook's observers after the logger's teardown."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._ctx: Any = None
        self._caught: list[warnings.WarningMessage] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ctx = warnings.catch_warnings(record=True)
        self._caught = self._ctx.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        hook = getattr(trainer.strategy, "hook", None)
        record = {"warnings": [[w.category.__name__, str(w.message)] for w in self._caught],
                  "observers": len(hook.observers) if hook is not None else None}
        self._ctx.__exit__(None, None, None)
        (self.out / f"catch{trainer.global_rank}.json").write_text(json.dumps(record))


def run(tmp_path: Path, strategy: Any, logger_cb: CompressionLogger, **kwargs: Any) -> dict[str, Any]:
    """A 2-rank fork fit of TinyNet with a CSVLogger; returns metrics, per-rank records and caught warnings."""
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=CSVLogger(tmp_path / "logs"),
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=True,
                         callbacks=[Recorder(tmp_path), logger_cb, Catcher(tmp_path)], **kwargs)
    trainer.fit(TinyNet())
    (path,) = list((tmp_path / "logs").rglob("metrics.csv"))
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    return {"rows": rows, "columns": set(rows[0]), "callback_metrics": dict(trainer.callback_metrics),
            "records": [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)],
            "catch": [json.loads((tmp_path / f"catch{r}.json").read_text()) for r in range(2)]}


def series(rows: list[dict[str, str]], name: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[name])) for r in rows if r.get(name)]


def compression_warnings(catch: dict[str, Any]) -> list[str]:
    return [msg for cat, msg in catch["warnings"] if cat == CompressionWarning.__name__]


@pytest.fixture(scope="module")
def topk_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("topk")
    strategy = GradCompStrategy(compressor=TopK(density=0.1), start_method="fork")
    return run(tmp, strategy, CompressionLogger(per_layer=True), max_epochs=3,
               log_every_n_steps=2)  # 4 batches per epoch per rank -> 12 steps; the logger follows the Trainer


def test_documented_names_match_the_code() -> None:
    documented = set(re.findall(r"^\| `(gradcomp/[^`<]*)(?:<layer>)?` \|", DOCS.read_text(), flags=re.MULTILINE))
    assert documented == set(names.METRICS) | set(names.LAYER_METRICS)


def test_metrics_share_the_loss_rows_steps_and_epochs(topk_run: dict[str, Any]) -> None:
    """Each gradcomp/* step figure sits in the row of the loss Lightning logged at that step, with its epoch; the
    epoch aggregates sit in Lightning's epoch-end rows (before, they were rows of their own at step + 1, no epoch)."""
    rows = topk_run["rows"]
    ours = [r for r in rows if r.get(names.WIRE_BYTES)]
    assert [int(r["step"]) for r in ours] == [1, 3, 5, 7, 9, 11]
    for row in ours:
        assert row["train_loss"] and row["epoch"] and row[names.COMPRESSION_STEP]
        assert bool(row[names.ERROR]) == (int(row["step"]) >= 2)  # measured from the first compressed step on
    assert [int(r["epoch"]) for r in ours] == [0, 0, 1, 1, 2, 2]
    loss_steps = [int(r["step"]) for r in rows if r.get("train_loss")]
    assert loss_steps == [int(r["step"]) for r in ours]  # no row of the loss without ours, nor the reverse
    assert all(r["epoch"] for r in rows)
    assert {int(r["step"]) for r in rows if r.get(names.EPOCH_WIRE_BYTES)} <= set(loss_steps)


def test_another_period_writes_own_rows_at_lightnings_steps(tmp_path: Path) -> None:
    strategy = GradCompStrategy(compressor=TopK(density=0.1), start_method="fork")
    result = run(tmp_path, strategy, CompressionLogger(log_every_n_steps=3, summary=False), max_steps=8,
                 log_every_n_steps=2)
    rows = result["rows"]
    assert [int(r["step"]) for r in rows if r.get(names.WIRE_BYTES)] == [2, 5, 7]  # 7: the last partial interval
    assert [int(r["step"]) for r in rows if r.get("train_loss")] == [1, 3, 5, 7]
    assert all(r["epoch"] for r in rows)
    assert [s for s, _ in series(rows, names.ERROR)] == [2, 5]  # sampled every 3 compressed steps from step 2


def test_every_documented_metric_is_logged(topk_run: dict[str, Any]) -> None:
    columns = topk_run["columns"]
    assert set(names.METRICS) - {names.INTRA_BYTES} <= columns  # node-internal bytes: two-level reductions only
    assert names.INTRA_BYTES not in columns
    ours = {c for c in columns if c.startswith("gradcomp/")}
    undocumented = {c for c in ours - set(names.METRICS) if not c.startswith(tuple(names.LAYER_METRICS))}
    assert not undocumented
    for prefix in names.LAYER_METRICS:
        assert {prefix + "body.0.weight", prefix + "body.2.weight"} <= columns
    assert names.LAYER_PARAM + "head.weight" not in columns  # dense layers have no parameter


def test_logged_values_match_comm_stats(topk_run: dict[str, Any]) -> None:
    rows, stats = topk_run["rows"], [rec["stats"] for rec in topk_run["records"]]
    wire_total = series(rows, names.WIRE_BYTES_TOTAL)
    assert [s for s, _ in wire_total] == [1, 3, 5, 7, 9, 11]  # Lightning's steps (those of the loss)
    assert wire_total[-1][1] == stats[0]["wire_bytes"]
    assert series(rows, names.DENSE_BYTES_TOTAL)[-1][1] == stats[0]["dense_bytes"]
    whole_run = stats[0]["dense_bytes"] / stats[0]["wire_bytes"]
    assert series(rows, names.COMPRESSION_WHOLE_RUN)[-1][1] == pytest.approx(whole_run)
    # after the dense warm-up (steps 0, 1) every interval has the same, compressed, traffic
    per_step = series(rows, names.WIRE_BYTES)
    assert per_step[0][1] == series(rows, names.DENSE_BYTES)[0][1]  # interval (0, 2]: the two dense steps
    assert len({v for _, v in per_step[1:]}) == 1 and per_step[1][1] < per_step[0][1] / 3
    # per-layer attribution: the top-k layer sends (W-1) * k * (4 B value + 4 B index) against a dense ring all-reduce
    for name, numel in (("body.0.weight", 2048), ("body.2.weight", 4096)):
        expected = all_reduce_bytes(4 * numel, 2) / all_gather_bytes(8 * kept_count(numel, 0.1), 2)
        assert series(rows, names.LAYER_COMPRESSION + name)[-1][1] == pytest.approx(expected)
        assert series(rows, names.LAYER_PARAM + name)[-1][1] == pytest.approx(0.1)
    assert series(rows, names.LAYER_COMPRESSION + "head.weight")[-1][1] == pytest.approx(1.0, abs=0.01)
    assert all(v > 0 for _, v in series(rows, names.MEMORY_NORM))
    assert all(v > 0 for _, v in series(rows, names.HOOK_MS))


def test_epoch_metrics_aggregate_all_ranks(topk_run: dict[str, Any]) -> None:
    rows, stats = topk_run["rows"], [rec["stats"] for rec in topk_run["records"]]
    epoch_wire = series(rows, names.EPOCH_WIRE_BYTES)
    assert [s for s, _ in epoch_wire] == [3, 7, 11]  # Lightning's epoch-end rows
    assert sum(v for _, v in epoch_wire) == pytest.approx(sum(s["wire_bytes"] for s in stats))
    epoch_dense = series(rows, names.EPOCH_DENSE_BYTES)
    assert sum(v for _, v in epoch_dense) == pytest.approx(sum(s["dense_bytes"] for s in stats))
    for (_, mean), (_, slowest) in zip(series(rows, names.EPOCH_HOOK_MS), series(rows, names.EPOCH_HOOK_MS_MAX)):
        assert 0 < mean <= slowest


def test_error_is_sampled_and_in_range(topk_run: dict[str, Any]) -> None:
    rows = topk_run["rows"]
    errors = series(rows, names.ERROR)
    # by default the error is measured at the compressed steps that are logged: a fresh value in every logged row
    assert [s for s, _ in errors] == [3, 5, 7, 9, 11]
    assert all(0.0 < v < 1.0 for _, v in errors)
    for name in ("body.0.weight", "body.2.weight"):
        assert [s for s, _ in series(rows, names.LAYER_ERROR + name)] == [3, 5, 7, 9, 11]
    layer = [v for n in ("body.0.weight", "body.2.weight") for _, v in series(rows, names.LAYER_ERROR + n)[-1:]]
    assert min(layer) <= errors[-1][1] <= max(layer)  # the total is a weighted mean of the layers' errors
    epoch_errors = [v for _, v in series(rows, names.EPOCH_ERROR)]
    assert len(epoch_errors) == 3 and all(0.0 < v < 1.0 for v in epoch_errors)


def test_progress_bar_guard_summary_and_cleanup(topk_run: dict[str, Any]) -> None:
    compression = float(topk_run["callback_metrics"][names.COMPRESSION_STEP])
    assert compression == pytest.approx(series(topk_run["rows"], names.COMPRESSION_STEP)[-1][1])
    assert compression > 3
    for catch in topk_run["catch"]:
        assert not compression_warnings(catch)
        assert catch["observers"] == 0  # the probe is detached at the end of fit


def test_summary_is_printed_on_rank_zero_only(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    strategy = GradCompStrategy(compressor=Cast(torch.float16), start_method="fork")
    result = run(tmp_path, strategy, CompressionLogger(log_every_n_steps=1, error_every_n_steps=1), max_steps=6)
    out = capfd.readouterr().out
    assert out.count("GradComp summary") == 1
    assert re.search(r"body\.2\.weight\s*│\s*4,096\s*│\s*yes", out)
    # Cast reports no local contribution: the error cannot be measured and is skipped, not faked
    assert names.ERROR not in result["columns"]
    assert series(result["rows"], names.COMPRESSION_STEP)[-1][1] > 1.5
    assert not compression_warnings(result["catch"][0])


def test_guard_fires_once_when_every_layer_is_below_min_numel(tmp_path: Path) -> None:
    strategy = GradCompStrategy(compressor=TopK(density=0.1), min_numel=10**9, start_method="fork")
    result = run(tmp_path, strategy, CompressionLogger(log_every_n_steps=1), max_steps=8)
    fired = compression_warnings(result["catch"][0])
    assert len(fired) == 1
    assert "NOTHING IS BEING COMPRESSED" in fired[0] and "min_numel=1000000000" in fired[0]
    assert "body.2.weight" in fired[0] and "4096" in fired[0]
    assert not compression_warnings(result["catch"][1])  # rank 0 only
    assert series(result["rows"], names.COMPRESSION_WHOLE_RUN)[-1][1] == pytest.approx(1.0)


def test_guard_fires_without_gradcomp_strategy(tmp_path: Path) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[CompressionLogger()], default_root_dir=str(tmp_path))
    with pytest.warns(CompressionWarning, match="not GradCompStrategy"):
        trainer.fit(TinyNet())


# ---------------------------------------------------------------------- units
def _record(step: int, inputs: list[torch.Tensor], residuals: Optional[list[torch.Tensor]],
            first: int = 0) -> BucketRecord:
    slots = tuple(LayerSlot(f"l{first + i}", 0, tuple(t.shape), True) for i, t in enumerate(inputs))
    return BucketRecord(step, 0, slots, inputs, residuals)


def test_error_probe_measures_relative_error() -> None:
    probe = names.ErrorProbe(every=3, start_step=2)
    assert [s for s in range(12) if probe.wants(s)] == [2, 5, 8, 11]
    p = [torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0, 12.0])]
    r = [torch.tensor([0.0, 4.0]), torch.tensor([0.0, 0.0, 0.0])]
    probe(_record(2, p[:1], r[:1]))
    probe(_record(2, p[1:], r[1:], first=1))  # second bucket of the same step
    (measured,) = probe.drain()
    assert measured.step == 2
    assert measured.error == pytest.approx(math.sqrt(16 / (25 + 144)))
    assert measured.layers == {"l0": (16.0, 25.0), "l1": (0.0, 144.0)}
    assert not probe.pending and not probe.unsupported
    probe(_record(5, [torch.tensor([1.0, 1.0])], [torch.tensor([1.0, 0.0])]))
    probe.drain()
    assert probe.layer_errors()["l0"] == pytest.approx(math.sqrt(17 / 27))
    assert probe.total_error() == pytest.approx(math.sqrt(17 / 171))


def test_error_probe_counts_the_last_backward_pass_of_a_step() -> None:
    """Several synced backward passes before one optimizer step (manual accumulation) each hand over their bucket:
    the step's error is its last pass's, per layer, in whichever bucket the layer is."""
    probe = names.ErrorProbe(every=1)
    probe(_record(4, [torch.tensor([3.0, 4.0]), torch.tensor([1.0])], [torch.tensor([3.0, 0.0]), torch.tensor([0.0])]))
    probe(_record(4, [torch.tensor([6.0, 8.0])], [torch.tensor([0.0, 8.0])]))  # pass 2, layer l0's bucket only
    probe(_record(4, [torch.tensor([2.0])], [torch.tensor([1.0])], first=1))  # pass 2, layer l1's bucket
    (measured,) = probe.drain()
    assert measured.layers == {"l0": (64.0, 100.0), "l1": (1.0, 4.0)}
    assert measured.error == pytest.approx(math.sqrt(65 / 104))
    assert probe.layer_errors() == pytest.approx({"l0": 0.8, "l1": 0.5})


def test_error_probe_skips_unknown_residuals() -> None:
    probe = names.ErrorProbe(every=1)
    probe(_record(0, [torch.ones(3)], None))
    assert probe.unsupported and not probe.pending and probe.drain() == []
    assert math.isnan(probe.total_error())
    assert names.ErrorProbe(every=0).wants(0) is False


@pytest.mark.parametrize("kwargs, error", [
    ({"log_every_n_steps": 0}, ValueError), ({"log_every_n_steps": 2.5}, TypeError),
    ({"error_every_n_steps": -1}, ValueError), ({"per_layer": 1}, TypeError), ({"guard": None}, TypeError),
])
def test_bad_arguments(kwargs: dict[str, Any], error: type) -> None:
    with pytest.raises(error, match=next(iter(kwargs))):
        CompressionLogger(**kwargs)
