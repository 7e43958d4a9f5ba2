"""Helpers for ``torch.futures.Future``: one already resolved, and callbacks that compute the same bits whichever
thread runs them (:func:`then_same_numerics`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Optional, TypeVar

import torch
from torch.futures import Future

from lightning_gradcomp.comm_stats import CommStats

__all__ = ["completed_future", "then_same_numerics"]

T = TypeVar("T")


def completed_future(value: Any) -> Future:
    """A Future that is already resolved with ``value``."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


def then_same_numerics(fut: Future, fn: Callable[[Future], T], stats: Optional[CommStats] = None) -> Future:
    """``fut.then(fn)``, with ``fn`` computing the same bits on whichever thread runs it.

    A callback runs inline when ``fut`` is already complete and otherwise on the thread that completes it
    (a gloo worker thread), so the thread differs between ranks and between runs. The intra-op thread count
    is per thread: ``torch.set_num_threads`` sets OpenMP's and MKL's count for the calling thread only, and a
    thread that has run no parallel ATen op yet (gloo's, in a small callback) calls MKL with MKL's default
    count (all cores). A GEMM split over another number of threads rounds differently: on torch 2.13 CPU
    (MKL 2024.2) ``p @ q.T`` with ``p`` of shape ``10 x 2`` and ``q`` of shape ``512 x 2`` differs between 1
    and 2 threads, and PowerSGD replicas drifted apart. So the calling thread's count is recorded here and set
    on the thread that runs ``fn``.

    The rest of what ATen's CPU kernels read is process-wide, except two per-thread settings left alone: the
    denormal mode (``torch.set_flush_denormal``), which gloo's threads inherit when ``init_process_group``
    creates them, and autocast, which Lightning enables for the forward pass only.

    On CUDA, ``fn`` also continues the caller's stream. PyTorch runs a CUDA Future's callback on a fresh pool stream
    that waits only for the collective, so a callback reading a tensor the caller wrote after launching the collective
    (RandomK's output positions, computed while its values travel) could read it before it was written: seen on an
    H200 as a device-side "index out of bounds" in ``scatter_add_``, in one fit of five. So ``fn`` runs on the
    caller's stream after that stream waits for the callback's stream (the collective), and the callback's stream
    then waits for ``fn``'s work, on which the returned Future records its completion. Two event waits, no host sync;
    every tensor ``fn`` allocates and frees stays on one stream, as the caching allocator requires.

    Args:
        fut: the Future to chain on.
        fn: the callback; it receives the completed ``fut``.
        stats: where the callback's wall time goes (:attr:`CommStats.callback_seconds`) when it runs on another
            thread than this one (inline, it is part of the caller's own time).

    Returns:
        The Future of ``fn``'s result.
    """
    threads = torch.get_num_threads()
    caller = threading.get_ident()
    stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None

    def timed(done: Future) -> T:
        torch.set_num_threads(threads)  # a no-op on the calling thread; ~0.1 us
        if stats is None or threading.get_ident() == caller:
            return fn(done)
        start = time.perf_counter()
        try:
            return fn(done)
        finally:
            stats.add_callback(time.perf_counter() - start)

    def run(done: Future) -> T:
        if stream is None:
            return timed(done)
        callback_stream = torch.cuda.current_stream(stream.device)
        stream.wait_stream(callback_stream)
        with torch.cuda.stream(stream):
            result = timed(done)
        callback_stream.wait_stream(stream)
        return result

    return fut.then(run)
