"""The scenarios of the reliability tests: run descriptions and killing a rank mid-step.

Every run is W=2 independent forked rank processes (see ``launch.py``) fitting ``TinyNet`` for
``MAX_EPOCHS`` epochs of ``STEPS_PER_EPOCH`` batches. The killed run checkpoints after every epoch and its
``victim`` rank is SIGKILLed in the middle of step ``KILL_STEP``, inside the compression hook, after the
compressor issued its collectives; the last checkpoint before that is the one after step ``CKPT_STEP``.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from reliability.launch import launch, text

MAX_EPOCHS = 3
STEPS_PER_EPOCH = 4  # 64 samples, batch 8, 2 ranks
CKPT_STEP = 8  # end of epoch 1
KILL_STEP = 10  # third batch of epoch 2
SURFACE_SECONDS = 60.0
STARTUP_SECONDS = 300.0  # generous: the machine may be busy; not part of the 60 s bound
VICTIM = {"topk": 1, "cltk": 0, "powersgd": 1, "diana": 0, "signsgd": 1, "lgreco": 0, "swarm": 1}
"""Which rank is killed, per case: both rank 0 (hosting the rendezvous store) and rank 1 are covered."""


def config(out: Path, case: str, world: int = 2, **extra: Any) -> dict[str, Any]:
    """A run description for :func:`reliability.launch.rank_main`."""
    return {"case": case, "world": world, "out": str(out), "max_epochs": MAX_EPOCHS, **extra}


def errors(out: Path, world: int) -> str:
    """Every rank's recorded error, and the stacks of a rank that hung, for assertion messages."""
    return "\n".join(f"rank {r}: {text(out, 'error', r)[:2000]}{text(out, 'stack', r)[-4000:]}" for r in range(world))


@dataclass
class KilledRun:
    """What happened when a rank was SIGKILLed mid-step."""

    out: Path
    ckpt_dir: Path
    victim: int
    victim_code: Optional[int]
    survivor_code: Optional[int]
    surfaced_after: float
    leftovers: list[int]
    survivor_error: str


def kill_mid_step(out: Path, ckpt_dir: Path, case: str, victim: int, mode: str = "fork") -> KilledRun:
    """Run ``case`` until ``victim`` stalls inside step ``KILL_STEP``, SIGKILL it, watch the survivor."""
    cfg = config(out, case, ckpt_dir=str(ckpt_dir), pause={"rank": victim, "step": KILL_STEP})
    survivor = 1 - victim
    with launch(cfg, mode) as ranks:
        reached = ranks.wait_for_file(out / f"paused{victim}", STARTUP_SECONDS)
        assert reached, f"rank {victim} never reached step {KILL_STEP}:\n{errors(out, 2)}"
        ranks.signal(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        survivor_code = ranks.wait(survivor, SURFACE_SECONDS)
        surfaced_after = time.monotonic() - killed_at
        victim_code = ranks.wait(victim, 10.0)
        left = ranks.leftovers()
        error = text(out, "error", survivor) + (ranks.stderr(survivor) if mode == "subprocess" else "")
    return KilledRun(out, ckpt_dir, victim, victim_code, survivor_code, surfaced_after, left, error)
