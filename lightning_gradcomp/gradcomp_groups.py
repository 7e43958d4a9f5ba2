"""GradCompStrategy's process groups: the hook's private group of DDP's ranks (:func:`_private_group`, also
GradCompFabricStrategy's) and, with ``hierarchy=``, the node and cross-node groups of the layout the ranks form.

A mixin, listed before the Lightning strategy base class in :class:`~lightning_gradcomp.strategy.GradCompStrategy`,
which sets the attributes declared here.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.functional.realview import real_view_numel
from lightning_gradcomp.hierarchy import Hierarchy, HierarchyLayout, HierarchySpec, group_size_for

__all__ = ["GradCompGroups"]


class GradCompGroups(DDPStrategy):
    """Mixin: :class:`~lightning_gradcomp.strategy.GradCompStrategy`'s process groups."""

    hierarchy: HierarchySpec

    def _hierarchy_layout(self) -> HierarchyLayout:
        """The node layout ``hierarchy`` means here (in the worker, once the world is known).

        Raises:
            ValueError: the group size does not divide the world size, or (``"node"``) Lightning's ranks are not
                numbered ``node_rank * devices + local_rank``.
        """
        size = group_size_for(self.hierarchy, self.world_size, self.num_processes)
        if self.hierarchy == "node" and (
            self.world_size != self.num_nodes * size or self.global_rank != self.node_rank * size + self.local_rank
        ):
            raise ValueError(
                f"`hierarchy='node'` needs ranks numbered node_rank * devices + local_rank over "
                f"num_nodes * devices processes; rank {self.global_rank} of {self.world_size} has "
                f"node_rank {self.node_rank}, local_rank {self.local_rank} ({self.num_nodes} nodes x "
                f"{size} devices): pass an int `hierarchy` or fix the launcher's rank order"
            )
        return HierarchyLayout(self.world_size, size)

    def _new_groups(self, stats: CommStats) -> tuple[Comm, Optional[Hierarchy]]:
        """The hook's collectives on a new private group of DDP's ranks, and (``hierarchy=``) new node and cross-node
        groups, all counting into ``stats`` (collective: every rank calls it, at setup)."""
        assert isinstance(self.model, DistributedDataParallel) and self.lightning_module is not None
        hierarchy = None
        if self.hierarchy is not None:
            named = self.lightning_module.named_parameters()
            numels = {n: real_view_numel(p) for n, p in named if p.requires_grad}  # DDP reduces complex as real
            hierarchy = Hierarchy.create(self._hierarchy_layout(), self.global_rank, numels, stats, self._timeout)
        return Comm(_private_group(self.model.process_group, self._timeout), stats), hierarchy


def _private_group(group: Any, timeout: Optional[timedelta]) -> Any:
    """A new process group of ``group``'s ranks, for the hook alone (every rank of ``group`` calls this at setup).

    The hook issues its collectives on the communication thread while backward goes on. Collectives that other code
    issues on DDP's group during backward (SyncBatchNorm's backward, a model's own differentiable all-reduce) would
    otherwise share one sequence with them, in an order that differs between ranks: a deadlock, or gloo pairing
    buffers of different collectives. On a group of its own the hook's order is its bucket order, the same on every
    rank.
    """
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == dist.get_world_size():  # every rank calls new_group, in the same order
        return dist.new_group(ranks, timeout=timeout)
    return dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)  # only the group's ranks call it
