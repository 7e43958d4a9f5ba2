"""Process-global state that tests change, saved before a test and put back after it (``tests/conftest.py``).

Without it a test's leftovers decide what later tests on the same worker see: ``LightningEnvironment.
set_global_rank(1)`` sets Lightning's process-global ``rank_zero_only.rank``, and every later test that expects a
``rank_zero_warn`` then sees none (issue 50).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["RANK_ZERO_MODULES", "REGISTRIES", "restored_global_state"]

RANK_ZERO_MODULES = (
    "lightning_utilities.core.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.pytorch.utilities.rank_zero",
    "lightning_fabric.utilities.rank_zero",
    "pytorch_lightning.utilities.rank_zero",
)
"""Modules whose ``rank_zero_only`` carries the process-global ``rank`` (one object today, kept apart if not)."""

REGISTRIES = (
    ("lightning.pytorch.strategies", "StrategyRegistry"),
    ("lightning.fabric.strategies", "STRATEGY_REGISTRY"),
    ("pytorch_lightning.strategies", "StrategyRegistry"),
    ("lightning_fabric.strategies", "STRATEGY_REGISTRY"),
    ("lightning_gradcomp.compressors.registry", "_FACTORIES"),
    ("lightning_gradcomp.presets", "PRESETS"),
    ("lightning_gradcomp.presets", "_CLASSES"),
)
"""Module-level dictionaries that registering a strategy, preset or compressor fills."""

Restore = Callable[[], None]


def _rank_zero_only() -> list[Any]:
    """The distinct ``rank_zero_only`` objects of the modules imported so far."""
    found: dict[int, Any] = {}
    for name in RANK_ZERO_MODULES:
        fn = getattr(sys.modules.get(name), "rank_zero_only", None)
        if fn is not None:
            found[id(fn)] = fn
    return list(found.values())


def _save_ranks() -> Restore:
    saved = [(fn, fn.__dict__.get("rank")) for fn in _rank_zero_only()]

    def restore() -> None:
        for fn, rank in saved:
            fn.rank = rank

    return restore


def _save_registries() -> Restore:
    saved = []
    for module, attr in REGISTRIES:
        registry = getattr(sys.modules.get(module), attr, None)
        if isinstance(registry, dict):
            saved.append((registry, dict(registry)))

    def restore() -> None:
        for registry, entries in saved:
            if registry != entries:
                registry.clear()
                registry.update(entries)

    return restore


def _save_environment() -> Restore:
    saved = dict(os.environ)

    def restore() -> None:
        if os.environ != saved:
            os.environ.clear()
            os.environ.update(saved)

    return restore


def _save_warning_filters() -> Restore:
    saved = list(warnings.filters)

    def restore() -> None:
        warnings.filters[:] = saved
        mutated = getattr(warnings, "_filters_mutated", None)  # drops the per-module "already warned" caches
        if mutated is not None:
            mutated()

    return restore


def _save_torch() -> Restore:
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()

    def restore() -> None:
        torch.set_default_dtype(dtype)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)

    return restore


@contextmanager
def restored_global_state() -> Iterator[None]:
    """Run the block, then put back Lightning's ``rank_zero_only.rank``, the strategy, preset and compressor
    registries, ``os.environ``, the warning filters, and torch's default dtype, thread count and determinism."""
    restores = [_save_ranks(), _save_registries(), _save_environment(), _save_warning_filters(), _save_torch()]
    try:
        yield
    finally:
        for restore in reversed(restores):
            restore()
