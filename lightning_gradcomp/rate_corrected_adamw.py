"""AdamW for sparsified gradients with error feedback: the second moment corrected by each coordinate's arrival rate.

With top-k / CLT-k and error feedback, a coordinate's averaged gradient is zero on most steps and arrives, every
``P = 1 / rate`` steps, as the sum ``S`` of the gradients it missed. Plain Adam normalises these bursts by the root
of their own second moment ``v ~ rate * S**2``, so a coordinate whose gradient is consistent moves about
``sqrt(P)`` learning rates per period instead of the ``P`` that the dense gradient earns it (10.6x less at
``P = 100``: ``tests/test_rate_corrected_adamw.py``). Scaling ``v`` by the coordinate's arrival rate ``f`` (an
exponential average of ``grad != 0`` with Adam's ``beta2``) gives ``v * f ~ (rate * S) ** 2``, the dense gradient's
square, so such a coordinate again travels as far as under dense AdamW:

    m <- beta1 m + (1 - beta1) g          v <- beta2 v + (1 - beta2) g**2          f <- beta2 f + (1 - beta2) [g != 0]
    p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat f_hat) + eps)      (hats: Adam's bias corrections; f_hat is 1 when
                                                                   every step arrives, so dense gradients give AdamW)

``beta2`` must average over several arrival periods. The correction is exact for consistent coordinates and
over-steps noise-dominated ones (by up to ``sqrt(P)``). Measured on the language horizon task (docs/recipes.md,
"ScaleCom on the horizon tasks"): +2 points at 5 % density with ``beta2 = 0.98``, nothing at 1 %.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.checks import check_number

__all__ = ["RateCorrectedAdamW"]


class RateCorrectedAdamW(torch.optim.Optimizer):
    """AdamW whose second moment is scaled by each coordinate's arrival rate (for sparsified gradients).

    On dense gradients it takes AdamW's steps (up to rounding). Per parameter it keeps three tensors of the
    parameter's shape: ``exp_avg``, ``exp_avg_sq`` and ``arrival`` (the rate).

    Args:
        params: parameters or parameter groups.
        lr: learning rate, > 0.
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: decoupled weight decay, >= 0.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        check_number("lr", lr, 0.0, math.inf)
        check_number("betas[0]", betas[0], 0.0, 1.0, low_open=False, high_open=True)
        check_number("betas[1]", betas[1], 0.0, 1.0, low_open=False, high_open=True)
        check_number("eps", eps, 0.0, math.inf, low_open=False)
        check_number("weight_decay", weight_decay, 0.0, math.inf, low_open=False)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One update of every parameter with a gradient (sparse gradients are refused)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("RateCorrectedAdamW does not take sparse (torch.sparse) gradients")
            _update(self, params, group)
        return loss


def _state(opt: RateCorrectedAdamW, p: Tensor) -> dict[str, Any]:
    state = opt.state[p]
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["arrival"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _update(opt: RateCorrectedAdamW, params: list[Tensor], group: dict[str, Any]) -> None:
    """The group's step, one fused (``_foreach``) op per stage over all its tensors; no host syncs."""
    beta1, beta2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    states = [_state(opt, p) for p in params]
    for state in states:
        state["step"] += 1
    grads = [p.grad for p in params if p.grad is not None]
    m = [s["exp_avg"] for s in states]
    v = [s["exp_avg_sq"] for s in states]
    f = [s["arrival"] for s in states]
    if wd:
        torch._foreach_mul_(params, 1.0 - lr * wd)
    torch._foreach_lerp_(m, grads, 1.0 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1.0 - beta2)
    torch._foreach_mul_(f, beta2)
    torch._foreach_add_(f, [g.ne(0).to(g.dtype) for g in grads], alpha=1.0 - beta2)
    denoms = torch._foreach_mul(v, f)
    torch._foreach_sqrt_(denoms)
    steps = {s["step"] for s in states}
    if len(steps) == 1:  # the usual case: one fused op per stage
        t = steps.pop()
        torch._foreach_div_(denoms, 1.0 - beta2**t)
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(params, m, denoms, value=-lr / (1.0 - beta1**t))
        return
    for p, state, m_p, d_p in zip(params, states, m, denoms):  # a tensor that missed steps keeps its own count
        t = state["step"]
        p.addcdiv_(m_p, d_p.div_(1.0 - beta2**t).add_(eps), value=-lr / (1.0 - beta1**t))
