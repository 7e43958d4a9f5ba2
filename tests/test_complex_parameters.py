"""Complex parameters: DDP reduces a complex gradient as its real view (``2 n`` real numbers, real and imaginary parts
interleaved, in a bucket of the matching real dtype). Every strategy must do the same: the hook's slots cover both
parts (a slot sized by the complex count left the second half of the layer un-averaged, and the replicas diverged),
and LocalSGD's and SwarmSGD's flat copies keep the imaginary parts (casting to a real dtype dropped them: every sync
set them to zero)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from helpers.distributed import run_workers
from helpers.models import fit
from lightning_gradcomp import GradCompStrategy, LocalSGDStrategy, SwarmStrategy
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors import TopK, registry
from lightning_gradcomp.functional.realview import real_view
from lightning_gradcomp.hook import gradcomp_comm_hook
from lightning_gradcomp.localsgd import OuterSync

IN, STEPS, BATCH = 41, 4, 6
VARIANTS = [*registry.list(), "topk-all"]  # topk-all keeps every entry: the exact mean, within rounding
COMPLEX = ("zm", "z1", "zc", "zd")


class ComplexNet(pl.LightningModule):
    """Complex parameters of 1025, 17, 1 (complex64) and 6 (complex128) entries between real layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(IN, IN)
        self.zm = nn.Parameter(0.1 * torch.randn(25, IN, dtype=torch.complex64))
        self.z1 = nn.Parameter(torch.randn(17, dtype=torch.complex64))
        self.zc = nn.Parameter(torch.randn(1, dtype=torch.complex64))
        self.zd = nn.Parameter(torch.randn(6, dtype=torch.complex128))
        self.head = nn.Linear(17, 4)
        gen = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(48, IN, generator=gen), torch.randn(48, 4, generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (self.inp(x).to(torch.complex64) @ self.zm.T)[:, :17] * self.z1 + self.zc
        h = h + self.zd.to(torch.complex64).sum()
        return self.head(h.abs())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=BATCH, shuffle=True)


def _complex(model: nn.Module) -> list[torch.Tensor]:
    return [getattr(model, n).detach().clone() for n in COMPLEX]


def _hook_run(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    """Per compressor: parameters and gradients after every step, and the local gradients' mean (the reference)."""
    out: dict[str, Any] = {}
    for name in names:
        model = ComplexNet()
        start = _complex(model)
        ddp = DistributedDataParallel(model)  # default buckets: the complex64 parameters share one
        compressor = TopK(1.0) if name == "topk-all" else registry.create(name)
        strategy = GradCompStrategy(compressor=compressor, start_step=2, min_numel=1, compress_1d=True)
        hook = strategy.make_hook(Comm(None, CommStats()), {id(p): n for n, p in model.named_parameters()})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        hook.attach_optimizer(optimizer)
        ddp.register_comm_hook(hook, gradcomp_comm_hook)
        gen = torch.Generator().manual_seed(rank)
        params, grads, means = [], [], []
        for _ in range(STEPS):
            x, y = torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, 4, generator=gen)
            local = torch.autograd.grad(nn.functional.mse_loss(model(x), y), [getattr(model, n) for n in COMPLEX])
            mean = [real_view(g).clone() for g in local]
            for g in mean:
                dist.all_reduce(g)
                g.div_(world)
            means.append(mean)
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            grads.append([real_view(getattr(model, n).grad).clone() for n in COMPLEX])
            optimizer.step()
            params.append([p.detach().clone() for p in model.parameters()])
        out[name] = {"params": params, "grads": grads, "means": means, "start": start, "end": _complex(model),
                     "compressed": hook.stats.compressed_steps}
        hook.close()
    return out


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_every_compressor_reduces_both_parts_of_complex_gradients(world: int) -> None:
    results = run_workers(_hook_run, world, VARIANTS, timeout=120)
    for name in VARIANTS:
        first = results[0][name]
        expected = 0 if name == "none" else STEPS - 2  # steps 0 and 1 dense, compressed from step 2 on
        assert first["compressed"] == expected, name
        for rank, res in enumerate(results[1:], start=1):
            for step, (a, b) in enumerate(zip(first["params"], res[name]["params"])):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{name}: rank {rank} differs after step {step}"
        for p0, p1, pname in zip(first["start"], first["end"], COMPLEX):
            assert not torch.equal(p0.imag, p1.imag), f"{name}: the imaginary part of {pname} never moved"
            assert torch.isfinite(real_view(p1)).all(), name
    for name in ("none", "topk-all"):  # lossless: every step's gradient is the mean of the ranks' local ones
        for step, (grads, means) in enumerate(zip(results[0][name]["grads"], results[0][name]["means"])):
            for g, m, pname in zip(grads, means, COMPLEX):
                torch.testing.assert_close(g, m, rtol=1e-5, atol=1e-6, msg=f"{name} {pname} step {step}")


def _outer_run(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    """LocalSGD's engine (as the strategy builds it), two local steps per sync, ``outer="average"``."""
    out: dict[str, Any] = {}
    for name in names:
        model = ComplexNet()
        strategy = LocalSGDStrategy(local_steps=2, outer="average", compressor=name, min_numel=1, compress_1d=True)
        compressor = strategy.compressor.clone()
        compressor.prepare()
        params = [(n, p) for n, p in model.named_parameters()]
        engine = OuterSync(compressor, Comm(None, CommStats()), params, [], policy=strategy.policy, outer="average")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(rank)
        synced = []
        for step in range(STEPS):
            x, y = torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, 4, generator=gen)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            engine.count_step()
            if step % 2 == 1:
                local = _complex(model)
                engine.sync_next()
                glob = engine.global_tensors()
                synced.append({"local": local, "params": _complex(model),
                               "global": [glob[n].clone() for n in COMPLEX], "pending": engine.pending()})
        out[name] = synced
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_local_sgd_keeps_the_imaginary_parts(world: int) -> None:
    names = ["none", "topk", "qsgd", "powersgd", "cltk"]
    results = run_workers(_outer_run, world, names, timeout=120)
    for name in names:
        for sync, first in enumerate(results[0][name]):
            assert not first["pending"], f"{name}: parameters differ from the global model after sync {sync}"
            for p, g, pname in zip(first["params"], first["global"], COMPLEX):
                assert g.dtype == p.dtype and torch.equal(g, p), f"{name} {pname}: global model != parameters"
                assert p.imag.abs().sum() > 0, f"{name} {pname}: imaginary part zero after sync {sync}"
            for rank, res in enumerate(results[1:], start=1):
                assert all(torch.equal(a, b) for a, b in zip(first["params"], res[name][sync]["params"])), (
                    f"{name}: rank {rank} differs after sync {sync}")
        # dense pseudo-gradients and the "average" outer step: the synced model is the mean of the local ones
        for sync, first in enumerate(results[0]["none"]):
            for i, pname in enumerate(COMPLEX):
                mean = sum(r["none"][sync]["local"][i] for r in results) / world
                torch.testing.assert_close(first["params"][i], mean, rtol=1e-5, atol=1e-6,
                                           msg=f"{pname} sync {sync}")


class _Final(pl.Callback):
    """Saves each rank's complex parameters at the end of fit (after SwarmSGD's final average)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(_complex(pl_module), self.out / f"final{trainer.global_rank}.pt")


def test_swarm_gossips_the_imaginary_parts(tmp_path: Path) -> None:
    """Lock-step gossip every step, then the average at the end: the replicas agree, imaginary parts included, and
    those moved from the start (the fp32 copy had dropped them: zero after the first exchange)."""
    start = _complex(ComplexNet())
    fit(SwarmStrategy(mode="lockstep", start_method="fork"), tmp_path, devices=2, model=ComplexNet(),
        max_steps=STEPS, callbacks=[_Final(tmp_path)])
    final = [torch.load(tmp_path / f"final{r}.pt", weights_only=True) for r in range(2)]
    for p0, a, b, pname in zip(start, final[0], final[1], COMPLEX):
        assert torch.equal(a, b), pname
        assert a.dtype == p0.dtype and a.imag.abs().sum() > 0 and not torch.equal(p0.imag, a.imag), pname
