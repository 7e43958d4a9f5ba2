"""BiLSTM-CTC speech recognition with word and character error rates (torchmetrics)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn
from torchmetrics.text import CharErrorRate, WordErrorRate

from recipes.models import create_model
from recipes.models.acoustic import ctc_greedy
from recipes.tasks.optim import OptimizerName, Schedule, build_optimization

__all__ = ["SpeechRecognizer"]


class SpeechRecognizer(pl.LightningModule):
    """Train a registered CTC acoustic model; validation decodes best-path and logs ``val/wer`` and ``val/cer``.

    For the digit corpus ``val/wer`` is the digit error rate (substitutions + deletions + insertions per digit).

    Args:
        arch: registered model name (``lstm_ctc_small`` / ``lstm_ctc_base``).
        n_feats: features per frame (linked from the data module by the CLI).
        num_classes: CTC classes including blank (linked from the data module by the CLI).
        dropout: dropout probability.
        optimizer: ``adamw``, ``sgd`` or ``rate_adamw`` (:class:`~lightning_gradcomp.RateCorrectedAdamW`).
        lr: peak learning rate.
        momentum: AdamW beta1 / SGD momentum.
        beta2: AdamW beta2.
        weight_decay: weight decay.
        schedule: learning-rate schedule.
        warmup: warm-up fraction (< 1) or steps.
    """

    def __init__(self, arch: str = "lstm_ctc_small", n_feats: int = 40, num_classes: int = 11, dropout: float = 0.1,
                 optimizer: OptimizerName = "adamw", lr: float = 2e-3, momentum: float = 0.9, beta2: float = 0.98,
                 weight_decay: float = 0.01, schedule: Schedule = "onecycle", warmup: float = 0.15) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = create_model(arch, n_feats=n_feats, num_classes=num_classes, dropout=dropout)
        self.ctc = nn.CTCLoss(blank=0, zero_infinity=True)
        self.wer = WordErrorRate()
        self.cer = CharErrorRate()

    def _forward_loss(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
        log_probs, out_lens = self.net(batch["feats"], batch["feat_lens"])
        loss = self.ctc(log_probs.transpose(0, 1), batch["labels"], out_lens, batch["label_lens"])
        return loss, log_probs, out_lens

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, _, _ = self._forward_loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["texts"]))
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        loss, log_probs, out_lens = self._forward_loss(batch)
        n = len(batch["texts"])
        self.log("val/loss", loss, sync_dist=True, batch_size=n)
        units = self.trainer.datamodule.units
        words = self.trainer.datamodule.unit_kind == "words"
        hyps = [(" " if words else "").join(units[i - 1] for i in ids) for ids in ctc_greedy(log_probs, out_lens)]
        hyps = [h.replace("|", " ").strip() for h in hyps]
        refs = [" ".join(t.lower().split()) for t in batch["texts"]]
        self.wer(hyps, refs)
        self.cer(hyps, refs)
        self.log("val/wer", self.wer, prog_bar=True, batch_size=n)
        self.log("val/cer", self.cer, batch_size=n)

    def configure_optimizers(self) -> Any:
        h = self.hparams
        return build_optimization(self.parameters(), optimizer=h.optimizer, lr=h.lr, weight_decay=h.weight_decay,
                                  momentum=h.momentum, beta2=h.beta2, schedule=h.schedule, warmup=h.warmup,
                                  total_steps=self.trainer.estimated_stepping_batches)
