"""The two passes an error-feedback sparsifier cannot skip, timed against the bench's references on the same gradients.

TopK and the exact CLT-k leader start every compressed step with two passes over the compressed slots that no
encoding, gathering or decoding can remove:

* **compensation**, ``p = m + g`` (the engine's kernel: reads ``g`` and ``m``, writes a new ``p``, zeroes ``g``, where
  the averaged result goes, and checks ``g`` for NaN/Inf on the way);
* **selection**, the exact top-``k`` of ``|p|`` per layer (the compiled radix selection), each slot's right after its
  compensation, as the engine's early pass runs them.

This script times both, slot by slot, on one backward pass's gradients of a bench model (the slots the strategy's
default policy compresses, as slices of one flat buffer like a DDP bucket), next to the bench's own references
(:func:`lightning_gradcomp.bench.worker.reference_times`: one fp32 copy into a buffer allocated once, one
``rand_like``), all in one process with one thread, in alternating rounds, and prints the medians and the ratios to
the copy. The issue's target for the sparsifiers' whole work is 3x the copy::

    python benchmarks/sparsifier_floor.py --model transformer --rounds 40
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.bench.models import load_workload
from lightning_gradcomp.bench.worker import reference_times
from lightning_gradcomp.functional.feedback import compensate_checked
from lightning_gradcomp.functional.selection import exact_topk_indices, prepare_native
from lightning_gradcomp.functional.sparsify import kept_count


def compressed_slots(model: str, seed: int = 0) -> list[Tensor]:
    """One backward pass's gradients of ``model`` that the strategy's default policy compresses, as slices of one flat
    fp32 buffer (a DDP bucket's layout)."""
    torch.manual_seed(seed)
    workload = load_workload(model)
    workload().backward()
    policy = GradCompStrategy(compressor="topk").policy
    grads = [
        p.grad.detach().reshape(-1).float()
        for p in workload.parameters()
        if p.grad is not None and policy.wants(p.shape)
    ]
    flat = torch.cat(grads)
    return list(flat.split([g.numel() for g in grads]))


def floor_round(grads: list[Tensor], saved: list[Tensor], memories: list[Tensor], ratio: float) -> dict[str, float]:
    """Seconds of one step's compensation and selection over every slot (each slot's selection right after its
    compensation); the memories become the new ``p`` (their values only steer the selection's candidates)."""
    for g, s in zip(grads, saved):
        g.copy_(s)  # the compensation zeroed it last round
    compensation = selection = 0.0
    for i, g in enumerate(grads):
        start = time.perf_counter()
        p, _ = compensate_checked(memories[i], g, clear=True)
        middle = time.perf_counter()
        exact_topk_indices(p, kept_count(p.numel(), ratio))
        end = time.perf_counter()
        compensation += middle - start
        selection += end - middle
        memories[i] = p
    return {"compensation": compensation, "selection": selection}


def measure(model: str, rounds: int, ratio: float, seed: int = 0) -> dict[str, Any]:
    """Medians over ``rounds`` alternating rounds of the references and of the two passes, in seconds."""
    grads = compressed_slots(model, seed)
    saved = [g.clone() for g in grads]
    gen = torch.Generator().manual_seed(seed + 1)
    memories = [torch.randn(g.shape, generator=gen) * g.std() for g in grads]  # a memory of the gradient's scale
    prepare_native()
    samples: dict[str, list[float]] = {"clone": [], "rand_like": [], "compensation": [], "selection": []}
    floor_round(grads, saved, memories, ratio)  # warm-up: kernels loaded, allocator primed
    for _ in range(rounds):
        refs = reference_times(saved, repeats=1)
        samples["clone"].append(refs["clone"])
        samples["rand_like"].append(refs["rand_like"])
        for name, seconds in floor_round(grads, saved, memories, ratio).items():
            samples[name].append(seconds)
    both = [c + s for c, s in zip(samples["compensation"], samples["selection"])]
    out = {name: statistics.median(values) for name, values in samples.items()}
    out["both"] = statistics.median(both)
    out["slots"], out["numel"] = len(grads), sum(g.numel() for g in grads)
    return out


def report(model: str, ratio: float, result: dict[str, Any]) -> str:
    """A Markdown table of the medians (ms) and their ratios to the copy."""
    clone = result["clone"]
    lines = [
        f"*{model}: {result['slots']} compressed slots, {result['numel']:,} entries; top-{ratio:g} per layer; "
        f"one thread*",
        "",
        "| pass | ms (median) | / clone |",
        "|---|---|---|",
    ]
    for name in ("clone", "rand_like", "compensation", "selection", "both"):
        label = "compensation + selection" if name == "both" else name
        lines.append(f"| {label} | {result[name] * 1e3:.2f} | {result[name] / clone:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer", help="a bench model (transformer, cnn, ...)")
    parser.add_argument("--rounds", type=int, default=40, help="alternating rounds timed")
    parser.add_argument("--ratio", type=float, default=0.01, help="fraction of each layer kept")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each bench rank
    print(report(args.model, args.ratio, measure(args.model, args.rounds, args.ratio, args.seed)))


if __name__ == "__main__":
    main()
