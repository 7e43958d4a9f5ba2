"""One benchmark rank: runs every configuration in turn and writes its measurements as JSON.

Run by the bench runner as ``python -m lightning_gradcomp.bench.worker SPEC.json`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and ``GLOO_SOCKET_IFNAME`` inside a namespace) set.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_gradcomp.bench.configs import install
from lightning_gradcomp.bench.models import load_workload

__all__ = ["header_bytes_per_packet", "run_rank"]


def _iface_tx(iface: Optional[str]) -> tuple[int, int]:
    """``(bytes, packets)`` the interface has sent so far (zeros without an interface)."""
    if not iface:
        return 0, 0
    stats = Path(f"/sys/class/net/{iface}/statistics")
    if not stats.exists():
        return 0, 0
    return int((stats / "tx_bytes").read_text()), int((stats / "tx_packets").read_text())


def header_bytes_per_packet() -> int:
    """Ethernet + IPv4 + TCP header bytes of one packet in this network namespace.

    14 (Ethernet) + 20 (IPv4) + 20 (TCP), plus the 12-byte timestamp option when ``tcp_timestamps`` is on
    (Linux's default). A segmentation-offloaded packet is counted once with one header, so
    ``tx_bytes - tx_packets * header`` is exactly the TCP payload the process sent.
    """
    try:
        timestamps = Path("/proc/sys/net/ipv4/tcp_timestamps").read_text().strip() != "0"
    except OSError:
        timestamps = True
    return 14 + 20 + 20 + (12 if timestamps else 0)


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


def _run_steps(
    step: Any, warmup: int, steps: int, work: Optional[Callable[[], float]] = None
) -> tuple[list[float], list[float]]:
    """``warmup`` unmeasured then ``steps`` measured steps, each after a barrier: the measured steps' seconds, and
    how much the cumulative ``work`` counter moved in each (empty without one). Every step waits for its
    collectives and their callbacks, so a step's work is complete when it returns."""
    times, works = [], []
    for i in range(warmup + steps):
        dist.barrier()
        before = work() if work is not None else 0.0
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
            if work is not None:
                works.append(work() - before)
    return times, works


class _Measured:
    """Something measured on this rank in blocks of steps: ``step`` plus cumulative ``counters`` (name -> value).

    Each :meth:`block` keeps its step times and adds what the counters moved during it (the interface's bytes and
    packets less those of the block's own barriers), so blocks of one configuration may be interleaved with
    other configurations' blocks (``--rounds``).
    """

    def __init__(
        self,
        step: Callable[[], None],
        counters: Callable[[], dict[str, float]],
        iface: Optional[str],
        work: Optional[Callable[[], float]] = None,
    ):
        self.step, self.counters, self.iface, self.work = step, counters, iface, work
        self.times: list[float] = []
        self.works: list[float] = []  # per measured step, when ``work`` (a cumulative seconds counter) is given
        self.moved: dict[str, float] = {}

    def warm(self, steps: int) -> None:
        """``steps`` unmeasured steps."""
        _run_steps(self.step, steps, 0)

    def block(self, steps: int) -> None:
        """``steps`` measured steps, with Python's cyclic garbage collector run before them and paused during them
        (as ``timeit`` does): a full collection of the bench's objects takes a few hundred ms, and it would fall on
        whichever step crossed its allocation threshold."""
        # A rank's step can end while its last messages to a peer still wait in its link's queue: the interface
        # counts a packet when it leaves the queue, the peer needs only the messages it waits for. Past a barrier
        # every rank has received all that was sent before it. So one barrier first keeps the unmeasured step
        # before the block out of the barrier estimate (it read up to 370 KB there at 100 Mbit/s), and one after
        # the last step keeps the block's tail in the block.
        if self.iface:
            dist.barrier()
        barrier_bytes, barrier_packets = _barrier_tx(self.iface, steps + 1) if self.iface else (0, 0)
        gc.collect()
        gc.disable()
        try:
            before = self.counters()
            times, works = _run_steps(self.step, 0, steps, self.work)
            self.times += times
            self.works += works
            if self.iface:
                dist.barrier()
            after = self.counters()
        finally:
            gc.enable()
        for key, value in after.items():
            self.moved[key] = self.moved.get(key, 0.0) + value - before[key]
        # the block's barriers (one before each step, one after the last) are not the configuration's traffic
        self.moved["tx"] = self.moved.get("tx", 0.0) - barrier_bytes
        self.moved["packets"] = self.moved.get("packets", 0.0) - barrier_packets


def _interface_counters(iface: Optional[str]) -> dict[str, float]:
    tx_bytes, tx_packets = _iface_tx(iface)
    return {"tx": tx_bytes, "packets": tx_packets}


class _ComputeOnly(_Measured):
    """The same per-rank work with no communication (all ranks run it at the same time)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.workload = workload = load_workload(spec["model"], spec.get("batch_size"))
        opt = torch.optim.SGD(workload.parameters(), lr=0.01)

        def step() -> None:
            workload().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        super().__init__(step, dict, None)

    @classmethod
    def in_one_block(cls, spec: dict[str, Any]) -> _ComputeOnly:
        """A new one, warmed up, with all of ``spec["steps"]`` measured in one block."""
        measured = cls(spec)
        measured.warm(spec["warmup"])
        measured.block(spec["steps"])
        return measured

    def references(self) -> dict[str, float]:
        """:func:`reference_times` on the gradients of one more backward pass."""
        self.workload().backward()
        return reference_times([p.grad for p in self.workload.parameters() if p.grad is not None])


def reference_times(grads: list[torch.Tensor], repeats: int = 5) -> dict[str, float]:
    """Seconds of one pass over ``grads`` (one flat fp32 copy of the model's gradient), timed on this rank.

    ``clone``: one fp32 copy; ``rand_like``: one uniform draw of the same size; ``half``: a cast to fp16 (what
    PyTorch's ``fp16_compress_hook`` does). Each writes into a buffer allocated once, so the figure is the pass
    itself: with a fresh output per run the same copy took 0.6-5 ms on the development machine, depending on
    whether the allocator handed back warm pages or new ones (first-touch page faults). The medians of
    ``repeats`` runs: the references the overhead table divides our communication thread's work by.
    """
    flat = torch.cat([g.reshape(-1) for g in grads]).float()
    copy, half = torch.empty_like(flat), torch.empty_like(flat, dtype=torch.float16)
    ops = {"clone": lambda: copy.copy_(flat), "rand_like": copy.uniform_, "half": lambda: half.copy_(flat)}
    out = {}
    for name, op in ops.items():
        op()
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            op()
            runs.append(time.perf_counter() - start)
        out[name] = sorted(runs)[len(runs) // 2]
    return out


def _barrier_tx(iface: Optional[str], count: int) -> tuple[int, int]:
    """Interface ``(bytes, packets)`` this rank sends for ``count`` barriers (subtracted from the steps)."""
    before = _iface_tx(iface)
    for _ in range(count):
        dist.barrier()
    after = _iface_tx(iface)
    return after[0] - before[0], after[1] - before[1]


class _Configuration(_Measured):
    """One configuration installed on this rank (its own copy of the model, DDP and hook)."""

    def __init__(self, name: str, spec: dict[str, Any], iface: Optional[str]) -> None:
        self.workload = load_workload(spec["model"], spec.get("batch_size"))
        self.installed = installed = install(name, self.workload, spec["bucket_cap_mb"])
        opt = torch.optim.SGD(installed.ddp.parameters(), lr=0.01)
        installed.begin(opt)

        def step() -> None:
            installed.ddp().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            installed.end_step()  # the layerwise callback (L-GreCo) runs here, inside the timed step, as in a fit

        def counters() -> dict[str, float]:
            return {
                "wire": installed.wire_bytes(),
                "hook": installed.hook_seconds(),
                "thread": installed.thread_seconds(),
                "wait": installed.wait_seconds(),
                **_interface_counters(iface),
            }

        def work() -> float:  # compression work so far: the thread's time less its blocking waits, plus callbacks
            return installed.thread_seconds() - installed.wait_seconds()

        super().__init__(step, counters, iface, work)

    def result(self, peak_rss_mb: Optional[float]) -> dict[str, Any]:
        """The configuration's figures per measured step; ends it (the layerwise callback's ``on_train_end``)."""
        installed, n, moved, iface = self.installed, len(self.times), self.moved, self.iface
        state_mb = installed.state_nbytes() / 2**20
        installed.end()
        return {
            "step_times": self.times,
            "wire_bytes_per_step": moved["wire"] / n,
            "hook_seconds_per_step": moved["hook"] / n,
            "thread_seconds_per_step": moved["thread"] / n,
            "wait_seconds_per_step": moved["wait"] / n,
            "work_seconds_steps": self.works,
            "iface_tx_bytes_per_step": moved["tx"] / n if iface else None,
            "iface_tx_packets_per_step": moved["packets"] / n if iface else None,
            "iface_tx_payload_bytes_per_step": (moved["tx"] - moved["packets"] * header_bytes_per_packet()) / n
            if iface
            else None,
            "peak_rss_mb": peak_rss_mb,
            "state_mb": state_mb,
            "bucket_cap_mb": installed.ddp.bucket_bytes_cap / 2**20,
            "batch_size": self.workload.batch_size,
            "params": sum(p.numel() for p in self.workload.parameters()),
            # per-layer parameters the layerwise callback (L-GreCo) set by the end; {} = uniform (None: not our hook)
            "layer_params": None if installed.hook is None else dict(installed.hook.layer_params),
        }


def _measure(name: str, spec: dict[str, Any], iface: Optional[str]) -> dict[str, Any]:
    """One configuration on its own: its warm-up, then all its measured steps (with its own peak RSS)."""
    config = _Configuration(name, spec, iface)
    config.warm(spec["warmup"])
    _reset_peak_rss()
    config.block(spec["steps"])
    return config.result(_peak_rss_mb())


def block_sizes(steps: int, rounds: int) -> list[int]:
    """``steps`` measured steps cut into ``rounds`` blocks as equal as possible (the larger ones first).

    Example::

        >>> block_sizes(10, 3)
        [4, 3, 3]
    """
    base, extra = divmod(steps, rounds)
    return [base + (i < extra) for i in range(rounds)]


def _round_robin(spec: dict[str, Any], iface: Optional[str]) -> tuple[_ComputeOnly, dict[str, dict[str, Any]]]:
    """Every configuration installed at once, then ``rounds`` rounds of one block each: the compute-only step
    first, then each configuration in order, every block after one unmeasured step (the model it switches to is
    cold in the caches). The machine's drift over the run then falls on every configuration and on the
    compute-only baseline alike. Peak RSS is not per configuration here (``None``)."""
    compute = _ComputeOnly(spec)
    configs = {name: _Configuration(name, spec, iface) for name in spec["configs"]}
    for measured in (compute, *configs.values()):
        measured.warm(spec["warmup"])
    for size in block_sizes(spec["steps"], spec["rounds"]):
        for measured in (compute, *configs.values()):
            measured.warm(1)
            measured.block(size)
    return compute, {name: config.result(None) for name, config in configs.items()}


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure the compute-only step and every configuration in ``spec["configs"]`` on this rank.

    ``spec["rounds"]`` (default 1): with 1, each configuration runs all its steps in one go, between two runs of
    the compute-only step (before and after all of them); with more, in that many interleaved blocks
    (:func:`_round_robin`).
    """
    torch.set_num_threads(spec.get("threads", 1))
    dist.init_process_group("gloo")
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if spec.get("rounds", 1) > 1:
        compute, configs = _round_robin(spec, iface)
    else:
        compute = _ComputeOnly.in_one_block(spec)
        configs = {name: _measure(name, spec, iface) for name in spec["configs"]}
        # again at the end: the baseline of every efficiency is the median over both runs, not one run's drift
        compute.times += _ComputeOnly.in_one_block(spec).times
    results = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "compute_only": {"step_times": compute.times, "references": compute.references()},
        "configs": configs,
    }
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
