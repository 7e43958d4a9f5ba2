#!/usr/bin/env bash
# The prepared GPU check (shared/design/GPU.md): one command on a lent GPU machine, <= 8 minutes, a short table last.
#   bash benchmarks/gpu_check.sh            # logs and JSON under $OUT (or ./gpu_check_out when OUT is unset)
# Steps: versions; the project installed without touching the image's packages; the native CPU kernel built once;
# tests/cuda (every compressor on CUDA tensors, no host syncs on the training thread, replicas identical at W = 2 on
# gloo with CUDA tensors, one bf16-mixed NCCL W = 1 Lightning fit per preset); each compressor's reduction timed in a
# DDP step on a ~110M-parameter Transformer against PyTorch's powerSGD_hook / fp16_compress_hook and one gradient copy.
# Without a CUDA device it says so, runs tests/cuda (which then skip) and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTORCH_NVML_BASED_CUDA_CHECK=1
status=0

echo "== machine"
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || echo "no nvidia-smi"
"$PY" -c "import sys, torch, lightning; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'| cuda', torch.version.cuda, '| lightning', lightning.__version__, '| gpu', torch.cuda.is_available())"
"$PY" -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton: none"

echo "== install"
# Always install: a bare `python -c "import lightning_gradcomp"` succeeds from the repository root (the current
# folder is on sys.path) although scripts and subprocesses started elsewhere would not find the package.
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { echo "install FAILED"; tail -20 "$OUT/install.log"; exit 1; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the same package whatever the image's site-packages hold
"$PY" -c "import lightning_gradcomp; print('lightning_gradcomp from', lightning_gradcomp.__file__)"
timeout 120 "$PY" -c "from lightning_gradcomp.functional import _native; print('native kernel:', 'built' if _native.load() else 'none (torch steps)')"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device: tests/cuda skip, no timings"
  "$PY" -m pytest -q tests/cuda 2>&1 | tail -3
  exit 0
fi

echo "== tests/cuda"
workers=$("$PY" -c "import os; print(max(1, min(8, (os.cpu_count() or 2) // 2)))")
timeout 220 "$PY" -m pytest -q -n "$workers" tests/cuda --junitxml="$OUT/cuda_tests.xml" -o junit_logging=system-out \
  >"$OUT/cuda_tests.log" 2>&1
rc=$?; [ $rc -ne 0 ] && status=1
grep -E "^(FAILED|ERROR)" "$OUT/cuda_tests.log" | cut -c1-220
tests_line=$(tail -1 "$OUT/cuda_tests.log")
echo "pytest rc=$rc: $tests_line"

echo "== reduction timings"
timeout 170 "$PY" benchmarks/gpu_reduction.py --json "$OUT/gpu_reduction.json" >"$OUT/gpu_reduction.log" 2>&1
rc=$?; [ $rc -ne 0 ] && { status=1; echo "gpu_reduction rc=$rc"; tail -25 "$OUT/gpu_reduction.log"; }

echo
echo "== summary ($(date -u +%FT%TZ))"
nvidia-smi --query-gpu=name --format=csv,noheader
echo "tests/cuda: $tests_line"
sed -n '/^NVIDIA\|^cpu,/,$p' "$OUT/gpu_reduction.log"
exit $status
