"""ResNet image classification with top-1 / top-5 accuracy (torchmetrics)."""

from __future__ import annotations

from typing import Any, Literal, Optional

import lightning.pytorch as pl
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from recipes.models import create_model
from recipes.tasks.optim import OptimizerName, Schedule, build_optimization

__all__ = ["ImageClassifier"]


class ImageClassifier(pl.LightningModule):
    """Train a registered ResNet (``resnet8/20/18/50``) with cross-entropy; logs ``val/acc1``, ``val/acc5``.

    Args:
        arch: registered model name (see :func:`recipes.models.list_models`).
        num_classes: classifier outputs (linked from the data module by the CLI).
        in_channels: image channels (linked from the data module by the CLI).
        stem: ``"imagenet"`` or ``"small"`` (``None``: the architecture's default).
        optimizer: ``sgd``, ``adamw`` or ``rate_adamw`` (:class:`~lightning_gradcomp.RateCorrectedAdamW`).
        lr: peak learning rate.
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
        schedule: learning-rate schedule (see :func:`recipes.tasks.optim.build_optimization`).
        warmup: warm-up fraction (< 1) or steps.
        label_smoothing: cross-entropy label smoothing.
    """

    def __init__(self, arch: str = "resnet8", num_classes: int = 10, in_channels: int = 1,
                 stem: Optional[Literal["imagenet", "small"]] = None, optimizer: OptimizerName = "sgd",
                 lr: float = 0.2, momentum: float = 0.9, weight_decay: float = 5e-4, schedule: Schedule = "onecycle",
                 warmup: float = 0.25, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        kwargs: dict[str, Any] = {"num_classes": num_classes, "in_channels": in_channels}
        if stem is not None:
            kwargs["stem"] = stem
        self.net = create_model(arch, **kwargs)
        self.loss = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.acc5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val/loss", self.loss(logits, y), sync_dist=True)
        self.acc1(logits, y)
        self.acc5(logits, y)
        self.log("val/acc1", self.acc1, prog_bar=True)
        self.log("val/acc5", self.acc5)

    def configure_optimizers(self) -> Any:
        h = self.hparams
        return build_optimization(self.parameters(), optimizer=h.optimizer, lr=h.lr, weight_decay=h.weight_decay,
                                  momentum=h.momentum, schedule=h.schedule, warmup=h.warmup,
                                  total_steps=self.trainer.estimated_stepping_batches)

