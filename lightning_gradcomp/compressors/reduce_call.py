"""The two ends of one :meth:`~.base.Compressor.reduce` call: what the compressor is given (:class:`ReduceContext`:
the collectives, the step, the bucket's slots and parameters, its seeded generators, the buffers to write into) and
what it gives back (:class:`Reduction`: the Future of the averaged slots, the residuals, its own contribution)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.comm import Comm
from lightning_gradcomp.plan import LayerSlot

__all__ = ["ReduceContext", "Reduction"]


@dataclass
class ReduceContext:
    """What a compressor may use while reducing one bucket.

    Attributes:
        comm: byte-counting collectives.
        step: global optimizer-step counter (identical on all ranks).
        bucket_index: DDP bucket index.
        slots: the compressed slots, in buffer order.
        params: per-slot compression parameter (``ratio``, ``rank``, ``bits``...), in slot order.
        seed: the strategy's seed.
        observed: whether an observer reads this reduction's :attr:`Reduction.local` (a compressor may skip
            computing it when not).
        outputs: per slot, the bucket's flat fp32 slice, which the compressor may fill with its averaged result and
            return once it no longer reads its inputs: the engine then copies nothing back. Its contents are dead,
            except for a compressor that borrows its inputs (:attr:`Compressor.borrows_inputs`): then these are the
            inputs themselves. ``None`` when there are none (see :meth:`output`).
        outputs_zeroed: whether the engine already zeroed :attr:`outputs` (for a compressor with
            :attr:`Compressor.sparse_outputs`, while it compensated): :meth:`output` then hands them out as they are.
        early: per slot, what :meth:`Compressor.precompute` returned when the engine called it ahead of
            :meth:`Compressor.reduce` (see :meth:`precomputed`); ``None`` when it did not.
    """

    comm: Comm
    step: int
    bucket_index: int
    slots: Sequence[LayerSlot]
    params: Sequence[Any]
    seed: int = 0
    observed: bool = True
    outputs: Optional[Sequence[Tensor]] = None
    outputs_zeroed: bool = False
    early: Optional[list[Any]] = None

    def precomputed(self, index: int) -> Any:
        """What :meth:`Compressor.precompute` returned for slot ``index`` ahead of the reduction, or ``None`` (not
        called, or nothing to do on this rank): the compressor then does that work itself."""
        return None if self.early is None else self.early[index]

    def output(self, index: int, like: Tensor) -> Tensor:
        """A zeroed fp32 tensor for slot ``index``'s averaged result: :attr:`outputs` ``[index]`` when there is one,
        else a fresh one of ``like``'s size and device."""
        if self.outputs is not None:
            return self.outputs[index] if self.outputs_zeroed else self.outputs[index].zero_()
        return torch.zeros(like.numel(), dtype=torch.float32, device=like.device)

    @property
    def rank(self) -> int:
        """This rank in the reducing group."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.comm.world_size

    def generator(self, device: torch.device, *, shared: bool, salt: Union[int, str]) -> torch.Generator:
        """A generator seeded from ``(seed, step, rank or "shared", salt)``, identical across runs.

        ``shared=True`` gives every rank the same stream (shared indices, shared initialisation);
        ``shared=False`` gives independent per-rank streams (stochastic rounding). Pass the layer name
        as ``salt`` for per-layer streams: they then do not depend on how DDP groups layers into buckets
        (which differs in the first step after a resume), so resumed runs reproduce uninterrupted ones.
        """
        who = "shared" if shared else f"rank{self.rank}"
        key = f"{self.seed}/{self.step}/{who}/{salt}".encode()
        gen = torch.Generator(device=device)
        gen.manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1))
        return gen

    def shares(self, counts: Sequence[int]) -> list[tuple[str, int]]:
        """Attribution of a concatenated payload (``counts[i]`` elements of slot ``i``)."""
        return [(slot.name, int(c)) for slot, c in zip(self.slots, counts)]


@dataclass
class Reduction:
    """The result of :meth:`Compressor.reduce`.

    Attributes:
        averaged: resolves to one flat fp32 tensor per slot: ``(1/W) * sum_i c_i``.
        residuals: per-slot ``p - c`` for error feedback (``None`` when unused).
        local: optionally, this rank's decoded contribution ``c`` per slot, for compressors without
            error feedback; observers (compression-error logging) use it when present.
        result_nonfinite: set, by the time :attr:`averaged` resolves, by a compressor that
            :attr:`Capabilities.propagates_nonfinite` and checked its averaged values for NaN/Inf while decoding
            (whether it found any); the engine then checks only the dense slots itself. ``None``: the engine checks
            the whole bucket. (The compressor reports through its result; :class:`ReduceContext` only flows in.)
    """

    averaged: Future
    residuals: Optional[list[Tensor]] = None
    local: Optional[Sequence[Tensor]] = None
    result_nonfinite: Optional[bool] = None
