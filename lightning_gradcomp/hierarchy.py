r"""Hierarchical reduction: a dense all-reduce inside each node, compression only across nodes.

``GradCompStrategy(hierarchy=...)`` splits the W ranks into N "nodes" of L consecutive ranks (``[0..L-1]``,
``[L..2L-1]``, ...: Lightning numbers ranks ``node_rank * L + local_rank``). Each rank belongs to two extra
process groups: its **node group** (the L ranks of its node, fast links) and its **cross-node group** (the N
ranks with its local rank, one per node: the slow links).

Every parameter has an **owner**, a local rank chosen once from the names and sizes of all parameters of the
model (:func:`assign_owners`: largest first, to the least loaded local rank), never from DDP's buckets, so it
is the same before and after DDP's bucket rebuild and across resumes. Per bucket (:class:`Hierarchy` holds this
rank's view, :class:`NodeShards` the bucket's slots grouped by owner; the protocol itself is in
:func:`~lightning_gradcomp.hierarchical_reduction.reduce_hierarchical`):

1. **Node reduce-scatter.** One uneven all-to-all in the node group sends every slot to its owner, together
   with the sender's "NaN/Inf in my bucket" flag; each owner sums the L copies of its slots (the node sum)
   and the L flags (the node's flag) into its **shard**: its own slots back to back (:attr:`NodeShards.local`).
2. Each local rank reduces *the slots it owns* over its cross-node group: the compressor (with error feedback,
   memories kept by the owner) on the node-mean of its compressed slots, and one all-reduce of its dense slots
   plus the node's non-finite flag (so every rank of the world takes the same decision). The compressor sees
   the cross-node ``Comm``: ``ctx.rank`` is the node index, ``ctx.world_size`` is N (CLT-k's leader rotates
   over nodes).
3. **Node all-gather.** A second uneven all-to-all hands each owner's shard (its averaged slots, and the flag
   element) to the other L - 1 ranks of the node, which copy the slots into their bucket.

Bytes per rank for a bucket of ``n`` fp32 elements, ``n_j`` of them owned by local rank ``j`` (the
:mod:`lightning_gradcomp.comm` accounting: the elements sent to other ranks): intra-node
``4 (n - n_j + L - 1) + 4 (L - 1)(n_j + 1)`` (``CommStats.intra_bytes``; about ``2 (L-1)/L * 4n`` when the
shares are balanced, the bytes of one ring all-reduce), inter-node only this rank's owned share, over N ranks
(``CommStats.wire_bytes``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import cached_property
from typing import Optional, Union

import torch.distributed as dist

from lightning_gradcomp.checks import ArgumentTypeError, is_int
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.plan import BucketPlan, LayerSlot

__all__ = ["Hierarchy", "HierarchyLayout", "NodeShards", "assign_owners", "check_hierarchy", "group_size_for"]

HierarchySpec = Union[str, int, None]
"""What ``GradCompStrategy(hierarchy=...)`` accepts: ``None``, ``"node"`` or a group size."""

_ALLOWED = "None (flat), 'node' (the processes of one machine) or a positive int group size dividing the world size"


def check_hierarchy(value: HierarchySpec) -> HierarchySpec:
    """Validate ``hierarchy`` at construction; return it unchanged.

    Raises:
        ValueError: a string other than ``"node"``, or an ``int`` below 1; the message names ``hierarchy`` and the
            allowed values. Another type: :class:`~lightning_gradcomp.checks.ArgumentTypeError` (also a ``TypeError``).
    """
    if value is None or value == "node":
        return value
    if not is_int(value) and not isinstance(value, str):
        raise ArgumentTypeError(f"`hierarchy` must be {_ALLOWED}; got {value!r}")
    if isinstance(value, str) or value < 1:
        raise ValueError(f"`hierarchy` must be {_ALLOWED}; got {value!r}")
    return value


def group_size_for(hierarchy: HierarchySpec, world_size: int, processes_per_node: int) -> int:
    """The node size L that ``hierarchy`` means on ``world_size`` ranks with ``processes_per_node`` per machine.

    Raises:
        ValueError: the size does not divide ``world_size``; the message names ``hierarchy``.
    """
    size = processes_per_node if hierarchy == "node" else check_hierarchy(hierarchy)
    if not isinstance(size, int) or size < 1 or world_size % size:
        raise ValueError(
            f"`hierarchy={hierarchy!r}` gives node groups of {size} processes, which does not divide "
            f"the world size {world_size}; `hierarchy` must be {_ALLOWED}"
        )
    return size


@dataclass(frozen=True)
class HierarchyLayout:
    """W ranks as N nodes of L consecutive ranks.

    Attributes:
        world_size: W.
        group_size: L, processes per node (divides W).
    """

    world_size: int
    group_size: int

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.world_size % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide world size {self.world_size}")

    @property
    def num_nodes(self) -> int:
        """N."""
        return self.world_size // self.group_size

    def node_of(self, rank: int) -> int:
        """The node of global ``rank``."""
        return rank // self.group_size

    def local_rank(self, rank: int) -> int:
        """``rank``'s index inside its node."""
        return rank % self.group_size

    def node_ranks(self, node: int) -> list[int]:
        """The ranks of ``node`` (its node group), in local-rank order."""
        return list(range(node * self.group_size, (node + 1) * self.group_size))

    def cross_ranks(self, local_rank: int) -> list[int]:
        """The ranks with ``local_rank``, one per node (a cross-node group), in node order."""
        return list(range(local_rank, self.world_size, self.group_size))


def assign_owners(numels: Mapping[str, int], group_size: int) -> dict[str, int]:
    """The local rank owning each parameter: largest first, to the least loaded (ties: lowest local rank).

    A pure function of the names and sizes (sorted by ``(-numel, name)``), so it is the same on every rank, for
    any bucket layout and after a resume.

    >>> assign_owners({"a": 10, "b": 6, "c": 5, "d": 1}, 2)
    {'a': 0, 'b': 1, 'c': 1, 'd': 0}
    """
    loads = [0] * group_size
    owners = {}
    for name, numel in sorted(numels.items(), key=lambda item: (-item[1], item[0])):
        owner = min(range(group_size), key=lambda j: (loads[j], j))
        owners[name] = owner
        loads[owner] += numel
    return owners


@dataclass(frozen=True)
class NodeShards:
    """One bucket's slots grouped by owner: the layout of the node's uneven reduce-scatter and all-gather.

    Attributes:
        by_owner: per local rank ``j`` (``0..L-1``), the slots ``j`` owns, in buffer order.
        counts: per local rank, the number of elements of its slots (they sum to the bucket's ``numel``).
        local: this rank's slots as a plan of their own (same bucket index, offsets into the rank's shard, a
            buffer of ``counts[local_rank]`` elements).
    """

    by_owner: tuple[tuple[LayerSlot, ...], ...]
    counts: tuple[int, ...]
    local: BucketPlan

    @classmethod
    def of(cls, plan: BucketPlan, owner: Callable[[str], int], group_size: int, local_rank: int) -> NodeShards:
        """Group ``plan``'s slots by ``owner(name)`` (a pure function of the plan, the owners and the rank).

        >>> from lightning_gradcomp.plan import LayerSlot, BucketPlan
        >>> plan = BucketPlan(0, 7, (LayerSlot("a", 0, (4,), True), LayerSlot("b", 4, (3,), True)))
        >>> shards = NodeShards.of(plan, {"a": 1, "b": 0}.__getitem__, 2, local_rank=1)
        >>> shards.counts, shards.local.slots[0].offset
        ((3, 4), 0)
        """
        by_owner = tuple(tuple(s for s in plan.slots if owner(s.name) == j) for j in range(group_size))
        counts = tuple(sum(s.numel for s in slots) for slots in by_owner)
        local, offset = [], 0
        for slot in by_owner[local_rank]:
            local.append(replace(slot, offset=offset))
            offset += slot.numel
        return cls(by_owner, counts, BucketPlan(plan.index, offset, tuple(local)))

    @cached_property
    def widths(self) -> list[int]:
        """Per local rank, what its shard travels as: its elements and one flag element."""
        return [count + 1 for count in self.counts]

    @cached_property
    def gathered(self) -> tuple[tuple[Optional[LayerSlot], ...], tuple[int, ...]]:
        """The all-gather's output, owner by owner: each owner's slots then its flag element (``None``), and the
        sizes of these pieces."""
        layout = tuple(s for slots in self.by_owner for s in (*slots, None))
        return layout, tuple(1 if s is None else s.numel for s in layout)


class Hierarchy:
    """One rank's view of the hierarchy: its node and cross-node ``Comm`` and the owner of every parameter.

    Args:
        layout: the node layout.
        rank: this rank's global rank.
        intra: collectives over this rank's node group (bytes counted as ``CommStats.intra_bytes``).
        cross: collectives over this rank's cross-node group (bytes counted as ``CommStats.wire_bytes``).
        owners: ``parameter name -> local rank`` (:func:`assign_owners`).
    """

    def __init__(self, layout: HierarchyLayout, rank: int, intra: Comm, cross: Comm, owners: dict[str, int]) -> None:
        self.layout = layout
        self.rank = rank
        self.local_rank = layout.local_rank(rank)
        self.intra = intra
        self.cross = cross
        self.owners = owners
        self._shards: dict[int, tuple[BucketPlan, NodeShards]] = {}

    @classmethod
    def create(
        cls,
        layout: HierarchyLayout,
        rank: int,
        numels: Mapping[str, int],
        stats: CommStats,
        timeout: Optional[timedelta] = None,
    ) -> Hierarchy:
        """Create the node and cross-node groups (a collective: every rank calls it, in the same order).

        Args:
            layout: the node layout.
            rank: this rank's global rank.
            numels: ``parameter name -> number of elements`` of every trained parameter (ownership).
            stats: where both ``Comm`` count their bytes (the hook's stats).
            timeout: the groups' timeout (the strategy's process-group timeout).
        """
        intra = cross = None
        for node in range(layout.num_nodes):  # every rank creates every group, in the same order
            group = dist.new_group(layout.node_ranks(node), timeout=timeout)
            if node == layout.node_of(rank):
                intra = group
        for local in range(layout.group_size):
            group = dist.new_group(layout.cross_ranks(local), timeout=timeout)
            if local == layout.local_rank(rank):
                cross = group
        return cls(
            layout, rank, Comm(intra, stats, intra=True), Comm(cross, stats), assign_owners(numels, layout.group_size)
        )

    def owner(self, name: str) -> int:
        """The local rank owning ``name`` (a name outside the model: by a checksum of the name)."""
        owner = self.owners.get(name)
        return zlib.crc32(name.encode()) % self.layout.group_size if owner is None else owner

    def owns(self, name: str) -> bool:
        """Whether this rank reduces ``name`` across nodes."""
        return self.owner(name) == self.local_rank

    def shards(self, plan: BucketPlan) -> NodeShards:
        """``plan``'s slots grouped by owner (cached per bucket; rebuilt when the plan changes)."""
        cached = self._shards.get(plan.index)
        if cached is None or cached[0] is not plan:
            cached = self._shards[plan.index] = (
                plan,
                NodeShards.of(plan, self.owner, self.layout.group_size, self.local_rank),
            )
        return cached[1]

    def describe(self) -> list[int]:
        """``[num_nodes, group_size]``: recorded in checkpoints (per-rank state is only valid for this layout)."""
        return [self.layout.num_nodes, self.layout.group_size]
