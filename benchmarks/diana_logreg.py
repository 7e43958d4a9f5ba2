"""Reproduce DIANA's central claim: with full local gradients on heterogeneous data, learned shifts let
quantized gradient descent reach the exact optimum, while the same quantizer without shifts stalls.

Setting: L2-regularised logistic regression, W gloo processes (fork), each rank holding its own data
with a different feature shift and class balance, full local gradients (no sampling noise), plain
gradient descent with a constant step. The gradients go through the library's ``DIANA`` compressor
(its real ``reduce()``, real collectives, byte-counted) exactly as the DDP hook would call it:
fp32 tensors in, the averaged fp32 estimate out. Compared:

* ``DIANA`` (block l-inf quantizer, ``alpha = alpha_p / 2``), default all-to-all aggregation;
* ``DIANA`` with the paper's exact all-gather aggregation;
* the same quantizer with ``alpha = 0`` (no shifts: TernGrad/QSGD-like two-stage quantization);
* dense gradient descent (fp32 all-reduce), for reference.

Metric: relative gradient norm of the full objective, ``||grad f(x_k)|| / ||grad f(x_0)||`` (float64).

Run::

    nice -n 10 python benchmarks/diana_logreg.py            # W=4, 800 steps, writes docs/figures/diana_logreg.png
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_gradcomp.bench.runner import free_port
from lightning_gradcomp.comm import Comm, CommStats, all_reduce_bytes
from lightning_gradcomp.compressors import DIANA
from lightning_gradcomp.compressors.base import ReduceContext
from lightning_gradcomp.plan import LayerSlot

__all__ = ["main"]

METHODS = {
    "DIANA (all-to-all)": {"alpha": None, "aggregation": "alltoall"},
    "DIANA (all-gather, paper)": {"alpha": None, "aggregation": "allgather"},
    "alpha = 0 (no shifts)": {"alpha": 0.0, "aggregation": "alltoall"},
    "dense GD": None,
}


def make_data(rank: int, samples: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s features (shifted mean) and +-1 labels (rank-specific class balance), float64."""
    common = torch.Generator().manual_seed(seed)
    w_true = torch.randn(dim, generator=common, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    shift = 1.5 * torch.randn(dim, generator=gen, dtype=torch.float64) / math.sqrt(dim)
    a = (torch.randn(samples, dim, generator=gen, dtype=torch.float64) / math.sqrt(dim) + shift)
    bias = 1.5 * (rank - 1.5)  # class balance differs per rank
    logits = a @ w_true * 2.0 + bias + 0.5 * torch.randn(samples, generator=gen, dtype=torch.float64)
    return a, torch.where(logits >= 0, 1.0, -1.0).to(torch.float64)


def local_grad(x: torch.Tensor, a: torch.Tensor, y: torch.Tensor, lam: float) -> torch.Tensor:
    """Gradient of ``mean(log(1 + exp(-y a.x))) + lam/2 ||x||^2`` (float64)."""
    margin = y * (a @ x)
    return a.t() @ (-y * torch.sigmoid(-margin)) / a.shape[0] + lam * x


def smoothness(a: torch.Tensor, lam: float) -> float:
    """``L_i = lambda_max(A^T A) / (4 m) + lam`` of one rank's loss."""
    return float(torch.linalg.matrix_norm(a, ord=2) ** 2 / (4 * a.shape[0]) + lam)


def run_method(rank: int, world: int, kwargs: Optional[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Gradient descent with the gradient averaged by DIANA (or densely); returns the metric curve."""
    a, y = make_data(rank, args.samples, args.dim, args.seed)
    lipschitz = torch.tensor([smoothness(a, args.lam)], dtype=torch.float64)
    dist.all_reduce(lipschitz, op=dist.ReduceOp.MAX)  # setup, not part of the algorithm's traffic
    comp = DIANA(f"linf:{args.block}", **kwargs) if kwargs is not None else None
    omega = 1.0 / comp.quantizer.alpha_max - 1.0 if comp is not None else 0.0
    smooth = float(lipschitz)
    gamma = args.gamma / (smooth * (1.0 + 2.0 * omega / world)) if comp is not None else 1.0 / smooth
    comm = Comm(None, CommStats())
    slot = LayerSlot("weight", 0, (1, args.dim), True)
    x = torch.zeros(args.dim, dtype=torch.float64)
    curve, g0 = [], None
    for step in range(args.steps + 1):
        g = local_grad(x, a, y, args.lam)
        full = g.clone()
        dist.all_reduce(full)  # metric only (float64, not counted)
        full /= world
        norm = float(full.norm())
        g0 = norm if g0 is None else g0
        curve.append(norm / g0)
        if step == args.steps:
            break
        if comp is None:
            avg = g.to(torch.float32) / world
            comm.all_reduce(avg)
        else:
            ctx = ReduceContext(comm, step, 0, [slot], [None], seed=args.seed)
            avg = comp.reduce([g.to(torch.float32)], ctx).averaged.wait()[0]
        x -= gamma * avg.to(torch.float64)
    return {"curve": curve, "wire": comm.stats.wire_bytes / args.steps, "gamma": gamma,
            "alpha": comp.alpha if comp is not None else None}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = {name: run_method(rank, world, kwargs, args) for name, kwargs in METHODS.items()}
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def floor_of(curve: list[float]) -> float:
    """Median of the last quarter of a curve: the level where a method stalls."""
    tail = sorted(curve[-max(1, len(curve) // 4):])
    return tail[len(tail) // 2]


def first_below(curve: list[float], level: float) -> Optional[int]:
    """First step whose metric is below ``level`` (``None`` if never)."""
    return next((k for k, v in enumerate(curve) if v < level), None)


def plot(results: dict[str, dict[str, Any]], path: Path, args: argparse.Namespace) -> None:
    """Semilog plot of every method's relative gradient norm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {"dense GD": ":", "alpha = 0 (no shifts)": "-", "DIANA (all-gather, paper)": "--"}
    for name, res in results.items():
        ax.semilogy(res["curve"], styles.get(name, "-"), label=name, linewidth=1.4)
    ax.axhline(1e-6, color="grey", linewidth=0.8)
    ax.set_xlabel("iteration (full local gradients)")
    ax.set_ylabel(r"$\|\nabla f(x_k)\| / \|\nabla f(x_0)\|$")
    ax.set_title(f"L2 logistic regression, W={args.world} heterogeneous ranks, d={args.dim}, "
                 f"l-inf blocks of {args.block}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> int:
    """Run every method on ``--world`` processes, print a table, save the figure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--samples", type=int, default=400, help="samples per rank")
    parser.add_argument("--block", type=int, default=64, help="l-inf quantization block size")
    parser.add_argument("--lam", type=float, default=0.05, help="L2 regularisation")
    parser.add_argument("--gamma", type=float, default=1.0, help="step = gamma / (L (1 + 2 omega / W))")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--figure", type=Path,
                        default=Path(__file__).resolve().parents[1] / "docs/figures/diana_logreg.png")
    args = parser.parse_args(argv)

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = queue.get(timeout=3600)
    for p in procs:
        p.join()

    dense = all_reduce_bytes(4 * args.dim, args.world)
    print(f"W={args.world} d={args.dim} samples/rank={args.samples} block={args.block} lambda={args.lam} "
          f"steps={args.steps}")
    print(f"{'method':28s} {'alpha':>8s} {'final':>9s} {'floor':>9s} {'min':>9s} {'<1e-6 at':>9s} "
          f"{'bytes/step':>10s} {'vs fp32':>7s}")
    for name, res in results.items():
        curve = res["curve"]
        hit = first_below(curve, 1e-6)
        alpha = "-" if res["alpha"] is None else f"{res['alpha']:.4f}"
        print(f"{name:28s} {alpha:>8s} {curve[-1]:9.2e} {floor_of(curve):9.2e} {min(curve):9.2e} "
              f"{hit if hit is not None else 'never':>9} {res['wire']:10.0f} {dense / res['wire']:6.1f}x")
    ratio = floor_of(results["alpha = 0 (no shifts)"]["curve"]) / floor_of(results["DIANA (all-to-all)"]["curve"])
    print(f"floor(alpha = 0) / floor(DIANA all-to-all) = {ratio:.3g}")
    plot(results, args.figure, args)
    print(f"figure: {args.figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
