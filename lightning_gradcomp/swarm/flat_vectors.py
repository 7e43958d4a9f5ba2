"""A model's tensors as one flat real vector and back: what SwarmSGD gossips and averages (a complex tensor counts as
its real view, two numbers per entry)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.functional.realview import from_real, real_shape, real_view, real_view_numel

__all__: list[str] = []  # SwarmStrategy's own helpers: _write_flat, _split_real, _write_named


def _write_flat(tensors: list[Tensor], flat: Tensor) -> None:
    """Copy consecutive pieces of the real vector ``flat`` into ``tensors`` (a complex one takes its real view's)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            target = real_view(t.detach())
            target.copy_(flat[offset : offset + target.numel()].view_as(target))
            offset += target.numel()


def _split_real(flat: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
    """Consecutive pieces of the real vector ``flat`` as tensors of the dtypes and shapes of ``like``'s."""
    out, offset = {}, 0
    for name, t in like.items():
        shape = real_shape(t)
        numel = real_view_numel(t)
        out[name] = from_real(flat[offset : offset + numel].view(shape), t)
        offset += numel
    return out


def _write_named(module: torch.nn.Module, values: dict[str, Tensor]) -> None:
    live: dict[str, Tensor] = dict(module.named_parameters())
    live.update(dict(module.named_buffers()))
    with torch.no_grad():
        for name, value in values.items():
            if name in live:
                live[name].copy_(value)
