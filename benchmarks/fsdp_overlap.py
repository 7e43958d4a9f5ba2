"""The FSDP2 replica reduction with and without overlap (issue 48): step time of the same training, three ways.

4 gloo CPU processes as 2 replicas x 2 shards (loopback, no emulated link), an MLP of ``--depth`` ``Linear`` layers of
``--width`` (each ``fully_shard``-ed, and the root), SGD, ``FSDPReplicaReduction`` with ``--compressor`` across the
replicas, in round-robin blocks of ``--steps`` steps:

* ``inline``: the old behaviour, the pipeline run in the hook on the autograd thread (non-finite decision read there);
* ``wait``: the hook hands the reduction to the communication thread and waits for it (the modes FSDP2 copies in);
* ``overlap``: the hook returns at once, the reductions are waited for at the end of backward (the default where the
  sharded ``.grad`` views the hook's buffer: fp32 here).

Prints the median step time (slowest rank) of each and the ratios to ``inline``. On a machine with few cores the
communication thread competes with backward for them, so the figure is noisy and says little about GPUs:

    python benchmarks/fsdp_overlap.py [--width 512] [--depth 6] [--compressor topk] [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_gradcomp.comm import Comm
from lightning_gradcomp.compressors import registry
from lightning_gradcomp.fsdp_reduction import FSDPReplicaReduction, replicate_group
from lightning_gradcomp.gloo_workers import run_workers
from lightning_gradcomp.plan import SlotPolicy

MODES = ("inline", "wait", "overlap")


def _inline(engine: FSDPReplicaReduction) -> None:
    """Make ``engine``'s hook run the pipeline on the autograd thread, as before issue 48."""

    def reduce(output: torch.Tensor, plan: Any, params: Any, *, group: Any = None, defer: bool = False) -> None:
        transaction = engine.transaction
        if not transaction.in_backward:
            transaction.begin_backward()
            torch.autograd.Variable._execution_engine.queue_callback(engine.finish_backward)
        compresses = engine.step >= engine.start_step and not engine.compressor.dense
        transaction.compressed(compresses)
        engine._reduce(output, plan, engine.step, compresses and bool(plan.compressed), group).wait()

    engine.reduce = reduce  # type: ignore[method-assign]


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    group = replicate_group(2)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            torch.manual_seed(0)
            model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(args.depth)))
            for layer in model:
                fully_shard(layer, mesh=mesh["shard"])
            fully_shard(model, mesh=mesh["shard"])
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            names = {id(p): n for n, p in model.named_parameters()}
            engine = FSDPReplicaReduction(
                registry.create(args.compressor), Comm(group), names, start_step=0, policy=SlotPolicy()
            )
            engine.install(model)
            engine.attach_optimizer(optimizer)
            if mode == "inline":
                _inline(engine)
            elif mode == "wait":
                hook = engine.reduce
                engine.reduce = lambda *a, _hook=hook, **k: _hook(*a, **{**k, "defer": False})  # type: ignore[method-assign]
            x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
            for step in range(args.warmup + args.steps):
                dist.barrier()
                start = time.perf_counter()
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step >= args.warmup:
                    times[mode].append(float(elapsed))
            engine.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--compressor", default="topk")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times = run_workers(_worker, 4, args, timeout=600.0)[0]
    base = statistics.median(times["inline"])
    for mode in MODES:
        median = statistics.median(times[mode])
        print(f"{mode:8s} median step {1000 * median:8.2f} ms   inline / {mode}: {base / median:.3f}")


if __name__ == "__main__":
    main()
