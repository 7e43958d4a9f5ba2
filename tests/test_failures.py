"""``failures``: a timed-out collective is explained (which one, which group, how long, what to set); other
failures keep the dead-rank hint. Hung ranks through each front-end: ``tests/reliability/test_rank_failure.py``."""

from __future__ import annotations

import doctest
from datetime import timedelta

import pytest

from lightning_gradcomp import failures
from lightning_gradcomp.failures import (CollectiveTimeoutError, explain, explained, failure_hint, headline, reraised,
                                         timeout_message)

GLOO_TIMEOUT = RuntimeError("[/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation "
                            "to complete")
GLOO_CLOSED = RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:34014")


def test_doctests() -> None:
    assert doctest.testmod(failures, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0


def test_a_backend_timeout_is_explained_with_the_time_it_waited() -> None:
    err = explain(GLOO_TIMEOUT, "all_gather", None, "`exchange_timeout=` of SwarmStrategy")
    assert isinstance(err, CollectiveTimeoutError) and isinstance(err, RuntimeError)
    text = str(err)
    assert text.startswith("collective all_gather on the group of ranks ? timed out after 0:00:20: a rank is "
                           "probably hung or dead")
    assert "The wait is set by `exchange_timeout=` of SwarmStrategy" in text
    assert text.endswith(f"Backend error: {GLOO_TIMEOUT}")
    assert explain(err, "all_gather", None) is err  # explained once
    assert explain(GLOO_CLOSED, "all_gather", None) is GLOO_CLOSED  # a dead rank is not a timeout
    assert explain(ValueError("timeout"), "all_gather", None).__class__ is ValueError


def test_explained_raises_from_the_backend_error() -> None:
    with pytest.raises(CollectiveTimeoutError, match="collective broadcast on") as info:
        with explained("broadcast", None):
            raise GLOO_TIMEOUT
    assert info.value.__cause__ is GLOO_TIMEOUT
    with pytest.raises(RuntimeError, match="Connection closed"):
        with explained("broadcast", None):
            raise GLOO_CLOSED


def test_the_strategy_hint_keeps_an_explanation_and_drops_what_wrapped_it() -> None:
    explanation = timeout_message("all_reduce", [0, 1, 2], timedelta(seconds=3))
    wrapped = RuntimeError(f"Got the following error when running the callback: CollectiveTimeoutError: "
                           f"{explanation} Backend error: {GLOO_TIMEOUT}")
    assert headline(str(wrapped)).startswith(explanation)
    hint = failure_hint("GradCompStrategy", 2, 3, timedelta(seconds=3), wrapped)
    assert hint.startswith(f"GradCompStrategy (rank 2 of 3): {explanation}")
    raw = failure_hint("GradCompStrategy", 0, 3, timedelta(seconds=3), GLOO_TIMEOUT)  # Lightning's/DDP's collective
    assert raw.startswith("GradCompStrategy (rank 0 of 3): collective (Lightning's or DDP's own) on the group of "
                          "ranks 0, 1, 2 timed out after 0:00:03")
    dead = failure_hint("GradCompStrategy", 0, 2, timedelta(minutes=10), GLOO_CLOSED)
    assert dead.startswith("GradCompStrategy (rank 0 of 2): a collective failed. Another rank has most likely died")
    assert dead.endswith(f"Original error: {GLOO_CLOSED}")


def test_a_thread_failure_is_reraised_with_its_explanation() -> None:
    err = reraised(explain(GLOO_TIMEOUT, "exchange (send and receive) with rank 1", None), "SwarmSGD rank 0: failed")
    assert isinstance(err, CollectiveTimeoutError)
    assert str(err).startswith("SwarmSGD rank 0: failed: collective exchange (send and receive) with rank 1 on")
    assert type(reraised(GLOO_CLOSED, "SwarmSGD rank 0: presumed dead")) is RuntimeError
