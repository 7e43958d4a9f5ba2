"""Strategy presets: the one way to add a name that ``Trainer(strategy=...)`` accepts.

On the Lightning floor of the package (it imports Lightning's ``StrategyRegistry``): the compressors declare no
presets. ``GradCompStrategy``'s built-in names are declared in :mod:`lightning_gradcomp.gradcomp_presets`, the other
strategies' next to their classes, yours anywhere::

    register_preset("scalecom", "DDP + ScaleCom CLT-k 1% with error feedback",
                    lambda: {"compressor": CLTK(density=0.01)})
    register_preset("swarmsgd", "SwarmSGD with its defaults", dict, strategy=SwarmStrategy)

The call registers ``name`` (``popen`` launcher), ``name_spawn`` and ``name_fork`` with Lightning's
``StrategyRegistry`` at once, and, for a strategy class that wraps the model in DDP (it takes
``find_unused_parameters``), each of them also with ``_find_unused_parameters_true`` as Lightning names its DDP
variants (``scalecom_find_unused_parameters_true``, ``scalecom_fork_find_unused_parameters_true``...), whenever it
runs: a preset declared in your own code after ``import lightning_gradcomp`` works with ``Trainer(strategy="name")``
with no other call. ``factory()`` returns the keyword arguments of the strategy class (``GradCompStrategy`` unless
``strategy=`` names another) and runs each time a strategy is built from the name, so two Trainers never share a
(stateful) compressor. ``PRESETS`` maps each name to ``(description, factory)``; :func:`preset_class` gives the
class it builds. The presets of ``GradCompStrategy`` are Fabric strategy names too (``Fabric(strategy="scalecom")``):
:mod:`lightning_gradcomp.fabric_strategy` follows every declaration through :func:`on_declare`.

Compressor names are a separate, smaller name space: :func:`lightning_gradcomp.compressors.register` names a
compressor *class*, so that ``GradCompStrategy(compressor="topk")`` and ``compressors.create("topk", density=0.1)``
can build it. To make a configuration selectable with ``Trainer(strategy=...)``, declare a preset; register a
compressor name only to build the class from a string.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any, Optional

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_gradcomp.checks import ArgumentTypeError

__all__ = ["PRESETS", "UNUSED_SUFFIX", "on_declare", "preset_class", "register_preset", "register_presets"]

Factory = Callable[[], dict[str, Any]]

PRESETS: dict[str, tuple[str, Factory]] = {}
"""Every declared preset: name -> ``(description, factory)``."""
_CLASSES: dict[str, Optional[type[Strategy]]] = {}
"""The ``strategy=`` of each declared preset (``None``: ``GradCompStrategy``)."""
_VARIANTS = (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork"))
UNUSED_SUFFIX = "_find_unused_parameters_true"
"""Suffix of the variants with ``find_unused_parameters=True`` (Lightning's ``ddp_find_unused_parameters_true``)."""
_LISTENERS: list[Callable[[str], None]] = []
"""Called with each preset's name as it is declared (:func:`on_declare`)."""


class _Builder:
    """What ``StrategyRegistry`` stores for a preset name: ``StrategyRegistry.get`` calls it for a new strategy."""

    def __init__(self, factory: Factory, strategy: Optional[type[Strategy]], name: str = "") -> None:
        self.factory = factory
        self.strategy = strategy
        self.name = name

    def __call__(self, **init_params: Any) -> Strategy:
        built = _resolve(self.strategy)(**{**self.factory(), **init_params})
        if self.name:  # for messages that name a variant of it (GradCompStrategy's unused-parameter hint)
            suffix = {method: suffix for suffix, method in _VARIANTS}.get(str(init_params.get("start_method")), "")
            built._preset_name = self.name + suffix  # type: ignore[attr-defined]
        return built

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_resolve(self.strategy).__name__}, {self.factory!r})"


def register_preset(
    name: str, description: str, factory: Factory, *, strategy: Optional[type[Strategy]] = None
) -> None:
    """Declare the strategy name ``name`` (+ ``_spawn`` / ``_fork``) and register it with Lightning now.

    Args:
        name: the ``Trainer(strategy=...)`` name (stored lower-case).
        description: one line, shown by ``lightning-gradcomp list`` and ``StrategyRegistry[name]["description"]``.
        factory: returns the strategy's keyword arguments; called once per strategy built from the name.
        strategy: the strategy class; ``None`` means :class:`~lightning_gradcomp.GradCompStrategy`.

    Raises:
        ValueError: ``name`` or a variant is already a Lightning (Trainer or Fabric) strategy name that is not a
            preset (``"ddp"``, Fabric's ``"dp"``).
    """
    key = _check_declaration(name, description, factory, strategy)
    if key in PRESETS and (PRESETS[key], _CLASSES[key]) != ((description, factory), strategy):
        warnings.warn(f"preset {name!r} re-declared; the previous one is replaced", stacklevel=2)
    PRESETS[key] = (description, factory)
    _CLASSES[key] = strategy
    _register(StrategyRegistry, key, description, _Builder(factory, strategy, key))
    for listener in _LISTENERS:
        listener(key)


def on_declare(listener: Callable[[str], None]) -> None:
    """Call ``listener(name)`` for every preset declared so far, then for each one declared (or re-declared) later.

    How another registry follows the presets: :mod:`lightning_gradcomp.fabric_strategy` registers the
    ``GradCompStrategy`` presets with Fabric's ``STRATEGY_REGISTRY`` this way.
    """
    _LISTENERS.append(listener)
    for key in list(PRESETS):
        listener(key)


def preset_class(name: str) -> type[Strategy]:
    """The strategy class that preset ``name`` builds.

    Raises:
        KeyError: unknown name; the message lists the presets.
    """
    key = name.lower()
    if key not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; available: {', '.join(sorted(PRESETS))}")
    return _resolve(_CLASSES.get(key))


def register_presets(
    strategy_registry: Any, strategy: type[Strategy], declared_for: Optional[type[Strategy]] = None
) -> None:
    """Register the presets that build ``strategy`` (+ variants) in ``strategy_registry``, replacing their entries.

    Declaring a preset already registers it with Lightning's ``StrategyRegistry``; this is what the classes'
    ``register_strategies`` hook does, for another registry or to restore removed names. Idempotent.
    ``declared_for`` registers the presets declared for that class instead, built with ``strategy``.
    """
    source = declared_for or strategy
    for key, (description, factory) in PRESETS.items():
        if preset_class(key) is source:
            _register(strategy_registry, key, description, _Builder(factory, strategy, key))


def _register(strategy_registry: Any, key: str, description: str, builder: _Builder) -> None:
    unused = _wraps_in_ddp(builder.strategy)
    for suffix, method in _VARIANTS:
        strategy_registry.register(key + suffix, builder, description=description, override=True, start_method=method)
        if unused:
            strategy_registry.register(
                key + suffix + UNUSED_SUFFIX,
                builder,
                description=f"{description}; find_unused_parameters=True",
                override=True,
                start_method=method,
                find_unused_parameters=True,
            )


def _wraps_in_ddp(strategy: Optional[type[Strategy]]) -> bool:
    """Whether the class takes DDP's ``find_unused_parameters`` (by name or through ``**kwargs``)."""
    if strategy is None:
        return True  # GradCompStrategy
    parameters = inspect.signature(strategy.__init__).parameters.values()
    return any(p.name == "find_unused_parameters" or p.kind is p.VAR_KEYWORD for p in parameters)


def _check_declaration(name: str, description: str, factory: Factory, strategy: Optional[type[Strategy]]) -> str:
    if not isinstance(name, str) or not name:
        raise ArgumentTypeError(f"preset `name` must be a non-empty str, got {name!r}")
    if not isinstance(description, str):
        raise ArgumentTypeError(f"preset `description` must be a str, got {description!r}")
    if not callable(factory):
        raise ArgumentTypeError(f"preset `factory` must be a callable returning keyword arguments, got {factory!r}")
    if strategy is not None and not (isinstance(strategy, type) and issubclass(strategy, Strategy)):
        raise ArgumentTypeError(f"preset `strategy` must be a Lightning Strategy class or None, got {strategy!r}")
    key = name.lower()
    for suffix in (suffix + unused for suffix, _ in _VARIANTS for unused in ("", UNUSED_SUFFIX)):
        for registry in (StrategyRegistry, FABRIC_REGISTRY):  # Fabric's too: the presets are registered there
            entry = dict.get(registry, key + suffix)
            if entry is not None and not isinstance(entry["strategy"], _Builder):
                raise ValueError(f"{key + suffix!r} is already a Lightning strategy name; choose another preset name")
    return key


def _resolve(strategy: Optional[type[Strategy]]) -> type[Strategy]:
    if strategy is not None:
        return strategy
    from lightning_gradcomp.strategy import GradCompStrategy  # late: strategy.py imports us (test_package_floors)

    return GradCompStrategy
