"""DiLoCo on FSDP2 replicas (``LocalSGDFSDPStrategy``) on the Local SGD task of docs/localsgd.md, at equal samples.

The task, settings syntax and data order are those of ``benchmarks/localsgd_compare.py`` (imported, not copied); the
network is sharded as one FSDP2 unit over each replica's shard group, ``--world`` ranks form ``world / shard``
replicas. Rank 0 evaluates the final global model (full parameters gathered from the shards).

    python benchmarks/localsgd_fsdp_compare.py --settings diloco:H=20,olr=1,mom=0.5 --shard 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import lgreco_compare as lg  # benchmarks/: the tasks, model and optimiser
import lightning.pytorch as pl
import localsgd_compare as lc  # benchmarks/: the settings syntax and the strategies' compressors
from torch.distributed.fsdp import fully_shard

from lightning_gradcomp import LocalSGDFSDPStrategy
from lightning_gradcomp.comm import compression_ratio
from lightning_gradcomp.gloo_workers import free_port


class ShardedClassifier(lg.Classifier):
    def configure_model(self) -> None:
        fully_shard(self.net, mesh=self.device_mesh["shard"])


class FinalProbe(pl.Callback):
    """Every rank gathers the full parameters; rank 0 evaluates them in an unsharded copy and writes JSON."""

    def __init__(self, out: Path, seed: int) -> None:
        self.out, self.seed = out, seed

    def on_fit_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in pl_module.net.state_dict().items()}
        if trainer.global_rank != 0:
            return
        net = pl_module.task.make_net(self.seed)
        net.load_state_dict(full)
        stats = trainer.strategy.comm_stats
        acc, loss = lg.evaluate(net, *pl_module.task.data[2:])
        self.out.write_text(json.dumps({"accuracy": acc, "test_loss": loss, "wire_bytes": stats.wire_bytes,
                                        "dense_bytes": stats.dense_bytes, "intra_bytes": stats.intra_bytes,
                                        "steps": stats.steps, "syncs": trainer.strategy.hook.step}))


def make_strategy(opts: dict[str, float], kind: str, task: lg.Task, seed: int, shard: int) -> LocalSGDFSDPStrategy:
    local = lc.make_strategy(kind, opts, task, seed)  # the LocalSGDStrategy of the setting: its settings
    return LocalSGDFSDPStrategy(local_steps=local.local_steps, outer=local.outer, outer_lr=local.outer_lr,
                                outer_momentum=local.outer_momentum, fragments=local.fragments,
                                compressor=local.compressor, min_numel=task.min_numel, beta=local.beta, seed=seed,
                                shard_size=shard, start_method="fork")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["diloco:H=20,olr=1,mom=0.5"])
    parser.add_argument("--task", default="lm", choices=["lm", "mlp"])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--shard", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--train-size", type=int, default=20000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    task = lg.build_task(args.task, args)
    print(f"task: {task.description}; {task.epochs} epochs, {args.world} ranks x {task.batch} per step, "
          f"{args.world // args.shard} replicas x {args.shard} shards", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for text in args.settings:
                kind, opts = lc.parse_setting(text)
                os.environ["MASTER_PORT"], os.environ["MASTER_ADDR"] = str(free_port()), "127.0.0.1"
                pl.seed_everything(seed, verbose=False)
                out = Path(tmp) / f"final_{time.monotonic_ns()}.json"
                trainer = pl.Trainer(accelerator="cpu", devices=args.world,
                                     strategy=make_strategy(opts, kind, task, seed, args.shard),
                                     max_epochs=task.epochs, logger=False, enable_checkpointing=False,
                                     enable_progress_bar=False, enable_model_summary=False,
                                     callbacks=[FinalProbe(out, seed)], default_root_dir=tmp)
                start = time.perf_counter()
                trainer.fit(ShardedClassifier(task, seed))
                rec = json.loads(out.read_text())
                ratio = compression_ratio(rec["dense_bytes"], rec["wire_bytes"])
                print(f"seed {seed}  fsdp {text:28s} acc {100 * rec['accuracy']:6.2f} %  loss {rec['test_loss']:.4f}  "
                      f"sent across replicas {rec['wire_bytes'] / 2**20:9.3f} MiB  per-step HSDP/sent {ratio:8.1f}x  "
                      f"steps {rec['steps']}  syncs {rec['syncs']}  {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
