"""DiLoCo vs DDP vs a per-step compressor vs SwarmSGD: training wall time to a target accuracy on a slow link.

The measurement of ``benchmarks/swarm_link.py`` (same task, data, model, seed and optimiser as
``swarm_compare.py``: the Fashion-MNIST CNN, SGD momentum 0.9, per-step cosine lr, W = 4 ranks, 32 images per
rank per step), with more configurations. Everything except the strategy is *reused* from ``swarm_link.py``:
each rank is its own process in its own network namespace with a ``tc tbf``-limited veth
(``lightning_gradcomp.bench.netem.EmulatedLink``), started by ``swarm_link.launch``; ``StepClock`` notes the
clock after every optimizer step and keeps a snapshot every ``--every`` steps; ``swarm_link.evaluate`` finds the
first snapshot reaching the target and ``swarm_link.report`` prints the tables.

Configurations (``--configs``):

``ddp``
    dense fp32 gradient all-reduce every step (``GradCompStrategy(compressor=None)``, as in swarm_link).
``scalecom_compact``
    our per-step compressor with the fewest bytes at the same accuracy on this CNN: the ``scalecom_compact``
    preset (CLT-k 1 %, approximate selection, fp16 values, delta16 indices, error feedback), every step.
``swarm_h4``
    SwarmSGD H=4, 8-bit, non-blocking (the fastest SwarmSGD configuration of docs/benchmarks-history.md).
``diloco``
    ``LocalSGDStrategy(local_steps=20, outer="nesterov", outer_lr=1.0, outer_momentum=0.5)``, dense fp32
    pseudo-gradients (the outer setting tuned on the Transformer LM of ``localsgd_compare.py``).
``diloco_sign``
    the same with EF-SignSGD pseudo-gradients (bucket 512) and outer momentum 0 (the first compressed setting
    of docs/localsgd.md meeting >= 500x / 1.5 pt on the LM's seeds 0 and 1; 1.62 pt on seed 2).
``diloco_sign24``
    H=24, EF-SignSGD bucket 256, outer lr 1, momentum 0.5 (the second-round setting: 600x, within 1.5 pt on
    seeds 0, 1 and 2 of the LM).
``diloco_overlap`` (not in the default set)
    ``diloco`` with ``overlap=2``: each sync's exchange runs in the background during the next 2 local steps.

For the LocalSGD configurations the snapshot is the **global** model ``theta`` (what validation would see;
it changes only at syncs), not the rank's drifted local model; all ranks hold the same ``theta``, so the mean
over ranks that ``swarm_link.evaluate`` takes is ``theta`` itself. The final point is taken after the final sync.

    nice -n 10 python benchmarks/localsgd_link.py [--link 100mbit] [--epochs 3] [--target 0.85] \\
        [--configs ddp scalecom_compact swarm_h4 diloco diloco_sign diloco_sign24 diloco_overlap] [--out results.json]

Root and Linux network namespaces are needed for ``--link`` other than ``none`` (loopback).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import swarm_compare  # benchmarks/: the shared task's strategies and labels
import swarm_link  # benchmarks/: launcher, clock, evaluation and report
import torch
from _common import Classifier  # benchmarks/: the shared Fashion-MNIST task

from lightning_gradcomp import GradCompStrategy, LocalSGDStrategy
from lightning_gradcomp.compressors import SignSGD
from lightning_gradcomp.presets import PRESETS

LABELS = {
    "scalecom_compact": "per-step CLT-k 1 % fp16/delta16 + EF (scalecom_compact)",
    "diloco": "DiLoCo H=20, dense fp32, outer lr 1 mom 0.5",
    "diloco_sign": "DiLoCo H=20, EF-SignSGD pseudo-gradient, outer lr 1 mom 0",
    "diloco_sign24": "DiLoCo H=24, EF-SignSGD (bucket 256) pseudo-gradient, outer lr 1 mom 0.5",
    "diloco_overlap": "DiLoCo H=20, dense fp32, outer lr 1 mom 0.5, exchange overlapped with 2 steps",
}
CONFIGS = ("ddp", "scalecom_compact", "swarm_h4", "diloco", "diloco_sign", "diloco_sign24")
swarm_compare.LABELS.update(LABELS)  # swarm_link.report looks the labels up there


def make_strategy(key: str, seed: int) -> pl.strategies.Strategy:
    """The strategy of configuration ``key`` for one rank process (``popen``: Lightning spawns nothing)."""
    if key == "scalecom_compact":
        return GradCompStrategy(**PRESETS[key][1](), seed=seed, start_method="popen")
    if key in ("diloco", "diloco_overlap"):
        return LocalSGDStrategy(local_steps=20, outer="nesterov", outer_lr=1.0, outer_momentum=0.5, seed=seed,
                                overlap=2 if key == "diloco_overlap" else 0, start_method="popen")
    if key == "diloco_sign":
        return LocalSGDStrategy(local_steps=20, outer="nesterov", outer_lr=1.0, outer_momentum=0.0,
                                compressor=SignSGD(group_size=512), seed=seed, start_method="popen")
    if key == "diloco_sign24":
        return LocalSGDStrategy(local_steps=24, outer="nesterov", outer_lr=1.0, outer_momentum=0.5,
                                compressor=SignSGD(group_size=256), seed=seed, start_method="popen")
    return swarm_compare.make_strategy(key, seed, start_method="popen")


class GlobalStepClock(swarm_link.StepClock):
    """``StepClock`` whose snapshots are the global model ``theta`` under ``LocalSGDStrategy``."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        count = len(self.snapshots)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        engine = getattr(trainer.strategy, "hook", None)
        if len(self.snapshots) == count or not isinstance(trainer.strategy, LocalSGDStrategy) or engine is None:
            return
        begin = time.perf_counter()
        theta = engine.global_tensors()
        step, state = self.snapshots[-1]
        self.snapshots[-1] = (step, {k: theta[f"net.{k}"].detach().clone() if f"net.{k}" in theta else v
                                     for k, v in state.items()})
        self.excluded += time.perf_counter() - begin


def worker(key: str, out: Path, args: argparse.Namespace) -> None:
    """One rank of one configuration (started inside its namespace by ``swarm_link.launch``)."""
    torch.set_num_threads(1)
    data = torch.load(out.parent / "data.pt", weights_only=True)  # written once by the parent
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=swarm_compare.WORLD,
                         strategy=make_strategy(key, args.seed), max_epochs=args.epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[GlobalStepClock(args.every, out),
                                    *([swarm_compare.Straggle(args.straggler, args.straggler_sleep)]
                                      if args.straggler >= 0 else [])],
                         default_root_dir=str(out))
    trainer.fit(Classifier(data, args.seed, args.lr, args.batch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    swarm_link.task_arguments(parser, CONFIGS, sorted(set(CONFIGS) | set(swarm_compare.LABELS)))
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.worker_out, args)
        return
    emulate, (name, *data) = swarm_link.check_parent_arguments(parser, args)
    where = f"emulated {args.link} out of each rank (netns + veth + tc tbf)" if emulate else "loopback"
    print(f"{name}; W={swarm_compare.WORLD}, one process per rank, {where}, 1 thread each, batch {args.batch}/rank, "
          f"{args.epochs} epoch(s), lr {args.lr}, seed {args.seed}; target {100 * args.target:g} %", flush=True)

    def describe(key: str, rec: dict[str, Any]) -> str:
        ttt = rec["time_to_target"]
        return (f"  {key:16s} {rec['steps']} steps in {rec['train_seconds']:.1f} s, final acc "
                f"{100 * rec['final_acc']:.2f} %, {'not reached' if ttt is None else f'{ttt:.1f} s'} to "
                f"{100 * args.target:g} %, {rec['wire_bytes'] / 1e6:.2f} MB/rank; wall: launch+train "
                f"{rec['wall_seconds']['launch_and_train']:.0f} s, evaluation "
                f"{rec['wall_seconds']['evaluate']:.0f} s")

    swarm_link.run_configs(args, data, emulate, "localsgd-link-", describe, script=Path(__file__).resolve())


if __name__ == "__main__":
    main()
