"""Determinism: replicas stay bit-identical and a seeded run repeats bit for bit, for every compressor.

A ``Future`` callback runs inline or on one of gloo's threads, differently on each rank and in each run, and a
gloo thread calls MKL with all cores until it first runs a parallel ATen op, so anything a callback computes
must not depend on the thread (:func:`lightning_gradcomp.comm.then_same_numerics`). The models have a 10-row
matrix: MKL computes PowerSGD's decode ``p @ q.T`` for a ``10 x r`` factor (r >= 2) and ``m >= 128``
differently with 1 and 2 threads, so the drift shows (torch 2.13 CPU, MKL 2024.2).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from helpers.distributed import run_workers
from helpers.models import TinyNet, assert_replicas_identical, fit
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import Comm, then_same_numerics
from lightning_gradcomp.compressors import PowerSGD, registry
from lightning_gradcomp.hook import gradcomp_comm_hook

RUNS = 10
STEPS = 8


@pytest.mark.parametrize(("n", "m", "r"), [(10, 512, 2), (10, 256, 4), (6, 128, 2), (512, 512, 2)])
def test_callback_on_another_thread_computes_the_callers_bits(n: int, m: int, r: int) -> None:
    gen = torch.Generator().manual_seed(0)
    p, q = torch.randn(n, r, generator=gen), torch.randn(m, r, generator=gen)
    fut: Future = Future()
    chained = then_same_numerics(fut, lambda _: (threading.get_ident(), p @ q.T))
    completer = threading.Thread(target=fut.set_result, args=(None,))  # a fresh thread runs the callback
    completer.start()
    completer.join()
    ident, product = chained.wait()
    assert ident == completer.ident
    assert torch.equal(product, p @ q.T)


# ------------------------------------------------------------------ raw DDP: every compressor, 10 runs
def _train(rank: int, name: str) -> list[torch.Tensor]:
    """``STEPS`` seeded SGD steps of a 64-256-10 MLP under DDP with ``name``; flat parameters after each."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 10))
    ddp = DistributedDataParallel(model)
    names = {id(p): n for n, p in model.named_parameters()}
    hook = GradCompStrategy(compressor=registry.create(name)).make_hook(Comm(), names)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)
    params = []
    for _ in range(STEPS):
        x, y = torch.randn(16, 64, generator=data), torch.randn(16, 10, generator=data)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return params


def _repeat_all(rank: int, world_size: int) -> dict[str, list[list[torch.Tensor]]]:
    return {name: [_train(rank, name) for _ in range(RUNS)] for name in registry.list()}


def test_every_compressor_repeats_bit_for_bit_and_replicas_agree() -> None:
    ranks = run_workers(_repeat_all, 2, timeout=300)  # ~9 s idle; 120 s was once too short on a loaded machine
    failures = []
    for name in registry.list():
        runs = [rank[name] for rank in ranks]
        for run in range(RUNS):
            steps = [s for s in range(STEPS) if not torch.equal(runs[0][run][s], runs[1][run][s])]
            if steps:
                failures.append(f"{name}: run {run}: ranks differ from step {steps[0]}")
            if not all(torch.equal(a, b) for a, b in zip(runs[0][run], runs[0][0])):
                failures.append(f"{name}: run {run} differs from run 0")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ Lightning: PowerSGD
class TenOutputNet(TinyNet):
    """TinyNet with a 10-output head: a ``10 x hidden`` matrix that PowerSGD compresses."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(2)
        self.head = nn.Linear(self.hparams.hidden, 10)
        self.y = torch.randn(self.hparams.samples, 10, generator=torch.Generator().manual_seed(3))


def test_powersgd_fit_repeats_and_replicas_agree(tmp_path: Path) -> None:
    def run(out: Path) -> list[dict[str, Any]]:
        model = TenOutputNet(hidden=256, in_features=128, lr=0.01)
        return fit(GradCompStrategy(compressor=PowerSGD(rank=2), start_method="fork"), out, model=model,
                   max_epochs=4)

    first, second = run(tmp_path / "first"), run(tmp_path / "second")
    assert_replicas_identical(first)
    assert_replicas_identical(second)
    assert all(torch.equal(a, b) for a, b in zip(first[0]["params"], second[0]["params"], strict=True))
