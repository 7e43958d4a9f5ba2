"""benchmarks/sparsifier_floor.py: the slots it times and the passes it runs (not the timings themselves)."""

from __future__ import annotations

import torch
from sparsifier_floor import compressed_slots, floor_round, measure, report  # benchmarks/ (on sys.path: conftest.py)

from lightning_gradcomp.functional.feedback import compensate
from lightning_gradcomp.functional.selection import exact_topk_indices


def test_the_slots_are_the_policys_as_slices_of_one_buffer() -> None:
    slots = compressed_slots("cnn")
    assert slots and all(s.dtype == torch.float32 and s.dim() == 1 for s in slots)
    assert all(s.numel() >= 1024 for s in slots)  # the default policy's min_numel
    base = slots[0].untyped_storage().data_ptr()
    offset = 0
    for s in slots:  # contiguous slices of one flat buffer, in order, as a DDP bucket holds them
        assert s.untyped_storage().data_ptr() == base and s.storage_offset() == offset
        offset += s.numel()


def test_a_round_compensates_and_selects_every_slot() -> None:
    slots = compressed_slots("cnn")
    saved = [s.clone() for s in slots]
    memories = [torch.full_like(s, 0.5) for s in slots]
    expected = [compensate(m, g) for m, g in zip(memories, saved)]
    seconds = floor_round(slots, saved, memories, 0.01)
    assert seconds["compensation"] > 0 and seconds["selection"] > 0
    assert all(torch.equal(m, e) for m, e in zip(memories, expected))  # the memories became p
    assert all(torch.count_nonzero(s) == 0 for s in slots)  # g cleared, where the result goes
    assert exact_topk_indices(memories[0], 5).numel() == 5


def test_measure_and_report() -> None:
    result = measure("cnn", rounds=2, ratio=0.01)
    for name in ("clone", "rand_like", "compensation", "selection", "both"):
        assert result[name] > 0
    table = report("cnn", 0.01, result)
    for row in ("| clone |", "| rand_like |", "| compensation |", "| selection |", "| compensation + selection |"):
        assert row in table
