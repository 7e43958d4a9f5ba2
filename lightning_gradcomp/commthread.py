"""One ordered communication thread per process: runs each bucket's protocol off the autograd thread.

The hook engine hands every bucket to :class:`CommThread` and returns a ``Future`` at once, so backward goes on
computing the next buckets' gradients while this thread compensates, compresses and communicates. Jobs run
strictly in submission order (DDP calls the hook in the same bucket order on every rank), so every rank issues
the hook's collectives in the same order: the rule that keeps gloo and NCCL from deadlocking. No other thread
may issue collectives on the hook's process group while a job is pending, so ``GradCompStrategy`` gives the hook
a group of its own (a model's collectives during backward, such as SyncBatchNorm's, stay on DDP's group). On a
shared group the hook drains the thread in the last bucket's call (:meth:`CommThread.drain`: every job has
*issued* its collectives), before DDP issues its own collective on the group (the all-reduce of the
used-parameter map with ``find_unused_parameters=True``), and Lightning, callbacks and checkpoints use the groups
only after ``backward()``, which waits for every bucket.

A job may return a value or a ``Future``; the job's ``Future`` resolves with that value, or when that Future
does (a compressor's last collective may still be in flight when the job returns, so the thread starts the
next bucket at once). An exception in a job fails its ``Future`` (DDP then raises it from ``backward()``, as a
``RuntimeError`` with its message only, so the message gets the exception's type and the frames where it was
raised appended).

Numerics: the thread runs each job with the submitting thread's intra-op thread count (MKL and OpenMP counts
are per thread, and a GEMM split over another number of threads rounds differently), so results are the bits
the training thread would compute. On CUDA the job runs on the thread's own stream, after an event recorded on
the submitting thread's current stream, and the stream is synchronized (on this thread, never the training
thread) before the ``Future`` resolves.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
from torch.futures import Future

__all__ = ["CommThread"]

Job = Callable[[], Any]

_FUTURES = (Future, torch._C.Future)
"""Futures made in Python and those returned by C++ (``Work.get_future().then(...)``)."""


class CommThread:
    """A daemon thread that runs submitted jobs one at a time, in order, and resolves their Futures.

    Args:
        name: the thread's name (shown in stack dumps).
    """

    def __init__(self, name: str = "gradcomp-comm") -> None:
        self._jobs: queue.SimpleQueue[Optional[tuple[Job, Future, int, Any]]] = queue.SimpleQueue()
        self._streams: dict[torch.device, Any] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the thread still runs jobs."""
        return self._thread.is_alive()

    def submit(self, job: Job, device: Optional[torch.device] = None) -> Future:
        """Queue ``job`` (run after every job submitted before it); returns the Future of its result.

        Args:
            job: a callable without arguments returning a value or a ``Future``.
            device: the device of the tensors ``job`` touches (for CUDA stream ordering); ``None`` for CPU.
        """
        fut: Future = Future()
        event = None
        if device is not None and device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        self._jobs.put((job, fut, torch.get_num_threads(), (device, event)))
        return fut

    def drain(self) -> None:
        """Wait until every job submitted so far has run (its collectives are issued; the last may be in flight)."""
        self.submit(lambda: None).wait()

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the queued jobs (idempotent)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout)

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut, threads, (device, event) = item
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            try:
                if event is not None:
                    self._run_cuda(job, fut, device, event)
                else:
                    _resolve(fut, job())
            except BaseException as err:  # noqa: BLE001 - every failure must reach the waiting backward pass
                fut.set_exception(_located(err))

    def _run_cuda(self, job: Job, fut: Future, device: torch.device, event: Any) -> None:
        torch.cuda.set_device(device)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_event(event)
        with torch.cuda.stream(stream):
            result = job()
            if isinstance(result, _FUTURES):
                result = result.wait()
        stream.synchronize()  # on this thread: the training thread never waits on the device
        fut.set_result(result)


def _located(err: BaseException, frames: int = 4) -> BaseException:
    """``err``, its message followed by its type and the last ``frames`` frames where it was raised on this thread.

    DDP re-raises a failed hook Future from ``backward()`` as a ``RuntimeError`` carrying only the message, so the
    type and the place would be lost. Only a single string argument is extended (other exceptions pass unchanged).

    Example::

        >>> try:
        ...     raise ValueError("bad")
        ... except ValueError as e:
        ...     str(_located(e)).startswith("bad (ValueError on the communication thread, at ")
        True
    """
    if len(err.args) == 1 and isinstance(err.args[0], str):
        where = "; ".join(
            f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in traceback.extract_tb(err.__traceback__)[-frames:]
        )
        err.args = (f"{err.args[0]} ({type(err).__name__} on the communication thread, at {where})",)
    return err


def _resolve(fut: Future, result: Any) -> None:
    """Resolve ``fut`` with ``result``, or when ``result`` (a Future) resolves, with its value or error."""
    if not isinstance(result, _FUTURES):
        fut.set_result(result)
        return

    def forward(done: Future) -> None:
        try:
            fut.set_result(done.value())
        except BaseException as err:  # noqa: BLE001
            fut.set_exception(err)

    result.add_done_callback(forward)
