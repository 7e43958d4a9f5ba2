"""``lightning-gradcomp advise`` against the bench: predicted and measured step times, side by side.

For one setting (model, world size or nodes x processes, emulated link) this script

1. measures: runs ``lightning-gradcomp bench`` (flat), ``benchmarks/hierarchy_link.py`` (``--nodes N
   --per-node G``) or ``benchmarks/fsdp_link.py`` (``--fsdp``: native HSDP and the ``*_fsdp`` presets) ``--runs``
   times on the emulated link, each writing a JSON file under ``--out`` (skipped for files already there);
2. predicts: calibrates every configuration on this machine with ``advise``'s calibration (as many processes at
   once as the bench's ranks, which share this machine's cores, one torch thread each) and prices its step on the
   same topology;
3. prints a markdown table: predicted step, measured step (median of the runs' medians, and their min-max), the
   error, and both rankings, with the pairs of configurations the prediction orders against the measurement
   beyond the measured spread.

The link given to the model is the emulated one: ``tc tbf`` shapes Ethernet frames, so the TCP payload runs at
``rate * 1448 / 1514`` (one 66-byte Ethernet + IPv4 + TCP-with-timestamps header per 1448-byte segment), and its
256 KiB token bucket lets that much through at once after an idle period (``Link.burst``; ``--no-burst`` leaves it
out); its latency is ``--latency`` (measured with ``--probe``, which runs ``advise --probe`` on an emulated link).
Inside a node (``--per-node`` > 1) the processes talk over the namespace's loopback: ``--intra``.

    python benchmarks/advise_check.py --model transformer --world-size 2 --link 100mbit --out runs/
    python benchmarks/advise_check.py --model transformer --nodes 2 --per-node 2 --link 10mbit --out runs/
    python benchmarks/advise_check.py --fsdp --nodes 2 --per-node 2 --link 100mbit --steps 10 --out runs/
    python benchmarks/advise_check.py --probe 1gbit --nodes 2 --per-node 2      # the emulated link, measured
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from lightning_gradcomp.advise.calibrate import calibrate
from lightning_gradcomp.advise.command import build_report, with_device
from lightning_gradcomp.advise.costs import Link, Topology, parse_link
from lightning_gradcomp.bench.netem import EmulatedLink, can_emulate, parse_rate, rank_address
from lightning_gradcomp.bench.runner import free_port

GOODPUT = 1448 / (1514 + 66 / 2)
"""TCP payload bytes per byte that ``tc tbf`` counts: a 1448-byte segment travels in a 1514-byte frame (66 bytes of
Ethernet, IPv4 and TCP-with-timestamps headers), and a rank's egress also carries the ACKs of the stream it receives
(collectives send both ways at once): one 66-byte frame per two segments."""
BURST = 256 * 1024
"""The emulated links' token bucket (``bench.netem``: ``tbf ... burst 256kb``; tc's kb are 1,024 bytes)."""

FLAT_CONFIGS = (
    "ddp",
    "torch_fp16",
    "torch_powersgd",
    "gradcomp_fp16",
    "gradcomp_topk",
    "gradcomp_randomk",
    "scalecom",
    "qsgd",
)
HIER_CONFIGS = {"ddp": "gradcomp_none", "ddp_hier": "gradcomp_none+hier", "cltk": "scalecom", "cltk_hier": "scalecom+hier"}
"""``hierarchy_link.py``'s configurations and the same configurations in ``advise``'s names."""
FSDP_CONFIGS = {"hsdp": "hsdp", "fsdp_none": "gradcomp_fsdp", "scalecom": "scalecom_fsdp", "powersgd": "powersgd_fsdp"}
"""``fsdp_link.py``'s configurations (``--fsdp``) and the same configurations in ``advise``'s names."""

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- measuring
def bench_command(args: argparse.Namespace, out: Path) -> list[str]:
    """The measuring command of one run."""
    if args.fsdp:
        return [
            sys.executable,
            str(ROOT / "benchmarks" / "fsdp_link.py"),
            *("--link", args.link, "--nodes", str(args.nodes), "--per-node", str(args.per_node)),
            *("--configs", *FSDP_CONFIGS, "--model", args.model, "--batch-size", str(args.batch_size or 8)),
            *("--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", "1", "--out", str(out)),
        ]
    if args.per_node > 1:
        return [
            sys.executable,
            str(ROOT / "benchmarks" / "hierarchy_link.py"),
            "--link",
            args.link,
            "--nodes",
            str(args.nodes),
            "--per-node",
            str(args.per_node),
            "--configs",
            *HIER_CONFIGS,
            "--model",
            args.model,
            "--batch-size",
            str(args.batch_size or 8),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--out",
            str(out),
        ]
    command = [sys.executable, "-m", "lightning_gradcomp.cli", "bench", "--model", args.model]
    command += ["--world-size", str(args.world_size), "--link", args.link, "--steps", str(args.steps)]
    command += ["--warmup", str(args.warmup), "--configs", ",".join(args.configs), "--json", str(out)]
    if args.batch_size:
        command += ["--batch-size", str(args.batch_size)]
    return command


def run_file(args: argparse.Namespace, run: int) -> Path:
    world = f"{args.nodes}x{args.per_node}" if args.per_node > 1 or args.fsdp else f"w{args.world_size}"
    world += "_fsdp" if args.fsdp else ""
    return Path(args.out) / f"{args.model}_{world}_{args.link}_run{run}.json"


def measure(args: argparse.Namespace, configs: list[str]) -> None:
    """Run the bench ``--runs`` times (files already there are kept), each followed by a calibration and prediction
    (``<run>.advise.json``): the machine's load then falls alike on the measured run and on its prediction."""
    for run in range(1, args.runs + 1):
        path = run_file(args, run)
        if path.exists():
            continue
        command = bench_command(args, path.with_suffix(".tmp"))
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        path.with_suffix(".tmp").rename(path)
        prediction_file(path).write_text(json.dumps(predicted(args, configs)))


def prediction_file(run: Path) -> Path:
    return run.with_name(run.stem + ".advise.json")


def median_report(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The first report with each configuration's step, exposed time and efficiency the median over ``reports``."""
    out = json.loads(json.dumps(reports[0]))
    for name, row in out["configs"].items():
        for key in ("step_s", "exposed_s", "scaling_efficiency"):
            row[key] = statistics.median(r["configs"][name][key] for r in reports)
    out["compute_only_step_s"] = statistics.median(r["compute_only_step_s"] for r in reports)
    return out


def measured_steps(args: argparse.Namespace, paths: Optional[list[Path]] = None) -> dict[str, list[float]]:
    """Per configuration (advise's names), the median step of each run found (seconds)."""
    out: dict[str, list[float]] = {}
    for path in paths if paths is not None else [run_file(args, r) for r in range(1, args.runs + 1)]:
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        if args.fsdp or args.per_node > 1:
            names = FSDP_CONFIGS if args.fsdp else HIER_CONFIGS
            for key, row in data["summary"].items():
                out.setdefault(names[key], []).append(row["step_time_median_s"])
        else:
            for name, row in data["summary"]["configs"].items():
                out.setdefault(name, []).append(row["step_time_median_s"])
    return out


# ---------------------------------------------------------------------------------------------- predicting
def topology(args: argparse.Namespace) -> Topology:
    inter = Link(parse_rate(args.link) / 8 * GOODPUT, args.latency, burst=BURST * GOODPUT if args.burst else 0.0)
    intra = parse_link(args.intra, name="--intra")
    if args.per_node > 1 or args.fsdp:
        return Topology(args.nodes, args.per_node, inter, intra)
    return Topology(args.world_size, 1, inter, intra)


def predicted(args: argparse.Namespace, configs: list[str]) -> dict[str, Any]:
    topo = topology(args)
    batch = args.batch_size or (8 if args.per_node > 1 or args.fsdp else None)
    cal = calibrate(
        args.model,
        configs,
        topo,
        batch_size=batch,
        procs=topo.world_size,
        threads=1,
        steps=args.calibration_steps,
        bucket_cap_mb=25.0 if args.per_node > 1 else None,  # hierarchy_link.py's buckets
    )
    topo = with_device(topo, cal.device)
    return build_report(cal.traces, topo, model=args.model, params=cal.params, device=cal.device, procs=topo.world_size)


# ---------------------------------------------------------------------------------------------- comparing
def inversions(pred: dict[str, float], runs: dict[str, list[float]]) -> list[tuple[str, str]]:
    """Pairs ``(a, b)`` predicted faster-first whose measured order is the other way beyond the spread: every run of
    ``a`` slower than every run of ``b``."""
    names = sorted((n for n in pred if runs.get(n)), key=pred.__getitem__)
    bad = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if min(runs[a]) > max(runs[b]):
                bad.append((a, b))
    return bad


def paired_errors(args: argparse.Namespace) -> dict[str, list[float]]:
    """Per configuration, each run's prediction (made right after it) against that run's median step."""
    out: dict[str, list[float]] = {}
    for run in range(1, args.runs + 1):
        path, pred = run_file(args, run), prediction_file(run_file(args, run))
        if not (path.exists() and pred.exists()):
            continue
        one = copy_args(args, runs=1)
        measured = measured_steps(one, [path])
        report = json.loads(pred.read_text())
        for name, steps in measured.items():
            if name in report["configs"]:
                out.setdefault(name, []).append(report["configs"][name]["step_s"] / steps[0] - 1)
    return out


def copy_args(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def compare(
    report: dict[str, Any],
    runs: dict[str, list[float]],
    bound: float = 0.2,
    paired: Optional[dict[str, list[float]]] = None,
) -> str:
    """A markdown table of predicted against measured steps (``paired``: per configuration, each run's error against
    the prediction made right after it)."""
    rows = report["configs"]
    pred = {n: r["step_s"] for n, r in rows.items()}
    measured_order = sorted((n for n in pred if runs.get(n)), key=lambda n: statistics.median(runs[n]))
    predicted_order = sorted(pred, key=pred.__getitem__)
    lines = [
        "| config | predicted ms | measured ms (median of runs; min-max) | error | link-bound | within 20 % | "
        "predicted rank | measured rank | error per run (paired) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in predicted_order:
        row = rows[name]
        m = runs.get(name)
        bound_by_link = row["exposed_s"] > 0.5 * row["step_s"]
        if m:
            med = statistics.median(m)
            err = pred[name] / med - 1
            cells = (
                f"{med * 1e3:.0f} ({min(m) * 1e3:.0f}-{max(m) * 1e3:.0f})",
                f"{err:+.0%}",
                "yes" if abs(err) <= bound else "no",
                str(measured_order.index(name) + 1),
            )
        else:
            cells = ("-", "-", "-", "-")
        pairs = (paired or {}).get(name)
        per_run = ", ".join(f"{e:+.0%}" for e in pairs) if pairs else "-"
        lines.append(
            f"| {name} | {pred[name] * 1e3:.0f} | {cells[0]} | {cells[1]} | {'yes' if bound_by_link else 'no'} | "
            f"{cells[2]} | {predicted_order.index(name) + 1} | {cells[3]} | {per_run} |"
        )
    bad = inversions(pred, runs)
    lines.append("")
    lines.append(
        "ranking: "
        + (
            "matches the measured one within the measured spread"
            if not bad
            else "inverted beyond the spread: " + ", ".join(f"{a} < {b}" for a, b in bad)
        )
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- probing
def probe(rate: str, nodes: int, per_node: int, probe_bytes: int) -> dict[str, Any]:
    """``advise --probe`` run by every process of an emulated ``nodes x per_node`` job; rank 0's JSON report."""
    ok, why = can_emulate()
    if not ok:
        raise SystemExit(f"cannot emulate {rate}: {why}")
    world = nodes * per_node
    port = free_port()
    argv = ["-m", "lightning_gradcomp.cli", "advise", "--probe", "--probe-bytes", str(probe_bytes), "--json"]
    argv += ["--model", "mlp-small", "--configs", "ddp", "--steps", "1", "--threads", "1"]
    with EmulatedLink(nodes, rate) as link, tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world):
            node = rank // per_node
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank % per_node),
                "LOCAL_WORLD_SIZE": str(per_node),
                "MASTER_ADDR": rank_address(0),
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": link.interface(node),
            }
            out = open(Path(tmp) / f"rank{rank}.out", "w")  # noqa: SIM115 - closed with the process
            command = ["ip", "netns", "exec", link.namespace(node), sys.executable, *argv]
            procs.append((subprocess.Popen(command, env=env, stdout=out), out))
        for proc, out in procs:
            proc.wait(timeout=1800)
            out.close()
        text = (Path(tmp) / "rank0.out").read_text()
    return json.loads(text[text.index("{") :])


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--world-size", type=int, default=2, help="flat: the bench's ranks")
    parser.add_argument("--nodes", type=int, default=2, help="with --per-node > 1: hierarchy_link.py's nodes")
    parser.add_argument("--per-node", type=int, default=1, help="processes per node (> 1: hierarchy_link.py)")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2: fsdp_link.py's native HSDP and *_fsdp presets")
    parser.add_argument("--link", default="100mbit")
    parser.add_argument("--latency", type=float, default=50e-6, help="seconds per hop on the emulated link (probed: 48 us)")
    parser.add_argument("--intra", default="25gbit,36us", help="loopback inside an emulated node (probed: 24.8 Gbit/s, 36 us)")
    parser.add_argument("--no-burst", dest="burst", action="store_false", help="model the link without tbf's bucket")
    parser.add_argument("--configs", default=",".join(FLAT_CONFIGS))
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=5, help="the bench's measured steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--calibration-steps", type=int, default=3)
    parser.add_argument("--out", default="advise_runs", help="folder of the bench's JSON files")
    parser.add_argument("--no-measure", action="store_true", help="compare with the runs already in --out")
    parser.add_argument("--measure-only", action="store_true", help="run the missing bench runs, predict nothing")
    parser.add_argument("--repredict", action="store_true",
                        help="with --no-measure: predict again after each saved run (a changed model), on this machine now")
    parser.add_argument("--probe", default=None, help="instead: probe this emulated rate with advise --probe")
    parser.add_argument("--probe-bytes", type=int, default=64 * 2**20)
    args = parser.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    if args.probe:
        report = probe(args.probe, args.nodes, args.per_node, args.probe_bytes)
        inter, intra = report["topology"]["inter_node"], report["topology"]["intra_node"]
        nominal = parse_rate(args.probe) / 8
        print(
            f"probed {args.probe} ({args.nodes} x {args.per_node}): inter-node {inter['bytes_per_s'] * 8 / 1e6:.1f} "
            f"Mbit/s payload ({inter['bytes_per_s'] / nominal:.3f} of the rate; TCP goodput {GOODPUT:.3f}), "
            f"latency {inter['latency_s'] * 1e6:.0f} us; intra-node {intra['bytes_per_s'] * 8 / 1e9:.2f} Gbit/s, "
            f"{intra['latency_s'] * 1e6:.0f} us"
        )
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    configs = list(HIER_CONFIGS.values()) if args.per_node > 1 else args.configs
    configs = list(FSDP_CONFIGS.values()) if args.fsdp else configs
    if not args.no_measure:
        measure(args, configs)
    if args.measure_only:
        return
    if args.repredict:
        for run in range(1, args.runs + 1):
            if run_file(args, run).exists():
                prediction_file(run_file(args, run)).write_text(json.dumps(predicted(args, configs)))
    after_runs = [prediction_file(run_file(args, r)) for r in range(1, args.runs + 1)]
    found = [json.loads(p.read_text()) for p in after_runs if p.exists()]
    report = median_report(found) if found else predicted(args, configs)
    print(f"predictions: {'median of the ' + str(len(found)) + ' made after each run' if found else 'one, now'}")
    runs = measured_steps(args)
    where = (
        f"{args.nodes} nodes x {args.per_node}" if args.per_node > 1 or args.fsdp else f"W = {args.world_size}"
    ) + f", {args.link}, {args.model}" + (", FSDP2" if args.fsdp else "")
    print(f"\n*{where}: predicted (advise) against measured ({len(next(iter(runs.values()), []))} runs)*\n")
    print(compare(report, runs, paired=paired_errors(args)))


if __name__ == "__main__":
    main()
