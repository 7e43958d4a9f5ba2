"""Top-k with error feedback written from the textbook, without this library: is the language task's slowdown the
method or this code? (issue 49)

One process trains the language recipe's model (``lm_small``) on its data (the Ding sentences, windows of 128 bytes)
with the recipe's optimizer, schedule and clipping, on a batch of 2 x 16 windows, either dense or with per-tensor
top-k of the error-compensated gradient (``p = m + g``; keep the ``density`` largest ``|p|``; ``m = p - kept``),
one worker (no averaging: the method alone, no collectives, no library code on the gradient path). Prints the
held-out next-byte accuracy every ``--every`` steps.

    python benchmarks/ef_topk_reference.py --steps 1000 --density 1.0     # dense
    python benchmarks/ef_topk_reference.py --steps 1000 --density 0.01    # top-k 1 % + error feedback
    python benchmarks/ef_topk_reference.py --steps 1000 --density 0.01 --optimizer sgd --lr 0.3
    python benchmarks/ef_topk_reference.py --steps 1000 --density 0.01 --second-moment local  # v: dense gradient
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Optional

import _common  # noqa: F401 - benchmarks/_common.py puts the repository root (the recipes package) on sys.path
import torch
from torch import Tensor, nn

from recipes.data.language_data import LanguageDataModule
from recipes.models.registry import create_model
from recipes.tasks.optim import build_optimization


def topk_with_error_feedback(grad: Tensor, memory: Tensor, density: float, scale: Optional[Tensor] = None) -> Tensor:
    """The kept part of ``memory + grad`` (its ``ceil(density * n)`` largest magnitudes, each multiplied by ``scale``
    when given); ``memory`` keeps the rest."""
    p = memory.add_(grad)
    k = max(1, math.ceil(density * p.numel()))
    flat = p.view(-1)
    score = flat.abs() if scale is None else flat.abs() * scale.view(-1)
    idx = score.topk(k, sorted=False).indices
    kept = torch.zeros_like(flat)
    kept[idx] = flat[idx]
    flat[idx] = 0.0
    return kept.view_as(grad)


class LocalSecondMomentAdamW(torch.optim.AdamW):
    """AdamW with ``m`` from ``.grad`` (the compressed gradient) and ``v`` from ``self.local[param]`` (the local dense
    gradient before compression, set before each step)."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.local: dict[torch.Tensor, Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["t"] += 1
                st["m"].lerp_(p.grad, 1 - b1)
                st["v"].mul_(b2).addcmul_(self.local[p], self.local[p], value=1 - b2)
                denom = (st["v"] / (1 - b2 ** st["t"])).sqrt_().add_(eps)
                p.mul_(1 - lr * wd).addcdiv_(st["m"], denom, value=-lr / (1 - b1 ** st["t"]))


@torch.no_grad()
def accuracy(model: nn.Module, loader) -> float:
    model.eval()
    hits = total = 0
    for x, y in loader:
        hits += int((model(x).argmax(-1) == y).sum())
        total += y.numel()
    model.train()
    return hits / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--density", type=float, default=0.01, help="1.0: dense")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=int, default=250)
    ap.add_argument("--batch", type=int, default=32, help="windows per step (the recipe's 2 ranks x 16)")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "rate_adamw"])
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--second-moment", default="compressed", choices=["compressed", "local"],
                    help="AdamW's v from the compressed gradient (the optimizer as is) or from the dense local gradient"
                         " before compression (the worker has it for free)")
    ap.add_argument("--select", default="magnitude", choices=["magnitude", "normalized", "preconditioned"],
                    help="keep the largest |p| (top-k), the largest |p| / sqrt(v) (normalized) or |p| / v ** 0.25 "
                         "(preconditioned: top-k of the gradient in the coordinates where AdamW with a fixed v is "
                         "SGD), v an EMA of the dense gradient's square")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    data = LanguageDataModule(source="ding", context=128, val_every=50, batch_size=args.batch)
    data.setup("fit")
    model = create_model("lm_small", vocab=data.vocab_size, dropout=0.1, max_len=128)
    opt_cfg = build_optimization(model.parameters(), optimizer=args.optimizer, lr=args.lr, weight_decay=0.01,
                                 momentum=0.9, schedule="cosine", warmup=0.05, total_steps=args.steps)
    opt, sched = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    if args.second_moment == "local":  # the same schedule on the variant (LambdaLR reads the optimizer's groups)
        opt = LocalSecondMomentAdamW(model.parameters(), lr=args.lr, betas=opt.defaults["betas"], weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, sched.lr_lambdas[0])
    memories = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    second = {n: torch.zeros_like(p) for n, p in model.named_parameters()}  # EMA of the dense g**2 (beta 0.98)
    gen = torch.Generator().manual_seed(args.seed)
    train = torch.utils.data.DataLoader(data.train_dataloader().dataset, batch_size=args.batch, shuffle=True,
                                        generator=gen, drop_last=True)
    val = data.val_dataloader()
    step, start, curve = 0, time.perf_counter(), []
    while step < args.steps:
        for x, y in train:
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=False)
            loss.backward()
            if args.second_moment == "local":
                opt.local = {p: p.grad.detach().clone() for p in model.parameters()}
            if args.select != "magnitude":
                for n, p in model.named_parameters():
                    second[n].mul_(0.98).addcmul_(p.grad, p.grad, value=0.02)
            if args.density < 1.0:
                for n, p in model.named_parameters():
                    power = {"magnitude": 0.0, "normalized": 0.5, "preconditioned": 0.25}[args.select]
                    scale = second[n].pow(power).add_(1e-8).reciprocal_() if power else None
                    p.grad.copy_(topk_with_error_feedback(p.grad, memories[n], args.density, scale))
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % args.every == 0 or step == args.steps:
                acc = accuracy(model, val)
                curve.append((step, acc))
                print(f"step {step} val/acc {acc:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
            if step >= args.steps:
                break
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "curve": curve}, f)


if __name__ == "__main__":
    main()
