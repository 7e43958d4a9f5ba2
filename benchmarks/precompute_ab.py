"""Within-process A/B of ``Compressor.precompute``: the engine's early pass on and off in alternating pairs of steps.

The same W = 2 processes (loopback gloo) train one bench configuration; every other pair of steps the compressor's
``precompute`` is switched off for the compensation (so ``reduce`` does that work itself, as before the early
pass). Prints, per rank, the median step time and the median compression work per step (the communication
thread's time less its blocking waits, as the bench's "work ms") of each side:

    python benchmarks/precompute_ab.py gradcomp_topk --steps 30

Both sides run on the same gradients, caches and machine state, so differences of a few percent of the work show
that a step-time A/B between two bench runs cannot (docs/benchmarks.md, "Engine speed, this version").
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from lightning_gradcomp import hook as engine
from lightning_gradcomp.bench.configs import install
from lightning_gradcomp.bench.models import load_workload
from lightning_gradcomp.gloo_workers import run_workers

WARMUP = 6


def _run(rank: int, world: int, config: str, steps: int, model: str) -> dict[bool, tuple[float, float]]:
    installed = install(config, load_workload(model), None)
    optimizer = torch.optim.SGD(installed.ddp.parameters(), lr=0.01)
    installed.begin(optimizer)
    early = {"on": True}
    compensate = engine.GradCompHook._compensate

    def switched(hook: Any, *args: Any) -> Any:
        if early["on"]:
            return compensate(hook, *args)
        hook.compressor.precompute = lambda index, tensor, ctx: None  # this pass only: reduce does the work
        try:
            return compensate(hook, *args)
        finally:
            del hook.compressor.precompute

    engine.GradCompHook._compensate = switched  # type: ignore[method-assign]
    times: dict[bool, list[float]] = {True: [], False: []}
    works: dict[bool, list[float]] = {True: [], False: []}
    for i in range(WARMUP + 2 * steps):
        early["on"] = (i // 2) % 2 == 0
        torch.distributed.barrier()
        work = installed.thread_seconds() - installed.wait_seconds()
        start = time.perf_counter()
        installed.ddp().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        installed.end_step()
        if i >= WARMUP:
            times[early["on"]].append(time.perf_counter() - start)
            works[early["on"]].append(installed.thread_seconds() - installed.wait_seconds() - work)
    installed.hook.close()
    return {on: (statistics.median(times[on]), statistics.median(works[on])) for on in (True, False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a bench configuration with error feedback (gradcomp_topk, scalecom, ...)")
    parser.add_argument("--steps", type=int, default=30, help="measured steps on each side")
    parser.add_argument("--model", default="transformer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = run_workers(_run, 2, args.config, args.steps, args.model, timeout=1800.0)
    for rank, result in enumerate(results):
        (on_step, on_work), (off_step, off_work) = result[True], result[False]
        print(
            f"{args.config} rank{rank}: early ON step {on_step * 1e3:.1f} ms work {on_work * 1e3:.2f} ms | "
            f"OFF step {off_step * 1e3:.1f} ms work {off_work * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
