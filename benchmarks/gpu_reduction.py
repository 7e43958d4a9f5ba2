"""Each compressor's reduction on a GPU, timed in a DDP step, against PyTorch's hooks and one pass over the gradient.

One process, one GPU, NCCL at world size 1 (the collectives are near-free: what is timed is the compression work the
step cannot hide), a ~110M-parameter Transformer encoder in bf16 autocast with fp32 gradients in 25 MB DDP buckets.
For each configuration a fresh copy of the model (same seed) is wrapped in DDP with that configuration's comm hook and
trained with SGD + momentum; after ``--warmup`` steps (past every dense warm-up: ``start_step=2`` here, PowerSGD's
``start_powerSGD_iter=2``) ``--steps`` steps are timed with CUDA events (and the host's clock after a synchronize,
which also catches work done off the stream on the host). Printed per configuration: the median step, its excess over
dense DDP's step, that excess in units of one device-to-device copy of the gradient (the one-pass limit: the fewest
bytes a compressor can move is one read of the gradient), and the ratio to ``powerSGD_hook``'s and
``fp16_compress_hook``'s excess. ``--json`` writes every figure::

    python benchmarks/gpu_reduction.py --json $OUT/gpu_reduction.json

``--profile N`` profiles N steps of each ``--only`` configuration after the warm-up instead (torch.profiler, CPU and
CUDA): the top operators by host and by device time, and per step the calls that wait for the device or copy to the
host (``aten::_local_scalar_dense`` is ``.item()``), into ``--profile-dir``::

    python benchmarks/gpu_reduction.py --only cltk topk --profile 3 --profile-dir $OUT

On a machine without CUDA, ``--device cpu --small`` runs the same code on a small model (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors import registry
from lightning_gradcomp.hook import gradcomp_comm_hook

BUCKET_MB = 25


class Encoder(nn.Module):
    """Token embedding + ``layers`` pre-norm Transformer encoder layers + a tied-free output head."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


def build(small: bool, device: torch.device) -> tuple[nn.Module, int, int]:
    """The model (seed 0) on ``device``, its vocabulary and sequence length."""
    torch.manual_seed(0)
    vocab, d, heads, layers, seq = (512, 64, 4, 2, 32) if small else (8192, 1024, 16, 8, 256)
    return Encoder(vocab, d, heads, layers).to(device), vocab, seq


HookSetup = Callable[[DistributedDataParallel, nn.Module, torch.optim.Optimizer], Optional[Any]]


def _ours(name: str) -> HookSetup:
    def setup(ddp: DistributedDataParallel, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
        names = {id(p): n for n, p in model.named_parameters()}
        device = next(model.parameters()).device
        # make_hook compresses at every world size: the one-process pass-through (single_process="dense") is
        # decided at a fit's hook registration, which this bench does not go through
        hook = GradCompStrategy(compressor=registry.create(name)).make_hook(Comm(None, CommStats()), names, device)
        hook.attach_optimizer(opt)
        ddp.register_comm_hook(hook, gradcomp_comm_hook)
        return hook

    return setup


def _torch_powersgd(ddp: DistributedDataParallel, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                        min_compression_rate=2, use_error_feedback=True, warm_start=True)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _torch_fp16(ddp: DistributedDataParallel, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)


def configurations() -> dict[str, HookSetup]:
    """Label -> hook setup: dense DDP, PyTorch's two hooks, then every registered compressor with its defaults."""
    configs: dict[str, HookSetup] = {"ddp": lambda *_: None, "torch_powerSGD_r4": _torch_powersgd,
                                     "torch_fp16": _torch_fp16}
    for name in sorted(registry.names()):
        if not name.startswith("unit_test"):
            configs[name] = _ours(name)
    return configs


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples), 3)


def copy_ms(numel: int, device: torch.device, repeats: int) -> float:
    """Median time of one device-to-device copy of ``numel`` fp32 values (the one-pass limit)."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            dst.copy_(src)
            ms = (time.perf_counter() - start) * 1e3
        if i >= 3:
            times.append(ms)
    return _median_ms(times)


def time_configuration(setup: HookSetup, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Median step time (events and host clock) of a fresh model under DDP with ``setup``'s hook."""
    model, vocab, seq = build(args.small, device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    hook = setup(ddp, model, opt)
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(0, vocab, (args.batch, seq), device=device, generator=gen) for _ in range(4)]
    if args.profile:
        return profile_configuration(ddp, opt, batches, args, device, hook)
    event_ms: list[float] = []
    host_ms: list[float] = []
    loss = torch.zeros((), device=device)
    for i in range(args.warmup + args.steps):
        tokens = batches[i % len(batches)]
        if device.type == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = ddp(tokens)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if device.type == "cuda":
            b.record()
            torch.cuda.synchronize()
            if i >= args.warmup:
                event_ms.append(a.elapsed_time(b))
        if i >= args.warmup:
            host_ms.append((time.perf_counter() - start) * 1e3)
    result: dict[str, Any] = {
        "step_ms": _median_ms(event_ms or host_ms),
        "host_ms": _median_ms(host_ms),
        "loss": float(loss),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "grad_numel": sum(p.numel() for p in model.parameters()),
    }
    if hook is not None:
        stats = hook.stats
        result.update(compressed_steps=stats.compressed_steps, wire_bytes=stats.wire_bytes,
                      dense_bytes=stats.dense_bytes,
                      engine_ms_per_step=round(1e3 * (stats.comm_thread_seconds - stats.wait_seconds
                                                      + stats.callback_seconds) / max(stats.steps, 1), 3))
        hook.close()
    del ddp, model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


SYNC_EVENTS = ("aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize", "cudaDeviceSynchronize",
               "cudaEventSynchronize", "cudaMemcpyAsync", "Memcpy DtoH (Device -> Pinned)",
               "Memcpy DtoH (Device -> Pageable)", "cudaLaunchKernel")


def profile_configuration(ddp: DistributedDataParallel, opt: torch.optim.Optimizer, batches: list[torch.Tensor],
                          args: argparse.Namespace, device: torch.device, hook: Any) -> dict[str, Any]:
    """Warm up, then profile ``args.profile`` steps: per-step counts of :data:`SYNC_EVENTS` and two top-25 tables."""
    from torch.profiler import ProfilerActivity, profile

    def step(tokens: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = ddp(tokens)
        nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    for i in range(args.warmup):
        step(batches[i % len(batches)])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for i in range(args.profile):
            step(batches[i % len(batches)])
        if device.type == "cuda":
            torch.cuda.synchronize()
    averages = prof.key_averages()
    counts = {e.key: round(e.count / args.profile, 1) for e in averages if e.key in SYNC_EVENTS}
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    if device.type == "cuda":
        tables.append(averages.table(sort_by="self_device_time_total", row_limit=25))
    if hook is not None:
        hook.close()
    return {"per_step_counts": counts, "tables": tables}


def table(results: dict[str, dict[str, Any]], one_pass: float) -> str:
    """The printed table: step, excess over DDP, excess in one-pass units, ratios to PyTorch's hooks' excess."""
    base = results["ddp"]["step_ms"]
    excess = {k: r["step_ms"] - base for k, r in results.items() if "step_ms" in r}
    rows = [f"{'config':<20} {'step ms':>8} {'host ms':>8} {'excess ms':>9} {'x 1-pass':>8} "
            f"{'vs psgd':>7} {'vs fp16':>7} {'engine ms':>9}  ok"]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"{name:<20} FAILED: {r['error'][:90]}")
            continue
        e = excess[name]

        def ratio(ref: str, e: float = e) -> str:
            d = excess.get(ref)
            return f"{e / d:7.2f}" if d and d > 0 else "      -"

        rows.append(f"{name:<20} {r['step_ms']:8.2f} {r['host_ms']:8.2f} {e:9.2f} {e / one_pass:8.1f} "
                    f"{ratio('torch_powerSGD_r4')} {ratio('torch_fp16')} "
                    f"{r.get('engine_ms_per_step', float('nan')):9.2f}  {'yes' if r['finite'] else 'NaN'}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--warmup", type=int, default=6, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (medians)")
    parser.add_argument("--only", nargs="*", help="configuration labels to run (default: all)")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--profile", type=int, default=0, help="profile this many steps instead of timing")
    parser.add_argument("--profile-dir", default=".", help="where --profile writes its tables")
    args = parser.parse_args()

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    configs = configurations()
    chosen = args.only or list(configs)
    results: dict[str, dict[str, Any]] = {}
    if args.profile:
        for name in chosen:
            result = time_configuration(configs[name], args, device)
            with open(os.path.join(args.profile_dir, f"profile_{name}.txt"), "w") as f:
                f.write("\n\n".join(result["tables"]))
            print(f"{name}: per step {json.dumps(result['per_step_counts'])}", flush=True)
        dist.destroy_process_group()
        return
    for name in ["ddp", *[c for c in chosen if c != "ddp"]]:
        try:
            results[name] = time_configuration(configs[name], args, device)
        except Exception as exc:  # one failing compressor must not hide the others' figures
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, json.dumps(results[name]), flush=True)
    numel = next(r["grad_numel"] for r in results.values() if "grad_numel" in r)
    one_pass = copy_ms(numel, device, 50)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{name}, torch {torch.__version__}, {numel / 1e6:.1f}M parameters, fp32 gradient "
          f"{numel * 4 / 2**20:.0f} MiB, one-pass copy {one_pass:.3f} ms, batch {args.batch}, medians of {args.steps}")
    print(table(results, one_pass))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "one_pass_ms": one_pass, "args": vars(args),
                       "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
