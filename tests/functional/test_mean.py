"""DDP's pre-division: the engine's dense reductions keep DDP's bits at every world size and gradient dtype."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from helpers.distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import Comm
from lightning_gradcomp.compressors import NoCompression, TopK
from lightning_gradcomp.functional.axpy import predivide_
from lightning_gradcomp.hook import gradcomp_comm_hook

STEPS = 4
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def test_predivide_differs_from_a_division_where_ddp_does() -> None:
    """At W = 3 the reciprocal's product and the quotient differ on some entries (the reason for the helper); at
    powers of two they never do."""
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(predivide_(x.clone(), 3), x / 3)
    for world in (1, 2, 4, 8):
        assert torch.equal(predivide_(x.clone(), world), x / world)


def test_the_old_import_path_warns_and_gives_the_same_function() -> None:
    import importlib
    import sys

    sys.modules.pop("lightning_gradcomp.functional.mean", None)
    with pytest.warns(DeprecationWarning, match="functional.axpy"):
        mean = importlib.import_module("lightning_gradcomp.functional.mean")
    assert mean.predivide_ is predivide_


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 3)).to(dtype)


def _train(rank: int, dtype: torch.dtype, hooked: Optional[GradCompStrategy]) -> list[list[torch.Tensor]]:
    """The gradients DDP leaves after each of :data:`STEPS` SGD steps, with ``hooked``'s engine or DDP's own."""
    model = _model(dtype)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002, gradient_as_bucket_view=hooked is not None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = None
    if hooked is not None:
        hook = hooked.make_hook(Comm(), {id(p): n for n, p in model.named_parameters()})
        ddp.register_comm_hook(hook, gradcomp_comm_hook)
        hook.attach_optimizer(optimizer)
    data = torch.Generator().manual_seed(rank)
    grads = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        ddp(torch.randn(8, 16, generator=data).to(dtype)).float().square().mean().backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        optimizer.step()
    if hook is not None:
        hook.close()
    return grads


def _compare(rank: int, world: int) -> dict[str, Any]:
    """Per dtype and engine setting, the steps whose gradients differ from plain DDP's (none expected)."""
    settings = {
        "none": lambda: GradCompStrategy(NoCompression(), min_numel=1),
        # all steps dense (before start_step): the engine's dense path
        "dense steps": lambda: GradCompStrategy(TopK(0.1), start_step=STEPS + 1),
    }
    found: dict[str, Any] = {}
    for dtype in DTYPES:
        reference = _train(rank, dtype, None)
        for name, make in settings.items():
            grads = _train(rank, dtype, make())
            found[f"{dtype} {name}"] = [
                step for step in range(STEPS) if not all(map(torch.equal, grads[step], reference[step]))
            ]
        if world > 2:  # the dense slots travel in a collective of another size: gloo may sum 3+ ranks in another order
            continue
        # compressed weights, dense biases: the biases' first compressed step (from DDP's parameters) is DDP's
        grads = _train(rank, dtype, GradCompStrategy(TopK(0.1), start_step=2, min_numel=1))
        found[f"{dtype} dense slots"] = [
            i for i, (a, b) in enumerate(zip(grads[2], reference[2])) if a.dim() == 1 and not torch.equal(a, b)
        ]
    return found


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_dense_reductions_keep_ddps_bits(world: int) -> None:
    """NoCompression and the dense steps before ``start_step`` give DDP's gradients bit for bit, in fp32, fp64, bf16
    and fp16, at W = 2..5 (DDP scales by ``1 / W``: a division differs at W = 3 and 5); so do the dense slots of a
    compressed step at W = 2."""
    for rank, found in enumerate(run_workers(_compare, world, timeout=120)):
        assert not any(found.values()), (rank, {k: v for k, v in found.items() if v})
