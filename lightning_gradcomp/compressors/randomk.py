"""RandomK: shared-seed random sparsification with an all-reduce of the kept values
(:class:`~.sparse.SharedIndexCompressor` does the exchange)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.checks import check_bool
from lightning_gradcomp.compressors.base import ReduceContext
from lightning_gradcomp.compressors.registry import register
from lightning_gradcomp.compressors.sparse import SharedIndexCompressor, resolve_density
from lightning_gradcomp.functional.sparsify import stratified_layers

__all__ = ["RandomK"]


@register("randomk")
class RandomK(SharedIndexCompressor):
    """Keep ``k`` random entries per layer, chosen by a generator shared by all ranks.

    Selection is stratified: each layer is cut into ``k`` near-equal blocks and one uniform element is
    kept per block (O(k) random numbers instead of a permutation of the whole layer; each element is kept
    with probability ``1/block size`` = ``k/n``).

    The support is identical everywhere, so the values are all-reduced: bytes per rank are
    ``2 (W-1)/W * sum_l k_l * value bytes``, independent of W. No indices travel.

    Args:
        density: fraction of each layer's elements kept, in (0, 1].
        unbiased: scale kept values by their block size (``n / k``) and skip error feedback (unbiased, high
            variance);
            the default keeps values unscaled and relies on error feedback.
        value_dtype: wire dtype of the values (fp32, fp16 or bf16; 16-bit values are divided by W and saturated
            before the cast: :func:`~.sparse.saturated_wire_values`).
        ratio: deprecated name of ``density`` (warns with a ``DeprecationWarning``).
    """

    def __init__(
        self,
        density: float = 0.01,
        unbiased: bool = False,
        value_dtype: torch.dtype | str = torch.float32,
        *,
        ratio: Optional[float] = None,
    ) -> None:
        super().__init__(resolve_density("RandomK", density, ratio, 0.01), value_dtype)
        self.unbiased = check_bool("unbiased", unbiased)

    @property
    def uses_error_feedback(self) -> bool:
        return not self.unbiased

    def shared_indices(
        self, tensors: list[Tensor], ks: list[int], ctx: ReduceContext
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Per layer, one uniform entry of each of ``k`` near-equal blocks, from the layer's shared stream; with
        ``unbiased``, each kept value scaled by its block's size."""
        device = tensors[0].device
        generators = [ctx.generator(device, shared=True, salt=slot.name) for slot in ctx.slots]
        local, sizes = stratified_layers([t.numel() for t in tensors], ks, generators, device)
        return local, sizes if self.unbiased else None

    def extra_repr(self) -> str:
        return super().extra_repr() + (", unbiased=True" if self.unbiased else "")
