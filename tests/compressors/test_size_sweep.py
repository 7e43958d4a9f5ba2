"""Every compressor on small and odd-sized layers at W = 2..5: runs finish, replicas agree, bytes match.

Issue 16: layers with fewer scale groups than ranks leave chunks without scales, and chunk payloads of a
byte size that is not a multiple of 4 broke the quantized all-reduce at W >= 3. The sweep drives
``GradCompHook`` under plain ``torch.distributed`` (forked gloo ranks, DDP, no Lightning): one process group
per W, every compressor inside the same processes. A Lightning fit of a logistic regression covers the
quantized compressors end to end.
"""

import math
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from helpers.distributed import run_workers
from helpers.models import LayerSizesNet, assert_replicas_identical, fit
from helpers.wire import hook_call_bytes
from lightning_gradcomp import GradCompStrategy, compressors
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors import (CLTK, DIANA, QSGD, PowerSGD, QuantizedCompressor, RandomK,
                                            SharedIndexCompressor, SignSGD, SparseCompressor, TernGrad, TopK, registry)
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.hook import GradCompHook, gradcomp_comm_hook
from lightning_gradcomp.plan import BucketPlan, LayerSlot
from lightning_gradcomp.schedule import WarmupSchedule

SHAPES = {  # layers of 1, 2, 3, 7, 31, 100, 127, 129, 1000 and 4097 elements, plus the conv below, and an empty one
    "v1": (1,), "v2": (2,), "m3": (3, 1), "v7": (7,), "v31": (31,), "logreg": (1, 100),
    "v127": (127,), "v129": (129,), "m1000": (10, 100), "m4097": (17, 241), "empty": (0, 5),
}
START_STEP, STEPS, BATCH = 2, 5, 4


def _variants() -> dict[str, Callable[[], Compressor]]:
    """Every registered compressor with its defaults, plus the non-default wire formats and aggregations.

    Built at collection time, before any test registers a throwaway name.
    """
    out: dict[str, Callable[[], Compressor]] = {name: lambda n=name: registry.create(n) for name in registry.list()}
    for name in ("qsgd", "terngrad", "signsgd", "diana"):  # the default "auto" is the all-gather at W = 2
        out[f"{name}-allgather"] = lambda n=name: registry.create(n, aggregation="allgather")
        out[f"{name}-alltoall"] = lambda n=name: registry.create(n, aggregation="alltoall")
    out["qsgd-3bit-g32"] = lambda: QSGD(bits=3, bucket_size=32)  # bit-stream packing, many groups per layer
    out["diana-l2:16"] = lambda: DIANA("l2:16")
    out["terngrad-g1"] = lambda: TernGrad(bucket_size=1)  # one scale per element
    out["signsgd-g7"] = lambda: SignSGD(bucket_size=7)
    out["topk-fp16"] = lambda: TopK(ratio=0.1, value_dtype=torch.float16)
    out["topk-delta16"] = lambda: TopK(ratio=0.1, index_coding="delta16")
    out["topk-delta16-bf16"] = lambda: TopK(ratio=0.3, index_coding="delta16", value_dtype="bfloat16")
    out["randomk-unbiased-bf16"] = lambda: RandomK(ratio=0.1, unbiased=True, value_dtype="bfloat16")
    out["cltk-delta16-fp16"] = lambda: CLTK(ratio=0.1, index_coding="delta16", value_dtype=torch.float16)
    out["cltk-approx"] = lambda: CLTK(ratio=0.05, selection="approx")  # sampled threshold, count within a band
    out["powersgd-cold"] = lambda: PowerSGD(rank=3, warm_start=False)  # a fresh shared Q every step
    return out


VARIANTS = _variants()
REGISTERED = registry.list()  # at collection time, like VARIANTS

FLAT = {"min_numel": 1, "compress_1d": True}  # every layer goes to the compressor at its own parameter
OPTIONS: dict[str, dict[str, Any]] = {  # variants of the strategy's parameter options (default: FLAT)
    # the layers under 1024 elements at their own parameter, the others following a schedule
    "cltk-small-schedule": {"small_param": 0.3, "schedule": {2: 0.5, 4: 0.2}},
    "topk-small-warmup": {"small_param": 0.5, "schedule": WarmupSchedule(steps=4, start=0.6, stages=2)},
    "qsgd-small-warmup": {"small_param": 6, "schedule": WarmupSchedule(steps=4, start=8, stages=2)},
    "powersgd-schedule": {**FLAT, "schedule": {2: 3, 3: 2, 4: 1}},
    # the casts under the other compressors' size rule: dense slots between cast ones (async dense all-reduce,
    # the slots divided and concatenated one by one, the whole bucket checked for NaN/Inf afterwards)
    "fp16-size-rule": {"min_numel": 1024, "compress_1d": False},
}
VARIANTS.update({
    "cltk-small-schedule": lambda: CLTK(ratio=0.1),
    "topk-small-warmup": lambda: TopK(ratio=0.1),
    "qsgd-small-warmup": lambda: QSGD(bits=4, bucket_size=32),
    "powersgd-schedule": lambda: PowerSGD(rank=1),
    "fp16-size-rule": lambda: compressors.Cast(torch.float16),
})




class _Recording:
    """Wraps the hook's per-bucket protocol (run on its communication thread, in bucket order) and records what
    each bucket did: its step, plan, per-layer parameters and the bytes its collectives counted."""

    def __init__(self, hook: GradCompHook) -> None:
        self.hook = hook
        self.calls: list[dict[str, Any]] = []
        self._reduce = hook._reduce
        hook._reduce = self  # type: ignore[method-assign]

    def __call__(self, plan: Any, buf: torch.Tensor, step: int, *args: Any) -> Any:
        before = self.hook.stats.wire_bytes
        out = self._reduce(plan, buf, step, *args)
        self.calls.append({"step": step, "plan": plan, "params": [self.hook.param_of(s.name) for s in plan.compressed],
                           "bytes": self.hook.stats.wire_bytes - before})
        return out


def _train(rank: int, world: int, name: str, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    model = LayerSizesNet(SHAPES).to(dtype)
    strategy = GradCompStrategy(compressor=VARIANTS[name](), start_step=START_STEP, **OPTIONS.get(name, FLAT))
    views = strategy._ddp_kwargs["gradient_as_bucket_view"]  # as a fit wraps the model: gradients in the buckets
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.004, gradient_as_bucket_view=views)  # ~1000 floats/bucket
    names = {id(p): n for n, p in model.named_parameters()}
    hook = strategy.make_hook(Comm(None, CommStats()), names, torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hook.attach_optimizer(optimizer)  # the engine commits staged state on optimizer steps
    recording = _Recording(hook)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    gen = torch.Generator().manual_seed(rank)
    total = sum(p.numel() for p in model.layers.values())
    for _ in range(STEPS):
        image, features = torch.randn(BATCH, 3, 5, 5, generator=gen), torch.randn(BATCH, total, generator=gen)
        target = torch.randn(BATCH, generator=gen).sign()
        loss = (ddp(image.to(dtype), features.to(dtype)).tanh() - target.to(dtype)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "calls": recording.calls, "step": hook.step}


def _sweep(rank: int, world: int, names: list[str], dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    out = {}
    for name in names:
        try:
            out[name] = _train(rank, world, name, dtype)
        except Exception as err:  # name the variant in the traceback run_workers reports
            raise RuntimeError(f"{name} failed at W={world} on rank {rank} with {dtype} parameters") from err
    return out


def _check(name: str, world: int, results: list[dict[str, Any]]) -> list[str]:
    """The problems of one variant: replica mismatch, byte mismatch, nothing compressed, wrong step count."""
    comp = VARIANTS[name]()
    problems = []
    init = LayerSizesNet(SHAPES)
    for rank, res in enumerate(results):
        if res["step"] != STEPS:
            problems.append(f"rank {rank}: hook.step = {res['step']}, expected {STEPS}")
        for (pname, p0), a, b in zip(init.named_parameters(), results[0]["params"], res["params"]):
            if not torch.equal(a, b):
                problems.append(f"rank {rank}: {pname} differs from rank 0")
            if not torch.isfinite(b).all() or (b.numel() and torch.equal(b, p0.detach())):
                problems.append(f"rank {rank}: {pname} is non-finite or never moved")
        for call in res["calls"]:
            compressing = call["step"] >= START_STEP and not comp.dense and bool(call["plan"].compressed)
            want = hook_call_bytes(comp, call["plan"], call["params"], world, compressing)
            if call["bytes"] != pytest.approx(want, rel=1e-12, abs=1e-9):
                layers = [(s.name, s.numel) for s in call["plan"].compressed]
                problems.append(f"rank {rank} step {call['step']} bucket {layers}: {call['bytes']} bytes, "
                                f"formula {want}")
    compressed = {s.name for c in results[0]["calls"] if c["step"] >= START_STEP for s in c["plan"].compressed}
    if not comp.dense and not compressed:
        problems.append("no layer was compressed")
    used = {p for c in results[0]["calls"] if c["step"] >= START_STEP for p in c["params"]}
    if name in OPTIONS and comp.param_name is not None and len(used) < 3:  # the schedule's values, small_param
        problems.append(f"the parameter options had no effect: parameters used {sorted(used)}")
    if OPTIONS.get(name, FLAT).get("min_numel", 1) > 1 and not any(c["plan"].dense for c in results[0]["calls"]):
        problems.append("the size rule left no slot dense")
    return [f"{name} W={world}: {p}" for p in problems]


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_every_compressor_on_small_and_odd_layers(world: int) -> None:
    names = list(VARIANTS)
    results = run_workers(_sweep, world, names, timeout=120)
    problems = [p for name in names for p in _check(name, world, [r[name] for r in results])]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("dtype", "world"), [(torch.float64, 3), (torch.bfloat16, 2), (torch.float16, 4),
                                              (torch.float64, 5)])
def test_every_registered_compressor_on_parameters_of_other_dtypes(dtype: torch.dtype, world: int) -> None:
    """fp64, bf16 and fp16 parameters: gradients and buckets of that dtype. Error feedback keeps fp32 memories, so
    a compressor must get fp32 inputs from the second step on too (fp64 ones broke PowerSGD's factors and SignSGD's
    residual); the parameters keep their dtype, move, stay finite and agree bit for bit across ranks."""
    results = run_workers(_sweep, world, REGISTERED, dtype, timeout=120)
    initial = list(LayerSizesNet(SHAPES).to(dtype).parameters())
    problems = []
    for name in REGISTERED:
        for rank, res in enumerate(r[name] for r in results):
            if res["step"] != STEPS:
                problems.append(f"{name} rank {rank}: hook.step = {res['step']}, expected {STEPS}")
            for p0, a, b in zip(initial, results[0][name]["params"], res["params"]):
                moved = not b.numel() or not torch.equal(b, p0)
                if b.dtype != dtype or not torch.equal(a, b) or not torch.isfinite(b).all() or not moved:
                    problems.append(f"{name} rank {rank}: a {b.dtype} parameter {tuple(b.shape)} differs from rank 0, "
                                    "is non-finite or never moved")
    assert not problems, "\n".join(problems)


def test_the_sweep_covers_every_compressor_class_and_the_issue_sizes() -> None:
    exported = {getattr(compressors, n) for n in compressors.__all__}
    concrete = {c for c in exported if isinstance(c, type) and issubclass(c, Compressor)} - {
        Compressor, QuantizedCompressor, SharedIndexCompressor, SparseCompressor}  # the base classes
    assert concrete <= {type(make()) for make in VARIANTS.values()}
    sizes = {math.prod(s) for s in SHAPES.values()} | {p.numel() for p in nn.Conv2d(3, 5, 3).parameters()}
    assert {1, 2, 3, 7, 31, 100, 127, 129, 1000, 4097, 135, 5, 0} == sizes


# ---------------------------------------------------------------------------- Lightning
class LogReg(pl.LightningModule):
    """Logistic regression ``Linear(100, 1, bias=False)``: one compressed layer of 100 elements."""

    def __init__(self, samples: int = 128, batch_size: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(100, 1, bias=False)
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(samples, 100, generator=gen)
        self.y = (self.x[:, :10].sum(dim=1) > 0).float()
        self.batch_size = batch_size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.binary_cross_entropy_with_logits(self.linear(x).squeeze(1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


@pytest.mark.parametrize("comp", [QSGD(bits=4), TernGrad(), SignSGD(), DIANA("linf:128")],
                         ids=["qsgd4", "terngrad", "signsgd", "diana"])
def test_logistic_regression_in_lightning_at_w4(tmp_path: Path, comp: Compressor) -> None:
    """Issue 16's report: a 100-element layer at W=4 (``min_numel=1``) crashed the quantized all-reduce."""
    strategy = GradCompStrategy(compressor=comp, min_numel=1, start_step=START_STEP, start_method="fork")
    records = fit(strategy, tmp_path, devices=4, model=LogReg(), max_steps=STEPS)
    assert_replicas_identical(records)
    stats = records[0]["stats"]
    assert stats["steps"] == STEPS and stats["compressed_steps"] == STEPS - START_STEP
    plan = BucketPlan(0, 100, (LayerSlot("linear.weight", 0, (1, 100), True),))
    dense = START_STEP * hook_call_bytes(comp, plan, [], 4, compressing=False)
    compressed = (STEPS - START_STEP) * hook_call_bytes(comp, plan, [comp.default_param], 4, compressing=True)
    assert stats["wire_bytes"] == pytest.approx(dense + compressed, rel=1e-12)
