"""GradCompStrategy(hierarchy=...): slot ownership, group layout, the hierarchical protocol and its byte split.

The protocol tests drive ``GradCompHook`` under plain ``torch.distributed`` (forked gloo ranks, DDP with small
buckets, no Lightning), every compressor inside the same processes, as ``compressors/test_size_sweep.py`` does;
the Lightning tests fit at W = 4 with nodes of 2 ranks.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from helpers.distributed import run_workers
from helpers.models import (LayerSizesNet, ReadyOrderNet, TinyNet, assert_replicas_identical, assert_resume_matches,
                            fit)
from helpers.wire import compressor_bytes
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import LGreCo, LowPassMemoryFilter
from lightning_gradcomp.comm import Comm, CommStats, all_reduce_bytes, broadcast_bytes
from lightning_gradcomp.compressors import (CLTK, DIANA, QSGD, Cast, Compressor, NoCompression, PowerSGD, RandomK,
                                            SignSGD, TernGrad, TopK)
from lightning_gradcomp.functional import kept_count
from lightning_gradcomp.hierarchy import Hierarchy, HierarchyLayout, assign_owners, check_hierarchy, group_size_for
from lightning_gradcomp.hook import GradCompHook, gradcomp_comm_hook
from lightning_gradcomp.strategy import _check_hierarchy_callbacks

# ---------------------------------------------------------------------------- pure: ownership and layout


def test_owners_are_balanced_and_independent_of_order() -> None:
    numels = {f"layer{i}.weight": n for i, n in enumerate([4096, 2048, 2048, 1000, 129, 127, 31, 7, 3, 1])}
    for size in (1, 2, 3, 4):
        owners = assign_owners(numels, size)
        assert owners == assign_owners(dict(reversed(list(numels.items()))), size)  # names and sizes only
        assert set(owners) == set(numels) and set(owners.values()) <= set(range(size))
        loads = [sum(n for name, n in numels.items() if owners[name] == j) for j in range(size)]
        assert max(loads) - min(loads) <= max(numels.values())  # greedy largest-first bound
    assert assign_owners(numels, 2)["layer0.weight"] == 0 and assign_owners(numels, 2)["layer1.weight"] == 1
    assert assign_owners({"b": 5, "a": 5}, 2) == {"a": 0, "b": 1}  # ties: by name, then lowest local rank


@pytest.mark.parametrize(("world", "size"), [(4, 2), (6, 2), (6, 3), (4, 1), (4, 4)])
def test_every_rank_is_in_one_node_group_and_one_cross_node_group(world: int, size: int) -> None:
    layout = HierarchyLayout(world, size)
    nodes = [layout.node_ranks(n) for n in range(layout.num_nodes)]
    crosses = [layout.cross_ranks(j) for j in range(size)]
    assert sorted(r for g in nodes for r in g) == list(range(world))
    assert sorted(r for g in crosses for r in g) == list(range(world))
    for rank in range(world):
        node, local = layout.node_of(rank), layout.local_rank(rank)
        assert nodes[node][local] == rank and crosses[local][node] == rank
        assert set(nodes[node]) & set(crosses[local]) == {rank}
    assert layout.num_nodes * size == world


@pytest.mark.parametrize("bad", ["nodes", "", 0, -2, 2.0, True, [2]])
def test_bad_hierarchy_values_are_rejected(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"`hierarchy` must be None \(flat\), 'node' .* or a positive int"):
        check_hierarchy(bad)
    with pytest.raises(ValueError, match="`hierarchy`"):
        GradCompStrategy(compressor=TopK(), hierarchy=bad)


def test_group_size_must_divide_the_world_size() -> None:
    assert group_size_for(2, 6, 8) == 2 and group_size_for("node", 8, 4) == 4 and group_size_for(1, 3, 3) == 1
    with pytest.raises(ValueError, match=r"`hierarchy=4` gives node groups of 4 processes, which does not divide "
                                         r"the world size 6; `hierarchy` must be"):
        group_size_for(4, 6, 2)
    with pytest.raises(ValueError, match="`hierarchy='node'`"):
        group_size_for("node", 6, 4)


class _WorldOnly(TopK):
    """A compressor that declares it needs every rank of the world."""

    capabilities = dataclasses.replace(TopK.capabilities, hierarchical=False)


def test_compressors_and_callbacks_that_need_the_world_are_refused() -> None:
    with pytest.raises(ValueError, match=r"_WorldOnly cannot run with `hierarchy=2`"):
        GradCompStrategy(compressor=_WorldOnly(), hierarchy=2)
    GradCompStrategy(compressor=_WorldOnly())  # flat: fine
    with pytest.raises(ValueError, match=r"`layerwise=LGreCo\(...\)` cannot be combined with `hierarchy='node'`"):
        GradCompStrategy(compressor=TopK(), hierarchy="node", layerwise=LGreCo())
    with pytest.raises(ValueError, match="LowPassMemoryFilter.*similarity_every_n_steps=0"):
        _check_hierarchy_callbacks([LowPassMemoryFilter(similarity_every_n_steps=10)])
    with pytest.raises(ValueError, match="^LGreCo cannot be combined"):
        _check_hierarchy_callbacks([LGreCo()])
    _check_hierarchy_callbacks([LowPassMemoryFilter(beta=0.5)])  # no all-rank exchange: fine
    for comp in (TopK(), CLTK(), QSGD(), PowerSGD(), RandomK(), SignSGD(), TernGrad(), DIANA(), Cast(torch.float16)):
        assert GradCompStrategy(compressor=comp, hierarchy=2).hierarchy == 2


def _node_strategy(monkeypatch: pytest.MonkeyPatch, rank: int, node_rank: int, local_rank: int) -> GradCompStrategy:
    monkeypatch.setenv("NODE_RANK", str(node_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    s = GradCompStrategy(compressor=TopK(), hierarchy="node", parallel_devices=[torch.device("cpu")] * 2)
    env = LightningEnvironment()
    env.set_world_size(4)
    env.set_global_rank(rank)
    s.cluster_environment = env
    s.num_nodes = 2
    return s


def test_node_hierarchy_uses_lightnings_processes_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _node_strategy(monkeypatch, 3, 1, 1)._hierarchy_layout() == HierarchyLayout(4, 2)
    with pytest.raises(ValueError, match="needs ranks numbered node_rank \\* devices \\+ local_rank"):
        _node_strategy(monkeypatch, 2, 1, 1)._hierarchy_layout()


# ---------------------------------------------------------------------------- the protocol, without Lightning
SHAPES = {"v1": (1,), "v3": (3,), "v31": (31,), "logreg": (1, 100), "v127": (127,), "m1000": (10, 100),
          "m4097": (17, 241), "m2048": (32, 64)}
START_STEP, STEPS, BATCH = 2, 5, 4

COMPRESSORS: dict[str, Callable[[], Compressor]] = {
    "topk": lambda: TopK(0.1),
    "cltk": lambda: CLTK(0.1),
    "qsgd": lambda: QSGD(bits=4, bucket_size=32),
    "powersgd": lambda: PowerSGD(rank=2),
    "randomk": lambda: RandomK(0.1),
    "signsgd": lambda: SignSGD(bucket_size=7),
    "terngrad": lambda: TernGrad(),
    "diana": lambda: DIANA("linf:16"),
    "fp16": lambda: Cast(torch.float16),
    "none": lambda: NoCompression(),
}




def _groups(rank: int, world: int, size: int) -> Hierarchy:
    numels = {n: p.numel() for n, p in LayerSizesNet(SHAPES).named_parameters()}
    return Hierarchy.create(HierarchyLayout(world, size), rank, numels, CommStats())


def _hook(model: nn.Module, groups: Hierarchy, comp: Compressor, **kwargs: Any) -> GradCompHook:
    """A hook over ``groups``' process groups with fresh stats (the groups are made once per worker)."""
    stats = CommStats()
    hierarchy = Hierarchy(groups.layout, groups.rank, Comm(groups.intra.group, stats, intra=True),
                          Comm(groups.cross.group, stats), groups.owners)
    strategy = GradCompStrategy(compressor=comp, min_numel=1, compress_1d=True, start_step=START_STEP, **kwargs)
    names = {id(p): n for n, p in model.named_parameters()}
    return strategy.make_hook(Comm(None, stats), names, torch.device("cpu"), hierarchy)


class _Recording:
    """Records each bucket's step, plan, per-layer parameters and the bytes it counted (intra, inter, dense)."""

    def __init__(self, hook: GradCompHook) -> None:
        self.hook, self.calls, self._reduce = hook, [], hook._reduce
        hook._reduce = self  # type: ignore[method-assign]

    def __call__(self, plan: Any, buf: torch.Tensor, step: int, compressing: bool, *args: Any) -> Any:
        stats = self.hook.stats
        before = (stats.wire_bytes, stats.intra_bytes, stats.dense_bytes)
        out = self._reduce(plan, buf, step, compressing, *args)
        self.calls.append({"step": step, "plan": plan, "compressing": compressing,
                           "params": {s.name: self.hook.param_of(s.name) for s in plan.compressed},
                           "wire": stats.wire_bytes - before[0], "intra": stats.intra_bytes - before[1],
                           "dense": stats.dense_bytes - before[2]})
        return out


def _train(rank: int, groups: Hierarchy, comp: Compressor, nan_step: Optional[int] = None,
           loss_scale: float = 1.0, **kwargs: Any) -> dict[str, Any]:
    model = LayerSizesNet(SHAPES)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.004)  # ~1000 floats per bucket: several buckets
    hook = _hook(model, groups, comp, **kwargs)
    if loss_scale != 1.0:
        hook.loss_scale = lambda: torch.tensor(loss_scale)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hook.attach_optimizer(optimizer)
    recording = _Recording(hook)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    gen = torch.Generator().manual_seed(rank)
    total = sum(p.numel() for p in model.layers.values())
    params, grads = [], []
    for step in range(STEPS):
        image, features = torch.randn(BATCH, 3, 5, 5, generator=gen), torch.randn(BATCH, total, generator=gen)
        loss = (ddp(image, features).tanh() - torch.randn(BATCH, generator=gen).sign()).square().mean()
        if step == nan_step and rank == 1:
            handle = model.layers["m4097"].register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan")))
        optimizer.zero_grad()
        (loss * loss_scale).backward()
        if step == nan_step and rank == 1:
            handle.remove()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        for p in model.parameters():  # what the GradScaler does before stepping (exact: a power of two)
            p.grad.div_(loss_scale)
        optimizer.step()
        params.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    hook.close()
    return {"params": params, "grads": grads, "calls": recording.calls, "step": hook.step,
            "stats": hook.stats.state_dict(), "memory": hook.memory.state_dict(),
            "local_rank": groups.local_rank, "owners": groups.owners}


def _sweep(rank: int, world: int, size: int, names: list[str]) -> dict[str, Any]:
    groups = _groups(rank, world, size)
    out = {}
    for name in names:
        try:
            out[name] = _train(rank, groups, COMPRESSORS[name]())
        except Exception as err:  # name the variant in the traceback run_workers reports
            raise RuntimeError(f"{name} failed at W={world}, nodes of {size}, on rank {rank}") from err
    return out


def node_exchange_bytes(numel: int, owned: int, size: int) -> float:
    """Intra-node bytes of one fp32 bucket: reduce-scatter to the owners (plus one flag per receiver), then the
    owner sends its ``owned`` averaged elements and the flag to the other ``size - 1``."""
    return 4.0 * (numel - owned + size - 1) + 4.0 * (size - 1) * (owned + 1)


def _expected(comp: Compressor, call: dict[str, Any], owned: set[str], world: int, size: int) -> tuple[float, float]:
    """(inter-node, intra-node) bytes of one bucket: node sum + share in the node, owned slots across nodes."""
    plan, nodes = call["plan"], world // size
    if nodes == 1:  # one node: nothing crosses nodes, one dense all-reduce in the node
        return 0.0, all_reduce_bytes(4 * plan.numel, size)
    mine = [s for s in plan.slots if s.name in owned]
    intra = node_exchange_bytes(plan.numel, sum(s.numel for s in mine), size)
    if not call["compressing"]:
        return (all_reduce_bytes(4 * sum(s.numel for s in mine), nodes) if mine else 0.0), intra
    dense = [s for s in mine if not s.compressed]
    comp_slots = [s for s in mine if s.compressed]
    inter = all_reduce_bytes(4 * (sum(s.numel for s in dense) + 1), nodes)
    if comp_slots:
        inter += compressor_bytes(comp, comp_slots, [call["params"][s.name] for s in comp_slots], nodes)
    return inter, intra


def _problems(name: str, world: int, size: int, results: list[dict[str, Any]]) -> list[str]:
    comp = COMPRESSORS[name]()
    problems = []
    first = torch.cat([p.detach().reshape(-1) for p in LayerSizesNet(SHAPES).parameters()])
    for rank, res in enumerate(results):
        if res["step"] != STEPS:
            problems.append(f"rank {rank}: hook.step = {res['step']}")
        for step, (a, b) in enumerate(zip(results[0]["params"], res["params"])):
            if not torch.equal(a, b):
                problems.append(f"rank {rank} differs from rank 0 after step {step}")
        if not torch.isfinite(res["params"][-1]).all() or torch.equal(res["params"][-1], first):
            problems.append(f"rank {rank}: non-finite or never moved")
        owned = {n for n, j in res["owners"].items() if j == res["local_rank"]}
        if comp.uses_error_feedback and set(res["memory"]) - owned:
            problems.append(f"rank {rank} keeps memories of layers it does not own: {set(res['memory']) - owned}")
        for call in res["calls"]:
            inter, intra = _expected(comp, call, owned, world, size)
            dense = all_reduce_bytes(4 * call["plan"].numel, world)
            got = (call["wire"], call["intra"], call["dense"])
            if got != pytest.approx((inter, intra, dense), rel=1e-12, abs=1e-9):
                problems.append(f"rank {rank} step {call['step']} bucket {call['plan'].index}: (inter, intra, dense) "
                                f"{got}, formula {(inter, intra, dense)}")
    compressed = any(c["compressing"] for c in results[0]["calls"])
    if compressed != (not comp.dense and world > size):
        problems.append(f"compressed: {compressed} (one node, or a dense compressor: never)")
    if comp.uses_error_feedback and world > size and not all(r["memory"] for r in results[:size]):
        problems.append("a local rank keeps no memory: it owns no compressed layer")
    return [f"{name} W={world} nodes of {size}: {p}" for p in problems]


@pytest.mark.parametrize(("world", "size"), [(4, 2), (6, 2), (6, 3), (4, 1), (4, 4)])
def test_replicas_identical_and_bytes_split_at_every_step(world: int, size: int) -> None:
    """Sizes 1 and W are the edge cases: every rank its own node (flat, through the hierarchy), one node."""
    names = list(COMPRESSORS)
    results = run_workers(_sweep, world, size, names, timeout=120)
    problems = [p for name in names for p in _problems(name, world, size, [r[name] for r in results])]
    assert not problems, "\n".join(problems)


def _exact(rank: int, world: int, size: int) -> list[torch.Tensor]:
    """Gradients that are multiples of W (so every order of summation and division is exact)."""
    groups = _groups(rank, world, size)
    out = []
    for comp in (NoCompression(), TopK(1.0), CLTK(1.0)):
        model = LayerSizesNet(SHAPES)
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.004)
        hook = _hook(model, groups, comp)
        ddp.register_comm_hook(hook, gradcomp_comm_hook)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(START_STEP + 1):  # dense steps, then one compressed step
            model.zero_grad()
            weights = {n: torch.randint(-50, 50, p.shape, generator=gen).float() * world
                       for n, p in model.named_parameters()}
            ddp(torch.zeros(1, 3, 5, 5), torch.zeros(1, sum(p.numel() for p in model.layers.values())))
            sum((p * weights[n]).sum() for n, p in model.named_parameters()).backward()  # gradient = weights
            out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            out.append(torch.cat([weights[n].reshape(-1) for n, _ in model.named_parameters()]))
        hook.close()
    return out


def test_the_average_is_the_global_mean() -> None:
    """Dense steps and (ratio 1) compressed steps give exactly the mean over all W ranks."""
    for world, size in ((4, 2), (6, 3)):
        results = run_workers(_exact, world, size, timeout=60)
        for i in range(0, len(results[0]), 2):
            mean = sum(r[i + 1] for r in results) / world
            for rank, r in enumerate(results):
                assert torch.equal(r[i], mean), f"W={world}: rank {rank}, record {i // 2}"


def _span(name: str) -> slice:
    """Where parameter ``name`` lies in the concatenated parameters of :class:`~helpers.models.LayerSizesNet`."""
    offset = 0
    for n, p in LayerSizesNet(SHAPES).named_parameters():
        if n == name:
            return slice(offset, offset + p.numel())
        offset += p.numel()
    raise KeyError(name)


def _nonfinite_and_scale(rank: int, world: int, size: int) -> dict[str, Any]:
    groups = _groups(rank, world, size)
    return {"zero": _train(rank, groups, CLTK(0.1), nan_step=3, nonfinite="zero"),
            "dense": _train(rank, groups, CLTK(0.1), nan_step=3, nonfinite="dense"),
            "plain": _train(rank, groups, CLTK(0.1)),
            "scaled": _train(rank, groups, CLTK(0.1), loss_scale=2.0 ** 10)}


def test_nonfinite_gradients_and_loss_scale() -> None:
    results = run_workers(_nonfinite_and_scale, 4, 2, timeout=60)
    for rank, res in enumerate(results):
        for policy in ("zero", "dense"):
            run = res[policy]
            assert run["stats"]["nonfinite_steps"] >= 1, (rank, policy)
            assert all(bool(torch.isfinite(m).all()) for m in run["memory"].values()), (rank, policy)
        zero = res["zero"]
        poisoned = zero["grads"][3][_span("layers.m4097")]
        assert torch.equal(poisoned, torch.zeros_like(poisoned))  # its bucket contributes no gradient
        assert torch.equal(zero["params"][-1], results[0]["zero"]["params"][-1])
        assert torch.isfinite(zero["params"][-1]).all()
        assert not torch.isfinite(res["dense"]["params"][-1]).all()  # DDP semantics: the NaN goes through
        plain, scaled = res["plain"], res["scaled"]
        for a, b in zip(plain["grads"], scaled["grads"]):  # state in unscaled units: scaling is exact
            assert torch.equal(a * 2.0 ** 10, b)
        assert plain["memory"].keys() == scaled["memory"].keys()
        assert all(torch.equal(plain["memory"][k], scaled["memory"][k]) for k in plain["memory"])


# ---------------------------------------------------------------------------- Lightning
def strategy(compressor: Compressor, **kwargs: Any) -> GradCompStrategy:
    return GradCompStrategy(compressor=compressor, start_method="fork", hierarchy=2, **kwargs)


def test_lightning_replicas_and_bytes_at_w4(tmp_path: Path) -> None:
    records = fit(strategy(CLTK(0.05)), tmp_path, devices=4, max_epochs=1, model=TinyNet(samples=256))  # 8 steps
    assert_replicas_identical(records)
    net = TinyNet()
    numels = {n: p.numel() for n, p in net.named_parameters()}
    owners = assign_owners(numels, 2)
    total = sum(numels.values())
    for rank, rec in enumerate(records):
        stats, steps = rec["stats"], rec["stats"]["steps"]
        mine = [n for n in numels if owners[n] == rank % 2]
        comp = [n for n in mine if net.get_parameter(n).dim() > 1 and numels[n] >= 1024]
        dense = sum(numels[n] for n in mine if n not in comp)
        k = sum(kept_count(numels[n], 0.05) for n in comp)
        cltk = broadcast_bytes(4 * k, 2) + all_reduce_bytes(4 * k, 2) if comp else 0.0
        inter = 2 * all_reduce_bytes(4 * sum(numels[n] for n in mine), 2) + \
            (steps - 2) * (all_reduce_bytes(4 * (dense + 1), 2) + cltk)
        assert stats["wire_bytes"] == pytest.approx(inter)
        owned = sum(numels[n] for n in mine)
        assert stats["intra_bytes"] == pytest.approx(steps * node_exchange_bytes(total, owned, 2))
        assert stats["dense_bytes"] == pytest.approx(steps * all_reduce_bytes(4 * total, 4))
        assert set(rec["memory"]) == set(comp)
    assert {rank % 2 for rank in range(4)} == set(owners.values())  # both local ranks compress something


RESUMABLE = {  # name: (compressor, ReadyOrderNet kwargs); hidden=10 for PowerSGD as in test_strategy.py
    "cltk": (lambda: CLTK(0.05), {}),
    "powersgd": (lambda: PowerSGD(rank=2), {"hidden": 10, "in_features": 128}),
}


@pytest.mark.parametrize("name", sorted(RESUMABLE))
def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path, name: str) -> None:
    make, net = RESUMABLE[name]

    def run(out: Path, epochs: int, **options: Any) -> list[dict[str, Any]]:
        model = ReadyOrderNet(samples=32 * 4, **net)  # 4 steps per epoch
        return fit(strategy(make(), beta=0.5), out, devices=4, model=model, max_epochs=epochs, **options)

    straight = run(tmp_path / "straight", 3)
    ckpt_dir = tmp_path / "ckpt"
    run(tmp_path / "first", 1, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], enable_checkpointing=True)
    resumed = run(tmp_path / "resumed", 3, ckpt_path=str(ckpt_dir / "last.ckpt"))
    assert_resume_matches(straight, resumed)
    assert all(resumed[rank]["memory"] for rank in (0, 2))  # local rank 0 owns a compressed layer


def test_group_size_not_dividing_the_world_fails_on_every_rank(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="`hierarchy=3` gives node groups of 3 processes, which does not divide"):
        fit(GradCompStrategy(compressor=TopK(0.05), start_method="fork", hierarchy=3), tmp_path, devices=2,
            max_steps=1)


def test_state_saved_under_another_layout_restarts_per_rank_state() -> None:
    class _Layout:
        def describe(self) -> list[int]:
            return [2, 2]

    hook = GradCompHook(TopK(), SimpleNamespace(stats=CommStats()), {}, hierarchy=_Layout())  # type: ignore[arg-type]
    flat = {"step": 7, "hierarchy": None, "memory": {"w": torch.ones(3)}, "layer_params": {"w": 0.1}}
    with pytest.warns(UserWarning, match=r"saved with hierarchy layout None .* restored into \[2, 2\]"):
        hook.load_state_dict(flat)
    assert hook.step == 7 and hook.layer_params == {"w": 0.1} and not hook.memory.memories
    hook.load_state_dict({**flat, "hierarchy": [2, 2]})  # same layout: the memories are this rank's
    assert torch.equal(hook.memory.memories["w"], torch.ones(3))
