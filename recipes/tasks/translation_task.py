"""Transformer translation: label-smoothed cross-entropy, greedy decoding, exact match and BLEU (torchmetrics)."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.text import SacreBLEUScore

from recipes.data.vocab import EOS, PAD
from recipes.models import create_model
from recipes.tasks.optim import OptimizerName, Schedule, build_optimization

__all__ = ["Translator"]


class Translator(pl.LightningModule):
    """Train a registered encoder-decoder (``transformer_tiny`` / ``transformer_base``).

    Validation decodes greedily and logs ``val/exact`` (fraction of sentences reproduced exactly) and
    ``val/bleu`` (sacreBLEU-compatible corpus BLEU, 13a tokenisation, as a fraction in [0, 1]), plus the
    teacher-forced ``val/loss``.

    Args:
        arch: registered model name.
        src_vocab: source vocabulary size (linked from the data module by the CLI).
        tgt_vocab: target vocabulary size (linked from the data module by the CLI).
        max_len: longest sequence the model handles (linked from the data module by the CLI).
        dropout: dropout probability.
        label_smoothing: cross-entropy label smoothing.
        optimizer: ``adamw``, ``sgd`` or ``rate_adamw`` (:class:`~lightning_gradcomp.RateCorrectedAdamW`).
        lr: peak learning rate.
        momentum: AdamW beta1 / SGD momentum.
        beta2: AdamW beta2.
        weight_decay: weight decay.
        schedule: learning-rate schedule.
        warmup: warm-up fraction (< 1) or steps.
        decode_batches: decode only the first this many validation batches per epoch (``None``: all).
    """

    def __init__(self, arch: str = "transformer_tiny", src_vocab: int = 35, tgt_vocab: int = 36, max_len: int = 64,
                 dropout: float = 0.1, label_smoothing: float = 0.1, optimizer: OptimizerName = "adamw",
                 lr: float = 1e-3, momentum: float = 0.9, beta2: float = 0.98, weight_decay: float = 0.01,
                 schedule: Schedule = "cosine", warmup: float = 0.1, decode_batches: Optional[int] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = create_model(arch, src_vocab=src_vocab, tgt_vocab=tgt_vocab, dropout=dropout, max_len=max_len)
        self.loss = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=label_smoothing)
        self.exact = MeanMetric()
        self.bleu = SacreBLEUScore(tokenize="13a")

    def _loss(self, batch: dict[str, Any]) -> Tensor:
        logits = self.net(batch["src"], batch["tgt_in"])
        return self.loss(logits.reshape(-1, logits.shape[-1]), batch["tgt_out"].reshape(-1))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), sync_dist=True, batch_size=len(batch["ref"]))
        limit = self.hparams.decode_batches
        if limit is not None and batch_idx >= limit:
            return
        hyps = self.translate(batch["src"], max_new_tokens=batch["tgt_out"].shape[1] + 10)
        refs = batch["ref"]
        self.exact.update(torch.tensor([float(" ".join(h.split()) == " ".join(r.split())) for h, r in zip(hyps, refs)]))
        self.bleu.update(hyps, [[r] for r in refs])
        self.log("val/exact", self.exact, prog_bar=True, batch_size=len(refs))
        self.log("val/bleu", self.bleu, batch_size=len(refs))

    def translate(self, src: Tensor, max_new_tokens: int) -> list[str]:
        """Greedy translations of a padded source batch, as text (needs the trainer's data module codec)."""
        codec = self.trainer.datamodule.tgt_codec
        out = self.net.greedy_decode(src, max_new_tokens)
        texts = []
        for row in out.tolist():
            ids = row[: row.index(EOS)] if EOS in row else row
            texts.append(codec.decode(ids))
        return texts

    def configure_optimizers(self) -> Any:
        h = self.hparams
        return build_optimization(self.parameters(), optimizer=h.optimizer, lr=h.lr, weight_decay=h.weight_decay,
                                  momentum=h.momentum, beta2=h.beta2, schedule=h.schedule, warmup=h.warmup,
                                  total_steps=self.trainer.estimated_stepping_batches)
