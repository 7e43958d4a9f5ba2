"""Compressor names: ``register`` / ``create`` / ``names`` (``list`` is the deprecated name of ``names``).

These names build a compressor *class* from a string (``GradCompStrategy(compressor="topk")``,
``create("topk", density=0.1)``). Names for ``Trainer(strategy=...)`` are presets, a separate registry on the
Lightning floor: :func:`lightning_gradcomp.presets.register_preset`.
"""

from __future__ import annotations

import builtins
import re
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, Union

from lightning_gradcomp.checks import ArgumentTypeError
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.none import NoCompression

__all__ = ["as_compressor", "create", "describe", "list", "names", "register"]

_FACTORIES: dict[str, Callable[..., Compressor]] = {}
F = TypeVar("F", bound=Callable[..., Compressor])


def register(name: str) -> Callable[[F], F]:
    """Decorator registering a compressor class or factory under ``name`` (warns on overwrite)."""

    def wrap(factory: F) -> F:
        key = name.lower()
        if key in _FACTORIES and _FACTORIES[key] is not factory:
            warnings.warn(f"compressor name {name!r} re-registered; the previous entry is replaced", stacklevel=2)
        _FACTORIES[key] = factory
        return factory

    return wrap


def create(name: str, **kwargs: Any) -> Compressor:
    """Build the compressor registered as ``name`` with ``kwargs``.

    Raises:
        KeyError: unknown name; the message lists the available names.
    """
    key = name.lower()
    if key not in _FACTORIES:
        raise KeyError(f"unknown compressor {name!r}; available: {', '.join(names())}")
    return _FACTORIES[key](**kwargs)


def names() -> builtins.list[str]:
    """Sorted names of the registered compressors."""
    return sorted(_FACTORIES)


def list() -> builtins.list[str]:  # noqa: A001 - the deprecated name, kept for one release
    """Deprecated name of :func:`names` (it shadowed the builtin ``list``); warns with a ``DeprecationWarning``."""
    warnings.warn(
        "lightning_gradcomp.compressors.registry.list() is deprecated: use registry.names()",
        DeprecationWarning,
        stacklevel=2,
    )
    return names()


def describe(name: str) -> str:
    """One line about the compressor registered as ``name``: the first paragraph of its class's (factory's)
    docstring, as plain text (reST's double backticks dropped)."""
    paragraph = (_FACTORIES[name.lower()].__doc__ or "").strip().split("\n\n")[0]
    paragraph = re.sub(r":\w+:`~?(?:[\w.]+\.)?(\w+)`", r"\1", paragraph)  # :class:`~a.b.C` -> C
    return " ".join(paragraph.replace("``", "").split())


class _UnknownCompressorError(KeyError, ValueError):
    """An unknown compressor name: a ``ValueError`` (and a ``KeyError``, as :func:`create` raises)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def as_compressor(compressor: Union[Compressor, str, None]) -> Compressor:
    """A strategy's ``compressor`` argument as a compressor: an instance as is, a registered name built with its
    defaults, ``None`` as :class:`~lightning_gradcomp.compressors.NoCompression`.

    Raises:
        ValueError: an unknown name (also a ``KeyError``); the message lists the registered names.
        TypeError: neither a :class:`Compressor`, a string nor ``None``.
    """
    if compressor is None:
        return NoCompression()
    if isinstance(compressor, str):
        if compressor.lower() not in names():
            raise _UnknownCompressorError(
                f"unknown compressor {compressor!r}: `compressor` must be a Compressor "
                f"instance or a registered name ({', '.join(names())})"
            )
        return create(compressor)
    if not isinstance(compressor, Compressor):
        raise ArgumentTypeError(
            f"`compressor` must be a Compressor instance or a registered name ({', '.join(names())}), "
            f"got {compressor!r}"
        )
    return compressor


register("none")(NoCompression)  # the default compressor (as_compressor(None)): named here, where it is built
