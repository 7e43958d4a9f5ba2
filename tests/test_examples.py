"""The README quick start (real popen launcher) and the documented custom compressor."""

from __future__ import annotations

import contextlib
import io
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.distributed import run_workers
from helpers.models import assert_replicas_identical, fit
from helpers.reduce import rank_inputs, reduce_worker
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import LGreCo
from lightning_gradcomp.comm import all_gather_bytes
from lightning_gradcomp.functional.packing import packed_nbytes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from custom_compressor import AbsmaxInt  # noqa: E402 - also declares the preset "absmax_int4"
import quickstart  # noqa: E402

from lightning_gradcomp.cli import main as cli_main  # noqa: E402
from lightning_gradcomp.compressors import registry  # noqa: E402
from lightning_gradcomp.presets import PRESETS  # noqa: E402


def test_docs_show_the_complete_example_verbatim_in_at_most_25_lines() -> None:
    source = (ROOT / "examples" / "custom_compressor.py").read_text()
    page = (ROOT / "docs" / "custom-compressor.md").read_text()
    assert source.strip() in page
    assert len([line for line in source.splitlines() if line.strip()]) <= 25  # lines of code, blank lines aside


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_example_reduces_within_half_a_step_and_counts_its_bytes(world_size: int) -> None:
    shapes, bits = [(30, 40), (7,), (1,), (13, 11), (10, 10)], [4, 2, 3, 5, 8]  # tiny, odd, prime sizes
    results = run_workers(reduce_worker, world_size, AbsmaxInt(), shapes, bits)
    inputs = [rank_inputs(r, shapes) for r in range(world_size)]
    for layer, b in enumerate(bits):
        mean = sum(x[layer] for x in inputs) / world_size
        bound = max(float(x[layer].abs().max()) for x in inputs) / (2 ** (b - 1) - 1) / 2 * (1 + 1e-5)
        got = results[0]["steps"][0]["averaged"][layer]
        assert float((got - mean).abs().max()) <= bound
        for other in results[1:]:
            assert torch.equal(got, other["steps"][0]["averaged"][layer])
    payload = sum(packed_nbytes(math.prod(s), b) + 4 * -(-math.prod(s) // 128) for s, b in zip(shapes, bits))
    assert results[0]["stats"]["wire_bytes"] == pytest.approx(all_gather_bytes(payload, world_size))


def test_example_layer_costs_are_its_bytes_and_its_error() -> None:
    comp = AbsmaxInt()
    assert comp.tunable and comp.layer_candidates((4, 4), [1, 2, 3, 9]) == [2, 3, 4]
    exact = torch.tensor([-7.0, 0.0, 3.0, 7.0])  # on the 4-bit grid: no error at 4 bits
    sizes, errors = comp.layer_costs(exact, (4,), [2, 4])
    assert sizes == [1.0 + 4, 2.0 + 4] and errors[1] == 0.0 and errors[0] > 0
    with pytest.raises(ValueError, match="bits"):
        AbsmaxInt(bits=9)


def test_example_preset_name_trains_with_identical_replicas(tmp_path: Path) -> None:
    records = fit("absmax_int4_fork", tmp_path, max_epochs=2)
    assert_replicas_identical(records)
    assert records[0]["stats"]["wire_bytes"] < records[0]["stats"]["dense_bytes"] / 2  # TinyNet: small layers dense


def test_lgreco_tunes_the_example_per_layer(tmp_path: Path) -> None:
    strategy = GradCompStrategy(compressor=AbsmaxInt(bits=4), start_method="fork")
    lgreco = LGreCo(period=3, warmup_steps=4, accumulate_steps=2, alpha=1.3)  # error budget: 1.3x uniform 4 bits
    records = fit(strategy, tmp_path, max_epochs=3, callbacks=[lgreco])
    assert_replicas_identical(records)
    chosen = [{name: layer["param"] for name, layer in rec["stats"]["layers"].items() if layer["param"] is not None}
              for rec in records]  # the compressed layers' bit widths at the end
    assert chosen[0] and chosen[0] == chosen[1] and all(2 <= b <= 8 for b in chosen[0].values())
    assert set(chosen[0].values()) != {4}  # L-GreCo moved at least one layer off the uniform 4 bits


@pytest.mark.slow
@pytest.mark.parametrize("name", ["topk", "scalecom"])  # a compressor name and a strategy name (the README's)
def test_quickstart_script_runs_two_processes_with_the_popen_launcher(tmp_path: Path, name: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), name], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"rank (\d): ([\d,]+) B/step sent vs dense ([\d,]+)", proc.stdout)
    assert sorted(rank for rank, _, _ in lines) == ["0", "1"]
    for _, sent, dense in lines:
        assert int(sent.replace(",", "")) * 3 < int(dense.replace(",", ""))
    assert not list(tmp_path.iterdir()), "the quickstart left files in the current folder"


def _listed_names() -> list[str]:
    """Every name ``lightning-gradcomp list`` prints (strategy names, then compressor names)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["list"]) == 0
    return [line.split()[0] for line in out.getvalue().splitlines() if line.startswith("  ")]


def test_the_names_below_are_what_list_prints() -> None:
    assert sorted(_listed_names()) == sorted([*PRESETS, *registry.names()])


@pytest.mark.parametrize("name", sorted({*PRESETS, *registry.names()}))
def test_quickstart_trains_with_every_listed_name(name: str, capfd: pytest.CaptureFixture[str],
                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    trainer = quickstart.main(name, devices=2, max_epochs=1, start_method="fork")
    assert trainer.state.finished
    printed = re.findall(r"rank (\d): ([\d,]+) B/step sent vs dense ([\d,]+)", capfd.readouterr().out)
    assert sorted(rank for rank, _, _ in printed) == ["0", "1"]
    assert not list(tmp_path.iterdir())
