"""The shared argument checks (``lightning_gradcomp.checks``), where the shared helpers live, and the strategies'
common default process-group timeout."""

from __future__ import annotations

import ast
import doctest
import inspect
import math
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_gradcomp import GradCompStrategy, LocalSGDStrategy, SwarmStrategy, checks, distributed, failures
from lightning_gradcomp.callbacks import LowPassMemoryFilter
from lightning_gradcomp.checks import (ArgumentTypeError, check_bool, check_bucket_size, check_dtype, check_int,
                                       check_number, check_timeout, is_int, is_number)
from lightning_gradcomp.compressors import DIANA, PowerSGD, TopK

PACKAGE = Path(checks.__file__).parent


def test_examples_pass() -> None:
    assert doctest.testmod(checks).failed == 0


@pytest.mark.parametrize("value, number, integer", [
    (3, True, True), (0.5, True, False), (-2, True, True), (float("inf"), True, False), (True, False, False),
    (False, False, False), ("1", False, False), (None, False, False), (torch.tensor(1), False, False)])
def test_is_number_and_is_int_exclude_bool(value: Any, number: bool, integer: bool) -> None:
    assert is_number(value) == number and is_int(value) == integer


# ---------------------------------------------------------------------------------------------- check_number
@pytest.mark.parametrize("value, kwargs", [
    (0.5, {}), (1.0, {}), (1, {}), (0.0, {"low_open": False}), (0.999, {"high_open": True}),
    (7, {"integer": True})])
def test_check_number_accepts_and_returns_the_value(value: Any, kwargs: dict) -> None:
    assert check_number("x", value, 0.0, 1.0 if not kwargs.get("integer") else 10, **kwargs) is value


@pytest.mark.parametrize("value, kwargs, match", [
    (0.0, {}, r"`ratio` must be in \(0.0, 1.0\], got 0.0"),
    (1.5, {}, r"`ratio` must be in \(0.0, 1.0\], got 1.5"),
    (-0.1, {"low_open": False}, r"`ratio` must be in \[0.0, 1.0\], got -0.1"),
    (1.0, {"high_open": True}, r"`ratio` must be in \(0.0, 1.0\), got 1.0"),
    (1.0, {"low_open": False, "high_open": True}, r"`ratio` must be in \[0.0, 1.0\), got 1.0"),
    (float("nan"), {}, r"`ratio` must be in \(0.0, 1.0\], got nan")])
def test_check_number_rejects_out_of_range_naming_argument_and_range(value: Any, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_number("ratio", value, 0.0, 1.0, **kwargs)


@pytest.mark.parametrize("value, integer, match", [
    (True, False, "`ratio` must be a number, got True"), ("0.1", False, "`ratio` must be a number, got '0.1'"),
    (None, False, "`ratio` must be a number"), (False, True, "`ratio` must be an integer, got False"),
    (1.0, True, "`ratio` must be an integer, got 1.0")])
def test_check_number_rejects_non_numbers_and_bool(value: Any, integer: bool, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        check_number("ratio", value, 0, 1, integer=integer)


# ---------------------------------------------------------------------------------------------- check_int
def test_check_int_accepts_the_closed_range() -> None:
    assert check_int("seed", 0, 0, 2**63 - 1) == 0 and check_int("seed", 2**63 - 1, 0, 2**63 - 1) == 2**63 - 1
    assert check_int("min_numel", 10**12, 1) == 10**12 and type(check_int("k", 3, 1)) is int


@pytest.mark.parametrize("value, error, match", [
    (0, ValueError, r"`min_numel` must be in \[1, inf\), got 0"), (-5, ValueError, r"\[1, inf\), got -5"),
    (True, TypeError, "`min_numel` must be an integer, got True"), (2.0, TypeError, "must be an integer, got 2.0"),
    ("3", TypeError, "must be an integer, got '3'")])
def test_check_int_rejects(value: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        check_int("min_numel", value, 1)


def test_check_int_names_a_finite_upper_bound() -> None:
    with pytest.raises(ValueError, match=r"`accumulate_steps` must be in \[1, 5\], got 6"):
        check_int("accumulate_steps", 6, 1, 5)
    with pytest.raises(ValueError, match=r"`accumulate_steps` must be in \[1, period = 5\], got 6"):
        check_int("accumulate_steps", 6, 1, 5, high_name="period")  # a bound set by another argument


# ---------------------------------------------------------------------------------------------- check_bool
@pytest.mark.parametrize("value", [True, False])
def test_check_bool_accepts_bools(value: bool) -> None:
    assert check_bool("compress_1d", value) is value


@pytest.mark.parametrize("value", [1, 0, "yes", "true", None, 1.0])
def test_check_bool_rejects_everything_else(value: Any) -> None:
    with pytest.raises(TypeError, match=f"`compress_1d` must be a bool, got {value!r}"):
        check_bool("compress_1d", value)


# ---------------------------------------------------------------------------------------------- check_bucket_size
def test_check_bucket_size() -> None:
    assert check_bucket_size(1) == 1 and check_bucket_size(512) == 512
    with pytest.raises(ValueError, match=r"`bucket_size` must be in \[1, inf\), got 0"):
        check_bucket_size(0)
    with pytest.raises(ValueError, match=r"`block_size` must be in \[1, inf\), got -1"):
        check_bucket_size(-1, "block_size")
    with pytest.raises(TypeError, match="`bucket_size` must be an integer, got True"):
        check_bucket_size(True)


# ---------------------------------------------------------------------------------------------- check_dtype
SPARSE = (torch.float32, torch.float16, torch.bfloat16)
HALF = (torch.float16, torch.bfloat16)


@pytest.mark.parametrize("value, expected", [
    (torch.float16, torch.float16), ("float16", torch.float16), ("torch.bfloat16", torch.bfloat16),
    ("float", torch.float32), (torch.float32, torch.float32), ("fp16", torch.float16), ("BF16", torch.bfloat16),
    ("fp32", torch.float32)])
def test_check_dtype_accepts_dtypes_and_their_names(value: Any, expected: torch.dtype) -> None:
    assert check_dtype("value_dtype", value, SPARSE) is expected


@pytest.mark.parametrize("value, allowed, match", [
    (torch.int8, SPARSE, r"`value_dtype` must be one of torch.float32, torch.float16, torch.bfloat16, got torch.int8"),
    ("int8", SPARSE, r"must be one of .*, got torch.int8"),  # a name is shown as the dtype it names
    ("float64x", SPARSE, r"must be one of .*, got 'float64x'"),
    ("fp64", SPARSE, r"must be one of .*, got torch.float64"),  # an alias is shown as the dtype it names
    ("nn", SPARSE, r"got 'nn'"),  # torch.nn is an attribute of torch, not a dtype
    (None, SPARSE, "got None"), (32, SPARSE, "got 32"),
    (torch.float32, HALF, r"`value_dtype` must be torch.float16 or torch.bfloat16, got torch.float32")])
def test_check_dtype_rejects_naming_argument_and_choices(value: Any, allowed: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_dtype("value_dtype", value, allowed)


# ---------------------------------------------------------------------------------------------- check_timeout
@pytest.mark.parametrize("value, expected", [
    (None, None), (timedelta(minutes=2), timedelta(minutes=2)), (120, timedelta(seconds=120)),
    (0.5, timedelta(seconds=0.5)), (10**12, timedelta(seconds=10**12))])
def test_check_timeout_accepts(value: Any, expected: Any) -> None:
    assert check_timeout(value) == expected


@pytest.mark.parametrize("value, error", [
    (0, ValueError), (-1, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
    (timedelta(0), ValueError), (timedelta(seconds=-3), ValueError), (True, TypeError), ("10", TypeError),
    (10**15, ValueError), (timedelta.max, ValueError)])  # beyond int64 microseconds: it overflowed in the store
def test_check_timeout_rejects(value: Any, error: type) -> None:
    match = r"`timeout` must be positive and finite \(seconds in \[1e-06, 1e\+12\]\)" if error is ValueError \
        else "`timeout` must be a datetime.timedelta, a number of seconds or None"
    with pytest.raises(error, match=match):
        check_timeout(value)


# ---------------------------------------------------------------------------------------------- where helpers live
def _package_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    found |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return {name for name in found if name.split(".")[0] == "lightning_gradcomp"}


@pytest.mark.parametrize("module", ["checks.py", "distributed.py", "failures.py", "atomic_files.py"])
def test_the_bottom_modules_import_nothing_from_the_package(module: str) -> None:
    assert _package_imports(PACKAGE / module) == set()


@pytest.mark.parametrize("module", ["swarm/strategy.py", "localsgd/strategy.py"])
def test_other_strategies_do_not_import_helpers_from_gradcomp_strategy(module: str) -> None:
    assert "lightning_gradcomp.strategy" not in _package_imports(PACKAGE / module)


def test_old_import_paths_give_the_same_objects() -> None:
    from lightning_gradcomp import shard_files, strategy
    from lightning_gradcomp.compressors import base, qsgd

    assert base.check_number is check_number and qsgd.check_bucket_size is check_bucket_size
    assert strategy.check_timeout is check_timeout and strategy.DEFAULT_TIMEOUT is distributed.DEFAULT_TIMEOUT
    assert strategy.load_verified is shard_files.load_verified
    assert strategy.verify_checkpoint_file is shard_files.verify_checkpoint_file
    assert {"DEFAULT_TIMEOUT", "check_timeout", "load_verified", "verify_checkpoint_file"} <= set(strategy.__all__)


def test_collective_failures_are_recognised() -> None:
    assert failures.is_collective_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:598] Connection closed "
                                                          "by peer [127.0.0.1]:4242"))
    assert failures.is_collective_failure(RuntimeError("Application timeout caused pair closure"))
    assert not failures.is_collective_failure(RuntimeError("CUDA out of memory"))
    assert not failures.is_collective_failure(ValueError("gloo"))


# ---------------------------------------------------------------------------------------------- the timeout default
@pytest.mark.parametrize("cls", [SwarmStrategy, LocalSGDStrategy])
def test_every_strategy_defaults_to_gradcomp_strategys_timeout(cls: type) -> None:
    default = inspect.signature(GradCompStrategy).parameters["timeout"].default
    assert default == distributed.DEFAULT_TIMEOUT == timedelta(minutes=10)
    assert inspect.signature(cls).parameters["timeout"].default == default
    assert cls()._timeout == GradCompStrategy()._timeout == default


@pytest.mark.parametrize("cls", [GradCompStrategy, SwarmStrategy, LocalSGDStrategy])
def test_every_strategy_checks_its_timeout_alike(cls: type) -> None:
    assert cls(timeout=30)._timeout == timedelta(seconds=30)
    assert cls(timeout=None)._timeout is None
    with pytest.raises(ValueError, match="`timeout` must be positive and finite"):
        cls(timeout=0)
    assert math.isclose(cls(timeout=timedelta(minutes=1))._timeout.total_seconds(), 60.0)


WRONG_TYPES = {  # one wrong-typed argument of each kind of check, strategies, compressors and callbacks
    "beta": lambda: GradCompStrategy(compressor=TopK(), beta="0.5"),
    "hierarchy": lambda: GradCompStrategy(hierarchy=2.0),
    "ratio": lambda: TopK(ratio="0.1"),
    "rank": lambda: PowerSGD(rank=2.5),
    "alpha": lambda: DIANA(alpha="0.1"),
    "bits": lambda: SwarmStrategy(bits="8"),
    "block_size": lambda: SwarmStrategy(block_size="1024"),
    "lattice_margin": lambda: SwarmStrategy(lattice_margin="4"),
    "torus_shape": lambda: SwarmStrategy(topology="torus", torus_shape=("2", "2")),
    "schedule": lambda: LowPassMemoryFilter(schedule={"a": 0.1}),
    "compress_1d": lambda: GradCompStrategy(compress_1d=1),
    "timeout": lambda: GradCompStrategy(timeout="10"),
}


@pytest.mark.parametrize("argument", sorted(WRONG_TYPES))
def test_a_wrong_type_is_a_type_error_and_a_value_error(argument: str) -> None:
    """docs/reliability.md: a wrong type raises ``TypeError``; it is a ``ValueError`` too (:class:`ArgumentTypeError`),
    as an out-of-range value is, so that ``except ValueError`` catches every bad argument. Before, some checks raised a
    plain ``ValueError`` for a wrong type (``beta``, ``hierarchy``, the lattice's, ``torus_shape``, the low-pass
    schedule's keys) and the rest a plain ``TypeError``."""
    with pytest.raises(ArgumentTypeError, match=f"`{argument}`") as caught:
        WRONG_TYPES[argument]()
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, ValueError)


@pytest.mark.parametrize("make", [lambda: GradCompStrategy(compressor=TopK(), beta=1.5),
                                  lambda: GradCompStrategy(hierarchy=0), lambda: GradCompStrategy(hierarchy="nodes"),
                                  lambda: SwarmStrategy(bits=9), lambda: SwarmStrategy(lattice_margin=0.5),
                                  lambda: LowPassMemoryFilter(schedule={-1: 0.1}), lambda: TopK(ratio=2.0)])
def test_a_value_out_of_range_stays_a_plain_value_error(make: Any) -> None:
    with pytest.raises(ValueError) as caught:
        make()
    assert not isinstance(caught.value, TypeError)
