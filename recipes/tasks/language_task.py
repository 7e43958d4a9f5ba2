"""Causal language modelling: cross-entropy per token, held-out token accuracy, perplexity and bits per byte."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric

from recipes.models import create_model
from recipes.tasks.optim import OptimizerName, Schedule, build_optimization

__all__ = ["LanguageModel"]


class LanguageModel(pl.LightningModule):
    """Train a registered causal LM (``lm_small`` / ``lm_base``) on (input, next-token target) windows.

    Validation logs ``val/loss`` (mean cross-entropy in nats per token over every held-out token), ``val/ppl``
    (its exponential), ``val/bpt`` (bits per token: bits per byte for the byte vocabulary) and ``val/acc``
    (next-token accuracy).

    Args:
        arch: registered model name.
        vocab: vocabulary size (linked from the data module by the CLI).
        context: tokens per window (linked from the data module by the CLI).
        dropout: dropout probability.
        optimizer: ``adamw``, ``sgd`` or ``rate_adamw`` (:class:`~lightning_gradcomp.RateCorrectedAdamW`).
        lr: peak learning rate.
        momentum: AdamW beta1 / SGD momentum.
        beta2: AdamW beta2.
        weight_decay: weight decay.
        schedule: learning-rate schedule.
        warmup: warm-up fraction (< 1) or steps.
    """

    def __init__(self, arch: str = "lm_small", vocab: int = 260, context: int = 128, dropout: float = 0.1,
                 optimizer: OptimizerName = "adamw", lr: float = 2e-3, momentum: float = 0.9, beta2: float = 0.98,
                 weight_decay: float = 0.01, schedule: Schedule = "cosine", warmup: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = create_model(arch, vocab=vocab, dropout=dropout, max_len=context)
        self.val_nll = MeanMetric()
        self.val_acc = MeanMetric()

    def _logits_loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch
        logits = self.net(x)
        return logits, nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        _, loss = self._logits_loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits, loss = self._logits_loss(batch)
        y = batch[1]
        self.val_nll.update(loss, weight=y.numel())
        self.val_acc.update((logits.argmax(-1) == y).float().mean(), weight=y.numel())

    def on_validation_epoch_end(self) -> None:
        nll, acc = self.val_nll.compute(), self.val_acc.compute()
        self.val_nll.reset()
        self.val_acc.reset()
        # already reduced over ranks by the metrics; sync_dist averages the identical values (and keeps Lightning quiet)
        self.log_dict({"val/loss": nll, "val/ppl": torch.exp(nll), "val/bpt": nll / math.log(2), "val/acc": acc},
                      sync_dist=True)

    def configure_optimizers(self) -> Any:
        h = self.hparams
        return build_optimization(self.parameters(), optimizer=h.optimizer, lr=h.lr, weight_decay=h.weight_decay,
                                  momentum=h.momentum, beta2=h.beta2, schedule=h.schedule, warmup=h.warmup,
                                  total_steps=self.trainer.estimated_stepping_batches)
