"""SwarmStrategy's evaluation on another model than the rank's own (``eval_model``): the mean over ranks (a NaN/Inf
on some rank contained), rank 0's, or the rank's own, swapped in around every validation, test and predict loop
(:class:`~lightning_gradcomp.replicas.DivergentReplicas`); the mean also serves checkpoints and the end of ``fit``.

A mixin, listed before the Lightning strategy base class in :class:`~lightning_gradcomp.swarm.strategy.SwarmStrategy`,
which sets the attributes declared here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal, Optional

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor

from lightning_gradcomp.comm import Comm
from lightning_gradcomp.functional.realview import real_view
from lightning_gradcomp.replicas import DivergentReplicas
from lightning_gradcomp.swarm.exchange import contained_mean
from lightning_gradcomp.swarm.flat_vectors import _split_real, _write_named

__all__ = ["AveragedEvaluation"]

log = logging.getLogger("lightning_gradcomp.swarm.strategy")  # SwarmStrategy's: its warning keeps its logger name


class AveragedEvaluation(DivergentReplicas, DDPStrategy):
    """Mixin: :class:`~lightning_gradcomp.swarm.strategy.SwarmStrategy`'s evaluation model (see the module
    docstring)."""

    _aux: Optional[Comm]
    _ensure_comms: Callable[[], None]
    eval_model: Literal["mean", "rank0", "local"]

    # ------------------------------------------------------------------ evaluation on the averaged model
    def _model_tensors(self) -> dict[str, Tensor]:
        """Parameters and floating-point buffers, by name (what evaluation averages)."""
        module = self.lightning_module
        named = {n: p.detach() for n, p in module.named_parameters()}
        named.update({n: b.detach() for n, b in module.named_buffers() if b.is_floating_point()})
        return named

    def _mean_of(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Element-wise mean over ranks of named floating tensors (one all-reduce of their fp64 values).

        Where some rank's model holds NaN/Inf (it diverged and has not healed through an exchange yet), the mean
        there is over the finite ranks only (:func:`~lightning_gradcomp.swarm.exchange.contained_mean`, one more
        all-reduce of twice the size, only then), so one diverged rank does not poison the averaged model. Every
        rank reads the same sum, so every rank takes the same branch.
        """
        assert self._aux is not None
        flat = torch.cat([real_view(t).reshape(-1).double() for t in tensors.values()])
        self._aux.all_reduce(flat)
        finite = torch.isfinite(flat)
        if bool(finite.all()):  # one host read; evaluation, checkpoints and the end of fit only
            flat /= self.world_size
            return _split_real(flat, tensors)
        local = torch.cat([real_view(t).reshape(-1).double() for t in tensors.values()])
        local_finite = torch.isfinite(local)
        parts = torch.cat(
            [
                torch.where(local_finite, local, torch.zeros((), dtype=local.dtype, device=local.device)),
                local_finite.double(),
            ]
        )
        self._aux.all_reduce(parts)
        finite_total, finite_count = parts.chunk(2)
        mean = contained_mean(flat, finite_total, finite_count, self.world_size)
        if self.global_rank == 0:
            log.warning(
                f"SwarmSGD: {int((~finite).sum())} of {flat.numel()} coordinates of the mean over ranks met a "
                f"NaN/Inf model value; there the mean is over the ranks whose value is finite "
                f"({int((finite_count == 0).sum())} coordinates have none and stay NaN/Inf)"
            )
        return _split_real(mean, tensors)

    def _enter_eval(self) -> None:
        self._ensure_comms()
        if self._aux is None or self.world_size < 2 or self.eval_model == "local" or self._eval_backup is not None:
            return
        tensors = self._model_tensors()
        self._eval_backup = {n: t.clone() for n, t in tensors.items()}
        if self.eval_model == "mean":
            _write_named(self.lightning_module, self._mean_of(tensors))
        else:
            flat = torch.cat([real_view(t).reshape(-1).double() for t in tensors.values()])
            self._aux.broadcast(flat, 0)
            _write_named(self.lightning_module, _split_real(flat, tensors))

    def _exit_eval(self) -> None:
        if self._eval_backup is not None:
            _write_named(self.lightning_module, self._eval_backup)
            self._eval_backup = None
