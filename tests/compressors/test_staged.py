"""StagedState: working copies, commit/discard, and the spare buffers that make steady-state steps allocate nothing."""

from __future__ import annotations

import torch

from lightning_gradcomp.compressors.staged import StagedState


def _staging(**values: torch.Tensor) -> StagedState:
    store = StagedState(dict(values))
    store.staging = True
    return store


def test_working_copies_keep_their_values_until_committed() -> None:
    store = _staging(h=torch.zeros(5))
    expected = torch.zeros(5)
    for step in range(4):
        work = store["h"]
        assert torch.equal(work, expected) and work is not store.committed["h"]  # a copy, not the committed tensor
        work.add_(step + 1)
        assert torch.equal(store.committed["h"], expected)  # untouched until the commit
        expected = expected + (step + 1)
        store.commit()
        assert torch.equal(store.committed["h"], expected)


def test_discard_keeps_the_committed_value() -> None:
    committed = torch.arange(4.0)
    store = _staging(h=committed)
    store["h"].mul_(10)
    store.discard()
    assert store.committed["h"] is committed and torch.equal(committed, torch.arange(4.0))
    assert torch.equal(store["h"], torch.arange(4.0))


def test_values_computed_from_the_committed_one_are_staged_by_assignment() -> None:
    """DIANA's way: read the committed value (``peek``), compute the new one into a new tensor in one pass, assign
    it; a discard leaves the committed value untouched, a commit installs it."""
    store = _staging(h=torch.zeros(4))
    for step in range(3):
        old = store.peek("h")
        store["h"] = torch.add(old, 1.0)
        store.commit()
        assert torch.equal(store.committed["h"], torch.full((4,), float(step + 1)))
    store["h"] = torch.full((4,), -1.0)
    store.discard()
    assert torch.equal(store.committed["h"], torch.full((4,), 3.0))
