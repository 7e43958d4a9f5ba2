"""Byte-counting wrappers over ``torch.distributed`` collectives.

Every collective the library issues goes through :class:`Comm`, which adds the bytes *this rank*
puts on the wire to a :class:`CommStats`, using the standard bandwidth-optimal algorithm formulas
(``B`` is the payload of one rank in bytes, ``W`` the world size). For the one asymmetric collective,
broadcast, the figure is the mean over ranks: any broadcast tree or chain delivers ``B`` to each of the
``W - 1`` other ranks, so ``(W - 1) B`` bytes cross the network in total, however the senders share them
(gloo's root sends them all; NCCL's ring passes them along).

=====================  ===============================
collective             bytes sent per rank
=====================  ===============================
all-reduce (ring)      ``2 (W - 1) / W * B``
all-gather             ``(W - 1) * B``
broadcast              ``(W - 1) / W * B`` (mean)
all-to-all             ``(W - 1) / W * B``
all-to-all (uneven)    the elements this rank sends to the other ranks
point-to-point send    ``B``
=====================  ===============================

The formulas are pure functions so tests can check counts against them without processes.

With ``GradCompStrategy(hierarchy=...)`` the hook also reduces inside each node: a :class:`Comm` made with
``intra=True`` counts its bytes as :attr:`CommStats.intra_bytes` (fast links), and ``wire_bytes`` are then the
bytes sent over the slow, inter-node links only.

:func:`then_same_numerics` is how every ``Future`` callback that computes floating-point results is attached:
it makes the callback compute the same bits whichever thread runs it.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, TypeVar, Union, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.failures import TIMEOUT_SETTING, ExplainedWork, explained

__all__ = [
    "Comm",
    "CommStats",
    "LayerStats",
    "all_gather_bytes",
    "all_reduce_bytes",
    "all_to_all_bytes",
    "broadcast_bytes",
    "completed_future",
    "compression_ratio",
    "p2p_bytes",
    "sparse_payload_bytes",
    "then_same_numerics",
]

T = TypeVar("T")

LayerShares = Sequence[tuple[str, int]]
"""(layer name, number of elements of the payload that belong to that layer)."""


def all_reduce_bytes(payload_bytes: int, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``payload_bytes``."""
    return 2.0 * (world_size - 1) / world_size * payload_bytes


def all_gather_bytes(payload_bytes: int, world_size: int) -> float:
    """Bytes one rank sends in an all-gather where every rank contributes ``payload_bytes``."""
    return float((world_size - 1) * payload_bytes)


def broadcast_bytes(payload_bytes: int, world_size: int) -> float:
    """Mean bytes per rank of a broadcast of ``payload_bytes``: ``(W - 1) B`` in total over ``W`` ranks."""
    return (world_size - 1) / world_size * payload_bytes


def all_to_all_bytes(payload_bytes: int, world_size: int) -> float:
    """Bytes one rank sends in an all-to-all of a ``payload_bytes`` input split into W chunks."""
    return (world_size - 1) / world_size * payload_bytes


def p2p_bytes(payload_bytes: int, world_size: int) -> float:
    """Bytes sent by a point-to-point send of ``payload_bytes``."""
    return float(payload_bytes)


def compression_ratio(dense_bytes: float, wire_bytes: float) -> float:
    """The compression, dense / wire bytes: how many times fewer bytes were sent than dense DDP would have sent.

    ``dense_bytes / wire_bytes`` when something was sent; ``1.0`` when nothing was due and nothing was sent (no
    traffic yet: nothing saved); ``inf`` when bytes were due but none were sent (a layer that another rank owns
    under ``hierarchy=``, a one-node hierarchy, LocalSGD's local steps before the first synchronization).
    :attr:`CommStats.compression_ratio`, :attr:`LayerStats.compression`, ``CompressionLogger``, ``CompressionGuard``
    and ``lightning-gradcomp report`` all use it.

    Example::

        >>> compression_ratio(400.0, 100.0), compression_ratio(0.0, 0.0), compression_ratio(400.0, 0.0)
        (4.0, 1.0, inf)
    """
    if wire_bytes > 0:
        return dense_bytes / wire_bytes
    return math.inf if dense_bytes > 0 else 1.0


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


@dataclass
class LayerStats:
    """Cumulative per-layer figures for one rank (bytes are summed over steps)."""

    numel: int = 0
    compressed: bool = False
    param: Optional[float] = None
    wire_bytes: float = 0.0
    dense_bytes: float = 0.0

    @property
    def compression(self) -> float:
        """Dense-equivalent bytes divided by wire bytes (:func:`compression_ratio`)."""
        return compression_ratio(self.dense_bytes, self.wire_bytes)

    @property
    def ratio(self) -> float:
        """Deprecated name of :attr:`compression` (warns)."""
        warnings.warn("`LayerStats.ratio` is deprecated: use `.compression`", DeprecationWarning, stacklevel=2)
        return self.compression


_CALLBACK_LOCK = threading.Lock()


@dataclass
class CommStats:
    """Cumulative communication figures of one rank.

    Attributes:
        wire_bytes: bytes this rank put on the wire, by the formulas in this module; with
            ``hierarchy=`` the inter-node bytes only (collectives over the cross-node group).
        intra_bytes: with ``hierarchy=``, the bytes of the collectives inside the node (fast links); 0 when flat.
        dense_bytes: bytes dense DDP (fp32 ring all-reduce of every bucket over all W ranks) would have sent.
        steps: optimizer steps whose gradients went through the hook.
        compressed_steps: steps at which the compressor ran (after ``start_step``).
        collectives: number of collectives issued.
        nonfinite_steps: buckets that held NaN/Inf on some rank and were reduced densely.
        hook_seconds: wall time the hook blocks the autograd thread (queueing a bucket: small).
        comm_thread_seconds: wall time the communication thread spends on buckets (compression, decoding,
            and waits for the collectives it needs in line; the last collective of a bucket runs on).
        wait_seconds: the part of ``comm_thread_seconds`` spent blocked in collectives (the blocking calls of
            :class:`Comm` and the hook's explicit waits).
        callback_seconds: wall time of the Future callbacks (decoding, writing the result into the bucket) that
            ran after their collective completed, on the thread that completed it (gloo's); callbacks that ran
            inline are part of ``comm_thread_seconds``. ``comm_thread_seconds - wait_seconds + callback_seconds``
            is the compression work.
        layers: per-layer figures, keyed by parameter name.
    """

    wire_bytes: float = 0.0
    intra_bytes: float = 0.0
    dense_bytes: float = 0.0
    steps: int = 0
    compressed_steps: int = 0
    collectives: int = 0
    nonfinite_steps: int = 0
    hook_seconds: float = 0.0
    comm_thread_seconds: float = 0.0
    wait_seconds: float = 0.0
    callback_seconds: float = 0.0
    layers: dict[str, LayerStats] = field(default_factory=dict)

    @property
    def compression_ratio(self) -> float:
        """Dense-equivalent bytes divided by wire bytes (:func:`compression_ratio`: 1.0 before any traffic)."""
        return compression_ratio(self.dense_bytes, self.wire_bytes)

    def layer(self, name: str) -> LayerStats:
        """The (created on demand) figures of one layer."""
        if name not in self.layers:
            self.layers[name] = LayerStats()
        return self.layers[name]

    def add_wire(self, nbytes: float, shares: Optional[LayerShares] = None) -> None:
        """Count ``nbytes`` sent, attributing them to layers in proportion to ``shares``."""
        self.wire_bytes += nbytes
        self.collectives += 1
        if not shares:
            return
        total = sum(n for _, n in shares)
        if total <= 0:
            return
        for name, n in shares:
            self.layer(name).wire_bytes += nbytes * n / total

    def add_callback(self, seconds: float) -> None:
        """Add ``seconds`` to :attr:`callback_seconds` (safe from several threads at once)."""
        with _CALLBACK_LOCK:
            self.callback_seconds += seconds

    def add_intra(self, nbytes: float) -> None:
        """Count ``nbytes`` sent inside the node (``hierarchy=``: fast links; not attributed to layers)."""
        self.intra_bytes += nbytes
        self.collectives += 1

    def state_dict(self) -> dict[str, Any]:
        """Plain, ``weights_only``-loadable representation."""
        return {
            "wire_bytes": self.wire_bytes,
            "intra_bytes": self.intra_bytes,
            "dense_bytes": self.dense_bytes,
            "steps": self.steps,
            "compressed_steps": self.compressed_steps,
            "collectives": self.collectives,
            "nonfinite_steps": self.nonfinite_steps,
            "hook_seconds": self.hook_seconds,
            "comm_thread_seconds": self.comm_thread_seconds,
            "wait_seconds": self.wait_seconds,
            "callback_seconds": self.callback_seconds,
            "layers": {k: dict(vars(v)) for k, v in self.layers.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        for key in (
            "wire_bytes",
            "intra_bytes",
            "dense_bytes",
            "steps",
            "compressed_steps",
            "collectives",
            "nonfinite_steps",
            "hook_seconds",
            "comm_thread_seconds",
            "wait_seconds",
            "callback_seconds",
        ):
            setattr(self, key, state.get(key, getattr(self, key)))
        self.layers = {k: LayerStats(**v) for k, v in state.get("layers", {}).items()}


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def sparse_payload_bytes(tensor: Tensor) -> int:
    """Bytes of a sparse COO tensor's payload: its indices (int64, ``sparse_dim x nnz``) and its values."""
    return tensor._indices().numel() * 8 + tensor._values().numel() * tensor.element_size()


class Comm:
    """Collectives over one process group that count the bytes this rank sends.

    Args:
        group: the process group (``None``: the default group).
        stats: where counts go (a new :class:`CommStats` when omitted).
        intra: the group is inside one node (``hierarchy=``): bytes go to ``stats.intra_bytes``, not
            ``stats.wire_bytes``.
        timeout_setting: the argument that sets the group's timeout, named when a collective times out
            (:func:`~lightning_gradcomp.failures.timeout_message`).
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        stats: Optional[CommStats] = None,
        *,
        intra: bool = False,
        timeout_setting: str = TIMEOUT_SETTING,
    ) -> None:
        self.group = group
        self.stats = stats if stats is not None else CommStats()
        self.intra = intra
        self.timeout_setting = timeout_setting
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def _count(self, nbytes: float, shares: Optional[LayerShares]) -> None:
        if self.intra:
            self.stats.add_intra(nbytes)
        else:
            self.stats.add_wire(nbytes, shares)

    def waiting(self) -> _Waiting:
        """A context that adds its wall time to ``stats.wait_seconds`` (a blocking collective or wait)."""
        return _Waiting(self.stats)

    def _explained(self, collective: str) -> Any:
        """A context raising a timeout of ``collective`` on this group in plain words (:mod:`~.failures`)."""
        return explained(collective, self.group, self.timeout_setting)

    def _resolving_to(self, collective: str, work: dist.Work, value: Callable[[Any], Any]) -> Future:
        """``work``'s Future, resolving to ``value(result)`` once it completes, or to its error (explained; never a
        value after a failed collective)."""

        def done(fut: Future) -> Any:
            with self._explained(collective):
                return value(fut.value())  # raises the collective's error

        return work.get_future().then(done)

    @overload
    def all_reduce(
        self, tensor: Tensor, *, async_op: Literal[False] = False, op: Any = ..., shares: Optional[LayerShares] = None
    ) -> None: ...

    @overload
    def all_reduce(
        self, tensor: Tensor, *, async_op: Literal[True], op: Any = ..., shares: Optional[LayerShares] = None
    ) -> Future: ...

    def all_reduce(
        self,
        tensor: Tensor,
        *,
        async_op: bool = False,
        op: Any = dist.ReduceOp.SUM,
        shares: Optional[LayerShares] = None,
    ) -> Optional[Future]:
        """In-place sum (or ``op``) across ranks. With ``async_op`` returns a ``Future[Tensor]``.

        A sparse COO ``tensor`` (a sparse gradient) is all-gathered by the backend (gloo gathers every rank's indices
        and values, then sums them locally): counted as :func:`all_gather_bytes` of :func:`sparse_payload_bytes`
        (the backend's few bytes of sizes left out)."""
        if tensor.is_sparse:
            self._count(all_gather_bytes(sparse_payload_bytes(tensor), self.world_size), shares)
        else:
            self._count(all_reduce_bytes(_nbytes(tensor), self.world_size), shares)
        if not async_op:
            with self.waiting(), self._explained("all_reduce"):
                dist.all_reduce(tensor, op=op, group=self.group)
            return None
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        return self._resolving_to("all_reduce", work, lambda result: result[0])

    @overload
    def all_gather(
        self, tensor: Tensor, *, async_op: Literal[False] = False, shares: Optional[LayerShares] = None
    ) -> Tensor: ...

    @overload
    def all_gather(
        self, tensor: Tensor, *, async_op: Literal[True], shares: Optional[LayerShares] = None
    ) -> Future: ...

    def all_gather(
        self, tensor: Tensor, *, async_op: bool = False, shares: Optional[LayerShares] = None
    ) -> Union[Tensor, Future]:
        """Gather equal-sized ``tensor`` from every rank: shape ``(W, *tensor.shape)``, or with ``async_op`` a
        ``Future`` resolving to it (``tensor`` must then stay unchanged until it completes)."""
        self._count(all_gather_bytes(_nbytes(tensor), self.world_size), shares)
        out = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        flat, shaped = tensor.contiguous().reshape(-1), out.view(self.world_size, *tensor.shape)
        if not async_op:
            with self.waiting(), self._explained("all_gather"):
                gather(out, flat, group=self.group)
            return shaped
        return self._resolving_to("all_gather", gather(out, flat, group=self.group, async_op=True), lambda _: shaped)

    def broadcast(self, tensor: Tensor, src: int, *, shares: Optional[LayerShares] = None) -> None:
        """In-place broadcast of ``tensor`` from group rank ``src``."""
        self._count(broadcast_bytes(_nbytes(tensor), self.world_size), shares)
        with self.waiting(), self._explained("broadcast"):
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group)

    def all_to_all(self, output: Tensor, tensor: Tensor, *, shares: Optional[LayerShares] = None) -> None:
        """Exchange equal chunks: chunk ``j`` of ``tensor`` goes to rank ``j``, into ``output``."""
        self._count(all_to_all_bytes(_nbytes(tensor), self.world_size), shares)
        with self.waiting(), self._explained("all_to_all"):
            dist.all_to_all_single(output, tensor, group=self.group)

    @overload
    def all_to_all_uneven(
        self,
        output: Tensor,
        tensor: Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        async_op: Literal[False] = False,
    ) -> None: ...

    @overload
    def all_to_all_uneven(
        self,
        output: Tensor,
        tensor: Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        async_op: Literal[True],
    ) -> Future: ...

    def all_to_all_uneven(
        self,
        output: Tensor,
        tensor: Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        async_op: bool = False,
    ) -> Optional[Future]:
        """Exchange uneven chunks of 1-D tensors: ``tensor``'s chunk ``j`` (``input_splits[j]`` elements) goes to
        rank ``j``; rank ``j``'s chunk for this rank lands in ``output``'s chunk ``j`` (``output_splits[j]``).
        Counts the elements sent to the other ranks. With ``async_op`` returns a ``Future[Tensor]`` (``output``)."""
        sent = sum(input_splits) - input_splits[self.rank]
        self._count(float(sent * tensor.element_size()), None)
        out_splits, in_splits = list(output_splits), list(input_splits)
        if not async_op:
            with self.waiting(), self._explained("all_to_all"):
                dist.all_to_all_single(output, tensor, out_splits, in_splits, group=self.group)
            return None
        work = dist.all_to_all_single(output, tensor, out_splits, in_splits, group=self.group, async_op=True)
        return self._resolving_to("all_to_all", work, lambda _: output)

    def exchange(
        self, send: Tensor, recv: Tensor, peer: int, *, async_op: bool = False, shares: Optional[LayerShares] = None
    ) -> list[ExplainedWork]:
        """Send ``send`` to and receive ``recv`` from group rank ``peer`` (both posted together); the handles'
        ``wait()`` raises a timeout in plain words."""
        self._count(p2p_bytes(_nbytes(send), self.world_size), shares)
        global_peer = dist.get_global_rank(self.group, peer) if self.group else peer
        ops = [
            dist.P2POp(dist.isend, send, global_peer, self.group),
            dist.P2POp(dist.irecv, recv, global_peer, self.group),
        ]
        what = f"exchange (send and receive) with rank {global_peer}"
        works = [ExplainedWork(work, what, self.group, self.timeout_setting) for work in dist.batch_isend_irecv(ops)]
        if not async_op:
            with self.waiting():
                for work in works:
                    work.wait()
        return works


class _Waiting:
    """Adds the wall time of its ``with`` block to ``stats.wait_seconds``."""

    def __init__(self, stats: CommStats) -> None:
        self.stats = stats

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.stats.wait_seconds += time.perf_counter() - self._start
