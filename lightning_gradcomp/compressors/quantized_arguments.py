"""The arguments of the quantizing compressors (:mod:`.quantized`): the aggregation protocol (``"auto"``,
``"alltoall"``, ``"allgather"``) and the one it runs at a world size, the group size with its deprecated alias, and
the norm of stochastic rounding's scales."""

from __future__ import annotations

from typing import Any

from lightning_gradcomp.checks import check_group_size, renamed_argument
from lightning_gradcomp.functional.quantization_groups import PNorm, parse_p

__all__ = ["AGGREGATIONS", "check_aggregation", "check_p", "resolve_aggregation", "resolve_group_size"]

AGGREGATIONS = ("auto", "alltoall", "allgather")


def check_aggregation(aggregation: str) -> str:
    """Validate the ``aggregation`` argument (``"auto"``, ``"alltoall"`` or ``"allgather"``)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"`aggregation` must be one of {AGGREGATIONS}, got {aggregation!r}")
    return aggregation


def resolve_group_size(owner: str, group_size: Any, bucket_size: Any, default: int = 512) -> int:
    """The validated ``group_size`` of a quantizer from ``group_size=`` and its deprecated alias ``bucket_size=``
    (:func:`~lightning_gradcomp.checks.renamed_argument`: the alias warns; checked under the name the caller used).

    Example::

        >>> resolve_group_size("QSGD", 128, None)
        128
    """
    name, value = renamed_argument(owner, "group_size", group_size, default, "bucket_size", bucket_size, stacklevel=4)
    return check_group_size(value, name)


def resolve_aggregation(aggregation: str, world_size: int) -> str:
    """The protocol ``aggregation`` runs at ``world_size`` ranks: ``"auto"`` is ``"allgather"`` for ``W <= 2`` (the
    same bytes as the all-to-all, one collective, no second quantization) and ``"alltoall"`` above.

    Example::

        >>> resolve_aggregation("auto", 2), resolve_aggregation("auto", 4), resolve_aggregation("alltoall", 2)
        ('allgather', 'alltoall', 'alltoall')
    """
    check_aggregation(aggregation)
    if aggregation == "auto":
        return "allgather" if world_size <= 2 else "alltoall"
    return aggregation


def check_p(p: PNorm) -> float:
    """Validate a scale norm for stochastic rounding: 2 or inf."""
    try:
        value = parse_p(p)
    except ValueError:
        value = 1.0  # not a norm at all: report the values allowed here, not parse_p's
    if value == 1.0:
        raise ValueError(f"`p` must be 2 or inf, got {p!r}")
    return value
