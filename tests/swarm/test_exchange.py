"""The pairwise exchange protocol: both ends agree, the pair ends identical, bytes, fallback, 4 processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.distributed import run_workers
from lightning_gradcomp.comm import Comm
from lightning_gradcomp.functional.lattice import lattice_error_bound
from lightning_gradcomp.swarm.exchange import LatticeCodec, PairwiseGossip, average_pair, blockwise_absmax
from lightning_gradcomp.swarm.pairing import matching


def _both_ends(codec: LatticeCodec, x_a: torch.Tensor, x_b: torch.Tensor, spread_a: torch.Tensor,
               spread_b: torch.Tensor) -> tuple:
    own_a, own_b = codec.encode(x_a, spread_a), codec.encode(x_b, spread_b)
    avg_a, ok_a, gap_a = average_pair(codec, own_a, codec.decode(own_b.message, x_a))
    avg_b, ok_b, gap_b = average_pair(codec, own_b, codec.decode(own_a.message, x_b))
    return own_a, own_b, (avg_a, ok_a, gap_a), (avg_b, ok_b, gap_b)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pair_ends_bit_identical_within_the_lattice_bound(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    codec = LatticeCodec(bits=bits, block_size=100)
    x_a = torch.randn(1050, generator=gen)
    x_b = x_a + 0.01 * torch.randn(1050, generator=gen)
    spread = blockwise_absmax(x_a - x_b, 100)
    own_a, own_b, (avg_a, ok_a, gap_a), (avg_b, ok_b, gap_b) = _both_ends(codec, x_a, x_b, spread, spread)
    assert own_a.message.numel() == codec.message_bytes(1050) == 8 * 11 + (1050 * bits + 7) // 8
    assert bool(ok_a.all()) and bool(ok_b.all())
    assert torch.equal(avg_a, avg_b) and torch.equal(gap_a, gap_b)
    bound = ((lattice_error_bound(own_a.side) + lattice_error_bound(own_b.side)) / 2).repeat_interleave(100)[:1050]
    exact = (x_a.double() + x_b.double()) / 2
    assert bool(((avg_a.double() - exact).abs() <= bound.double() + 1e-7 * exact.abs()).all())  # + fp32 rounding


def test_both_ends_reject_the_same_blocks_when_the_estimate_is_too_small() -> None:
    """Random distances around the decodable range: the two per-block verdicts always agree (no deadlock)."""
    gen = torch.Generator().manual_seed(0)
    codec = LatticeCodec(bits=4, block_size=64, margin=1.0)
    verdicts = []
    for trial in range(200):
        x_a = torch.randn(256, generator=gen)
        x_b = x_a + (torch.rand(256, generator=gen) * 2 - 1) * 0.01 * (1 + trial % 7)
        spread_a = torch.full((4,), 0.02 + 0.01 * (trial % 5), dtype=torch.float64)
        spread_b = torch.full((4,), 0.03, dtype=torch.float64)
        *_, (avg_a, ok_a, _), (avg_b, ok_b, _) = _both_ends(codec, x_a, x_b, spread_a, spread_b)
        assert torch.equal(ok_a, ok_b)
        mask = ok_a.repeat_interleave(64)
        assert torch.equal(avg_a[mask], avg_b[mask])
        verdicts.extend((~ok_a).tolist())
    assert 80 < sum(verdicts) < 720


@pytest.mark.parametrize("bad, match", [({"bits": 0}, "bits"), ({"bits": 9}, "bits"), ({"block_size": 0}, "block_size"),
                                        ({"margin": 0.5}, "lattice_margin")])
def test_codec_arguments_are_validated(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LatticeCodec(**bad)


def _gossip_worker(rank: int, world_size: int, rounds: int, non_blocking: bool) -> dict:
    gen = torch.Generator().manual_seed(100 + rank)
    numel = 3000
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)) + 0.05 * torch.randn(numel, generator=gen)
    comm = Comm()
    engine = PairwiseGossip(comm, numel, LatticeCodec(bits=8, block_size=512))
    engine.anchor = x.clone() - 0.1  # first estimate: ranks are within 2 * 0.1 of each other
    history, deltas = [], []
    for r in range(rounds):
        partner = matching("complete", world_size, seed=7, round_index=r)[rank]
        delta = torch.zeros(numel)
        if partner >= 0:
            pending = engine.post(x, partner, r)
            if non_blocking:
                delta = 0.001 * torch.randn(numel, generator=gen)  # "local steps" taken while in flight
                x = engine.complete(pending, x + delta)
            else:
                x = engine.complete(pending)
        history.append(x.clone())
        deltas.append(delta)
    return {"history": history, "deltas": deltas, "bytes": comm.stats.wire_bytes,
            "stats": engine.stats.state_dict(), "message": engine.message_bytes(),
            "partners": [matching("complete", world_size, seed=7, round_index=r) for r in range(rounds)]}


@pytest.mark.parametrize("world_size", [3, 4])
def test_blocking_exchange_leaves_pairs_identical(world_size: int) -> None:
    rounds = 6
    out = run_workers(_gossip_worker, world_size, rounds, False)
    assert all(o["partners"] == out[0]["partners"] for o in out)  # every rank derived the same pairings
    for r in range(rounds):
        partners = out[0]["partners"][r]
        for i, j in enumerate(partners):
            if j >= 0:
                assert torch.equal(out[i]["history"][r], out[j]["history"][r]), (r, i, j)
    for rank, o in enumerate(out):
        exchanged = sum(p[rank] >= 0 for p in o["partners"])
        assert o["stats"]["fallbacks"] == 0
        assert o["bytes"] == exchanged * o["message"]  # one message per exchange, whatever W is
    if world_size == 3:
        assert all(p.count(-1) == 1 for p in out[0]["partners"])


def test_non_blocking_exchange_adds_local_progress_to_the_pair_average() -> None:
    rounds = 4
    out = run_workers(_gossip_worker, 4, rounds, True)
    for r in range(rounds):
        for i, j in enumerate(out[0]["partners"][r]):
            averaged_i = out[i]["history"][r] - out[i]["deltas"][r]
            averaged_j = out[j]["history"][r] - out[j]["deltas"][r]
            assert torch.allclose(averaged_i, averaged_j, atol=1e-6, rtol=0)
    assert not torch.equal(out[0]["history"][-1], out[out[0]["partners"][-1][0]]["history"][-1])


def _fallback_worker(rank: int, world_size: int) -> dict:
    numel = 800
    x = torch.zeros(numel)
    x[:400] = float(rank)  # block 0: ranks 1.0 apart, but the estimate says 0.001; block 1: equal
    comm = Comm()
    engine = PairwiseGossip(comm, numel, LatticeCodec(bits=8, block_size=400))
    engine.spread = torch.full((2,), 0.001, dtype=torch.float64)
    y = engine.complete(engine.post(x, 1 - rank, 0))
    z = engine.complete(engine.post(y + 0.0005 * (2 * rank - 1), 1 - rank, 1))  # estimate now learned: no fallback
    dist.barrier()
    return {"y": y, "z": z, "stats": engine.stats.state_dict(), "bytes": comm.stats.wire_bytes,
            "message": engine.message_bytes()}


def test_wrap_around_resends_only_the_wrapped_blocks_in_fp32_on_both_ends() -> None:
    out = run_workers(_fallback_worker, 2)
    for o in out:
        assert (o["stats"]["fallbacks"], o["stats"]["fallback_blocks"]) == (1, 1)
        assert o["bytes"] == 2 * o["message"] + 4 * 400  # two coded messages + block 0 in fp32
    assert torch.equal(out[0]["y"], out[1]["y"]) and torch.equal(out[0]["y"][:400], torch.full((400,), 0.5))
    assert torch.equal(out[0]["y"][400:], torch.zeros(400))
    assert torch.equal(out[0]["z"], out[1]["z"])


def test_dithered_rounding_keeps_pair_ends_identical_and_needs_no_extra_bytes() -> None:
    codec = LatticeCodec(bits=8, block_size=100, rounding="dithered")
    gen = torch.Generator().manual_seed(5)
    x_a = torch.randn(1050, generator=gen)
    x_b = x_a + 0.01 * torch.randn(1050, generator=gen)
    spread = blockwise_absmax(x_a - x_b, 100)
    d_a, d_b = codec.dither(1050, 0, 7, 0), codec.dither(1050, 0, 7, 1)  # (seed, exchange id, sender)
    assert not torch.equal(d_a, d_b) and torch.equal(d_a, codec.dither(1050, 0, 7, 0))
    own_a, own_b = codec.encode(x_a, spread, d_a), codec.encode(x_b, spread, d_b)
    nearest = LatticeCodec(bits=8, block_size=100)
    assert own_a.message.numel() == codec.message_bytes(1050) == nearest.message_bytes(1050)
    avg_a, ok_a, _ = average_pair(codec, own_a, codec.decode(own_b.message, x_a, d_b))
    avg_b, ok_b, _ = average_pair(codec, own_b, codec.decode(own_a.message, x_b, d_a))
    assert bool(ok_a.all()) and bool(ok_b.all()) and torch.equal(avg_a, avg_b)
    bound = lattice_error_bound(own_a.side).repeat_interleave(100)[:1050]
    assert bool(((avg_a - (x_a + x_b) / 2).abs() <= bound + 1e-6).all())
