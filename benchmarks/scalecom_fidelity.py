"""ScaleCom (CLTK) fidelity on real data, 2 CPU ranks, plus selection timings.

Part ``bytes`` (W = 2, 3, 4 gloo ranks, no Lightning): bytes one rank sends for one reduction of the CNN's
compressed layers with CLTK and local TopK, as the wire compression ratio against a dense fp32 all-reduce.

Part ``timing`` (one process, one thread): time of exact (``torch.topk``) and approximate (sampled
threshold) index selection, and of the whole leader-side ``CLTK.reduce`` (collectives stubbed out), each
divided by the time of one copy (``clone``) of the same gradients. Sizes: the CNN below, a 25 MB DDP
bucket of ResNet-50-like layers, and one 16M-element layer. Medians over interleaved repetitions.

Part ``fidelity`` (Lightning, ``GradCompStrategy``, fork launcher, W=2): a CNN of 0.51M parameters
(conv 1-32-32, fc 1568-320-10) on Fashion-MNIST (``/usr/share/datasets/fashion-mnist``, Debian
``dataset-fashion-mnist``; a subset of ``--train-size`` training images, the full 10k test set), or on
scikit-learn's digits when Fashion-MNIST is absent. SGD momentum 0.9, cosine learning rate, same seed
and epochs for every configuration:

* ``dense``: DDP's fp32 all-reduce;
* ``cltk``: CLTK ratio 1 %, classic error feedback (``LowPassMemoryFilter(beta=1)`` only measures);
* ``cltk_lowpass``: CLTK ratio 1 % with ``LowPassMemoryFilter(beta=0.1)``;
* ``cltk_hier``: ``cltk`` under ``GradCompStrategy(hierarchy=--per-node)``: dense reduction inside each group
  of ``--per-node`` ranks, CLTK 1 % across groups (run with ``--world-size 4``: 2 "nodes" x 2);
* ``cltk_compact``: the >= 100x configuration: CLTK with approximate selection, fp16 values and delta16
  indices; ratio 0.7 % on fc1 (98 % of the compressed elements) and, per layer, 10 % on conv2 and 20 % on
  the classifier fc2 (tiny layers starve at 1 %; ``--compact-ratio``, ``--compact-conv2-ratio``,
  ``--compact-fc2-ratio``); after ``--warmup-epochs`` (default 1) dense epochs.

Prints final test accuracy, bytes rank 0 sent (whole run, and per compressed step) and the ratio to
dense, the ranks' mean memory cosine at the end, and the hook time per step.

    python benchmarks/scalecom_fidelity.py [--part all|bytes|timing|fidelity] [--epochs 6] [--train-size 20000]
    python benchmarks/scalecom_fidelity.py --part fidelity --world-size 4 --configs cltk cltk_hier   # hierarchy
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import Classifier, load_data, make_cnn  # benchmarks/: the shared Fashion-MNIST task

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.bench.runner import free_port
from lightning_gradcomp.callbacks import LowPassMemoryFilter
from lightning_gradcomp.comm import Comm, CommStats, all_reduce_bytes, completed_future
from lightning_gradcomp.compressors import CLTK, TopK
from lightning_gradcomp.compressors.base import ReduceContext
from lightning_gradcomp.functional.selection import approx_topk_indices, exact_topk_indices
from lightning_gradcomp.plan import LayerSlot

WORLD = 2  # default ranks (--world-size)
BATCH = 64  # per rank
CONV2, FC2 = "net.3.weight", "net.9.weight"  # cltk_compact's per-layer ratios (9216 and 3200 elements)


# ---------------------------------------------------------------------------------------------- timing
class _LocalComm:
    """Stands in for :class:`~lightning_gradcomp.comm.Comm` on a lone leader: collectives are no-ops."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.stats = CommStats()

    def broadcast(self, tensor: torch.Tensor, src: int, **_: Any) -> None:
        pass

    def all_reduce(self, tensor: torch.Tensor, **_: Any) -> Any:
        return completed_future(tensor)


def _median_times(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median seconds of each function, repetitions interleaved so load changes hit all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def part_timing(reps: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    cases = {
        "CNN below (0.51M)": [(32 * 32 * 9,), (320 * 1568,), (10 * 320,)],
        "25 MB bucket (6.5M)": [(512 * 512 * 9,), (2048 * 512,), (2048 * 1000,), (1024 * 1024,)],
        "one 16M layer": [(16 * 2**20,)],
    }
    rows = []
    print(f"\nSelection and leader-side CLTK.reduce time at ratio 1 % / one copy (clone) of the gradients, "
          f"median of {reps}, 1 thread")
    print("| gradients | copy ms | exact topk | approx | CLTK exact reduce | CLTK approx reduce |")
    print("|---|---|---|---|---|---|")
    for label, shapes in cases.items():
        gen = torch.Generator().manual_seed(0)
        grads = [torch.randn(int(np.prod(s)), generator=gen) for s in shapes]
        ks = [max(1, round(0.01 * g.numel())) for g in grads]
        slots = [LayerSlot(f"l{i}", 0, s, True) for i, s in enumerate(shapes)]
        sample_gen = torch.Generator().manual_seed(1)

        def reduce(selection: str) -> Callable[[], Any]:
            comp = CLTK(0.01, selection=selection)  # type: ignore[arg-type]
            ctx = ReduceContext(_LocalComm(), 0, 0, slots, [0.01] * len(slots))  # type: ignore[arg-type]
            return lambda: comp.reduce([g.clone() for g in grads], ctx).averaged.wait()

        t = _median_times({
            "copy": lambda: [g.clone() for g in grads],
            "exact": lambda: [exact_topk_indices(g, k) for g, k in zip(grads, ks)],
            "approx": lambda: [approx_topk_indices(g, k, sample_gen) for g, k in zip(grads, ks)],
            "reduce_exact": reduce("exact"),
            "reduce_approx": reduce("approx"),
        }, reps)
        # reduce() includes its own input copy (clone above): subtract it to get the reduce work alone
        row = {"case": label, "copy_ms": 1e3 * t["copy"], "exact": t["exact"] / t["copy"],
               "approx": t["approx"] / t["copy"], "reduce_exact": (t["reduce_exact"] - t["copy"]) / t["copy"],
               "reduce_approx": (t["reduce_approx"] - t["copy"]) / t["copy"]}
        rows.append(row)
        print(f"| {label} | {row['copy_ms']:.3f} | {row['exact']:.1f}x | {row['approx']:.1f}x | "
              f"{row['reduce_exact']:.1f}x | {row['reduce_approx']:.1f}x |", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------- bytes
def _bytes_worker(rank: int, world: int, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shapes = [(32 * 32 * 9,), (320 * 1568,), (10 * 320,)]  # the CNN's compressed layers
    slots = [LayerSlot(f"l{i}", 0, s, True) for i, s in enumerate(shapes)]
    gen = torch.Generator().manual_seed(rank)
    out = {}
    for name, comp in BYTES_CASES.items():
        comm = Comm()
        ctx = ReduceContext(comm, 0, 0, slots, [comp.default_param] * len(slots))
        comp.reduce([torch.randn(int(np.prod(s)), generator=gen) for s in shapes], ctx).averaged.wait()
        out[name] = comm.stats.wire_bytes
    queue.put((rank, out, sum(int(np.prod(s)) for s in shapes)))
    dist.destroy_process_group()


BYTES_CASES = {"CLTK 1 %, int32 + fp32": CLTK(0.01),
               "CLTK 1 %, delta16 + fp16": CLTK(0.01, value_dtype=torch.float16, index_coding="delta16"),
               "TopK 1 % (all-gather)": TopK(0.01)}


def part_bytes() -> dict[str, dict[int, float]]:
    """Bytes rank 0 sends for one reduction of the CNN's compressed layers, on W = 2, 3, 4 gloo ranks."""
    ratios: dict[str, dict[int, float]] = {name: {} for name in BYTES_CASES}
    ctx = mp.get_context("fork")
    for world in (2, 3, 4):
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_bytes_worker, args=(r, world, port, queue)) for r in range(world)]
        for proc in procs:
            proc.start()
        results = {r: (o, n) for r, o, n in (queue.get(timeout=120) for _ in procs)}
        for proc in procs:
            proc.join()
        sent, n = results[0]
        for name, nbytes in sent.items():
            ratios[name][world] = all_reduce_bytes(4 * n, world) / nbytes
    print("\nWire compression ratio (dense fp32 all-reduce bytes / bytes sent, per rank, compressed layers of the CNN)")
    print("| compressor | W = 2 | W = 3 | W = 4 | W=4 / W=2 |")
    print("|---|---|---|---|---|")
    for name, r in ratios.items():
        print(f"| {name} | {r[2]:.1f}x | {r[3]:.1f}x | {r[4]:.1f}x | {r[4] / r[2]:.2f} |")
    return ratios


class LayerRatios(pl.Callback):
    """Set per-layer CLTK ratios at the start of fit (same values on every rank)."""

    def __init__(self, ratios: dict[str, float]) -> None:
        self.ratios = ratios

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.set_layer_params(self.ratios)


class Probe(pl.Callback):
    """Snapshots bytes when compression starts; rank 0 writes accuracy and figures to JSON at the end."""

    def __init__(self, out: Path, start_step: int) -> None:
        self.out, self.start_step = out, start_step
        self.at_start: Optional[tuple[float, float, int]] = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        stats = trainer.strategy.comm_stats
        if self.at_start is None and stats.steps >= self.start_step:
            self.at_start = (stats.wire_bytes, stats.dense_bytes, stats.steps)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Classifier) -> None:
        if trainer.global_rank != 0:
            return
        stats = trainer.strategy.comm_stats
        wire0, dense0, steps0 = self.at_start or (0.0, 0.0, 0)
        lowpass = [cb for cb in trainer.callbacks if isinstance(cb, LowPassMemoryFilter)]
        result = {
            "accuracy": pl_module.test_accuracy(),
            "wire_bytes": stats.wire_bytes, "dense_bytes": stats.dense_bytes, "steps": stats.steps,
            "phase_wire": stats.wire_bytes - wire0, "phase_dense": stats.dense_bytes - dense0,
            "phase_steps": stats.steps - steps0, "hook_seconds": stats.hook_seconds,
            "similarity": lowpass[0].last_similarity if lowpass else None,
        }
        self.out.write_text(json.dumps(result))


def run_fit(compressor: Optional[CLTK], callbacks: list[pl.Callback], start_step: int, data: tuple, args: Any,
            workdir: Path, hierarchy: Optional[int] = None) -> dict[str, Any]:
    """One ``args.world_size``-rank fit; returns rank 0's probe record plus the wall time."""
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    out = workdir / f"probe_{time.monotonic_ns()}.json"
    strategy = GradCompStrategy(compressor=compressor, start_step=start_step, seed=args.seed, start_method="fork",
                                hierarchy=hierarchy)
    trainer = pl.Trainer(accelerator="cpu", devices=args.world_size, strategy=strategy, max_epochs=args.epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Probe(out, start_step), *callbacks], default_root_dir=str(workdir))
    start = time.perf_counter()
    trainer.fit(Classifier(data, args.seed, args.lr))
    record = json.loads(out.read_text())
    record["seconds"] = time.perf_counter() - start
    return record


def part_fidelity(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    name, *data = load_data(args.train_size)
    steps_per_epoch = -(-len(data[1]) // (BATCH * args.world_size))
    warmup = max(2, args.warmup_epochs * steps_per_epoch)
    params = sum(p.numel() for p in make_cnn(0).parameters())
    print(f"\nFidelity: {name}, CNN {params:,} parameters, W={args.world_size}, batch {BATCH}/rank, {args.epochs} epochs "
          f"({steps_per_epoch} steps each), seed {args.seed}, lr {args.lr}")

    small = {CONV2: args.compact_conv2_ratio, FC2: args.compact_fc2_ratio}
    compact_label = (f"CLTK {100 * args.compact_ratio:g} % (conv2 {100 * args.compact_conv2_ratio:g} %, fc2 "
                     f"{100 * args.compact_fc2_ratio:g} %), approx, fp16 values, delta16 indices, "
                     f"beta = {args.compact_beta:g}"
                     f"{f', {args.warmup_epochs} dense warm-up epoch' if args.warmup_epochs else ''}")

    def measure(beta: float) -> LowPassMemoryFilter:
        return LowPassMemoryFilter(beta=beta, similarity_every_n_steps=25, sketch_size=None)

    configs: dict[str, tuple[Optional[CLTK], Callable[[], list], int, str]] = {
        "dense": (None, list, 2, "DDP fp32 all-reduce"),
        "cltk": (CLTK(0.01), lambda: [measure(1.0)], 2, "CLTK 1 %, beta = 1 (classic EF)"),
        "cltk_hier": (CLTK(0.01), list, 2, f"CLTK 1 %, beta = 1, hierarchy = {args.per_node} (nodes of "
                                            f"{args.per_node} ranks: dense inside, CLTK across)"),
        "cltk_lowpass": (CLTK(0.01), lambda: [measure(0.1)], 2, "CLTK 1 %, LowPassMemoryFilter beta = 0.1"),
        "cltk_compact": (CLTK(args.compact_ratio, selection="approx", value_dtype=torch.float16,
                              index_coding="delta16"), lambda: [measure(args.compact_beta), LayerRatios(small)],
                         warmup, compact_label),
    }
    results: dict[str, Any] = {}
    for key in args.configs:
        comp, callbacks, start, label = configs[key]
        rec = run_fit(comp, callbacks(), start, tuple(data), args, workdir,
                      hierarchy=args.per_node if key == "cltk_hier" else None)
        rec["label"] = label
        results[key] = rec
        print(f"  {key:13s} acc {rec['accuracy']:.4f}  wire {rec['wire_bytes'] / 1e6:8.2f} MB  "
              f"({rec['seconds']:.0f} s)", flush=True)

    dense = results.get("dense")
    print("\n| configuration | test accuracy | vs dense (pt) | MB sent by rank 0 | ratio, whole run "
          "| bytes per compressed step | ratio, compressed steps | memory cosine (end) | hook ms/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, rec in results.items():
        delta = f"{100 * (rec['accuracy'] - dense['accuracy']):+.2f}" if dense else "-"
        per_step = rec["phase_wire"] / max(rec["phase_steps"], 1)
        ratio_phase = rec["phase_dense"] / rec["phase_wire"] if rec["phase_wire"] else float("nan")
        sim = "-" if rec["similarity"] is None else f"{rec['similarity']:.3f}"
        print(f"| {rec['label']} | {100 * rec['accuracy']:.2f} % | {delta} | {rec['wire_bytes'] / 1e6:.2f} | "
              f"{rec['dense_bytes'] / rec['wire_bytes']:.1f}x | {per_step / 1e3:.1f} kB | {ratio_phase:.1f}x | "
              f"{sim} | {1e3 * rec['hook_seconds'] / rec['steps']:.2f} |")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["all", "bytes", "timing", "fidelity"], default="all")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--train-size", type=int, default=20000)
    parser.add_argument("--warmup-epochs", type=int, default=1, choices=[0, 1],
                        help="dense epochs before cltk_compact compresses (at most one)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--compact-ratio", type=float, default=0.007, help="cltk_compact's ratio for fc1")
    parser.add_argument("--compact-beta", type=float, default=1.0, help="cltk_compact's low-pass beta")
    parser.add_argument("--compact-conv2-ratio", type=float, default=0.1, help="cltk_compact's ratio for conv2")
    parser.add_argument("--compact-fc2-ratio", type=float, default=0.2, help="cltk_compact's ratio for fc2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--configs", nargs="+", default=["dense", "cltk", "cltk_lowpass", "cltk_compact"],
                        choices=["dense", "cltk", "cltk_hier", "cltk_lowpass", "cltk_compact"])
    parser.add_argument("--world-size", type=int, default=WORLD, help="ranks of the fidelity fits")
    parser.add_argument("--per-node", type=int, default=2, help="cltk_hier's node size (divides --world-size)")
    parser.add_argument("--out", type=Path, default=None, help="write all results as JSON here")
    args = parser.parse_args()
    if args.world_size < 2 or args.per_node < 1 or args.world_size % args.per_node:
        parser.error(f"need --world-size >= 2 and --per-node >= 1 dividing it, got {args.world_size} and "
                     f"{args.per_node}")
    results: dict[str, Any] = {}
    if args.part in ("all", "bytes"):
        results["bytes"] = part_bytes()
    if args.part in ("all", "timing"):
        results["timing"] = part_timing(args.reps)
    if args.part in ("all", "fidelity"):
        with tempfile.TemporaryDirectory() as tmp:
            results["fidelity"] = part_fidelity(args, Path(tmp))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
