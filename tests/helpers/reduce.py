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


def in_one_buffer(tensors: Sequence[torch.Tensor], gap: int = 3, fill: float = 0.0) -> list[torch.Tensor]:
    """Copies of ``tensors`` as slices of one buffer, ``gap`` elements of ``fill`` between them (as the compressed
    slots of a bucket lie between its dense ones)."""
    flat = torch.full((sum(t.numel() + gap for t in tensors),), fill)
    out, pos = [], 0
    for t in tensors:
        out.append(flat[pos : pos + t.numel()].copy_(t.reshape(-1)))
        pos += t.numel() + gap
    return out


def reduce_worker(rank: int, world_size: int, compressor: Compressor, shapes: Sequence[tuple[int, ...]],
                  params: Sequence[Any] | None = None, steps: int = 1, seed: int = 0,
                  one_buffer: bool = False) -> dict[str, Any]:
    """Reduce ``rank_inputs`` ``steps`` times (step = 0..steps-1); return the last results and the stats.

    ``one_buffer``: the inputs are slices of one buffer and the outputs (``ctx.outputs``) slices of another, each
    with gaps, as the engine hands them over (the gaps must come back untouched)."""
    comm = Comm()
    slots = make_slots(shapes)
    outs: list[dict[str, Any]] = []
    for step in range(steps):
        tensors = rank_inputs(rank, shapes, seed + step)
        ctx = ReduceContext(comm, step, 0, slots, list(params) if params else [compressor.default_param] * len(slots))
        if one_buffer:
            ctx.outputs = in_one_buffer([torch.full_like(t, 5.0) for t in tensors], fill=-3.0)
            inputs = in_one_buffer(tensors, fill=9.0)
            red = compressor.reduce(inputs, ctx)
            red.averaged.wait()
            out_flat = ctx.outputs[0].as_strided((sum(t.numel() + 3 for t in tensors),), (1,), 0)
            in_flat = inputs[0].as_strided(out_flat.shape, (1,), 0)
            gaps = torch.ones_like(out_flat, dtype=torch.bool)
            for out in ctx.outputs:
                gaps[out.storage_offset() : out.storage_offset() + out.numel()] = False
            assert bool((out_flat[gaps] == -3.0).all()) and bool((in_flat[gaps] == 9.0).all()), "a gap was written"
        else:
            red = compressor.reduce([t.clone() for t in tensors], ctx)
        outs.append({
            "averaged": [t.clone() for t in red.averaged.wait()],
            "residuals": None if red.residuals is None else [t.clone() for t in red.residuals],
            "local": None if red.local is None else [t.clone() for t in red.local],
        })
    return {"steps": outs, "stats": comm.stats.state_dict()}
