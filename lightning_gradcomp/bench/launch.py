"""Launching ranks: ``W`` processes of one command (loopback, or each inside its host's namespace of an emulated
link), waited for together."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

from lightning_gradcomp.bench.netem import EmulatedLink, rank_address
from lightning_gradcomp.gloo_workers import free_port

__all__ = ["launch_ranks", "wait_all"]


def wait_all(procs: Sequence[subprocess.Popen], timeout: float, what: str) -> None:
    """Wait for every process (all are killed once ``timeout`` seconds have passed).

    Raises:
        RuntimeError: a process exited with a non-zero code; the message names ``what`` and the codes.
    """
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise RuntimeError(f"{what} exited with codes {codes}")


def launch_ranks(
    spec: dict[str, Any],
    world: int,
    link: Optional[EmulatedLink],
    timeout: float,
    command: Callable[[Path], list[str]],
    host_of: Callable[[int], int] = lambda rank: rank,
    threads: int = 1,
) -> list[dict[str, Any]]:
    """Run ``world`` processes of ``command(spec_path)`` (env ``RANK``, ``WORLD_SIZE``, ``MASTER_*``), each inside the
    namespace of host ``host_of(rank)`` of ``link`` when given; return their ``<out_dir>/rank<r>.json`` files.

    Raises:
        RuntimeError: a rank exited with a non-zero code (all ranks are killed after ``timeout`` seconds).
    """
    port = free_port()
    spec_path = Path(spec["out_dir"]) / "spec.json"
    spec_path.write_text(json.dumps(spec))
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_PORT": str(port),
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": str(threads),
        }
        cmd = command(spec_path)
        if link is not None:
            env.update(MASTER_ADDR=rank_address(0), GLOO_SOCKET_IFNAME=link.interface(host_of(rank)))
            cmd = ["ip", "netns", "exec", link.namespace(host_of(rank)), *cmd]
        procs.append(subprocess.Popen(cmd, env=env))
    wait_all(procs, timeout, "benchmark ranks")
    return [json.loads((Path(spec["out_dir"]) / f"rank{r}.json").read_text()) for r in range(world)]
