"""Process groups: ``release_group``, and the strategies releasing the private groups they create at teardown.

The fits here run the way ``torchrun`` runs them: the ranks exist already and ``torch.distributed`` is initialized, so
one process runs several fits (a sweep) on the same default group.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from helpers.distributed import run_workers
from helpers.models import TinyNet
from lightning_gradcomp import GradCompStrategy, LocalSGDStrategy, SwarmStrategy
from lightning_gradcomp.compressors import CLTK, TopK
from lightning_gradcomp.distributed import release_group


def _registered() -> int:
    """Process groups this process holds (the default one included)."""
    return len(dist.distributed_c10d._world.pg_map)


def test_release_group_without_torch_distributed_does_nothing() -> None:
    assert not dist.is_initialized()
    assert release_group(None) is False
    assert release_group(object()) is False


def _release_worker(rank: int, world: int) -> dict[str, Any]:
    before = _registered()
    mine = dist.new_group(list(range(world)))
    only_first = dist.new_group([0])  # rank 1 is no member: it gets NON_GROUP_MEMBER
    out = {"none": release_group(None), "default": release_group(dist.group.WORLD)}
    out["first"], out["again"] = release_group(mine), release_group(mine)
    out["only_first"] = release_group(only_first)
    torch.distributed.barrier()  # the default group still works
    out["left"] = _registered() - before
    return out


def test_release_group_destroys_private_groups_only() -> None:
    first, second = run_workers(_release_worker, 2)
    for result in (first, second):
        assert result["none"] is False and result["default"] is False
        assert result["first"] is True and result["again"] is False
        assert result["left"] == 0
    assert first["only_first"] is True and second["only_first"] is False


# ---------------------------------------------------------------------------- strategies, several fits per process
STRATEGIES: dict[str, Callable[[], pl.strategies.Strategy]] = {
    "gradcomp": lambda: GradCompStrategy(compressor=TopK(0.1)),
    "gradcomp_hierarchy": lambda: GradCompStrategy(compressor=CLTK(0.1), hierarchy=2),
    "swarm_async": lambda: SwarmStrategy(mode="async", local_steps=2),
    "localsgd_overlap": lambda: LocalSGDStrategy(local_steps=2, overlap=1),
}


def _as_torchrun(rank: int, world: int) -> None:
    """Lightning's TorchElastic environment: the ranks exist and the default group is initialized (by the runner)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", NODE_RANK="0", TORCHELASTIC_RUN_ID="test")


def _trainer(strategy: Any, world: int, steps: int) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _sweep_worker(rank: int, world: int, kind: str, fits: int) -> list[int]:
    _as_torchrun(rank, world)
    counts = [_registered()]
    for _ in range(fits):
        _trainer(STRATEGIES[kind](), world, 3).fit(TinyNet())
        counts.append(_registered())
    return counts


@pytest.mark.parametrize("kind,world", [("gradcomp", 2), ("gradcomp", 3), ("gradcomp_hierarchy", 4),
                                        ("swarm_async", 2), ("localsgd_overlap", 3)])
def test_a_process_running_many_fits_keeps_no_earlier_fits_groups(kind: str, world: int) -> None:
    for counts in run_workers(_sweep_worker, world, kind, 3, timeout=120.0):
        assert counts == [counts[0]] * 4, f"process groups held before and after each fit: {counts}"


class _FailsAtStep(TinyNet):
    """TinyNet whose ``training_step`` raises at batch ``2`` on every rank (after compressed steps)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise ValueError("failed on purpose")
        return super().training_step(batch, batch_idx)


def _failing_worker(rank: int, world: int) -> list[int]:
    _as_torchrun(rank, world)
    counts = [_registered()]
    for _ in range(2):
        with pytest.raises(ValueError, match="failed on purpose"):
            _trainer(GradCompStrategy(compressor=TopK(0.1), start_step=2), world, 6).fit(_FailsAtStep())
        counts.append(_registered())
    _trainer(GradCompStrategy(compressor=TopK(0.1)), world, 3).fit(TinyNet())  # the process still trains
    return counts


def test_a_fit_that_raises_releases_its_groups_too() -> None:
    for counts in run_workers(_failing_worker, 2, timeout=120.0):
        assert counts == [counts[0]] * 3, f"process groups held before and after each failed fit: {counts}"


def _refit_worker(rank: int, world: int, hierarchy: Any, ckpt: str) -> dict[str, Any]:
    _as_torchrun(rank, world)
    strategy = GradCompStrategy(compressor=TopK(0.1), hierarchy=hierarchy, start_step=2)
    model = TinyNet()
    trainer = _trainer(strategy, world, 3)
    before = _registered()
    trainer.fit(model)
    hook = strategy.hook
    assert hook is not None
    first = {"step": hook.step, "wire": hook.stats.wire_bytes, "groups": _registered() - before,
             "memory": {k: v.clone() for k, v in hook.memory.state_dict().items()}}
    trainer.save_checkpoint(ckpt)  # after the fit's teardown: the hook's state, without its groups
    trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.fit(model)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"first": first, "same_hook": strategy.hook is hook, "step": hook.step, "wire": hook.stats.wire_bytes,
            "groups": _registered() - before, "params": params}


@pytest.mark.parametrize("world,hierarchy", [(2, None), (4, 2)])
def test_a_second_fit_of_one_strategy_keeps_its_hook_on_new_groups(tmp_path: Path, world: int, hierarchy: Any) -> None:
    """The hook (its step counter, memories and byte counts) carries over to the next ``fit``; its groups are made
    anew, the earlier ones released, and the replicas stay identical. A checkpoint saved between the fits holds the
    first fit's step."""
    ckpt = tmp_path / "between.ckpt"
    results = run_workers(_refit_worker, world, hierarchy, str(ckpt), timeout=120.0)
    assert torch.load(ckpt, weights_only=False)["gradcomp"]["replicated"]["step"] == 3
    for rank, result in enumerate(results):
        first = result["first"]
        assert first["groups"] == 0 and result["groups"] == 0, f"rank {rank}: groups left after a fit"
        assert result["same_hook"], f"rank {rank}: the second fit built a new hook"
        assert first["step"] == 3 and result["step"] == 6, f"rank {rank}: steps {first['step']} then {result['step']}"
        assert result["wire"] > first["wire"] > 0, f"rank {rank}: the second fit sent nothing"
        assert any(v.abs().sum() > 0 for v in first["memory"].values()), f"rank {rank}: no memory to carry over"
        assert torch.equal(result["params"], results[0]["params"]), f"rank {rank} differs from rank 0"
