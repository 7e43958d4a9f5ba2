"""StagedState: working copies, commit/discard, and the spare buffers that make steady-state steps allocate nothing."""

from __future__ import annotations

import torch

from lightning_gradcomp.compressors.staged import StagedState


def _staging(**values: torch.Tensor) -> StagedState:
    store = StagedState(dict(values))
    store.staging = True
    return store


def test_working_copies_alternate_between_two_buffers_and_keep_their_values() -> None:
    store = _staging(h=torch.zeros(5))
    seen = set()
    expected = torch.zeros(5)
    for step in range(6):
        work = store["h"]
        assert torch.equal(work, expected)  # the committed value, whatever buffer holds it
        work.add_(step + 1)
        expected = expected + (step + 1)
        store.commit()
        assert torch.equal(store.committed["h"], expected)
        seen.add(work.data_ptr())
    assert len(seen) == 2  # after the first step: no new allocation, two buffers in turn


def test_discard_keeps_the_committed_value_and_recycles_the_working_copy() -> None:
    committed = torch.arange(4.0)
    store = _staging(h=committed)
    work = store["h"]
    work.mul_(10)
    store.discard()
    assert torch.equal(store.committed["h"], torch.arange(4.0)) and store.committed["h"] is committed
    again = store["h"]
    assert again.data_ptr() == work.data_ptr() and torch.equal(again, torch.arange(4.0))  # the spare, refreshed


def test_assigned_values_never_free_what_a_caller_may_hold() -> None:
    """A value staged by assignment (PowerSGD's new factor) replaces the committed one without recycling it: a
    tensor read through ``peek`` in that step is never overwritten later."""
    first = torch.ones(3)
    store = _staging(q=first)
    peeked = store.peek("q")
    store["q"] = torch.full((3,), 2.0)
    store.commit()
    store["q"] = torch.full((3,), 3.0)
    store.commit()
    work = store["q"]
    work.zero_()
    store.commit()
    assert peeked is first and torch.equal(first, torch.ones(3))


def test_spares_match_shape_dtype_and_device_and_load_clears_them() -> None:
    store = _staging(h=torch.zeros(4))
    store["h"].add_(1)
    store.commit()  # spare: the old zeros(4)
    store.staged["h"] = torch.zeros(6)  # a layer resized (new working value staged directly)
    store.commit()
    work = store["h"]
    assert work.shape == (6,) and torch.equal(work, torch.zeros(6))
    store.load({"h": torch.ones(6)})
    assert torch.equal(store["h"], torch.ones(6))


def test_values_computed_from_the_committed_one_recycle_its_buffer() -> None:
    """``spare_for`` + ``stage`` (DIANA's shifts): a new value computed in one pass from ``peek``; after the first
    commits the new values alternate between two buffers, and a discard leaves the committed value untouched."""
    store = _staging(h=torch.zeros(4))
    seen = set()
    for step in range(5):
        old = store.peek("h")
        new = store.spare_for("h", old)
        torch.add(old, 1.0, out=new)
        store.stage("h", new)
        store.commit()
        assert torch.equal(store.committed["h"], torch.full((4,), float(step + 1)))
        if step >= 1:
            seen.add(new.data_ptr())
    assert len(seen) == 2
    new = store.spare_for("h", store.peek("h"))
    new.fill_(-1.0)
    store.stage("h", new)
    store.discard()
    assert torch.equal(store.committed["h"], torch.full((4,), 5.0))
