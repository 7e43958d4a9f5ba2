"""PowerSGD: rank-r power-iteration compression with error feedback, batched per bucket.

For each compressed layer (viewed as an ``n x m`` matrix ``M``, error-compensated by the engine) and its
warm-start factor ``Q`` (``m x r``, identical on every rank):

1. ``P = M Q`` for every layer; all ``P`` are concatenated and **all-reduced** (sum), waited in line.
2. ``P <- orth(P)`` (same input everywhere, so the same result everywhere).
3. ``Q_i = M^T P`` (this rank's contribution ``c_i = P Q_i^T``; the residual ``M - P Q_i^T`` goes to the
   engine's error-feedback memory).
4. All ``Q_i`` are concatenated and **all-reduced** asynchronously; the callback divides by W, keeps the
   result as the next warm start and returns ``P Q^T`` per layer.

Wire bytes per rank and bucket: ``2 (W-1)/W * 4 * sum_l (n_l + m_l) r_l`` over two collectives.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.checks import check_bool, check_int, check_number
from lightning_gradcomp.comm import then_same_numerics
from lightning_gradcomp.compressors.base import Compressor, ReduceContext, Reduction
from lightning_gradcomp.compressors.registry import register
from lightning_gradcomp.compressors.staged import StagedState
from lightning_gradcomp.functional.layerwise import lowrank_errors, lowrank_sizes
from lightning_gradcomp.functional.lowrank import (
    adapt_factor,
    effective_rank,
    lowrank_saves,
    matrix_shape,
    orthogonalize,
    random_factor,
    subtract_product,
    thin_matmul,
)
from lightning_gradcomp.plan import LayerSlot

__all__ = ["PowerSGD"]


@register("powersgd")
class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD (Vogels et al., 2019) with error feedback and warm start.

    The rank is a per-layer parameter (``param_name = "rank"``), so L-GreCo can set it per layer; a layer's
    effective rank is clipped to ``min(n, m)``. When a layer's rank changes, its warm-start factor is cut
    (leading columns kept) or extended with shared-seed random columns, identically on every rank.

    Tuning: rank 1-4 is typical for CNNs, 16-32 for transformers; start compressing after a short dense
    warm-up (``GradCompStrategy(start_step=...)``).

    Args:
        rank: default rank of every compressed layer, a positive integer.
        warm_start: reuse the previous step's averaged ``Q`` (else a fresh shared-seed ``Q`` every step).
        min_compression_rate: compress a layer only if ``(n + m) * rank * min_compression_rate <= n * m``
            (>= 1; with the default 2, ranks up to twice the default still send fewer bytes than dense;
            L-GreCo never picks a rank that does not).
    """

    param_name = "rank"

    def __init__(self, rank: int = 4, warm_start: bool = True, min_compression_rate: float = 2.0) -> None:
        self.rank: int = check_int("rank", rank, 1)
        self.warm_start = check_bool("warm_start", warm_start)
        self.min_compression_rate = float(
            check_number("min_compression_rate", min_compression_rate, 1.0, math.inf, low_open=False, high_open=True)
        )
        self._factors = StagedState()

    # ------------------------------------------------------------------ contract
    @property
    def uses_error_feedback(self) -> bool:
        return True

    def check_param(self, value: Any) -> int:
        return check_int("rank", value, 1)

    def layer_candidates(self, shape: Sequence[int], candidates: Iterable[Any]) -> list[Any]:
        """Valid ranks (see :meth:`Compressor.layer_candidates`) whose factors are smaller than the dense ``n x m``
        matrix of ``shape`` (the default rank is always kept)."""
        n, m = matrix_shape(shape)
        return [r for r in super().layer_candidates(shape, candidates) if r == self.rank or lowrank_saves(n, m, r)]

    def layer_costs(
        self, stat: Tensor, shape: Sequence[int], candidates: Sequence[Any]
    ) -> tuple[list[float], list[float]]:
        """Factor bytes ``4 (n + m) r`` and best rank-``r`` errors ``sqrt(sum_{i>r} sigma_i^2)`` of ``stat``
        viewed as ``n x m`` (see :meth:`Compressor.layer_costs`)."""
        return lowrank_sizes(shape, candidates), lowrank_errors(stat.reshape(matrix_shape(shape)), candidates)

    def accepts(self, slot: LayerSlot) -> bool:
        """Only layers that the default rank shrinks by ``min_compression_rate`` are compressed."""
        n, m = matrix_shape(slot.shape)
        return len(slot.shape) > 1 and lowrank_saves(n, m, self.rank, self.min_compression_rate)

    def precompute(self, index: int, tensor: Tensor, ctx: ReduceContext) -> Tensor:
        """This rank's ``P = M Q`` of slot ``index`` (``n x r``; ``M``: ``tensor`` as a matrix, ``Q``: the warm start
        or a fresh factor), which :meth:`reduce` all-reduces."""
        slot = ctx.slots[index]
        n, m = matrix_shape(slot.shape)
        return self._project(tensor.view(n, m), slot.name, effective_rank(n, m, ctx.params[index]), ctx)

    def _project(self, mat: Tensor, name: str, rank: int, ctx: ReduceContext, out: Optional[Tensor] = None) -> Tensor:
        """``P = M Q`` into ``out`` (a new ``n x rank`` tensor when ``None``)."""
        q = self._start_factor(name, mat.shape[1], rank, ctx, mat.device)
        return thin_matmul(mat, q, torch.empty(mat.shape[0], rank, device=mat.device) if out is None else out)

    def reduce(self, tensors: list[Tensor], ctx: ReduceContext) -> Reduction:
        """Two batched all-reduces (P waited in line, Q asynchronous). ``P`` comes from :meth:`precompute` when the
        engine called it."""
        device = tensors[0].device
        shapes = [matrix_shape(slot.shape) for slot in ctx.slots]
        ranks = [effective_rank(n, m, r) for (n, m), r in zip(shapes, ctx.params)]
        mats = [t.view(n, m) for t, (n, m) in zip(tensors, shapes)]

        p_counts = [n * r for (n, _), r in zip(shapes, ranks)]
        p_flat = torch.empty(sum(p_counts), dtype=torch.float32, device=device)
        ps = [piece.view(n, r) for piece, (n, _), r in zip(torch.split(p_flat, p_counts), shapes, ranks)]
        for i, (slot, mat, p, r) in enumerate(zip(ctx.slots, mats, ps, ranks)):
            early = ctx.precomputed(i)
            if early is None:
                self._project(mat, slot.name, r, ctx, out=p)
            else:
                p.copy_(early)
        ctx.comm.all_reduce(p_flat, shares=ctx.shares(p_counts))
        ps = [orthogonalize(p) for p in ps]

        q_counts = [m * r for (_, m), r in zip(shapes, ranks)]
        q_flat = torch.empty(sum(q_counts), dtype=torch.float32, device=device)
        qs = [piece.view(m, r) for piece, (_, m), r in zip(torch.split(q_flat, q_counts), shapes, ranks)]
        for mat, p, q in zip(mats, ps, qs):
            thin_matmul(mat, p, q, transpose=True)
            subtract_product(mat, p, q)  # residual p - c in the engine's tensor, before Q is overwritten
        fut = ctx.comm.all_reduce(q_flat, async_op=True, shares=ctx.shares(q_counts))
        assert fut is not None
        names = [slot.name for slot in ctx.slots]
        world = ctx.world_size

        outputs = ctx.outputs  # the bucket's slices, dead once the inputs are the engine's copies (error feedback)

        def decode(f: Future) -> list[Tensor]:
            summed = f.value().div_(world)
            out = []
            for i, (name, p, piece, (n, m), r) in enumerate(
                zip(names, ps, torch.split(summed, q_counts), shapes, ranks)
            ):
                q = piece.view(m, r)
                if self.warm_start:
                    self._factors[name] = q
                if outputs is None:
                    out.append((p @ q.T).reshape(-1))
                else:  # straight into the bucket: no fresh n x m tensor, no copy back
                    out.append(torch.matmul(p, q.T, out=outputs[i].view(n, m)).reshape(-1))
            return out

        return Reduction(averaged=then_same_numerics(fut, decode, ctx.comm.stats), residuals=tensors)

    # ------------------------------------------------------------------ state
    def _start_factor(self, name: str, m: int, rank: int, ctx: ReduceContext, device: torch.device) -> Tensor:
        """This step's ``Q`` (``m x rank``): the warm start, resized if the rank changed, or a fresh one.

        Fresh columns are drawn from a stream salted with the layer name, so they do not depend on the
        layer's position in its bucket (DDP re-buckets after its first step and after a resume).
        """
        previous = self._factors.peek(name) if self.warm_start else None
        if previous is not None and previous.shape[0] == m:
            previous = previous.to(device)
            if previous.shape[1] == rank:
                return previous
            return adapt_factor(previous, rank, ctx.generator(device, shared=True, salt=name))
        return random_factor(m, rank, ctx.generator(device, shared=True, salt=name), device)

    def state_dict(self) -> dict[str, Any]:
        """The warm-start factors ``Q`` by layer name (identical on every rank)."""
        return {"factors": {k: v.detach().cpu().clone() for k, v in self._factors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._factors.load({k: v.to(torch.float32).clone() for k, v in state.get("factors", {}).items()})

    def reset_state(self) -> None:
        self._factors.clear()

    def extra_repr(self) -> str:
        extra = "" if self.warm_start else ", warm_start=False"
        if self.min_compression_rate != 2.0:
            extra += f", min_compression_rate={self.min_compression_rate}"
        return f"rank={self.rank}{extra}"
