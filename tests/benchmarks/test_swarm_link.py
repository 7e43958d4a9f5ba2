"""benchmarks/swarm_link.py: the run clock over ranks and the search for the first snapshot at a target."""

from __future__ import annotations

import pytest
from swarm_link import first_reaching, run_clock  # benchmarks/ (on sys.path: conftest.py)


def test_run_clock_takes_the_slowest_rank_from_the_last_start() -> None:
    starts = [10.0, 10.5]
    times = [[11.0, 12.0, 14.0], [11.5, 11.9, 13.0]]
    assert run_clock(starts, times) == pytest.approx([1.0, 1.5, 3.5])
    with pytest.raises(ValueError, match="same number of steps"):
        run_clock(starts, [[1.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match="one entry per rank"):
        run_clock([0.0], times)


def _scorer(values: list[float]) -> tuple[object, list[int]]:
    seen: list[int] = []

    def score(i: int) -> float:
        seen.append(i)
        return values[i]

    return score, seen


def test_first_reaching_refines_inside_the_first_bracket_only() -> None:
    values = [0.1, 0.2, 0.3, 0.4, 0.5, 0.86, 0.84, 0.87, 0.9, 0.9]
    score, seen = _scorer(values)
    assert first_reaching(score, len(values), 4, 0.85) == 5  # coarse 3 (0.4) no, 7 (0.87) yes; then 4, 5
    assert seen == [3, 7, 4, 5]
    score, seen = _scorer(values)
    assert first_reaching(score, len(values), 1, 0.85) == 5 and seen == list(range(6))
    score, _ = _scorer(values)
    assert first_reaching(score, len(values), 4, 0.95) is None
    score, seen = _scorer([0.0, 0.0, 0.0, 0.0, 1.0])  # the last item is always a coarse point
    assert first_reaching(score, 5, 3, 0.5) == 4 and seen == [2, 4, 3]
    assert first_reaching(score, 0, 3, 0.5) is None
    with pytest.raises(ValueError, match="`stride`"):
        first_reaching(score, 5, 0, 0.5)
