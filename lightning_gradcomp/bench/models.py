"""Built-in benchmark workloads (synthetic batches), and loading a user's LightningModule by import path.

A workload is an ``nn.Module`` whose ``forward()`` takes no input and returns the loss of one fixed batch,
so DDP can wrap it directly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor, nn

__all__ = ["BUILTIN_MODELS", "Workload", "load_workload"]


class Workload(nn.Module):
    """``model`` plus a fixed batch; ``forward()`` returns the loss; ``batch_size`` samples per step."""

    def __init__(self, model: nn.Module, loss: Callable[[nn.Module], Tensor], batch_size: int) -> None:
        super().__init__()
        self.model = model
        self._loss = loss
        self.batch_size = batch_size

    def forward(self) -> Tensor:
        return self._loss(self.model)


def _classification(model: nn.Module, x: Tensor, classes: int, gen: torch.Generator) -> Workload:
    y = torch.randint(0, classes, (x.shape[0],), generator=gen)
    return Workload(model, lambda m: nn.functional.cross_entropy(m(x), y), x.shape[0])


def _mlp(width: int = 1024, depth: int = 4, batch_size: int = 64) -> Workload:
    layers: list[nn.Module] = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    gen = torch.Generator().manual_seed(0)
    return _classification(
        nn.Sequential(*layers, nn.Linear(width, 10)), torch.randn(batch_size, 256, generator=gen), 10, gen
    )


def _cnn(channels: int = 64, batch_size: int = 32) -> Workload:
    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    c = channels
    model = nn.Sequential(
        block(3, c),
        block(c, c),
        nn.MaxPool2d(2),
        block(c, 2 * c),
        block(2 * c, 2 * c),
        nn.MaxPool2d(2),
        block(2 * c, 4 * c),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * c, 10),
    )
    gen = torch.Generator().manual_seed(0)
    return _classification(model, torch.randn(batch_size, 3, 32, 32, generator=gen), 10, gen)


class _TinyLM(nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.out(self.encoder(self.embed(tokens)))


def _transformer(
    d_model: int = 256, layers: int = 4, batch_size: int = 16, seq: int = 64, vocab: int = 1000
) -> Workload:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=gen)

    def loss(m: nn.Module) -> Tensor:
        return nn.functional.cross_entropy(m(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    return Workload(_TinyLM(vocab, d_model, layers), loss, batch_size)


BUILTIN_MODELS: dict[str, Callable[..., Workload]] = {
    "mlp": _mlp,
    "mlp-small": partial(_mlp, width=512, depth=3),
    "mlp-large": partial(_mlp, width=2048, depth=4),
    "cnn": _cnn,
    "transformer": _transformer,
}


def check_model(spec: str) -> str:
    """Return ``spec`` if it names a built-in model or has the form ``module.path:ClassName`` (not imported here).

    Raises:
        ValueError: anything else; the message names ``model`` and lists the built-in names.
    """
    module_name, colon, class_name = str(spec).partition(":")
    if spec not in BUILTIN_MODELS and not (colon and module_name and class_name):
        raise ValueError(f"`model` must be one of {', '.join(BUILTIN_MODELS)} or 'module.path:ClassName', got {spec!r}")
    return spec


def load_workload(spec: str, batch_size: Optional[int] = None) -> Workload:
    """A built-in model name, or ``package.module:ClassName`` naming a LightningModule.

    ``batch_size`` (samples per rank and step) overrides a built-in model's default. The LightningModule is
    built without arguments; its first training batch is reused every step and its ``training_step`` gives
    the loss (its batch size is the data loader's).
    """
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
    if spec in BUILTIN_MODELS:
        torch.manual_seed(0)
        return BUILTIN_MODELS[spec](**({} if batch_size is None else {"batch_size": batch_size}))
    check_model(spec)
    if batch_size is not None:
        raise ValueError("`batch_size` applies to built-in models only; a LightningModule uses its own data loader")
    module_name, _, class_name = spec.partition(":")
    torch.manual_seed(0)
    module: Any = getattr(importlib.import_module(module_name), class_name)()
    batch = next(iter(module.train_dataloader()))

    def loss(m: Any) -> Tensor:  # m: the user's LightningModule, with its own training_step signature
        out = m.training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out

    size = len(batch[0]) if isinstance(batch, (list, tuple)) else 0
    return Workload(module, loss, size)
