"""LGreCo tunes a compressor it has never heard of: one that describes its own costs (``layer_costs``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, Sequence

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor
from torch.futures import Future

from helpers.models import TinyNet, assert_replicas_identical, fit
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import LGreCo
from lightning_gradcomp.checks import check_int
from lightning_gradcomp.comm import then_same_numerics
from lightning_gradcomp.compressors import Compressor, ReduceContext, Reduction
from lightning_gradcomp.hook import BucketRecord
from lightning_gradcomp.plan import LayerSlot


# ---------------------------------------------------------------------------------------------- the compressor
def _block_means(x: Tensor, block: int) -> Tensor:
    """Means of consecutive blocks of ``block`` elements of a flat tensor (the last block may be shorter)."""
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.cat([x, x.new_zeros(blocks * block - n)]).view(blocks, block)
    counts = torch.full((blocks,), float(block), dtype=x.dtype, device=x.device)
    counts[-1] = n - (blocks - 1) * block
    return padded.sum(1) / counts


def _expand(means: Tensor, block: int, numel: int) -> Tensor:
    return means.repeat_interleave(block)[:numel]


class BlockMean(Compressor):
    """Send the mean of every ``block`` consecutive elements of a layer (one all-reduce), with error feedback.

    ``block`` is a per-layer integer parameter: L-GreCo tunes it through :meth:`layer_costs` alone, with the
    base class's integer grid and candidate filter.
    """

    param_name: ClassVar[str] = "block"

    def __init__(self, block: int = 4) -> None:
        self.block = self.check_param(block)

    @property
    def uses_error_feedback(self) -> bool:
        return True

    def check_param(self, value: Any) -> int:
        return check_int("block", value, 1)

    def layer_costs(self, stat: Tensor, shape: Sequence[int],
                    candidates: Sequence[Any]) -> tuple[list[float], list[float]]:
        """``4 ceil(n / block)`` bytes and the exact error ``||A - expand(means(A))||``."""
        x = stat.detach().reshape(-1).to(torch.float64)
        n = x.numel()
        sizes = [4.0 * -(-n // int(b)) for b in candidates]
        errors = [float((x - _expand(_block_means(x, int(b)), int(b), n)).norm()) for b in candidates]
        return sizes, errors

    def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
        blocks = [int(b) for b in ctx.params]
        means = [_block_means(t, b) for t, b in zip(tensors, blocks)]
        residuals = [t.sub_(_expand(m, b, t.numel())) for t, m, b in zip(tensors, means, blocks)]
        counts = [m.numel() for m in means]
        fut = ctx.comm.all_reduce(torch.cat(means), async_op=True, shares=ctx.shares(counts))
        numels, world = [t.numel() for t in tensors], ctx.world_size

        def decode(f: Future) -> list[Tensor]:
            summed = f.value().div_(world)
            return [_expand(m, b, n) for m, b, n in zip(torch.split(summed, counts), blocks, numels)]

        return Reduction(averaged=then_same_numerics(fut, decode), residuals=residuals)

    def extra_repr(self) -> str:
        return f"block={self.block}"


# ---------------------------------------------------------------------------------------------- the DP choice
def test_custom_compressor_is_tunable() -> None:
    comp = BlockMean(block=4)
    assert comp.tunable and comp.default_param == 4
    assert comp.candidate_grid(0.25, 4.0, 9) == list(range(1, 17))
    assert comp.layer_candidates((8, 64), [0, 2, 2.5, 8]) == [2, 4, 8]  # checked, default added, sorted
    x = torch.arange(8.0)
    sizes, errors = comp.layer_costs(x, (8,), [1, 2, 8])
    assert sizes == [32.0, 16.0, 4.0] and errors[0] == 0.0 and errors[1] == pytest.approx(8 ** 0.5 / 2)


def test_lgreco_picks_the_custom_parameter_by_dp() -> None:
    gen = torch.Generator().manual_seed(0)
    # "smooth": constant on blocks of 16 (small integers, so every block mean is exact); "rough": white noise
    smooth = torch.randint(-4, 5, (32,), generator=gen).float().repeat_interleave(16).view(8, 64)
    rough = torch.randn(8, 64, generator=gen)
    cb = LGreCo(period=5, warmup_steps=10, accumulate_steps=1)
    applied: dict[str, Any] = {}
    cb._hook = SimpleNamespace(step=10, comm=SimpleNamespace(world_size=1), compressor=BlockMean(block=4),
                               device=torch.device("cpu"))
    stats = {"smooth": smooth, "rough": rough}
    slots = tuple(LayerSlot(name, 0, tuple(x.shape), True) for name, x in stats.items())
    cb._collector(BucketRecord(9, 0, slots, [x.reshape(-1) for x in stats.values()], None))
    entry = cb.adjust(SimpleNamespace(set_layer_params=applied.update))
    assert entry is not None and entry["feasible"]
    assert applied == cb.choice and applied["smooth"] == 16  # the largest block of the grid, still exact
    assert applied["rough"] <= 4  # white noise: larger blocks only lose more
    assert entry["error"] <= entry["budget"] and entry["bytes"] < entry["uniform_bytes"]


# ---------------------------------------------------------------------------------------------- Lightning
class _Dump(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = Path(out)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        lg = next(cb for cb in trainer.callbacks if isinstance(cb, LGreCo))
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({"end": dict(trainer.strategy.hook.layer_params), "history": lg.history},
                   self.out / f"dump{trainer.global_rank}.pt")


def test_lightning_run_tunes_custom_compressor_identically_on_all_ranks(tmp_path: Path) -> None:
    world = 2
    strategy = GradCompStrategy(compressor=BlockMean(block=4), start_method="fork")
    cb = LGreCo(period=3, warmup_steps=4, accumulate_steps=2, alpha=1.3)
    records = fit(strategy, tmp_path, devices=world, model=TinyNet(hidden=64, in_features=48, samples=64,
                                                                   batch_size=8),
                  max_epochs=3, callbacks=[cb, _Dump(tmp_path)])
    assert_replicas_identical(records)
    dumps = [torch.load(tmp_path / f"dump{r}.pt", weights_only=True) for r in range(world)]
    history = dumps[0]["history"]
    assert [h["step"] for h in history] == [4, 7, 10]
    assert all(h["feasible"] and h["error"] <= h["budget"] for h in history)
    assert any(h["values"] != [4, 4] for h in history)  # a non-uniform choice was applied
    assert dumps[1]["history"] == history and dumps[1]["end"] == dumps[0]["end"]
    assert dumps[0]["end"] == dict(zip(history[-1]["layers"], history[-1]["values"]))
    for rec in records:  # the engine used the chosen values on every rank
        for name, value in dumps[0]["end"].items():
            assert rec["stats"]["layers"][name]["param"] == value
