"""Sparse gradients (``nn.Embedding(sparse=True)``): DDP gives each its own bucket, a sparse COO tensor. The engine
reduces it as DDP does (never compressed: one sparse all-reduce of the gradient divided by W) next to the compressed
dense buckets, with every compressor: replicas identical, ``NoCompression`` bit-identical to DDP, the sparse
layer's bytes the formula's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from helpers.distributed import run_workers
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import Comm, all_gather_bytes
from lightning_gradcomp.compressors import registry
from lightning_gradcomp.hook import gradcomp_comm_hook

BATCH, STEPS = 6, 5
"""Each batch has 24 tokens: with the small vocabularies below they repeat rows, so the uncoalesced gradient holds
duplicates."""


class _Tagger(nn.Module):
    """A sparse embedding (``nn.Embedding`` or, with ``bag``, ``nn.EmbeddingBag``) feeding two dense layers."""

    def __init__(self, bag: bool, vocab: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, dim, sparse=True) if bag else nn.Embedding(vocab, dim, sparse=True)
        self.bag = bag
        self.hidden = nn.Linear(dim, 48)
        self.out = nn.Linear(48, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pooled = self.emb(tokens) if self.bag else self.emb(tokens).mean(1)
        return self.out(self.hidden(pooled).tanh())


def _train(
    rank: int, world: int, names: list[str], dtype: torch.dtype, bag: bool, vocab: int, dim: int
) -> dict[str, Any]:
    """Per compressor name (``"ddp"``: no hook), the final parameters and the stats of the embedding layer; and the
    bytes the formula gives for the embedding (per step, this rank's distinct tokens: its nnz rows)."""
    out: dict[str, Any] = {}
    payload = 0
    for name in names:
        torch.manual_seed(0)
        model = _Tagger(bag, vocab, dim).to(dtype)
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        hook = None
        if name != "ddp":
            strategy = GradCompStrategy(compressor=registry.create(name), min_numel=1, compress_1d=True)
            hook = strategy.make_hook(Comm(), {id(p): n for n, p in model.named_parameters()})
            ddp.register_comm_hook(hook, gradcomp_comm_hook)
            hook.attach_optimizer(optimizer)
        data = torch.Generator().manual_seed(rank)
        payload = 0
        for _ in range(STEPS):
            optimizer.zero_grad()
            tokens = torch.randint(vocab, (BATCH, 4), generator=data)
            payload += tokens.unique().numel() * (8 + dim * dtype.itemsize)  # an int64 index and dim values per row
            ddp(tokens).float().square().mean().backward()
            assert model.emb.weight.grad is not None and model.emb.weight.grad.is_sparse
            optimizer.step()
        out[name] = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}
        if hook is not None:
            hook.close()
            layer = hook.stats.layer("emb.weight")
            out[name].update(
                wire=layer.wire_bytes, dense=layer.dense_bytes, compressed=layer.compressed, total=hook.stats.wire_bytes
            )
    out["expected"] = all_gather_bytes(payload, world)
    return out


@pytest.mark.parametrize(
    ("world", "dtype", "bag", "vocab", "dim"),
    [
        (2, torch.float32, False, 12, 8),
        (3, torch.float32, False, 12, 8),
        (3, torch.float32, True, 12, 8),
        (3, torch.bfloat16, False, 12, 8),
        (4, torch.float32, True, 7, 13),  # odd and prime sizes
        (5, torch.bfloat16, False, 31, 1),
    ],
)
def test_sparse_gradients_are_reduced_as_ddp_does_next_to_every_compressor(
    world: int, dtype: torch.dtype, bag: bool, vocab: int, dim: int
) -> None:
    """At W = 3 each duplicate entry must be divided by W before the duplicates are summed, as DDP does: the other
    order rounds differently."""
    names = ["ddp", *registry.list()]
    results = run_workers(_train, world, names, dtype, bag, vocab, dim)
    for name in names:
        finals = [r[name]["params"] for r in results]
        for key, value in finals[0].items():
            assert torch.isfinite(value).all(), (name, key)
            assert all(torch.equal(value, f[key]) for f in finals[1:]), (name, key)  # replicas identical
        if name == "ddp":
            continue
        for r in results:
            assert r[name]["compressed"] is False, name
            assert r[name]["wire"] == pytest.approx(r["expected"]), name  # (W - 1) x (indices + values)
            assert r[name]["dense"] == pytest.approx(r[name]["wire"]), name  # what DDP sends for it
            assert r[name]["total"] > r[name]["wire"], name  # the dense buckets went over the wire too
    ddp, plain = results[0]["ddp"]["params"], results[0]["none"]["params"]
    assert all(torch.equal(ddp[k], plain[k]) for k in ddp)  # no compression: DDP's bits
