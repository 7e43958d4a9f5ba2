"""Two-level reduction (``GradCompStrategy(hierarchy=...)``): compress only the slow hops between nodes.

Each flat tensor is first reduce-scattered inside the node (one uneven all-to-all: every slot goes to the local rank
that owns it, with the sender's NaN/Inf flag, and the owner sums the node's copies); each rank then runs the
reduction pipeline (:class:`~lightning_gradcomp.reduction.GradientReduction`) over its cross-node group for the slots
it owns (the node-mean gradient of its owned compressed slots goes to the compressor, its owned dense slots and the
node's flag to the dense all-reduce, both divided by W, so their sum over nodes is the global mean); finally a
second all-to-all hands every owner's averaged slots to the rest of its node. Before ``start_step`` (or for a dense
compressor) the owned slots are all-reduced across nodes without the flag, like DDP. With a single node nothing is
compressed: one dense all-reduce in the node, as DDP. The layout and groups: :mod:`lightning_gradcomp.hierarchy`.
"""

import time
from typing import Optional

import torch
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.comm import completed_future, then_same_numerics
from lightning_gradcomp.functional.finite import nonfinite_flag
from lightning_gradcomp.hierarchy import Hierarchy
from lightning_gradcomp.plan import BucketPlan
from lightning_gradcomp.reduction import GradientReduction

__all__ = ["reduce_hierarchical"]


def reduce_hierarchical(
    reduction: GradientReduction,
    hierarchy: Hierarchy,
    plan: BucketPlan,
    buf: Tensor,
    step: int,
    compressing: bool,
    scale: Optional[Tensor],
) -> Future:
    """Average ``buf`` (laid out by ``plan``) over every rank of ``hierarchy``'s world through ``reduction``, compressed
    across nodes when ``compressing`` (``scale``: the AMP loss scale, or ``None``). Returns a Future of ``buf``."""
    start = time.perf_counter()
    if buf.is_sparse:
        fut = reduction.reduce_sparse(plan, buf)
    else:
        reduction.count_dense_equivalent(plan, buf)
        if hierarchy.layout.num_nodes == 1:
            fut = reduction.reduce_dense(plan, buf, hierarchy.intra)
        else:
            fut = _reduce_two_levels(reduction, hierarchy, plan, buf, step, compressing, scale)
    reduction.stats.comm_thread_seconds += time.perf_counter() - start
    return fut


def _reduce_two_levels(
    reduction: GradientReduction,
    hierarchy: Hierarchy,
    plan: BucketPlan,
    buf: Tensor,
    step: int,
    compressing: bool,
    scale: Optional[Tensor],
) -> Future:
    """Node reduce-scatter into this rank's shard, its slots across nodes, node all-gather of the shards."""
    intra, shards, size = hierarchy.intra, hierarchy.shards(plan), hierarchy.layout.group_size
    local = shards.local  # this rank's slots, back to back in its shard
    width = local.numel + 1  # the shard and the node's NaN/Inf flag
    # (1) every slot to its owner, with this rank's flag (read only when compressing); row j of `rows` is what
    # local rank j sent us
    flag = nonfinite_flag(buf) if compressing else buf.new_zeros(1)
    send = torch.cat([piece for slots in shards.by_owner for piece in (*(buf[s.offset : s.end] for s in slots), flag)])
    rows = send.view(1, width) if size == 1 else buf.new_empty(size, width)
    if size > 1:
        intra.all_to_all_uneven(rows.view(-1), send, [width] * size, shards.widths)
    shard = rows[0]
    for j in range(1, size):  # the node sum, in local-rank order (only the owner computes it)
        shard.add_(rows[j])
    if compressing:  # (2) the shard across nodes: the flat protocol on the cross-node group
        fut = reduction.reduce_compressed(
            local, shard, step, scale, hierarchy.cross, local.dense, local.compressed, size, node_flag=shard[-1:]
        )
        with intra.waiting():  # its averages are sent in (3)
            fut.wait()
    else:
        reduction.all_reduce_dense(shard, local.slots, hierarchy.cross)
    # (3) every owner's shard to the rest of the node
    if size == 1:
        gathered = shard
    else:
        rows[1:].copy_(shard.expand(size - 1, width))
        gathered = buf.new_empty(plan.numel + size)
        fut = intra.all_to_all_uneven(gathered, rows.view(-1), shards.widths, [width] * size, async_op=True)
    layout, sizes = shards.gathered  # each owner's slots, then its flag element (None)

    def unpack(received: Tensor) -> Tensor:
        for slot, piece in zip(layout, torch.split(received, list(sizes))):
            if slot is not None:
                buf[slot.offset : slot.end].copy_(piece)
        return buf

    if size == 1:
        return completed_future(unpack(gathered))
    return then_same_numerics(fut, lambda done: unpack(done.value()), reduction.stats)
