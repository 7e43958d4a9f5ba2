"""LocalSGDStrategy's sync engine at W = 2..5 on layers of awkward sizes: replicas and bytes after every sync.

The sweep drives :class:`~lightning_gradcomp.localsgd.OuterSync` under plain ``torch.distributed`` (forked gloo
ranks, no Lightning), built and called as the strategy does (``configure_ddp`` builds it; ``optimizer_step``
calls ``count_step``, ``finish`` when an exchange is due and ``sync_next`` every ``local_steps / fragments``
steps; ``on_train_end`` applies what is in flight and syncs what is pending). One process group per W, every
configuration inside the same processes, as ``compressors/test_size_sweep.py`` and ``test_hierarchy.py`` do.

Checked right after every sync (every application of an exchange): the synced parameters are bitwise identical
on every rank and equal to the global model ``theta`` (cast to the parameter dtype), and so are the floating
buffers when the last fragment was synced; the bytes of every exchange are non-zero, identical on every rank
(every collective the engine and these compressors issue has the same per-rank count on all ranks: ring
all-reduce, all-gather, padded all-to-all chunks, broadcast counted as the mean over ranks) and equal to the
formula. Right after a sync of every fragment nothing is pending (bf16 and fp16 parameters hold ``theta``
rounded to their dtype). Before the first sync the ranks differ (else the test would prove nothing); dense
pseudo-gradients give the reference outer step (mean, then ``"average"`` or Nesterov) within float32 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers.distributed import run_workers
from helpers.models import LayerSizesNet
from helpers.wire import compressor_bytes
from lightning_gradcomp import LocalSGDStrategy, compressors
from lightning_gradcomp.comm import Comm, CommStats, all_reduce_bytes
from lightning_gradcomp.compressors import (CLTK, DIANA, QSGD, Cast, Compressor, NoCompression, PowerSGD,
                                            QuantizedCompressor, RandomK, SharedIndexCompressor, SignSGD,
                                            SparseCompressor, TernGrad, TopK)
from lightning_gradcomp.localsgd import OuterSync
from lightning_gradcomp.plan import BucketPlan

SHAPES = {  # 0, 1, 3, 17, 1000, 1025 and 4097 elements, each as a vector and as a matrix; plus the Conv2d(3, 5, 3)
    "v0": (0,), "m0": (0, 5), "v1": (1,), "m1": (1, 1), "v3": (3,), "m3": (3, 1), "v17": (17,), "m17": (1, 17),
    "v1000": (1000,), "m1000": (8, 125), "v1025": (1025,), "m1025": (25, 41), "v4097": (4097,), "m4097": (17, 241),
}
BUFFER = 7  # elements of the floating buffer (a running statistic each rank updates on its own)
BATCH = 4

COMPRESSORS: dict[str, Callable[[], Compressor]] = {
    "none": NoCompression,
    "cltk": lambda: CLTK(0.1),
    "topk": lambda: TopK(0.1),
    "randomk": lambda: RandomK(0.1),
    "qsgd": lambda: QSGD(bits=4, bucket_size=128),
    "signsgd": lambda: SignSGD(bucket_size=128),
    "terngrad": lambda: TernGrad(bucket_size=128),
    "powersgd": lambda: PowerSGD(rank=2),
    "fp16": lambda: Cast(torch.float16),
}
POLICIES = {"default": {}, "flat": {"min_numel": 1, "compress_1d": True}}  # flat: every tensor is compressed
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


@dataclass(frozen=True)
class Case:
    """One configuration of the strategy: compressor, outer optimizer, slot policy, parameter dtype, streaming."""

    compressor: str
    outer: str = "nesterov"
    policy: str = "default"
    dtype: str = "fp32"
    local_steps: int = 2
    fragments: int = 1
    overlap: int = 0
    steps: int = 6

    @property
    def name(self) -> str:
        name = f"{self.compressor}/{self.outer}/{self.policy}/{self.dtype}/H={self.local_steps}"
        name += f"/F={self.fragments}" if self.fragments > 1 else ""
        return name + (f"/tau={self.overlap}" if self.overlap else "")

    def strategy(self) -> LocalSGDStrategy:
        """The strategy (its validation and defaults) whose engine this case builds."""
        return LocalSGDStrategy(local_steps=self.local_steps, outer=self.outer,  # type: ignore[arg-type]
                                compressor=COMPRESSORS[self.compressor](), fragments=self.fragments,
                                overlap=self.overlap, **POLICIES[self.policy])


def _cases() -> dict[str, Case]:
    cases = [Case(c, outer, policy) for c in COMPRESSORS for outer in ("average", "nesterov")
             for policy in POLICIES if not (c == "none" and policy == "flat")]  # dense: every tensor is dense
    cases += [Case(c, policy="flat", dtype="bf16") for c in ("none", "cltk", "qsgd", "signsgd", "powersgd")]
    cases += [Case(c, policy="flat", dtype="fp16") for c in ("none", "cltk")]
    cases += [Case(c, policy="flat", dtype="fp64") for c in ("cltk", "signsgd", "powersgd")]
    # streaming: a fragment every 2 steps, each synced every 4; 8 steps, then the final sync of fragment 0
    cases += [Case(c, outer, "flat", local_steps=4, fragments=2, steps=8)
              for c, outer in (("none", "average"), ("cltk", "nesterov"), ("qsgd", "average"),
                               ("signsgd", "nesterov"), ("powersgd", "nesterov"), ("randomk", "average"))]
    # overlap: each exchange runs in a thread on its own process group, applied one step after it was issued
    cases += [Case(c, "nesterov", "flat", local_steps=4, fragments=2, overlap=1, steps=8)
              for c in ("cltk", "signsgd", "powersgd")]
    return {case.name: case for case in cases}


CASES = _cases()


class _Net(LayerSizesNet):
    """:class:`~helpers.models.LayerSizesNet` over :data:`SHAPES` plus a floating buffer (averaged at syncs)."""

    def __init__(self) -> None:
        super().__init__(SHAPES)
        self.register_buffer("stat", torch.zeros(BUFFER))


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def _build(model: nn.Module, case: Case, async_group: Optional[dist.ProcessGroup]) -> OuterSync:
    """The engine as ``LocalSGDStrategy.configure_ddp`` builds it."""
    strategy = case.strategy()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    persistent = set(model.state_dict())
    buffers = [(n, b) for n, b in model.named_buffers() if b.is_floating_point() and n in persistent]
    compressor = strategy.compressor.clone()
    compressor.prepare()
    stats = CommStats()
    async_comm = Comm(async_group, stats) if strategy.overlap else None
    return OuterSync(compressor, Comm(None, stats), params, buffers, fragments=strategy.fragments,
                     policy=strategy.policy, outer=strategy.outer, outer_lr=strategy.outer_lr,
                     outer_momentum=strategy.outer_momentum, seed=strategy.seed, beta=strategy.beta,
                     overlap=strategy.overlap, async_comm=async_comm)


@dataclass
class _Recorder:
    """Wraps the engine's ``_prepare`` (snapshot), ``_run`` (collectives, possibly on the exchange thread) and
    ``_apply`` (outer step and write-back) to record what each exchange did."""

    engine: OuterSync
    model: nn.Module
    keep_local: bool
    prepared: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    applied: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        engine = self.engine
        prepare, run, apply = engine._prepare, engine._run, engine._apply

        def _prepare(indices: list[int], apply_at: int) -> Any:
            keep = self.keep_local or not self.prepared
            self.prepared.append({"indices": list(indices), "local": _flat(self.model.parameters()) if keep else None})
            return prepare(indices, apply_at)

        def _run(job: Any, comm: Comm) -> None:
            before = (comm.stats.wire_bytes, comm.stats.collectives)
            run(job, comm)
            self.runs.append({"step": job.step, "indices": list(job.indices),
                              "wire": comm.stats.wire_bytes - before[0],
                              "collectives": comm.stats.collectives - before[1]})

        def _apply(job: Any) -> None:
            apply(job)
            names = [s.name for i in job.indices for s in engine.fragments[i].slots]
            params, theta = engine.params, engine.theta
            off_theta = [n for n in names if not torch.equal(params[n], theta[n].to(params[n].dtype))]
            whole = len(job.indices) == len(engine.fragments)
            self.applied.append({"step": job.step, "indices": list(job.indices),
                                 "params": _flat(self.model.parameters()), "buffers": _flat(self.model.buffers()),
                                 "off_theta": off_theta, "pending": engine.pending() if whole else None})

        engine._prepare, engine._run, engine._apply = _prepare, _run, _apply  # type: ignore[method-assign]


def _train(rank: int, case: Case, async_group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
    model = _Net().to(DTYPES[case.dtype])
    init = _flat(model.parameters())
    engine = _build(model, case, async_group)
    recorder = _Recorder(engine, model, keep_local=case.compressor == "none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    total = sum(p.numel() for p in model.layers.values())
    dtype = DTYPES[case.dtype]
    period = case.local_steps // case.fragments
    for _ in range(case.steps):  # LocalSGDStrategy.optimizer_step
        image = torch.randn(BATCH, 3, 5, 5, generator=gen).to(dtype)
        features = torch.randn(BATCH, total, generator=gen).to(dtype)
        loss = (model(image, features).tanh() - torch.randn(BATCH, generator=gen).sign().to(dtype)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            model.stat.mul_(0.9).add_(features[:, :BUFFER].mean(dim=0), alpha=0.1)
        engine.count_step()
        if engine.due():
            engine.finish()
        if engine.local_steps % period == 0:
            engine.sync_next()
    engine.finish()  # LocalSGDStrategy.on_train_end (sync_at_end=True)
    final_sync = engine.pending()
    if final_sync:
        engine.sync(list(range(len(engine.fragments))))
    stats = engine.stats.state_dict()
    del stats["layers"]
    return {"init": init, "plans": engine.plans(), "prepared": recorder.prepared, "runs": recorder.runs,
            "applied": recorder.applied, "final_sync": final_sync, "pending_at_end": engine.pending(),
            "final": _flat(model.parameters()), "stats": stats, "syncs": engine.step}


def _sweep(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    # the dedicated group of the overlapped exchanges (LocalSGDStrategy.configure_ddp makes one per fit)
    async_group = dist.new_group(backend="gloo") if any(CASES[n].overlap for n in names) else None
    out = {}
    for name in names:
        try:
            out[name] = _train(rank, CASES[name], async_group)
        except Exception as err:  # name the configuration in the traceback run_workers reports
            raise RuntimeError(f"{name} failed at W={world} on rank {rank}") from err
    return out


# ---------------------------------------------------------------------------- checks (in the parent)
def _offsets() -> dict[str, slice]:
    out, offset = {}, 0
    for name, p in _Net().named_parameters():
        out[name] = slice(offset, offset + p.numel())
        offset += p.numel()
    return out


OFFSETS = _offsets()


def _expected_bytes(comp: Compressor, plans: list[BucketPlan], indices: list[int], world: int) -> float:
    """One exchange: dense slots (and, with the last fragment, the buffer) in one fp32 all-reduce, then the
    compressed slots in one batched ``compressor.reduce``."""
    dense = [s for i in indices for s in plans[i].dense]
    comp_slots = [s for i in indices for s in plans[i].compressed]
    dense_numel = sum(s.numel for s in dense) + (BUFFER if len(plans) - 1 in indices else 0)
    out = all_reduce_bytes(4 * dense_numel, world) if dense_numel else 0.0
    if comp_slots:
        out += compressor_bytes(comp, comp_slots, [comp.default_param] * len(comp_slots), world)
    return out


def _reference_outer(case: Case, results: list[dict[str, Any]], world: int) -> list[str]:
    """Dense pseudo-gradients, one fragment: theta follows mean-then-outer-step (float64 reference)."""
    problems = []
    theta = results[0]["init"].double()
    momentum: Optional[torch.Tensor] = None
    for k, applied in enumerate(results[0]["applied"]):
        delta = sum(theta - r["prepared"][k]["local"].double() for r in results) / world
        if case.outer == "average":
            theta = theta - delta
        else:
            momentum = delta if momentum is None else 0.9 * momentum + delta
            theta = theta - 0.7 * (delta + 0.9 * momentum)
        err = float((applied["params"].double() - theta).abs().max())
        if err > 1e-5:
            problems.append(f"sync {k}: theta is {err:.2e} away from the reference outer step")
        theta = applied["params"].double()  # the next reference starts from the engine's rounded theta
    return problems


def _problems(case: Case, world: int, results: list[dict[str, Any]]) -> list[str]:
    comp = COMPRESSORS[case.compressor]()
    plans: list[BucketPlan] = results[0]["plans"]
    last = len(plans) - 1
    problems = []
    first = results[0]
    per_step = sum(all_reduce_bytes(p.numel() * p.element_size(), world)  # what per-step DDP sends
                   for p in _Net().to(DTYPES[case.dtype]).parameters())
    for rank, res in enumerate(results):
        if [(a["step"], a["indices"]) for a in res["applied"]] != [(a["step"], a["indices"]) for a in first["applied"]]:
            problems.append(f"rank {rank} applied other exchanges than rank 0")
            continue
        if not torch.equal(res["init"], first["init"]):
            problems.append(f"rank {rank} started from another model")
        for k, (mine, ref) in enumerate(zip(res["applied"], first["applied"])):
            names = [s.name for i in mine["indices"] for s in plans[i].slots]
            differ = [n for n in names if not torch.equal(mine["params"][OFFSETS[n]], ref["params"][OFFSETS[n]])]
            if differ:
                problems.append(f"rank {rank} differs from rank 0 right after sync {k} (fragments {mine['indices']}) "
                                f"in {differ}")
            if mine["off_theta"]:
                problems.append(f"rank {rank} sync {k}: parameters {mine['off_theta']} are not theta")
            if last in mine["indices"] and not torch.equal(mine["buffers"], ref["buffers"]):
                problems.append(f"rank {rank} sync {k}: the buffer differs from rank 0")
            if mine["pending"]:
                problems.append(f"rank {rank} sync {k}: the engine reports local progress right after a full sync")
        if not torch.equal(res["final"], first["final"]):
            problems.append(f"rank {rank}: the final model differs from rank 0")
        if not torch.isfinite(res["final"].float()).all() or torch.equal(res["final"], res["init"]):
            problems.append(f"rank {rank}: the final model is non-finite or never moved")
        if res["pending_at_end"]:
            problems.append(f"rank {rank}: local progress is pending after the final sync")
        if res["final_sync"] != first["final_sync"]:
            problems.append(f"rank {rank}: the ranks disagree on the final sync")
        # bytes: every exchange, identical on every rank, equal to the formula
        keys = ("step", "indices", "wire", "collectives")
        mismatched = [(mine, ref) for mine, ref in zip(res["runs"], first["runs"])
                      if [mine[k] for k in keys] != [ref[k] for k in keys]]
        if mismatched or len(res["runs"]) != len(first["runs"]):
            problems.append(f"rank {rank}: exchanges or their bytes differ from rank 0's, first {mismatched[:1]}")
        for run in res["runs"]:
            want = _expected_bytes(comp, plans, run["indices"], world)
            if not run["wire"] > 0 or run["wire"] != pytest.approx(want, rel=1e-12):
                problems.append(f"rank {rank} sync {run['step']} fragments {run['indices']}: {run['wire']} bytes, "
                                f"formula {want}")
        stats, syncs = res["stats"], res["syncs"]
        if stats["steps"] != case.steps or stats["dense_bytes"] != pytest.approx(case.steps * per_step, rel=1e-12):
            problems.append(f"rank {rank}: steps {stats['steps']}, dense bytes {stats['dense_bytes']} "
                            f"(expected {case.steps}, {case.steps * per_step})")
        if stats["compressed_steps"] != (0 if comp.dense else syncs) or len(res["runs"]) != syncs:
            problems.append(f"rank {rank}: {syncs} syncs, {len(res['runs'])} exchanges, "
                            f"{stats['compressed_steps']} compressed")
        if stats["wire_bytes"] != pytest.approx(sum(r["wire"] for r in res["runs"]), rel=1e-12):
            problems.append(f"rank {rank}: wire bytes {stats['wire_bytes']} are not the sum over the exchanges")
    # the sweep proves something only if the ranks had drifted apart before their first sync ...
    if all(torch.equal(r["prepared"][0]["local"], first["prepared"][0]["local"]) for r in results[1:]):
        problems.append("the ranks were identical before the first sync")
    # ... every sync ran, and the compressor had slots to compress
    expected = case.steps // (case.local_steps // case.fragments) + int(first["final_sync"])
    if first["syncs"] != expected:
        problems.append(f"{first['syncs']} syncs, expected {expected}")
    if not comp.dense and not any(plan.compressed for plan in plans):
        problems.append("no tensor was compressed")
    if case.compressor == "none" and case.fragments == 1 and case.dtype == "fp32":
        problems += _reference_outer(case, results, world)
    return [f"{case.name} W={world}: {p}" for p in problems]


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_replicas_identical_and_bytes_symmetric_after_every_sync(world: int) -> None:
    names = list(CASES)
    results = run_workers(_sweep, world, names, timeout=120)
    problems = [p for name in names for p in _problems(CASES[name], world, [r[name] for r in results])]
    assert not problems, "\n".join(problems)


def test_the_sweep_covers_every_accepted_compressor_sizes_and_options() -> None:
    exported = {getattr(compressors, n) for n in compressors.__all__}
    concrete = {c for c in exported if isinstance(c, type) and issubclass(c, Compressor)} - {
        Compressor, QuantizedCompressor, SparseCompressor, SharedIndexCompressor}  # the abstract exchange bases
    assert concrete - {type(make()) for make in COMPRESSORS.values()} == {DIANA}
    with pytest.raises(ValueError, match="DIANA"):  # the one compressor the strategy refuses
        LocalSGDStrategy(compressor=DIANA())
    sizes = {math.prod(s) for s in SHAPES.values()}
    assert {0, 1, 3, 17, 1000, 1025, 4097} <= sizes
    assert all({math.prod(s) for s in SHAPES.values() if len(s) == d} == sizes for d in (1, 2))
    cases = CASES.values()
    assert {c.outer for c in cases} == {"average", "nesterov"} and {c.dtype for c in cases} == set(DTYPES)
    assert {c.compressor for c in cases if c.fragments > 1} >= {"none", "cltk", "signsgd", "powersgd"}
    assert any(c.overlap for c in cases)
    assert all(c.fragments <= len(list(_Net().parameters())) for c in cases)
    for case in cases:  # every configuration is one the strategy accepts
        case.strategy()
