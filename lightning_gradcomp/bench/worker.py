"""One benchmark rank: runs every configuration in turn and writes its measurements as JSON.

Run by the bench runner as ``python -m lightning_gradcomp.bench.worker SPEC.json`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and ``GLOO_SOCKET_IFNAME`` inside a namespace) set.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_gradcomp.bench.configs import count_step, install
from lightning_gradcomp.bench.models import load_workload

__all__ = ["run_rank"]


def _iface_tx_bytes(iface: Optional[str]) -> Optional[int]:
    if not iface:
        return None
    path = Path(f"/sys/class/net/{iface}/statistics/tx_bytes")
    return int(path.read_text()) if path.exists() else None


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss_mb() -> Optional[float]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _run_steps(step: Any, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _compute_only(spec: dict[str, Any]) -> dict[str, Any]:
    """The same per-rank work with no communication (all ranks run it at the same time)."""
    workload = load_workload(spec["model"])
    opt = torch.optim.SGD(workload.parameters(), lr=0.01)

    def step() -> None:
        workload().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    return {"step_times": _run_steps(step, spec["warmup"], spec["steps"])}


def _barrier_tx_bytes(iface: Optional[str], count: int) -> int:
    """Interface bytes this rank sends for ``count`` barriers (subtracted from the measured steps)."""
    before = _iface_tx_bytes(iface)
    for _ in range(count):
        dist.barrier()
    after = _iface_tx_bytes(iface)
    return (after - before) if before is not None and after is not None else 0


def _measure(name: str, spec: dict[str, Any], iface: Optional[str]) -> dict[str, Any]:
    workload = load_workload(spec["model"])
    installed = install(name, workload, spec["bucket_cap_mb"])
    opt = torch.optim.SGD(installed.ddp.parameters(), lr=0.01)
    counters: dict[str, float] = {}

    def step() -> None:
        installed.ddp().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        count_step(installed)

    def snapshot() -> dict[str, float]:
        return {"wire": installed.wire_bytes(), "hook": installed.hook_seconds(), "tx": _iface_tx_bytes(iface) or 0}

    _run_steps(step, spec["warmup"], 0)
    n = spec["steps"]
    barrier_tx = _barrier_tx_bytes(iface, n)
    _reset_peak_rss()
    counters = snapshot()
    times = _run_steps(step, 0, n)
    end = snapshot()
    return {
        "step_times": times,
        "wire_bytes_per_step": (end["wire"] - counters["wire"]) / n,
        "hook_seconds_per_step": (end["hook"] - counters["hook"]) / n,
        # the per-step barrier of the measurement loop is not part of the configuration's traffic
        "iface_tx_bytes_per_step": (end["tx"] - counters["tx"] - barrier_tx) / n if iface else None,
        "peak_rss_mb": _peak_rss_mb(),
        "batch_size": workload.batch_size,
        "params": sum(p.numel() for p in workload.parameters()),
    }


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure the compute-only step and every configuration in ``spec["configs"]`` on this rank."""
    torch.set_num_threads(spec.get("threads", 1))
    dist.init_process_group("gloo")
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    results = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "compute_only": _compute_only(spec),
               "configs": {}}
    for name in spec["configs"]:
        results["configs"][name] = _measure(name, spec, iface)
    dist.barrier()
    return results


def main(argv: Optional[list[str]] = None) -> int:
    """Read the spec, run, write ``<out_dir>/rank<r>.json``."""
    args = argv if argv is not None else sys.argv[1:]
    spec = json.loads(Path(args[0]).read_text())
    results = run_rank(spec)
    Path(spec["out_dir"], f"rank{results['rank']}.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: destroying a gloo group while PyTorch's powerSGD_hook futures still hold
    # references aborts with "Resource deadlock avoided" on some links; the results are already on disk.
    os._exit(code)
