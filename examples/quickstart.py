"""Two CPU processes train a small MLP through any name that ``lightning-gradcomp list`` prints.

    python examples/quickstart.py [NAME]   # a strategy name (scalecom, gradcomp_topk, diloco...) or a compressor (topk)

Each rank prints the bytes it sent per step against dense DDP's. Nothing is written to the current folder: no
logger, no checkpoints, and Lightning's root folder is a temporary one, removed at the end.
"""

import sys
import tempfile

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import GradCompStrategy


class MLP(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))

    def configure_model(self):  # the FSDP2 names (*_fsdp) give a device mesh: shard inside each replica
        if self.device_mesh is not None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["shard"])

    def training_step(self, batch, _):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class PrintBytes(pl.Callback):
    def on_train_end(self, trainer, pl_module):  # on every rank, in the process that trained
        s = trainer.strategy.comm_stats
        steps = max(s.steps, 1)
        print(f"rank {trainer.global_rank}: {s.wire_bytes / steps:,.0f} B/step sent vs dense {s.dense_bytes / steps:,.0f}"
              f" (averaged over all {s.steps} steps, {s.steps - s.compressed_steps} of them dense)")


def strategy_for(name, start_method="popen"):
    """A strategy name as it is (``_spawn``/``_fork`` added for another launcher), else a compressor name."""
    if name.lower() in StrategyRegistry:
        return name if start_method == "popen" else f"{name}_{start_method}"
    return GradCompStrategy(compressor=name, start_method=start_method)  # an unknown name: ValueError listing them


def main(name="topk", devices=2, max_epochs=2, start_method="popen"):
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()), batch_size=32)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(accelerator="cpu", devices=devices, max_epochs=max_epochs, default_root_dir=root,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, strategy=strategy_for(name, start_method),
                             callbacks=[PrintBytes()])
        trainer.fit(MLP(), data)
    return trainer


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "topk")
