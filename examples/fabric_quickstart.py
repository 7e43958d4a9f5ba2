"""Two CPU processes train a small MLP with Lightning Fabric through a compression preset.

    python examples/fabric_quickstart.py [NAME]   # scalecom (default), gradcomp_topk, powersgd_gc, qsgd...

Gradients are accumulated over two micro-batches (``no_backward_sync``); each rank prints the bytes it sent per
step against dense DDP's, saves a checkpoint with its compression state (``fabric.save``) and loads it back
(``fabric.load``). The checkpoint goes to a temporary folder, removed at the end.
"""

import shutil
import sys
import tempfile

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

import lightning_gradcomp  # noqa: F401 - registers the presets as Fabric strategy names


def train(fabric, steps=8, accumulate=2):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)  # wraps in DDP and registers the compression hook
    x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    data = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=16))
    for i, (inputs, target) in zip(range(steps * accumulate), data):
        syncing = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not syncing):  # no communication on the other micro-batches
            loss = torch.nn.functional.cross_entropy(model(inputs), target)
            fabric.backward(loss / accumulate)
        if syncing:
            optimizer.step()  # also commits this step's compression state (error-feedback memories...)
            optimizer.zero_grad()
    s = fabric.strategy.comm_stats
    print(f"rank {fabric.global_rank}: {s.wire_bytes / s.steps:,.0f} B/step sent vs dense {s.dense_bytes / s.steps:,.0f}"
          f" ({s.steps} steps, {s.steps - s.compressed_steps} of them dense)")
    folder = fabric.broadcast(tempfile.mkdtemp() if fabric.is_global_zero else None)  # one folder for all ranks
    state = {"model": model, "optimizer": optimizer, "steps": steps}
    fabric.save(f"{folder}/last.ckpt", state)  # every rank's compression state goes to its own shard
    fabric.load(f"{folder}/last.ckpt", state)  # ... and comes back from it
    fabric.barrier()
    if fabric.is_global_zero:
        shutil.rmtree(folder)
    return s.state_dict()


def main(name="scalecom", devices=2, start_method="popen"):
    strategy = name if start_method == "popen" else f"{name}_{start_method}"
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    return fabric.launch(train)  # rank 0's stats


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "scalecom")
