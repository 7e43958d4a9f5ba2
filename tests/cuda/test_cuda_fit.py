"""One Lightning fit per preset on one GPU (bf16-mixed, NCCL at world size 1), each in its own process.

Skipped without a CUDA device. ``fit_one.py`` runs the fit and prints what it saw; this checks it: the fit reached its
last step, the weights stayed finite and on the GPU, the reduction path ran (collectives issued; the compressor ran on
the steps after the dense warm-up), and the compression state kept between steps lives on the GPU (a few scalars on
the host are allowed: step counters, seeds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_gradcomp.presets import PRESETS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SCRIPT = Path(__file__).with_name("fit_one.py")
HOST_ELEMENTS = 64  # a host tensor larger than this in the hook state would put a copy on the host path


@pytest.mark.parametrize("preset", sorted(p for p in PRESETS if not p.endswith("_fsdp")))  # 1 GPU: 1 replica
def test_preset_fits_on_one_gpu_in_bf16(preset: str) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), preset], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result))
    assert result["global_step"] == 24 and result["finite"] and result["on_gpu"], result
    if result["steps"] is not None and result["strategy"] == "GradCompStrategy":
        assert result["backend"] == "nccl" and result["steps"] == 24 and result["collectives"] > 0, result
        assert result["dense"] or result["compressed"] > 0, result
    big = [(name, n) for name, n in result["state_on_host"] if n > HOST_ELEMENTS]
    assert not big, f"compression state on the host: {big}"
