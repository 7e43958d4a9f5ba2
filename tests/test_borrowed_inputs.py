"""``Compressor.borrows_inputs``: without error feedback the engine hands such a compressor views of the bucket
instead of copies, and the result is the same bits."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from helpers.distributed import run_workers
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import Comm
from lightning_gradcomp.compressors import DIANA, QSGD, Cast
from lightning_gradcomp.compressors.base import ReduceContext, Reduction
from lightning_gradcomp.hook import gradcomp_comm_hook


def _recording(base: type, borrows: bool) -> type:
    class Recording(base):  # type: ignore[misc, valid-type]
        capabilities = dataclasses.replace(base.capabilities, borrows_inputs=borrows)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.pointers: list[int] = []

        def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
            self.pointers.extend(t.untyped_storage().data_ptr() for t in tensors)
            return super().reduce(tensors, ctx)

    return Recording


def _train(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for base, kwargs in ((Cast, {}), (QSGD, {"bits": 4}), (DIANA, {})):
        for borrows in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(33, 130), nn.Tanh(), nn.Linear(130, 7))
            ddp = DistributedDataParallel(model)
            comp = _recording(base, borrows)(**kwargs)
            hook = GradCompStrategy(compressor=comp, min_numel=1, compress_1d=True).make_hook(
                Comm(), {id(p): n for n, p in model.named_parameters()})
            buckets: list[int] = []
            ddp.register_comm_hook(hook, lambda state, bucket: (buckets.append(
                bucket.buffer().untyped_storage().data_ptr()), gradcomp_comm_hook(state, bucket))[1])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            hook.attach_optimizer(optimizer)
            data = torch.Generator().manual_seed(rank)
            for _ in range(5):
                optimizer.zero_grad()
                ddp(torch.randn(8, 33, generator=data)).square().mean().backward()
                optimizer.step()
            hook.close()
            comp = hook.compressor  # the hook owns a copy
            out[(base.__name__, borrows)] = {
                "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                "borrowed": bool(comp.pointers) and all(ptr in set(buckets) for ptr in comp.pointers),
                "compressed": bool(comp.pointers)}
    return out


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_borrowing_compressors_get_bucket_views_and_the_same_bits(world: int) -> None:
    results = run_workers(_train, world)
    for name in ("Cast", "QSGD", "DIANA"):
        copied, borrowed = [r[(name, False)] for r in results], [r[(name, True)] for r in results]
        assert all(r["compressed"] for r in copied + borrowed)
        assert not any(r["borrowed"] for r in copied), name  # fresh copies
        assert all(r["borrowed"] for r in borrowed), name  # views of the bucket
        for a, b in zip(copied, borrowed):
            assert torch.equal(a["params"], b["params"]), name
        assert all(torch.equal(r["params"], borrowed[0]["params"]) for r in borrowed), name
