"""GradCompStrategy's checks of its arguments that need more than one value to decide: the ``small_param`` against
the compressor's range, ``hierarchy=`` against the compressor and the callbacks, and the warning for a stateful
compressor under ``gradient_as_bucket_view=False`` with ``find_unused_parameters=True``."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_gradcomp.callbacks.lgreco import LGreCo
from lightning_gradcomp.callbacks.lowpass import LowPassMemoryFilter
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.hierarchy import HierarchySpec

__all__: list[str] = []


def _warn_unused_without_views(compressor: Compressor) -> None:
    """Warn that a stateful compressor under ``gradient_as_bucket_view=False`` and ``find_unused_parameters=True``
    needs ``zero_grad(set_to_none=True)``: DDP leaves the ``.grad`` of a parameter unused on every rank untouched,
    so with an old (zeroed) ``.grad`` the optimizer steps it and the state staged for it is committed, although
    what the hook sent for it never reached the ``.grad``."""
    if compressor.uses_error_feedback or compressor._staged_stores():
        rank_zero_warn(
            f"GradCompStrategy: {type(compressor).__name__} keeps state, and with gradient_as_bucket_view=False and "
            "find_unused_parameters=True DDP leaves the .grad of a parameter unused on every rank as it was. Keep "
            "optimizer.zero_grad() at set_to_none=True (its default): with set_to_none=False what the compressor "
            "sent for such a parameter in that step is lost. gradient_as_bucket_view=True (this strategy's default) "
            "has no such limit"
        )


def _check_hierarchy_combination(
    hierarchy: HierarchySpec, compressor: Compressor, layerwise: Optional[Callback]
) -> HierarchySpec:
    """Refuse ``hierarchy=`` with a compressor or ``layerwise`` callback that needs every layer on every rank."""
    if hierarchy is None:
        return None
    if not compressor.hierarchical:
        raise ValueError(
            f"{type(compressor).__name__} cannot run with `hierarchy={hierarchy!r}`: it needs every rank "
            f"of the world (hierarchical mode hands each compressor node-mean gradients over the "
            f"cross-node group); use hierarchy=None"
        )
    if layerwise is not None:
        raise ValueError(
            f"`layerwise={type(layerwise).__name__}(...)` cannot be combined with `hierarchy="
            f"{hierarchy!r}`: each rank only compresses the layers it owns, and the per-layer tuning "
            f"averages statistics of every layer over all ranks; use hierarchy=None"
        )
    return hierarchy


def _check_hierarchy_callbacks(callbacks: list[Callback]) -> None:
    """Refuse callbacks that exchange every layer's compression state between all ranks (each rank owns some)."""
    for cb in callbacks:
        if isinstance(cb, LGreCo) or (isinstance(cb, LowPassMemoryFilter) and cb.similarity_every_n_steps):
            what = "LGreCo" if isinstance(cb, LGreCo) else "LowPassMemoryFilter(similarity_every_n_steps=...)"
            raise ValueError(
                f"{what} cannot be combined with GradCompStrategy(hierarchy=...): each rank holds the "
                f"compression state of the layers it owns only; use hierarchy=None"
                + ("" if isinstance(cb, LGreCo) else " or similarity_every_n_steps=0")
            )


def _check_small_param(value: Any, compressor: Compressor) -> Any:
    """``small_param`` checked against the compressor's parameter range (``None`` passes)."""
    if value is None:
        return None
    compressor.require_param("small_param")
    try:
        return compressor.check_param(value)
    except (TypeError, ValueError) as err:
        raise type(err)(f"`small_param`: {err}") from None
