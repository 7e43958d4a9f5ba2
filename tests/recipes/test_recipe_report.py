"""The summary callback's arithmetic and the optimizer/schedule helper."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp import RateCorrectedAdamW
from recipes.report import RecipeReport, format_bytes, summarize_comm
from recipes.tasks.optim import build_optimization


def test_summarize_comm_and_format_bytes():
    s = summarize_comm(wire_bytes=25.0, dense_bytes=100.0)
    assert s["saved_fraction"] == pytest.approx(0.75) and s["compression_ratio"] == pytest.approx(4.0)
    assert summarize_comm(0.0, 0.0)["saved_fraction"] == 0.0
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.5 KiB" and format_bytes(3 * 2**30) == "3.0 GiB"


def test_render_mentions_metrics_and_savings():
    text = RecipeReport.render({"model": "M", "strategy": "S", "compressor": "C", "world_size": 2, "steps": 7,
                                "fit_seconds": 1.0, "metrics": {"val/acc1": 0.5},
                                "comm": summarize_comm(10.0, 40.0)})
    assert "val/acc1 = 0.5000" in text and "saved 75.0% (4.0x)" in text


@pytest.mark.parametrize("schedule", ["onecycle", "cosine", "constant"])
def test_schedules_warm_up_then_decay(schedule: str):
    p = torch.nn.Parameter(torch.zeros(2))
    conf = build_optimization([p], optimizer="sgd", lr=0.1, weight_decay=0.0, momentum=0.9, schedule=schedule,
                              warmup=0.2, total_steps=100)
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    peak = max(lrs)
    assert peak == pytest.approx(0.1, rel=0.02)
    assert lrs[0] < 0.5 * peak and lrs.index(peak) in range(15, 25)
    if schedule != "constant":
        assert lrs[-1] < 0.05 * peak


def test_build_optimization_rejects_bad_arguments():
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError, match="optimizer"):
        build_optimization(p, optimizer="lamb", lr=0.1, weight_decay=0, momentum=0.9, schedule="cosine",  # type: ignore[arg-type]
                           warmup=0, total_steps=10)
    with pytest.raises(ValueError, match="lr"):
        build_optimization(p, optimizer="adamw", lr=0.0, weight_decay=0, momentum=0.9, schedule="cosine",
                           warmup=0, total_steps=10)
    with pytest.raises(ValueError, match="beta2"):
        build_optimization(p, optimizer="adamw", lr=0.1, weight_decay=0, momentum=0.9, schedule="cosine",
                           warmup=0, total_steps=10, beta2=1.0)


@pytest.mark.parametrize("name, cls", [("adamw", torch.optim.AdamW), ("rate_adamw", RateCorrectedAdamW)])
@pytest.mark.parametrize("beta2", [0.98, 0.999])
def test_build_optimization_passes_beta2(name: str, cls: type, beta2: float):
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = build_optimization(p, optimizer=name, lr=0.1, weight_decay=0.01, momentum=0.8, schedule="cosine",  # type: ignore[arg-type]
                             warmup=0, total_steps=10, beta2=beta2)["optimizer"]
    assert isinstance(opt, cls) and opt.param_groups[0]["betas"] == (0.8, beta2)
