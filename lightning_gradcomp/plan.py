"""Layer plans: how one DDP bucket splits into per-parameter slots, compressed or dense."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_gradcomp.functional.realview import real_shape

__all__ = ["BucketPlan", "LayerSlot", "SlotPolicy", "build_plan"]


@dataclass(frozen=True)
class LayerSlot:
    """One parameter's gradient inside a bucket buffer.

    Attributes:
        name: the parameter's qualified name (``layer.weight``).
        offset: first element in the flat bucket buffer.
        shape: the parameter's shape; ``numel`` elements follow ``offset``.
        compressed: whether the compressor handles it (else it joins the dense all-reduce).
        small: compressed only because the policy has a ``small_param`` (the size rule alone would send it dense).
    """

    name: str
    offset: int
    shape: tuple[int, ...]
    compressed: bool
    small: bool = False

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def end(self) -> int:
        """One past the last element in the bucket buffer."""
        return self.offset + self.numel


@dataclass(frozen=True)
class SlotPolicy:
    """Which tensors are compressed: ``ndim > 1`` (unless ``compress_1d``) and ``numel >= min_numel``.

    Args:
        min_numel: smallest tensor (in elements) that is compressed.
        compress_1d: also compress vectors (biases, norm weights).
        small_param: when set, the tensors this rule leaves out are compressed too, with this compression
            parameter (e.g. a density of 0.25) instead of going dense; ``None``: they go dense. Empty tensors
            always go dense (nothing to compress; a kept count of at least 1 would not fit them).
    """

    min_numel: int = 1024
    compress_1d: bool = False
    small_param: Any = None

    def wants(self, shape: Sequence[int]) -> bool:
        """Whether a tensor of ``shape`` should be compressed."""
        numel = 1
        for s in shape:
            numel *= s
        return (len(shape) > 1 or self.compress_1d) and numel >= self.min_numel


def size_rule(every_layer: bool, min_numel: Optional[int], compress_1d: Optional[bool]) -> tuple[int, bool]:
    """``(min_numel, compress_1d)`` of a strategy: the user's values, else the compressor's default.

    ``every_layer`` is :attr:`Compressor.compresses_small_layers`: then every layer is compressed (``1, True``),
    otherwise the size rule keeps vectors and layers under 1024 elements dense (``1024, False``).

    Example::

        >>> size_rule(False, None, None), size_rule(True, None, None), size_rule(True, 4096, None)
        ((1024, False), (1, True), (4096, True))
    """
    return (
        (1 if every_layer else 1024) if min_numel is None else min_numel,
        every_layer if compress_1d is None else compress_1d,
    )


@dataclass(frozen=True)
class BucketPlan:
    """The slots of one bucket, in buffer order."""

    index: int
    numel: int
    slots: tuple[LayerSlot, ...]

    @property
    def dense(self) -> tuple[LayerSlot, ...]:
        """Slots reduced densely."""
        return tuple(s for s in self.slots if not s.compressed)

    @property
    def compressed(self) -> tuple[LayerSlot, ...]:
        """Slots handed to the compressor."""
        return tuple(s for s in self.slots if s.compressed)


def build_plan(
    index: int,
    params: Sequence[torch.Tensor],
    names: dict[int, str],
    policy: SlotPolicy,
    accepts: Callable[[LayerSlot], bool] = lambda slot: True,
) -> BucketPlan:
    """Lay out ``params`` (a bucket's parameters, in bucket order) as contiguous slots.

    Args:
        index: the bucket index.
        params: ``bucket.parameters()``; their gradients are packed back to back in the buffer (a complex one as its
            real view: a slot of shape ``(*shape, 2)``; the size rule still judges the parameter's own shape).
        names: ``id(param) -> name``.
        policy: the size/dimension policy.
        accepts: the compressor's own veto (e.g. PowerSGD skips layers it cannot shrink).
    """
    slots: list[LayerSlot] = []
    offset = 0
    for param in params:
        shape = real_shape(param)  # a complex gradient lies in the bucket as its real view (DDP's layout)
        name = names.get(id(param), f"bucket{index}.param{len(slots)}")
        slot = LayerSlot(name, offset, shape, compressed=False)
        if policy.wants(param.shape) and accepts(slot):  # the parameter's own shape: a complex vector is 1-D
            slot = LayerSlot(name, offset, shape, compressed=True)
        elif policy.small_param is not None and slot.numel > 0 and accepts(slot):
            slot = LayerSlot(name, offset, shape, compressed=True, small=True)
        slots.append(slot)
        offset += slot.numel
    return BucketPlan(index=index, numel=offset, slots=tuple(slots))
