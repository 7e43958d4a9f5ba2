"""Expected wire bytes of one hook call, per compressor family, from the formulas of ``lightning_gradcomp.comm``.

Each function adds the collectives in the order the code issues them, so the sums match ``CommStats``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lightning_gradcomp.comm import all_gather_bytes, all_reduce_bytes, broadcast_bytes
from lightning_gradcomp.compressors import CLTK, Cast, NoCompression, PowerSGD, RandomK, TopK
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.quantized import QuantizedCompressor, wire_bytes
from lightning_gradcomp.functional.lowrank import effective_rank, matrix_shape
from lightning_gradcomp.functional.sparsify import kept_count
from lightning_gradcomp.plan import BucketPlan, LayerSlot

__all__ = ["compressor_bytes", "hook_call_bytes"]


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def compressor_bytes(comp: Compressor, slots: Sequence[LayerSlot], params: Sequence[Any], world: int) -> float:
    """Bytes one rank sends in ``comp.reduce`` of the compressed ``slots`` with per-slot ``params``."""
    numels = [s.numel for s in slots]
    if isinstance(comp, QuantizedCompressor):
        codecs = [comp.codec(p) for p in params]
        return wire_bytes(numels, codecs, world, comp.aggregation, [s.name for s in slots])
    if isinstance(comp, (NoCompression, Cast)):
        dtype = torch.float32 if isinstance(comp, NoCompression) else comp.dtype
        return all_reduce_bytes(_size(dtype) * sum(numels), world)
    if isinstance(comp, PowerSGD):
        shapes = [matrix_shape(s.shape) for s in slots]
        ranks = [effective_rank(n, m, r) for (n, m), r in zip(shapes, params)]
        p_bytes = all_reduce_bytes(4 * sum(n * r for (n, _), r in zip(shapes, ranks)), world)
        return p_bytes + all_reduce_bytes(4 * sum(m * r for (_, m), r in zip(shapes, ranks)), world)
    if not isinstance(comp, (TopK, RandomK, CLTK)):
        raise NotImplementedError(f"no byte formula for {type(comp).__name__}: add one to tests/helpers/wire.py")
    ks = [kept_count(n, r) for n, r in zip(numels, params)]
    value = _size(comp.value_dtype)
    if isinstance(comp, (CLTK, TopK)):
        index = 2 if comp.index_coding == "delta16" else 4
        index_bytes = index * sum(comp.index_slots(n, k) for n, k in zip(numels, ks))
        if isinstance(comp, TopK):  # every rank's values and indices, gathered
            return all_gather_bytes(value * sum(ks) + index_bytes, world)
        return broadcast_bytes(index_bytes, world) + all_reduce_bytes(value * sum(ks), world)
    return all_reduce_bytes(value * sum(ks), world)  # RandomK: shared support, values only


def hook_call_bytes(comp: Compressor, plan: BucketPlan, params: Sequence[Any], world: int, compressing: bool) -> float:
    """Bytes of one ``GradCompHook`` call on a bucket: dense all-reduce, or dense part + NaN flag + compressor (no flag
    for a compressor that ``propagates_nonfinite``: its decision is made on the result)."""
    if not compressing:
        return all_reduce_bytes(4 * plan.numel, world)
    dense = sum(s.numel for s in plan.dense)
    flag = 0 if comp.propagates_nonfinite else 1
    head = all_reduce_bytes(4 * (dense + flag), world) if dense + flag else 0.0
    return head + compressor_bytes(comp, plan.compressed, params, world)
