"""``lightning-gradcomp advise``: predicted step time of each configuration on a described (or probed) cluster."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Optional

from lightning_gradcomp.advise.costs import (
    Collective,
    Link,
    StepTrace,
    Topology,
    efficiency_curve,
    parse_link,
    predict,
    recommend,
    speedups,
)
from lightning_gradcomp.advise.fsdp import FSDP_DEFAULTS, NATIVE_HSDP

__all__ = ["DEFAULT_CONFIGS", "add_arguments", "build_report", "format_report", "run_command"]

DEFAULT_CONFIGS = (
    "ddp",
    "torch_fp16",
    "torch_powersgd",
    "gradcomp_fp16",
    "gradcomp_topk",
    "gradcomp_randomk",
    "scalecom",
    "qsgd",
    "powersgd_gc",
)
HIERARCHICAL_DEFAULTS = ("gradcomp_none+hier", "scalecom+hier")
"""Added to the defaults on several nodes of several processes."""

DEFAULT_INTER_LATENCY = 20e-6
"""Seconds per inter-node hop when ``--inter-node`` gives none (TCP over Ethernet: tens of us)."""
DEFAULT_INTRA = "100gbit,5us"
"""``--intra-node`` when not given (a PCIe-class link between the processes of a node)."""
CHART_NODES = tuple(2**i for i in range(11))  # 1 .. 1024


def _int_in(name: str, low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"`{name}` must be an integer from {low} to {high:,}, got {text!r}")
        return value

    return parse


def _link_arg(name: str, default_latency: float) -> Callable[[str], Link]:
    def parse(text: str) -> Link:
        try:
            return parse_link(text, default_latency, name)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def _model_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"`--model-arg` must look like KEY=VALUE (d_model=1024), got {text!r}")
    import yaml

    return key.strip(), yaml.safe_load(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``advise`` subcommand's options (each checked as it is parsed)."""
    parser.add_argument(
        "--model", default="transformer", help="a bench model (mlp, cnn, transformer...) or module:Class"
    )
    parser.add_argument("--batch-size", type=_int_in("--batch-size", 1, 2**20), default=None, help="samples per rank")
    parser.add_argument(
        "--model-arg",
        type=_model_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a built-in model's size, repeatable: --model-arg d_model=1024 --model-arg layers=24 (transformer)",
    )
    parser.add_argument("--nodes", type=_int_in("--nodes", 1, 1_000_000), default=None, help="N nodes (default 2)")
    parser.add_argument(
        "--procs-per-node", type=_int_in("--procs-per-node", 1, 1024), default=None, help="G processes per node"
    )
    parser.add_argument(
        "--inter-node",
        type=_link_arg("--inter-node", DEFAULT_INTER_LATENCY),
        default=None,
        help="BANDWIDTH[,LATENCY] of each node's NIC, e.g. 25gbit,10us or 100mbit (latency default 20us)",
    )
    parser.add_argument(
        "--intra-node",
        type=_link_arg("--intra-node", 5e-6),
        default=None,
        help=f"BANDWIDTH[,LATENCY] between the processes of a node (default {DEFAULT_INTRA})",
    )
    parser.add_argument(
        "--configs",
        default=None,
        help="comma-separated bench configurations (ddp, torch_fp16, torch_powersgd, any preset, preset@arg=value), "
        "a preset with +hier for hierarchical reduction, hsdp or a *_fsdp preset for FSDP2; default: "
        + ",".join(DEFAULT_CONFIGS),
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="compare FSDP2 configurations (each replica sharded over a node's processes, replicas across nodes): "
        "native HSDP and the *_fsdp presets (" + ", ".join(FSDP_DEFAULTS) + "), unless --configs names others",
    )
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket size (default: each its own)")
    parser.add_argument("--steps", type=_int_in("--steps", 1, 1000), default=5, help="calibration steps per config")
    parser.add_argument("--warmup", type=_int_in("--warmup", 3, 1000), default=3, help="unmeasured steps first (>= 3)")
    parser.add_argument(
        "--calibration-procs",
        type=_int_in("--calibration-procs", 1, 256),
        default=1,
        help="processes calibrating at once: the ranks that will share one machine's cores (CPU runs); default 1",
    )
    parser.add_argument("--threads", type=_int_in("--threads", 1, 1024), default=None, help="torch threads per process")
    parser.add_argument("--device", default=None, help="where to calibrate: cpu, cuda (default: cuda if available)")
    parser.add_argument(
        "--cpu-copies",
        choices=("auto", "on", "off"),
        default="auto",
        help="charge intra-node bytes to the computing cores (auto: when calibrating on a CPU; off: a CPU calibration "
        "standing in for GPUs)",
    )
    parser.add_argument("--chart", default=None, help="PNG of the predicted efficiency against nodes (1-1024)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="run as every rank of a torchrun/SLURM job: measure the links (ping-pong), then rank 0 advises",
    )
    parser.add_argument(
        "--probe-bytes", type=_int_in("--probe-bytes", 1024, 2**31), default=16 * 2**20, help="large probe message"
    )


def _configs(args: Any, topology: Topology) -> list[str]:
    if args.configs:
        return [c.strip() for c in args.configs.split(",") if c.strip()]
    if getattr(args, "fsdp", False):
        return list(FSDP_DEFAULTS)
    names = list(DEFAULT_CONFIGS)
    if topology.nodes > 1 and topology.procs_per_node > 1:
        names += HIERARCHICAL_DEFAULTS
    return names


def _collectives(trace: StepTrace) -> list[dict[str, Any]]:
    return [
        {"kind": i.kind, "bytes": i.nbytes, "group": i.group, "blocking": i.blocking}
        for b in trace.buckets
        for i in b.items
        if isinstance(i, Collective)
    ]


def build_report(
    traces: Mapping[str, StepTrace],
    topology: Topology,
    *,
    model: str = "",
    params: int = 0,
    device: str = "",
    procs: int = 1,
    baseline: Optional[str] = None,
) -> dict[str, Any]:
    """The JSON-able report: topology, each configuration's prediction, the recommendation (pure).

    ``baseline``: the dense configuration the speed-ups and the recommendation compare with; by default ``ddp``, or
    ``hsdp`` (native HSDP) when only FSDP2 configurations have a dense one."""
    if baseline is None:
        baseline = NATIVE_HSDP if NATIVE_HSDP in traces and "ddp" not in traces else "ddp"
    predictions = predict(traces, topology)
    vs_ddp = speedups(predictions, "ddp")
    vs_hsdp = speedups(predictions, NATIVE_HSDP)
    vs_psgd = speedups(predictions, "torch_powersgd")
    rows = {}
    for name, p in predictions.items():
        rows[name] = {
            "step_s": p.step,
            "scaling_efficiency": p.efficiency,
            "speedup_vs_ddp": vs_ddp.get(name),
            "speedup_vs_hsdp": vs_hsdp.get(name),
            "speedup_vs_torch_powersgd": vs_psgd.get(name),
            "nic_bytes_per_step": p.nic_bytes,
            "comm_s": p.comm,
            "exposed_s": p.exposed,
            "buckets": len(traces[name].buckets),
            "collectives": _collectives(traces[name]),
        }
    compute = next(iter(traces.values())).compute_only if traces else 0.0
    return {
        "model": model,
        "params": params,
        "device": device,
        "calibration_procs": procs,
        "topology": {
            "nodes": topology.nodes,
            "procs_per_node": topology.procs_per_node,
            "world_size": topology.world_size,
            "inter_node": {"bytes_per_s": topology.inter.bandwidth, "latency_s": topology.inter.latency},
            "intra_node": {"bytes_per_s": topology.intra.bandwidth, "latency_s": topology.intra.latency},
            "cpu_copies": topology.cpu_copies,
        },
        "compute_only_step_s": compute,
        "baseline": baseline,
        "configs": rows,
        "recommendation": recommend(predictions, baseline),
    }


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_report(report: Mapping[str, Any]) -> str:
    """The report as a text table plus the recommendation line (pure)."""
    topo = report["topology"]
    inter = Link(topo["inter_node"]["bytes_per_s"], topo["inter_node"]["latency_s"])
    intra = Link(topo["intra_node"]["bytes_per_s"], topo["intra_node"]["latency_s"])
    lines = [
        f"{report['model']} ({report['params']:,} params), {topo['nodes']} nodes x {topo['procs_per_node']} processes "
        f"(W = {topo['world_size']}); inter-node {inter.describe()}, intra-node {intra.describe()}"
        + ("; intra-node copies charged to the CPU cores" if topo.get("cpu_copies") else ""),
        f"calibrated on {report['device']} ({report['calibration_procs']} process(es) at once); compute-only step "
        f"{report['compute_only_step_s'] * 1e3:.1f} ms. PREDICTED figures (alpha-beta model), not measured:",
        "",
    ]
    baseline = report.get("baseline", "ddp")
    header = ("config", "step ms", "scaling eff.", f"vs {baseline}", "vs powerSGD_hook", "NIC MB/step", "comm ms",
              "exposed ms")  # fmt: skip
    rows = [header]
    ranked = sorted(report["configs"].items(), key=lambda kv: kv[1]["step_s"])
    for name, row in ranked:
        rows.append(
            (
                name,
                f"{row['step_s'] * 1e3:.1f}",
                f"{row['scaling_efficiency']:.0%}",
                _ratio(row.get(f"speedup_vs_{baseline}")),
                _ratio(row["speedup_vs_torch_powersgd"]),
                f"{row['nic_bytes_per_step'] / 1e6:,.3f}",
                f"{row['comm_s'] * 1e3:.1f}",
                f"{row['exposed_s'] * 1e3:.1f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [
        "",
        "comm ms: the collectives' time if nothing overlapped; exposed ms: what the step waits for beyond "
        "the calibrated step with free collectives",
        f"recommendation: {report['recommendation']}",
    ]
    return "\n".join(lines)


def chart(traces: Mapping[str, StepTrace], topology: Topology, path: str, best: int = 4) -> list[str]:
    """Write a PNG of the predicted scaling efficiency against nodes (1-1,024) for the ``best`` configurations at
    this topology, plus ``ddp``, ``hsdp`` and ``torch_powersgd`` when calibrated; the configurations drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    predictions = predict(traces, topology)
    drawn = sorted(predictions, key=lambda n: predictions[n].step)[:best]
    drawn += [n for n in ("ddp", NATIVE_HSDP, "torch_powersgd") if n in traces and n not in drawn]
    curves = efficiency_curve({n: traces[n] for n in drawn}, topology, CHART_NODES)
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for name, points in curves.items():
        ax.plot([n for n, _ in points], [100 * e for _, e in points], marker="o", markersize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"nodes ({topology.procs_per_node} processes each)")
    ax.set_ylabel("predicted scaling efficiency (%)")
    top = max(100 * e for points in curves.values() for _, e in points)
    ax.set_ylim(0, max(105.0, top + 5))  # above 100 %: calibration noise (a step faster than the compute-only one)
    ax.set_title(f"inter-node {topology.inter.describe()} (predicted)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def _probe(args: Any) -> Optional[tuple[int, int, Link, Optional[Link]]]:
    """Run the probe on every rank; on rank 0 ``(nodes, procs_per_node, inter, intra)``, elsewhere ``None``."""
    import torch
    import torch.distributed as dist

    from lightning_gradcomp.advise.probe import probe_links

    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        nodes, per_node, inter, intra = probe_links(args.probe_bytes, device=device)
        rank = dist.get_rank()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    if inter is None:
        raise ValueError("`--probe` found one node: nothing to measure between nodes (run it across >= 2 nodes)")
    return nodes, per_node, inter, intra


def _topology(args: Any) -> Optional[Topology]:
    """The topology from the arguments or the probe (``None`` on a probing rank other than 0)."""
    intra = args.intra_node or parse_link(DEFAULT_INTRA)
    if args.probe:
        probed = _probe(args)
        if probed is None:
            return None
        nodes, per_node, inter, measured_intra = probed
        print(
            f"probed: inter-node {inter.describe()}"
            + (f", intra-node {measured_intra.describe()}" if measured_intra else "")
        )
        return Topology(args.nodes or nodes, args.procs_per_node or per_node, inter, measured_intra or intra)
    if args.inter_node is None:
        raise ValueError("`--inter-node` is required (BANDWIDTH[,LATENCY], e.g. 25gbit,10us), or `--probe` in a job")
    return Topology(args.nodes or 2, args.procs_per_node or 1, args.inter_node, intra)


def check_arguments(args: Any, topology: Topology) -> list[str]:
    """The configurations to calibrate; raises ``ValueError`` naming the argument for anything refused."""
    from lightning_gradcomp.advise.calibrate import check_advise_config, check_model_args
    from lightning_gradcomp.bench.models import check_model

    check_model(args.model)
    check_model_args(args.model, dict(args.model_arg))
    configs = _configs(args, topology)
    if not configs:
        raise ValueError("`--configs` names no configuration")
    for name in configs:
        try:
            check_advise_config(name, topology.procs_per_node)
        except ValueError as err:
            raise ValueError(f"`--configs`: {err}") from None
    if args.bucket_cap_mb is not None and not args.bucket_cap_mb > 0:
        raise ValueError(f"`--bucket-cap-mb` must be > 0, got {args.bucket_cap_mb}")
    if args.chart and not Path(args.chart).resolve().parent.is_dir():
        raise ValueError(f"`--chart`: the folder of {args.chart} does not exist")
    return configs


def run_command(args: Any, parser: Optional[argparse.ArgumentParser] = None) -> int:
    """Run ``advise`` from parsed arguments: calibrate, predict, print (table or JSON), optionally chart."""
    import lightning_gradcomp  # noqa: F401 - declares every preset

    try:
        if args.probe and (args.nodes is not None or args.inter_node is not None):
            raise ValueError("`--probe` measures the job's links and nodes: leave out `--nodes` and `--inter-node`")
        topology = _topology(args)
        if topology is None:
            return 0  # a probing rank other than 0
        configs = check_arguments(args, topology)
    except ValueError as err:
        print(f"lightning-gradcomp advise: error: {err}", file=sys.stderr)
        return 2
    import torch

    from lightning_gradcomp.advise.calibrate import calibrate

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    calibration = calibrate(
        args.model,
        configs,
        topology,
        batch_size=args.batch_size,
        bucket_cap_mb=args.bucket_cap_mb,
        device=device,
        warmup=args.warmup,
        steps=args.steps,
        procs=args.calibration_procs,
        threads=args.threads,
        model_args=dict(args.model_arg),
    )
    topology = with_device(topology, calibration.device, getattr(args, "cpu_copies", "auto"))
    report = build_report(
        calibration.traces,
        topology,
        model=args.model,
        params=calibration.params,
        device=calibration.device,
        procs=args.calibration_procs,
    )
    if args.chart:
        report["chart"] = {"path": args.chart, "configs": chart(calibration.traces, topology, args.chart)}
    if args.json:
        print(json.dumps(report, indent=1, default=_finite))
    else:
        print(format_report(report))
    return 0


def with_device(topology: Topology, device: str, cpu_copies: str = "auto") -> Topology:
    """``topology`` whose ranks compute on ``device``: on ``"cpu"`` their cores also copy the intra-node bytes
    (:attr:`Topology.cpu_copies`), unless ``cpu_copies`` (``--cpu-copies``) says ``"on"`` or ``"off"``."""
    on = str(device).startswith("cpu") if cpu_copies == "auto" else cpu_copies == "on"
    return dataclasses.replace(topology, cpu_copies=on)


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)
