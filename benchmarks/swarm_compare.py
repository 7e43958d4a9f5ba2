"""SwarmSGD vs DDP at equal samples processed, W=4 CPU ranks, on the ScaleCom fidelity task.

Task (imported from ``benchmarks/scalecom_fidelity.py`` so both checks train the same thing): the
0.51M-parameter CNN on Fashion-MNIST (``/usr/share/datasets/fashion-mnist``, Debian
``dataset-fashion-mnist``; the first ``--train-size`` training images, the full 10k test set), or
scikit-learn's digits when Fashion-MNIST is absent. SGD momentum 0.9, weight decay 5e-4, per-step
cosine learning rate, ``--batch`` images per rank per step (default 32, i.e. the same global batch of
128 as the W=2 ScaleCom check), same seed and epochs for every configuration, so every configuration
processes the same samples:

* ``ddp``: ``GradCompStrategy`` without compression (DDP's fp32 gradient all-reduce every step);
* ``swarm_h1``: ``SwarmStrategy(local_steps=1, bits=8)``, non-blocking, complete graph;
* ``swarm_h4``: ``SwarmStrategy(local_steps=4, bits=8)``, non-blocking, complete graph;
* optional extras: ``swarm_h1_blocking``, ``swarm_h4_blocking``, ``swarm_h4_fp32`` (``bits=None``) and
  ``swarm_h1_4bit``.

Every rank's final model is written to disk (``average_at_end=False``); the parent evaluates the
mean of the four models (what ``SwarmStrategy`` evaluates and, with ``average_at_end``, returns) and
rank 0's own model on the test set. Bytes are what each rank sent (``comm_stats.wire_bytes``; for
SwarmSGD gossip only, start broadcast excluded), averaged over ranks.

    python benchmarks/swarm_compare.py [--epochs 3] [--train-size 20000] [--configs ddp swarm_h1 swarm_h4]

Configurations ``swarm_*`` use the asynchronous mode (the default); ``*_lockstep`` the lock-step rounds.
``--straggler R`` makes rank R sleep ``--straggler-sleep`` seconds per step (a slow worker).

Straggler throughput (``--straggler-bench``): W=4 ranks, sleep-dominated steps (a tiny MLP plus
``--bench-sleep`` seconds of sleep per step, rank 3 sleeping ``--slowdown`` times as long), so the measure
is not CPU-bound on a small machine. Reports, per mode (async SwarmSGD, lock-step SwarmSGD, DDP), the
steps every rank completed within ``--window`` seconds of the common start, with and without the
straggler, and each fast rank's ratio:

    nice -n 10 python benchmarks/swarm_compare.py --straggler-bench
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _common import Classifier, load_data, make_cnn  # benchmarks/: the shared Fashion-MNIST task
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import GradCompStrategy, SwarmStrategy
from lightning_gradcomp.bench.runner import free_port

WORLD = 4


class SaveRank(pl.Callback):
    """Every rank writes its final parameters and communication figures (after the last exchange)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        s = trainer.strategy
        swarm = s.swarm_stats.state_dict() if isinstance(s, SwarmStrategy) else None
        torch.save({"state": {k: v.detach().clone() for k, v in pl_module.net.state_dict().items()},
                    "wire_bytes": s.comm_stats.wire_bytes, "dense_bytes": s.comm_stats.dense_bytes,
                    "steps": s.comm_stats.steps, "swarm": swarm},
                   self.out / f"rank{trainer.global_rank}.pt")


def accuracy(state: dict[str, torch.Tensor], xte: torch.Tensor, yte: torch.Tensor) -> float:
    net = make_cnn(0)
    net.load_state_dict(state)
    net.eval()
    with torch.no_grad():
        hits = sum(int((net(x).argmax(1) == y).sum()) for x, y in zip(xte.split(1000), yte.split(1000)))
    return hits / len(yte)


def params_of(state: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() for v in state.values() if v.is_floating_point())


def make_strategy(key: str, seed: int, start_method: str = "fork") -> pl.strategies.Strategy:
    if key == "ddp":
        return GradCompStrategy(compressor=None, seed=seed, start_method=start_method)
    local_steps = 4 if "h4" in key else 1
    lockstep = "lockstep" in key or "blocking" in key
    return SwarmStrategy(local_steps=local_steps, bits=None if "fp32" in key else 4 if "4bit" in key else 8,
                         non_blocking="blocking" not in key, average_at_end=False, seed=seed,
                         mode="lockstep" if lockstep else "async",
                         rounding="dithered" if "dither" in key else "nearest", start_method=start_method)


class Straggle(pl.Callback):
    """Rank ``rank`` sleeps ``seconds`` after every step; every rank notes its step clock."""

    def __init__(self, rank: int, seconds: float, base: float = 0.0, out: Path | None = None) -> None:
        self.rank, self.seconds, self.base, self.out = rank, seconds, base, out
        self.start, self.times = 0.0, []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.monotonic()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        time.sleep(self.base + (self.seconds if trainer.global_rank == self.rank else 0.0))
        self.times.append(time.monotonic())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.out is not None:
            torch.save({"start": self.start, "times": self.times}, self.out / f"clock{trainer.global_rank}.pt")


def run(key: str, data: tuple[torch.Tensor, ...], args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    out = workdir / key
    out.mkdir()
    callbacks: list[pl.Callback] = [SaveRank(out)]
    if args.straggler >= 0:
        callbacks.append(Straggle(args.straggler, args.straggler_sleep))
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=make_strategy(key, args.seed),
                         max_epochs=args.epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, default_root_dir=str(workdir))
    start = time.perf_counter()
    trainer.fit(Classifier(data, args.seed, args.lr, args.batch))
    seconds = time.perf_counter() - start
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    mean = {k: torch.stack([r["state"][k].double() for r in ranks]).mean(0).to(ranks[0]["state"][k].dtype)
            for k in ranks[0]["state"]}
    flat = torch.stack([torch.cat([r["state"][k].reshape(-1).double() for k in mean]) for r in ranks])
    rec: dict[str, Any] = {
        "acc_mean": accuracy(mean, data[2], data[3]), "acc_rank0": accuracy(ranks[0]["state"], data[2], data[3]),
        "wire_bytes": sum(r["wire_bytes"] for r in ranks) / WORLD, "dense_bytes": ranks[0]["dense_bytes"],
        "steps": ranks[0]["steps"], "seconds": seconds,
        "consensus": float((flat - flat.mean(0)).norm(dim=1).max()), "model_norm": float(flat.mean(0).norm()),
    }
    if ranks[0]["swarm"] is not None:
        rec["exchanges"] = sum(r["swarm"]["exchanges"] for r in ranks) / WORLD
        rec["fallbacks"] = sum(r["swarm"]["fallbacks"] for r in ranks)
        rec["fallback_blocks"] = sum(r["swarm"]["fallback_blocks"] for r in ranks)
        rec["blocks"] = -(-params_of(ranks[0]["state"]) // 1024)
        rec["rounds"] = ranks[0]["swarm"]["rounds"]
    return rec


LABELS = {
    "ddp": "DDP (fp32 gradient all-reduce every step)",
    "swarm_h1": "SwarmSGD H=1, 8-bit, async",
    "swarm_h4": "SwarmSGD H=4, 8-bit, async",
    "swarm_h1_dither": "SwarmSGD H=1, 8-bit dithered, async",
    "swarm_h1_lockstep": "SwarmSGD H=1, 8-bit, lock-step non-blocking",
    "swarm_h4_lockstep": "SwarmSGD H=4, 8-bit, lock-step non-blocking",
    "swarm_h1_blocking": "SwarmSGD H=1, 8-bit, blocking",
    "swarm_h4_blocking": "SwarmSGD H=4, 8-bit, blocking",
    "swarm_h4_fp32": "SwarmSGD H=4, fp32 models, non-blocking",
    "swarm_h1_4bit": "SwarmSGD H=1, 4-bit, non-blocking",
}


class _SleepNet(pl.LightningModule):
    """A tiny MLP on random data: the step is dominated by the callback's sleep."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
        gen = torch.Generator().manual_seed(1)
        self.data = TensorDataset(torch.randn(4096, 32, generator=gen), torch.randn(4096, 4, generator=gen))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)


def straggler_bench(args: argparse.Namespace) -> None:
    """Steps per rank within a fixed window, with and without a 3x slower rank, per mode."""
    modes = {"async": "swarm_h1", "lockstep": "swarm_h1_lockstep", "ddp": "ddp"}
    print(f"W={WORLD}, step = tiny MLP + {1e3 * args.bench_sleep:.0f} ms sleep; straggler rank 3 sleeps "
          f"{args.slowdown}x; steps completed within {args.window:.1f} s of the common start", flush=True)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, key in modes.items():
            for slow in (False, True):
                os.environ["MASTER_PORT"] = str(free_port())
                os.environ["MASTER_ADDR"] = "127.0.0.1"
                out = Path(tmp) / f"{name}_{slow}"
                out.mkdir()
                extra = (args.slowdown - 1) * args.bench_sleep if slow else 0.0
                trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=make_strategy(key, args.seed),
                                     max_epochs=-1, max_steps=args.bench_steps, logger=False,
                                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                     callbacks=[Straggle(3, extra, args.bench_sleep, out)],
                                     default_root_dir=str(out))
                trainer.fit(_SleepNet())
                clocks = [torch.load(out / f"clock{r}.pt", weights_only=True) for r in range(WORLD)]
                t0 = max(c["start"] for c in clocks)
                rows[(name, slow)] = [sum(t - t0 <= args.window for t in c["times"]) for c in clocks]
                print(f"  {name:8s} straggler={slow!s:5s} steps per rank in {args.window:.1f} s: "
                      f"{rows[(name, slow)]}", flush=True)
    print("\n| mode | steps per rank, no straggler | steps per rank, rank 3 slowed "
          f"{args.slowdown:g}x | fast ranks with / without straggler |")
    print("|---|---|---|---|")
    for name in modes:
        base, slow = rows[(name, False)], rows[(name, True)]
        ratios = ", ".join(f"{100 * s / b:.0f} %" for s, b in zip(slow[:3], base[:3]))
        print(f"| {name} | {base} | {slow} | {ratios} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=32, help="images per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", nargs="+", default=["ddp", "swarm_h1", "swarm_h4"], choices=list(LABELS))
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--straggler", type=int, default=-1, help="rank that sleeps --straggler-sleep s per step")
    parser.add_argument("--straggler-sleep", type=float, default=0.0)
    parser.add_argument("--straggler-bench", action="store_true", help="run the straggler throughput benchmark")
    parser.add_argument("--bench-sleep", type=float, default=0.05, help="seconds of sleep per step (benchmark)")
    parser.add_argument("--slowdown", type=float, default=3.0, help="straggler's sleep multiplier (benchmark)")
    parser.add_argument("--bench-steps", type=int, default=60, help="steps per rank (benchmark)")
    parser.add_argument("--window", type=float, default=2.5, help="seconds counted (benchmark)")
    args = parser.parse_args()
    if args.straggler_bench:
        straggler_bench(args)
        return
    name, *data = load_data(args.train_size)
    params = sum(p.numel() for p in make_cnn(0).parameters())
    print(f"{name}; CNN {params:,} parameters; W={WORLD}, batch {args.batch}/rank, {args.epochs} epochs, "
          f"lr {args.lr}, seed {args.seed}", flush=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.configs:
            results[key] = rec = run(key, tuple(data), args, Path(tmp))
            print(f"  {key:18s} mean-model acc {rec['acc_mean']:.4f}  rank-0 acc {rec['acc_rank0']:.4f}  "
                  f"{rec['wire_bytes'] / 1e6:7.2f} MB/rank  {rec['seconds']:.0f} s", flush=True)
    ddp = results.get("ddp")
    print("\n| configuration | test acc., mean model | vs DDP (pt) | test acc., rank-0 model | MB sent per rank "
          "| vs DDP | exchanges per rank | bytes per exchange | blocks resent in fp32 "
          "| max_i ‖x_i − x̄‖ at end | fit time / DDP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key, rec in results.items():
        delta = f"{100 * (rec['acc_mean'] - ddp['acc_mean']):+.2f}" if ddp else "-"
        ratio = f"{ddp['wire_bytes'] / rec['wire_bytes']:.1f}x less" if ddp and key != "ddp" else "-"
        time_ratio = f"{rec['seconds'] / ddp['seconds']:.2f}" if ddp else "-"
        if "exchanges" in rec:
            share = rec["fallback_blocks"] / (rec["exchanges"] * WORLD * rec["blocks"])
            swarm = (f"{rec['exchanges']:.0f} | {rec['wire_bytes'] / rec['exchanges'] / 1e3:.1f} kB | "
                     f"{100 * share:.2f} % (in {rec['fallbacks']} of {rec['exchanges'] * WORLD:.0f} exchanges)")
        else:
            swarm = "- | - | -"
        print(f"| {LABELS[key]} | {100 * rec['acc_mean']:.2f} % | {delta} | {100 * rec['acc_rank0']:.2f} % | "
              f"{rec['wire_bytes'] / 1e6:.2f} | {ratio} | {swarm} | {rec['consensus']:.4f} | {time_ratio} |")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
