"""CUDA checks: every compressor on CUDA tensors at W = 1, and no host sync on the training thread.

Skipped without a CUDA device (the project's CI machines have none; run ``python -m pytest tests/cuda`` on a
GPU machine). One forked rank on gloo with CUDA tensors (``tests/helpers/distributed.py``), a small DDP model on ``cuda:0``, the hook
built by ``GradCompStrategy.make_hook``, a few steps past ``start_step``. The host-sync check counts the Tensor
methods that wait for the device, called on the training thread inside the hook or the optimizer-step commit
(``torch.cuda.set_sync_debug_mode`` is process-wide and would also flag the communication thread, which is
allowed to wait).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from helpers.distributed import run_workers
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors import registry
from lightning_gradcomp.hook import GradCompHook, gradcomp_comm_hook

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NAMES = sorted(n for n in registry.list() if not n.startswith("unit_test"))
SYNCING = ("item", "__bool__", "tolist", "cpu", "numpy", "__int__", "__float__", "nonzero")


def _hooked_ddp(name: str, widths: tuple[int, ...] = (64, 128, 128, 4)) -> tuple[nn.Module, Any, Any, Any]:
    """A small MLP on ``cuda:0`` (same initial weights on every rank) under DDP with the ``name`` compressor's hook."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.Tanh()]
    model = nn.Sequential(*layers[:-1]).to(device)
    ddp = DistributedDataParallel(model, device_ids=[0])
    names = {id(p): n for n, p in model.named_parameters()}
    hook = GradCompStrategy(compressor=registry.create(name), min_numel=256).make_hook(
        Comm(None, CommStats()), names, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    hook.attach_optimizer(opt)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    return model, ddp, hook, opt


def _on_cuda(rank: int, world: int, name: str) -> dict[str, Any]:
    device = torch.device("cuda", 0)
    model, ddp, hook, opt = _hooked_ddp(name)
    before = [p.detach().clone() for p in model.parameters()]

    counts: dict[str, int] = {}
    inside = threading.local()
    originals = {m: getattr(torch.Tensor, m) for m in SYNCING}

    def counting(method: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(inside, "on", False):
                counts[method] = counts.get(method, 0) + 1
            return originals[method](*args, **kwargs)
        return wrapper

    call = GradCompHook.__call__

    def watched(self: GradCompHook, bucket: Any) -> Any:
        inside.on = True
        try:
            return call(self, bucket)
        finally:
            inside.on = False

    gen = torch.Generator(device=device).manual_seed(1)
    try:
        for m in SYNCING:
            setattr(torch.Tensor, m, counting(m))
        GradCompHook.__call__ = watched  # type: ignore[method-assign]
        for _ in range(5):
            x = torch.randn(16, 64, device=device, generator=gen)
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        for m, original in originals.items():
            setattr(torch.Tensor, m, original)
        GradCompHook.__call__ = call  # type: ignore[method-assign]
    torch.cuda.synchronize()
    return {"counts": counts, "steps": hook.stats.steps, "compressed": hook.stats.compressed_steps,
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            "moved": any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))}


def _replica_on_cuda(rank: int, world: int, name: str, widths: tuple[int, ...]) -> dict[str, Any]:
    """Rank ``rank`` of a gloo group whose tensors all live on ``cuda:0``: 6 steps on this rank's own batches."""
    device = torch.device("cuda", 0)
    model, ddp, hook, opt = _hooked_ddp(name, widths)
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    for _ in range(6):
        x = torch.randn(8, widths[0], device=device, generator=gen)
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return {"params": [p.detach().cpu() for p in model.parameters()], "compressed": hook.stats.compressed_steps,
            "collectives": hook.stats.collectives}


@pytest.mark.parametrize("widths", [(64, 128, 128, 4), (33, 257, 7, 3)], ids=["even", "odd"])
@pytest.mark.parametrize("name", NAMES)
def test_replicas_stay_identical_at_two_ranks_on_cuda_tensors(name: str, widths: tuple[int, ...]) -> None:
    """Two processes on one GPU, gloo with CUDA tensors: the compressor's collectives, the communication thread's
    stream ordering and the optimizer-step commit leave both ranks with the same weights (``torch.equal``), on layer
    sizes that are and are not multiples of the compressors' groups."""
    first, second = run_workers(_replica_on_cuda, 2, name, widths, timeout=120)
    assert first["collectives"] > 0 and first["compressed"] == second["compressed"]
    assert all(torch.isfinite(p).all() for p in first["params"])
    for a, b in zip(first["params"], second["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_compressor_on_cuda_without_host_syncs(name: str) -> None:
    (result,) = run_workers(_on_cuda, 1, name, timeout=120)
    assert result["finite"] and result["moved"] and result["steps"] == 5
    if not registry.create(name).dense:
        assert result["compressed"] == 3
    assert result["counts"] == {}, f"host syncs on the training thread: {result['counts']}"


def test_the_cpu_kernels_entry_points_take_torchs_steps_on_cuda() -> None:
    """The functions that use the compiled CPU kernel run torch's steps on CUDA tensors, on the device: compensation
    (and no NaN/Inf answer, so the engine scans the bucket), scaled sign, DIANA's fused subtraction and the thin
    products."""
    from lightning_gradcomp.functional.feedback import compensate_checked
    from lightning_gradcomp.functional.lowrank import thin_matmul
    from lightning_gradcomp.functional.quantize import sign_quantize, stochastic_quantize

    device = torch.device("cuda", 0)
    m, g = torch.randn(1000, device=device), torch.randn(1000, device=device)
    scale = torch.tensor([4.0], device=device)
    p, bad = compensate_checked(m, g.clone(), scale, clear=True)
    assert p.device == device and bad is None and torch.equal(p, torch.addcdiv(m, g, scale))
    q = sign_quantize(g, 64)
    assert q.codes.device == device and torch.equal(q.codes, torch.ge(g, 0).view(torch.uint8))
    gen = torch.Generator(device=device)
    fused = stochastic_quantize(g, 1, 128, "inf", gen.manual_seed(3), minus=m)
    plain = stochastic_quantize(g - m, 1, 128, "inf", gen.manual_seed(3))
    assert torch.equal(fused.codes, plain.codes) and torch.equal(fused.scales, plain.scales)
    mat, factor = torch.randn(40, 30, device=device), torch.randn(30, 4, device=device)
    torch.testing.assert_close(thin_matmul(mat, factor, torch.empty(40, 4, device=device)), mat @ factor)


def test_zero_if_nonfinite_decides_on_the_device_without_a_host_sync() -> None:
    """The local-step guard of LocalSGDStrategy: no host sync on CUDA, every tensor zeroed when one holds NaN/Inf."""
    from lightning_gradcomp.functional.finite import zero_if_nonfinite

    device = torch.device("cuda", 0)
    finite = [torch.randn(s, device=device) for s in [(), (5,), (3, 4)]]
    poisoned = [t.clone() for t in finite]
    poisoned[2][1, 1] = float("nan")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kept, zeroed = zero_if_nonfinite([t.clone() for t in finite]), zero_if_nonfinite(poisoned)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert kept.item() == 0.0 and zeroed.item() == 1.0
    assert all(not t.any() for t in poisoned)


def _late_write(rank: int, world: int) -> list[float]:
    from lightning_gradcomp.comm import then_same_numerics

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    seen = []
    for _ in range(3):
        values, late = torch.ones(1 << 16, device=device), torch.zeros(4, device=device)
        fut = torch.distributed.all_reduce(values, async_op=True).get_future()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time on the caller's stream, then the write
        late.fill_(7.0)
        seen += then_same_numerics(fut, lambda _: late.clone()).wait().tolist()
    return seen


def test_a_callback_sees_what_the_caller_wrote_after_launching_the_collective() -> None:
    """``then_same_numerics`` runs its callback after the caller's stream: a tensor written on that stream after the
    collective was launched (behind a ~0.1 s device sleep) reads as written, not as it was (PyTorch's own callback
    stream waits only for the collective)."""
    (seen,) = run_workers(_late_write, 1, timeout=120)
    assert seen == [7.0] * 12
