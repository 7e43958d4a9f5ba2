"""What several benchmark scripts share: the repository root, the recipes' metrics and the Fashion-MNIST task.

Scripts import it as ``from _common import ...`` (``python benchmarks/<name>.py`` puts this folder on
``sys.path``; ``tests/benchmarks/conftest.py`` does the same for the tests). Importing it also puts the repository
root on ``sys.path``, so that ``recipes`` (a folder of the repository, not an installed package) can be imported.
The multi-process gloo runner is in the package: :mod:`lightning_gradcomp.gloo_workers`.
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# ---------------------------------------------------------------------------------------------- recipes
# task -> (summary metric key, its name in tables, scale to percent)
METRICS = {"image": ("val/acc1", "top-1 %", 100.0), "translation": ("val/exact", "exact match %", 100.0),
           "speech": ("val/wer", "digit/word error %", 100.0), "language": ("val/acc", "next-byte accuracy %", 100.0)}

# ---------------------------------------------------------------------------------------------- Fashion-MNIST task
# used by scalecom_fidelity.py, swarm_compare.py, swarm_link.py, localsgd_link.py and lgreco_compare.py
FMNIST = Path("/usr/share/datasets/fashion-mnist")


def _idx(path: Path) -> np.ndarray:
    raw = gzip.open(path).read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_data(train_size: int) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(name, x_train, y_train, x_test, y_test)``: images as ``(N, 1, 28, 28)`` floats.

    Fashion-MNIST (``/usr/share/datasets/fashion-mnist``, Debian ``dataset-fashion-mnist``; the first
    ``train_size`` training images, the full 10k test set), or scikit-learn's digits when it is absent.
    """
    if FMNIST.exists():
        xtr, ytr = _idx(FMNIST / "train-images-idx3-ubyte.gz"), _idx(FMNIST / "train-labels-idx1-ubyte.gz")
        xte, yte = _idx(FMNIST / "t10k-images-idx3-ubyte.gz"), _idx(FMNIST / "t10k-labels-idx1-ubyte.gz")
        name = f"Fashion-MNIST ({min(train_size, len(xtr))} of {len(xtr)} training images, {len(xte)} test)"
        xtr, ytr = xtr[:train_size], ytr[:train_size]
    else:  # sklearn digits, 8x8 upsampled to 28x28 by nearest neighbour (padded)
        from sklearn.datasets import load_digits

        d = load_digits()
        images = np.kron(d.images, np.ones((3, 3))) * 16
        images = np.pad(images, ((0, 0), (2, 2), (2, 2))).astype(np.uint8)
        xtr, ytr, xte, yte = images[:1400], d.target[:1400], images[1400:], d.target[1400:]
        name = "sklearn digits (1400 train / 397 test; Fashion-MNIST not installed)"

    def prep(x: np.ndarray) -> torch.Tensor:
        return ((torch.from_numpy(np.array(x, dtype=np.float32)) / 255.0 - 0.286) / 0.353).unsqueeze(1)

    return name, prep(xtr), torch.from_numpy(np.array(ytr, dtype=np.int64)), prep(xte), \
        torch.from_numpy(np.array(yte, dtype=np.int64))


def make_cnn(seed: int) -> nn.Sequential:
    """conv 1-32 (3x3) + pool, conv 32-32 + pool, fc 1568-320-10: 514,858 parameters."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 320), nn.ReLU(), nn.Linear(320, 10))


class Classifier(pl.LightningModule):
    """The CNN with SGD (momentum 0.9, weight decay 5e-4) and a per-step cosine learning rate."""

    def __init__(self, data: tuple[torch.Tensor, ...], seed: int, lr: float, batch: int = 64) -> None:
        super().__init__()
        self.net = make_cnn(seed)
        self.xtr, self.ytr, self.xte, self.yte = data
        self.lr, self.batch = lr, batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.xtr, self.ytr), batch_size=self.batch, shuffle=True)

    def test_accuracy(self) -> float:
        self.net.eval()
        with torch.no_grad():
            hits = sum(int((self.net(x).argmax(1) == y).sum())
                       for x, y in zip(self.xte.split(1000), self.yte.split(1000)))
        return hits / len(self.yte)
