"""Four CPU processes train a small Transformer-like MLP as 2 replicas x 2 shards: FSDP2 inside each pair, CLT-k 1%
across the pairs (GradCompFSDPStrategy).

    python examples/fsdp_hsdp.py [COMPRESSOR] [SHARD_SIZE]   # e.g. cltk 2, powersgd 2, qsgd 1, none 2

Each rank prints the bytes it sent per step across replicas (compressed) against native HSDP's all-reduce, and the
bytes inside its shard group (FSDP2's all-gathers and reduce-scatters). Nothing is written to the current folder.
"""

import sys
import tempfile

import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import GradCompFSDPStrategy


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(pl.LightningModule):
    def __init__(self, width=64, depth=4):
        super().__init__()
        self.blocks = torch.nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = torch.nn.Linear(width, 4)

    def configure_model(self):  # shard each block over this replica's shard group, then the rest
        for block in self.blocks:
            fully_shard(block, mesh=self.device_mesh["shard"])
        fully_shard(self, mesh=self.device_mesh["shard"])

    def forward(self, x):  # FSDP2 gathers the root's own parameters (the head) in forward: call self(x)
        return self.head(self.blocks(x))

    def training_step(self, batch, _):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class PrintBytes(pl.Callback):
    def on_train_end(self, trainer, pl_module):  # on every rank
        s = trainer.strategy.comm_stats
        steps = max(s.steps, 1)
        print(f"rank {trainer.global_rank}: across replicas {s.wire_bytes / steps:,.0f} B/step vs native HSDP "
              f"{s.dense_bytes / steps:,.0f}; inside the shard group {s.intra_bytes / steps:,.0f} B/step")


def main(compressor="cltk", shard_size=2, devices=4, max_epochs=2, start_method="popen"):
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()), batch_size=16)
    strategy = GradCompFSDPStrategy(compressor=compressor, shard_size=shard_size, start_method=start_method)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=max_epochs,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=root, callbacks=[PrintBytes()])
        trainer.fit(Net(), data)
    return trainer


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cltk", int(sys.argv[2]) if len(sys.argv) > 2 else 2)
