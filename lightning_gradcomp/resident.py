"""Bytes of the tensors an object graph keeps resident (compression state between steps)."""

from typing import Any

import torch
from torch import Tensor

__all__ = ["resident_nbytes"]


def resident_nbytes(*roots: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots`` through object attributes (``__dict__`` and
    ``__slots__``), dicts, lists and tuples (each storage counted once, whole).

    Example::

        >>> t = torch.zeros(4)
        >>> resident_nbytes({"a": t, "b": t[:2]}, [torch.zeros(2, dtype=torch.float64)])
        32
    """
    seen_objects: set[int] = set()
    seen_storages: set[tuple[str, int]] = set()
    total = 0
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if isinstance(obj, Tensor):
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr())
            if key not in seen_storages:
                seen_storages.add(key)
                total += storage.nbytes()
            continue
        if id(obj) in seen_objects or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype)):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        else:
            if hasattr(obj, "__dict__"):
                stack.extend(vars(obj).values())
            for cls in type(obj).__mro__:  # slotted classes (PyTorch's PowerSGDState)
                slots = cls.__dict__.get("__slots__", ())
                stack.extend(getattr(obj, name, None) for name in ((slots,) if isinstance(slots, str) else slots))
    return total
