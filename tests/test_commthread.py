"""The communication thread: a job's exception reaches the caller with its type and where it was raised."""

from __future__ import annotations

import pytest
import torch

from helpers.distributed import run_workers
from helpers.engine import train_through_hook
from lightning_gradcomp.commthread import CommThread
from lightning_gradcomp.compressors import TopK


def _failing_job() -> None:
    raise ValueError("bad bucket")


def test_a_failing_job_fails_its_future_naming_type_and_place() -> None:
    thread = CommThread()
    try:
        assert thread.submit(lambda: 3).wait() == 3
        with pytest.raises(ValueError, match=r"^bad bucket \(ValueError on the communication thread, at "
                                             r".*test_commthread.py:\d+ in _failing_job\)$"):
            thread.submit(_failing_job).wait()
        assert thread.submit(lambda: 4).wait() == 4  # the thread goes on
    finally:
        thread.close()


class _Broken(TopK):
    def reduce(self, tensors: list[torch.Tensor], ctx: object) -> object:
        raise KeyError("no such slot")


def _backward(rank: int, world: int) -> str:
    try:
        train_through_hook(rank, _Broken(), steps=3)  # two dense steps, then the compressor's
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_backward_reports_the_compressors_error_with_its_type_and_place() -> None:
    """DDP re-raises a failed hook Future as a RuntimeError with the message only: the message carries the rest."""
    for message in run_workers(_backward, 2):
        assert "no such slot" in message and "KeyError on the communication thread" in message, message
        assert "test_commthread.py" in message and "in reduce" in message, message
