"""The configurations ``advise`` calibrates: which names it takes (:func:`check_advise_config`), and each one
installed on a model as the bench installs it, its collectives recorded (see
:mod:`lightning_gradcomp.advise.calibrate`)."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.advise.costs import Topology
from lightning_gradcomp.advise.fsdp import check_fsdp_config, is_fsdp_config
from lightning_gradcomp.advise.mirror_comm import MirrorComm
from lightning_gradcomp.advise.step_recorder import _Recorder
from lightning_gradcomp.advise.torch_hooks import _as_comm_hook, _timed_hook
from lightning_gradcomp.bench.configs import BASELINES, DDP_BUCKET_CAP_MB, build_strategy, is_config
from lightning_gradcomp.comm import CommStats
from lightning_gradcomp.hierarchy import Hierarchy, HierarchyLayout, assign_owners
from lightning_gradcomp.hook import GradCompHook, gradcomp_comm_hook

__all__ = ["HIERARCHICAL", "check_advise_config"]

HIERARCHICAL = "+hier"
"""Suffix of a configuration reduced hierarchically (``GradCompStrategy(hierarchy="node")``): ``scalecom+hier``."""

_SINGLE_BUCKET_MB = 1024.0  # powerSGD_hook runs on one bucket (the bench's choice: it aborts on gloo with more)


def check_advise_config(name: str, procs_per_node: int = 1) -> str:
    """``name`` if ``advise`` can calibrate it: a bench configuration, a strategy preset followed by ``+hier``, or an
    FSDP2 configuration (``hsdp``, a ``GradCompFSDPStrategy`` preset: :mod:`lightning_gradcomp.advise.fsdp`).

    Raises:
        ValueError: an unknown name, ``+hier`` on a baseline, on FSDP2 or with one process per node, a preset that
            does not reduce at every step.
    """
    base = name[: -len(HIERARCHICAL)] if name.endswith(HIERARCHICAL) else name
    if is_fsdp_config(base):
        if base != name:
            raise ValueError(f"configuration {name!r}: FSDP2 is hierarchical already (sharded inside the node)")
        return check_fsdp_config(name)
    if not is_config(base):
        raise ValueError(f"unknown configuration {name!r} (see `lightning-gradcomp list`; `+hier` for hierarchical)")
    if base != name and base in BASELINES:
        raise ValueError(f"configuration {name!r}: `+hier` applies to strategy presets, not to {base}")
    if base != name and procs_per_node < 2:
        raise ValueError(f"configuration {name!r}: `+hier` needs `--procs-per-node` >= 2")
    return name


# ---------------------------------------------------------------------------------------------- install
@dataclass
class _Installed:
    ddp: DistributedDataParallel
    hook: Optional[GradCompHook]
    mirrors: list[MirrorComm]
    module: Optional[types.ModuleType] = None
    blocking: bool = False


def _wrap(model: nn.Module, bucket_cap_mb: float, views: bool = True) -> DistributedDataParallel:
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*")
        return DistributedDataParallel(
            model, bucket_cap_mb=bucket_cap_mb, broadcast_buffers=False, gradient_as_bucket_view=views
        )


def _install(
    name: str, model: nn.Module, topology: Topology, recorder: _Recorder, bucket_cap_mb: Optional[float]
) -> _Installed:
    """Configuration ``name`` on ``model``, its collectives recorded (see the module docstring)."""
    cap = DDP_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    if name == "ddp":
        ddp = _wrap(model, cap)
        ddp.register_comm_hook(None, _timed_hook(recorder, default_hooks.allreduce_hook))
        return _Installed(ddp, None, [], default_hooks)
    if name == "torch_fp16":
        ddp = _wrap(model, cap)
        ddp.register_comm_hook(None, _timed_hook(recorder, default_hooks.fp16_compress_hook))
        return _Installed(ddp, None, [], default_hooks)
    if name == "torch_powersgd":
        ddp = _wrap(model, _SINGLE_BUCKET_MB)
        state = psgd.PowerSGDState(
            None, matrix_approximation_rank=4, start_powerSGD_iter=2, min_compression_rate=2, random_seed=0
        )
        ddp.register_comm_hook(state, _timed_hook(recorder, psgd.powerSGD_hook))
        return _Installed(ddp, None, [], psgd, blocking=True)
    hierarchical = name.endswith(HIERARCHICAL)
    strategy = build_strategy(name[: -len(HIERARCHICAL)] if hierarchical else name)
    if bucket_cap_mb is None:
        bucket_cap_mb = strategy._ddp_kwargs.get("bucket_cap_mb") or DDP_BUCKET_CAP_MB
    ddp = _wrap(model, bucket_cap_mb, strategy._ddp_kwargs["gradient_as_bucket_view"])
    stats = CommStats()
    world = MirrorComm(topology.world_size, "world", recorder, stats)
    mirrors = [world]
    hierarchy = None
    if hierarchical:
        layout = HierarchyLayout(topology.world_size, topology.procs_per_node)
        intra = MirrorComm(topology.procs_per_node, "intra", recorder, stats, intra=True)
        cross = MirrorComm(topology.nodes, "cross", recorder, stats)
        numels = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
        hierarchy = Hierarchy(layout, 0, intra, cross, assign_owners(numels, topology.procs_per_node))
        mirrors += [cross]  # the node index rotates with the step, as the world rank does when flat
    names = {id(p): n for n, p in model.named_parameters()}
    hook = strategy.make_hook(world, names, next(model.parameters()).device, hierarchy)
    strategy.bind_hook(hook)
    reduce = hook._reduce

    def reduce_recorded(*args: Any) -> Future:
        if hierarchy is not None:
            recorder.sharing = _nic_sharing(hierarchy, args[0])
        recorder.begin()
        try:
            return reduce(*args)
        finally:
            recorder.end()

    hook._reduce = reduce_recorded  # type: ignore[method-assign,assignment]

    def ready_then_hook(state: GradCompHook, bucket: dist.GradBucket) -> Future:
        recorder.ready()
        return gradcomp_comm_hook(state, bucket)

    ddp.register_comm_hook(hook, _as_comm_hook(ready_then_hook))
    return _Installed(ddp, hook, mirrors)


def _nic_sharing(hierarchy: Hierarchy, plan: Any) -> float:
    """How many times this rank's cross-node bytes cross the NIC in all: ``1 / f`` for a rank that owns a fraction ``f``
    of the bucket (every local rank's bytes in proportion to its share), within ``[1, 4 G]``."""
    size = hierarchy.layout.group_size
    owned = hierarchy.shards(plan).counts[hierarchy.local_rank] / max(1, plan.numel)
    return min(4.0 * size, max(1.0, 1.0 / owned if owned > 0 else 4.0 * size))
