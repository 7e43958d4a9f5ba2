"""One process (``devices=1``): no strategy compresses unless asked (``single_process="compress"``).

Debugging on one device first is what Lightning users do; there is no gradient communication to save there, so the
fit must be DDP's, bit for bit (issue 52, item 1). The GPU check (``tests/cuda/fit_one.py``) opts in to exercise the
compression path at W = 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from helpers.models import fit
from lightning_gradcomp import GradCompFSDPStrategy, GradCompStrategy, LocalSGDStrategy, SwarmStrategy
from lightning_gradcomp.compressors import CLTK, TopK


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    assert len(a[0]["params"]) == len(b[0]["params"]) > 0
    return all(torch.equal(x, y) for x, y in zip(a[0]["params"], b[0]["params"], strict=True))


@pytest.fixture
def ddp_one(tmp_path: Path) -> list[dict[str, Any]]:
    return fit(DDPStrategy(start_method="fork"), tmp_path / "ddp", devices=1, max_epochs=2)


def test_a_preset_on_one_device_trains_as_ddp_bit_for_bit(tmp_path: Path, ddp_one: list[dict[str, Any]]) -> None:
    ours = fit("gradcomp_topk_fork", tmp_path / "ours", devices=1, max_epochs=2)
    assert _same(ours, ddp_one)
    assert ours[0]["losses"] == ddp_one[0]["losses"]
    stats = ours[0]["stats"]
    assert stats["steps"] == len(ours[0]["params"]) and stats["compressed_steps"] == 0


def test_one_device_compresses_when_asked(tmp_path: Path, ddp_one: list[dict[str, Any]]) -> None:
    ours = fit(GradCompStrategy(compressor=TopK(0.01), start_method="fork", single_process="compress"),
               tmp_path / "ours", devices=1, max_epochs=2)
    assert ours[0]["stats"]["compressed_steps"] == ours[0]["stats"]["steps"] - 2 > 0
    assert not _same(ours, ddp_one)


@pytest.mark.parametrize("make", [GradCompStrategy, LocalSGDStrategy])
@pytest.mark.parametrize("value", ["Dense", "off", None, 1])
def test_single_process_is_checked_at_construction(make: Any, value: Any) -> None:
    with pytest.raises(ValueError, match=r"`single_process` must be one of \('dense', 'compress'\)"):
        make(single_process=value)


def test_localsgd_on_one_device_reduces_pseudo_gradients_without_the_compressor(tmp_path: Path) -> None:
    def run(name: str, **kwargs: Any) -> list[dict[str, Any]]:
        strategy = LocalSGDStrategy(local_steps=2, outer="nesterov", start_method="fork", **kwargs)
        return fit(strategy, tmp_path / name, devices=1, max_epochs=2)

    plain = run("plain")
    assert _same(run("cltk", compressor=CLTK(0.01)), plain)
    assert not _same(run("compress", compressor=CLTK(0.01), single_process="compress"), plain)


def test_swarm_on_one_device_has_no_partner_and_trains_as_ddp(tmp_path: Path,
                                                                ddp_one: list[dict[str, Any]]) -> None:
    swarm = fit(SwarmStrategy(local_steps=1, bits=8, start_method="fork"), tmp_path / "swarm", devices=1,
                max_epochs=2)
    assert _same(swarm, ddp_one)


def test_the_gpu_check_builds_every_preset_to_compress_on_its_one_gpu() -> None:
    """``tests/cuda/fit_one.py`` fits each preset on one GPU to exercise the compression path: it opts in."""
    import sys

    sys.path.insert(0, str(Path(__file__).with_name("cuda")))
    try:
        import fit_one
    finally:
        sys.path.pop(0)
    from lightning_gradcomp.presets import PRESETS, preset_class

    for name in PRESETS:
        if issubclass(preset_class(name), GradCompFSDPStrategy):  # one process is one replica: not in the GPU check
            continue
        strategy = fit_one.build(name)
        assert getattr(strategy, "single_process", "compress") == "compress", name
        assert isinstance(strategy, (GradCompStrategy, LocalSGDStrategy, SwarmStrategy)), name
