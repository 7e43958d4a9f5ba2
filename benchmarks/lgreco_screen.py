"""Will L-GreCo pay on this model? The planned saving per family from one dense process, in seconds.

Trains a task of ``benchmarks/lgreco_compare.py`` densely in one process (no Lightning, no process group) and,
every ``--every`` steps, fills :class:`~lightning_gradcomp.callbacks.LGreCo`'s tables from the raw gradients of the
last 10 steps (one rank's half of each batch, as a 2-rank run would see them), solves at the uniform setting's
error (``alpha = 1``) and prints the planned saving of each family (PowerSGD rank 4, TopK 1 %, QSGD 4 bits, with
the comparison's candidate grids). It sees no accuracy and no error feedback; in the Lightning runs of
``lgreco_compare.py`` the planned savings came out lower (e.g. ``lm``: 1.42x here at step 300, 1.15x over a run),
so use it to rank models, then measure the ones that look promising.

    python benchmarks/lgreco_screen.py lm_untied [--steps 400] [--every 100] [--detail]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from lgreco_compare import ACCUMULATE, FAMILIES, build_task, make_optimizer  # benchmarks/lgreco_compare.py
from torch import Tensor, nn

from lightning_gradcomp.callbacks.lgreco import LGreCo, layer_table
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.functional.layerwise import solve_or_uniform
from lightning_gradcomp.plan import LayerSlot


def planned_saving(compressor: Compressor, grid_args: dict[str, Any], stats: dict[str, Tensor],
                   shapes: dict[str, tuple[int, ...]]) -> tuple[float, dict[str, Any]]:
    """``(uniform bytes / chosen bytes, {layer: chosen value})`` for the layers ``compressor`` accepts.

    The same candidate grids, tables, budget (``alpha = 1``) and solver as :meth:`LGreCo.adjust`, without the
    cross-rank averaging.
    """
    planner = LGreCo(**grid_args)
    names = [n for n in stats if compressor.accepts(LayerSlot(n, 0, shapes[n], True))]
    grids = [planner.grid(compressor, shapes[n]) for n in names]
    tables = [layer_table(compressor, stats[n], shapes[n], g) for n, g in zip(names, grids)]
    sizes, errors = [t[0] for t in tables], [t[1] for t in tables]
    uniform = [g.index(compressor.default_param) for g in grids]
    budget = sum(e[c] for e, c in zip(errors, uniform))  # the uniform setting fits it, so the call never raises
    picks, _ = solve_or_uniform(sizes, errors, uniform, budget)
    uniform_bytes = sum(s[c] for s, c in zip(sizes, uniform))
    chosen_bytes = sum(s[c] for s, c in zip(sizes, picks))
    return uniform_bytes / chosen_bytes, {n: g[c] for n, g, c in zip(names, grids, picks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=("resnet", "cnn", "lm", "lm_untied", "mlp"))
    parser.add_argument("--steps", type=int, default=400, help="dense training steps")
    parser.add_argument("--every", type=int, default=100, help="steps between two plans (> 10)")
    parser.add_argument("--detail", action="store_true", help="also print every layer's chosen value")
    parser.add_argument("--train-size", type=int, default=20000, help="Fashion-MNIST training images")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.every <= ACCUMULATE:
        parser.error(f"--every must exceed the {ACCUMULATE}-step statistics window")
    args.epochs = None
    torch.set_num_threads(1)
    task = build_task(args.task, args)
    net = task.make_net(args.seed)
    opt = make_optimizer(task, net.parameters())
    xtr, ytr = task.data[:2]
    shapes = {n: tuple(p.shape) for n, p in net.named_parameters() if p.dim() > 1 and p.numel() >= task.min_numel}
    families = {k: v for k, v in FAMILIES.items() if k != "powersgd8"}
    print(f"{task.name}: {sum(p.numel() for p in net.parameters()):,} parameters, {len(shapes)} compressible "
          f"matrices, batch {task.batch} x 2, {task.optimizer} lr {task.lr}", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    sums: dict[str, Tensor] = {}
    start = time.perf_counter()

    def loss_of(x: Tensor, y: Tensor) -> Tensor:
        logits = net(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(ytr), (2 * task.batch,), generator=gen)
        first, second = idx[:task.batch], idx[task.batch:]
        opt.zero_grad()
        loss = loss_of(xtr[first], ytr[first])
        loss.backward()
        if args.every - step % args.every < ACCUMULATE or step % args.every == 0:  # the last 10 steps of a period
            for name, p in net.named_parameters():
                if name in shapes:
                    sums[name] = sums[name] + p.grad if name in sums else p.grad.detach().clone()
        loss_of(xtr[second], ytr[second]).backward()  # the other rank's half: gradients of the full batch
        opt.step()
        if step % args.every == 0:
            line = [f"step {step}: loss {float(loss.detach()):.3f}"]
            for key, (label, make, grid_args) in families.items():
                saving, choice = planned_saving(make(), grid_args, sums, shapes)
                line.append(f"{label} {saving:.2f}x")
                if args.detail:
                    print(f"  {label}: " + ", ".join(f"{n} {v:.3g}" for n, v in choice.items()))
            print(" | ".join(line) + f" ({time.perf_counter() - start:.0f} s)", flush=True)
            sums = {}


if __name__ == "__main__":
    main()
