"""The state a quantizing compressor keeps for the piece of each layer this rank owns in the all-to-all protocol
(DIANA's and SignSGD's server-side state, :mod:`.quantized`): read, staged until the step commits, reset when the
owned piece moves; and a ``weights_only``-loadable copy of such state."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_gradcomp.compressors.staged import StagedState
from lightning_gradcomp.compressors.wire_layout import Segment

__all__ = ["OwnedStore", "owned_moved", "owned_state", "stage_owned", "state_copy"]


OwnedStore = Union[StagedState, dict[str, dict[str, Any]]]
"""Per layer, ``{"start": first element, "value": tensor}``: the state of the piece of the layer this rank owns."""


def _owned_entry(store: OwnedStore, name: str) -> Optional[dict[str, Any]]:
    """The committed entry of ``name`` (no working copy), or ``None``."""
    return store.peek(name) if isinstance(store, StagedState) else store.get(name)


def _moved(entry: Optional[dict[str, Any]], seg: Segment) -> bool:
    return entry is not None and (int(entry["start"]) != seg.start or entry["value"].numel() != seg.numel)


def owned_moved(store: OwnedStore, name: str, seg: Segment) -> bool:
    """Whether layer ``name`` has owned state for another range than ``seg`` (the chunk this rank owns moved)."""
    return _moved(_owned_entry(store, name), seg)


def owned_state(store: OwnedStore, name: str, seg: Segment, device: torch.device) -> Tensor:
    """The committed fp32 state of the piece ``seg`` of layer ``name`` that this rank owns, to read only (zeros when
    new or moved); :func:`stage_owned` stores its new value. No working copy is made.

    ``store[name]`` is ``{"start": first element, "value": tensor}``.
    """
    entry = _owned_entry(store, name)
    if entry is None or _moved(entry, seg):
        return torch.zeros(seg.numel, dtype=torch.float32, device=device)
    value: Tensor = entry["value"]
    return value if value.device == device else value.to(device)


def stage_owned(store: OwnedStore, name: str, seg: Segment, value: Tensor) -> None:
    """Store ``value`` as the new owned state of piece ``seg`` of layer ``name`` (staged until the step commits)."""
    store[name] = {"start": seg.start, "value": value}


def state_copy(store: Union[StagedState, dict[str, Any]]) -> dict[str, Any]:
    """A CPU, ``weights_only``-loadable deep copy of a nested dict of tensors and numbers."""
    return {
        k: state_copy(v) if isinstance(v, dict) else v.detach().cpu().clone() if isinstance(v, Tensor) else v
        for k, v in store.items()
    }
