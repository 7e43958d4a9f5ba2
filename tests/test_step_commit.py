"""State reflects only gradients an optimizer step consumed; steps are optimizer steps (issue 16, item 7).

Each case is compared with the same run without the extra pass or the unused branch, where plain DDP gives
bit-identical parameters: with compression it must too, for every stateful compressor.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from helpers.distributed import run_workers
from helpers.engine import hook_under_ddp
from helpers.models import fit
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.compressors import CLTK, DIANA, Compressor, PowerSGD, SignSGD, TopK

COMPRESSORS = {
    "cltk": lambda: CLTK(0.05),
    "topk": lambda: TopK(0.05),
    "powersgd": lambda: PowerSGD(rank=2),
    "signsgd": lambda: SignSGD(),
    "diana": lambda: DIANA(),
}


def _strategy(compressor: Compressor, **kwargs: Any) -> GradCompStrategy:
    return GradCompStrategy(compressor=compressor, start_method="fork", **kwargs)


def _data(samples: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(samples, 32, generator=gen), torch.randn(samples, 4, generator=gen)


class _TwoOptimizers(pl.LightningModule):
    """Manual optimization over two parameter groups ``a`` and ``b`` (a GAN's shape).

    Per batch: ``loss_a`` backward, ``opt_a`` steps, both gradients are zeroed; then ``loss_b`` backward and
    ``opt_b`` steps. With ``leak`` the first loss also sends gradients into ``b`` (discarded by ``zero_grad``);
    without, ``b`` is detached there. With ``extra`` a whole backward pass is thrown away before the first.
    """

    def __init__(self, leak: bool = False, extra: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.leak, self.extra = leak, extra
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.b = nn.Linear(64, 4)
        self.x, self.y = _data()

    def _loss(self, batch: Any, detach_b: bool) -> torch.Tensor:
        x, y = batch
        h = self.a(x)
        if detach_b:
            out = nn.functional.linear(h, self.b.weight.detach(), self.b.bias.detach())
        else:
            out = self.b(h)
        return nn.functional.mse_loss(out, y)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()
        if self.extra:
            self.manual_backward(3.0 * self._loss(batch, detach_b=False))
            opt_a.zero_grad()
            opt_b.zero_grad()
        self.manual_backward(self._loss(batch, detach_b=not self.leak))
        opt_a.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
        x, y = batch
        loss_b = nn.functional.mse_loss(self.b(self.a(x).detach()), y)
        self.manual_backward(loss_b)
        opt_b.step()
        opt_b.zero_grad()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.a.parameters(), lr=0.05, momentum=0.9),
                torch.optim.SGD(self.b.parameters(), lr=0.05, momentum=0.9)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=8)


class _Final(pl.Callback):
    """Saves each rank's final parameters, step counters and memories to ``<out>/final<r>.pt``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        hook = trainer.strategy.hook
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({"params": [p.detach().clone() for p in pl_module.parameters()], "hook_step": hook.step,
                    "steps": hook.stats.steps, "global_step": trainer.global_step,
                    "memory": hook.memory.state_dict(), "compressor": hook.compressor.state_dict()},
                   self.out / f"final{trainer.global_rank}.pt")


def _run_manual(tmp_path: Path, name: str, tag: str, **model_kwargs: Any) -> list[dict[str, Any]]:
    out = tmp_path / tag
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=_strategy(COMPRESSORS[name](), start_step=2, find_unused_parameters=True),
                         max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[_Final(out)], default_root_dir=str(out))
    trainer.fit(_TwoOptimizers(**model_kwargs))
    return [torch.load(out / f"final{r}.pt", weights_only=True) for r in range(2)]


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for i, (x, y) in enumerate(zip(a["params"], b["params"], strict=True)):
        assert torch.equal(x, y), f"parameter {i} differs"
    assert a["memory"].keys() == b["memory"].keys()
    for k in a["memory"]:
        assert torch.equal(a["memory"][k], b["memory"][k]), f"memory of {k} differs"


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_discarded_backward_pass_leaves_no_trace(tmp_path: Path, name: str) -> None:
    """A backward pass whose gradient is zeroed before any step, and a GAN's cross-gradient into ``b``."""
    plain = _run_manual(tmp_path, name, "plain")
    noisy = _run_manual(tmp_path, name, "noisy", leak=True, extra=True)
    for rank in range(2):
        _assert_same(noisy[rank], plain[rank])
    batches = 2 * 3  # 2 epochs x 48 samples / (8 per batch x 2 ranks)
    for rec in (plain[0], noisy[0]):  # steps are optimizer steps (two per batch), not backward passes
        assert rec["steps"] == rec["hook_step"] == rec["global_step"] == 2 * batches


class _SometimesUsed(pl.LightningModule):
    """An MLP whose ``branch`` takes part only in even batches (``find_unused_parameters=True``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.Tanh())
        self.branch = nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)
        self.x, self.y = _data(64)
        self.memories: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.body(x)
        if batch_idx % 2 == 0:
            h = torch.tanh(self.branch(h))
        return nn.functional.mse_loss(self.head(h), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        hook = self.trainer.strategy.hook
        self.memories.append(_state_of("branch.weight", {"memory": hook.memory.state_dict(),
                                                         "compressor": hook.compressor.state_dict()}))

    def on_train_end(self) -> None:
        torch.save({"memories": self.memories}, Path(self.trainer.default_root_dir) / f"m{self.global_rank}.pt")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=8)


def _state_of(name: str, state: Any, inside: bool = False) -> torch.Tensor:
    """Every tensor of ``state`` (nested dicts) stored under key ``name``, flattened and concatenated."""
    if isinstance(state, torch.Tensor):
        return state.reshape(-1).float() if inside else torch.zeros(0)
    if isinstance(state, dict):
        parts = [_state_of(name, v, inside or k == name) for k, v in sorted(state.items())]
        return torch.cat(parts) if parts else torch.zeros(0)
    return torch.zeros(0)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_parameter_unused_on_every_rank_keeps_its_memory(tmp_path: Path, name: str) -> None:
    """In odd batches ``branch`` is unused everywhere: DDP leaves it alone, and so must its memory and state."""
    fit(_strategy(COMPRESSORS[name](), find_unused_parameters=True), tmp_path, model=_SometimesUsed(),
        max_epochs=2)
    memories = torch.load(tmp_path / "m0.pt", weights_only=True)["memories"]
    assert len(memories) == 8
    compressed = [i for i, m in enumerate(memories) if m.numel()]
    assert compressed, "the branch never got compression state"
    for i in range(1, len(memories), 2):  # odd batch i: unused
        if memories[i - 1].numel():
            assert torch.equal(memories[i], memories[i - 1]), f"batch {i} changed the unused layer's memory"
    assert any(not torch.equal(memories[i], memories[i - 2]) for i in range(2, len(memories), 2)
               if memories[i - 2].numel()), "the used batches never changed the memory"


# ---------------------------------------------------------------------------- the hook under DDP, without Lightning
class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 24, bias=False)
        self.b = nn.Linear(24, 24, bias=False)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return self.b(h) if use_b else h


USES_B = (True, True, True, False, False, True, False, True)


def _hooked(model: nn.Module, name: str, views: bool, node_size: int = 0,
            **ddp_kwargs: Any) -> tuple[DistributedDataParallel, Any, Any]:
    """``model`` under DDP with the compressor's hook (compressed from the third step) and an SGD at ``lr = 0``
    attached to it: the optimizer steps with the gradients alone. ``node_size``: the hierarchical hook with nodes of
    that many ranks (0: flat)."""
    strategy = _strategy(COMPRESSORS[name](), start_step=2, min_numel=1, gradient_as_bucket_view=views)
    return hook_under_ddp(model, strategy, node_size=node_size, gradient_as_bucket_view=views, **ddp_kwargs)


def _applied_and_memory(rank: int, world: int, name: str, views: bool, set_to_none: bool) -> dict[str, Any]:
    """What the optimizer was handed for ``b`` over the steps (``lr = 0``: the gradients alone), and ``b``'s final
    memory, with ``b`` unused on every rank in some steps."""
    model = _Branchy()
    ddp, hook, optimizer = _hooked(model, name, views, find_unused_parameters=True)
    gen = torch.Generator().manual_seed(rank)
    applied = torch.zeros(24, 24)
    for use_b in USES_B:
        optimizer.zero_grad(set_to_none=set_to_none)
        ddp(torch.randn(8, 16, generator=gen), use_b).square().mean().backward()
        if model.b.weight.grad is not None:
            applied += model.b.weight.grad
        optimizer.step()
    memory = hook.memory.state_dict().get("b.weight", torch.zeros(24 * 24)).reshape(24, 24)
    hook.close()
    return {"applied": applied, "memory": memory}


def _averaged_gradients(world: int) -> torch.Tensor:
    """The sum over the steps of the ranks' mean gradient of ``b``, without DDP."""
    model, total = _Branchy(), torch.zeros(24, 24)
    gens = [torch.Generator().manual_seed(rank) for rank in range(world)]
    for use_b in USES_B:
        for gen in gens:
            model.zero_grad()
            model(torch.randn(8, 16, generator=gen), use_b).square().mean().backward()
            if use_b:
                total += model.b.weight.grad / world
    return total


@pytest.mark.parametrize(("views", "set_to_none"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize(("name", "world"), [("cltk", 2), ("topk", 2), ("powersgd", 2), ("cltk", 5), ("topk", 3),
                                             ("powersgd", 4)])
def test_what_error_feedback_sends_for_an_unused_layer_is_applied_or_kept(name: str, world: int, views: bool,
                                                                          set_to_none: bool) -> None:
    """Error feedback's ledger over steps where ``b`` is unused on every rank: what the optimizer was handed plus the
    ranks' mean memory equals the sum of the mean gradients. With the gradients as bucket views, ``b``'s ``.grad``
    shows what the hook sent; with ``.grad`` at ``None``, DDP leaves it there and nothing is committed. (The fourth
    combination is the limitation in docs/user-guide.md: DDP leaves an old ``.grad`` untouched, and what the hook
    sent for ``b`` is lost.)"""
    results = run_workers(_applied_and_memory, world, name, views, set_to_none)
    ledger = results[0]["applied"] + sum(r["memory"] for r in results) / world
    torch.testing.assert_close(ledger, _averaged_gradients(world), rtol=0, atol=1e-6)
    assert all(torch.equal(results[0]["applied"], r["applied"]) for r in results)
    assert float(sum(r["memory"] for r in results).abs().sum()) > 0  # error feedback held something back


@pytest.mark.parametrize("name", ["cltk", "topk", "randomk", "powersgd", "signsgd", "diana", "qsgd", "terngrad",
                                  "fp16", "none"])
def test_the_fourth_combination_is_warned_about_for_stateful_compressors(name: str) -> None:
    """``gradient_as_bucket_view=False`` with ``find_unused_parameters=True``: a stateful compressor is warned to keep
    ``zero_grad(set_to_none=True)``; a stateless one, and either argument alone, are not."""
    stateful = name not in ("qsgd", "terngrad", "fp16", "none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GradCompStrategy(compressor=name, gradient_as_bucket_view=False, find_unused_parameters=True)
        GradCompStrategy(compressor=name, find_unused_parameters=True)
        GradCompStrategy(compressor=name, gradient_as_bucket_view=False)
    said = [str(w.message) for w in caught if "set_to_none=True" in str(w.message)]
    assert len(said) == int(stateful), said
    if stateful:
        assert "gradient_as_bucket_view=False and find_unused_parameters=True" in said[0]


# ---------------------------------------------------------------------------- several backward passes per step
STEPS = 5
PATTERNS = {  # per optimizer step: "b" a synced backward pass, "n" one under no_sync, "z" zero_grad(set_to_none=True),
    # "s" a step the optimizer skipped (as fp16 AMP's GradScaler does; the strategy then calls drop_unstepped), after
    # which zero_grad(set_to_none=False) leaves zeroed tensors that look kept
    "accumulate": "bbb",  # Lightning's manual-optimization accumulation: every pass synced, one step
    "discard-then-accumulate": "bznb",  # the first pass thrown away; the next two accumulated (one without a sync)
    "accumulate-after-local": "nbb",
    "accumulate-skip-accumulate": "bbsbb",  # two accumulated passes lost to a skipped step, then two kept
}


def _layers_of_several_sizes() -> nn.Module:
    """Parameters of 384, 552, 23 (prime), 161, 7, 7 and 1 entries."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24, bias=False), nn.Tanh(), nn.Linear(24, 23), nn.Tanh(),
                         nn.Linear(23, 7, bias=False), nn.Tanh(), nn.Linear(7, 1))


def _ledger_run(rank: int, world: int, name: str, pattern: str, views: bool, bucket_mb: float,
                node_size: int) -> dict[str, Any]:
    """What the optimizer was handed over 5 steps, compressed from the third (``lr = 0``: the gradients alone), and
    the final memories."""
    model = _layers_of_several_sizes()
    ddp, hook, optimizer = _hooked(model, name, views, node_size, bucket_cap_mb=bucket_mb)
    gen = torch.Generator().manual_seed(rank)
    applied = [torch.zeros_like(p) for p in model.parameters()]
    for _ in range(STEPS):
        optimizer.zero_grad()
        for action in PATTERNS[pattern]:
            if action in "zs":
                if action == "s":
                    hook.drop_unstepped()
                optimizer.zero_grad(set_to_none=action == "z")
                continue
            x = torch.randn(8, 16, generator=gen)
            if action == "n":
                with ddp.no_sync():
                    ddp(x).square().mean().backward()
            else:
                ddp(x).square().mean().backward()
        for total, p in zip(applied, model.parameters()):
            total += p.grad
        optimizer.step()
    memory = hook.memory.state_dict()
    hook.close()
    # the biases are 1-D (sent dense, no memory), in buckets with compressed layers
    return {"applied": applied,
            "memory": [memory[n].reshape(p.shape) if n in memory else torch.zeros_like(p)
                       for n, p in model.named_parameters()],
            "steps": hook.stats.steps}


def _kept_gradients(world: int, pattern: str) -> list[torch.Tensor]:
    """The sum over the steps of the ranks' mean gradients of the passes no ``zero_grad`` threw away."""
    model, gens = _layers_of_several_sizes(), [torch.Generator().manual_seed(rank) for rank in range(world)]
    totals = [torch.zeros_like(p) for p in model.parameters()]
    for _ in range(STEPS):
        for gen in gens:  # each rank's draws, in its own order
            kept: list[list[torch.Tensor]] = []
            for action in PATTERNS[pattern]:
                if action in "zs":
                    kept = []
                    continue
                model.zero_grad()
                model(torch.randn(8, 16, generator=gen)).square().mean().backward()
                kept.append([p.grad.clone() for p in model.parameters()])
            for grads in kept:
                for total, g in zip(totals, grads):
                    total += g / world
    return totals


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize(("name", "world", "views", "bucket_mb", "node_size"),
                         [("cltk", 2, True, 25.0, 0), ("topk", 3, False, 0.001, 0), ("powersgd", 4, True, 0.001, 0),
                          ("topk", 5, True, 25.0, 0), ("cltk", 4, False, 0.001, 2)])
def test_error_feedback_ledger_holds_over_several_backward_passes_per_step(name: str, world: int, views: bool,
                                                                           bucket_mb: float, node_size: int,
                                                                           pattern: str) -> None:
    """Several backward passes before one optimizer step (DDP adds each pass's gradient to the ``.grad`` the last
    left): each synced pass compresses its bucket against the state the previous pass staged, unless a
    ``zero_grad()`` cleared that pass's gradient. What the optimizer was handed plus the ranks' mean memory then
    equals the sum of the mean gradients of the passes kept (the memories of a pass must not be dropped while its
    gradient stays, nor kept once it is cleared). Layers of several sizes, down to one entry; one bucket, or
    a cap of 1-2 KB (two buckets per pass once DDP rebuilds them). With ``node_size`` the hierarchical hook: a
    layer's memory is its owner's in each node, for the node-mean gradient, so the memories are averaged over nodes."""
    results = run_workers(_ledger_run, world, name, pattern, views, bucket_mb, node_size)
    holders = world // node_size if node_size else world  # ranks holding each layer's memory
    for i, target in enumerate(_kept_gradients(world, pattern)):
        ledger = results[0]["applied"][i] + sum(r["memory"][i] for r in results) / holders
        torch.testing.assert_close(ledger, target, rtol=1e-6, atol=2e-6)  # sums reach 9
    assert all(torch.equal(a, b) for r in results for a, b in zip(results[0]["applied"], r["applied"]))
    assert results[0]["steps"] == STEPS  # steps are optimizer steps, not backward passes
    assert float(sum(r["memory"][1] for r in results).abs().sum()) > 0  # error feedback held something back
