"""Sharded replicas on the Local SGD task of docs/localsgd.md, at equal samples: DiLoCo (``LocalSGDFSDPStrategy``),
per-step compressed HSDP (``GradCompFSDPStrategy``) and native HSDP (FSDP2's 2-D mesh, no compression).

The task, the ``diloco`` / ``average`` settings syntax and the data order are those of
``benchmarks/localsgd_compare.py`` (imported, not copied); the network is sharded as one FSDP2 unit, ``--world``
ranks form ``world / shard`` replicas of ``shard`` ranks, and every rank reads its own part of the data (the same
samples in the same order in every setting). Two more kinds of setting:

``hsdp``
    Native HSDP: Lightning's ``ModelParallelStrategy`` with ``data_parallel_size = world / shard`` and
    ``tensor_parallel_size = shard``, the network ``fully_shard``-ed on the whole 2-D mesh (FSDP2 reduce-scatters in
    the shard group, then all-reduces across replicas in fp32). Its bytes across replicas are modelled by the formula
    of ``fsdp_link.hsdp_modelled_bytes`` (what ``GradCompFSDPStrategy`` counts as ``dense_bytes``).
``fsdp``
    ``GradCompFSDPStrategy``: FSDP2 on the shard group, the replica reduction through the compressor. Options
    (``fsdp:key=value,...``): ``cltk`` (CLT-k density), ``topk`` (TopK density), ``sign`` (EF-SignSGD with this group
    size), ``psgd`` (PowerSGD rank), ``f16=1``
    (fp16 values), ``d16=1`` (``delta16`` indices), ``start`` (first compressed step, default 2), ``beta``
    (error-feedback low-pass factor, default 1), ``warm`` and ``from`` (a ``WarmupSchedule`` of ``warm`` steps from
    the parameter ``from``), ``small`` (``small_param``: the tensors the size rule leaves dense are compressed with
    this parameter); no compressor option: ``NoCompression`` (HSDP through the library).

Rank 0 evaluates the final global model (full parameters gathered from the shards) and reports what it sent across
replicas, and per-step native HSDP's bytes across replicas over the same steps divided by it.

    python benchmarks/localsgd_fsdp_compare.py --settings diloco:H=20,olr=1,mom=0.5 --shard 2
    python benchmarks/localsgd_fsdp_compare.py --settings hsdp fsdp:cltk=0.01,f16=1,d16=1 --seeds 0 [--json out.json]
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
from fsdp_link import hsdp_modelled_bytes  # benchmarks/: native HSDP's bytes across replicas, by formula
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from lightning_gradcomp import GradCompFSDPStrategy, LocalSGDFSDPStrategy
from lightning_gradcomp.comm import compression_ratio
from lightning_gradcomp.fsdp_strategy import _FullStateLauncher
from lightning_gradcomp.gloo_workers import free_port
from lightning_gradcomp.schedule import WarmupSchedule

FSDP_KEYS = ("cltk", "topk", "sign", "psgd", "f16", "d16", "start", "beta", "warm", "from", "small")


class ShardedClassifier(lg.Classifier):
    def configure_model(self) -> None:
        fully_shard(self.net, mesh=self.device_mesh["shard"])


class HSDPClassifier(lg.Classifier):
    """Sharded on the strategy's whole 2-D mesh: FSDP2's native HSDP (dim 0 replicates, dim 1 shards)."""

    def configure_model(self) -> None:
        fully_shard(self.net, mesh=self.device_mesh)


class NativeHSDP(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy on forked ranks, every rank reading its own part of the data (as the other
    settings): ranks ``r * shard .. r * shard + shard - 1`` are replica ``r``, the mesh ``(replicas, shard)``."""

    def __init__(self, replicas: int, shard: int) -> None:
        super().__init__(data_parallel_size=replicas, tensor_parallel_size=shard)
        self.replicas = replicas

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        self._launcher = _FullStateLauncher(self, start_method="fork")


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
        acc, loss = lg.evaluate(net, *pl_module.task.data[2:])
        strategy = trainer.strategy
        if isinstance(strategy, NativeHSDP):  # no byte counters: FSDP2's own all-reduce, by formula
            wire, intra = hsdp_modelled_bytes(pl_module.net, strategy.replicas)
            steps = trainer.global_step
            record = {"wire_bytes": wire * steps, "dense_bytes": wire * steps, "intra_bytes": intra * steps,
                      "steps": steps, "syncs": steps}
        else:
            stats, hook = strategy.comm_stats, strategy.hook
            record = {"wire_bytes": stats.wire_bytes, "dense_bytes": stats.dense_bytes,
                      "intra_bytes": stats.intra_bytes, "steps": stats.steps, "syncs": hook.step if hook else None}
        self.out.write_text(json.dumps({"accuracy": acc, "test_loss": loss, **record}))


def parse_setting(text: str) -> tuple[str, dict[str, float]]:
    """``hsdp``, ``fsdp:cltk=0.01,f16=1`` or a ``localsgd_compare.py`` setting (``diloco:...``, ``average:...``)."""
    kind, _, rest = text.partition(":")
    if kind not in ("hsdp", "fsdp"):
        return lc.parse_setting(text)
    opts: dict[str, float] = {}
    for part in filter(None, rest.split(",")):
        key, _, value = part.partition("=")
        if kind == "hsdp" or key not in FSDP_KEYS:
            raise SystemExit(f"unknown option {key!r} in {text!r}")
        opts[key] = float(value)
    return kind, opts


def make_fsdp_strategy(opts: dict[str, float], task: lg.Task, seed: int, shard: int) -> GradCompFSDPStrategy:
    """``GradCompFSDPStrategy`` of an ``fsdp:`` setting."""
    compressor = lc.compressor_of(opts)
    extra: dict[str, Any] = {}
    if "warm" in opts:
        extra["schedule"] = WarmupSchedule(steps=int(opts["warm"]), start=opts["from"])
    if "small" in opts:
        extra["small_param"] = opts["small"]
    return GradCompFSDPStrategy(compressor=compressor, shard_size=shard, start_step=int(opts.get("start", 2)),
                                min_numel=task.min_numel, beta=opts.get("beta", 1.0), seed=seed, start_method="fork",
                                **extra)


def make_strategy(opts: dict[str, float], kind: str, task: lg.Task, seed: int, shard: int, world: int = 4) -> Any:
    """The strategy of one setting (``world``: the number of ranks, for native HSDP's mesh)."""
    if kind == "hsdp":
        return NativeHSDP(world // shard, shard)
    if kind == "fsdp":
        return make_fsdp_strategy(opts, task, seed, shard)
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
    parser.add_argument("--json", type=Path, default=None, help="append every run's record to this JSON list")
    args = parser.parse_args()
    task = lg.build_task(args.task, args)
    print(f"task: {task.description}; {task.epochs} epochs, {args.world} ranks x {task.batch} per step, "
          f"{args.world // args.shard} replicas x {args.shard} shards", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for text in args.settings:
                kind, opts = parse_setting(text)
                os.environ["MASTER_PORT"], os.environ["MASTER_ADDR"] = str(free_port()), "127.0.0.1"
                pl.seed_everything(seed, verbose=False)
                out = Path(tmp) / f"final_{time.monotonic_ns()}.json"
                module = HSDPClassifier if kind == "hsdp" else ShardedClassifier
                trainer = pl.Trainer(accelerator="cpu", devices=args.world,
                                     strategy=make_strategy(opts, kind, task, seed, args.shard, args.world),
                                     max_epochs=task.epochs, logger=False, enable_checkpointing=False,
                                     enable_progress_bar=False, enable_model_summary=False,
                                     callbacks=[FinalProbe(out, seed)], default_root_dir=tmp)
                start = time.perf_counter()
                trainer.fit(module(task, seed))
                rec = json.loads(out.read_text())
                rec.update(setting=text, seed=seed, seconds=time.perf_counter() - start)
                ratio = compression_ratio(rec["dense_bytes"], rec["wire_bytes"])
                print(f"seed {seed}  {text:36s} acc {100 * rec['accuracy']:6.2f} %  loss {rec['test_loss']:.4f}  "
                      f"sent across replicas {rec['wire_bytes'] / 2**20:9.3f} MiB  per-step HSDP/sent {ratio:8.1f}x  "
                      f"steps {rec['steps']}  syncs {rec['syncs']}  {rec['seconds']:.0f} s", flush=True)
                if args.json is not None:
                    records = json.loads(args.json.read_text()) if args.json.exists() else []
                    args.json.write_text(json.dumps([*records, rec], indent=1))


if __name__ == "__main__":
    main()
