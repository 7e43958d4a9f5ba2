"""Walking nested state (dicts, lists, tuples) for the tensors in it."""

from __future__ import annotations

from typing import Any

import torch


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a nested dict/list/tuple, depth first."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors(v)]
    return []
