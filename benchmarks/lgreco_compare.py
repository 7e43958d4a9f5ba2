"""L-GreCo reproduction and PowerSGD vs ``torch``'s ``powerSGD_hook``, on 2 CPU ranks (gloo).

Task: 10-class classification of synthetic data (256 Gaussian features with a power-law spectrum, labelled by a
fixed random teacher network; 8192 training and 4096 test samples generated from a seed, no download), learned
by an MLP with layers of very different sizes (256-1024-512-256-128-64-32-10: 320 to 524k weights).

Part ``lgreco`` (Lightning, ``GradCompStrategy``): for each family (PowerSGD rank 4, TopK 1 %, QSGD 4 bits)
one run with the uniform default and one with :class:`~lightning_gradcomp.callbacks.LGreCo` at the **same
error budget** (``alpha = 1``). Prints the bytes rank 0 sent (all layers, and the compressed layers only),
the final test accuracy, and saves the per-layer choice to ``docs/figures/lgreco_layers.png``.

Part ``torch`` (raw DDP, no Lightning): the same model trained with our ``PowerSGD(rank=4)`` hook engine and
with ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (rank 4, error feedback, warm start).
torch's hook issues collectives from Future callbacks, which deadlocks gloo with several buckets, so both
run with a single DDP bucket (``bucket_cap_mb=1000``). Prints bytes per compressed step (ours from
:class:`~lightning_gradcomp.comm.CommStats`, torch's from its own ``compression_stats`` counters with the
same all-reduce formula), time inside the hook function per step, step time, and final accuracy.

    python benchmarks/lgreco_compare.py [--part all|lgreco|torch] [--epochs 6] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import LGreCo
from lightning_gradcomp.comm import Comm, all_reduce_bytes
from lightning_gradcomp.compressors import PowerSGD, TopK
from lightning_gradcomp.compressors.qsgd import QSGD
from lightning_gradcomp.hook import GradCompHook, gradcomp_comm_hook
from lightning_gradcomp.plan import SlotPolicy

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = (256, 1024, 512, 256, 128, 64, 32, 10)
WORLD = 2
BATCH = 64  # per rank
MIN_NUMEL = 256  # every weight matrix is compressed (biases stay dense)
TRAIN = 8192
TEACHER_SCALE = 1.0
SPECTRUM = 1.0


# ---------------------------------------------------------------------------------------------- task
def make_data(seed: int = 0, train: int = TRAIN, test: int = 4096) -> tuple[torch.Tensor, ...]:
    """Gaussian inputs with a power-law spectrum (like natural signals), labelled by a random teacher.

    ``x = (z * i^-SPECTRUM) R`` with ``z ~ N(0, I)`` and a random rotation ``R``; labels are the argmax of a
    fixed ``d -> 32 (tanh) -> 10`` teacher applied to ``x``, normalised to unit variance per direction.
    """
    gen = torch.Generator().manual_seed(1234 + seed)
    d = WIDTHS[0]
    scales = torch.arange(1, d + 1, dtype=torch.float32) ** -SPECTRUM
    rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    x = (torch.randn(train + test, d, generator=gen) * scales) @ rotation.T
    x = x / x.std()
    w1 = torch.randn(d, 32, generator=gen) / d ** 0.5
    w2 = torch.randn(32, 10, generator=gen)
    y = (torch.tanh(x @ w1 * TEACHER_SCALE) @ w2).argmax(1)
    return x[:train], y[:train], x[train:], y[train:]


def make_mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(WIDTHS) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


class Classifier(pl.LightningModule):
    """The MLP on the synthetic task, SGD with momentum and a cosine learning-rate decay."""

    def __init__(self, seed: int, epochs: int, lr: float = 0.05) -> None:
        super().__init__()
        self.net = make_mlp(seed)
        self.seed, self.epochs, self.lr = seed, epochs, lr
        self.xtr, self.ytr, self.xte, self.yte = make_data()  # one data set; the seed varies init and order

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        steps = self.trainer.estimated_stepping_batches
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=steps), "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.xtr, self.ytr), batch_size=BATCH, shuffle=True)


class Probe(pl.Callback):
    """Rank 0 writes accuracy, bytes, per-layer figures and the LGreCo history to a JSON file."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: Classifier) -> None:
        if trainer.global_rank != 0:
            return
        stats = trainer.strategy.comm_stats
        lg = [cb for cb in trainer.callbacks if isinstance(cb, LGreCo)]
        compressed = {k: v for k, v in stats.layers.items() if v.compressed}
        result = {
            "accuracy": accuracy(pl_module.net, pl_module.xte, pl_module.yte),
            "wire_bytes": stats.wire_bytes,
            "dense_bytes": stats.dense_bytes,
            "compressed_layer_bytes": sum(v.wire_bytes for v in compressed.values()),
            "steps": stats.steps,
            "layers": {k: {"numel": v.numel, "param": v.param, "wire_bytes": v.wire_bytes}
                       for k, v in compressed.items()},
            "history": lg[0].history if lg else [],
        }
        self.out.write_text(json.dumps(result))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fit(compressor: Any, layerwise: Optional[LGreCo], seed: int, epochs: int, workdir: Path) -> dict[str, Any]:
    """One 2-rank fit (fork launcher); returns rank 0's :class:`Probe` record plus the wall time."""
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    out = workdir / f"probe_{time.monotonic_ns()}.json"
    strategy = GradCompStrategy(compressor=compressor, start_step=2, min_numel=MIN_NUMEL, start_method="fork",
                                layerwise=layerwise)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Probe(out)], default_root_dir=str(workdir))
    start = time.perf_counter()
    trainer.fit(Classifier(seed, epochs))
    record = json.loads(out.read_text())
    record["seconds"] = time.perf_counter() - start
    return record


# ---------------------------------------------------------------------------------------------- part 1
FAMILIES: dict[str, tuple[Callable[[], Any], dict[str, Any]]] = {
    # name: (uniform compressor, LGreCo candidate arguments)
    "PowerSGD rank": (lambda: PowerSGD(rank=4), {"min_factor": 0.25, "max_factor": 4.0}),
    "TopK ratio": (lambda: TopK(ratio=0.01), {"min_factor": 1 / 16, "max_factor": 4.0, "num_candidates": 13}),
    "QSGD bits": (lambda: QSGD(bits=4, bucket_size=512), {"min_factor": 0.5, "max_factor": 2.0}),
}


def lgreco_for(kwargs: dict[str, Any], steps_per_epoch: int) -> LGreCo:
    """Re-plan after the first epoch's first quarter, then every half epoch, from 10 accumulated steps."""
    return LGreCo(warmup_steps=steps_per_epoch // 4, period=steps_per_epoch // 2, accumulate_steps=10, alpha=1.0,
                  **kwargs)


def part_lgreco(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    steps_per_epoch = TRAIN // (BATCH * WORLD)
    results: dict[str, Any] = {}
    for family, (make, kwargs) in FAMILIES.items():
        for seed in args.seeds:
            uni = run_fit(make(), None, seed, args.epochs, workdir)
            lg = run_fit(make(), lgreco_for(kwargs, steps_per_epoch), seed, args.epochs, workdir)
            results.setdefault(family, []).append({"uniform": uni, "lgreco": lg})
            saving = uni["compressed_layer_bytes"] / lg["compressed_layer_bytes"]
            print(f"{family:14s} seed {seed}: uniform {uni['compressed_layer_bytes'] / 1e6:8.2f} MB "
                  f"acc {uni['accuracy']:.4f} | L-GreCo {lg['compressed_layer_bytes'] / 1e6:8.2f} MB "
                  f"acc {lg['accuracy']:.4f} | saving {saving:.2f}x "
                  f"(all layers {uni['wire_bytes'] / lg['wire_bytes']:.2f}x)", flush=True)
    dense = run_fit(None, None, args.seeds[0], args.epochs, workdir)
    results["dense"] = dense
    print(f"dense DDP seed {args.seeds[0]}: {dense['wire_bytes'] / 1e6:.2f} MB acc {dense['accuracy']:.4f}")
    print_lgreco_table(results, args)
    plot_layers(results, ROOT / "docs" / "figures" / "lgreco_layers.png")
    return results


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs)


def print_lgreco_table(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\nL-GreCo vs uniform at alpha = 1, {args.epochs} epochs, W={WORLD}, mean over seeds {args.seeds}")
    print("| family | setting | MB sent, compressed layers | MB sent, all layers | bytes saving (compressed / all) "
          "| test accuracy | error budget used (last re-plan) |")
    print("|---|---|---|---|---|---|---|")
    for family in FAMILIES:
        runs = results[family]
        for setting in ("uniform", "lgreco"):
            comp = _mean([r[setting]["compressed_layer_bytes"] for r in runs]) / 1e6
            total = _mean([r[setting]["wire_bytes"] for r in runs]) / 1e6
            acc = _mean([r[setting]["accuracy"] for r in runs])
            if setting == "uniform":
                print(f"| {family} | uniform | {comp:.2f} | {total:.2f} | 1.00x / 1.00x | {acc:.4f} | 1.000 |")
                continue
            save_c = _mean([r["uniform"]["compressed_layer_bytes"] / r["lgreco"]["compressed_layer_bytes"]
                            for r in runs])
            save_t = _mean([r["uniform"]["wire_bytes"] / r["lgreco"]["wire_bytes"] for r in runs])
            last = [r["lgreco"]["history"][-1] for r in runs if r["lgreco"]["history"]]
            used = _mean([h["error"] / h["budget"] for h in last if h.get("feasible")]) if last else float("nan")
            print(f"| {family} | L-GreCo | {comp:.2f} | {total:.2f} | {save_c:.2f}x / {save_t:.2f}x | {acc:.4f} "
                  f"| {used:.3f} |")
    dense = results["dense"]
    print(f"| dense DDP | - | - | {dense['wire_bytes'] / 1e6:.2f} | - | {dense['accuracy']:.4f} | - |")


def _numel(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 else str(n)


def plot_layers(results: dict[str, Any], path: Path) -> None:
    """Per-layer chosen parameter (last re-plan of seed 0's L-GreCo run) relative to the uniform default."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FAMILIES), figsize=(4.2 * len(FAMILIES), 3.6), constrained_layout=True)
    for ax, (family, (make, _)) in zip(axes, FAMILIES.items()):
        run = results[family][0]["lgreco"]
        default = make().default_param
        names = sorted(run["layers"], key=lambda n: int(n.split(".")[1]))
        chosen = [run["layers"][n]["param"] for n in names]
        labels = [f"{n.split('.')[1]}\n{_numel(run['layers'][n]['numel'])}" for n in names]
        rel = [c / default for c in chosen]
        ax.bar(range(len(names)), [r - 1.0 for r in rel], bottom=1.0,
               color=["tab:orange" if r < 1 else "tab:blue" for r in rel])
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label=f"uniform ({default:g})")
        ax.set_yscale("log", base=2)
        span = max(max(abs(math.log2(r)) for r in rel), 1.0) + 0.5
        ax.set_ylim(2 ** -span, 2 ** span)
        ax.set_xticks(range(len(names)), labels, fontsize=8)
        for i, c in enumerate(chosen):
            ax.annotate(f"{c:.3g}", (i, c / default), ha="center", va="bottom" if c >= default else "top",
                        fontsize=7)
        saving = run["history"][-1]["uniform_bytes"] / run["history"][-1]["bytes"] if run["history"] else 1.0
        ax.set_title(f"{family}: last re-plan {saving:.2f}x fewer bytes", fontsize=10)
        ax.set_xlabel("layer (net.<i>, numel)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("chosen / uniform default")
    fig.suptitle("L-GreCo per-layer parameters at the uniform setting's error budget (alpha = 1)", fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------- part 2
def _timed(hook_fn: Callable, box: list[float]) -> Callable:
    """Wrap a comm hook: ``box[0]`` += time in the hook body, ``box[1]`` += time until its Future resolved.

    torch's hook does most of its work in Future callbacks, ours in the body; the second figure covers both
    (and the wait for the other rank).
    """

    def wrapper(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
        start = time.perf_counter()
        fut = hook_fn(state, bucket)
        box[0] += time.perf_counter() - start

        def done(f: torch.futures.Future) -> torch.Tensor:
            box[1] += time.perf_counter() - start
            return f.value()

        return fut.then(done)

    # DDP checks these annotations (they are strings under ``from __future__ import annotations``).
    wrapper.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return wrapper


def _torch_worker(rank: int, which: str, seed: int, epochs: int, port: int, queue: Any) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        queue.put((rank, _train_torch(rank, which, seed, epochs)))
    except BaseException as err:  # report instead of leaving the parent waiting
        queue.put((rank, {"error": repr(err)}))
        raise
    finally:
        dist.destroy_process_group()


def _train_torch(rank: int, which: str, seed: int, epochs: int) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = make_mlp(seed)
    xtr, ytr, xte, yte = make_data()
    model = DDP(net, bucket_cap_mb=1000)
    box = [0.0, 0.0]
    if which == "ours":
        names = {id(p): n for n, p in net.named_parameters()}
        hook = GradCompHook(PowerSGD(rank=4), Comm(), names, start_step=2, policy=SlotPolicy(min_numel=1))
        model.register_comm_hook(hook, _timed(gradcomp_comm_hook, box))
    else:
        hook = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                  min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0)
        model.register_comm_hook(hook, _timed(psgd.powerSGD_hook, box))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    n = xtr.shape[0] // WORLD
    steps_per_epoch = n // BATCH
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps_per_epoch * epochs)
    step_times, hook_times, resolve_times = [], [], []
    numel_after_before = 0
    for epoch in range(epochs):
        perm = torch.randperm(xtr.shape[0], generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        mine = perm[rank * n:(rank + 1) * n]
        for i in range(steps_per_epoch):
            idx = mine[i * BATCH:(i + 1) * BATCH]
            box[0] = box[1] = 0.0
            start = time.perf_counter()
            loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step_times.append(time.perf_counter() - start)
            hook_times.append(box[0])
            resolve_times.append(box[1])
    compressed_steps = epochs * steps_per_epoch - 2
    if which == "ours":
        dense_steps_bytes = 2 * all_reduce_bytes(4 * sum(p.numel() for p in net.parameters()), WORLD)
        per_step = (hook.stats.wire_bytes - dense_steps_bytes) / compressed_steps
    else:
        _, _, after = hook.compression_stats()
        numel_after_before = after
        per_step = all_reduce_bytes(4 * after / compressed_steps, WORLD)
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    skip = 2 + 5
    return {"accuracy": accuracy(net, xte, yte), "bytes_per_step": per_step,
            "hook_ms": 1e3 * statistics.median(hook_times[skip:]),
            "resolve_ms": 1e3 * statistics.median(resolve_times[skip:]),
            "step_ms": 1e3 * statistics.median(step_times[skip:]),
            "numel_after": numel_after_before, "checksum": float(params.double().sum())}


def run_torch_compare(which: str, seed: int, epochs: int) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_torch_worker, args=(r, which, seed, epochs, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in range(WORLD))
    for p in procs:
        p.join()
    for r in results.values():
        if "error" in r:
            raise RuntimeError(f"{which} worker failed: {r['error']}")
    assert results[0]["checksum"] == results[1]["checksum"], f"{which}: replicas differ"
    return results[0]


def part_torch(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for seed in args.seeds:
        for which in ("torch", "ours", "torch", "ours"):  # alternate so machine noise hits both alike
            out.setdefault(which, []).append(run_torch_compare(which, seed, args.epochs))
    dense_bytes = all_reduce_bytes(4 * sum(p.numel() for p in make_mlp(0).parameters()), WORLD)
    print(f"\nPowerSGD rank 4, single bucket, W={WORLD}, {args.epochs} epochs, seeds {args.seeds} (2 runs each)")
    print("| hook | bytes per compressed step | vs dense | hook body ms/step | hook call to result ms/step "
          "| step ms | test accuracy |")
    print("|---|---|---|---|---|---|---|")
    for which, label in (("torch", "torch `powerSGD_hook`"), ("ours", "`PowerSGD(rank=4)` (this library)")):
        runs = out[which]
        b = _mean([r["bytes_per_step"] for r in runs])
        print(f"| {label} | {b:,.0f} | {dense_bytes / b:.1f}x less | {_mean([r['hook_ms'] for r in runs]):.2f} "
              f"| {_mean([r['resolve_ms'] for r in runs]):.2f} | {_mean([r['step_ms'] for r in runs]):.2f} "
              f"| {_mean([r['accuracy'] for r in runs]):.4f} |")
    for key, what in (("resolve_ms", "hook call to result"), ("step_ms", "step")):
        ratio = _mean([r[key] for r in out["ours"]]) / _mean([r[key] for r in out["torch"]])
        print(f"{what} time ratio ours / torch (medians, same run set): {ratio:.2f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "lgreco", "torch"), default="all")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("all", "lgreco"):
            part_lgreco(args, Path(tmp))
        if args.part in ("all", "torch"):
            part_torch(args)


if __name__ == "__main__":
    main()
