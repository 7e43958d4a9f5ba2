"""A small LightningModule sharded with FSDP2, and a callback recording every rank's full parameters."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp.compressors import (
    CLTK,
    DIANA,
    QSGD,
    Cast,
    NoCompression,
    PowerSGD,
    RandomK,
    SignSGD,
    TernGrad,
    TopK,
)
from lightning_gradcomp.plan import BucketPlan, LayerSlot

SIZES = (13, 7, 5)
"""Layer widths: odd and prime, so FSDP2's dim-0 shards are uneven and padded."""


COMPRESSORS = {
    "none": NoCompression,
    "cast_bf16": lambda: Cast(torch.bfloat16),
    "topk": lambda: TopK(density=0.05),
    "randomk": lambda: RandomK(density=0.05),
    "terngrad": lambda: TernGrad(group_size=16),
    "cltk": lambda: CLTK(density=0.01),
    "qsgd": lambda: QSGD(bits=4, group_size=16),
    "signsgd": lambda: SignSGD(group_size=16),
    "powersgd": lambda: PowerSGD(rank=1, min_compression_rate=1.0),
    "diana": DIANA,
}
"""A factory per compressor the FSDP2 tests sweep (fresh objects: a compressor is owned by one rank)."""


def tanh_mlp(sizes: Sequence[int], width: int) -> nn.Sequential:
    """``Linear -> Tanh`` layers of widths ``sizes`` on ``width`` inputs, seeded (the same on every rank)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    last = width
    for size in sizes:
        layers += [nn.Linear(last, size), nn.Tanh()]
        last = size
    return nn.Sequential(*layers)


class Block(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class ShardedNet(pl.LightningModule):
    """Blocks of odd/prime widths; ``self_shard``: ``configure_model`` applies ``fully_shard`` over the mesh's
    ``"shard"`` dimension (else the strategy's ``shard_modules`` must). ``mp``: bf16 parameters, fp32 reduction."""

    def __init__(self, width: int = 11, samples: int = 96, batch_size: int = 4, self_shard: bool = True,
                 mp: bool = False, sizes: Sequence[int] = SIZES) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers, last = [], width
        for size in sizes:
            layers.append(Block(last, size))
            last = size
        self.blocks = nn.Sequential(*layers)
        self.self_shard, self.mp = self_shard, mp
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(samples, width, generator=gen)
        self.y = torch.randn(samples, sizes[-1], generator=gen)
        self.batch_size = batch_size

    def configure_model(self) -> None:
        if not self.self_shard:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs: dict[str, Any] = {"mesh": self.device_mesh["shard"]}
        if self.mp:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in self.blocks:
            fully_shard(block, **kwargs)
        fully_shard(self, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, shuffle=False)


class FullRecorder(pl.Callback):
    """After every batch: each parameter's ``full_tensor()`` (a collective: every rank records). At the end:
    ``<out>/rank<r>.pt`` with ``params`` (a list of flat tensors), ``stats``, ``step`` and ``memory``."""

    def __init__(self, out: Path, every: int = 1) -> None:
        self.out, self.every = Path(out), every
        self.params: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if (trainer.global_step % self.every) == 0:
            full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in pl_module.parameters()]
            self.params.append(torch.cat([t.detach().float().reshape(-1).clone() for t in full]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        reduction = getattr(strategy, "reduction", None)
        stats = getattr(strategy, "comm_stats", None)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({"params": self.params, "stats": None if stats is None else stats.state_dict(),
                    "step": None if reduction is None else reduction.step,
                    "memory": None if reduction is None else reduction.memory.state_dict(),
                    "plans": None if reduction is None else [plan_record(p) for p in reduction.plans()]},
                   self.out / f"rank{trainer.global_rank}.pt")


def plan_record(plan: BucketPlan) -> dict[str, Any]:
    """``plan`` as plain data (``weights_only``-loadable); :func:`plan_from_record` rebuilds it."""
    return {"index": plan.index, "numel": plan.numel,
            "slots": [(s.name, s.offset, list(s.shape), s.compressed, s.small) for s in plan.slots]}


def plan_from_record(record: dict[str, Any]) -> BucketPlan:
    slots = tuple(LayerSlot(name, offset, tuple(shape), compressed, small)
                  for name, offset, shape, compressed, small in record["slots"])
    return BucketPlan(record["index"], record["numel"], slots)


def fit_sharded(strategy: Any, out: Path, *, devices: int = 4, model: Optional[pl.LightningModule] = None,
                max_steps: int = 20, ckpt_path: Optional[str] = None, callbacks: Optional[list] = None,
                **trainer_kwargs: Any) -> list[dict[str, Any]]:
    """Fit ``model`` (ShardedNet) on ``devices`` forked CPU ranks; every rank's record."""
    out = Path(out)
    options: dict[str, Any] = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                               "enable_model_summary": False, **trainer_kwargs}
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps,
                         callbacks=[FullRecorder(out), *(callbacks or [])], default_root_dir=str(out), **options)
    trainer.fit(model or ShardedNet(), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(devices)]
