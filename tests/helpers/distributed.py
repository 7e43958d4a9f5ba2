"""The tests' multi-process runner: :mod:`lightning_gradcomp.gloo_workers` (also used by the benchmarks)."""

from __future__ import annotations

from lightning_gradcomp.gloo_workers import free_port, run_workers

__all__ = ["free_port", "run_workers"]
