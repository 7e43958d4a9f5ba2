"""FSDP2 configurations for ``lightning-gradcomp advise``: ``GradCompFSDPStrategy``'s presets and native HSDP.

Calibrated in one process, like the DDP configurations (:mod:`lightning_gradcomp.advise.calibrate`): the model is
sharded with FSDP2's ``fully_shard`` over a mesh of this one process (:func:`shard_units`: every
``TransformerEncoderLayer``, or else every ``Linear``, then the root; ``benchmarks/fsdp_link.py``'s rule), so its
forward, backward, FSDP2's copies in and out of its buffers and the optimizer step run for real, and each unit's
all-reduce hook fires where it fires in a real run, in backward order. The hook stands for the target cluster's rank
0, which holds the first (largest) shard of every parameter over the ``S = G`` processes of its node
(:func:`~lightning_gradcomp.advise.costs.shard_of`):

* it records the unit's shard-group collectives, their bytes from the shard's padded sizes: the reduce-scatter of the
  gradients and the all-gathers of the parameters (forward; backward again when the unit reshards after forward);
* native HSDP (``hsdp``): the dense all-reduce of the shard across the ``R = N`` replicas;
* a preset (``scalecom_fsdp``...): the replica reduction built by ``GradCompFSDPStrategy.make_reduction``, run on
  that shard (the unit's gradient, cut to shard 0's rows; the copy is not timed) with a
  :class:`~lightning_gradcomp.advise.mirror_comm.MirrorComm` standing for the ``R`` replicas: its plan, compressor
  and payloads are those of the shard; the hook then waits for it, as the strategy's does.

On CPU every collective blocks the autograd thread (gloo); on CUDA the shard group's collectives and native HSDP's
all-reduce are recorded as asynchronous (FSDP2's streams), the compressed replica reduction as waited for. The
trace is ``serial`` (:class:`~lightning_gradcomp.advise.costs.StepTrace`): a wait delays the rest of backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_gradcomp.advise.costs import (
    FSDPUnit,
    Topology,
    native_hsdp_collectives,
    shard_group_collectives,
    shard_of,
)
from lightning_gradcomp.advise.mirror_comm import MirrorComm
from lightning_gradcomp.advise.step_recorder import _Recorder, _Step
from lightning_gradcomp.comm import CommStats
from lightning_gradcomp.fsdp_reduction import FSDPReplicaReduction, _param_group, fsdp_modules
from lightning_gradcomp.fsdp_strategy import GradCompFSDPStrategy
from lightning_gradcomp.presets import PRESETS, preset_class

__all__ = [
    "FSDP_DEFAULTS",
    "NATIVE_HSDP",
    "check_fsdp_config",
    "fsdp_configs",
    "fsdp_strategy",
    "is_fsdp_config",
    "measure_fsdp",
    "shard_units",
]

NATIVE_HSDP = "hsdp"
"""Native HSDP (FSDP2's 2-D mesh): the baseline of the FSDP2 configurations."""
FSDP_DEFAULTS = (NATIVE_HSDP, "gradcomp_fsdp", "scalecom_fsdp", "powersgd_fsdp", "qsgd_fsdp")
"""What ``advise --fsdp`` compares when ``--configs`` is not given."""


def fsdp_configs() -> list[str]:
    """Every FSDP2 configuration ``advise`` prices: ``hsdp``, then each ``GradCompFSDPStrategy`` preset that reduces
    across replicas at every step."""
    presets = [
        name
        for name in sorted(PRESETS)
        if issubclass(preset_class(name), GradCompFSDPStrategy)
        and getattr(preset_class(name), "per_step_reduction", True)
    ]
    return [NATIVE_HSDP, *presets]


def _fsdp_preset(name: str) -> Optional[str]:
    """The ``GradCompFSDPStrategy`` preset of ``name`` (``preset@key=value...``), else ``None``."""
    preset = name.split("@", 1)[0]
    if preset not in PRESETS or not issubclass(preset_class(preset), GradCompFSDPStrategy):
        return None
    return preset


def is_fsdp_config(name: str) -> bool:
    """Whether ``name`` is an FSDP2 configuration: ``hsdp`` or a ``GradCompFSDPStrategy`` preset (with overrides)."""
    return name == NATIVE_HSDP or _fsdp_preset(name) is not None


def check_fsdp_config(name: str) -> str:
    """``name`` if ``advise`` can price it as FSDP2.

    Raises:
        ValueError: a preset that does not reduce across replicas at every step (DiLoCo's), a ``+hier`` suffix, or
            compressor arguments its compressor refuses.
    """
    preset = _fsdp_preset(name)
    if name == NATIVE_HSDP:
        return name
    if preset is None:
        raise ValueError(f"unknown FSDP2 configuration {name!r} (hsdp, or a GradCompFSDPStrategy preset)")
    if not getattr(preset_class(preset), "per_step_reduction", True):
        raise ValueError(
            f"configuration {name!r}: its replicas meet every `local_steps` steps; advise prices a reduction at "
            "every step"
        )
    fsdp_strategy(name)  # compressor arguments checked now, before any calibration
    return name


def fsdp_strategy(name: str) -> GradCompFSDPStrategy:
    """The strategy of FSDP2 configuration ``name`` (a preset, with its compressor's arguments after ``@``)."""
    from lightning_gradcomp.bench.configs import split_config

    preset, overrides = split_config(name)
    kwargs = PRESETS[preset][1]()
    if overrides:
        try:
            kwargs["compressor"] = type(kwargs["compressor"])(**overrides)
        except (TypeError, ValueError) as err:
            raise ValueError(f"configuration {name!r}: {err}") from None
    strategy = preset_class(preset)(**kwargs)
    assert isinstance(strategy, GradCompFSDPStrategy)
    return strategy


def shard_units(model: nn.Module, mesh: Any) -> int:
    """``fully_shard`` every ``TransformerEncoderLayer`` of ``model`` (in a model without any: every ``Linear``), then
    ``model`` itself, over ``mesh``; how many units hold parameters of their own."""
    from torch.distributed.fsdp import fully_shard

    blocks: list[nn.Module] = [m for m in model.modules() if isinstance(m, nn.TransformerEncoderLayer)]
    for module in blocks or [m for m in model.modules() if isinstance(m, nn.Linear)]:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return sum(_param_group(m) is not None for m in fsdp_modules(model))


# ---------------------------------------------------------------------------------------------- the hook
@dataclass(frozen=True)
class _TargetParam:
    """A parameter as shard 0 of the target cluster holds it (what ``FSDPReplicaReduction.plan_for`` reads)."""

    sharded_param: Tensor
    sharded_size: tuple[int, ...]
    padded_sharded_param_size: tuple[int, ...]


@dataclass(frozen=True)
class _TargetGroup:
    fsdp_params: tuple[_TargetParam, ...]


class _UnitHook:
    """The all-reduce hook of one FSDP2 unit during calibration (see the module docstring)."""

    def __init__(
        self,
        index: int,
        group: Any,
        recorder: _Recorder,
        topology: Topology,
        reduction: Optional[FSDPReplicaReduction],
        asynchronous: bool,
    ) -> None:
        self.index, self.group, self.recorder, self.reduction = index, group, recorder, reduction
        self.shards, self.replicas = topology.procs_per_node, topology.nodes
        self.asynchronous = asynchronous
        reduced = [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad]
        self.full = [fp.sharded_param.numel() for fp in reduced]  # one process: the whole parameter
        cuts = [shard_of(tuple(fp.sharded_param.shape), self.shards) for fp in reduced]
        self.target = _TargetGroup(tuple(_TargetParam(fp.sharded_param, s, (n,)) for fp, (s, n) in zip(reduced, cuts)))
        self.shard_numels = [math.prod(s) for s, _ in cuts]
        self.padded = [n for _, n in cuts]
        gathered = sum(shard_of(tuple(fp.sharded_param.shape), self.shards)[1] for fp in group.fsdp_params)
        dtype = group.mp_policy.param_dtype or group.fsdp_params[0].sharded_param.dtype
        self.gather_bytes = gathered * torch.empty((), dtype=dtype).element_size()

    def unit(self, output: Tensor) -> FSDPUnit:
        """This unit's traffic at the target shard size (read when FSDP2 hands over the gradient)."""
        gathers = 1 + (self.group.post_forward_mesh_info is not None)
        return FSDPUnit(sum(self.padded) * output.element_size(), self.gather_bytes, gathers)

    def shard(self, output: Tensor) -> Tensor:
        """Shard 0's reduce-scatter output: each parameter's first rows, then its padding."""
        buffer = output.new_zeros(sum(self.padded))
        source = target = 0
        for full, numel, padded in zip(self.full, self.shard_numels, self.padded):
            buffer[target : target + numel].copy_(output[source : source + numel])
            source, target = source + full, target + padded
        return buffer

    def __call__(self, output: Tensor) -> None:
        rec = self.recorder
        rec.ready()
        rec.begin()
        try:
            unit = self.unit(output)
            scatter, *gathers = shard_group_collectives(unit, self.shards, blocking=not self.asynchronous)
            rec.collective(scatter, rec.now(), rec.now())
            if self.replicas > 1 and self.reduction is None:
                for c in native_hsdp_collectives(unit, blocking=not self.asynchronous):
                    rec.collective(c, rec.now(), rec.now())
            elif self.replicas > 1 and self.reduction is not None:
                start = rec.now()
                buffer = self.shard(output)
                plan, params = self.reduction.plan_for(self.index, self.target)
                rec.exclude(start)
                self.reduction.reduce(buffer, plan, params)
                rec.join(rec.now(), rec.now())  # the hook waits for the replica reduction
            for c in gathers:  # the next forward's (and backward's) all-gathers
                rec.collective(c, rec.now(), rec.now())
        finally:
            rec.end()


# ---------------------------------------------------------------------------------------------- measuring
@dataclass
class _Installed:
    model: nn.Module
    reduction: Optional[FSDPReplicaReduction]
    mirror: Optional[MirrorComm]


def _install(name: str, model: nn.Module, topology: Topology, recorder: _Recorder, device: torch.device) -> _Installed:
    from torch.distributed.device_mesh import init_device_mesh

    shard_units(model, init_device_mesh(device.type, (1,)))
    reduction = mirror = None
    if name != NATIVE_HSDP and topology.nodes > 1:
        mirror = MirrorComm(topology.nodes, "replicate", recorder, CommStats())
        names = {id(p): n for n, p in model.named_parameters()}
        reduction = fsdp_strategy(name).make_reduction(mirror, names, device)
    index = 0
    for module in fsdp_modules(model):
        group = _param_group(module)
        if group is None:
            continue
        if reduction is not None:
            module.set_reduce_scatter_unused_params(True, recurse=False)  # a fixed layout, as the strategy's
        module.set_all_reduce_hook(_UnitHook(index, group, recorder, topology, reduction, device.type == "cuda"))
        index += 1
    return _Installed(model, reduction, mirror)


def measure_fsdp(
    name: str,
    make: Callable[[], Any],
    topology: Topology,
    device: torch.device,
    warmup: int,
    steps: int,
    sync: Callable[[torch.device], None],
) -> tuple[list[_Step], list[float]]:
    """The measured steps of FSDP2 configuration ``name`` (its timelines and lengths; see the module docstring)."""
    recorder = _Recorder()
    installed = _install(name, make().to(device), topology, recorder, device)
    model, reduction = installed.model, installed.reduction
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step sees the model's own gradients
    if reduction is not None:
        reduction.attach_optimizer(opt)
    rotates = reduction is not None and callable(getattr(reduction.compressor, "_leader", None))
    seen: list[_Step] = []
    times: list[float] = []
    for i in range(warmup + steps):
        if rotates and installed.mirror is not None and reduction is not None:
            installed.mirror.rank = reduction.step % installed.mirror.world_size  # leads unit 0, as in calibrate
        sync(device)
        recorder.start_step()
        model().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        sync(device)
        elapsed = recorder.now()
        if i >= warmup:
            seen.append(_Step(recorder.buckets, recorder.finished, elapsed))
            times.append(elapsed)
    return seen, times
