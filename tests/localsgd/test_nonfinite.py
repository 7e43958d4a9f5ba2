"""LocalSGDStrategy's sync engine contains a rank's NaN/Inf: no memory, momentum, compressor state or other rank
sees it, and the sync equals one where that rank made no progress.

The engine runs under plain ``torch.distributed`` (forked gloo ranks, no Lightning), driven as the strategy drives it
(see ``test_engine_sweep.py``). Right before the second sync the last rank's local model gets a NaN, +Inf or -Inf in
one parameter entry and in the floating buffer (a diverged rank: what the strategy's inner-step guard cannot catch,
such as an update that overflows). The same run with that rank's parameters and buffer set to the last synchronized
values instead (a rank that made no progress: its pseudo-gradients are exact zeros) is the reference: the poisoned run
must end bit for bit where the reference ends, on every rank, with every state tensor finite and the event counted
once, on that rank only. With ``overlap`` the poisoned model takes one more local step before the exchange is applied:
its NaN gradient is zeroed by the strategy's inner-step guard (mirrored here), counted too, and that run is checked for
identical, finite replicas and the two events (it cannot equal the reference, whose step had a real gradient).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from helpers.distributed import run_workers
from helpers.models import LayerSizesNet
from helpers.trees import tensors
from lightning_gradcomp import LocalSGDStrategy
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors import CLTK, QSGD, NoCompression, PowerSGD, SignSGD, TopK
from lightning_gradcomp.functional.finite import zero_if_nonfinite
from lightning_gradcomp.localsgd import OuterSync

SHAPES = {"v3": (3,), "m17": (1, 17), "m1025": (25, 41), "m4097": (17, 241)}
COMPRESSORS = {
    "none": NoCompression,
    "cltk": lambda: CLTK(0.1),
    "topk": lambda: TopK(0.1),
    "qsgd": lambda: QSGD(bits=4, bucket_size=128),
    "signsgd": lambda: SignSGD(bucket_size=128),
    "powersgd": lambda: PowerSGD(rank=2),
}
CASES = [  # (compressor, outer optimizer, fragments, value, overlap)
    ("none", "average", 1, "nan", 0), ("cltk", "nesterov", 1, "inf", 0), ("topk", "nesterov", 2, "-inf", 0),
    ("qsgd", "average", 1, "nan", 0), ("signsgd", "nesterov", 1, "-inf", 0), ("powersgd", "nesterov", 2, "inf", 0),
    ("cltk", "nesterov", 2, "nan", 1),
]
LOCAL_STEPS, STEPS, POISON_SYNC = 2, 8, 1  # syncs at steps 2, 4, 6, 8 (one fragment); the second is poisoned


class _Net(LayerSizesNet):
    def __init__(self) -> None:
        super().__init__(SHAPES)
        self.register_buffer("stat", torch.zeros(5))


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def _train(rank: int, world: int, case: tuple, poison: bool, group: dist.ProcessGroup) -> dict[str, Any]:
    name, outer, fragments, value, overlap = case
    strategy = LocalSGDStrategy(local_steps=LOCAL_STEPS * fragments, outer=outer, compressor=COMPRESSORS[name](),
                                fragments=fragments, overlap=overlap, min_numel=1, compress_1d=True)
    model = _Net()
    params = [(n, p) for n, p in model.named_parameters()]
    stats = CommStats()
    engine = OuterSync(strategy.compressor.clone(), Comm(None, stats), params, [("stat", model.stat)],
                       fragments=fragments, policy=strategy.policy, outer=outer, seed=strategy.seed, overlap=overlap,
                       async_comm=Comm(group, stats) if overlap else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    total = sum(p.numel() for p in model.layers.values())
    finite_after: list[bool] = []
    for step in range(1, STEPS + 1):
        features = torch.randn(4, total, generator=gen)
        loss = (model(torch.randn(4, 3, 5, 5, generator=gen), features).tanh() - 0.5).square().mean()
        optimizer.zero_grad()
        loss.backward()
        engine.note_nonfinite(zero_if_nonfinite([p.grad for p in model.parameters()]))  # the strategy's guard
        optimizer.step()
        with torch.no_grad():
            model.stat.mul_(0.9).add_(features[:, :5].mean(dim=0), alpha=0.1)
            if step == LOCAL_STEPS * (POISON_SYNC + 1) and rank == world - 1:
                if poison:  # one entry of the largest matrix, and the buffer
                    model.layers["m4097"].view(-1)[100] = float(value)
                    model.stat[2] = float(value)
                else:  # no progress since the fragment's last sync (the buffer goes with the last fragment)
                    synced = {s.name for s in engine.fragments[engine.cursor].slots} | {"stat"}
                    engine.write({n: t for n, t in engine.global_tensors().items() if n in synced})
        engine.count_step()
        if engine.due():
            engine.finish()
        if engine.local_steps % LOCAL_STEPS == 0:
            engine.sync_next()
        if not engine.in_flight():  # after every step but those between an exchange's issue and its application
            finite_after.append(bool(torch.isfinite(_flat(model.parameters())).all()))
    engine.finish()
    if fragments > 1:  # fragment 0 has two local steps since its last sync: the strategy's end-of-fit sync
        engine.sync(list(range(fragments)))
        finite_after.append(bool(torch.isfinite(_flat(model.parameters())).all()))
    state = engine.rank_state()
    return {"final": _flat([*model.parameters(), model.stat]), "finite_after": finite_after,
            "state": [t for part in ("memory", "compressor") for t in tensors(state[part])],
            "nonfinite": engine.stats.nonfinite_steps, "momentum": list(engine.momentum.values())}


def _both(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group(backend="gloo")  # the overlapped exchanges' own group, as the strategy makes
    return {case: {poison: _train(rank, world, case, poison, group) for poison in (True, False)} for case in CASES}


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_a_diverged_rank_contributes_no_progress_and_poisons_nothing(world: int) -> None:
    results = run_workers(_both, world, timeout=120)
    for case in CASES:
        for rank, res in enumerate(results):
            poisoned, reference = res[case][True], res[case][False]
            where = f"{case} W={world} rank {rank}"
            if not case[4]:  # with overlap the poisoned model takes a local step (its gradient zeroed) meanwhile
                assert torch.equal(poisoned["final"], reference["final"]), f"{where}: not the no-progress sync"
            assert torch.equal(poisoned["final"], results[0][case][True]["final"]), f"{where}: replicas differ"
            assert all(poisoned["finite_after"]), f"{where}: non-finite parameters after a sync"
            assert all(bool(t.isfinite().all()) for t in poisoned["state"] + poisoned["momentum"]), where
            events = (2 if case[4] else 1) if rank == world - 1 else 0  # overlap: that zeroed step too
            assert poisoned["nonfinite"] == events and reference["nonfinite"] == 0, where
        if COMPRESSORS[case[0]]().uses_error_feedback:  # the check covers state that exists
            assert results[-1][case][True]["state"], f"{case}: no memory or compressor state to check"
        if case[1] == "nesterov":
            assert results[-1][case][True]["momentum"], f"{case}: no outer momentum to check"
