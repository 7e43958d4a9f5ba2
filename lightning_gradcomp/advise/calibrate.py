"""Calibration for ``lightning-gradcomp advise``: each configuration's step on this machine, with free collectives.

One process, a gloo group of one rank (DDP needs a group; its collectives then cost next to nothing). Each
configuration is installed as the bench installs it (:mod:`lightning_gradcomp.bench.configs`: the same model, the
same ``GradCompStrategy.make_hook``), except that our hook's collectives go to a :class:`MirrorComm`: a ``Comm``
that stands for ``W`` ranks holding identical gradients. It moves no bytes: an all-reduce multiplies by ``W``, an
all-gather repeats the tensor ``W`` times, a broadcast changes nothing, so the reduction computes what it would at
world size ``W`` (its protocol, its payload, its decode of ``W`` messages), on this machine's device, and every
collective's exact payload is recorded (:class:`~lightning_gradcomp.advise.costs.Collective`). For CLT-k its rank
follows the step (``step mod W``): a rank that leads bucket 0 (the leader rotates with the step), which is the
busiest rank of a step; other compressors stay at rank 0.

PyTorch's hooks (``ddp``, ``torch_fp16``, ``torch_powersgd``) run at ``W = 1`` with their module's
``torch.distributed`` replaced by a recorder that completes every all-reduce at once and records its payload;
``powerSGD_hook`` issues its second all-reduce from a ``Future`` callback and waits for it, so its collectives
are recorded as blocking, one after the other.

What each measured step leaves (:class:`~lightning_gradcomp.advise.costs.StepTrace`): the time each DDP bucket
became ready (the hook's call), the compute between the reduction's collectives on the communication thread,
the collectives, and the tail from the last reduction to the step's end. The median over the measured steps is
taken item by item.

Simplification: collectives complete at once here, so a ``Future`` callback (the decode) runs inline and counts as
compute on the issuing thread right after the collective, not after the transfer: the last bucket's decode is
hidden under its transfer in the replay (a few ms on the bench's models).

The parts: :mod:`~lightning_gradcomp.advise.configurations` (the names and how each is installed),
:mod:`~lightning_gradcomp.advise.mirror_comm` (:class:`MirrorComm`), :mod:`~lightning_gradcomp.advise.torch_hooks`
(PyTorch's hooks recorded) and :mod:`~lightning_gradcomp.advise.step_recorder` (the timeline and its median); this
module measures and re-exports their names.
"""

from __future__ import annotations

import functools
import inspect
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.advise.configurations import _SINGLE_BUCKET_MB as _SINGLE_BUCKET_MB
from lightning_gradcomp.advise.configurations import HIERARCHICAL, _install, check_advise_config
from lightning_gradcomp.advise.configurations import _Installed as _Installed
from lightning_gradcomp.advise.configurations import _nic_sharing as _nic_sharing
from lightning_gradcomp.advise.configurations import _wrap as _wrap
from lightning_gradcomp.advise.costs import StepTrace, Topology
from lightning_gradcomp.advise.fsdp import is_fsdp_config, measure_fsdp
from lightning_gradcomp.advise.mirror_comm import MirrorComm
from lightning_gradcomp.advise.step_recorder import _Bucket as _Bucket
from lightning_gradcomp.advise.step_recorder import _Recorder, _Step, _trace
from lightning_gradcomp.advise.torch_hooks import _as_comm_hook as _as_comm_hook
from lightning_gradcomp.advise.torch_hooks import _DoneWork as _DoneWork
from lightning_gradcomp.advise.torch_hooks import _recording
from lightning_gradcomp.advise.torch_hooks import _RecordingDist as _RecordingDist
from lightning_gradcomp.advise.torch_hooks import _timed_hook as _timed_hook
from lightning_gradcomp.bench.models import BUILTIN_MODELS, load_workload
from lightning_gradcomp.hook import GradCompHook

__all__ = [
    "HIERARCHICAL",
    "Calibration",
    "MirrorComm",
    "calibrate",
    "check_advise_config",
    "check_model_args",
    "single_process_group",
    "workload_of",
]


# ---------------------------------------------------------------------------------------------- calibration
@dataclass
class Calibration:
    """What :func:`calibrate` measured on this machine.

    Attributes:
        traces: per configuration, its median step (:class:`~.costs.StepTrace`).
        params: trained parameters of the model.
        gradient_bytes: bytes of its gradient (one dense fp32 copy).
        device: where it ran (``"cpu"``, ``"cuda"``...).
        step_times: per configuration, its measured steps with free collectives (seconds).
    """

    traces: dict[str, StepTrace]
    params: int
    gradient_bytes: int
    device: str
    step_times: dict[str, list[float]] = field(default_factory=dict)


def single_process_group() -> bool:
    """Start a gloo group of one process (an in-memory store) unless a group exists; whether it started one."""
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def check_model_args(model: str, model_args: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for ``model_args`` on a model that is not built in, or that its builder does not take."""
    if not model_args:
        return
    if model not in BUILTIN_MODELS:
        raise ValueError(f"`--model-arg` applies to the built-in models ({', '.join(BUILTIN_MODELS)}), not {model!r}")
    known = set(inspect.signature(BUILTIN_MODELS[model]).parameters) - {"batch_size"}
    unknown = sorted(set(model_args) - known)
    if unknown:
        raise ValueError(f"`--model-arg`: {model} takes {', '.join(sorted(known))}; got {', '.join(unknown)}")


def workload_of(model: str, batch_size: Optional[int] = None, model_args: Optional[Mapping[str, Any]] = None) -> Any:
    """The bench's workload ``model`` (``bench.models.load_workload``), a built-in one built with ``model_args``
    (its builder's keyword arguments: ``d_model``, ``layers``, ``vocab``, ``seq`` for the transformer; checked by
    :func:`check_model_args`)."""
    if not model_args:
        return load_workload(model, batch_size)
    check_model_args(model, model_args)
    torch.manual_seed(0)
    return BUILTIN_MODELS[model](**dict(model_args), **({} if batch_size is None else {"batch_size": batch_size}))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compute_only(make: Callable[[], Any], device: torch.device, warmup: int, steps: int) -> list[float]:
    """Seconds of the model's measured steps with no reduction at all (forward, backward, SGD step, ``zero_grad``)."""
    workload = make().to(device)
    opt = torch.optim.SGD(workload.parameters(), lr=0.0)  # lr 0: see _measure
    times = []
    for i in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        workload().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _measure(
    name: str,
    make: Callable[[], Any],
    topology: Topology,
    bucket_cap_mb: Optional[float],
    device: torch.device,
    warmup: int,
    steps: int,
) -> tuple[list[_Step], list[float]]:
    recorder = _Recorder()
    workload = make().to(device)
    installed = _install(name, workload, topology, recorder, bucket_cap_mb)
    opt = torch.optim.SGD(installed.ddp.parameters(), lr=0.0)  # lr 0 and scrubbed gradients: see _one_step
    if installed.hook is not None:
        installed.hook.attach_optimizer(opt)
    steps_seen: list[_Step] = []
    times: list[float] = []
    try:
        for i in range(warmup + steps):
            if installed.hook is not None and _rotates(installed.hook):
                for mirror in installed.mirrors:
                    mirror.rank = installed.hook.step % mirror.world_size  # leads bucket 0 (see the docstring)
            _sync(device)
            recorder.start_step()
            if installed.module is not None:
                with _recording(installed.module, recorder, installed.blocking):
                    scrubbed = _one_step(installed.ddp, opt)
            else:
                scrubbed = _one_step(installed.ddp, opt)
            _sync(device)
            elapsed = recorder.now() - scrubbed
            if i >= warmup:
                steps_seen.append(_Step(recorder.buckets, recorder.finished, elapsed))
                times.append(elapsed)
    finally:
        if installed.hook is not None:
            installed.hook.close()
    return steps_seen, times


def _rotates(hook: GradCompHook) -> bool:
    """Whether the compressor gives its ranks roles that rotate with the step (CLT-k's leader): the mirrored rank then
    follows the step. Others keep rank 0 (moving it would move e.g. DIANA's owned chunk and restart its state)."""
    return callable(getattr(hook.compressor, "_leader", None))


def _one_step(ddp: DistributedDataParallel, opt: torch.optim.Optimizer) -> float:
    """One step; returns the seconds spent scrubbing the gradients (not part of a real step).

    A mirrored decode may write garbage, even NaN/Inf, into the averaged gradient (an all-to-all aggregation's other
    servers' replies are not known here): it is set to zero before the optimizer step (lr 0, so the weights and the
    next gradients stay the model's own), which would otherwise turn the weights NaN and every later bucket into
    the dense fallback."""
    ddp().backward()
    start = time.perf_counter()
    grads = [p.grad for p in ddp.parameters() if p.grad is not None]
    if grads:
        torch._foreach_zero_(grads)
    scrubbed = time.perf_counter() - start
    opt.step()
    opt.zero_grad(set_to_none=False)
    return scrubbed


@dataclass
class _Raw:
    """One calibrating process's measurements: compute-only steps, and every configuration's steps."""

    compute: list[float]
    steps: dict[str, list[_Step]]


def _calibrate_raw(
    make: Callable[[], Any],
    configs: Sequence[str],
    topology: Topology,
    bucket_cap_mb: Optional[float],
    device: torch.device,
    warmup: int,
    steps: int,
    threads: Optional[int],
) -> _Raw:
    if threads is not None:
        torch.set_num_threads(threads)
    started = single_process_group()
    try:
        compute = _compute_only(make, device, warmup, steps)
        recorded = {}
        for name in configs:
            if is_fsdp_config(name):
                recorded[name], _ = measure_fsdp(name, make, topology, device, warmup, steps, _sync)
            else:
                recorded[name], _ = _measure(name, make, topology, bucket_cap_mb, device, warmup, steps)
        compute += _compute_only(make, device, 1, steps)  # again: the machine's drift falls on both
    finally:
        if started:
            dist.destroy_process_group()
    return _Raw(compute, recorded)


def _in_child(conn: Any, args: tuple[Any, ...]) -> None:
    try:
        conn.send(_calibrate_raw(*args))
    except BaseException as err:  # noqa: BLE001 - reported by the parent
        conn.send(RuntimeError(f"calibrating process failed: {type(err).__name__}: {err}"))
    finally:
        conn.close()


def _calibrate_together(procs: int, args: tuple[Any, ...]) -> list[_Raw]:
    """:func:`_calibrate_raw` in ``procs`` forked processes at once (ranks sharing this machine's cores)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(procs)]
    children = [ctx.Process(target=_in_child, args=(send, args), daemon=True) for _, send in pipes]
    for child in children:
        child.start()
    results = [recv.recv() for recv, _ in pipes]
    for child in children:
        child.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def calibrate(
    model: str,
    configs: Sequence[str],
    topology: Topology,
    *,
    batch_size: Optional[int] = None,
    bucket_cap_mb: Optional[float] = None,
    device: Union[str, torch.device] = "cpu",
    warmup: int = 3,
    steps: int = 5,
    procs: int = 1,
    threads: Optional[int] = None,
    model_args: Optional[Mapping[str, Any]] = None,
) -> Calibration:
    """Measure the compute-only step and every configuration's step trace on ``device`` (see the module docstring).

    Args:
        model: a bench model (``transformer``, ``cnn``...) or ``module.path:LightningModuleClass``.
        configs: bench configurations, strategy presets with compressor arguments, ``preset+hier``, or FSDP2
            configurations (``hsdp``, ``GradCompFSDPStrategy`` presets: :mod:`~lightning_gradcomp.advise.fsdp`).
        topology: the cluster whose world size the reductions compute for.
        batch_size: samples per rank and step (built-in models).
        bucket_cap_mb: DDP's bucket size for every configuration (``None``: each its own, as the bench).
        device: where the model and the reductions run.
        warmup: unmeasured steps first (>= 3: compression starts at step 2).
        steps: measured steps per configuration.
        procs: processes calibrating at once (forked), pooled: as many as the ranks that will share this machine's
            cores (the bench's emulated ranks do), so that each step sees the same contention; 1 for a machine
            that will run one rank per device.
        threads: torch threads per process (``None``: torch's default).
        model_args: a built-in model's builder arguments (:func:`workload_of`).
    """
    for name in configs:
        check_advise_config(name, topology.procs_per_node)
    if warmup < 3 or steps < 1 or procs < 1:
        raise ValueError(f"`warmup` must be >= 3, `steps` >= 1 and `procs` >= 1, got {warmup}, {steps}, {procs}")
    dev = torch.device(device)
    make = functools.partial(workload_of, model, batch_size, dict(model_args or {}))
    params = sum(p.numel() for p in make().parameters() if p.requires_grad)  # also checks the model's arguments
    args = (make, list(configs), topology, bucket_cap_mb, dev, warmup, steps, threads)
    raws = [_calibrate_raw(*args)] if procs == 1 else _calibrate_together(procs, args)
    compute = statistics.median(t for raw in raws for t in raw.compute)
    traces = {
        name: replace(_trace([s for raw in raws for s in raw.steps[name]], compute), serial=is_fsdp_config(name))
        for name in configs
    }
    times = {name: [s.length for raw in raws for s in raw.steps[name]] for name in configs}
    return Calibration(traces, params, 4 * params, str(dev), times)
