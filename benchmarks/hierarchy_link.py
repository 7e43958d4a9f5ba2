"""Flat vs hierarchical CLT-k on emulated nodes: inter-node bytes on the wire, hook time, step time.

N nodes of L processes (default 2 x 2). Each *node* is one network namespace
(``lightning_gradcomp.bench.netem.EmulatedLink`` with one namespace per node) whose veth is rate-limited with
``tc tbf``; the node's L processes share the namespace, so traffic between them goes over loopback (fast) and
only inter-node traffic crosses the shaped veth. gloo binds to the node's veth (``GLOO_SOCKET_IFNAME``, required)
and the rendezvous is at node 0's address. Each process trains the bench
transformer (``lightning_gradcomp.bench.models``) under DDP with the hook that ``GradCompStrategy.make_hook``
builds, flat (``hierarchy=None``) or hierarchical (``hierarchy=L``), one torch thread per process. Each node's
processes are started by one ``torchrun`` (``python -m torch.distributed.run --nnodes N --nproc-per-node L
--node-rank n``, static rendezvous at node 0's address) inside the node's namespace, as on a real cluster.

Measured per configuration, over ``--steps`` steps after ``--warmup``:

* the veth's ``tx_bytes``/``tx_packets`` of every node (read by its local rank 0 between two barriers; the
  barriers' own traffic is measured separately and subtracted; TCP/IP headers removed as in ``bench.worker``):
  the real inter-node payload per node (per NIC) and step;
* ``CommStats``: modelled inter-node bytes (``wire_bytes``) and intra-node bytes (``intra_bytes``) per rank;
* the communication thread's time per step (compression, waits) and the hook's own time, per rank;
* the step time (slowest rank, median).

    python benchmarks/hierarchy_link.py [--link 100mbit] [--nodes 2] [--per-node 2] [--steps 10] [--rounds 3]

``--link none`` runs the same processes on loopback in the root namespace (no interface counters).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.bench.models import load_workload
from lightning_gradcomp.bench.netem import EmulatedLink, can_emulate, rank_address
from lightning_gradcomp.bench.runner import free_port, wait_all
from lightning_gradcomp.bench.worker import _barrier_tx, _iface_tx, _run_steps, header_bytes_per_packet
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.compressors import CLTK, Compressor, NoCompression
from lightning_gradcomp.hierarchy import Hierarchy, HierarchyLayout
from lightning_gradcomp.hook import gradcomp_comm_hook

__all__ = ["CONFIGS", "launch", "merge_rounds", "summarise", "torchrun_commands"]

CONFIGS: dict[str, tuple[str, bool]] = {  # name: (compressor, hierarchical)
    "cltk": ("cltk", False),
    "cltk_hier": ("cltk", True),
    "ddp": ("none", False),
    "ddp_hier": ("none", True),
}


def _compressor(name: str, ratio: float) -> Compressor:
    return CLTK(density=ratio) if name == "cltk" else NoCompression()


# ---------------------------------------------------------------------------------------------- worker
def _time_compressor(compressor: Compressor) -> list[float]:
    """Wrap ``compressor.reduce`` to add the CPU time it takes on its thread to the returned cell.

    CPU time (``time.thread_time``), not wall time: with 4 processes on 2 cores a thread is often preempted, and
    the blocking collectives inside ``reduce`` sleep (they cost no CPU time)."""
    total = [0.0]
    reduce = compressor.reduce

    def timed(tensors: Any, ctx: Any) -> Any:
        start = time.thread_time()
        out = reduce(tensors, ctx)
        total[0] += time.thread_time() - start
        return out

    compressor.reduce = timed  # type: ignore[method-assign]
    return total


def _measure(key: str, spec: dict[str, Any], iface: Optional[str]) -> dict[str, Any]:
    comp_name, hierarchical = CONFIGS[key]
    rank, world, per_node = dist.get_rank(), dist.get_world_size(), spec["per_node"]
    workload = load_workload(spec["model"], spec["batch_size"])
    ddp = DistributedDataParallel(workload, bucket_cap_mb=spec["bucket_cap_mb"])
    strategy = GradCompStrategy(compressor=_compressor(comp_name, spec["ratio"]),
                                hierarchy=per_node if hierarchical else None)
    stats = CommStats()
    hierarchy = None
    if hierarchical:
        numels = {n: p.numel() for n, p in workload.named_parameters() if p.requires_grad}
        hierarchy = Hierarchy.create(HierarchyLayout(world, per_node), rank, numels, stats)
    names = {id(p): n for n, p in workload.named_parameters()}
    hook = strategy.make_hook(Comm(None, stats), names, torch.device("cpu"), hierarchy)
    compressor_seconds = _time_compressor(hook.compressor)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    hook.attach_optimizer(opt)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)

    per_step: list[float] = []  # compressor seconds of each step (backward waits for every bucket)

    def step() -> None:
        before = compressor_seconds[0]
        ddp().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        per_step.append(compressor_seconds[0] - before)

    def snapshot() -> dict[str, float]:
        tx, packets = _iface_tx(iface)
        return {"wire": stats.wire_bytes, "intra": stats.intra_bytes, "hook": stats.hook_seconds,
                "compressor": compressor_seconds[0],
                "thread": stats.comm_thread_seconds, "wait": stats.wait_seconds, "tx": tx, "packets": packets}

    n = spec["steps"]
    _run_steps(step, spec["warmup"], 0)
    dist.barrier()  # the warm-up's last packets, still queued on a link, are not counted as barrier bytes
    barrier_bytes, barrier_packets = _barrier_tx(iface, n + 1)  # the measurement's own barriers
    start = snapshot()
    times, _ = _run_steps(step, 0, n)  # (step times, work per step): the work is not used here
    dist.barrier()  # every process of the node has sent this step's bytes
    end = snapshot()
    hook.close()
    weights = torch.cat([p.detach().reshape(-1) for p in workload.parameters()])
    frames = end["tx"] - start["tx"] - barrier_bytes
    packets = end["packets"] - start["packets"] - barrier_packets
    return {
        "step_times": times,
        "wire_bytes_per_step": (end["wire"] - start["wire"]) / n,
        "intra_bytes_per_step": (end["intra"] - start["intra"]) / n,
        "hook_seconds_per_step": (end["hook"] - start["hook"]) / n,
        "thread_seconds_per_step": (end["thread"] - start["thread"]) / n,
        "compute_seconds_per_step": (end["thread"] - end["wait"] - start["thread"] + start["wait"]) / n,
        "compressor_seconds_per_step": (end["compressor"] - start["compressor"]) / n,
        "compressor_step_seconds": per_step[-n:],
        "nic_tx_payload_bytes_per_step": (frames - packets * header_bytes_per_packet()) / n if iface else None,
        "params": sum(p.numel() for p in workload.parameters()),
        "weights_sha256": hashlib.sha256(weights.numpy().tobytes()).hexdigest(),
    }


def run_rank(spec_path: str) -> None:
    """One process: every configuration in turn; writes ``<out_dir>/rank<r>.json``."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    local = dist.get_rank() % spec["per_node"]
    iface = os.environ.get("GLOO_SOCKET_IFNAME") if local == 0 else None  # one reader per node's NIC
    rounds: dict[str, list[dict[str, Any]]] = {key: [] for key in spec["configs"]}
    for _ in range(spec.get("rounds", 1)):  # configurations alternate, so a change of machine load hits all alike
        for key in spec["configs"]:
            rounds[key].append(_measure(key, spec, iface))
    results = {"rank": dist.get_rank(), "configs": {key: merge_rounds(rows) for key, rows in rounds.items()}}
    dist.barrier()
    Path(spec["out_dir"], f"rank{results['rank']}.json").write_text(json.dumps(results))


def merge_rounds(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's rounds as one measurement: step lists concatenated, per-step figures averaged, the
    weight digests joined (replicas must agree after every round)."""
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        values = [row[key] for row in rows]
        if isinstance(value, list):
            out[key] = [v for row in values for v in row]
        elif key == "weights_sha256":
            out[key] = ",".join(values)
        elif key == "params" or value is None:
            out[key] = value
        else:
            out[key] = statistics.mean(values)
    return out


# ---------------------------------------------------------------------------------------------- parent
def torchrun_commands(spec_path: Path, nodes: int, per_node: int, port: int, link: Optional[EmulatedLink],
                      script: Path = Path(__file__)) -> list[tuple[list[str], dict[str, str]]]:
    """One ``torchrun`` per node (inside the node's namespace when ``link`` is given): ``(argv, extra env)``.

    Static rendezvous at node 0's address; torchrun sets ``RANK = node * per_node + local rank``. Each process runs
    ``script --worker spec_path`` (this file; ``fsdp_link.py`` passes its own).
    """
    out = []
    for node in range(nodes):
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
                f"--node-rank={node}", f"--master-addr={rank_address(0) if link else '127.0.0.1'}",
                f"--master-port={port}", str(script.resolve()), "--worker", str(spec_path)]
        env = {"OMP_NUM_THREADS": "1"}
        if link is not None:
            argv = ["ip", "netns", "exec", link.namespace(node), *argv]
            env["GLOO_SOCKET_IFNAME"] = link.interface(node)
        out.append((argv, env))
    return out


def launch(spec: dict[str, Any], link: Optional[EmulatedLink], timeout: float, script: Path = Path(__file__)
            ) -> list[dict[str, Any]]:
    """Run one torchrun per node; return every rank's ``rank<r>.json``."""
    spec_path = Path(spec["out_dir"]) / "spec.json"
    spec_path.write_text(json.dumps(spec))
    procs = [subprocess.Popen(argv, env={**os.environ, **env})
             for argv, env in torchrun_commands(spec_path, spec["nodes"], spec["per_node"], free_port(), link,
                                                  script)]
    wait_all(procs, timeout, "torchrun")
    world = spec["nodes"] * spec["per_node"]
    return [json.loads((Path(spec["out_dir"]) / f"rank{r}.json").read_text()) for r in range(world)]


def summarise(ranks: list[dict[str, Any]], per_node: int) -> dict[str, dict[str, Any]]:
    """Per configuration: slowest rank's median step time, max thread/hook time, bytes per rank and per NIC."""
    out = {}
    for key in ranks[0]["configs"]:
        rows = [r["configs"][key] for r in ranks]
        steps = [max(times) for times in zip(*(row["step_times"] for row in rows))]
        nic = [row["nic_tx_payload_bytes_per_step"] for i, row in enumerate(rows) if i % per_node == 0]
        out[key] = {
            "step_time_median_s": statistics.median(steps),
            "thread_seconds_per_step_max": max(row["thread_seconds_per_step"] for row in rows),
            "hook_seconds_per_step_max": max(row["hook_seconds_per_step"] for row in rows),
            "compute_seconds_per_step_max": max(row["compute_seconds_per_step"] for row in rows),
            "compute_seconds_per_step_mean": statistics.mean(row["compute_seconds_per_step"] for row in rows),
            "compressor_seconds_per_step_mean": statistics.mean(row.get("compressor_seconds_per_step", 0.0)
                                                                for row in rows),
            # per step the busiest rank (CLT-k's leader selects for its whole group), median over steps
            "compressor_seconds_busiest_rank": statistics.median(
                max(per_rank) for per_rank in zip(*(row.get("compressor_step_seconds", [0.0]) for row in rows))),
            "wire_bytes_per_rank_step_mean": statistics.mean(row["wire_bytes_per_step"] for row in rows),
            "intra_bytes_per_rank_step_mean": statistics.mean(row["intra_bytes_per_step"] for row in rows),
            "nic_tx_payload_bytes_per_node_step": None if None in nic else statistics.mean(nic),
            "params": rows[0]["params"],
            "replicas_identical": len({row.get("weights_sha256") for row in rows}) == 1,
        }
    return out


def report(summary: dict[str, dict[str, Any]], where: str) -> None:
    """A markdown table."""
    print(f"\n{where}\n")
    print("| config | step s (median, slowest rank) | comm thread ms/step (max rank) | thread work ms/step "
          "(mean rank) | compressor CPU ms/step (mean rank) | compressor CPU ms/step (busiest rank) "
          "| modelled inter-node MB/rank/step "
          "| modelled intra-node MB/rank/step | NIC tx payload MB/node/step | replicas identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, row in summary.items():
        nic = row["nic_tx_payload_bytes_per_node_step"]
        print(f"| {key} | {row['step_time_median_s']:.3f} | {1e3 * row['thread_seconds_per_step_max']:.1f} | "
              f"{1e3 * row['compute_seconds_per_step_mean']:.1f} | "
              f"{1e3 * row['compressor_seconds_per_step_mean']:.1f} | "
              f"{1e3 * row['compressor_seconds_busiest_rank']:.1f} | "
              f"{row['wire_bytes_per_rank_step_mean'] / 1e6:.3f} | {row['intra_bytes_per_rank_step_mean'] / 1e6:.3f} | "
              f"{'-' if nic is None else f'{nic / 1e6:.3f}'} | {'yes' if row['replicas_identical'] else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--link", default="100mbit", help="rate out of each node (tc tbf), or 'none' for loopback")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["cltk", "cltk_hier"], choices=sorted(CONFIGS))
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the configurations, alternating, this often")
    parser.add_argument("--warmup", type=int, default=3, help="at least 3: compression starts at step 2")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, help="write the summary and raw per-rank figures as JSON")
    args = parser.parse_args()
    if args.worker is not None:
        run_rank(args.worker)
        sys.stdout.flush()
        os._exit(0)  # skip gloo teardown (see bench.worker)
    if args.warmup < 3 or args.steps < 1 or args.rounds < 1 or args.nodes < 2 or args.per_node < 1:
        parser.error("need --warmup >= 3, --steps >= 1, --rounds >= 1, --nodes >= 2, --per-node >= 1")
    emulate = args.link != "none"
    if emulate:
        ok, why = can_emulate()
        if not ok:
            parser.error(f"cannot emulate {args.link}: {why} (use --link none)")
    where = (f"{args.nodes} nodes x {args.per_node} processes, {args.model} (batch {args.batch_size}/rank), CLT-k "
             f"{args.ratio:g}, " + (f"emulated {args.link} out of each node (netns + veth + tc tbf), loopback inside"
                                    if emulate else "loopback"))
    with tempfile.TemporaryDirectory(prefix="hierarchy-link-") as tmp:
        spec = {"nodes": args.nodes, "per_node": args.per_node, "configs": args.configs, "model": args.model,
                "rounds": args.rounds,
                "batch_size": args.batch_size, "ratio": args.ratio, "bucket_cap_mb": args.bucket_cap_mb,
                "steps": args.steps, "warmup": args.warmup, "out_dir": tmp}
        with EmulatedLink(args.nodes, args.link) if emulate else nullcontext() as link:
            ranks = launch(spec, link, args.timeout)
    summary = summarise(ranks, args.per_node)
    report(summary, where)
    if args.out is not None:
        args.out.write_text(json.dumps({"setup": where, "summary": summary, "raw": ranks}, indent=1))


if __name__ == "__main__":
    main()
