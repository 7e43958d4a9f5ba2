"""A calibrated step (:class:`StepTrace`) and its replay on a topology (:func:`simulate_step`): the predicted step
time, as :mod:`lightning_gradcomp.advise.costs` describes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional, Union

from lightning_gradcomp.advise.costs.collectives import Collective, collective_seconds, loopback_seconds, nic_bytes
from lightning_gradcomp.advise.costs.topology import Group, Link, Topology, groups_for

__all__ = ["BucketTrace", "Join", "Prediction", "StepTrace", "simulate_step"]


@dataclass(frozen=True)
class Join:
    """The communication thread waits here for every asynchronous collective it issued so far (and their decode)."""


@dataclass(frozen=True)
class BucketTrace:
    """One DDP bucket: when it became ready (seconds from the step's start) and what its reduction did, in order:
    ``float`` items are seconds of compute on the communication thread, :class:`Collective` items its collectives,
    :class:`Join` items waits for the asynchronous ones."""

    ready: float
    items: tuple[Union[float, Collective, Join], ...] = ()


@dataclass(frozen=True)
class StepTrace:
    """A calibrated step of one configuration (one rank; seconds).

    Attributes:
        buckets: in the order they became ready.
        tail: from the last bucket's result to the step's end (DDP's finalisation, the optimizer step, ``zero_grad``).
        compute_only: the same step with no reduction at all (the model's forward, backward and optimizer step).
        serial: the reductions ran on the autograd thread (FSDP2's all-reduce hooks, :mod:`~.costs.fsdp`): a bucket's
            wait delays every later bucket, whose ``ready`` keeps its calibrated distance from the previous hook's end.
    """

    buckets: tuple[BucketTrace, ...]
    tail: float
    compute_only: float
    serial: bool = False


@dataclass(frozen=True)
class Prediction:
    """A configuration's predicted step on a topology."""

    step: float
    compute_only: float
    nic_bytes: float
    comm: float = 0.0
    exposed: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def efficiency(self) -> float:
        """Scaling efficiency: the compute-only step over the predicted step."""
        return self.compute_only / self.step if self.step > 0 else 1.0


def simulate_step(trace: StepTrace, topology: Topology, groups: Optional[Mapping[str, Group]] = None) -> Prediction:
    """Replay ``trace`` on ``topology`` (see the module docstring): the predicted step time and the bytes per NIC.

    Example: one bucket ready at 1 s, 0.5 s of compression, one asynchronous all-reduce of 1 MB over 2 ranks on
    1 MB/s; the step ends 1.5 s + 1 s later, plus a 0.1 s tail::

        >>> t = StepTrace((BucketTrace(1.0, (0.5, Collective("all_reduce", 1e6))),), tail=0.1, compute_only=1.1)
        >>> p = simulate_step(t, Topology(2, 1, Link(1e6), Link(1e9)))
        >>> round(p.step, 6), p.nic_bytes
        (2.6, 1000000.0)
    """
    groups = groups_for(topology) if groups is None else groups
    thread = 0.0
    link_free: dict[str, float] = {}
    done = 0.0
    comm = nic = 0.0
    bucket_state = _TokenBucket(topology.inter)
    shift = 0.0  # serial traces: how far the waits so far delayed the autograd thread
    copies = 0.0  # CPU seconds of intra-node copies, lost by the step's compute (Topology.cpu_copies)
    for bucket in trace.buckets:
        thread = max(thread, bucket.ready + shift)
        for item in bucket.items:
            if isinstance(item, Join):
                thread = max(thread, done)
                continue
            if not isinstance(item, Collective):
                thread += item
                continue
            cost = collective_seconds(item, topology, groups)
            copies += loopback_seconds(item, topology, groups)
            sent = nic_bytes(item, groups)
            comm += cost
            nic += sent
            channel = _channel(item.group)
            start = max(thread, link_free.get(channel, 0.0))
            cost = max(0.0, cost - bucket_state.take(start, sent, cost))
            end = link_free[channel] = start + cost
            bucket_state.busy_until(end)
            if item.blocking:
                thread = end + item.decode
            else:
                done = max(done, end + item.decode)
        if trace.serial:
            shift = max(shift, thread - bucket.ready - sum(i for i in bucket.items if isinstance(i, float)))
    last_ready = trace.buckets[-1].ready + shift if trace.buckets else 0.0
    finish = max(thread, done, last_ready)
    step = finish + trace.tail + copies
    return Prediction(step, trace.compute_only, nic, comm, max(0.0, step - _no_network_step(trace)))


class _TokenBucket:
    """The inter-node link's token bucket (``Link.burst``): how much of a transfer passes at once."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.tokens = link.burst
        self.idle_since = 0.0

    def take(self, start: float, nbytes: float, cost: float) -> float:
        """Seconds saved by a transfer of ``nbytes`` through the NIC starting at ``start`` (and its tokens spent)."""
        if self.link.burst <= 0 or nbytes <= 0:
            return 0.0
        if start > self.idle_since:
            self.tokens = min(self.link.burst, self.tokens + (start - self.idle_since) * self.link.bandwidth)
        used = min(self.tokens, nbytes)
        self.tokens -= used
        return min(cost, used / self.link.bandwidth)

    def busy_until(self, end: float) -> None:
        self.idle_since = max(self.idle_since, end)


def _channel(group: str) -> str:
    """Collectives on one channel run one after another (one process group's queue)."""
    return group


def _no_network_step(trace: StepTrace) -> float:
    """The step with free collectives (what the calibration measured, up to noise)."""
    thread = done = 0.0
    for bucket in trace.buckets:
        thread = max(thread, bucket.ready)
        for item in bucket.items:
            if isinstance(item, Join):
                thread = max(thread, done)
            elif isinstance(item, Collective):
                if item.blocking:
                    thread += item.decode
                else:
                    done = max(done, thread + item.decode)
            else:
                thread += item
    last_ready = trace.buckets[-1].ready if trace.buckets else 0.0
    return max(thread, done, last_ready) + trace.tail
