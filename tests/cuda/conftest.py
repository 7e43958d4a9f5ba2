"""CUDA tests: decide whether a GPU is there without initialising CUDA in the pytest process.

The multi-rank checks fork their ranks (``run_workers``) and the Lightning fits run in subprocesses; a parent that
had initialised the CUDA driver could not hand CUDA to a forked child. PyTorch's NVML-based check answers
``torch.cuda.is_available()`` without that initialisation; it is read on each call, so setting it here, before the
test modules are collected, covers their skip marks.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
