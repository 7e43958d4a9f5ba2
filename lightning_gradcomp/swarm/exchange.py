"""The pairwise model exchange of SwarmSGD: lattice-coded messages, a wrap-around guard and the average.

Protocol of one exchange between ranks ``a`` and ``b`` (both run the same code):

1. Each end encodes its flat model ``x`` (fp32, trainable parameters) on a cubic lattice whose side is
   chosen per block of ``block_size`` coordinates from its running estimate of the distance to a peer
   (:class:`LatticeCodec`). Message (``uint8``): ``sides`` (fp32 per block) | ``checksums`` (int32 per
   block) | codes packed at ``bits`` bits per coordinate. Both messages are posted together (one send,
   one recv, ``batch_isend_irecv``).
2. Each end decodes the partner's codes against its *own* model and checks the block checksums; then
   both evaluate :func:`~lightning_gradcomp.functional.lattice.pair_decodable` per block on the two
   lattice points. That test is symmetric, computed on identical numbers whenever the local decode of
   the block was exact, and passes only if *both* decodes of the block were exact, so both ends reach
   the same per-block verdict without another message.
3. Accepted blocks: both set the average to ``(Q(x_a) + Q(x_b)) / 2`` (float addition is commutative:
   identical bits on both ends). Rejected blocks (a decode wrapped, or could have; or a block of either model
   holds NaN/Inf, which makes its side non-finite, sent as is): both send those blocks of their model in fp32 (a
   second, usually empty, exchange whose size both ends know) and average them; such exchanges are counted in
   :class:`SwarmStats` and logged.

**NaN/Inf stay on their rank**: where one end's value is NaN/Inf and the other's finite, both take the finite one
(:func:`contained_average`, in the fp32 blocks and the fp32 exchange), and a non-finite local progress counts as
none, so a diverged model heals from its partner instead of spreading.

Rounding: ``LatticeCodec(rounding="nearest")`` (default) rounds to the nearest lattice point, which is
deterministic and biased (the error is a fixed function of the value); ``rounding="dithered"`` shifts
the lattice by uniform offsets drawn from ``(seed, exchange id, sender rank)`` (known to both ends, never
sent), making each end's quantized model unbiased at the same bytes (subtractive dither).

Non-blocking use posts the exchange, lets the caller run more local steps, and completes it later:
``x <- avg(x_old, x_partner_old) + (x_now - x_old)``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.checks import check_value, is_int, is_number
from lightning_gradcomp.comm import Comm
from lightning_gradcomp.functional.lattice import (
    MAX_BLOCK,
    lattice_checksum,
    lattice_codes,
    lattice_decode,
    lattice_dither,
    lattice_index,
    lattice_sides,
    lattice_value,
    pair_decodable,
)
from lightning_gradcomp.functional.packing import pack_bits, packed_nbytes, unpack_bits
from lightning_gradcomp.swarm.pairing import round_generator

__all__ = [
    "Decoded",
    "Encoded",
    "LatticeCodec",
    "PairwiseGossip",
    "PendingExchange",
    "SwarmStats",
    "average_pair",
    "blockwise_absmax",
    "contained_average",
    "contained_mean",
    "with_progress",
]

log = logging.getLogger(__name__)

_SPREAD_DECAY = 0.95
_DITHER_SALT = 1 << 20
ROUNDINGS = ("nearest", "dithered")


def _padded(values: Tensor, block_size: int) -> Tensor:
    """``values`` (flat) zero-padded to whole blocks, shape ``(blocks, block_size)``."""
    values = values.reshape(-1)
    blocks = math.ceil(values.numel() / block_size)
    if blocks * block_size == values.numel():
        return values.view(blocks, block_size)
    out = values.new_zeros(blocks * block_size)
    out[: values.numel()] = values
    return out.view(blocks, block_size)


def blockwise_absmax(x: Tensor, block_size: int) -> Tensor:
    """``max |x|`` over consecutive blocks of a flat tensor (last block may be short), float32."""
    return _padded(x.float(), block_size).abs().amax(dim=1)


def _clone(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.clone()


@dataclass
class Encoded:
    """One end's encoded model: the wire ``message``, its lattice ``index`` (``(blocks, block)``, int32,
    zero-padded) and per-block ``side``."""

    message: Tensor
    index: Tensor
    side: Tensor
    numel: int
    dither: Optional[Tensor] = None


@dataclass
class Decoded:
    """A partner's model as decoded here: lattice ``index``, ``side`` and which block checksums matched."""

    index: Tensor
    side: Tensor
    checksum_ok: Tensor
    dither: Optional[Tensor] = None


@dataclass(frozen=True)
class LatticeCodec:
    """Wire format of a lattice-coded flat model.

    Args:
        bits: bits per coordinate, 1 to 8 (packed with :mod:`~lightning_gradcomp.functional.packing`).
        block_size: coordinates sharing one side and one checksum (8 bytes on the wire per block).
        margin: the side decodes exactly for peers up to ``margin`` times the estimated distance away.
        rounding: ``"nearest"`` (deterministic, biased) or ``"dithered"`` (shared-seed subtractive
            dither: unbiased, same bytes; error uniform in half a side either way).
    """

    bits: int = 8
    block_size: int = 1024
    margin: float = 4.0
    rounding: str = "nearest"

    def __post_init__(self) -> None:
        check_value(self.bits, is_int, lambda v: 1 <= v <= 8, "`bits` must be an integer in [1, 8] (or None for fp32)")
        in_blocks = f"`block_size` must be an integer in [1, {MAX_BLOCK}]"
        check_value(self.block_size, is_int, lambda v: 1 <= v <= MAX_BLOCK, in_blocks)
        check_value(
            self.margin, is_number, lambda v: 1 <= v < math.inf, "`lattice_margin` must be a finite number >= 1"
        )
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"`rounding` must be one of {ROUNDINGS}, got {self.rounding!r}")

    def dither(self, numel: int, seed: int, exchange_id: int, sender: int) -> Optional[Tensor]:
        """The sender's dither offsets ``(blocks, block_size)`` for one exchange (``None`` for nearest)."""
        if self.rounding != "dithered":
            return None
        gen = round_generator(seed, exchange_id, salt=_DITHER_SALT + int(sender))
        return lattice_dither((self.blocks(numel), self.block_size), gen)

    def blocks(self, numel: int) -> int:
        """Number of side blocks for ``numel`` coordinates."""
        return math.ceil(numel / self.block_size)

    def message_bytes(self, numel: int) -> int:
        """Bytes of one message: ``8 * blocks + ceil(numel * bits / 8)`` (side and checksum per block)."""
        return 8 * self.blocks(numel) + packed_nbytes(numel, self.bits)

    def encode(self, x: Tensor, spread: Tensor, dither: Optional[Tensor] = None) -> Encoded:
        """Encode flat fp32 ``x`` with sides sized for peers ``spread`` (per block) away."""
        values = _padded(x.float(), self.block_size)
        side = lattice_sides(spread, values.abs().amax(dim=1), self.bits, float(self.margin))
        index = lattice_index(values, side.view(-1, 1), dither)
        codes = lattice_codes(index, self.bits).reshape(-1)[: x.numel()]
        checksum = lattice_checksum(index).to(torch.int32)
        message = torch.cat([side.view(torch.uint8), checksum.view(torch.uint8), pack_bits(codes, self.bits)])
        return Encoded(message=message, index=index, side=side, numel=x.numel(), dither=dither)

    def decode(self, message: Tensor, reference: Tensor, dither: Optional[Tensor] = None) -> Decoded:
        """Decode a partner's ``message`` against this end's flat ``reference`` model."""
        numel, blocks = reference.numel(), self.blocks(reference.numel())
        side = message[: 4 * blocks].clone().view(torch.float32)
        checksum = message[4 * blocks : 8 * blocks].clone().view(torch.int32).long()
        codes = _padded(unpack_bits(message[8 * blocks :], self.bits, numel), self.block_size)
        index = lattice_decode(codes, _padded(reference.float(), self.block_size), side.view(-1, 1), self.bits, dither)
        return Decoded(index=index, side=side, checksum_ok=lattice_checksum(index) == checksum, dither=dither)


def contained_average(a: Tensor, b: Tensor) -> Tensor:
    """``(a + b) / 2`` elementwise, except where exactly one of ``a`` and ``b`` is NaN/Inf: there the finite one.

    Symmetric (``contained_average(b, a)`` has the same bits), so both ends of an exchange agree.

    Example::

        >>> contained_average(torch.tensor([1.0, float("nan"), 2.0]), torch.tensor([3.0, 5.0, float("inf")])).tolist()
        [2.0, 5.0, 2.0]
    """
    average = (a + b) / 2
    finite_a, finite_b = torch.isfinite(a), torch.isfinite(b)
    return torch.where(finite_a == finite_b, average, torch.where(finite_a, a, b))


def contained_mean(total: Tensor, finite_total: Tensor, finite_count: Tensor, world_size: int) -> Tensor:
    """The mean over ranks of one coordinate each, taken over the ranks whose value there is finite.

    Args:
        total: the plain sum over ranks (NaN/Inf where some rank's value is).
        finite_total: the sum over ranks of the finite values (a NaN/Inf counted as 0).
        finite_count: how many ranks hold a finite value, per coordinate (float).
        world_size: the number of ranks.

    Returns:
        ``finite_total / finite_count`` where some rank is finite, else ``total / world_size`` (no rank is finite:
        the value stays NaN/Inf). With two ranks this is :func:`contained_average`.

    Example::

        >>> contained_mean(torch.tensor([4.0, float("inf")]), torch.tensor([4.0, 6.0]), torch.tensor([2.0, 2.0]), 3)
        tensor([2., 3.])
    """
    return torch.where(finite_count > 0, finite_total / finite_count.clamp(min=1), total / world_size)


def with_progress(average: Optional[Tensor], x_now: Tensor, x_old: Tensor) -> tuple[Tensor, bool]:
    """``average + (x_now - x_old)`` (the non-blocking update; flat fp32), where a non-finite progress counts as none
    (so a model that went NaN/Inf takes the exchange's average there); the progress alone when ``average`` is
    ``None``. Also returns whether some progress was NaN/Inf (a host read)."""
    progress = x_now.detach().float() - x_old
    finite = torch.isfinite(progress)
    nonfinite = not bool(finite.all())
    if nonfinite:  # the masking pass only when needed
        progress = torch.where(finite, progress, torch.zeros((), dtype=progress.dtype, device=progress.device))
    return (progress if average is None else average + progress), nonfinite


def average_pair(codec: LatticeCodec, own: Encoded, partner: Decoded) -> tuple[Tensor, Tensor, Tensor]:
    """The pair average ``(Q(x_own) + Q(x_partner)) / 2`` (flat fp32) and which blocks may use it.

    Returns:
        ``(average, accepted, gap)``: the flat average (meaningless in rejected blocks), a per-block bool
        ``accepted`` (identical on both ends) and the per-block ``max |Q(x_own) - Q(x_partner)|``
        (meaningful in accepted blocks). Float addition is commutative, so both ends get the same bits.
    """
    own_value = lattice_value(own.index, own.side.view(-1, 1), own.dither)
    other_value = lattice_value(partner.index, partner.side.view(-1, 1), partner.dither)
    gap = (own_value - other_value).abs().amax(dim=1)
    accepted = pair_decodable(own_value, other_value, own.side.view(-1, 1), partner.side.view(-1, 1), codec.bits)
    accepted &= partner.checksum_ok & torch.isfinite(own.side) & torch.isfinite(partner.side)  # NaN/Inf: fp32
    return ((own_value + other_value) / 2).reshape(-1)[: own.numel], accepted, gap


@dataclass
class SwarmStats:
    """Gossip figures of one rank (cumulative).

    Attributes:
        rounds: gossip rounds reached (including ones this rank sat out).
        exchanges: rounds in which this rank exchanged with a partner.
        sat_out: lock-step: rounds without a partner (odd world size, incomplete matching); async: offers that went
            unclaimed (renewed, locked to claim another rank, or withdrawn at a drain).
        fallbacks: exchanges in which some blocks were resent in fp32 (a decode wrapped or could have).
        fallback_blocks: blocks resent in fp32, in all.
        consensus: last measured ``max_i ||x_i - mean||_2`` (``nan`` if never measured).
        nonfinite_steps: local steps whose gradient held NaN/Inf and was zeroed before the update.
        nonfinite_exchanges: exchanges in which this rank's posted model, or its progress since the post, held
            NaN/Inf; the partner's values (or the pair's average) were taken there (:func:`contained_average`).
    """

    rounds: int = 0
    exchanges: int = 0
    sat_out: int = 0
    fallbacks: int = 0
    fallback_blocks: int = 0
    consensus: float = float("nan")
    nonfinite_steps: int = 0
    nonfinite_exchanges: int = 0
    consensus_history: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        """Plain, ``weights_only``-loadable representation."""
        return {
            "rounds": self.rounds,
            "exchanges": self.exchanges,
            "sat_out": self.sat_out,
            "fallbacks": self.fallbacks,
            "fallback_blocks": self.fallback_blocks,
            "consensus": self.consensus,
            "nonfinite_steps": self.nonfinite_steps,
            "nonfinite_exchanges": self.nonfinite_exchanges,
            "consensus_history": list(self.consensus_history),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        keys = ("rounds", "exchanges", "sat_out", "fallbacks", "fallback_blocks", "consensus", "nonfinite_steps")
        for key in (*keys, "nonfinite_exchanges"):
            setattr(self, key, state.get(key, getattr(self, key)))
        self.consensus_history = list(state.get("consensus_history", []))


@dataclass
class PendingExchange:
    """An exchange that was posted and not yet applied.

    Attributes:
        round_index: the gossip round it belongs to.
        peer: the partner's rank.
        x_old: this end's flat model when it was posted (fp32).
        sent: this end's message (kept alive until the send completes).
        received: buffer for the partner's message.
        own: this end's encoding (``None`` in fp32 mode).
        works: in-flight send/recv handles (empty once completed or restored from a checkpoint).
    """

    round_index: int
    peer: int
    x_old: Tensor
    sent: Tensor
    received: Tensor
    own: Optional[Encoded] = None
    works: list[Any] = field(default_factory=list)

    def wait(self) -> None:
        """Block until both the send and the receive are done."""
        for work in self.works:
            work.wait()
        self.works = []

    def state_dict(self) -> dict[str, Any]:
        """Completed exchange as plain tensors (waits for the data first)."""
        self.wait()
        return {
            "round_index": self.round_index,
            "peer": self.peer,
            "x_old": self.x_old.clone(),
            "sent": self.sent.clone(),
            "received": self.received.clone(),
        }


class PairwiseGossip:
    """Per-rank engine that posts and completes pairwise model exchanges.

    Args:
        comm: byte-counting communicator (its stats receive every byte sent).
        numel: length of the flat model.
        codec: lattice wire format, or ``None`` to exchange fp32 models.
        stats: where gossip figures go.
        seed: shared seed of the dither offsets (``rounding="dithered"``).
    """

    def __init__(
        self, comm: Comm, numel: int, codec: Optional[LatticeCodec], stats: Optional[SwarmStats] = None, seed: int = 0
    ) -> None:
        self.comm = comm
        self.seed = int(seed)
        self.numel = int(numel)
        self.codec = codec
        self.stats = stats if stats is not None else SwarmStats()
        self.spread: Optional[Tensor] = None
        self.anchor: Optional[Tensor] = None
        self.drift: Optional[Tensor] = None

    # ------------------------------------------------------------------ protocol
    def message_bytes(self) -> int:
        """Bytes this rank sends per (non-fallback) exchange."""
        return self.codec.message_bytes(self.numel) if self.codec is not None else 4 * self.numel

    def post(self, x: Tensor, peer: int, round_index: int) -> PendingExchange:
        """Encode flat model ``x`` and post the exchange with ``peer`` (returns at once)."""
        x_old = x.detach().float().clone()
        own = None
        if self.codec is None:
            sent = x_old
            received = torch.empty_like(x_old)
        else:
            own = self.codec.encode(x_old, self._spread_estimate(x_old), self._dither(round_index, self.comm.rank))
            sent = own.message
            received = torch.empty_like(sent)
        works = self.comm.exchange(sent, received, peer, async_op=True)
        return PendingExchange(round_index, peer, x_old, sent, received, own, list(works))

    def complete(self, pending: PendingExchange, x_now: Optional[Tensor] = None) -> Tensor:
        """Wait for ``pending`` and return the new flat model (fp32).

        ``x_now`` is the model after the local steps taken since the post (``None``: none were taken);
        the result is ``avg + (x_now - x_old)``.
        """
        pending.wait()
        x_old = pending.x_old
        if self.codec is None:
            average = contained_average(x_old, pending.received)  # symmetric: both ends get the same bits
        else:
            own = pending.own if pending.own is not None else self._own_from_message(pending)
            partner = self.codec.decode(pending.received, x_old, self._dither(pending.round_index, pending.peer))
            average, accepted, gap = average_pair(self.codec, own, partner)
            if not bool(accepted.all()):
                self._fallback(pending, accepted, average, gap)
            self.spread = gap if self.spread is None else torch.maximum(gap, _SPREAD_DECAY * self.spread)
        if x_now is None:
            if not bool(torch.isfinite(x_old).all()):  # one host read (the lattice path reads its verdict too)
                self.stats.nonfinite_exchanges += 1
            if self.codec is not None:
                self.anchor = average.clone()
            return average
        progress, nonfinite = with_progress(None, x_now, x_old)  # x_old's NaN/Inf make the progress's too
        self.stats.nonfinite_exchanges += int(nonfinite)
        if self.codec is not None:
            self.drift = blockwise_absmax(progress, self.codec.block_size)
        return average + progress

    def _fallback(self, pending: PendingExchange, accepted: Tensor, average: Tensor, gap: Tensor) -> None:
        """Exchange the rejected blocks in fp32 (blocking) and write their average and distance in place."""
        assert self.codec is not None
        block = self.codec.block_size
        rejected = (~accepted).nonzero().reshape(-1)
        self.stats.fallbacks += 1
        self.stats.fallback_blocks += rejected.numel()
        count = self.stats.fallbacks
        if count & (count - 1) == 0:
            log.warning(
                f"SwarmSGD rank {self.comm.rank}: lattice decode with rank {pending.peer} in round "
                f"{pending.round_index} wrapped around (or could have) in {rejected.numel()} of "
                f"{accepted.numel()} blocks; those were exchanged in fp32 ({count} such exchange(s) "
                f"so far on this rank)"
            )
        mask = (~accepted).repeat_interleave(block)[: self.numel]
        mine = pending.x_old[mask].contiguous()
        theirs = torch.empty_like(mine)
        self.comm.exchange(mine, theirs, pending.peer)
        average[mask] = contained_average(mine, theirs)
        exact = pending.x_old.new_zeros(self.numel)
        exact[mask] = (mine - theirs).abs().nan_to_num(0.0, 0.0, 0.0)  # the distance estimate stays finite
        gap[rejected] = blockwise_absmax(exact, block)[rejected]

    def _own_from_message(self, pending: PendingExchange) -> Encoded:
        assert self.codec is not None
        dither = self._dither(pending.round_index, self.comm.rank)
        decoded = self.codec.decode(pending.sent, pending.x_old, dither)  # exact: the reference is x itself
        return Encoded(message=pending.sent, index=decoded.index, side=decoded.side, numel=self.numel, dither=dither)

    def _dither(self, exchange_id: int, sender: int) -> Optional[Tensor]:
        assert self.codec is not None
        return self.codec.dither(self.numel, self.seed, exchange_id, sender)

    def _spread_estimate(self, x: Tensor) -> Tensor:
        """Expected ``max |x - x_partner|`` per block: the (slowly decaying) largest distance measured in
        past exchanges plus twice this rank's own local progress over the last round (the partner is
        assumed to have moved as far; this tracks growing step sizes, e.g. momentum warming up)."""
        assert self.codec is not None
        if self.anchor is not None:  # local progress since the last synchronization point
            drift = blockwise_absmax(x - self.anchor, self.codec.block_size)
            self.anchor = None
        elif self.drift is not None:
            drift = self.drift
        else:
            drift = torch.zeros(self.codec.blocks(self.numel), device=x.device)
        return drift * 2 if self.spread is None else self.spread + drift * 2

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Distance estimate (spread, anchor, drift) and stats (``weights_only``-loadable)."""
        return {
            "spread": _clone(self.spread),
            "anchor": _clone(self.anchor),
            "drift": _clone(self.drift),
            "stats": self.stats.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self.spread = state.get("spread")
        self.anchor = state.get("anchor")
        self.drift = state.get("drift")
        self.stats.load_state_dict(state.get("stats", {}))

    def restore_pending(self, state: dict[str, Any]) -> PendingExchange:
        """Rebuild a completed-but-unapplied exchange from :meth:`PendingExchange.state_dict`."""
        return PendingExchange(
            int(state["round_index"]), int(state["peer"]), state["x_old"].float(), state["sent"], state["received"]
        )
