"""Benchmark configurations: how each one reduces gradients, and how its wire bytes are counted.

Names: ``ddp`` (DDP's built-in all-reduce), ``torch_fp16`` (PyTorch's ``fp16_compress_hook``),
``torch_powersgd`` (PyTorch's ``powerSGD_hook``, rank 4, on ONE bucket: with two or more buckets it
aborts on gloo because it issues collectives from Future callbacks), and every ``GradCompStrategy`` preset
(``gradcomp_topk``, ``scalecom``, ``qsgd``...), which run our hook engine; the presets of strategies that do not
reduce gradients (``swarmsgd``, ``diloco``) are not configurations here.

A preset is built exactly as ``Trainer(strategy=name)`` builds it: ``preset_class(name)(**factory())``, whose
:meth:`~lightning_gradcomp.GradCompStrategy.make_hook` assembles the hook (compressor clone, start step, size
policy, seed, beta, non-finite policy), so what is benchmarked is what users run. The bench has no Trainer,
so a preset's ``layerwise`` callback (L-GreCo) is driven by :class:`LayerwiseDriver`, which makes the calls
Lightning makes at the same points of a step, with the strategy itself as ``trainer.strategy``.

Every configuration wraps the model with ``broadcast_buffers=False``: the benchmark measures gradient
reduction, and DDP's per-forward buffer broadcast (BatchNorm statistics) would add the same traffic to
every configuration while our accounting, which covers gradient reduction only, would not see it.

A measured step is ``ddp().backward()``, ``optimizer.step()``, ``zero_grad()``, then
:meth:`Installed.end_step`; :meth:`Installed.begin` runs once the optimizer exists, :meth:`Installed.end` at
the end.
"""

import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import yaml
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.comm import Comm, CommStats, all_reduce_bytes
from lightning_gradcomp.hook import GradCompHook, gradcomp_comm_hook, resident_nbytes
from lightning_gradcomp.presets import PRESETS, preset_class
from lightning_gradcomp.strategy import GradCompStrategy

__all__ = ["BASELINES", "Installed", "LayerwiseDriver", "available_configs", "install", "install_strategy"]

BASELINES = ("ddp", "torch_fp16", "torch_powersgd")
_SINGLE_BUCKET_MB = 1024.0


_DRIVEN = ("on_train_start", "on_train_batch_end", "on_train_end")
"""The Lightning hooks :class:`LayerwiseDriver` calls, where a Trainer would."""

_NOT_APPLICABLE = ("state_dict", "load_state_dict", "on_save_checkpoint", "on_load_checkpoint", "on_exception")
"""Hooks that have nothing to do in the bench (it writes no checkpoint; a failure aborts it)."""


class _TrainerView:
    """What a layerwise callback reads of the ``Trainer``: the strategy, the ranks, the step, the callbacks."""

    def __init__(self, strategy: GradCompStrategy, callback: Callback) -> None:
        self.strategy = strategy
        self.callbacks = [callback]
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.global_step = 0  # optimizer steps taken, as ``Trainer.global_step``


class _ModuleView:
    """Stands in for the ``LightningModule``: keeps the last value of every metric a callback logs."""

    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        self.logged[name] = float(value)

    def log_dict(self, metrics: dict[str, Any], **kwargs: Any) -> None:
        for name, value in metrics.items():
            self.log(name, value)


class LayerwiseDriver:
    """Runs a strategy's ``layerwise`` callback (e.g. L-GreCo) in the bench, which has no Trainer.

    It calls ``on_train_start`` once the optimizer exists, ``on_train_batch_end`` after every optimizer step
    and ``on_train_end`` at the end (where Lightning calls them), with the real strategy, whose hook is the
    one the model reduces with, as ``trainer.strategy``.

    Raises:
        NotImplementedError: the callback overrides another Lightning hook, which the bench cannot honour;
            benchmark it through a Trainer instead.
    """

    def __init__(self, callback: Callback, strategy: GradCompStrategy) -> None:
        hooks = [name for name in dir(Callback) if name.startswith("on_") or name in ("setup", "teardown")]
        unsupported = [
            name
            for name in hooks
            if name not in _DRIVEN + _NOT_APPLICABLE and getattr(type(callback), name) is not getattr(Callback, name)
        ]
        if unsupported:
            raise NotImplementedError(
                f"the bench drives only {', '.join(_DRIVEN)} of a layerwise callback; "
                f"{type(callback).__name__} also overrides {', '.join(unsupported)}: "
                f"benchmark it with a Lightning Trainer instead"
            )
        self.callback = callback
        self.trainer = _TrainerView(strategy, callback)
        self.module = _ModuleView()

    def start(self) -> None:
        self.callback.on_train_start(self.trainer, self.module)  # type: ignore[arg-type]

    def step_end(self) -> None:
        self.trainer.global_step += 1
        step = self.trainer.global_step - 1
        self.callback.on_train_batch_end(self.trainer, self.module, None, None, step)  # type: ignore[arg-type]

    def end(self) -> None:
        self.callback.on_train_end(self.trainer, self.module)  # type: ignore[arg-type]


@dataclass
class Installed:
    """A wrapped model plus counters: ``wire_bytes()``, ``hook_seconds()`` (time the hook blocks the autograd
    thread), ``thread_seconds()`` (our communication thread's time plus the Future callbacks that ran on gloo's
    threads; for PyTorch's hooks, their body plus their Future callbacks) and ``wait_seconds()`` (the part of it
    blocked in collectives) are cumulative.

    ``hook`` is our hook engine (presets only), ``layerwise`` the driver of the preset's layerwise callback.
    """

    ddp: DistributedDataParallel
    wire_bytes: Callable[[], float]
    hook_seconds: Callable[[], float]
    extra: dict[str, Any] = field(default_factory=dict)
    hook: Optional[GradCompHook] = None
    layerwise: Optional[LayerwiseDriver] = None
    thread_seconds: Callable[[], float] = lambda: 0.0
    wait_seconds: Callable[[], float] = lambda: 0.0

    def begin(self, optimizer: torch.optim.Optimizer) -> None:
        """Once the optimizer exists, before the first step: attach it to the hook, start the layerwise callback."""
        if self.hook is not None:
            self.hook.attach_optimizer(optimizer)  # the engine commits its memories on optimizer steps
        if self.layerwise is not None:
            self.layerwise.start()

    def end_step(self) -> None:
        """After each optimizer step: advance the baselines' byte counters, run the layerwise callback."""
        steps: Optional[dict[str, int]] = self.extra.get("steps")
        if steps is not None:
            steps["n"] += 1
        if self.layerwise is not None:
            self.layerwise.step_end()

    def state_nbytes(self) -> int:
        """Bytes of the tensors the configuration keeps between steps beyond DDP's own: our hook's memories and
        compressor state, or the state object of PyTorch's hook (``powerSGD_hook``'s error and factor memories)."""
        if self.hook is not None:
            return self.hook.state_nbytes()
        return resident_nbytes(self.extra.get("state"))

    def end(self) -> None:
        """After the last step (``on_train_end`` of the layerwise callback)."""
        if self.layerwise is not None:
            self.layerwise.end()


def available_configs() -> list[str]:
    """The baselines followed by every ``GradCompStrategy`` preset name."""
    return [*BASELINES, *sorted(name for name in PRESETS if issubclass(preset_class(name), GradCompStrategy))]


def split_config(name: str) -> tuple[str, dict[str, Any]]:
    """``"preset@key=value@..."`` into the preset and the compressor arguments that replace its compressor's: the
    compressor's class built with those arguments, the others at their defaults. Values are read as YAML scalars.

    Example::

        >>> split_config("signsgd@aggregation=alltoall@group_size=256")
        ('signsgd', {'aggregation': 'alltoall', 'group_size': 256})

    Raises:
        ValueError: an override without ``=``.
    """
    preset, *pairs = name.split("@")
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"configuration {name!r}: overrides look like `@key=value`, got {pair!r}")
        overrides[key] = yaml.safe_load(value)
    return preset, overrides


def is_config(name: str) -> bool:
    """Whether ``name`` is a baseline, a strategy preset, or a strategy preset with compressor overrides."""
    preset, overrides = split_config(name)
    return name in available_configs() or (bool(overrides) and preset in available_configs()[len(BASELINES) :])


class _TimedHook:
    """Wraps a PyTorch hook: times its body (what runs before it returns the Future, ``seconds``) and, through
    :class:`_TimedDist`, its Future callbacks (``callback_seconds``, with ``wait_seconds`` the part of them
    blocked in collectives), so that its work compares with ours, which includes everything.

    PyTorch's hooks run part of their work in ``Future.then`` callbacks (``powerSGD_hook``: the Q step,
    decompression and error feedback; ``fp16_compress_hook``: the copy back into the bucket), on the thread that
    completes the collective. A callback that runs inline inside the body counts once, as callback time.
    """

    def __init__(self, hook: Callable[..., Any], module: Any) -> None:
        self.hook = hook
        self.seconds = 0.0
        self.callback_seconds = 0.0
        self.wait_seconds = 0.0
        self._local = threading.local()
        module.dist = _TimedDist(self)  # the hook's module reaches torch.distributed through this global

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self._local.inline = 0.0
        start = time.perf_counter()
        fut = self.hook(state, bucket)
        self.seconds += time.perf_counter() - start - self._local.inline
        return fut.future if isinstance(fut, _TimedFuture) else fut

    def work_seconds(self) -> float:
        """Body plus callbacks (waits included: ``wait_seconds`` is the part to subtract)."""
        return self.seconds + self.callback_seconds

    def timed(self, callback: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``callback``, adding its time to ``callback_seconds`` (and to the body's inline time on this thread)."""

        def run(fut: Any) -> Any:
            start = time.perf_counter()
            try:
                return callback(fut)
            finally:
                elapsed = time.perf_counter() - start
                self.callback_seconds += elapsed
                self._local.inline = getattr(self._local, "inline", 0.0) + elapsed

        return run

    def waited(self, wait: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return wait()
        finally:
            self.wait_seconds += time.perf_counter() - start


class _TimedDist:
    """``torch.distributed`` as a PyTorch hook module sees it: ``all_reduce`` hands out timed works and futures."""

    def __init__(self, timer: _TimedHook) -> None:
        self._timer = timer

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_reduce(self, *args: Any, **kwargs: Any) -> Any:
        work = dist.all_reduce(*args, **kwargs)
        return None if work is None else _TimedWork(work, self._timer)


class _TimedWork:
    def __init__(self, work: Any, timer: _TimedHook) -> None:
        self.work, self._timer = work, timer

    def get_future(self) -> "_TimedFuture":
        return _TimedFuture(self.work.get_future(), self._timer)

    def wait(self) -> Any:
        return self._timer.waited(self.work.wait)


class _TimedFuture:
    """A Future whose ``then`` callbacks are timed and whose ``wait`` counts as a wait; ``future`` is the real one."""

    def __init__(self, future: torch.futures.Future, timer: _TimedHook) -> None:
        self.future, self._timer = future, timer

    def then(self, callback: Callable[[Any], Any]) -> "_TimedFuture":
        return _TimedFuture(self.future.then(self._timer.timed(callback)), self._timer)

    def wait(self) -> Any:
        return self._timer.waited(self.future.wait)

    def value(self) -> Any:
        return self.future.value()


def _timed_hook_fn(timed: _TimedHook) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return timed(state, bucket)

    return hook


def _wrap(model: nn.Module, bucket_cap_mb: float, views: bool = True) -> DistributedDataParallel:
    """DDP around ``model``; ``views``: ``gradient_as_bucket_view`` (the gradients are views of the buckets: no copy
    between them), which every configuration gets, as ``GradCompStrategy`` sets it by default."""
    with warnings.catch_warnings():  # torch >= 2.13 suggests forward_sync_buffers, which still syncs at init
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*")
        return DistributedDataParallel(
            model, bucket_cap_mb=bucket_cap_mb, broadcast_buffers=False, gradient_as_bucket_view=views
        )


DDP_BUCKET_CAP_MB = 25.0
"""DDP's default bucket size, used for ``ddp`` and PyTorch's hooks when the bench sets none."""


def install(name: str, model: nn.Module, bucket_cap_mb: Optional[float] = None) -> Installed:
    """Wrap ``model`` in DDP and set up configuration ``name`` on this rank.

    ``bucket_cap_mb``: the DDP bucket size; ``None`` gives each configuration its own default (DDP's 25 MB for
    ``ddp`` and PyTorch's hooks, the strategy's choice for ours, as in a fit).
    """
    world = dist.get_world_size()
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    steps = {"n": 0}

    def counted(dtype_bytes: int) -> Callable[[], float]:
        return lambda: steps["n"] * all_reduce_bytes(dtype_bytes * numel, world)

    dense_cap = DDP_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    if name == "ddp":
        ddp = _wrap(model, dense_cap)
        return Installed(ddp, counted(4), lambda: 0.0, {"steps": steps})
    if name == "torch_fp16":
        ddp = _wrap(model, dense_cap)
        timed = _TimedHook(default_hooks.fp16_compress_hook, default_hooks)
        ddp.register_comm_hook(None, _timed_hook_fn(timed))
        return Installed(
            ddp,
            counted(2),
            lambda: timed.seconds,
            {"steps": steps},
            thread_seconds=timed.work_seconds,
            wait_seconds=lambda: timed.wait_seconds,
        )
    if name == "torch_powersgd":
        ddp = _wrap(model, _SINGLE_BUCKET_MB)
        state = psgd.PowerSGDState(
            None, matrix_approximation_rank=4, start_powerSGD_iter=2, min_compression_rate=2, random_seed=0
        )
        timed = _TimedHook(psgd.powerSGD_hook, psgd)
        ddp.register_comm_hook(state, _timed_hook_fn(timed))
        # PyTorch counts the elements it all-reduces (P, Q and uncompressed tensors), all in fp32
        return Installed(
            ddp,
            lambda: all_reduce_bytes(4 * state.total_numel_after_compression, world),
            lambda: timed.seconds,
            {"state": state},
            thread_seconds=timed.work_seconds,
            wait_seconds=lambda: timed.wait_seconds,
        )
    return install_strategy(build_strategy(name), model, bucket_cap_mb)


def build_strategy(name: str) -> GradCompStrategy:
    """The strategy of configuration ``name`` (a preset, with its compressor's arguments after ``@``); raises
    ``ValueError`` naming the configuration for an unknown name or arguments its compressor refuses."""
    if not is_config(name) or name in BASELINES:
        raise ValueError(f"unknown benchmark configuration {name!r}; available: {', '.join(available_configs())}")
    preset, overrides = split_config(name)
    kwargs = PRESETS[preset][1]()
    if overrides:
        try:
            kwargs["compressor"] = type(kwargs["compressor"])(**overrides)
        except (TypeError, ValueError) as err:  # an unknown or a bad argument
            raise ValueError(f"configuration {name!r}: {err}") from None
    strategy = preset_class(preset)(**kwargs)
    assert isinstance(strategy, GradCompStrategy)
    return strategy


def install_strategy(strategy: GradCompStrategy, model: nn.Module, bucket_cap_mb: Optional[float] = None) -> Installed:
    """Wrap ``model`` in DDP and reduce with ``strategy``'s hook, built by ``strategy.make_hook`` (this rank).

    ``bucket_cap_mb``: the DDP bucket size; ``None`` takes the strategy's (its ``bucket_cap_mb`` argument or its
    compressor's preference), else DDP's 25 MB.

    The hook is bound to the strategy as in a fit (``strategy.hook``, ``set_layer_params``... act on it), and
    the strategy's ``layerwise`` callback, if any, is driven by a :class:`LayerwiseDriver`.
    """
    if bucket_cap_mb is None:
        bucket_cap_mb = strategy._ddp_kwargs.get("bucket_cap_mb") or DDP_BUCKET_CAP_MB
    ddp = _wrap(model, bucket_cap_mb, strategy._ddp_kwargs["gradient_as_bucket_view"])  # as in a fit
    names = {id(p): n for n, p in model.named_parameters()}
    device = next(model.parameters()).device
    hook = strategy.make_hook(Comm(None, CommStats()), names, device)
    strategy.bind_hook(hook)  # what GradCompStrategy._register_ddp_hooks does in a fit (there is no Trainer here)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    layerwise = None if strategy.layerwise is None else LayerwiseDriver(strategy.layerwise, strategy)
    return Installed(
        ddp,
        lambda: hook.stats.wire_bytes,
        lambda: hook.stats.hook_seconds,
        thread_seconds=lambda: hook.stats.comm_thread_seconds + hook.stats.callback_seconds,
        wait_seconds=lambda: hook.stats.wait_seconds,
        hook=hook,
        layerwise=layerwise,
    )
