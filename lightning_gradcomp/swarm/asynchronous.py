"""Asynchronous SwarmSGD gossip: store-based match-making and a background exchange thread per rank.

No global rounds. Each rank, after its own H local steps, looks for a partner that is *ready now*; the
pair exchanges quantized models point-to-point on a dedicated gloo group, driven by a background thread,
while both main threads keep training. The average is applied at the rank's next step boundary in the
non-blocking form ``x <- avg(x_pub, x_partner_pub) + (x_now - x_pub)``, where ``x_pub`` is the model this
rank published (snapshotted) for the exchange.

**Match-making** (``torch.distributed`` ``Store``: the process group's TCPStore, under a prefix). Every rank
``r`` owns one key ``state/r``; only these transitions exist, each one atomic:

* ``r`` publishes: ``state/r <- "wait:<seq>:<step>:<token>"`` (only ``r`` writes it, and only when it has no
  exchange in flight), and hands its snapshot ``x_pub`` to its thread, which polls ``state/r``.
* a ready rank ``c`` claims ``r``: ``compare_set(state/r, "wait:<seq>:...", "claim:<seq>:<c>:<ticket>:<c_step>")``
  with a fresh ``ticket`` from ``store.add`` (the exchange id). At most one claimer succeeds; ``c`` claims only
  while it is not published itself, so nobody is ever in two exchanges.
* ``r`` withdraws (at a drain: end of ``fit``, checkpoint): ``compare_set(state/r, "wait:...", "idle")``. If that
  fails, somebody claimed ``r`` first, and ``r`` completes that exchange.
* ``r`` renews an unclaimed offer with a fresh snapshot: ``compare_set(state/r, "wait:<seq>:...",
  "wait:<seq+1>:<step>:<token>")`` (the same token), again failing only if a claim came first. A renewal never
  passes through ``idle``.
* ``r``, with an open offer, locks it to claim: ``compare_set(state/r, "wait:<seq>:...", "busy:<seq>:<token>")``
  (failing only if a claim came first). Nobody claims a locked rank; ``r`` then claims a waiting neighbour and sets
  ``state/r <- "idle"``, or finds none and publishes again.

**Symmetry breaking.** At its next attempt, a rank whose offer is still open renews it if no neighbour is
waiting; if one is, it locks its offer and claims, as a rank without an offer does. Two ranks at the same pace
that both wait lock at the same moment and find each other locked. Each fresh offer carries a token (the
``seq`` of its first publication; renewals keep it), and the pair (rank, token) gives a pseudo-random priority
that every rank computes alike (:func:`offer_priority`). A claimer waits for a locked neighbour of higher
priority to finish its attempt (it claims somebody, or publishes again and is then claimed), and passes over one
of lower priority, which may be waiting for it; a claimer without an offer waits for any locked neighbour. Waits
thus follow increasing priority and form no cycle, and a pair forms. A new token per fresh offer draws a new
order, so no rank is favoured. (Why not simpler rules, and what they cost: ``docs/swarm.md``, asynchronous mode.)

**Why it cannot deadlock.** A claim pairs two ranks whose threads are both free (a published rank's thread
waits only for its claim; a claimer has nothing in flight), and each thread runs one exchange at a time,
so both ends post exactly one matching send/recv pair to each other and to nobody else. A thread never waits
for a main thread, and a main thread waits for its own thread only when draining (end of ``fit``, before a
checkpoint) or in replay; during match-making, a claimer may wait for a locked neighbour to finish its
attempt (a few store operations): a locked claimer only for one of higher priority, a claimer without an offer
(which nobody waits for) for any. The waits follow increasing priority, so they end (and after 2 s a claimer
passes over the neighbour anyway). A rank that never gets claimed simply keeps training. A partner that died
(claimed and vanished, or crashed mid-exchange) makes the gloo receive fail or time out
(``exchange_timeout``); the error is raised on the main thread at its next step boundary.

**Atomicity.** The thread computes the average from the two snapshots and hands it over whole; the main
thread applies it between two optimizer steps (never during one, never during evaluation). Both ends
apply an exchange once both messages arrived; a failed exchange is applied by neither (the error stops
training).

**Pairing log and replay.** Every applied exchange is recorded as
``(pub_step, partner, partner_pub_step, ticket, apply_step, drained)`` (local optimizer-step counts;
``drained`` is 1 when it was applied by a drain, at the end of ``fit`` or before a checkpoint, rather than at
a step boundary). Passing the logs of all ranks back as ``replay`` reproduces the run exactly: each rank
publishes at the logged step, exchanges with the logged partner and ticket (the dither seed), and applies
at the logged step (or drain), waiting if needed. Replay cannot deadlock either: a rank waits only for an
exchange that, in the logged run, had completed before that point, so the waits follow a real execution's
happens-before order.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.failures import CollectiveTimeoutError, group_ranks, reraised, timeout_message
from lightning_gradcomp.swarm.exchange import PairwiseGossip, with_progress
from lightning_gradcomp.swarm.pairing import round_generator

__all__ = ["AsyncGossip", "Attempt", "PairingRecord", "StoreMatchmaker", "offer_priority"]

log = logging.getLogger(__name__)

PairingRecord = tuple[int, int, int, int, int, int]
"""``(pub_step, partner, partner_pub_step, ticket, apply_step, drained)`` of one applied exchange."""

_POLL_SECONDS = 0.002
_CLAIM_TRIES = 3
_SPINS, _SPIN_SECONDS = 4000, 0.0005  # how long a claimer waits for a locked neighbour: 2 s at most
_MASK64 = (1 << 64) - 1
_LOCAL_STEPS_SALT = 1 << 24


@dataclass(frozen=True)
class Attempt:
    """The outcome of :meth:`StoreMatchmaker.attempt`.

    Attributes:
        partner: ``(partner, partner_step, ticket)`` when this rank claimed a waiting neighbour.
        published: this rank's new (or renewed) open offer.
        taken: this rank's open offer was claimed first: that exchange runs, nothing else changed.
    """

    partner: Optional[tuple[int, int, int]] = None
    published: Optional[str] = None
    taken: bool = False


class StoreMatchmaker:
    """The claim protocol of the module docstring over a ``torch.distributed`` store.

    Args:
        store: a store shared by all ranks (use a fresh prefix per run).
        rank: this rank.
        neighbours: ranks this rank may pair with (its neighbours in the topology).
        seed: seed of the random scan order.
    """

    def __init__(self, store: dist.Store, rank: int, neighbours: Sequence[int], seed: int = 0) -> None:
        self.store = store
        self.rank = rank
        self.neighbours = list(neighbours)
        self._gen = round_generator(seed, rank, salt=2)
        self._seq = 0
        self._token = 0

    def key(self, rank: int) -> str:
        return f"state/{rank}"

    def reset(self) -> None:
        """Mark this rank idle (call on every rank, then synchronize, before any claim)."""
        self.store.set(self.key(self.rank), "idle")

    def publish(self, step: int) -> str:
        """Offer this rank for pairing; returns the published value (the claim's expected value)."""
        self._seq += 1
        self._token = self._seq
        value = f"wait:{self._seq}:{step}:{self._token}"
        self.store.set(self.key(self.rank), value)
        return value

    def withdraw(self, published: str, final: bool = False) -> bool:
        """Take the offer back; ``False`` if a claim came first (then that exchange must run)."""
        desired = "done" if final else "idle"
        return _text(self.store.compare_set(self.key(self.rank), published, desired)) == desired

    def retire(self) -> None:
        """Never to be claimed again (end of training; nothing published)."""
        self.store.set(self.key(self.rank), "done")

    def read_claim(self, published: str) -> Optional[tuple[int, int, int]]:
        """``(claimer, ticket, claimer_step)`` once ``published`` was claimed, else ``None``."""
        value = _text(self.store.get(self.key(self.rank)))
        seq = published.split(":")[1]
        if not value.startswith(f"claim:{seq}:"):
            return None
        _, _, claimer, ticket, step = value.split(":")
        return int(claimer), int(ticket), int(step)

    def renew(self, published: str, step: int) -> Optional[str]:
        """Replace this rank's open offer by a fresh one in one atomic step; ``None`` if a claim came first."""
        self._seq += 1
        value = f"wait:{self._seq}:{step}:{self._token}"
        return value if _text(self.store.compare_set(self.key(self.rank), published, value)) == value else None

    def attempt(self, step: int, published: Optional[str]) -> Attempt:
        """One pairing attempt; ``published`` is this rank's open offer, if any (see the module docstring)."""
        own = None
        if published is not None:
            if not any(_text(self.store.get(self.key(peer))).startswith("wait:") for peer in self.neighbours):
                renewed = self.renew(published, step)
                return Attempt(published=renewed, taken=renewed is None)
            locked = f"busy:{published.split(':')[1]}:{self._token}"
            if _text(self.store.compare_set(self.key(self.rank), published, locked)) != locked:
                return Attempt(taken=True)
            own = offer_priority(self.rank, self._token)
        found = self.claim(step, own)
        if found is None:
            return Attempt(published=self.publish(step))
        if own is not None:
            self.store.set(self.key(self.rank), "idle")  # nobody else writes a locked key
        return Attempt(partner=found)

    def claim(self, step: int, own: Optional[tuple[int, int]] = None) -> Optional[tuple[int, int, int]]:
        """Claim a published neighbour, in random order: ``(partner, partner_step, ticket)`` or ``None``.

        ``own``: this rank's offer priority while its offer is locked (``None`` when it has none). A neighbour
        that is itself locked and claiming is waited for if its priority is higher (or this rank has no offer),
        and passed over otherwise (it may be waiting for this rank), so the waits cannot form a cycle.
        """
        order = torch.randperm(len(self.neighbours), generator=self._gen).tolist()
        for idx in order:
            peer = self.neighbours[idx]
            value = _text(self.store.get(self.key(peer)))
            tries = spins = 0
            while True:
                if value.startswith("wait:") and tries < _CLAIM_TRIES:  # retried on the peer's renewed offer
                    tries += 1
                    _, seq, peer_step, _ = value.split(":")
                    ticket = int(self.store.add("ticket", 1))
                    desired = f"claim:{seq}:{self.rank}:{ticket}:{step}"
                    value = _text(self.store.compare_set(self.key(peer), value, desired))
                    if value == desired:
                        return peer, int(peer_step), ticket
                elif value.startswith("busy:") and spins < _SPINS:
                    if own is not None and offer_priority(peer, int(value.split(":")[2])) < own:
                        break
                    spins += 1
                    time.sleep(_SPIN_SECONDS)
                    value = _text(self.store.get(self.key(peer)))
                else:
                    break
        return None


def offer_priority(rank: int, token: int) -> tuple[int, int]:
    """The priority of ``rank``'s offer with ``token``: of two locked neighbours, the lower one waits for the higher.

    A splitmix64 hash of ``(rank, token)`` (the same on every rank, and unrelated from one token to the next), then
    the rank, so priorities are distinct.
    """
    x = ((rank << 32) ^ token) & _MASK64
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31), rank


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


@dataclass
class _Job:
    """One exchange from this rank's view (a published offer becomes one once claimed)."""

    x_pub: Tensor
    pub_step: int
    published: Optional[str] = None  # set while waiting for a claim
    claimed: bool = False  # a withdrawal, renewal or lock failed: the claim came first
    peer: int = -1
    peer_step: int = -1
    ticket: int = -1
    apply_step: int = -1  # replay only
    drained: bool = False  # replay only
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    average: Optional[Tensor] = None
    error: Optional[BaseException] = None


class AsyncGossip:
    """Per-rank asynchronous gossip: match-making on the main thread, exchanges on a background thread.

    Args:
        engine: the exchange engine; its ``comm`` must be on a group used by nobody else.
        matchmaker: the claim protocol (``None`` only with ``replay``).
        local_steps: mean local steps between gossip attempts (H).
        geometric: draw each H from a geometric distribution (per rank) instead of fixed.
        seed: seed of the H draws.
        timeout: seconds a drain or a replayed exchange may wait before the partner is declared dead.
        replay: this rank's pairing log to reproduce (see the module docstring).
    """

    def __init__(
        self,
        engine: PairwiseGossip,
        matchmaker: Optional[StoreMatchmaker],
        local_steps: int,
        geometric: bool,
        seed: int,
        timeout: float,
        replay: Optional[Sequence[Sequence[int]]] = None,
    ) -> None:
        self.engine = engine
        self.matchmaker = matchmaker
        self.local_steps = local_steps
        self.geometric = geometric
        self.seed = seed
        self.timeout = timeout
        self.replay = None if replay is None else [tuple(int(v) for v in entry) for entry in replay]
        self.log: list[PairingRecord] = []
        self.attempts = 0
        self.next_attempt = self._draw()
        self._job: Optional[_Job] = None
        self._queue: queue.Queue[Optional[_Job]] = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._threads = torch.get_num_threads()

    # ------------------------------------------------------------------ main thread
    def start(self) -> None:
        """Start the exchange thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="swarmsgd-gossip", daemon=True)
            self._thread.start()

    def close(self) -> bool:
        """Stop the thread (after :meth:`drain`); return whether it stopped (``False``: an exchange still ran after
        ``timeout`` seconds, so its group must not be destroyed under it)."""
        stopped = True
        if self._thread is not None:
            if self._job is not None:
                self._job.cancelled.set()
            self._queue.put(None)
            self._thread.join(timeout=self.timeout)
            stopped = not self._thread.is_alive()
            self._thread = None
        return stopped

    @property
    def in_flight(self) -> bool:
        """Whether an offer or an exchange is outstanding."""
        return self._job is not None

    def boundary(self, step: int, current: Callable[[], Tensor]) -> Optional[Tensor]:
        """Called after local step ``step`` (1-based count): apply a finished exchange, maybe start one.

        Args:
            step: optimizer steps taken so far by this rank.
            current: returns this rank's flat model now (called only when needed).

        Returns:
            The new flat model when an exchange was applied, else ``None``.
        """
        if self.replay is not None:
            return self._replay_boundary(step, current)
        out = None
        job = self._job
        if job is not None and job.done.is_set() and not job.cancelled.is_set():
            out = self._apply(job, step, current())
        if step >= self.next_attempt:
            applied = out
            if self._attempt(step, lambda: applied if applied is not None else current()):
                self.attempts += 1
                self.next_attempt = step + self._draw()
        return out

    def drain(self, step: int, current: Callable[[], Tensor], final: bool = False) -> Optional[Tensor]:
        """Withdraw an unclaimed offer, finish and apply an exchange in flight (``final``: retire)."""
        out = None
        if self.replay is not None:
            out = self._replay_boundary(step, current, draining=True)
        job = self._job
        if job is not None and job.published is not None and not job.claimed and self.matchmaker is not None:
            if self.matchmaker.withdraw(job.published, final=final):
                job.cancelled.set()
                self.engine.stats.sat_out += 1
                self._job = job = None
        if job is not None:
            self._wait(job)
            out = self._apply(job, step, out if out is not None else current(), drained=True)
        if final and self.matchmaker is not None and self.replay is None:
            self.matchmaker.retire()
        return out

    def _attempt(self, step: int, current: Callable[[], Tensor]) -> bool:
        """Try to pair now; ``False`` if an exchange is still in flight (retry at the next boundary)."""
        assert self.matchmaker is not None
        job = self._job
        if job is not None and (job.published is None or job.claimed):
            return False  # exchanging: try again after it is applied
        outcome = self.matchmaker.attempt(step, job.published if job is not None else None)
        if outcome.taken:
            assert job is not None
            job.claimed = True
            return False  # just claimed: try again after this exchange is applied
        if job is not None:  # the open offer was renewed or locked, unclaimed
            job.cancelled.set()
            self.engine.stats.sat_out += 1
            self._job = None
        self.engine.stats.rounds += 1
        job = _Job(x_pub=current().detach().float().clone(), pub_step=step, published=outcome.published)
        if outcome.partner is not None:
            job.peer, job.peer_step, job.ticket = outcome.partner
        self._submit(job)
        return True

    def _submit(self, job: _Job) -> None:
        self.start()
        self._job = job
        self._queue.put(job)

    def _wait(self, job: _Job) -> None:
        if not job.done.wait(self.timeout):
            what = f"exchange (send and receive) with rank {job.peer} (ticket {job.ticket})"
            waited = timedelta(seconds=self.timeout)
            message = timeout_message(what, group_ranks(self.engine.comm.group), waited, EXCHANGE_TIMEOUT_SETTING)
            raise CollectiveTimeoutError(f"SwarmSGD rank {self.engine.comm.rank}: {message}")

    def _apply(self, job: _Job, step: int, x_now: Tensor, drained: bool = False) -> Tensor:
        self._job = None
        if job.error is not None:
            raise reraised(
                job.error,
                f"SwarmSGD rank {self.engine.comm.rank}: exchange with rank {job.peer} (ticket "
                f"{job.ticket}) failed; the partner is presumed dead or stopped",
            ) from job.error
        assert job.average is not None
        self.engine.stats.exchanges += 1
        self.log.append((job.pub_step, job.peer, job.peer_step, job.ticket, step, int(drained)))
        updated, nonfinite = with_progress(job.average, x_now, job.x_pub)
        if nonfinite and bool(torch.isfinite(job.x_pub).all()):  # else the exchange thread counted it already
            self.engine.stats.nonfinite_exchanges += 1
        return updated

    def _replay_boundary(self, step: int, current: Callable[[], Tensor], draining: bool = False) -> Optional[Tensor]:
        assert self.replay is not None
        out = None
        job = self._job
        if job is not None and (draining or (job.apply_step == step and not job.drained)):
            self._wait(job)
            out = self._apply(job, step, current(), drained=draining)
        index = len(self.log) + (self._job is not None)
        if not draining and index < len(self.replay) and self.replay[index][0] == step and self._job is None:
            pub_step, peer, peer_step, ticket, apply_step, drained = self.replay[index]
            self.engine.stats.rounds += 1
            x = out if out is not None else current()
            self._submit(
                _Job(
                    x_pub=x.detach().float().clone(),
                    pub_step=pub_step,
                    peer=peer,
                    peer_step=peer_step,
                    ticket=ticket,
                    apply_step=apply_step,
                    drained=bool(drained),
                )
            )
        return out

    def _draw(self) -> int:
        if not self.geometric or self.local_steps <= 1:
            return self.local_steps
        gen = round_generator(self.seed, self.attempts, salt=_LOCAL_STEPS_SALT + self.engine.comm.rank)
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        p = 1.0 / self.local_steps
        return 1 + int(math.floor(math.log1p(-u) / math.log1p(-p)))

    # ------------------------------------------------------------------ exchange thread
    def _serve(self) -> None:
        torch.set_num_threads(self._threads)
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if job.published is not None and not self._await_claim(job):
                    continue
                pending = self.engine.post(job.x_pub, job.peer, job.ticket)
                job.average = self.engine.complete(pending)
            except BaseException as exc:  # surfaced on the main thread
                job.error = exc
            finally:
                job.done.set()

    def _await_claim(self, job: _Job) -> bool:
        assert self.matchmaker is not None and job.published is not None
        while not job.cancelled.is_set():
            claim = self.matchmaker.read_claim(job.published)
            if claim is not None:
                job.peer, job.ticket, job.peer_step = claim
                return True
            time.sleep(_POLL_SECONDS)
        return False

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Counters, the pairing log and the RNG position (call after :meth:`drain`)."""
        return {"log": [list(r) for r in self.log], "attempts": self.attempts, "next_attempt": self.next_attempt}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self.log = [cast(PairingRecord, tuple(int(v) for v in r)) for r in state.get("log", [])]
        self.attempts = int(state.get("attempts", 0))
        self.next_attempt = int(state.get("next_attempt", self.next_attempt))


EXCHANGE_TIMEOUT_SETTING = "`exchange_timeout=` of SwarmStrategy"
"""What sets the timeout of the exchanges' group, as a timed-out exchange names it."""


def exchange_group(timeout: float) -> dist.ProcessGroup:
    """A gloo group over all ranks for the exchange thread only (every rank must call this, in order)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
