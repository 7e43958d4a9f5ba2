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

The formulas are in :mod:`lightning_gradcomp.wire_bytes`, the counters in :mod:`lightning_gradcomp.comm_stats` and
the ``Future`` helpers in :mod:`lightning_gradcomp.futures`; this module re-exports them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Optional, Union, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.comm_stats import _CALLBACK_LOCK as _CALLBACK_LOCK
from lightning_gradcomp.comm_stats import CommStats, LayerShares, LayerStats
from lightning_gradcomp.failures import TIMEOUT_SETTING, ExplainedWork, explained
from lightning_gradcomp.futures import T as T
from lightning_gradcomp.futures import completed_future, then_same_numerics
from lightning_gradcomp.wire_bytes import (
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
    broadcast_bytes,
    compression_ratio,
    p2p_bytes,
    sparse_payload_bytes,
)

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


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


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
