"""Optimizer + per-step learning-rate schedule shared by the recipe modules."""

from __future__ import annotations

import math
from typing import Any, Iterable, Literal

import torch
from torch import nn

from lightning_gradcomp.rate_corrected_adamw import RateCorrectedAdamW

__all__ = ["Schedule", "OptimizerName", "build_optimization"]

OptimizerName = Literal["sgd", "adamw", "rate_adamw"]
Schedule = Literal["onecycle", "cosine", "constant"]


def _lr_factor(schedule: str, step: int, total: int, warmup: int) -> float:
    if schedule == "constant":
        return min(1.0, (step + 1) / warmup) if warmup else 1.0
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimization(params: Iterable[nn.Parameter], *, optimizer: OptimizerName, lr: float, weight_decay: float,
                       momentum: float, schedule: Schedule, warmup: float, total_steps: int,
                       beta2: float = 0.98) -> dict[str, Any]:
    """Return Lightning's ``configure_optimizers`` dict with a per-step scheduler.

    Args:
        params: parameters to optimise.
        optimizer: ``sgd`` (Nesterov momentum), ``adamw`` or ``rate_adamw``
            (:class:`~lightning_gradcomp.RateCorrectedAdamW`: AdamW for sparsified gradients with error feedback).
        lr: peak learning rate.
        weight_decay: decoupled (AdamW) or L2 (SGD) weight decay.
        momentum: SGD momentum, or AdamW's beta1.
        beta2: AdamW's beta2 (0.98 by default; 0.999 suits ``rate_adamw`` at 1 % density).
        schedule: ``onecycle`` (torch's OneCycleLR), ``cosine`` (linear warm-up then cosine to 0) or
            ``constant`` (linear warm-up then flat).
        warmup: warm-up length as a fraction of ``total_steps`` when < 1, else in steps.
        total_steps: optimizer steps of the whole run.
    """
    if optimizer not in ("sgd", "adamw", "rate_adamw"):
        raise ValueError(f"`optimizer` must be 'sgd', 'adamw' or 'rate_adamw', got {optimizer!r}")
    if not 0 <= beta2 < 1:
        raise ValueError(f"`beta2` must be in [0, 1), got {beta2}")
    if schedule not in ("onecycle", "cosine", "constant"):
        raise ValueError(f"`schedule` must be 'onecycle', 'cosine' or 'constant', got {schedule!r}")
    if lr <= 0 or weight_decay < 0 or warmup < 0:
        raise ValueError(f"`lr` must be > 0, `weight_decay` and `warmup` >= 0, got {lr}, {weight_decay}, {warmup}")
    params = [p for p in params if p.requires_grad]
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0,
                                                     weight_decay=weight_decay)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, betas=(momentum, beta2), weight_decay=weight_decay)
    else:
        opt = RateCorrectedAdamW(params, lr=lr, betas=(momentum, beta2), weight_decay=weight_decay)
    total = max(1, int(total_steps))
    warm = int(warmup * total) if warmup < 1 else int(warmup)
    if schedule == "onecycle":
        sched: Any = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total + 1,
                                                         pct_start=max(warmup, 1e-3) if warmup < 1 else warm / total)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(schedule, s, total, warm))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
