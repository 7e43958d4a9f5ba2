import sys, torch, lightning.pytorch as pl  # noqa: E401 - `python examples/quickstart.py [compressor]`
from torch.utils.data import DataLoader, TensorDataset
from lightning_gradcomp import GradCompStrategy

class MLP(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    def training_step(self, batch, _):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

if __name__ == "__main__":
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()), batch_size=32)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=2, logger=False, enable_progress_bar=False,
                         strategy=GradCompStrategy(compressor=sys.argv[1] if len(sys.argv) > 1 else "topk"))
    trainer.fit(MLP(), data)
    s = trainer.strategy.comm_stats
    print(f"rank {trainer.global_rank}: {s.wire_bytes / s.steps:,.0f} B/step sent vs dense {s.dense_bytes / s.steps:,.0f}")
