"""Run one compressor reduction on W gloo ranks with known inputs (no DDP, no Lightning)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lightning_gradcomp.comm import Comm
from lightning_gradcomp.compressors.base import Compressor, ReduceContext
from lightning_gradcomp.plan import LayerSlot


def make_slots(shapes: Sequence[tuple[int, ...]]) -> list[LayerSlot]:
    """Consecutive compressed slots named ``layer<i>``."""
    slots, offset = [], 0
    for i, shape in enumerate(shapes):
        slot = LayerSlot(f"layer{i}", offset, tuple(shape), compressed=True)
        slots.append(slot)
        offset += slot.numel
    return slots


def rank_inputs(rank: int, shapes: Sequence[tuple[int, ...]], seed: int = 0) -> list[torch.Tensor]:
    """Deterministic per-rank flat fp32 inputs."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return [torch.randn(int(torch.tensor(s).prod()), generator=gen) for s in shapes]


def reduce_worker(rank: int, world_size: int, compressor: Compressor, shapes: Sequence[tuple[int, ...]],
                  params: Sequence[Any] | None = None, steps: int = 1, seed: int = 0) -> dict[str, Any]:
    """Reduce ``rank_inputs`` ``steps`` times (step = 0..steps-1); return the last results and the stats."""
    comm = Comm()
    slots = make_slots(shapes)
    outs: list[dict[str, Any]] = []
    for step in range(steps):
        tensors = rank_inputs(rank, shapes, seed + step)
        ctx = ReduceContext(comm, step, 0, slots, list(params) if params else [compressor.default_param] * len(slots))
        red = compressor.reduce([t.clone() for t in tensors], ctx)
        outs.append({
            "averaged": [t.clone() for t in red.averaged.wait()],
            "residuals": None if red.residuals is None else [t.clone() for t in red.residuals],
            "local": None if red.local is None else [t.clone() for t in red.local],
        })
    return {"steps": outs, "stats": comm.stats.state_dict()}
