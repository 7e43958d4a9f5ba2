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
"""

from __future__ import annotations

import functools
import inspect
import statistics
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.advise.costs import BucketTrace, Collective, Join, StepTrace, Topology
from lightning_gradcomp.bench.configs import BASELINES, DDP_BUCKET_CAP_MB, build_strategy, is_config
from lightning_gradcomp.bench.models import BUILTIN_MODELS, load_workload
from lightning_gradcomp.comm import (
    Comm,
    CommStats,
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
    broadcast_bytes,
    completed_future,
    p2p_bytes,
    sparse_payload_bytes,
)
from lightning_gradcomp.hierarchy import Hierarchy, HierarchyLayout, assign_owners
from lightning_gradcomp.hook import GradCompHook, gradcomp_comm_hook

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

HIERARCHICAL = "+hier"
"""Suffix of a configuration reduced hierarchically (``GradCompStrategy(hierarchy="node")``): ``scalecom+hier``."""

_SINGLE_BUCKET_MB = 1024.0  # powerSGD_hook runs on one bucket (the bench's choice: it aborts on gloo with more)


def check_advise_config(name: str, procs_per_node: int = 1) -> str:
    """``name`` if ``advise`` can calibrate it: a bench configuration, or a strategy preset followed by ``+hier``.

    Raises:
        ValueError: an unknown name, or ``+hier`` on a baseline or with one process per node.
    """
    base = name[: -len(HIERARCHICAL)] if name.endswith(HIERARCHICAL) else name
    if not is_config(base):
        raise ValueError(f"unknown configuration {name!r} (see `lightning-gradcomp list`; `+hier` for hierarchical)")
    if base != name and base in BASELINES:
        raise ValueError(f"configuration {name!r}: `+hier` applies to strategy presets, not to {base}")
    if base != name and procs_per_node < 2:
        raise ValueError(f"configuration {name!r}: `+hier` needs `--procs-per-node` >= 2")
    return name


# ---------------------------------------------------------------------------------------------- the recorder
@dataclass
class _Bucket:
    ready: float
    items: list[Union[float, Collective, Join]] = field(default_factory=list)


class _Recorder:
    """One step's timeline: buckets ready (any thread), each bucket's compute and collectives (its reducing thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.buckets: list[_Bucket] = []
        self._queued: list[_Bucket] = []
        self._current: Optional[_Bucket] = None
        self._last = 0.0
        self.finished = 0.0
        self.sharing: Optional[float] = None  # the current bucket's cross-node NIC multiplier (hierarchy)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def start_step(self) -> None:
        with self._lock:
            self.t0 = time.perf_counter()
            self.buckets, self._queued, self._current, self.finished = [], [], None, 0.0

    def ready(self) -> None:
        with self._lock:
            bucket = _Bucket(self.now())
            self.buckets.append(bucket)
            self._queued.append(bucket)

    def begin(self) -> None:
        with self._lock:
            self._current = self._queued.pop(0) if self._queued else _Bucket(self.now())
            self._last = self.now()

    def collective(self, record: Collective, start: float, end: float) -> None:
        with self._lock:
            if self._current is None:
                return
            self._current.items += [max(0.0, start - self._last), record]
            self._last = end

    def join(self, start: float, end: float) -> None:
        with self._lock:
            if self._current is not None:
                self._current.items += [max(0.0, start - self._last), Join()]
                self._last = end

    def end(self) -> None:
        with self._lock:
            if self._current is not None:
                self._current.items.append(max(0.0, self.now() - self._last))
                self.finished = max(self.finished, self.now())
                self._current = None


@dataclass
class _Step:
    """One measured step: its buckets, when its last reduction ended and its length (seconds from its start)."""

    buckets: list[_Bucket]
    finished: float
    length: float


# ---------------------------------------------------------------------------------------------- MirrorComm
class MirrorComm(Comm):
    """A ``Comm`` standing for ``world_size`` ranks with identical inputs: it moves no bytes, computes what the
    collective would return, records each collective (payload per rank, group, blocking) and counts its bytes by
    the :mod:`lightning_gradcomp.comm` formulas.

    Args:
        world_size: the ranks it stands for (``W``, or ``G`` / ``N`` for a hierarchy's node / cross-node group).
        scope: the group's name in the cost model: ``"world"``, ``"intra"`` or ``"cross"``.
        recorder: where collectives go.
        stats: byte counters (a new :class:`CommStats` when omitted).
        intra: count bytes as intra-node (``hierarchy=``).
    """

    def __init__(
        self,
        world_size: int,
        scope: str,
        recorder: _Recorder,
        stats: Optional[CommStats] = None,
        *,
        intra: bool = False,
    ) -> None:  # no super().__init__: there is no process group behind it
        self.group = None
        self.stats = stats if stats is not None else CommStats()
        self.intra = intra
        self.timeout_setting = "timeout"
        self.world_size = world_size
        self.rank = 0
        self.scope = scope
        self.recorder = recorder

    def _record(self, kind: str, nbytes: float, blocking: bool, start: float) -> None:
        sharing = self.recorder.sharing if self.scope == "cross" else None
        record = Collective(kind, float(nbytes), self.scope, blocking, sharing=sharing)
        self.recorder.collective(record, start, self.recorder.now())

    @contextmanager
    def _waiting(self) -> Iterator[None]:
        start = self.recorder.now()
        yield
        self.recorder.join(start, self.recorder.now())

    def waiting(self) -> Any:
        """An explicit wait for earlier asynchronous collectives (a :class:`~.costs.Join` in the trace)."""
        return self._waiting()

    def all_reduce(  # type: ignore[override]
        self, tensor: Tensor, *, async_op: bool = False, op: Any = dist.ReduceOp.SUM, shares: Any = None
    ) -> Optional[Future]:
        start = self.recorder.now()
        if tensor.is_sparse:
            payload = sparse_payload_bytes(tensor)
            self._count(all_gather_bytes(payload, self.world_size), shares)
            kind = "all_gather"
        else:
            payload = tensor.numel() * tensor.element_size()
            self._count(all_reduce_bytes(payload, self.world_size), shares)
            kind = "all_reduce"
            if op == dist.ReduceOp.SUM and tensor.dtype != torch.bool:
                tensor.mul_(self.world_size)  # the sum of W identical copies (not timed as the reduction's work)
        self._record(kind, payload, not async_op, start)
        return completed_future(tensor) if async_op else None

    def all_gather(  # type: ignore[override]
        self, tensor: Tensor, *, async_op: bool = False, shares: Any = None
    ) -> Union[Tensor, Future]:
        start = self.recorder.now()
        payload = tensor.numel() * tensor.element_size()
        self._count(all_gather_bytes(payload, self.world_size), shares)
        out = tensor.contiguous().reshape(1, *tensor.shape).repeat(self.world_size, *([1] * tensor.dim()))
        self._record("all_gather", payload, not async_op, start)
        return completed_future(out) if async_op else out

    def broadcast(self, tensor: Tensor, src: int, *, shares: Any = None) -> None:
        start = self.recorder.now()
        payload = tensor.numel() * tensor.element_size()
        self._count(broadcast_bytes(payload, self.world_size), shares)
        self._record("broadcast", payload, True, start)

    def all_to_all(self, output: Tensor, tensor: Tensor, *, shares: Any = None) -> None:
        start = self.recorder.now()
        payload = tensor.numel() * tensor.element_size()
        self._count(all_to_all_bytes(payload, self.world_size), shares)
        chunks = tensor.reshape(self.world_size, -1)
        output.reshape(self.world_size, -1).copy_(chunks[self.rank].expand_as(chunks))
        self._record("all_to_all", all_to_all_bytes(payload, self.world_size), True, start)

    def all_to_all_uneven(  # type: ignore[override]
        self,
        output: Tensor,
        tensor: Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        async_op: bool = False,
    ) -> Optional[Future]:
        start = self.recorder.now()
        sent = (sum(input_splits) - input_splits[self.rank]) * tensor.element_size()
        self._count(float(sent), None)
        mine = torch.split(tensor, list(input_splits))[self.rank]
        for piece in torch.split(output, list(output_splits)):
            if piece.numel() == mine.numel():
                piece.copy_(mine)
            else:  # another rank's shard: its contents are not known here
                piece.zero_()
        self._record("all_to_all", sent, not async_op, start)
        return completed_future(output) if async_op else None

    def exchange(
        self, send: Tensor, recv: Tensor, peer: int, *, async_op: bool = False, shares: Any = None
    ) -> list[Any]:
        start = self.recorder.now()
        payload = send.numel() * send.element_size()
        self._count(p2p_bytes(payload, self.world_size), shares)
        recv.copy_(send)
        self._record("p2p", payload, not async_op, start)
        return []


# ---------------------------------------------------------------------------------------------- PyTorch's hooks
class _RecordingDist:
    """``torch.distributed`` as a PyTorch hook module sees it: ``all_reduce`` completes at once and is recorded."""

    def __init__(self, recorder: _Recorder, blocking: bool) -> None:
        self._recorder = recorder
        self._blocking = blocking

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_reduce(self, tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        start = self._recorder.now()
        record = Collective("all_reduce", float(tensor.numel() * tensor.element_size()), "world", self._blocking)
        self._recorder.collective(record, start, self._recorder.now())
        return _DoneWork(tensor)


class _DoneWork:
    def __init__(self, tensor: Tensor) -> None:
        self._tensor = tensor

    def get_future(self) -> Future:
        return completed_future([self._tensor])

    def wait(self) -> bool:
        return True


@contextmanager
def _recording(module: types.ModuleType, recorder: _Recorder, blocking: bool) -> Iterator[None]:
    saved = module.dist
    module.dist = _RecordingDist(recorder, blocking)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.dist = saved  # type: ignore[attr-defined]


def _timed_hook(recorder: _Recorder, hook: Callable[[Any, Any], Future]) -> Callable[[Any, Any], Future]:
    """A DDP comm hook that marks the bucket ready and runs ``hook`` as its reduction (on the autograd thread)."""

    def run(state: Any, bucket: dist.GradBucket) -> Future:
        recorder.ready()
        recorder.begin()
        fut = hook(state, bucket)
        recorder.end()
        return fut

    return _as_comm_hook(run)


def _as_comm_hook(fn: Callable[[Any, Any], Future]) -> Callable[[Any, Any], Future]:
    """``fn`` with the annotations DDP checks (this module's annotations are strings)."""
    fn.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": Future[Tensor]}
    return fn


# ---------------------------------------------------------------------------------------------- install
@dataclass
class _Installed:
    ddp: DistributedDataParallel
    hook: Optional[GradCompHook]
    mirrors: list[MirrorComm]
    module: Optional[types.ModuleType] = None
    blocking: bool = False


def _wrap(model: nn.Module, bucket_cap_mb: float, views: bool = True) -> DistributedDataParallel:
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*")
        return DistributedDataParallel(
            model, bucket_cap_mb=bucket_cap_mb, broadcast_buffers=False, gradient_as_bucket_view=views
        )


def _install(
    name: str, model: nn.Module, topology: Topology, recorder: _Recorder, bucket_cap_mb: Optional[float]
) -> _Installed:
    """Configuration ``name`` on ``model``, its collectives recorded (see the module docstring)."""
    cap = DDP_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    if name == "ddp":
        ddp = _wrap(model, cap)
        ddp.register_comm_hook(None, _timed_hook(recorder, default_hooks.allreduce_hook))
        return _Installed(ddp, None, [], default_hooks)
    if name == "torch_fp16":
        ddp = _wrap(model, cap)
        ddp.register_comm_hook(None, _timed_hook(recorder, default_hooks.fp16_compress_hook))
        return _Installed(ddp, None, [], default_hooks)
    if name == "torch_powersgd":
        ddp = _wrap(model, _SINGLE_BUCKET_MB)
        state = psgd.PowerSGDState(
            None, matrix_approximation_rank=4, start_powerSGD_iter=2, min_compression_rate=2, random_seed=0
        )
        ddp.register_comm_hook(state, _timed_hook(recorder, psgd.powerSGD_hook))
        return _Installed(ddp, None, [], psgd, blocking=True)
    hierarchical = name.endswith(HIERARCHICAL)
    strategy = build_strategy(name[: -len(HIERARCHICAL)] if hierarchical else name)
    if bucket_cap_mb is None:
        bucket_cap_mb = strategy._ddp_kwargs.get("bucket_cap_mb") or DDP_BUCKET_CAP_MB
    ddp = _wrap(model, bucket_cap_mb, strategy._ddp_kwargs["gradient_as_bucket_view"])
    stats = CommStats()
    world = MirrorComm(topology.world_size, "world", recorder, stats)
    mirrors = [world]
    hierarchy = None
    if hierarchical:
        layout = HierarchyLayout(topology.world_size, topology.procs_per_node)
        intra = MirrorComm(topology.procs_per_node, "intra", recorder, stats, intra=True)
        cross = MirrorComm(topology.nodes, "cross", recorder, stats)
        numels = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
        hierarchy = Hierarchy(layout, 0, intra, cross, assign_owners(numels, topology.procs_per_node))
        mirrors += [cross]  # the node index rotates with the step, as the world rank does when flat
    names = {id(p): n for n, p in model.named_parameters()}
    hook = strategy.make_hook(world, names, next(model.parameters()).device, hierarchy)
    strategy.bind_hook(hook)
    reduce = hook._reduce

    def reduce_recorded(*args: Any) -> Future:
        if hierarchy is not None:
            recorder.sharing = _nic_sharing(hierarchy, args[0])
        recorder.begin()
        try:
            return reduce(*args)
        finally:
            recorder.end()

    hook._reduce = reduce_recorded  # type: ignore[method-assign,assignment]

    def ready_then_hook(state: GradCompHook, bucket: dist.GradBucket) -> Future:
        recorder.ready()
        return gradcomp_comm_hook(state, bucket)

    ddp.register_comm_hook(hook, _as_comm_hook(ready_then_hook))
    return _Installed(ddp, hook, mirrors)


def _nic_sharing(hierarchy: Hierarchy, plan: Any) -> float:
    """How many times this rank's cross-node bytes cross the NIC in all: ``1 / f`` for a rank that owns a fraction ``f``
    of the bucket (every local rank's bytes in proportion to its share), within ``[1, 4 G]``."""
    size = hierarchy.layout.group_size
    owned = hierarchy.shards(plan).counts[hierarchy.local_rank] / max(1, plan.numel)
    return min(4.0 * size, max(1.0, 1.0 / owned if owned > 0 else 4.0 * size))


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


def _trace(steps: list[_Step], compute_only: float) -> StepTrace:
    """The item-by-item median of the measured steps; the median step when their shapes differ."""
    shapes = [[[i if not isinstance(i, float) else None for i in b.items] for b in s.buckets] for s in steps]
    same = all(shape == shapes[0] for shape in shapes)
    if not same:
        ordered = sorted(steps, key=lambda s: s.length)
        steps = [ordered[len(ordered) // 2]]
    buckets = []
    for b, first in enumerate(steps[0].buckets):
        items: list[Union[float, Collective, Join]] = []
        for i, item in enumerate(first.items):
            if isinstance(item, float):
                items.append(statistics.median(float(s.buckets[b].items[i]) for s in steps))  # type: ignore[arg-type]
            else:
                items.append(item)
        buckets.append(BucketTrace(statistics.median(s.buckets[b].ready for s in steps), tuple(items)))
    last = statistics.median(max(s.finished, s.buckets[-1].ready if s.buckets else 0.0) for s in steps)
    tail = max(0.0, statistics.median(s.length for s in steps) - last)
    return StepTrace(tuple(buckets), tail, compute_only)


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
        configs: bench configurations, strategy presets with compressor arguments, or ``preset+hier``.
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
    traces = {name: _trace([s for raw in raws for s in raw.steps[name]], compute) for name in configs}
    times = {name: [s.length for raw in raws for s in raw.steps[name]] for name in configs}
    return Calibration(traces, params, 4 * params, str(dev), times)
