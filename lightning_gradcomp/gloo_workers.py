"""Run a function on W forked CPU processes joined by a gloo process group, without Lightning.

For checking a compressor or a collective on one machine (the package's tests and benchmarks use it): each rank
calls ``fn(rank, world_size, *args)`` inside an initialised ``gloo`` group, and the parent gets the return values
back in rank order. Processes are forked (POSIX only), so ``fn`` and ``args`` need not be picklable; the return
values travel through ``torch.save``.

Ports: :func:`free_port` asks the kernel for one, or takes them from ``$LIGHTNING_GRADCOMP_PORTS`` (``"LO-HI"``).
Give each of several suites or benchmarks run side by side on one machine its own range (the test suite does so per
pytest-xdist worker): ports the kernel hands out to one process may be handed to another before the first binds it.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import queue
import random
import socket
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["PORTS_ENV", "free_port", "port_range", "run_workers"]

PORTS_ENV = "LIGHTNING_GRADCOMP_PORTS"
"""Environment variable naming the range :func:`free_port` takes ports from, ``"LO-HI"`` (inclusive)."""

_next_port: dict[tuple[int, int], int] = {}  # per range: where this process's next search starts


def port_range() -> Optional[tuple[int, int]]:
    """``(lo, hi)`` from ``$LIGHTNING_GRADCOMP_PORTS`` (``"LO-HI"``, ``1024 <= LO <= HI <= 65535``), or ``None``.

    Raises:
        ValueError: the variable is set but malformed or out of range.
    """
    spec = os.environ.get(PORTS_ENV, "").strip()
    if not spec:
        return None
    try:
        lo, hi = (int(part) for part in spec.split("-"))
    except ValueError:
        lo = hi = -1
    if not 1024 <= lo <= hi <= 65535:
        raise ValueError(f"{PORTS_ENV} must be 'LO-HI' with 1024 <= LO <= HI <= 65535, got {spec!r}")
    return lo, hi


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT``).

    The kernel picks it, unless ``$LIGHTNING_GRADCOMP_PORTS`` names a range: then it is the next port of that range
    that binds, going round from a random start per process, so a process does not reuse a port soon.

    Raises:
        OSError: no port of the range binds.
        ValueError: ``$LIGHTNING_GRADCOMP_PORTS`` is malformed.
    """
    span = port_range()
    if span is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    lo, hi = span
    count = hi - lo + 1
    start = _next_port.get(span)
    if start is None:
        start = random.SystemRandom().randrange(count)  # not the seeded generator: processes must differ
    for step in range(count):
        offset = (start + step) % count
        if _binds(lo + offset):
            _next_port[span] = (offset + 1) % count
            return lo + offset
    raise OSError(f"no free port in {PORTS_ENV}={lo}-{hi}")


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, conn: Connection) -> None:
    # Never collect what the parent left: a gloo process group it holds in a reference cycle would be freed here,
    # and its destructor joins worker threads that fork did not copy, so the rank would hang for good.
    gc.freeze()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buffer = io.BytesIO()  # plain bytes: shared-memory tensors would vanish when this process exits
        torch.save(result, buffer)
        message: tuple[bool, Any] = (True, buffer.getvalue())
    except BaseException:  # report the failure to the parent instead of hanging it
        message = (False, traceback.format_exc())
    # sent whole before any teardown: send_bytes returns once the parent can read all of it, so even a crash while
    # the process group is destroyed or the interpreter exits cannot cut the message short
    conn.send_bytes(pickle.dumps(message))
    conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks; return the results by rank.

    Each rank runs with one intra-op thread, ``MASTER_ADDR=127.0.0.1`` and a fresh free port, and destroys its
    process group on the way out. Each rank sends its result on its own pipe, so a rank that dies (a signal, an
    abort in native code) is reported, never waited for. A parent that has run MKL matrix products should have
    started with ``MKL_DISABLE_FAST_MM=1`` (the test suite sets it): a child forked from MKL's per-thread memory
    manager once spun in it for good. Each rank leaves the objects it inherited to the parent (``gc.freeze``): a
    gloo process group that the parent keeps as garbage would otherwise hang the rank that collects it.

    Args:
        fn: called once per rank after ``init_process_group("gloo")``; its return value (tensors, containers,
            numbers) is sent back to the parent.
        world_size: number of processes.
        *args: passed to ``fn`` after ``rank`` and ``world_size``.
        timeout: seconds to wait for each next rank's result before giving up.

    Raises:
        AssertionError: a rank raised (the message holds its traceback) or died before sending its result.
        queue.Empty: no result arrived within ``timeout`` (the ranks still alive are killed).

    Example::

        >>> def total(rank, world_size):
        ...     t = torch.tensor([rank + 1.0])
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> run_workers(total, 2)  # doctest: +SKIP
        [3.0, 3.0]
    """
    ctx = mp.get_context("fork")
    port = free_port()
    procs: list[Any] = []
    readers: dict[Connection, int] = {}
    for rank in range(world_size):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, writer))
        proc.start()
        writer.close()  # the rank holds the only writer left: its death ends the pipe
        procs.append(proc)
        readers[reader] = rank
    results: dict[int, Any] = {}
    try:
        while readers:
            ready = wait(list(readers), timeout=timeout)
            if not ready:
                raise queue.Empty(f"no result from ranks {sorted(readers.values())} within {timeout} s")
            for done in ready:
                assert isinstance(done, Connection)
                rank = readers.pop(done)
                try:
                    ok, value = pickle.loads(done.recv_bytes())
                except EOFError:
                    procs[rank].join(timeout=10)
                    raise AssertionError(
                        f"rank {rank} died before sending its result (exit code {procs[rank].exitcode})"
                    ) from None
                finally:
                    done.close()
                if not ok:
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for reader in readers:
            reader.close()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in range(world_size)]
