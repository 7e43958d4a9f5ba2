"""Memories and compressor state are kept in unscaled units under fp16 AMP (issue 16, item 3).

Two runs with the same fp16 forward and backward differ only in the GradScaler's scale history: one grows the
scale every other step (and backs off at an injected overflow), the other keeps it constant (and backs off at
the same overflow). Scales are powers of two, so scaling is exact: when state is stored unscaled, both runs
must end with bit-identical parameters, memories and compressor state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from helpers.models import TinyNet, fit
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.compressors import CLTK, DIANA, QSGD, Compressor, PowerSGD, RandomK, SignSGD, TopK

COMPRESSORS = {
    "cltk": lambda: CLTK(0.05),
    "topk": lambda: TopK(0.05),
    "randomk": lambda: RandomK(0.1),
    "powersgd": lambda: PowerSGD(rank=2),
    "signsgd": lambda: SignSGD(),
    "diana": lambda: DIANA(),
    "qsgd": lambda: QSGD(bits=4),
}


class _OverflowOnce(TinyNet):
    """The loss becomes infinite at batch 1 of epoch 1 on rank 0: the scaler skips that step and backs off.

    The forward runs in fp32 (autocast off): fp16 activations would make small gradient entries subnormal,
    whose rounding depends on the scale, and the two runs would differ for a reason unrelated to the state.
    """

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            loss = super().training_step(batch, batch_idx)
        if self.current_epoch == 1 and batch_idx == 1 and self.global_rank == 0:
            loss = loss * float("inf")
        return loss


class _State(pl.Callback):
    """Saves the scale after every batch and, at the end, the parameters and all compression state."""

    def __init__(self, out: Path) -> None:
        self.out, self.scales = out, []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        hook = trainer.strategy.hook
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({"scales": self.scales, "params": [p.detach().clone() for p in pl_module.parameters()],
                    "memory": hook.memory.state_dict(), "compressor": hook.compressor.state_dict(),
                    "nonfinite": hook.stats.nonfinite_steps}, self.out / f"state{trainer.global_rank}.pt")


def _run(tmp_path: Path, compressor: Compressor, tag: str, growth_interval: int) -> list[dict[str, Any]]:
    out = tmp_path / tag
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=growth_interval)
    fit(GradCompStrategy(compressor=compressor, start_method="fork"), out, model=_OverflowOnce(), max_epochs=3,
        callbacks=[_State(out)], plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    return [torch.load(out / f"state{r}.pt", weights_only=True) for r in range(2)]


def _flat(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state) for t in _flat(state[k])]
    return []


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_state_is_independent_of_the_loss_scale_history(tmp_path: Path, name: str) -> None:
    changing = _run(tmp_path, COMPRESSORS[name](), "changing", growth_interval=2)
    constant = _run(tmp_path, COMPRESSORS[name](), "constant", growth_interval=10**6)
    scales = changing[0]["scales"]
    assert len(set(scales)) >= 4 and any(b < a for a, b in zip(scales, scales[1:])), scales  # grew and backed off
    assert len(set(constant[0]["scales"])) == 2  # only the back-off at the overflow
    assert changing[0]["nonfinite"] == constant[0]["nonfinite"] >= 1
    for rank in range(2):
        for a, b in zip(changing[rank]["params"], constant[rank]["params"], strict=True):
            assert torch.equal(a, b)
        for key in ("memory", "compressor"):
            flat_a, flat_b = _flat(changing[rank][key]), _flat(constant[rank][key])
            assert len(flat_a) == len(flat_b)
            assert all(torch.equal(a, b) for a, b in zip(flat_a, flat_b)), f"{key} differs"
    if COMPRESSORS[name]().uses_error_feedback:
        assert changing[0]["memory"], "no memory was kept"


class _SkippedStepKeepsZeros(TinyNet):
    """fp32 forward, ``zero_grad(set_to_none=False)``; at global step 3 rank 0's gradient of ``head.weight`` (or, with
    ``everywhere``, of every parameter) gets an Inf before DDP reduces it, so the scaler skips that step."""

    def __init__(self, everywhere: bool) -> None:
        super().__init__()
        self.everywhere = everywhere

    def on_train_start(self) -> None:
        if self.global_rank == 0:
            for name, p in self.named_parameters():
                if self.everywhere or name == "head.weight":
                    p.register_hook(self._poison)

    def _poison(self, grad: torch.Tensor) -> torch.Tensor:
        if self.trainer.global_step != 3:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return super().training_step(batch, batch_idx)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=False)


@pytest.mark.parametrize("name", ["cltk", "powersgd", "diana"])
def test_a_skipped_step_leaves_no_state_even_when_zero_grad_keeps_the_tensors(tmp_path: Path, name: str) -> None:
    """The scaler skips step 3 for an Inf in one layer; the other layers' buckets were finite and staged new state.
    That state must go, as nothing stepped: the run ends exactly as one where every layer's gradient held the Inf
    (nothing staged at all). ``zero_grad(set_to_none=False)`` leaves zeroed tensors that look like kept ones, so the
    strategy drops the state when the optimizer reports no step."""
    runs = {}
    for everywhere in (False, True):
        out = tmp_path / str(everywhere)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=10**6)
        fit(GradCompStrategy(compressor=COMPRESSORS[name](), start_method="fork", bucket_cap_mb=0.001), out,
            model=_SkippedStepKeepsZeros(everywhere), max_epochs=2, callbacks=[_State(out)],
            plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
        runs[everywhere] = [torch.load(out / f"state{r}.pt", weights_only=True) for r in range(2)]
    assert runs[False][0]["scales"] == runs[True][0]["scales"] and len(set(runs[True][0]["scales"])) == 2  # skipped
    for rank in range(2):
        one, every = runs[False][rank], runs[True][rank]
        assert all(torch.equal(a, b) for a, b in zip(one["params"], every["params"], strict=True))
        flat_a = _flat(one["memory"]) + _flat(one["compressor"])
        flat_b = _flat(every["memory"]) + _flat(every["compressor"])
        assert len(flat_a) == len(flat_b) > 0
        assert all(torch.equal(a, b) for a, b in zip(flat_a, flat_b)), "the state differs"
