"""Compressed FSDP2 vs native HSDP on emulated nodes: bytes across nodes on the wire, step time.

N nodes of L processes (default 2 x 2), set up as ``hierarchy_link.py`` does: each *node* is one network namespace
(``lightning_gradcomp.bench.netem.EmulatedLink``) whose veth is rate-limited with ``tc tbf``; the node's L processes
share the namespace, so traffic between them goes over loopback and only inter-node traffic crosses the shaped
veth; one ``torchrun`` per node inside its namespace, gloo bound to the veth (``GLOO_SOCKET_IFNAME``). Each process
trains the bench transformer (``lightning_gradcomp.bench.models``; one torch thread) under FSDP2 without Lightning,
each ``TransformerEncoderLayer`` and the root ``fully_shard``-ed, SGD, in these configurations:

* ``hsdp``: native HSDP, ``fully_shard`` on FSDP2's 2-D mesh ``("replicate", "shard") = (N, L)``: FSDP2's own
  reduce-scatter inside the node, then its all-reduce across nodes;
* ``fsdp_none``: the library's front-end, ``fully_shard`` on the 1-D shard mesh inside the node plus
  ``FSDPReplicaReduction`` with ``NoCompression`` across nodes (should send what ``hsdp`` sends);
* ``scalecom``: the same with CLT-k 1% (the ``scalecom_fsdp`` preset);
* ``powersgd``: the same with PowerSGD rank 4 (the ``powersgd_fsdp`` preset).

The replica reduction is built by ``GradCompFSDPStrategy.make_reduction`` from the preset's strategy, so what is
measured is what the strategy runs. Measured per configuration, over ``--steps`` steps after ``--warmup``, in
``--rounds`` round-robin blocks:

* the veth's ``tx_bytes``/``tx_packets`` of every node (read by its local rank 0 between two barriers, the barriers'
  own traffic subtracted, TCP/IP headers removed as in ``bench.worker``): the real inter-node payload per node and
  step;
* ``CommStats`` of the replica reduction: ``wire_bytes`` (across replicas) and ``intra_bytes`` (the shard group's
  collectives, by formula) per rank; for ``hsdp``, which has no reduction, the same formulas applied to its
  reduce-scatter outputs (modelled);
* the step time (slowest rank, median).

    python benchmarks/fsdp_link.py [--link 100mbit] [--nodes 2] [--per-node 2] [--steps 10] [--rounds 3]

``--link none`` runs the same processes on loopback in the root namespace (no interface counters).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from hierarchy_link import launch, merge_rounds  # benchmarks/ (the script's folder, on sys.path)
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_gradcomp.advise.fsdp import shard_units
from lightning_gradcomp.bench.models import load_workload
from lightning_gradcomp.bench.netem import EmulatedLink, can_emulate
from lightning_gradcomp.bench.worker import _barrier_tx, _iface_tx, _run_steps, header_bytes_per_packet
from lightning_gradcomp.comm import Comm, all_gather_bytes, all_reduce_bytes
from lightning_gradcomp.fsdp_reduction import fsdp_modules, replicate_group

__all__ = ["CONFIGS", "hsdp_modelled_bytes", "summarise"]

CONFIGS: dict[str, Optional[str]] = {  # name: the GradCompFSDPStrategy preset of its replica reduction (None: native)
    "hsdp": None,
    "fsdp_none": "gradcomp_fsdp",
    "scalecom": "scalecom_fsdp",
    "powersgd": "powersgd_fsdp",
}


# ---------------------------------------------------------------------------------------------- worker
def _shard(model: nn.Module, mesh: DeviceMesh) -> None:
    """``fully_shard`` every transformer block (or, in a model without any, every ``Linear``), then the root: the
    rule ``advise --fsdp`` calibrates with (:func:`lightning_gradcomp.advise.fsdp.shard_units`)."""
    shard_units(model, mesh)


def hsdp_modelled_bytes(model: nn.Module, replicas: int) -> tuple[int, int]:
    """Per rank and step, ``(across replicas, inside the shard group)``: native HSDP's all-reduce of each module's
    reduce-scatter output, and the shard group's reduce-scatters and all-gathers, by the formulas that
    ``FSDPReplicaReduction`` counts with (:mod:`lightning_gradcomp.comm`). Call after the first step (FSDP2's lazy
    initialisation decides which modules reshard after forward)."""
    wire = intra = 0
    for module in fsdp_modules(model):
        for group in module._get_fsdp_state()._fsdp_param_groups:
            size = group.mesh_info.shard_mesh_size
            numel = sum(fp.padded_sharded_param_size.numel() for fp in group.fsdp_params
                        if fp.sharded_param.requires_grad)
            nbytes = numel * group.fsdp_params[0].sharded_param.element_size()
            wire += all_reduce_bytes(nbytes, replicas)
            if size > 1:
                gathers = 1 + (group.post_forward_mesh_info is not None)  # forward, and backward after a reshard
                intra += all_gather_bytes(nbytes, size) * (1 + gathers)  # the reduce-scatter, the all-gathers
    return wire, intra


def _measure(key: str, spec: dict[str, Any], iface: Optional[str], mesh: DeviceMesh, group: Any) -> dict[str, Any]:
    workload = load_workload(spec["model"], spec["batch_size"])
    preset = CONFIGS[key]
    _shard(workload, mesh if preset is None else mesh["shard"])
    opt = torch.optim.SGD(workload.parameters(), lr=0.01)
    reduction = None
    if preset is not None:
        strategy = StrategyRegistry.get(preset)
        names = {id(p): n for n, p in workload.named_parameters()}
        reduction = strategy.make_reduction(Comm(group), names, torch.device("cpu"))
        reduction.install(workload)
        reduction.attach_optimizer(opt)

    def step() -> None:
        workload().backward()
        opt.step()
        opt.zero_grad()

    def snapshot() -> dict[str, float]:
        tx, packets = _iface_tx(iface)
        stats = reduction.stats if reduction is not None else None
        return {"wire": stats.wire_bytes if stats else 0, "intra": stats.intra_bytes if stats else 0,
                "dense": stats.dense_bytes if stats else 0, "tx": tx, "packets": packets}

    n = spec["steps"]
    _run_steps(step, spec["warmup"], 0)
    dist.barrier()  # the warm-up's last packets, still queued on a link, are not counted as barrier bytes
    barrier_bytes, barrier_packets = _barrier_tx(iface, n + 1)  # the measurement's own barriers
    start = snapshot()
    times, _ = _run_steps(step, 0, n)
    dist.barrier()  # every process of the node has sent this step's bytes
    end = snapshot()
    if reduction is None:
        wire, intra = hsdp_modelled_bytes(workload, spec["nodes"])
        dense = wire
    else:
        wire, intra, dense = ((end[k] - start[k]) / n for k in ("wire", "intra", "dense"))
    weights = torch.cat([p.full_tensor().detach().reshape(-1) for p in workload.parameters()])  # inside the node
    frames = end["tx"] - start["tx"] - barrier_bytes
    packets = end["packets"] - start["packets"] - barrier_packets
    return {
        "step_times": times,
        "wire_bytes_per_step": wire,
        "intra_bytes_per_step": intra,
        "dense_bytes_per_step": dense,
        "wire_bytes_modelled": reduction is None,
        "nic_tx_payload_bytes_per_step": (frames - packets * header_bytes_per_packet()) / n if iface else None,
        "params": sum(p.numel() for p in workload.parameters()),
        "weights_sha256": hashlib.sha256(weights.numpy().tobytes()).hexdigest(),
    }


def run_rank(spec_path: str) -> None:
    """One process: every configuration in turn, ``rounds`` times; writes ``<out_dir>/rank<r>.json``."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["timeout"]))
    local = dist.get_rank() % spec["per_node"]
    iface = os.environ.get("GLOO_SOCKET_IFNAME") if local == 0 else None  # one reader per node's NIC
    mesh = init_device_mesh("cpu", (spec["nodes"], spec["per_node"]), mesh_dim_names=("replicate", "shard"))
    group = replicate_group(spec["per_node"])  # the replica reduction's own group, as the strategy makes it
    rounds: dict[str, list[dict[str, Any]]] = {key: [] for key in spec["configs"]}
    for _ in range(spec["rounds"]):  # configurations alternate, so a change of machine load hits all alike
        for key in spec["configs"]:
            rounds[key].append(_measure(key, spec, iface, mesh, group))
    results = {"rank": dist.get_rank(), "configs": {key: merge_rounds(rows) for key, rows in rounds.items()}}
    dist.barrier()
    Path(spec["out_dir"], f"rank{results['rank']}.json").write_text(json.dumps(results))


# ---------------------------------------------------------------------------------------------- parent
def summarise(ranks: list[dict[str, Any]], per_node: int) -> dict[str, dict[str, Any]]:
    """Per configuration: slowest rank's median step time, bytes per rank and per NIC, and the ratios against
    ``hsdp`` (when it was run): ``*_fewer_than_hsdp`` = hsdp's bytes / these, ``step_time_vs_hsdp`` = this / hsdp's."""
    out: dict[str, dict[str, Any]] = {}
    for key in ranks[0]["configs"]:
        rows = [r["configs"][key] for r in ranks]
        steps = [max(times) for times in zip(*(row["step_times"] for row in rows))]
        nic = [row["nic_tx_payload_bytes_per_step"] for i, row in enumerate(rows) if i % per_node == 0]
        out[key] = {
            "step_time_median_s": statistics.median(steps),
            "wire_bytes_per_rank_step_mean": statistics.mean(row["wire_bytes_per_step"] for row in rows),
            "wire_bytes_modelled": rows[0]["wire_bytes_modelled"],
            "dense_bytes_per_rank_step_mean": statistics.mean(row["dense_bytes_per_step"] for row in rows),
            "intra_bytes_per_rank_step_mean": statistics.mean(row["intra_bytes_per_step"] for row in rows),
            "nic_tx_payload_bytes_per_node_step": None if None in nic else statistics.mean(nic),
            "params": rows[0]["params"],
            "replicas_identical": len({row["weights_sha256"] for row in rows}) == 1,
        }
    base = out.get("hsdp")
    for row in out.values() if base is not None else ():
        row["step_time_vs_hsdp"] = row["step_time_median_s"] / base["step_time_median_s"]
        for ratio, figure in (("wire", "wire_bytes_per_rank_step_mean"), ("nic", "nic_tx_payload_bytes_per_node_step")):
            row[f"{ratio}_fewer_than_hsdp"] = _ratio(base[figure], row[figure])
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b <= 0 else a / b


def _fmt(value: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def report(summary: dict[str, dict[str, Any]], where: str) -> None:
    """A markdown table."""
    print(f"\n{where}\n")
    print("| config | step s (median, slowest rank) | step vs hsdp | NIC tx payload MB/node/step | fewer than hsdp "
          "(NIC) | across nodes MB/rank/step (CommStats) | fewer than hsdp (CommStats) | intra-node MB/rank/step "
          "| replicas identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, row in summary.items():
        wire = _fmt(row["wire_bytes_per_rank_step_mean"], ".3f", 1e-6) + (" (modelled)" if row["wire_bytes_modelled"]
                                                                             else "")
        print(f"| {key} | {row['step_time_median_s']:.3f} | {_fmt(row.get('step_time_vs_hsdp'), '.2f')} | "
              f"{_fmt(row['nic_tx_payload_bytes_per_node_step'], '.3f', 1e-6)} | "
              f"{_fmt(row.get('nic_fewer_than_hsdp'), '.1f')}x | {wire} | "
              f"{_fmt(row.get('wire_fewer_than_hsdp'), '.1f')}x | {row['intra_bytes_per_rank_step_mean'] / 1e6:.3f} | "
              f"{'yes' if row['replicas_identical'] else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--link", default="100mbit", help="rate out of each node (tc tbf), or 'none' for loopback")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--model", default="transformer", choices=["transformer", "mlp", "mlp-small"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the configurations, alternating, this often")
    parser.add_argument("--warmup", type=int, default=3, help="at least 3: compression starts at step 2")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=Path("fsdp_link.json"),
                        help="the summary and raw per-rank figures as JSON (default: ./fsdp_link.json)")
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
    where = (f"{args.nodes} nodes x {args.per_node} processes, FSDP2 {args.model} (batch {args.batch_size}/rank), "
             + (f"emulated {args.link} out of each node (netns + veth + tc tbf), loopback inside"
                if emulate else "loopback"))
    with tempfile.TemporaryDirectory(prefix="fsdp-link-") as tmp:
        spec = {"nodes": args.nodes, "per_node": args.per_node, "configs": args.configs, "model": args.model,
                "rounds": args.rounds, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                "timeout": args.timeout, "out_dir": tmp}
        with EmulatedLink(args.nodes, args.link) if emulate else nullcontext() as link:
            ranks = launch(spec, link, args.timeout, Path(__file__))
    summary = summarise(ranks, args.per_node)
    report(summary, where)
    args.out.write_text(json.dumps({"setup": where, "argv": sys.argv[1:], "summary": summary, "raw": ranks},
                                   indent=1))
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
