"""One benchmark run (:func:`run_bench`): the options checked before any rank starts, ``W`` ranks of
:mod:`lightning_gradcomp.bench.worker` launched on loopback or an emulated link, their results summarised; and a
ladder of links (:func:`run_ladder`)."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Optional

from lightning_gradcomp.bench.configs import BASELINES, available_configs, build_strategy, is_config
from lightning_gradcomp.bench.launch import launch_ranks
from lightning_gradcomp.bench.models import check_model
from lightning_gradcomp.bench.netem import EmulatedLink, can_emulate, parse_rate
from lightning_gradcomp.bench.summary import recommend, summarise

__all__ = ["DEFAULT_CONFIGS", "check_links", "check_options", "run_bench", "run_ladder"]

DEFAULT_CONFIGS = ("ddp", "torch_fp16", "torch_powersgd", "gradcomp_fp16", "gradcomp_topk", "gradcomp_randomk")


def _launch(spec: dict[str, Any], link: Optional[EmulatedLink], timeout: float) -> list[dict[str, Any]]:
    return launch_ranks(
        spec,
        spec["world_size"],
        link,
        timeout,
        lambda path: [sys.executable, "-m", "lightning_gradcomp.bench.worker", str(path)],
        threads=spec.get("threads", 1),
    )


def run_bench(
    model: str = "mlp",
    world_size: int = 2,
    steps: int = 20,
    warmup: int = 5,
    configs: Sequence[str] = DEFAULT_CONFIGS,
    link: Optional[str] = None,
    bucket_cap_mb: Optional[float] = None,
    threads: int = 1,
    timeout: float = 1800.0,
    batch_size: Optional[int] = None,
    rounds: int = 1,
) -> dict[str, Any]:
    """Run the benchmark and return ``{"summary", "recommendation", "link", "raw"}``.

    ``rounds``: 1 runs each configuration's ``steps`` in one go, between two runs of the compute-only step; more
    cuts them into that many blocks, run round-robin with the compute-only step's blocks (every configuration
    resident at once), so that the machine's drift over the run falls on all of them alike.
    """
    check_options(model, world_size, steps, warmup, configs, bucket_cap_mb, threads, batch_size, rounds, [link or ""])
    note = "loopback (no link emulation requested)"
    emulate = False
    if link:
        ok, why = can_emulate()
        emulate = ok
        note = f"emulated {link} per rank (netns + veth + tc tbf)" if ok else f"loopback: cannot emulate {link}: {why}"
    with tempfile.TemporaryDirectory(prefix="lgc-bench-") as out_dir:
        spec = {
            "model": model,
            "world_size": world_size,
            "steps": steps,
            "warmup": warmup,
            "configs": list(configs),
            "bucket_cap_mb": bucket_cap_mb,
            "threads": threads,
            "out_dir": out_dir,
            "batch_size": batch_size,
            "rounds": rounds,
        }
        with EmulatedLink(world_size, link) if emulate and link else nullcontext() as emulated:
            raw = _launch(spec, emulated, timeout)
    summary = summarise(raw)
    summary["rounds"] = rounds
    return {"link": note, "model": model, "summary": summary, "recommendation": recommend(summary), "raw": raw}


def check_options(
    model: str,
    world_size: int,
    steps: int,
    warmup: int,
    configs: Sequence[str],
    bucket_cap_mb: Optional[float],
    threads: int,
    batch_size: Optional[int],
    rounds: int,
    links: Sequence[str] = (),
) -> None:
    """Raise ``ValueError`` for anything :func:`run_bench` refuses, before a rank starts: the numbers, the model, every
    configuration (its compressor's arguments built here) and every link of a ladder (``""`` and ``"loopback"``:
    none)."""
    unknown = [c for c in configs if not is_config(c)]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; available: {', '.join(available_configs())}")
    for name in configs:
        if name not in BASELINES:
            build_strategy(name)  # an argument its compressor refuses, here rather than in every rank
    check_links(links)
    check_model(model)  # here, not in the ranks after their imports
    if world_size < 2:
        raise ValueError(f"`world_size` must be >= 2, got {world_size}")
    if steps < 1 or warmup < 3:
        raise ValueError(
            f"`steps` must be >= 1 and `warmup` >= 3 (compression starts at step 2), got {steps}, {warmup}"
        )
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ValueError(f"`bucket_cap_mb` must be > 0 (MB) or None for each configuration's own, got {bucket_cap_mb}")
    if threads < 1:
        raise ValueError(f"`threads` must be >= 1, got {threads}")
    if not 1 <= rounds <= steps:
        raise ValueError(f"`rounds` must be between 1 and `steps` ({steps}), got {rounds}")


def check_links(links: Sequence[str]) -> None:
    """Raise ``ValueError`` unless every link is a rate such as ``100mbit`` (``""`` and ``"loopback"``: none)."""
    for link in links:
        if link and link != "loopback":
            parse_rate(link)


def run_ladder(links: Sequence[str], **kwargs: Any) -> dict[str, dict[str, Any]]:
    """:func:`run_bench` once per link (``"loopback"``: no emulation), in order; ``{link: result}``. Every link is
    checked before the first runs."""
    check_links(links)
    return {link: run_bench(link=None if link == "loopback" else link, **kwargs) for link in links}
