"""SwarmSGD vs DDP: training wall time to a target test accuracy, W=4 ranks on an emulated slow link.

Same task, model, data, seed and configurations as ``benchmarks/swarm_compare.py`` (DDP, SwarmSGD H=1
and H=4 with 8-bit codes, non-blocking), but every rank runs in its own network namespace whose
outgoing veth is rate-limited with ``tc tbf`` (``lightning_gradcomp.bench.netem.EmulatedLink``;
Linux, root). Each rank is a separate process launched with ``ip netns exec`` (Lightning sees
``LOCAL_RANK`` and spawns nothing; ``num_nodes=4``), gloo binds to the rank's veth, and
``MASTER_ADDR`` is rank 0's address on the bridge. One torch thread per rank.

Measuring without perturbing the run: a callback notes the clock after every optimizer step and
keeps an in-memory copy of the rank's local model every ``--every`` steps (no communication); the
copy time is measured and taken off the clock. After training the parent evaluates the mean of the
four local models (SwarmSGD's model; for DDP, rank 0's model) on the test set every
``--series-every`` steps, at the end, and at the snapshots in between where the target is first
reached. The clock of a snapshot is the slowest rank's clock at that step, counted from the moment
the last rank started training (``on_train_start``: after process-group setup and the start
broadcast), so it is training time only. The final point is taken after ``fit`` applied the last
exchange.

    nice -n 10 python benchmarks/swarm_link.py [--link 100mbit] [--epochs 3] [--target 0.85]

``--link none`` runs the same processes on loopback (no namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl
import torch
from _common import Classifier, load_data  # benchmarks/: the shared Fashion-MNIST task
from swarm_compare import LABELS, WORLD, Straggle, accuracy, make_strategy  # benchmarks/swarm_compare.py

from lightning_gradcomp import SwarmStrategy
from lightning_gradcomp.bench.netem import EmulatedLink, can_emulate, rank_address
from lightning_gradcomp.bench.runner import free_port

__all__ = ["StepClock", "first_reaching", "run_clock"]

CONFIGS = ("ddp", "swarm_h1", "swarm_h4")


# ---------------------------------------------------------------------------------------------- pure
def run_clock(starts: Sequence[float], step_times: Sequence[Sequence[float]]) -> list[float]:
    """Seconds of training at the end of each step, over all ranks.

    Args:
        starts: each rank's clock when it started training (absolute, same clock on every rank).
        step_times: per rank, its clock at the end of each step (absolute, snapshot time removed).

    Returns:
        Per step: the slowest rank's clock minus the last rank's start.
    """
    if not starts or len(starts) != len(step_times):
        raise ValueError(f"`starts` and `step_times` need one entry per rank, got {len(starts)} and "
                         f"{len(step_times)}")
    lengths = {len(t) for t in step_times}
    if len(lengths) != 1:
        raise ValueError(f"every rank must report the same number of steps, got {sorted(lengths)}")
    t0 = max(starts)
    return [max(ts) - t0 for ts in zip(*step_times)]


def first_reaching(score: Callable[[int], float], count: int, stride: int, target: float) -> Optional[int]:
    """Index of the first of ``count`` items whose score reaches ``target``, scoring few items.

    Scores every ``stride``-th item (``stride - 1, 2 * stride - 1, ...`` and the last one); inside the
    first bracket whose end reaches ``target`` it then scores the items in between, in order. The answer
    is exact at full resolution whenever no item before that bracket reaches ``target``.

    Returns:
        The index, or ``None`` if no scored item reaches ``target``.
    """
    if count < 0 or stride < 1:
        raise ValueError(f"`count` must be >= 0 and `stride` >= 1, got {count} and {stride}")
    coarse = sorted(set(range(stride - 1, count, stride)) | ({count - 1} if count else set()))
    previous = -1
    for index in coarse:
        if score(index) >= target:
            return next((i for i in range(previous + 1, index) if score(i) >= target), index)
        previous = index
    return None


# ---------------------------------------------------------------------------------------------- one rank
def _iface_tx_bytes() -> Optional[int]:
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    path = Path(f"/sys/class/net/{iface}/statistics/tx_bytes") if iface else None
    return int(path.read_text()) if path is not None and path.exists() else None


def _copy(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class StepClock(pl.Callback):
    """Clock after every optimizer step, a copy of the local model every ``every`` steps; saved at the end.

    The clock is ``time.perf_counter()`` (CLOCK_MONOTONIC, shared by all processes of the machine) minus
    the time spent copying snapshots so far. Nothing is communicated.
    """

    def __init__(self, every: int, out: Path) -> None:
        self.every, self.out = every, out
        self.start = 0.0
        self.excluded = 0.0
        self.times: list[float] = []
        self.snapshots: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.tx_start: Optional[int] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.tx_start = _iface_tx_bytes()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        self.times.append(now - self.excluded)
        if len(self.times) % self.every == 0:
            self.snapshots.append((len(self.times), _copy(pl_module.net)))
            self.excluded += time.perf_counter() - now

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        end = time.perf_counter() - self.excluded  # the strategy has applied the last exchange by now
        tx_end = _iface_tx_bytes()
        s = trainer.strategy
        torch.save({"start": self.start, "times": self.times, "end": end, "excluded": self.excluded,
                    "snapshots": self.snapshots + [(len(self.times), _copy(pl_module.net))],
                    "wire_bytes": s.comm_stats.wire_bytes,
                    "iface_tx_bytes": None if tx_end is None or self.tx_start is None else tx_end - self.tx_start,
                    "fallback_blocks": s.swarm_stats.fallback_blocks if isinstance(s, SwarmStrategy) else 0},
                   self.out / f"rank{trainer.global_rank}.pt")


def worker(key: str, out: Path, args: argparse.Namespace) -> None:
    """One rank of one configuration (started inside its namespace by :func:`launch`)."""
    torch.set_num_threads(1)
    data = torch.load(out.parent / "data.pt", weights_only=True)  # written once by the parent
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=WORLD,
                         strategy=make_strategy(key, args.seed, start_method="popen"), max_epochs=args.epochs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[StepClock(args.every, out), *([Straggle(args.straggler, args.straggler_sleep)]
                                                                  if args.straggler >= 0 else [])],
                         default_root_dir=str(out))
    trainer.fit(Classifier(data, args.seed, args.lr, args.batch))


# ---------------------------------------------------------------------------------------------- parent
def launch(key: str, link: Optional[EmulatedLink], args: argparse.Namespace, workdir: Path,
           script: Optional[Path] = None) -> list[dict[str, Any]]:
    """Start the W ranks of ``key`` (each in its namespace) as ``python <script> --worker ...`` (default: this
    file), wait, and load what each saved."""
    out = workdir / key
    out.mkdir()
    port = str(free_port())
    procs: list[subprocess.Popen] = []
    with ExitStack() as logs:
        for rank in range(WORLD):
            env = {**os.environ, "LOCAL_RANK": "0", "NODE_RANK": str(rank), "WORLD_SIZE": str(WORLD),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, str(script or Path(__file__).resolve()), "--worker", key, "--worker-out", str(out),
                   "--epochs", str(args.epochs), "--batch", str(args.batch), "--lr", str(args.lr),
                   "--seed", str(args.seed), "--every", str(args.every), "--straggler", str(args.straggler),
                   "--straggler-sleep", str(args.straggler_sleep)]
            if link is not None:
                env.update(MASTER_ADDR=rank_address(0), GLOO_SOCKET_IFNAME=link.interface(rank))
                cmd = ["ip", "netns", "exec", link.namespace(rank), *cmd]
            log = logs.enter_context(open(out / f"rank{rank}.log", "w"))
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        try:
            codes = [p.wait(timeout=args.timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    if any(codes):
        first = next(r for r, c in enumerate(codes) if c)
        tail = (out / f"rank{first}.log").read_text()[-3000:]
        raise RuntimeError(f"{key}: ranks exited with codes {codes}; end of rank {first}'s log:\n{tail}")
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def evaluate(key: str, ranks: list[dict[str, Any]], xte: torch.Tensor, yte: torch.Tensor,
             args: argparse.Namespace) -> dict[str, Any]:
    """Accuracy series, time and step to the target, final accuracy, bytes and clock checks."""
    clock = run_clock([r["start"] for r in ranks], [r["times"] for r in ranks])
    t0 = max(r["start"] for r in ranks)
    snapshots = ranks[0]["snapshots"]  # (step, state) every --every steps, then the final model
    last = len(snapshots) - 1
    acc: dict[int, float] = {}

    def score(i: int) -> float:
        if i not in acc:
            states = [r["snapshots"][i][1] for r in (ranks[:1] if key == "ddp" else ranks)]
            mean = {k: torch.stack([s[k].double() for s in states]).mean(0).to(states[0][k].dtype)
                    for k in states[0]}
            acc[i] = accuracy(mean, xte, yte)
        return acc[i]

    def seconds(i: int) -> float:
        return max(r["end"] for r in ranks) - t0 if i == last else clock[snapshots[i][0] - 1]

    stride = args.series_every // args.every
    hit = first_reaching(score, len(snapshots), stride, args.target)
    for i in list(range(stride - 1, last, stride)) + [last]:  # the rest of the series
        score(i)
    tx = [r["iface_tx_bytes"] for r in ranks]
    return {"series": [{"step": snapshots[i][0], "seconds": seconds(i), "acc": a, "final": i == last}
                       for i, a in sorted(acc.items())],
            "steps": len(clock), "train_seconds": seconds(last), "final_acc": acc[last],
            "time_to_target": None if hit is None else seconds(hit),
            "step_to_target": None if hit is None else snapshots[hit][0],
            "wire_bytes": sum(r["wire_bytes"] for r in ranks) / WORLD,
            "iface_tx_bytes": sum(tx) / WORLD if all(v is not None for v in tx) else None,
            "excluded_seconds": max(r["excluded"] for r in ranks),
            "start_skew_seconds": t0 - min(r["start"] for r in ranks),
            "fallback_blocks": sum(r["fallback_blocks"] for r in ranks)}


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    """Markdown tables: one row per configuration, then the accuracy-vs-clock series."""
    ddp = results.get("ddp")
    print(f"\n| configuration | time to {100 * args.target:g} % (s) | at step | DDP time / this | training time (s) "
          "| ms per step | final acc., mean model | MB sent per rank | interface MB per rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, rec in results.items():
        ttt = rec["time_to_target"]
        ratio = f"{ddp['time_to_target'] / ttt:.2f}" if ddp and ddp["time_to_target"] and ttt else "-"
        iface = "-" if rec["iface_tx_bytes"] is None else f"{rec['iface_tx_bytes'] / 1e6:.1f}"
        print(f"| {LABELS[key]} | {'not reached' if ttt is None else f'{ttt:.1f}'} | {rec['step_to_target'] or '-'} "
              f"| {ratio} | {rec['train_seconds']:.1f} | {1e3 * rec['train_seconds'] / rec['steps']:.0f} | "
              f"{100 * rec['final_acc']:.2f} % | {rec['wire_bytes'] / 1e6:.1f} | {iface} |")
    keys = list(results)
    steps = sorted({p["step"] for rec in results.values() for p in rec["series"] if not p["final"]})
    print("\nTest accuracy of the averaged model (%) @ training clock (s):\n")
    print("| step | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for step in steps + ["end"]:
        cells = []
        for key in keys:
            p = next((p for p in results[key]["series"] if (p["final"] if step == "end" else
                                                           p["step"] == step and not p["final"])), None)
            cells.append("" if p is None else f"{100 * p['acc']:.2f} @ {p['seconds']:.1f}")
        print(f"| {step} | " + " | ".join(cells) + " |")


def task_arguments(parser: argparse.ArgumentParser, configs: Sequence[str], choices: Sequence[str]) -> None:
    """The options of this script (shared with ``localsgd_link.py``, whose ranks take the same worker options)."""
    parser.add_argument("--link", default="100mbit", help="per-rank outgoing rate (tc tbf), or 'none' for loopback")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=32, help="images per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=10, help="snapshot every this many steps")
    parser.add_argument("--series-every", type=int, default=40,
                        help="evaluate every this many steps (a multiple of --every; finer near the target)")
    parser.add_argument("--target", type=float, default=0.85, help="test accuracy to reach (fraction)")
    parser.add_argument("--configs", nargs="+", default=list(configs), choices=list(choices))
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    parser.add_argument("--straggler", type=int, default=-1, help="rank that sleeps --straggler-sleep s per step "
                                                                  "(the sleep is on the step clock)")
    parser.add_argument("--straggler-sleep", type=float, default=0.0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)


def check_parent_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[bool, Any]:
    """Validate the parent's options; returns ``(emulate, (name, *data))`` with the task's data loaded."""
    if args.every < 1 or args.series_every < 1 or args.series_every % args.every or not 0 < args.target <= 1:
        parser.error("--every must be >= 1, --series-every a positive multiple of it, and --target in (0, 1]")
    emulate = args.link.lower() != "none"
    if emulate:
        ok, why = can_emulate()
        if not ok:
            parser.error(f"cannot emulate {args.link}: {why} (use --link none for loopback)")
    return emulate, load_data(args.train_size)


def run_configs(args: argparse.Namespace, data: Sequence[Any], emulate: bool, prefix: str,
                describe: Callable[[str, dict[str, Any]], str], script: Optional[Path] = None) -> dict[str, Any]:
    """Launch, time and evaluate every ``args.configs`` in turn (each on a fresh emulated link when ``emulate``);
    prints ``describe(key, record)`` per config, writes ``args.out`` (JSON) after each, prints the report."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        torch.save(tuple(data), Path(tmp) / "data.pt")
        for key in args.configs:
            begin = time.perf_counter()
            with EmulatedLink(WORLD, args.link) if emulate else nullcontext() as link:
                ranks = launch(key, link, args, Path(tmp), script=script)
            launched = time.perf_counter()
            results[key] = rec = evaluate(key, ranks, data[2], data[3], args)
            rec["wall_seconds"] = {"launch_and_train": launched - begin, "evaluate": time.perf_counter() - launched}
            print(describe(key, rec), flush=True)
            if args.out is not None:
                args.out.write_text(json.dumps(results, indent=1))
    report(results, args)
    return results


def _describe(key: str, rec: dict[str, Any], target: float) -> str:
    ttt = rec["time_to_target"]
    return (f"  {key:10s} {rec['steps']} steps in {rec['train_seconds']:.1f} s, final acc "
            f"{100 * rec['final_acc']:.2f} %, {'not reached' if ttt is None else f'{ttt:.1f} s'} to "
            f"{100 * target:g} %, {rec['wire_bytes'] / 1e6:.1f} MB/rank; snapshot copies "
            f"{1e3 * rec['excluded_seconds']:.0f} ms (excluded), start skew "
            f"{1e3 * rec['start_skew_seconds']:.0f} ms; wall: launch+train "
            f"{rec['wall_seconds']['launch_and_train']:.0f} s, evaluation {rec['wall_seconds']['evaluate']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    task_arguments(parser, CONFIGS, LABELS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.worker_out, args)
        return
    emulate, (name, *data) = check_parent_arguments(parser, args)
    where = f"emulated {args.link} out of each rank (netns + veth + tc tbf)" if emulate else "loopback"
    print(f"{name}; W={WORLD}, one process per rank, {where}, 1 thread each, batch {args.batch}/rank, "
          f"{args.epochs} epoch(s), lr {args.lr}, seed {args.seed}; snapshots every {args.every} steps, "
          f"evaluated every {args.series_every}; target {100 * args.target:g} %", flush=True)
    run_configs(args, data, emulate, "swarm-link-", lambda key, rec: _describe(key, rec, args.target))

if __name__ == "__main__":
    main()
