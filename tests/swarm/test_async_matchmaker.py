"""The async match-making protocol under every kind of interleaving of its store operations (threads, one process).

A scheduler lets exactly one store operation run at a time and picks, at random (seeded), which waiting thread
goes next, so each seed is one reproducible interleaving of the ranks' concurrent attempts.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable, Optional

import pytest
import torch.distributed as dist

from lightning_gradcomp.swarm.asynchronous import Attempt, StoreMatchmaker, offer_priority


class _Interleaver:
    """Runs one store operation at a time; when every live thread waits, a seeded draw picks the next."""

    def __init__(self, threads: int, seed: int) -> None:
        self.cond = threading.Condition()
        self.rng = random.Random(seed)
        self.live = threads
        self.waiting: set[int] = set()
        self.current: Optional[int] = None

    def run(self, tid: int, op: Callable[[], Any]) -> Any:
        with self.cond:
            self.waiting.add(tid)
            self.cond.notify_all()
            while self.current != tid:
                if self.current is None and len(self.waiting) == self.live:
                    self.current = self.rng.choice(sorted(self.waiting))
                    self.cond.notify_all()
                else:
                    self.cond.wait()
            self.waiting.discard(tid)
        try:
            return op()
        finally:
            with self.cond:
                self.current = None
                self.cond.notify_all()

    def exit(self) -> None:
        with self.cond:
            self.live -= 1
            self.cond.notify_all()


class _ScheduledStore:
    """A store whose every operation waits for its turn in an :class:`_Interleaver` (per calling thread)."""

    def __init__(self, store: dist.Store, interleaver: _Interleaver) -> None:
        self.store, self.interleaver, self.tid = store, interleaver, threading.local()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.store, name)
        return lambda *args: self.interleaver.run(self.tid.value, lambda: method(*args))


def _concurrent_attempts(store: dist.Store, makers: list[StoreMatchmaker], offers: list[Optional[str]], step: int,
                         seed: int) -> list[Attempt]:
    """Every rank attempts at once (rank r with its open offer ``offers[r]``), interleaved by ``seed``."""
    interleaver = _Interleaver(len(makers), seed)
    scheduled = _ScheduledStore(store, interleaver)
    results: list[Optional[Attempt]] = [None] * len(makers)

    def attempt(rank: int) -> None:
        scheduled.tid.value = rank
        makers[rank].store = scheduled
        try:
            results[rank] = makers[rank].attempt(step, offers[rank])
        finally:
            makers[rank].store = store
            interleaver.exit()

    threads = [threading.Thread(target=attempt, args=(r,)) for r in range(len(makers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def _pairs(makers: list[StoreMatchmaker], offers: list[Optional[str]], outcomes: list[Attempt]) -> set[tuple[int, int]]:
    """The exchanges these attempts made, checked for consistency: each claim names a real open offer, and no
    rank is in two exchanges."""
    pairs = set()
    for rank, outcome in enumerate(outcomes):
        if outcome.partner is not None:
            peer = outcome.partner[0]
            # the claimed offer is the peer's current one (renewed or not) and names this rank as its claimer
            claimed = offers[peer] if outcomes[peer].taken else outcomes[peer].published
            assert claimed is not None, (rank, peer, outcomes)
            claim = makers[peer].read_claim(claimed)
            assert claim is not None and claim[0] == rank, (rank, peer, claim)
            pairs.add((rank, peer))
    ranks = [r for pair in pairs for r in pair]
    assert len(ranks) == len(set(ranks)), pairs  # nobody in two exchanges
    for rank, outcome in enumerate(outcomes):  # an offer reported taken was taken by a claimer of this round
        assert not outcome.taken or any(peer == rank for _, peer in pairs), (rank, outcomes)
    return pairs


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_ranks_that_keep_attempting_together_pair_within_two_attempts(world_size: int) -> None:
    """Ranks at the same pace attempt at the same moments. Over two attempts (the first from idle, the second with
    whatever offer the first left open) at least one pair forms, in every interleaving of the store operations.

    Before the symmetry breaking, the interleaving in which every rank withdraws before any rank reads the others
    left all of them publishing again, so two ranks at one pace could go a whole run without pairing."""
    for seed in range(60):
        store = dist.HashStore()
        makers = [StoreMatchmaker(store, r, [p for p in range(world_size) if p != r], seed=seed) for r in range(world_size)]
        for maker in makers:
            maker.reset()
        pairs: set[tuple[int, int]] = set()
        offers: list[Optional[str]] = [None] * world_size
        for step in (2, 4):
            outcomes = _concurrent_attempts(store, makers, offers, step, seed=seed * 7 + step)
            made = _pairs(makers, offers, outcomes)
            pairs |= made
            paired = {r for pair in made for r in pair}
            offers = [None if r in paired else o.published for r, o in enumerate(outcomes)]
        assert pairs, (world_size, seed)


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_offer_priorities_are_distinct_and_favour_no_rank(world_size: int) -> None:
    """Over many fresh offers (tokens), each rank holds the highest priority among ``world_size`` waiting ranks
    (the one that only renews and is claimed) about as often as any other."""
    rng = random.Random(world_size)
    top = [0] * world_size
    draws = 6000
    for _ in range(draws):
        priorities = [offer_priority(r, rng.randrange(1, 10**6)) for r in range(world_size)]
        assert len(set(priorities)) == world_size
        top[max(range(world_size), key=priorities.__getitem__)] += 1
    assert all(abs(t / draws - 1 / world_size) < 0.03 for t in top), top
    assert offer_priority(3, 7) == offer_priority(3, 7) and offer_priority(3, 7) != offer_priority(3, 8)


def _two_waiting() -> tuple[dist.Store, list[StoreMatchmaker], list[str]]:
    store = dist.HashStore()
    makers = [StoreMatchmaker(store, 0, [1]), StoreMatchmaker(store, 1, [0])]
    for maker in makers:
        maker.reset()
    return store, makers, [maker.publish(2) for maker in makers]


def test_a_waiting_rank_claims_a_waiting_neighbour_at_once_and_renews_when_none_waits() -> None:
    store, makers, offers = _two_waiting()
    claimed = makers[1].attempt(4, offers[1])
    assert claimed.partner is not None and claimed.partner[:2] == (0, 2)
    assert store.get("state/1") == b"idle"  # its own offer was locked, then released
    assert makers[0].attempt(4, offers[0]).taken
    assert makers[0].read_claim(offers[0]) == (1, claimed.partner[2], 4)
    lone = makers[1].publish(6)  # rank 0 is exchanging: nobody waits, so rank 1 renews (same token, never idle)
    renewed = makers[1].attempt(8, lone)
    assert renewed.published is not None and renewed.published != lone and not renewed.taken
    assert renewed.published.split(":")[3] == lone.split(":")[3] and store.get("state/1").decode() == renewed.published


def test_a_locked_neighbour_is_passed_over_if_lower_and_waited_for_if_higher() -> None:
    """Two locked ranks claiming each other: the one of higher priority passes over the other at once (the other
    may be waiting for it); the lower one waits until the higher publishes again, then claims it."""
    store, makers, offers = _two_waiting()
    tokens = [int(offer.split(":")[3]) for offer in offers]
    priority = [offer_priority(r, tokens[r]) for r in (0, 1)]
    high = max((0, 1), key=priority.__getitem__)
    low = 1 - high
    for r in (0, 1):
        store.set(f"state/{r}", f"busy:1:{tokens[r]}")  # both locked their offers to claim
    start = time.monotonic()
    assert makers[high].claim(4, priority[high]) is None and time.monotonic() - start < 0.5

    def publish_later() -> None:
        time.sleep(0.05)
        makers[high].publish(4)

    thread = threading.Thread(target=publish_later)
    thread.start()
    found = makers[low].claim(4, priority[low])
    thread.join()
    assert found is not None and found[:2] == (high, 4) and time.monotonic() - start >= 0.05
