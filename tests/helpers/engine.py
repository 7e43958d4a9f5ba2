"""Training a small MLP through the hook engine on each rank of ``run_workers`` (bit-for-bit comparisons of two
ways of computing the same reduction)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.hierarchy import Hierarchy, HierarchyLayout
from lightning_gradcomp.hook import GradCompHook, gradcomp_comm_hook


def hook_under_ddp(model: nn.Module, strategy: GradCompStrategy, *, lr: float = 0.0, node_size: int = 0,
                   **ddp_kwargs: Any) -> tuple[DistributedDataParallel, GradCompHook, torch.optim.SGD]:
    """``model`` in DDP (``ddp_kwargs``) with ``strategy``'s hook on CPU and an SGD at ``lr`` attached to the hook.

    ``node_size``: the hierarchical hook, in nodes of that many ranks of the default group (0: flat)."""
    ddp = DistributedDataParallel(model, **ddp_kwargs)
    stats, names = CommStats(), {id(p): n for n, p in model.named_parameters()}
    hierarchy = None
    if node_size:
        numels = {n: p.numel() for n, p in model.named_parameters()}
        hierarchy = Hierarchy.create(HierarchyLayout(dist.get_world_size(), node_size), dist.get_rank(), numels, stats)
    hook = strategy.make_hook(Comm(None, stats), names, torch.device("cpu"), hierarchy)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    hook.attach_optimizer(optimizer)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    return ddp, hook, optimizer


def train_through_hook(
    rank: int,
    compressor: Compressor,
    *,
    steps: int,
    nonfinite: str = "dense",
    dtype: torch.dtype = torch.float32,
    poison_steps: Collection[int] = (),
    poison: float = float("inf"),
    grads: Optional[list[torch.Tensor]] = None,
) -> tuple[nn.Module, GradCompHook]:
    """A 33-130-77-5 MLP (seed 0, in ``dtype``) in DDP with 20 KB buckets, every layer compressed by ``compressor``
    (``min_numel=1``), trained ``steps`` SGD steps on data seeded by ``rank``; at ``poison_steps``, rank 1's loss gets
    ``poison`` (NaN, +Inf or -Inf) through the first layer's ``weight[0, 0]``, whose gradient it becomes. Returns the
    model and the (closed) hook; ``grads`` (when given) receives each step's averaged gradients, flat."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(33, 130), nn.Tanh(), nn.Linear(130, 77), nn.Tanh(), nn.Linear(77, 5)).to(dtype)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)
    hook = GradCompStrategy(compressor=compressor, min_numel=1, nonfinite=nonfinite).make_hook(
        Comm(), {id(p): n for n, p in model.named_parameters()}
    )
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook.attach_optimizer(optimizer)
    data = torch.Generator().manual_seed(rank)
    for step in range(steps):
        optimizer.zero_grad()
        loss = ddp(torch.randn(8, 33, generator=data).to(dtype)).float().square().mean()
        if step in poison_steps and rank == 1:
            loss = loss + model[0].weight[0, 0] * poison
        loss.backward()
        if grads is not None:
            grads.append(torch.cat([p.grad.detach().reshape(-1).clone() for p in model.parameters()]))
        optimizer.step()
    hook.close()
    return model, hook
