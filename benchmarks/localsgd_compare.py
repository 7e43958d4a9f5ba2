"""DiLoCo / Local SGD (``LocalSGDStrategy``) against per-step DDP on the L-GreCo Transformer LM, at equal samples.

Task, data, model and optimiser come from ``benchmarks/lgreco_compare.py`` (task ``lm``: next-token prediction on
the English sentences of the Ding dictionary, Debian ``trans-de-en``; a 2-layer pre-norm Transformer, width 64,
tied 4000-word embedding, 356k parameters; AdamW lr 2e-3, weight decay 0.01, per-step cosine decay; 32 sequences
per rank). Every setting runs ``--world`` forked CPU ranks (gloo, one thread each) for the same number of epochs,
so all settings see the same samples in the same order; only the communication differs:

``ddp``
    ``GradCompStrategy(compressor=None)``: DDP's dense fp32 all-reduce every step (the reference); with a compressor
    option (``ddp:cltk=0.01``) the per-step compressed all-reduce instead (``start_step`` 2).
``diloco``
    ``LocalSGDStrategy(outer="nesterov")``: H local AdamW steps, then outer Nesterov on the averaged
    pseudo-gradient.
``average``
    ``LocalSGDStrategy(outer="average")``: plain Local SGD (model averaging every H steps).

Options per setting (``kind:key=value,...``): ``H`` (local steps, default 20), ``cltk`` (CLT-k ratio of the
pseudo-gradient reduction with error feedback; default dense), ``topk`` (local top-k ratio), ``sign`` (EF-SignSGD
with this bucket size), ``psgd`` (PowerSGD of this rank), ``f16=1`` (CLT-k / top-k values in fp16), ``d16=1``
(CLT-k indices as ``delta16`` gaps), ``beta`` (error-feedback low-pass factor, default 1), ``olr`` (outer lr,
default 0.7), ``mom`` (outer momentum, default 0.9), ``F`` (fragments, default 1). Rank 0 evaluates the final
(global) model on the held-out tokens and reports the bytes it sent (``comm_stats``) next to what per-step DDP
would have sent over the same steps.

    python benchmarks/localsgd_compare.py --settings ddp diloco:H=20 diloco:H=20,cltk=0.01 average:H=20 \\
        [--world 4] [--epochs 6] [--seeds 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import lgreco_compare as lg  # benchmarks/: the L-GreCo benchmark's tasks, model and optimiser
import lightning.pytorch as pl
import torch

from lightning_gradcomp import GradCompStrategy, LocalSGDStrategy
from lightning_gradcomp.comm import compression_ratio
from lightning_gradcomp.compressors import CLTK, NoCompression, PowerSGD, SignSGD, TopK
from lightning_gradcomp.gloo_workers import free_port

DEFAULTS = {"H": 20, "olr": 0.7, "mom": 0.9, "F": 1}


def parse_setting(text: str) -> tuple[str, dict[str, float]]:
    """``"diloco:H=20,cltk=0.01"`` -> ``("diloco", {"H": 20, "cltk": 0.01, ...defaults})``."""
    kind, _, rest = text.partition(":")
    if kind not in ("ddp", "diloco", "average"):
        raise SystemExit(f"unknown setting kind {kind!r} (ddp, diloco, average)")
    opts: dict[str, float] = dict(DEFAULTS)
    for part in filter(None, rest.split(",")):
        key, _, value = part.partition("=")
        if key not in ("H", "cltk", "topk", "sign", "psgd", "f16", "d16", "beta", "olr", "mom", "F"):
            raise SystemExit(f"unknown option {key!r} in {text!r}")
        opts[key] = float(value)
    return kind, opts


def compressor_of(opts: dict[str, float]) -> Any:
    """The compressor a setting's options name (``cltk``/``topk`` density with ``f16``/``d16``, ``sign`` group size,
    ``psgd`` rank); ``NoCompression`` when none."""
    values = torch.float16 if opts.get("f16") else torch.float32
    if "cltk" in opts:
        return CLTK(density=opts["cltk"], value_dtype=values, index_coding="delta16" if opts.get("d16") else "int32")
    if "topk" in opts:
        return TopK(density=opts["topk"], value_dtype=values)
    if "sign" in opts:
        return SignSGD(group_size=int(opts["sign"]))
    if "psgd" in opts:
        return PowerSGD(rank=int(opts["psgd"]))
    return NoCompression()


def make_strategy(kind: str, opts: dict[str, float], task: lg.Task, seed: int) -> Any:
    """The strategy of one setting (``ddp`` with a compressor option: per-step compressed DDP)."""
    compressor = compressor_of(opts)
    if kind == "ddp":
        return GradCompStrategy(compressor=None if isinstance(compressor, NoCompression) else compressor,
                                min_numel=task.min_numel, seed=seed, start_method="fork")
    return LocalSGDStrategy(local_steps=int(opts["H"]), outer="nesterov" if kind == "diloco" else "average",
                            outer_lr=opts["olr"], outer_momentum=opts["mom"], fragments=int(opts["F"]),
                            compressor=compressor, min_numel=task.min_numel, beta=opts.get("beta", 1.0), seed=seed,
                            start_method="fork")


class FinalProbe(pl.Callback):
    """Rank 0 evaluates the final model (after LocalSGDStrategy's final sync) and writes bytes to JSON."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.global_rank != 0:
            return
        stats = trainer.strategy.comm_stats
        xte, yte = pl_module.task.data[2:]
        acc, loss = lg.evaluate(pl_module.net, xte, yte)
        hook = getattr(trainer.strategy, "hook", None)
        self.out.write_text(json.dumps({"accuracy": acc, "test_loss": loss, "wire_bytes": stats.wire_bytes,
                                        "dense_bytes": stats.dense_bytes, "steps": stats.steps,
                                        "syncs": getattr(hook, "step", None)}))


def run(kind: str, opts: dict[str, float], task: lg.Task, seed: int, world: int, workdir: Path) -> dict[str, Any]:
    """One fit on ``world`` forked ranks; rank 0's record plus the wall time."""
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    pl.seed_everything(seed, verbose=False)  # the data order (DistributedSampler) follows PL_GLOBAL_SEED
    out = workdir / f"final_{time.monotonic_ns()}.json"
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=make_strategy(kind, opts, task, seed),
                         max_epochs=task.epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[FinalProbe(out)], default_root_dir=str(workdir))
    start = time.perf_counter()
    trainer.fit(lg.Classifier(task, seed))
    record = json.loads(out.read_text())
    record["seconds"] = time.perf_counter() - start
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["ddp", "diloco:H=20", "diloco:H=20,cltk=0.01",
                                                          "average:H=20"])
    parser.add_argument("--task", default="lm", choices=["lm", "mlp", "cnn", "resnet"])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--train-size", type=int, default=20000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    task = lg.build_task(args.task, args)
    print(f"task: {task.description}; {task.epochs} epochs, {args.world} ranks x {task.batch} per step", flush=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for text in args.settings:
                kind, opts = parse_setting(text)
                rec = run(kind, opts, task, seed, args.world, Path(tmp))
                rec.update(setting=text, seed=seed)
                results.append(rec)
                ratio = compression_ratio(rec["dense_bytes"], rec["wire_bytes"])
                print(f"seed {seed}  {text:28s} acc {100 * rec['accuracy']:6.2f} %  loss {rec['test_loss']:.4f}  "
                      f"sent {rec['wire_bytes'] / 2**20:9.3f} MiB  DDP/sent {ratio:8.1f}x  steps {rec['steps']}  "
                      f"syncs {rec['syncs']}  {rec['seconds']:.0f} s", flush=True)
                if args.json is not None:
                    args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
