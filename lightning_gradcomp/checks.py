"""Argument checks shared by the package: each raises naming the argument and what it allows.

The bottom floor of the package: it imports only the standard library and torch, so every module (compressors,
callbacks, strategies, ``functional``) can use it. ``bool`` is never accepted as a number: ``True`` is an ``int``
to Python, but ``density=True`` or ``bits=True`` is a mistake.

Example::

    >>> check_number("density", 0.01, 0.0, 1.0)
    0.01
    >>> check_int("min_numel", 0, 1)
    Traceback (most recent call last):
    ...
    ValueError: `min_numel` must be in [1, inf), got 0
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Optional, TypeGuard, TypeVar, Union, cast

import torch

__all__ = [
    "ArgumentTypeError",
    "DTYPE_ALIASES",
    "MAX_TIMEOUT_SECONDS",
    "check_bool",
    "check_bucket_size",
    "check_dtype",
    "check_group_size",
    "check_int",
    "check_number",
    "check_single_process",
    "check_timeout",
    "check_value",
    "is_int",
    "is_number",
    "renamed_argument",
    "renamed_keywords",
]


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type. A ``TypeError``, and a ``ValueError`` too, so that code catching ``ValueError``
    for every bad argument (the other checks raise it for values out of range) catches this one as well.

    Example::

        >>> try:
        ...     check_int("rank", "4", 1)
        ... except ValueError as err:
        ...     isinstance(err, TypeError), str(err)
        (True, "`rank` must be an integer, got '4'")
    """


def is_number(value: Any) -> bool:
    """Whether ``value`` is an ``int`` or a ``float``, not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is an ``int``, not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_number(
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    low_open: bool = True,
    high_open: bool = False,
    integer: bool = False,
    high_name: Optional[str] = None,
) -> Any:
    """Validate a numeric argument against ``(low, high]`` (``low_open``, ``high_open`` choose the brackets) and
    return it unchanged. ``high_name``: the other argument ``high`` comes from, named in the message
    (``[1, period = 5]``).

    Raises:
        TypeError: ``value`` is not a number (or not an integer when ``integer``); the message names ``name``.
        ValueError: ``value`` is outside the range; the message names ``name`` and the range.
    """
    if not (is_int(value) if integer else is_number(value)):
        raise ArgumentTypeError(f"`{name}` must be {'an integer' if integer else 'a number'}, got {value!r}")
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        closed = not high_open and not (integer and math.isinf(high))  # no integer is infinite: [1, inf)
        brackets = ("(" if low_open else "[", "]" if closed else ")")
        upper = high if high_name is None else f"{high_name} = {high}"
        raise ValueError(f"`{name}` must be in {brackets[0]}{low}, {upper}{brackets[1]}, got {value!r}")
    return value


def check_value(value: Any, of_type: Callable[[Any], bool], in_range: Callable[[Any], bool], message: str) -> Any:
    """Return ``value`` when ``of_type(value)`` and ``in_range(value)``; otherwise raise ``f"{message}, got {value!r}"``
    as :class:`ArgumentTypeError` (the wrong type) or ``ValueError`` (out of range), for checks whose message states
    the type and the range at once.

    Example::

        >>> check_value(0.5, is_number, lambda v: 0 < v <= 1, "`beta` must be a number in (0, 1]")
        0.5
    """
    if not of_type(value):
        raise ArgumentTypeError(f"{message}, got {value!r}")
    if not in_range(value):
        raise ValueError(f"{message}, got {value!r}")
    return value


def check_int(name: str, value: Any, low: int, high: float = math.inf, *, high_name: Optional[str] = None) -> int:
    """Validate an integer argument in ``[low, high]`` (``high`` may be ``inf``; ``high_name`` as in
    :func:`check_number`) and return it.

    Raises:
        TypeError: ``value`` is not an ``int`` (a ``bool`` or an integral ``float`` neither).
        ValueError: ``value`` is outside the range; the message names ``name`` and the range.
    """
    return int(check_number(name, value, low, high, low_open=False, integer=True, high_name=high_name))


SINGLE_PROCESS = ("dense", "compress")
"""The values of the strategies' ``single_process``: what they do when one process trains (world size 1)."""


def check_single_process(value: Any) -> str:
    """``single_process`` checked: ``"dense"`` or ``"compress"`` (``ValueError`` naming the argument otherwise)."""
    if not isinstance(value, str) or value not in SINGLE_PROCESS:
        raise ValueError(f"`single_process` must be one of {SINGLE_PROCESS}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """Validate a flag: a ``bool`` (not ``0``/``1`` nor ``"yes"``).

    Raises:
        TypeError: ``value`` is not a ``bool``; the message names ``name``.
    """
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"`{name}` must be a bool, got {value!r}")
    return value


def check_group_size(value: Any, name: str = "group_size") -> int:
    """Validate a quantization group size, the number of consecutive elements sharing one scale: an integer >= 1."""
    return check_int(name, value, 1)


def check_bucket_size(value: Any, name: str = "bucket_size") -> int:
    """Deprecated name of :func:`check_group_size` (warns with a ``DeprecationWarning``)."""
    warnings.warn("check_bucket_size is deprecated: use check_group_size", DeprecationWarning, stacklevel=2)
    return check_group_size(value, name)


def renamed_argument(
    owner: str, new: str, value: Any, default: Any, old: str, old_value: Any, *, stacklevel: int = 3
) -> tuple[str, Any]:
    """``(name, value)`` of an argument renamed from ``old`` to ``new``, taken as ``owner(new=value, old=old_value)``
    was called (``old_value`` ``None``: not passed): ``(new, value)``; else ``(old, old_value)``, with a
    ``DeprecationWarning`` that names ``new`` (``stacklevel`` as :func:`warnings.warn`'s, counted from the caller of
    this function). Check the value under the returned name, the one the caller used.

    Raises:
        TypeError: both names were given, with different values (``value`` not left at ``default``).

    Example::

        >>> renamed_argument("QSGD", "group_size", 128, 512, "bucket_size", None)
        ('group_size', 128)
    """
    if old_value is None:
        return new, value
    warnings.warn(
        f"{owner}({old}=...) is deprecated: use {owner}({new}={old_value!r})",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    if value != default and value != old_value:
        raise ArgumentTypeError(
            f"{owner}: pass `{new}` only (`{old}` is its deprecated name), got both {value!r} and {old_value!r}"
        )
    return old, old_value


_F = TypeVar("_F", bound=Callable[..., Any])


def renamed_keywords(**renamed: str) -> Callable[[_F], _F]:
    """Decorator: the function also accepts each deprecated keyword ``old`` of ``renamed`` (``old="new"``) as its
    new name ``new``, with a ``DeprecationWarning`` naming ``new``; both at once raise ``TypeError``.

    Example::

        >>> @renamed_keywords(bucket_size="group_size")
        ... def groups(n, group_size):
        ...     return -(-n // group_size)
        >>> groups(1000, group_size=512)
        2
    """

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old, new in renamed.items():
                if old in kwargs:
                    if new in kwargs:
                        raise ArgumentTypeError(
                            f"{fn.__name__}: pass `{new}` only (`{old}` is its deprecated name), got both"
                        )
                    warnings.warn(
                        f"{fn.__name__}({old}=...) is deprecated: use {fn.__name__}({new}=...)",
                        DeprecationWarning,
                        stacklevel=2,
                    )
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return cast(_F, call)

    return wrap


DTYPE_ALIASES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp64": torch.float64,
}
"""Short dtype names accepted wherever a dtype may be given as a string (the names in Lightning's precisions)."""


def check_dtype(name: str, value: Union[torch.dtype, str], allowed: Sequence[torch.dtype]) -> torch.dtype:
    """Validate a dtype among ``allowed``; strings name a torch dtype (``"bfloat16"``, ``"torch.float16"``) or are
    one of :data:`DTYPE_ALIASES` (``"fp16"``, ``"bf16"``, ``"fp32"``, ``"fp64"``).

    Raises:
        ValueError: ``value`` is not one of ``allowed``; the message names ``name`` and lists them.
    """
    if isinstance(value, str):
        dtype = DTYPE_ALIASES.get(value.lower(), getattr(torch, value.removeprefix("torch."), None))
    else:
        dtype = value
    if not isinstance(dtype, torch.dtype) or dtype not in allowed:
        names = [str(d) for d in allowed]
        choices = " or ".join(names) if len(names) == 2 else "one of " + ", ".join(names)
        raise ValueError(f"`{name}` must be {choices}, got {dtype if isinstance(dtype, torch.dtype) else value!r}")
    return dtype


MAX_TIMEOUT_SECONDS = 1e12
"""Largest process-group timeout accepted (about 31,700 years): torch.distributed holds a timeout as int64
microseconds, which ``timedelta.max`` overflows (its store then times out at once, with a negative timeout)."""


def check_timeout(timeout: Any) -> Optional[timedelta]:
    """Validate a process-group timeout: a positive ``timedelta``, positive seconds (YAML), or ``None``.

    Raises:
        TypeError: not a ``timedelta``, a number or ``None``.
        ValueError: not in ``[1e-06, MAX_TIMEOUT_SECONDS]`` seconds.
    """
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif is_number(timeout):
        seconds = float(timeout)
    else:
        raise ArgumentTypeError(f"`timeout` must be a datetime.timedelta, a number of seconds or None, got {timeout!r}")
    # a timedelta holds whole microseconds: fewer would round to a zero timeout, not a short one
    if not 1e-6 <= seconds <= MAX_TIMEOUT_SECONDS:
        raise ValueError(
            f"`timeout` must be positive and finite (seconds in [1e-06, {MAX_TIMEOUT_SECONDS:g}]), got {timeout!r}"
        )
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)
