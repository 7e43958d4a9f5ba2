"""Emulated links: W network namespaces joined by veth pairs through a bridge, rate-limited with ``tc tbf``.

Linux and root only. Latency cannot be emulated on machines without ``sch_netem``; bandwidth can. Names
carry a unique prefix, and :class:`EmulatedLink` removes everything it made on exit, on Ctrl-C and on errors.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from types import FrameType, TracebackType
from typing import Optional

__all__ = ["EmulatedLink", "can_emulate", "parse_rate", "setup_commands", "teardown_commands"]

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)?bit$", re.IGNORECASE)
_SUBNET = "10.213.0"


def parse_rate(rate: str) -> float:
    """``"100mbit"`` -> 1e8 bits/s; raises ``ValueError`` for anything else."""
    match = _RATE.match(rate.strip())
    if not match:
        raise ValueError(f"`link` must look like 100mbit, 1gbit or 500kbit, got {rate!r}")
    scale = {"k": 1e3, "m": 1e6, "g": 1e9, None: 1.0}[match.group(2).lower() if match.group(2) else None]
    return float(match.group(1)) * scale


def can_emulate() -> tuple[bool, str]:
    """Whether namespaces can be made here, and why not."""
    if os.name != "posix" or not os.path.exists("/proc/net"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"missing tools: {', '.join(missing)} (Debian package iproute2)"
    return True, ""


def rank_address(rank: int) -> str:
    """The IPv4 address of ``rank`` inside its namespace."""
    return f"{_SUBNET}.{rank + 1}"


def setup_commands(prefix: str, world_size: int, rate: str) -> list[list[str]]:
    """The ``ip``/``tc`` commands creating the bridge, namespaces and shaped veths (pure, testable)."""
    parse_rate(rate)
    bridge = f"{prefix}br"
    cmds = [["ip", "link", "add", bridge, "type", "bridge"], ["ip", "link", "set", bridge, "up"]]
    for rank in range(world_size):
        ns, inner, outer = f"{prefix}ns{rank}", f"{prefix}v{rank}", f"{prefix}b{rank}"
        cmds += [
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", inner, "type", "veth", "peer", "name", outer],
            ["ip", "link", "set", inner, "netns", ns],
            ["ip", "link", "set", outer, "master", bridge],
            ["ip", "link", "set", outer, "up"],
            ["ip", "-n", ns, "addr", "add", f"{rank_address(rank)}/24", "dev", inner],
            ["ip", "-n", ns, "link", "set", inner, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            [
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                inner,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                "100ms",
            ],
        ]
    return cmds


def teardown_commands(prefix: str, world_size: int) -> list[list[str]]:
    """Commands removing everything :func:`setup_commands` made (veths go with their namespaces)."""
    return [["ip", "netns", "del", f"{prefix}ns{r}"] for r in range(world_size)] + [
        ["ip", "link", "del", f"{prefix}br"]
    ]


class EmulatedLink:
    """Context manager owning the namespaces of one benchmark run.

    Args:
        world_size: number of ranks (one namespace each).
        rate: ``tc`` rate per rank's outgoing link, e.g. ``"100mbit"``.
        prefix: unique name prefix (default: from the process id and a per-process counter, so a link ladder's
            next link never reuses the names of one the kernel is still tearing down: ``ip netns del`` removes
            the veths asynchronously); interface names stay <= 15 characters.
    """

    _made = 0  # links made by this process

    def __init__(self, world_size: int, rate: str, prefix: Optional[str] = None) -> None:
        self.world_size = world_size
        self.rate = rate
        if prefix is None:
            prefix = f"lgc{os.getpid() % 100000}{chr(ord('a') + EmulatedLink._made % 26)}"
            EmulatedLink._made += 1
        self.prefix = prefix
        self._old_handlers: dict[int, object] = {}

    def namespace(self, rank: int) -> str:
        """The namespace of ``rank``."""
        return f"{self.prefix}ns{rank}"

    def interface(self, rank: int) -> str:
        """The interface gloo must bind to in ``rank``'s namespace."""
        return f"{self.prefix}v{rank}"

    def __enter__(self) -> EmulatedLink:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            for cmd in setup_commands(self.prefix, self.world_size, self.rate):
                subprocess.run(cmd, check=True, capture_output=True, text=True)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: Optional[type], value: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def close(self) -> None:
        """Remove namespaces and bridge (errors for already-missing objects are ignored)."""
        for cmd in teardown_commands(self.prefix, self.world_size):
            subprocess.run(cmd, capture_output=True, text=True)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._old_handlers.clear()

    def exists(self) -> bool:
        """Whether any of this run's namespaces is still present."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return any(line.split()[0].startswith(self.prefix) for line in out.splitlines() if line.strip())
