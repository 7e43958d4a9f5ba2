"""Strategy presets: named ``GradCompStrategy`` configurations registered with Lightning.

A compressor module declares its preset next to its class, e.g.::

    register_preset("scalecom", "DDP + ScaleCom CLT-k 1% with error feedback",
                    lambda: {"compressor": CLTK(ratio=0.01)})

and ``Trainer(strategy="scalecom")`` (plus ``_spawn`` / ``_fork`` variants) then works once
``lightning_gradcomp`` is imported. Factories return ``GradCompStrategy`` keyword arguments.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["PRESETS", "register_preset"]

PRESETS: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {}


def register_preset(name: str, description: str, factory: Callable[[], dict[str, Any]]) -> None:
    """Declare a strategy name; ``factory()`` returns the ``GradCompStrategy`` keyword arguments."""
    PRESETS[name.lower()] = (description, factory)
