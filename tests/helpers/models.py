"""Small deterministic Lightning modules and a callback that records what every rank did."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class LayerSizesNet(nn.Module):
    """A linear model on random features with one parameter per entry of ``shapes``, plus ``Conv2d(3, 5, 3)``.

    ``forward(image, features)``: ``features`` has ``sum(numel)`` columns, one block per parameter.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 5, 3)
        self.layers = nn.ParameterDict({name: nn.Parameter(torch.randn(shape) / math.sqrt(math.prod(shape)))
                                        for name, shape in shapes.items()})

    def forward(self, image: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        out = self.conv(image).mean(dim=(1, 2, 3))
        pieces = features.split([p.numel() for p in self.layers.values()], dim=1)
        for weight, piece in zip(self.layers.values(), pieces):
            out = out + piece @ weight.reshape(-1)
        return out


class TinyNet(pl.LightningModule):
    """An MLP with two compressible matrices, a small dense head and biases (regression on fixed data)."""

    def __init__(self, hidden: int = 64, in_features: int = 32, samples: int = 64, batch_size: int = 8,
                 lr: float = 0.05, freeze_first: bool = False, unused_branch: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 4)
        self.unused = nn.Linear(hidden, hidden) if unused_branch else None
        if freeze_first:
            self.body[0].requires_grad_(False)
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(samples, in_features, generator=gen)
        self.y = torch.randn(samples, 4, generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.hparams.batch_size, shuffle=True)


class SparseEmbeddingNet(TinyNet):
    """TinyNet whose input first goes through ``nn.Embedding(sparse=True)`` (sparse gradients). ``poison_step``:
    rank 1's embedding gradient gets a NaN in its first stored value at that global step."""

    def __init__(self, sparse: bool = True, frozen: bool = False, poison_step: Optional[int] = None) -> None:
        super().__init__(in_features=8)
        self.embed = torch.nn.Embedding(16, 8, sparse=sparse)
        self.embed.weight.requires_grad_(not frozen)
        self.x = torch.randint(0, 16, (self.hparams.samples,))
        self.poison_step = poison_step

    def on_train_start(self) -> None:
        if self.poison_step is not None and self.trainer.global_rank == 1:
            self.embed.weight.register_hook(self._poison)

    def _poison(self, grad: torch.Tensor) -> torch.Tensor:
        if self.trainer.global_step != self.poison_step:
            return grad
        grad = grad.coalesce()
        values = grad.values().clone()
        values.view(-1)[0] = float("nan")
        return torch.sparse_coo_tensor(grad.indices(), values, grad.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


class ReadyOrderNet(TinyNet):
    """TinyNet without biases, its layers defined output first: in the order their gradients become ready.

    DDP's first step after a resume uses its initial bucket (parameters in definition order), where the
    uninterrupted run has the rebuilt one (gradient-ready order). From W = 3 on, gloo's ring all-reduce adds
    the ranks' values in an order that depends on the element's position in the buffer, so with TinyNet's
    layout not even plain DDP is resume-exact at W = 3. Here the two layouts coincide.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        del self.body, self.head
        torch.manual_seed(0)
        hidden = self.hparams.hidden
        self.out = nn.Linear(hidden, 4, bias=False)
        self.mid = nn.Linear(hidden, hidden, bias=False)
        self.inp = nn.Linear(self.hparams.in_features, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


class Recorder(pl.Callback):
    """Records flat parameters and the loss after every batch, and comm stats at the end, per rank.

    Files: ``<out>/rank<r>.pt`` with ``params`` (list of flat tensors), ``losses`` and ``stats``.
    """

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.params: list[torch.Tensor] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self.params.append(torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()]))
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stats = getattr(trainer.strategy, "comm_stats", None)
        hook = getattr(trainer.strategy, "hook", None)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({"params": self.params, "losses": self.losses,
                    "stats": stats.state_dict() if stats is not None else None,
                    "hook_step": hook.step if hook is not None else None,
                    "memory": hook.memory.state_dict() if hook is not None else None},
                   self.out / f"rank{trainer.global_rank}.pt")


def fit(strategy: Any, out: Path, *, devices: int = 2, model: Optional[pl.LightningModule] = None,
        max_epochs: int = 1, max_steps: int = -1, callbacks: Optional[list] = None, ckpt_path: Optional[str] = None,
        **trainer_kwargs: Any) -> list[dict[str, Any]]:
    """Fit ``model`` (TinyNet) with ``strategy`` on ``devices`` forked CPU ranks; return each rank's record."""
    out = Path(out)
    options: dict[str, Any] = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                               "enable_model_summary": False, **trainer_kwargs}
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=max_epochs,
                         max_steps=max_steps, callbacks=[Recorder(out), *(callbacks or [])],
                         default_root_dir=str(out), **options)
    trainer.fit(model or TinyNet(), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(devices)]


def assert_replicas_identical(records: list[dict[str, Any]]) -> None:
    """Every rank holds bit-identical parameters after every recorded batch."""
    first = records[0]["params"]
    assert first, "no steps were recorded"
    for rank, rec in enumerate(records[1:], start=1):
        assert len(rec["params"]) == len(first)
        for step, (a, b) in enumerate(zip(first, rec["params"])):
            assert torch.equal(a, b), f"rank {rank} differs from rank 0 after batch {step}"


def assert_resume_matches(straight: list[dict[str, Any]], resumed: list[dict[str, Any]]) -> None:
    """Every rank of a resumed run repeats the uninterrupted one bit for bit: parameters after every resumed batch,
    the final step counter and the error-feedback memories (``torch.equal``)."""
    for rank, (rec, ref) in enumerate(zip(resumed, straight, strict=True)):
        tail = ref["params"][-len(rec["params"]):]
        diverged = [step for step, (a, b) in enumerate(zip(rec["params"], tail)) if not torch.equal(a, b)]
        assert not diverged, f"rank {rank}: parameters differ from resumed step {diverged[0]} on"
        assert rec["hook_step"] == ref["hook_step"]
        mem_a, mem_b = rec["memory"], ref["memory"]
        assert mem_a.keys() == mem_b.keys() and all(torch.equal(mem_a[k], mem_b[k]) for k in mem_a)
