"""gloo's framing bytes per collective, from interface counters on an emulated link (Linux, root).

Runs W ranks in network namespaces (``lightning_gradcomp.bench.netem.EmulatedLink``), issues many all-reduces,
broadcasts and sparse all-reduces (a sparse gradient's: ``size / 16`` rows of 16 fp32, other rows on each rank) of
several sizes, and compares the TCP payload each rank's veth sent (tx bytes minus one Ethernet/IPv4/TCP header per
packet) with the formulas of ``lightning_gradcomp.comm``. The difference is what gloo adds per collective (message
headers, notifications; for the sparse all-reduce, the sizes it gathers first), which our byte accounting leaves
out:

    python benchmarks/gloo_framing.py --world-size 2
    python benchmarks/gloo_framing.py --world-size 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SIZES = (256, 2560, 25600, 256000)
"""fp32 elements per collective."""


def rank_main(repeats: int) -> None:
    """One rank: measure, then rank 0 prints every rank's payload per collective as JSON."""
    import torch
    import torch.distributed as dist

    from lightning_gradcomp.bench.worker import header_bytes_per_packet

    stats = f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics"

    def payload() -> int:
        with open(f"{stats}/tx_bytes") as b, open(f"{stats}/tx_packets") as p:
            return int(b.read()) - int(p.read()) * header_bytes_per_packet()

    dist.init_process_group("gloo")
    out = {}
    for size in SIZES:
        t = torch.zeros(size)
        rows = torch.randperm(size, generator=torch.Generator().manual_seed(dist.get_rank()))[: size // 16]
        sparse = torch.sparse_coo_tensor(rows[None], torch.ones(size // 16, 16), (size, 16)).coalesce()
        ops = (
            ("all_reduce", lambda: dist.all_reduce(t)),
            ("broadcast", lambda: dist.broadcast(t, 0)),
            ("sparse_all_reduce", lambda: dist.all_reduce(sparse.clone())),
        )
        for kind, op in ops:
            op()
            dist.barrier()
            start = payload()
            for _ in range(repeats):
                op()
            dist.barrier()  # every send of the last collective has left before the counter is read
            barrier = payload()
            dist.barrier()
            out[f"{kind}:{size}"] = (barrier - start - (payload() - barrier)) / repeats
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if dist.get_rank() == 0:
        print(json.dumps(gathered))
    dist.barrier()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.repeats)
        return 0
    from lightning_gradcomp.bench.netem import EmulatedLink, can_emulate, rank_address
    from lightning_gradcomp.bench.runner import free_port
    from lightning_gradcomp.comm import all_gather_bytes, all_reduce_bytes, broadcast_bytes

    formulas = {
        "all_reduce": lambda size: all_reduce_bytes(4 * size, world),
        "broadcast": lambda size: broadcast_bytes(4 * size, world),
        "sparse_all_reduce": lambda size: all_gather_bytes(size // 16 * (8 + 16 * 4), world),  # sparse_payload_bytes
    }

    ok, why = can_emulate()
    if not ok:
        print(f"cannot emulate a link here: {why}")
        return 1
    world, port = args.world_size, free_port()
    with EmulatedLink(world, args.link) as link:
        procs = [subprocess.Popen(["ip", "netns", "exec", link.namespace(r), sys.executable, __file__, "--rank-main",
                                   "--repeats", str(args.repeats)],
                                  env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_PORT": str(port),
                                       "MASTER_ADDR": rank_address(0), "GLOO_SOCKET_IFNAME": link.interface(r),
                                       "OMP_NUM_THREADS": "1"},
                                  stdout=subprocess.PIPE, text=True) for r in range(world)]
        outputs = [p.communicate()[0] for p in procs]
    per_rank = json.loads(outputs[0].strip().splitlines()[-1])
    print(f"W={world}: TCP payload per rank and collective (mean over ranks) vs our formula")
    print("| collective | fp32 elements | measured | formula | gloo framing |")
    print("|---|---|---|---|---|")
    for key in per_rank[0]:
        kind, size = key.split(":")
        formula = formulas[kind](int(size))
        measured = statistics.mean(r[key] for r in per_rank)
        print(f"| {kind} | {int(size):,} | {measured:,.0f} | {formula:,.0f} | {measured - formula:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
