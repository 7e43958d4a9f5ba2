"""The bench builds every preset exactly as the strategy does, and runs its layerwise callback (L-GreCo)."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from helpers.distributed import run_workers
from lightning.pytorch.callbacks import Callback

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.bench.configs import (
    BASELINES,
    LayerwiseDriver,
    available_configs,
    install,
    is_config,
    split_config,
)
from lightning_gradcomp.bench.models import load_workload
from lightning_gradcomp.bench.worker import _measure
from lightning_gradcomp.callbacks import LGreCo
from lightning_gradcomp.compressors import PowerSGD, TopK
from lightning_gradcomp.presets import PRESETS

# Test-only presets: every GradCompStrategy option away from its default, and a quick L-GreCo schedule.
OPTIONS = ("bench_test_options", lambda: {"compressor": TopK(ratio=0.05), "start_step": 5, "min_numel": 16,
                                          "compress_1d": True, "beta": 0.5, "seed": 7, "nonfinite": "zero"})
QUICK_LGRECO = ("bench_test_lgreco", lambda: {"compressor": PowerSGD(rank=4), "layerwise": LGreCo(
    warmup_steps=6, period=4, accumulate_steps=3, min_factor=0.25, max_factor=2.0)})


@pytest.fixture
def test_presets(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    for name, factory in (OPTIONS, QUICK_LGRECO):
        monkeypatch.setitem(PRESETS, name, ("test only", factory))
    return [OPTIONS[0], QUICK_LGRECO[0]]


def _public(obj: Any) -> dict[str, str]:
    """An object's public attributes, as ``repr`` strings (comparable across processes)."""
    return {k: repr(v) for k, v in vars(obj).items() if not k.startswith("_")}


def _describe(compressor: Any, start_step: int, policy: Any, seed: int, beta: float, nonfinite: str,
              layerwise: Optional[Callback]) -> dict[str, Any]:
    return {"compressor": (type(compressor).__name__, repr(compressor), _public(compressor)),
            "start_step": start_step, "policy": policy, "seed": seed, "beta": beta, "nonfinite": nonfinite,
            "layerwise": None if layerwise is None else (type(layerwise).__name__, _public(layerwise))}


def _bench_hooks(rank: int, world: int, names: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in names:
        installed = install(name, load_workload("mlp-small"))
        hook = installed.hook
        callback = installed.layerwise.callback if installed.layerwise is not None else None
        out[name] = _describe(hook.compressor, hook.start_step, hook.policy, hook.seed, hook.memory.beta,
                              hook.nonfinite, callback)
    return out


def test_every_benchmarked_preset_builds_the_strategys_hook(test_presets: list[str]) -> None:
    presets = [name for name in available_configs() if name not in BASELINES]
    assert set(test_presets) <= set(presets) and "lgreco" in presets
    built = run_workers(_bench_hooks, 1, presets, timeout=120.0)[0]
    drift = {}
    for name in presets:
        s = GradCompStrategy(**PRESETS[name][1]())
        expected = _describe(s.compressor, s.start_step, s.policy, s.seed, s.beta, s.nonfinite, s.layerwise)
        wrong = {key: (built[name][key], value) for key, value in expected.items() if built[name][key] != value}
        if wrong:
            drift[name] = wrong
    assert not drift, f"bench hook differs from the strategy's (bench, strategy): {drift}"


def _lgreco_in_bench(rank: int, world: int, name: str) -> dict[str, Any]:
    spec = {"model": "mlp-small", "batch_size": 16, "bucket_cap_mb": 25.0, "warmup": 3, "steps": 8}
    return _measure(name, spec, None)


@pytest.mark.slow
def test_bench_runs_lgreco_and_it_replans(test_presets: list[str]) -> None:
    ranks = run_workers(_lgreco_in_bench, 2, QUICK_LGRECO[0], timeout=180.0)
    chosen = ranks[0]["layer_params"]
    # 11 steps, re-plans after steps 6 and 10: every compressed layer has a per-layer rank, the same on all ranks
    assert chosen == ranks[1]["layer_params"]
    assert set(chosen) == {"model.0.weight", "model.2.weight", "model.4.weight"}
    assert set(chosen.values()) != {4}, chosen  # re-allocated at the uniform setting's error (2, 1, 7 here)
    assert ranks[0]["wire_bytes_per_step"] > 0


def test_driver_refuses_callbacks_that_need_other_lightning_hooks() -> None:
    class Clipper(Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            torch.nn.utils.clip_grad_norm_(pl_module.parameters(), 1.0)

    with pytest.raises(NotImplementedError, match="on_before_optimizer_step: benchmark it with a Lightning Trainer"):
        LayerwiseDriver(Clipper(), GradCompStrategy())


def _torch_hook_timing(rank: int, world: int, name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = load_workload("mlp-small")
    installed = install(name, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(4):  # powerSGD_hook compresses from its step 2 on
        installed.ddp().backward()
        opt.step()
        opt.zero_grad()
        installed.end_step()
    return {"hook": installed.hook_seconds(), "work": installed.thread_seconds(), "wait": installed.wait_seconds(),
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


@pytest.mark.parametrize("name", ["torch_fp16", "torch_powersgd"])
def test_pytorch_hooks_work_includes_their_future_callbacks(name: str) -> None:
    ranks = run_workers(_torch_hook_timing, 2, name, timeout=120.0)
    for r in ranks:
        assert r["work"] > r["hook"] > 0  # the callbacks (copy back; Q step, decompression) are timed too
        assert 0 <= r["wait"] < r["work"]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])  # the timing wrappers leave DDP's result alone


def _bucket_caps(rank: int, world: int, cap: Optional[float]) -> dict[str, float]:
    return {
        name: install(name, load_workload("mlp-small"), cap).ddp.bucket_bytes_cap / 2**20
        for name in ("ddp", "torch_fp16", "gradcomp_topk", "qsgd", "diana", "signsgd")
    }


def test_each_configuration_gets_its_own_bucket_size_unless_the_bench_sets_one() -> None:
    """As in a fit: DDP's 25 MB for DDP and PyTorch's hooks and for compressors without a preference, the
    quantizers' 4 MB (``Compressor.bucket_cap_mb``); ``--bucket-cap-mb`` applies to every configuration."""
    default, forced = run_workers(
        lambda rank, world: (_bucket_caps(rank, world, None), _bucket_caps(rank, world, 10.0)), 1, timeout=120.0
    )[0]
    assert default == {"ddp": 25.0, "torch_fp16": 25.0, "gradcomp_topk": 25.0, "qsgd": 4.0, "diana": 4.0, "signsgd": 4.0}
    assert set(forced.values()) == {10.0}


def test_a_preset_with_compressor_arguments_builds_that_compressor() -> None:
    assert split_config("signsgd@aggregation=alltoall@bucket_size=256") == (
        "signsgd", {"aggregation": "alltoall", "bucket_size": 256})
    assert split_config("qsgd") == ("qsgd", {})
    assert is_config("qsgd@aggregation=alltoall") and is_config("qsgd") and is_config("ddp")
    assert not is_config("ddp@bucket=1") and not is_config("nope@aggregation=alltoall")
    with pytest.raises(ValueError, match="overrides look like `@key=value`"):
        split_config("qsgd@alltoall")
    built = run_workers(_bench_hooks, 1, ["qsgd@aggregation=alltoall", "qsgd"], timeout=120.0)[0]
    assert built["qsgd@aggregation=alltoall"]["compressor"][2]["aggregation"] == repr("alltoall")
    assert built["qsgd"]["compressor"][2]["aggregation"] == repr("auto")
    assert built["qsgd@aggregation=alltoall"]["compressor"][2]["bits"] == built["qsgd"]["compressor"][2]["bits"]
