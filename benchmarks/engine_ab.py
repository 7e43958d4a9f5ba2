"""Within-process A/B of one engine change, switched on and off in alternating pairs of steps.

The same W = 2 processes (loopback gloo) train one bench configuration; every other pair of steps the change is
switched off. Prints, per rank, the median step time and the median compression work per step (the communication
thread's time less its blocking waits, as the bench's "work ms") and of those waits, of each side. Switches:

* ``precompute``: the engine's early pass (``Compressor.precompute`` right after each slot's compensation); off,
  ``reduce`` does that work itself, as before the early pass::

      python benchmarks/engine_ab.py gradcomp_topk --steps 30

* ``sign-residual``: SignSGD's residual ``p - c`` written by its quantize pass; off, in a second pass from the codes::

      python benchmarks/engine_ab.py signsgd --switch sign-residual --steps 30

* ``sparse-outputs``: a sparsifier's output slots zeroed in the compensation pass (``Compressor.sparse_outputs``, now
  under ``nonfinite="dense"`` too, the bench's policy); off, each slot zeroed by the compressor in ``reduce``::

      python benchmarks/engine_ab.py gradcomp_topk --switch sparse-outputs --steps 30

Both sides run on the same gradients, caches and machine state (and give the same bits), so differences of a few
percent of the work show that a step-time A/B between two bench runs cannot (docs/benchmarks-history.md, "Engine
speed, this version").
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_gradcomp import hook as engine
from lightning_gradcomp.bench.configs import install
from lightning_gradcomp.bench.models import load_workload
from lightning_gradcomp.compressors.signsgd import SignSGD
from lightning_gradcomp.compressors.sparse import SparseCompressor
from lightning_gradcomp.gloo_workers import run_workers

WARMUP = 6


def _precompute_switch() -> Callable[[bool], None]:
    compensate = engine.GradCompHook._compensate
    state = {"on": True}

    def switched(hook: Any, *args: Any) -> Any:
        if state["on"]:
            return compensate(hook, *args)
        hook.compressor.precompute = lambda index, tensor, ctx: None  # this pass only: reduce does the work
        try:
            return compensate(hook, *args)
        finally:
            del hook.compressor.precompute

    engine.GradCompHook._compensate = switched  # type: ignore[method-assign]
    return lambda on: state.update(on=on)


def _sign_residual_switch() -> Callable[[bool], None]:
    fused_quantize, fused_after = SignSGD._quantize, SignSGD._after_encode

    def quantize_only(self: SignSGD, index: int, x: Any, codec: Any, ctx: Any, shift: Any) -> Any:
        return fused_quantize(self, index, x, codec, dataclasses.replace(ctx, observed=True), shift)

    def second_pass(self: SignSGD, tensors: Any, decoded: Any, ctx: Any) -> Any:
        return fused_after(self, tensors, decoded, dataclasses.replace(ctx, observed=True))

    def set_on(on: bool) -> None:  # off: SignSGD's own path for observed steps
        SignSGD._quantize = fused_quantize if on else quantize_only  # type: ignore[method-assign]
        SignSGD._after_encode = fused_after if on else second_pass  # type: ignore[method-assign]

    return set_on


def _sparse_outputs_switch() -> Callable[[bool], None]:
    def set_on(on: bool) -> None:  # off: the compressor zeroes its output slots itself (ctx.output)
        SparseCompressor.capabilities = dataclasses.replace(SparseCompressor.capabilities, sparse_outputs=on)

    return set_on


SWITCHES: dict[str, Callable[[], Callable[[bool], None]]] = {
    "precompute": _precompute_switch,
    "sign-residual": _sign_residual_switch,
    "sparse-outputs": _sparse_outputs_switch,
}


def _run(rank: int, world: int, config: str, switch: str, steps: int, model: str) -> dict[bool, tuple[float, ...]]:
    installed = install(config, load_workload(model), None)
    optimizer = torch.optim.SGD(installed.ddp.parameters(), lr=0.01)
    installed.begin(optimizer)
    set_on = SWITCHES[switch]()
    times: dict[bool, list[float]] = {True: [], False: []}
    works: dict[bool, list[float]] = {True: [], False: []}
    waits: dict[bool, list[float]] = {True: [], False: []}
    for i in range(WARMUP + 2 * steps):
        on = (i // 2) % 2 == 0
        set_on(on)
        torch.distributed.barrier()
        work, wait = installed.thread_seconds() - installed.wait_seconds(), installed.wait_seconds()
        start = time.perf_counter()
        installed.ddp().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        installed.end_step()
        if i >= WARMUP:
            times[on].append(time.perf_counter() - start)
            works[on].append(installed.thread_seconds() - installed.wait_seconds() - work)
            waits[on].append(installed.wait_seconds() - wait)
    installed.hook.close()
    return {on: tuple(statistics.median(x[on]) for x in (times, works, waits)) for on in (True, False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a bench configuration (gradcomp_topk, scalecom, signsgd, ...)")
    parser.add_argument("--switch", choices=sorted(SWITCHES), default="precompute", help="the change switched")
    parser.add_argument("--steps", type=int, default=30, help="measured steps on each side")
    parser.add_argument("--model", default="transformer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = run_workers(_run, 2, args.config, args.switch, args.steps, args.model, timeout=1800.0)
    for rank, result in enumerate(results):
        sides = [f"{name} step {t * 1e3:.1f} ms work {w * 1e3:.2f} ms wait {b * 1e3:.2f} ms"
                 for name, (t, w, b) in (("ON", result[True]), ("OFF", result[False]))]  # fmt: skip
        print(f"{args.config} rank{rank}: {args.switch} " + " | ".join(sides))


if __name__ == "__main__":
    main()
