"""CLTK (ScaleCom): leader rotation, commutativity, local residuals, wire bytes, Lightning replicas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.distributed import run_workers
from helpers.models import TinyNet, assert_replicas_identical, fit
from helpers.reduce import make_slots
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import Comm, all_reduce_bytes, broadcast_bytes
from lightning_gradcomp.compressors import CLTK, TopK, registry
from lightning_gradcomp.compressors.base import Compressor, ReduceContext
from lightning_gradcomp.compressors.cltk import decode_delta16, delta16_capacity, encode_delta16, leader_rank
from lightning_gradcomp.functional import _native, exact_topk_indices, kept_count
from lightning_gradcomp.presets import PRESETS

SHAPES = [(60, 50), (4000,)]  # one small layer (exact path of "approx") and one sampled-path layer


def _p(rank: int, step: int, bucket: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Deterministic inputs p of one rank at (step, bucket), regenerable by the test process."""
    gen = torch.Generator().manual_seed(10_000 * rank + 100 * step + bucket)
    return [torch.randn(int(torch.tensor(s).prod()), generator=gen) for s in shapes]


def _worker(rank: int, world: int, comp: Compressor, shapes: list[tuple[int, ...]], steps: int,
            buckets: int) -> list[dict[str, Any]]:
    comm = Comm()
    slots = make_slots(shapes)
    out = []
    for step in range(steps):
        for bucket in range(buckets):
            tensors = _p(rank, step, bucket, shapes)
            ctx = ReduceContext(comm, step, bucket, slots, [comp.default_param] * len(slots), seed=7)
            bytes0, coll0 = comm.stats.wire_bytes, comm.stats.collectives
            red = comp.reduce([t.clone() for t in tensors], ctx)
            out.append({"step": step, "bucket": bucket, "averaged": [t.clone() for t in red.averaged.wait()],
                        "residuals": [t.clone() for t in red.residuals],
                        "bytes": comm.stats.wire_bytes - bytes0, "collectives": comm.stats.collectives - coll0})
    return out


# ---------------------------------------------------------------------------------------------- pure
def test_leader_rotates_per_step_with_bucket_offset() -> None:
    assert [leader_rank(s, 0, 3) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [leader_rank(s, 2, 4) for s in range(4)] == [2, 3, 0, 1]


@pytest.mark.parametrize("indices", [[0], [65534], [65535], [65536], [0, 1, 2, 131070, 131071, 299_999],
                                     [5, 70_000, 200_000]])
def test_delta16_round_trip(indices: list[int]) -> None:
    n = 300_000
    idx = torch.tensor(indices, dtype=torch.int64)
    cap = delta16_capacity(n, len(indices))
    codes = encode_delta16(idx, cap)
    assert codes.dtype == torch.uint16 and codes.numel() == cap
    assert torch.equal(decode_delta16(codes), idx)


def test_delta16_worst_case_fits_capacity() -> None:
    n = 1_000_000
    idx = torch.tensor([n - 1])  # one gap of n: the most escapes a single index can need
    assert torch.equal(decode_delta16(encode_delta16(idx, delta16_capacity(n, 1))), idx)
    spread = torch.arange(0, n, 65536 * 3)  # many large gaps
    assert torch.equal(decode_delta16(encode_delta16(spread, delta16_capacity(n, spread.numel()))), spread)


def test_commutes_with_the_mean_for_a_shared_mask() -> None:
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(500, generator=gen) for _ in range(4)]
    idx = exact_topk_indices(ps[1], 20)  # the leader's mask
    mask = torch.zeros(500)
    mask[idx] = 1.0
    mean_of_compressed = sum(p * mask for p in ps) / 4
    compressed_mean = (sum(ps) / 4) * mask
    torch.testing.assert_close(mean_of_compressed, compressed_mean, rtol=0, atol=1e-7)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"ratio": 0.0}, "ratio"), ({"ratio": 1.5}, "ratio"), ({"selection": "fast"}, "selection"),
    ({"index_coding": "int8"}, "index_coding"), ({"value_dtype": torch.int8}, "value_dtype")])
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        CLTK(**kwargs)


def test_registered_name_and_preset() -> None:
    comp = registry.create("cltk", ratio=0.02, selection="approx")
    assert isinstance(comp, CLTK) and comp.ratio == 0.02 and comp.uses_error_feedback
    assert "scalecom" in PRESETS
    preset = PRESETS["scalecom"][1]()["compressor"]
    assert isinstance(preset, CLTK) and preset.ratio == 0.01
    compact = PRESETS["scalecom_compact"][1]()["compressor"]
    assert (compact.ratio, compact.selection, compact.value_dtype, compact.index_coding) == (
        0.01, "approx", torch.float16, "delta16")


# ---------------------------------------------------------------------------------------------- gloo ranks
@pytest.mark.parametrize("world", [2, 3, 4])
def test_leader_indices_shared_mean_and_local_residuals(world: int) -> None:
    ratio, steps, buckets = 0.02, world + 1, 2
    spread = world == 3  # the opt-in per-bucket offset once; the paper's rule otherwise
    results = run_workers(_worker, world, CLTK(ratio, spread_leaders=spread), SHAPES, steps, buckets)
    for i, rec in enumerate(results[0]):
        step, bucket = rec["step"], rec["bucket"]
        leader = leader_rank(step, bucket if spread else 0, world)
        ps = [_p(r, step, bucket, SHAPES) for r in range(world)]
        for layer, n in enumerate(int(torch.tensor(s).prod()) for s in SHAPES):
            idx = exact_topk_indices(ps[leader][layer], kept_count(n, ratio))  # the leader's own p
            mask = torch.zeros(n, dtype=torch.bool)
            mask[idx] = True
            expected = torch.where(mask, sum(p[layer] for p in ps) / world, 0.0)  # CLT(mean p)
            locals_ = [ps[r][layer] - results[r][i]["residuals"][layer] for r in range(world)]
            torch.testing.assert_close(sum(locals_) / world, expected, rtol=1e-6, atol=1e-7)  # commutes
            for r in range(world):
                assert torch.equal(results[r][i]["averaged"][layer], results[0][i]["averaged"][layer])
                torch.testing.assert_close(results[r][i]["averaged"][layer], expected, rtol=1e-6, atol=1e-7)
                residual = results[r][i]["residuals"][layer]  # local p with the kept entries removed
                assert torch.equal(residual, torch.where(mask, 0.0, ps[r][layer]))
        k_total = sum(kept_count(int(torch.tensor(s).prod()), ratio) for s in SHAPES)
        assert rec["collectives"] == 2  # one broadcast + one all-reduce per bucket
        assert rec["bytes"] == pytest.approx(broadcast_bytes(4 * k_total, world) + all_reduce_bytes(4 * k_total, world))


def test_approx_selection_keeps_within_band_on_the_wire() -> None:
    world, ratio = 2, 0.01
    shapes = [(200_000,)]
    comp = CLTK(ratio, selection="approx", index_coding="delta16", value_dtype=torch.float16)
    results = run_workers(_worker, world, comp, shapes, 6, 1)
    k = kept_count(200_000, ratio)
    for i, rec in enumerate(results[0]):
        leader = leader_rank(rec["step"], 0, world)
        ps = [_p(r, rec["step"], 0, shapes)[0] for r in range(world)]
        support = ps[leader] != results[leader][i]["residuals"][0]  # entries the leader kept
        kept = int(support.sum())
        assert 0.9 * k <= kept <= k
        top = torch.zeros(200_000, dtype=torch.bool)
        top[exact_topk_indices(ps[leader], kept)] = True
        assert torch.equal(support, top)  # an exact top-c set of the leader's p
        assert torch.equal(rec["averaged"][0], results[1][i]["averaged"][0])
        expected = torch.where(support, (ps[0] + ps[1]) / 2, 0.0)
        torch.testing.assert_close(rec["averaged"][0], expected, rtol=2e-3, atol=2e-3)
        # delta16 indices (k codes + escapes) and fp16 values
        assert rec["bytes"] == pytest.approx(broadcast_bytes(2 * delta16_capacity(200_000, k), world)
                                              + all_reduce_bytes(2 * k, world))


def _prepare_worker(rank: int, world: int) -> list[str]:
    """A rank that has not loaded the selection kernel: ``prepare()``, then one reduce; when did it build?"""
    _native._MODULE, _native._FAILED, _native._DISABLED = None, False, None
    phase, builds = ["prepare"], []
    build = _native._build  # the cached kernel (compiled at most once per machine), or the reason it cannot be

    def recording_build() -> Any:
        builds.append(phase[0])
        return build()

    _native._build = recording_build  # this forked rank exits after the test
    comp = CLTK(0.01, selection="approx")
    comp.prepare()
    phase[0] = "reduce"
    slots = make_slots([(200_000,), (60, 50)])  # the sampled selection and the exact one of a small layer
    tensors = _p(rank, 0, 0, [(200_000,), (60, 50)])
    comp.reduce(tensors, ReduceContext(Comm(), 0, 0, slots, [0.01, 0.01], seed=7)).averaged.wait()
    return builds


def test_prepare_builds_the_kernel_before_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 16: the leader's first reduce compiled the kernel (15-20 s) while the other ranks waited in the
    broadcast; ``prepare()``, which the strategy calls on every rank in its setup, builds it instead."""
    monkeypatch.delenv(_native.DISABLE_ENV, raising=False)
    assert run_workers(_prepare_worker, 2, timeout=120.0) == [["prepare"], ["prepare"]]


def test_prepare_of_exact_selection_builds_the_kernel_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact selection uses the kernel's radix selection on CPU, so its ``prepare`` builds the kernel as well."""
    calls = []
    monkeypatch.setattr(_native, "load", lambda: calls.append(1))
    CLTK(0.01).prepare()
    assert calls == [1]


def _ratio(comp: Compressor, world: int, shapes: list[tuple[int, ...]]) -> float:
    results = run_workers(_worker, world, comp, shapes, 1, 1)
    n = sum(int(torch.tensor(s).prod()) for s in shapes)
    return all_reduce_bytes(4 * n, world) / results[0][0]["bytes"]


class _SaltRecorder(ReduceContext):
    """A context that records the salts of the generators the compressor asks for."""

    salts: list = []

    def generator(self, device: torch.device, *, shared: bool, salt: Any) -> torch.Generator:
        type(self).salts.append(salt)
        return super().generator(device, shared=shared, salt=salt)


def _salt_worker(rank: int, world: int, order: list[int]) -> dict[str, Any]:
    named = make_slots([(300, 40), (50, 60)])
    slots, offset = [], 0
    for i in order:  # the same layers, in another bucket order
        slots.append(type(named[i])(named[i].name, offset, named[i].shape, compressed=True))
        offset += named[i].numel
    gen = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(s.numel, generator=gen) for s in slots]
    _SaltRecorder.salts = []
    out = CLTK(0.01, selection="approx").reduce(tensors, _SaltRecorder(Comm(), 0, 0, slots, [0.01, 0.01]))
    out.averaged.wait()
    return {"salts": list(_SaltRecorder.salts), "names": [s.name for s in slots]}


def test_approx_sample_is_seeded_by_layer_name_not_bucket_position() -> None:
    """DDP re-buckets after its first step and after a resume: the sample must follow the layer's name."""
    for order in ([0, 1], [1, 0]):
        leader = run_workers(_salt_worker, 2, order)[0]  # step 0: rank 0 leads
        assert leader["salts"] == leader["names"]


def test_wire_ratio_holds_as_world_grows_unlike_local_topk() -> None:
    shapes = [(300, 200), (50_000,)]
    cltk = {w: _ratio(CLTK(0.01), w, shapes) for w in (2, 4)}
    topk = {w: _ratio(TopK(0.01), w, shapes) for w in (2, 4)}
    # dense 2(W-1)/W 4n over (W-1)/W 4k (index broadcast) + 2(W-1)/W 4k (values): 2n / 3k at every W
    assert cltk[2] == pytest.approx(200 / 3, rel=0.01)  # ratio 1 %
    assert cltk[4] == pytest.approx(cltk[2], rel=0.01)
    assert topk[4] < 0.6 * topk[2]  # all-gather: (W-1) * 8k bytes


# ---------------------------------------------------------------------------------------------- Lightning
def _strategy(comp: CLTK) -> GradCompStrategy:
    return GradCompStrategy(compressor=comp, start_method="fork")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_replicas_identical_and_bytes_match_formula(world: int, tmp_path: Path) -> None:
    ratio = 0.01
    records = fit(_strategy(CLTK(ratio)), tmp_path, devices=world, max_epochs=1, model=TinyNet(samples=128))
    assert_replicas_identical(records)
    stats = records[0]["stats"]
    compressed_steps = stats["steps"] - 2  # start_step = 2 dense steps
    assert compressed_steps > 0
    for name in ("body.0.weight", "body.2.weight"):
        layer = stats["layers"][name]
        n, k = layer["numel"], kept_count(layer["numel"], ratio)
        per_step = broadcast_bytes(4 * k, world) + all_reduce_bytes(4 * k, world)
        expected = 2 * all_reduce_bytes(4 * n, world) + compressed_steps * per_step
        assert layer["wire_bytes"] == pytest.approx(expected, rel=1e-9)


def test_replicas_identical_with_approx_delta16_fp16(tmp_path: Path) -> None:
    comp = CLTK(0.01, selection="approx", index_coding="delta16", value_dtype=torch.float16)
    records = fit(_strategy(comp), tmp_path, devices=2, max_epochs=2, model=TinyNet(hidden=512))
    assert_replicas_identical(records)
    stats = records[0]["stats"]
    layer = stats["layers"]["body.2.weight"]  # 512 x 512: large enough for the sampled selection
    n, k = layer["numel"], kept_count(layer["numel"], 0.01)
    per_step = broadcast_bytes(2 * delta16_capacity(n, k), 2) + all_reduce_bytes(2 * k, 2)
    assert layer["wire_bytes"] == pytest.approx(2 * all_reduce_bytes(4 * n, 2) + (stats["steps"] - 2) * per_step)
