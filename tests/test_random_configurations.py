"""Random configurations of the hook: classes of inputs no targeted sweep combines.

Each seed draws layer shapes (a matrix of at least 272 entries, then 1-D to 4-D layers of 1 to 4099 entries), a
compressor with random arguments (consecutive seeds take every compressor in turn), the parameter dtype, DDP's
bucket cap and bucket views, the slot policy, the non-finite policy, a layer unused on every rank in some steps, and
a pattern of backward passes per optimizer step (synced, ``no_sync``, a ``zero_grad`` between them), at W = 2..5;
some seeds run the hierarchical hook at W = 4 in nodes of 2. Checked: replicas bit-identical and finite after every
step; at ``lr = 0`` with an exact error-feedback compressor, error feedback's ledger (what the optimizer was handed
plus the ranks' mean memory equals the sum of the kept passes' mean gradients). The seeds are fixed, so a failure
repeats.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
from torch import nn

from helpers.distributed import run_workers
from helpers.engine import hook_under_ddp
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.compressors import (CLTK, DIANA, QSGD, Cast, Compressor, NoCompression, PowerSGD, RandomK,
                                            SignSGD, TernGrad, TopK)

STEPS = 5
DTYPES = [torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _shape(r: random.Random) -> tuple[int, ...]:
    kind = r.random()
    if kind < 0.2:
        return (r.choice([1, 2, 3, 5, 7, 13, 31, 127, 1000, 4099]),)
    if kind < 0.85:
        return (r.choice([1, 2, 3, 7, 17, 64, 129]), r.choice([1, 3, 5, 16, 33, 257]))
    return (r.choice([1, 2, 5]), r.choice([1, 3]), r.choice([1, 3, 7]), r.choice([1, 2, 3]))


def _compressor(r: random.Random, exact_feedback: bool, index: int) -> tuple[type, dict[str, Any]]:
    """Compressor ``index`` (cyclically) with random arguments; with ``exact_feedback`` among those whose memory holds
    exactly what they did not send (the ledger holds to rounding)."""
    ratio = r.choice([0.001, 0.01, 0.1, 0.37, 1.0])
    value = r.choice(["fp32", "fp16", "bf16"])
    aggregation = r.choice(["auto", "alltoall", "allgather"])
    group = r.choice([1, 7, 64, 512])
    choices: list[tuple[type, dict[str, Any]]] = [
        (CLTK, {"ratio": ratio, "selection": r.choice(["exact", "approx"]),
                "index_coding": r.choice(["int32", "delta16"]), "spread_leaders": r.random() < 0.5}),
        (TopK, {"ratio": ratio, "index_coding": r.choice(["int32", "delta16"])}),
        (RandomK, {"ratio": ratio}),
        (PowerSGD, {"rank": r.choice([1, 2, 4]), "warm_start": r.random() < 0.7}),
    ]
    if not exact_feedback:
        choices[0][1]["value_dtype"] = choices[1][1]["value_dtype"] = value
        choices += [
            (QSGD, {"bits": r.choice([2, 3, 4, 8]), "bucket_size": group, "p": r.choice(["inf", 2]),
                    "aggregation": aggregation}),
            (SignSGD, {"bucket_size": group, "aggregation": aggregation}),
            (TernGrad, {"bucket_size": group, "aggregation": aggregation}),
            (DIANA, {"quantizer": r.choice(["linf", "l2:64", "linf:7"]), "aggregation": aggregation}),
            (Cast, {"dtype": r.choice(["fp16", "bf16"])}),
            (NoCompression, {}),
        ]
    return choices[index % len(choices)]


@dataclass(frozen=True)
class Config:
    """One random configuration (drawn from its seed by :func:`draw`)."""

    shapes: tuple[tuple[int, ...], ...]
    compressor: type
    arguments: tuple[tuple[str, Any], ...]
    dtype: torch.dtype
    views: bool
    bucket_mb: Optional[float]
    policy: tuple[tuple[str, Any], ...]
    unused: bool
    pattern: str
    world: int
    node_size: int = 0  # the hierarchical hook with nodes of this many ranks (0: flat)

    def make(self) -> Compressor:
        return self.compressor(**dict(self.arguments))


def draw(seed: int, exact_feedback: bool = False, hierarchical: bool = False) -> Config:
    """The configuration of ``seed`` (fp32 with an exact error-feedback compressor when ``exact_feedback``; the
    hierarchical hook at W = 4 in nodes of 2 when ``hierarchical``)."""
    r = random.Random(seed)
    # the first layer is a matrix of at least 272 entries: every configuration compresses something
    shapes = ((r.choice([17, 64, 129]), r.choice([16, 33, 257])), *(_shape(r) for _ in range(r.randint(0, 5))))
    compressor, arguments = _compressor(r, exact_feedback, seed)  # consecutive seeds: every compressor in turn
    policy = {"min_numel": r.choice([1, 16, 256]), "compress_1d": r.random() < 0.5}
    if not exact_feedback:
        policy["nonfinite"] = r.choice(["dense", "zero"])
    return Config(shapes, compressor, tuple(arguments.items()),
                  torch.float32 if exact_feedback else r.choice(DTYPES), r.random() < 0.6,
                  r.choice([None, 0.0005, 0.002, 0.05]), tuple(policy.items()),
                  r.random() < 0.3 and len(shapes) > 1, r.choice(["b", "bb", "bnb", "nb", "bzb", "bbzb"]),
                  4 if hierarchical else r.randint(2, 5), 2 if hierarchical else 0)


class _Net(nn.Module):
    """One parameter per shape; each feeds the output through a different input column. With ``skip`` the last
    parameter is left out of the graph (unused on every rank)."""

    def __init__(self, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weights = nn.ParameterList(
            [nn.Parameter((torch.randn(s) / math.sqrt(math.prod(s))).to(dtype)) for s in shapes])

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        out = torch.zeros(x.shape[0], dtype=torch.float32)
        for i, w in enumerate(self.weights):
            if skip and i == len(self.weights) - 1:
                continue
            flat = w.float().reshape(-1)
            out = out + (flat[:x.shape[1]].sum() * x[:, i % x.shape[1]].float()).tanh() + flat.square().sum() * 1e-3
        return out


def _inputs(rank: int, step: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 10_000 + step * 100 + k)).to(dtype)


def _train(rank: int, world: int, config: Config, lr: float) -> dict[str, Any]:
    """``STEPS`` optimizer steps of ``config.pattern`` each, compressed from the third."""
    model = _Net(config.shapes, config.dtype)
    strategy = GradCompStrategy(compressor=config.make(), start_step=2, gradient_as_bucket_view=config.views,
                                **dict(config.policy))
    ddp, hook, optimizer = hook_under_ddp(
        model, strategy, lr=lr, node_size=config.node_size, gradient_as_bucket_view=config.views,
        find_unused_parameters=config.unused, **({} if config.bucket_mb is None else {"bucket_cap_mb": config.bucket_mb}))
    snapshots, applied = [], [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for step in range(STEPS):
        # the ledger runs always clear: a parameter unused on every rank keeps a stale .grad under
        # set_to_none=False, the case the strategy warns about without bucket views
        optimizer.zero_grad(set_to_none=lr == 0.0 or step % 2 == 0)
        skip = config.unused and step % 2 == 1
        for k, action in enumerate(config.pattern):
            if action == "z":
                optimizer.zero_grad()
                continue
            loss = ddp(_inputs(rank, step, k, config.dtype), skip).square().mean()
            if action == "n":
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        for total, p in zip(applied, model.parameters()):
            if p.grad is not None:
                total += p.grad.double()
        optimizer.step()
        snapshots.append(torch.cat([p.detach().double().reshape(-1) for p in model.parameters()]))
    memory = hook.memory.state_dict()
    hook.close()
    return {"snapshots": snapshots, "applied": applied,
            "memory": [memory[n].double().reshape(p.shape) if n in memory else torch.zeros_like(p, dtype=torch.float64)
                       for n, p in model.named_parameters()]}


def _kept_mean_gradients(config: Config) -> list[torch.Tensor]:
    """The sum over the steps of the ranks' mean gradients of the passes no ``zero_grad`` threw away (float64)."""
    model = _Net(config.shapes, config.dtype)
    totals = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for step in range(STEPS):
        skip = config.unused and step % 2 == 1
        for rank in range(config.world):
            kept: list[list[torch.Tensor]] = []
            for k, action in enumerate(config.pattern):
                if action == "z":
                    kept = []
                    continue
                model.zero_grad()
                model(_inputs(rank, step, k, config.dtype), skip).square().mean().backward()
                kept.append([torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double()
                             for p in model.parameters()])
            for grads in kept:
                for total, g in zip(totals, grads):
                    total += g / config.world
    return totals


@pytest.mark.parametrize(("seed", "hierarchical"), [*((s, False) for s in range(20)), *((s, True) for s in range(4))])
def test_random_configurations_keep_replicas_identical(seed: int, hierarchical: bool) -> None:
    config = draw(seed, hierarchical=hierarchical)
    results = run_workers(_train, config.world, config, 0.05)
    for step, reference in enumerate(results[0]["snapshots"]):
        assert torch.isfinite(reference).all(), (config, step)
        assert all(torch.equal(reference, r["snapshots"][step]) for r in results[1:]), (config, step)


@pytest.mark.parametrize("seed", range(100, 108))
def test_random_configurations_keep_the_error_feedback_ledger(seed: int) -> None:
    config = draw(seed, exact_feedback=True)
    results = run_workers(_train, config.world, config, 0.0)
    for i, target in enumerate(_kept_mean_gradients(config)):
        ledger = results[0]["applied"][i] + sum(r["memory"][i] for r in results) / config.world
        torch.testing.assert_close(ledger, target, rtol=1e-5, atol=1e-6, msg=lambda m: f"{config}: {m}")
    assert all(torch.equal(a, b) for r in results for a, b in zip(results[0]["applied"], r["applied"])), config
