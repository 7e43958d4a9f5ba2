"""PyTorch's DDP hooks (``ddp``, ``torch_fp16``, ``torch_powersgd``) calibrated at ``W = 1``: their module's
``torch.distributed`` replaced by a recorder that completes every all-reduce at once and records its payload (see
:mod:`lightning_gradcomp.advise.calibrate`)."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.advise.costs import Collective
from lightning_gradcomp.advise.step_recorder import _Recorder
from lightning_gradcomp.comm import completed_future

__all__: list[str] = []  # the calibration's own parts: _recording, _timed_hook, _as_comm_hook


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
