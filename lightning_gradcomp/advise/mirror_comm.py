"""MirrorComm: a ``Comm`` standing for ``W`` ranks with identical gradients, moving no bytes and recording each
collective (see :mod:`lightning_gradcomp.advise.calibrate`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.advise.costs import Collective
from lightning_gradcomp.advise.step_recorder import _Recorder
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

__all__ = ["MirrorComm"]


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
