"""SwarmSGD's exchange keeps NaN/Inf on their rank: a diverged model heals from its partner instead of spreading.

:func:`contained_average` on every class of pair (finite, NaN, +Inf, -Inf on either end), and the protocol at
W = 2..5 (lattice-coded and fp32 messages, blocking and non-blocking): the last rank's model gets NaN/Inf in a few
coordinates of two blocks before the first round (and, non-blocking, in its local progress too). After every round
both ends of each pair hold the same bits, every model that exchanged with a healed one is finite, the partner keeps
its own values at the poisoned coordinates, the distance estimates stay finite and the event is counted on the
poisoned rank only.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import pytest
import torch

from helpers.distributed import run_workers
from lightning_gradcomp.comm import Comm
from lightning_gradcomp.swarm.exchange import LatticeCodec, PairwiseGossip, contained_average, contained_mean
from lightning_gradcomp.swarm.pairing import matching

VALUES = [1.5, -2.25, float("nan"), float("inf"), -float("inf")]
NUMEL, BLOCK, ROUNDS = 3000, 512, 4
POISONED = [600, 601, 1100, 2999]  # blocks 1, 2 and the short last block


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)  # NaN payloads compared exactly (torch.equal says NaN != NaN)


def test_contained_average_is_symmetric_and_keeps_the_finite_side() -> None:
    pairs = list(itertools.product(VALUES, repeat=2))
    a = torch.tensor([p[0] for p in pairs])
    b = torch.tensor([p[1] for p in pairs])
    ab, ba = contained_average(a, b), contained_average(b, a)
    assert torch.equal(_bits(ab), _bits(ba))
    for (x, y), got in zip(pairs, ab.tolist()):
        finite_x, finite_y = torch.isfinite(torch.tensor(x)).item(), torch.isfinite(torch.tensor(y)).item()
        want = (x + y) / 2 if finite_x == finite_y else (x if finite_x else y)
        assert got == want or (got != got and want != want), (x, y, got)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_contained_mean_averages_the_finite_ranks_and_is_contained_average_at_two(world: int) -> None:
    """Every assignment of VALUES to ``world`` ranks (one coordinate each): the mean of the finite values, or the
    plain (non-finite) mean where no rank is finite; at W = 2 the same value as :func:`contained_average`."""
    columns = torch.tensor(list(itertools.product(VALUES, repeat=world)), dtype=torch.float64).T  # (world, cases)
    finite = torch.isfinite(columns)
    total = columns.sum(0)
    finite_total = torch.where(finite, columns, torch.zeros(())).sum(0)
    got = contained_mean(total, finite_total, finite.double().sum(0), world)
    for case in range(columns.shape[1]):
        values = columns[:, case].tolist()
        kept = [v for v in values if v == v and abs(v) != float("inf")]
        want = sum(kept) / len(kept) if kept else sum(values) / world
        value = got[case].item()
        assert value == want or (value != value and want != want), (values, value, want)
    if world == 2:
        pair = contained_average(columns[0], columns[1])
        assert torch.equal(torch.isnan(got), torch.isnan(pair))
        assert torch.equal(got.nan_to_num(0.0), pair.nan_to_num(0.0))


def _worker(rank: int, world: int, bits: Optional[int], non_blocking: bool, value: float) -> dict[str, Any]:
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    x += 0.05 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + rank))
    bad = rank == world - 1
    if bad:
        x[POISONED] = value
    engine = PairwiseGossip(Comm(), NUMEL, LatticeCodec(bits=bits, block_size=BLOCK) if bits else None)
    if bits:
        engine.anchor = x.nan_to_num(0.0, 0.0, 0.0) - 0.1  # first estimate: within 2 * 0.1 of each other
    gen = torch.Generator().manual_seed(rank)
    rounds = []
    for r in range(ROUNDS):
        partner = matching("complete", world, seed=7, round_index=r)[rank]
        before, progress = x.clone(), torch.zeros(NUMEL)
        if partner >= 0:
            pending = engine.post(x, partner, r)
            if non_blocking:
                progress = 0.001 * torch.randn(NUMEL, generator=gen)
                if bad and r == 0:
                    progress[[5, 1500]] = value  # the local steps diverged too
                x = engine.complete(pending, x + progress)
            else:
                x = engine.complete(pending)
        rounds.append({"partner": partner, "before": before, "progress": progress, "after": x.clone()})
    spread = engine.spread
    return {"rounds": rounds, "stats": engine.stats.state_dict(),
            "spread_finite": spread is None or bool(torch.isfinite(spread).all())}


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_a_poisoned_model_heals_and_poisons_no_partner(world: int) -> None:
    for bits, non_blocking, value in [(8, False, float("nan")), (4, True, float("inf")), (None, False, -float("inf")),
                                      (None, True, float("nan"))]:
        out = run_workers(_worker, world, bits, non_blocking, value, timeout=60)
        where = f"W={world} bits={bits} non_blocking={non_blocking} value={value}"
        bad = world - 1
        first = min(k for k in range(ROUNDS) if out[bad]["rounds"][k]["partner"] >= 0)  # the bad rank's first exchange
        partner = out[bad]["rounds"][first]["partner"]
        mine, theirs = out[bad]["rounds"][first], out[partner]["rounds"][first]
        # the poisoned rank takes its partner's values there (its own progress counts as none); the partner keeps its own
        assert torch.equal(mine["after"][POISONED], theirs["before"][POISONED]), where
        assert torch.equal(theirs["after"][POISONED], (theirs["before"] + theirs["progress"])[POISONED]), where
        for r in range(ROUNDS):
            for i, o in enumerate(out):
                step = o["rounds"][r]
                j = step["partner"]
                if j >= 0 and not non_blocking:  # both ends of the pair hold the same bits
                    assert torch.equal(_bits(step["after"]), _bits(out[j]["rounds"][r]["after"])), (where, r, i, j)
                if i != bad or r >= first:  # the poisoned rank from its first exchange on
                    assert bool(torch.isfinite(step["after"]).all()), (where, r, i)
        for rank, o in enumerate(out):
            assert o["spread_finite"], (where, rank)
            assert o["stats"]["nonfinite_exchanges"] == int(rank == bad), (where, rank, o["stats"])
