"""One preset's Lightning fit on one GPU: ``Trainer(accelerator="gpu", devices=1, precision="bf16-mixed")``.

Run as a script (``python tests/cuda/fit_one.py PRESET``) by ``test_cuda_fit.py``, one process per preset, so that
the pytest process never initialises CUDA. At one device Lightning's DDP family still builds a process group (NCCL
on a GPU, world size 1), wraps the model in DDP and runs the strategy's reduction path: the preset's strategy is built
with ``single_process="compress"`` where its class takes it (by default one process passes gradients through densely,
as DDP does; ``SwarmStrategy`` has no partner on one process and no such argument). The last line printed is a
JSON object: steps, compressed steps, collectives, bytes, whether the weights stayed finite and on the GPU, and the
hook state's tensors that live on the host (name and element count).
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gradcomp  # noqa: F401  (registers the presets)
from lightning_gradcomp.presets import PRESETS, preset_class

STEPS = 24


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(96, 512), nn.GELU(), nn.LayerNorm(512), nn.Linear(512, 384), nn.GELU(),
                                  nn.Linear(384, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class _HostState(pl.Callback):
    """At the end of training, before Lightning moves the model back to the CPU: where the weights are, and the live
    compression state's tensors (error-feedback memories, the compressor's attributes) on the host (``[name, numel]``)
    and on the GPU. (``state_dict()`` holds CPU copies by design, so the live objects are walked instead.)"""

    def __init__(self) -> None:
        self.host: list[tuple[str, int]] = []
        self.device_tensors = 0
        self.params_on_gpu = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.params_on_gpu = all(p.device.type == "cuda" for p in pl_module.parameters())
        hook = getattr(trainer.strategy, "hook", None)
        if hook is None:
            return
        self._walk("memory", getattr(getattr(hook, "memory", None), "memories", {}), 3)
        self._walk("compressor", vars(hook.compressor), 3)

    def _walk(self, name: str, value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            if value.device.type == "cuda":
                self.device_tensors += 1
            else:
                self.host.append((name, value.numel()))
        elif depth > 0 and isinstance(value, dict):
            for key, item in value.items():
                self._walk(f"{name}.{key}", item, depth - 1)
        elif depth > 0 and isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self._walk(f"{name}[{i}]", item, depth - 1)
        elif depth > 0 and hasattr(value, "__dict__") and type(value).__module__.startswith("lightning_gradcomp"):
            self._walk(name, vars(value), depth - 1)


def build(preset: str) -> pl.strategies.Strategy:
    """The preset's strategy, compressing on this one process where its class offers ``single_process``."""
    cls = preset_class(preset)
    kwargs = PRESETS[preset][1]()
    if "single_process" in inspect.signature(cls).parameters:
        kwargs["single_process"] = "compress"
    return cls(**kwargs)


def fit(preset: str) -> dict[str, Any]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(STEPS * 32, 96), torch.randint(0, 10, (STEPS * 32,)))
    model, probe = _Net(), _HostState()
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", strategy=build(preset),
                         max_steps=STEPS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[probe])
    start = time.perf_counter()
    trainer.fit(model, DataLoader(data, batch_size=32))
    torch.cuda.synchronize()
    stats = getattr(trainer.strategy, "comm_stats", None)
    params = list(model.parameters())  # back on the CPU after fit: Lightning's teardown moves the model there
    return {
        "preset": preset,
        "strategy": type(trainer.strategy).__name__,
        "global_step": trainer.global_step,
        "seconds": round(time.perf_counter() - start, 2),
        "steps": getattr(stats, "steps", None),
        "compressed": getattr(stats, "compressed_steps", None),
        "collectives": getattr(stats, "collectives", None),
        "wire_bytes": getattr(stats, "wire_bytes", None),
        "dense_bytes": getattr(stats, "dense_bytes", None),
        "dense": getattr(getattr(trainer.strategy, "compressor", None), "dense", None),
        "finite": all(bool(torch.isfinite(p).all()) for p in params),
        "on_gpu": probe.params_on_gpu,
        "state_on_gpu": probe.device_tensors,
        "state_on_host": probe.host,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
    }


if __name__ == "__main__":
    print(json.dumps(fit(sys.argv[1])), flush=True)
