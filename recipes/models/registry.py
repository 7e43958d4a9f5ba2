"""Name -> builder registry for recipe models (``create_model("resnet18", num_classes=1000)``)."""

from __future__ import annotations

import warnings
from typing import Any, Callable, TypeVar

from torch import nn

__all__ = ["create_model", "list_models", "register_model"]

_BUILDERS: dict[str, Callable[..., nn.Module]] = {}
F = TypeVar("F", bound=Callable[..., nn.Module])


def register_model(fn: F) -> F:
    """Decorator: register a builder under its function name (warns when a name is overwritten)."""
    if fn.__name__ in _BUILDERS:
        warnings.warn(f"model {fn.__name__!r} is registered twice; the later builder wins", stacklevel=2)
    _BUILDERS[fn.__name__] = fn
    return fn


def list_models(prefix: str = "") -> list[str]:
    """Registered model names starting with ``prefix``, sorted."""
    return sorted(n for n in _BUILDERS if n.startswith(prefix))


def create_model(name: str, **kwargs: Any) -> nn.Module:
    """Build the registered model ``name`` with ``kwargs``; ``ValueError`` listing the names when unknown."""
    if name not in _BUILDERS:
        raise ValueError(f"`arch` must be one of {list_models()}, got {name!r}")
    return _BUILDERS[name](**kwargs)
