"""Benchmark configurations: how each one reduces gradients, and how its wire bytes are counted.

Names: ``ddp`` (DDP's built-in all-reduce), ``torch_fp16`` (PyTorch's ``fp16_compress_hook``),
``torch_powersgd`` (PyTorch's ``powerSGD_hook``, rank 4, on ONE bucket: with two or more buckets it
aborts on gloo because it issues collectives from Future callbacks), and every strategy preset of this
package (``gradcomp_topk``, ``scalecom``, ``qsgd``...), which run our hook engine.

Every configuration wraps the model with ``broadcast_buffers=False``: the benchmark measures gradient
reduction, and DDP's per-forward buffer broadcast (BatchNorm statistics) would add the same traffic to
every configuration while our accounting, which covers gradient reduction only, would not see it.
"""

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.comm import Comm, CommStats, all_reduce_bytes
from lightning_gradcomp.hook import GradCompHook, gradcomp_comm_hook
from lightning_gradcomp.plan import SlotPolicy
from lightning_gradcomp.presets import PRESETS

__all__ = ["BASELINES", "Installed", "available_configs", "install"]

BASELINES = ("ddp", "torch_fp16", "torch_powersgd")
_SINGLE_BUCKET_MB = 1024.0


@dataclass
class Installed:
    """A wrapped model plus counters: ``wire_bytes()`` and ``hook_seconds()`` are cumulative."""

    ddp: DistributedDataParallel
    wire_bytes: Callable[[], float]
    hook_seconds: Callable[[], float]
    extra: dict[str, Any] = field(default_factory=dict)


def available_configs() -> list[str]:
    """The baselines followed by every registered preset name."""
    return [*BASELINES, *sorted(PRESETS)]


class _TimedHook:
    """Wraps a PyTorch hook, timing its body (what runs before it returns the Future)."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook
        self.seconds = 0.0

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()
        fut = self.hook(state, bucket)
        self.seconds += time.perf_counter() - start
        return fut


def _timed_hook_fn(timed: _TimedHook) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return timed(state, bucket)
    return hook


def _wrap(model: nn.Module, bucket_cap_mb: float) -> DistributedDataParallel:
    with warnings.catch_warnings():  # torch >= 2.13 suggests forward_sync_buffers, which still syncs at init
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*")
        return DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, broadcast_buffers=False)


def install(name: str, model: nn.Module, bucket_cap_mb: float = 25.0) -> Installed:
    """Wrap ``model`` in DDP and set up configuration ``name`` on this rank."""
    world = dist.get_world_size()
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    steps = {"n": 0}

    def counted(dtype_bytes: int) -> Callable[[], float]:
        return lambda: steps["n"] * all_reduce_bytes(dtype_bytes * numel, world)

    if name == "ddp":
        ddp = _wrap(model, bucket_cap_mb)
        return Installed(ddp, counted(4), lambda: 0.0, {"steps": steps})
    if name == "torch_fp16":
        ddp = _wrap(model, bucket_cap_mb)
        timed = _TimedHook(default_hooks.fp16_compress_hook)
        ddp.register_comm_hook(None, _timed_hook_fn(timed))
        return Installed(ddp, counted(2), lambda: timed.seconds, {"steps": steps})
    if name == "torch_powersgd":
        ddp = _wrap(model, _SINGLE_BUCKET_MB)
        state = psgd.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                   min_compression_rate=2, random_seed=0)
        timed = _TimedHook(psgd.powerSGD_hook)
        ddp.register_comm_hook(state, _timed_hook_fn(timed))
        # PyTorch counts the elements it all-reduces (P, Q and uncompressed tensors), all in fp32
        return Installed(ddp, lambda: all_reduce_bytes(4 * state.total_numel_after_compression, world),
                         lambda: timed.seconds, {"state": state})
    if name not in PRESETS:
        raise ValueError(f"unknown benchmark configuration {name!r}; available: {', '.join(available_configs())}")
    options = PRESETS[name][1]()
    compressor = options["compressor"].clone()
    ddp = _wrap(model, bucket_cap_mb)
    names = {id(p): n for n, p in model.named_parameters()}
    policy = SlotPolicy(min_numel=options.get("min_numel", 1024), compress_1d=options.get("compress_1d", False))
    hook = GradCompHook(compressor, Comm(None, CommStats()), names, start_step=2, policy=policy,
                        beta=options.get("beta", 1.0))
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    return Installed(ddp, lambda: hook.stats.wire_bytes, lambda: hook.stats.hook_seconds, {"hook": hook})


def count_step(installed: Installed) -> None:
    """Advance the formula-based byte counters of the baselines by one step."""
    steps: Optional[dict[str, int]] = installed.extra.get("steps")
    if steps is not None:
        steps["n"] += 1
