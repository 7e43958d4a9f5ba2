"""The image recipe's data: ImageNet-style ImageFolder trees, IDX (Fashion-)MNIST, sklearn digits, generated shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Literal, Optional

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from recipes.data.idx import find_idx_pair, read_idx
from recipes.data.imagefolder import ImageFolder, list_classes
from recipes.data.shapes import make_shapes
from recipes.data.transforms import PadCropFlip, RandomResizedCropFlip, ResizeCenterCrop

__all__ = ["FASHION_MNIST_DIR", "ImageDataModule", "ImageSource", "TensorImageDataset", "load_arrays"]

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
"""Where Debian's ``dataset-fashion-mnist`` package installs the IDX files."""

ImageSource = Literal["fashion_mnist", "mnist", "imagefolder", "digits", "shapes"]
_IDX_SOURCES = ("fashion_mnist", "mnist")


class TensorImageDataset(Dataset):
    """In-memory grey images (N, H, W) uint8 with labels, normalised to zero mean / unit std, plus a transform."""

    def __init__(self, images: Tensor, labels: Tensor, mean: float, std: float,
                 transform: Optional[Callable[[Tensor], Tensor]] = None) -> None:
        self.images, self.labels, self.mean, self.std, self.transform = images, labels, mean, std, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        x = (self.images[index][None].float() / 255.0 - self.mean) / self.std
        return (self.transform(x) if self.transform else x), self.labels[index]


Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def load_arrays(source: str, root: Optional[str], seed: int = 0) -> Arrays:
    """(train images, train labels, val images, val labels) as uint8 (N, H, W) / int64 (N,) arrays."""
    if source in _IDX_SOURCES:
        if root is None:
            raise ValueError(f"`root` (folder of the IDX files) is required for source={source!r}")
        arrays = [read_idx(p) for split in ("train", "t10k") for p in find_idx_pair(root, split)]
        return arrays[0], arrays[1].astype(np.int64), arrays[2], arrays[3].astype(np.int64)
    if source == "digits":
        from sklearn.datasets import load_digits  # optional: scikit-learn

        bunch = load_digits()
        images = np.clip(bunch.images * 16, 0, 255).astype(np.uint8)
        order = np.random.default_rng(seed).permutation(len(images))
        train, val = order[:1400], order[1400:]
        return images[train], bunch.target[train].astype(np.int64), images[val], bunch.target[val].astype(np.int64)
    if source == "shapes":
        xtr, ytr = make_shapes(12000, seed=seed)
        xva, yva = make_shapes(2000, seed=seed + 1)
        return xtr, ytr, xva, yva
    raise ValueError(f"`source` must be one of {_IDX_SOURCES + ('digits', 'shapes')} here, got {source!r}")


def _subset(ds: Dataset, n: Optional[int], seed: int) -> Dataset:
    if n is None or n >= len(ds):  # type: ignore[arg-type]
        return ds
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:n]  # type: ignore[arg-type]
    return Subset(ds, order.tolist())


class ImageDataModule(pl.LightningDataModule):
    """Image classification data for the ResNet recipe.

    Sources:

    * ``imagefolder``: ``root/<train_dir>/<class>/*.jpg`` and ``root/<val_dir>/<class>/*.jpg`` (ImageNet layout;
      RGB, random-resized-crop + flip for training, resize + centre crop for evaluation; needs Pillow).
    * ``fashion_mnist`` / ``mnist``: IDX files in ``root`` (default: Debian's ``/usr/share/datasets/fashion-mnist``);
      the ``t10k`` split is the validation set. Pad-2 random crop (+ flip for Fashion-MNIST).
    * ``digits``: scikit-learn's bundled 8x8 digits (1400 train / 397 validation), for tests.
    * ``shapes``: generated 28x28 shapes (:mod:`recipes.data.shapes`), needs nothing installed.

    Args:
        source: one of the above.
        root: data folder (``None``: the Debian path for ``fashion_mnist``).
        batch_size: per-process batch size.
        num_workers: DataLoader worker processes.
        train_subset: use only this many (seeded random) training samples.
        val_subset: use only this many (seeded random) validation samples.
        image_size: crop side for ``imagefolder``.
        augment: random crop / flip on the training set.
        num_classes: number of classes (``None``: 10, or the sub-folders of the train split).
        train_dir: train split folder name for ``imagefolder``.
        val_dir: validation split folder name for ``imagefolder``.
        seed: seed of the subsets and of the digits split.
    """

    def __init__(self, source: ImageSource = "fashion_mnist", root: Optional[str] = None, batch_size: int = 128,
                 num_workers: int = 0, train_subset: Optional[int] = None, val_subset: Optional[int] = None,
                 image_size: int = 224, augment: bool = True, num_classes: Optional[int] = None,
                 train_dir: str = "train", val_dir: str = "val", seed: int = 0) -> None:
        super().__init__()
        if source not in (*_IDX_SOURCES, "imagefolder", "digits", "shapes"):
            raise ValueError(f"`source` must be fashion_mnist, mnist, imagefolder, digits or shapes, got {source!r}")
        if batch_size < 1 or num_workers < 0:
            raise ValueError(f"`batch_size` must be >= 1 and `num_workers` >= 0, got {batch_size}, {num_workers}")
        for name, value in (("train_subset", train_subset), ("val_subset", val_subset)):
            if value is not None and value < 1:
                raise ValueError(f"`{name}` must be >= 1 (or None for every sample), got {value}")
        if source == "imagefolder" and root is None:
            raise ValueError("`root` (folder holding the train/ and val/ class folders) is required for imagefolder")
        self.source = source
        self.root = FASHION_MNIST_DIR if (root is None and source == "fashion_mnist") else root
        self.batch_size, self.num_workers = batch_size, num_workers
        self.train_subset, self.val_subset, self.seed = train_subset, val_subset, seed
        self.image_size, self.augment = image_size, augment
        self.train_dir, self.val_dir = train_dir, val_dir
        self._num_classes = num_classes
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None

    def check_data(self) -> None:
        """Raise ``FileNotFoundError`` naming the argument and the path when the local data this module reads is
        missing (the IDX files of both splits, or the image folder's split folders and their classes); the recipes'
        CLI calls this before training starts any process. Reads no image."""
        if self.source in _IDX_SOURCES:
            for split in ("train", "t10k"):
                try:
                    find_idx_pair(self.root, split)  # type: ignore[arg-type]
                except FileNotFoundError as err:
                    raise FileNotFoundError(f"`data.root`: {err} (the {self.source} IDX files)") from None
        elif self.source == "imagefolder":
            for name, split in (("train_dir", self.train_dir), ("val_dir", self.val_dir)):
                try:
                    list_classes(Path(self.root) / split)  # type: ignore[arg-type]
                except FileNotFoundError as err:
                    raise FileNotFoundError(f"`data.root` / `data.{name}`: {err}") from None

    @property
    def num_classes(self) -> int:
        """Classes of the task (the classifier's outputs)."""
        if self._num_classes is None:
            if self.source == "imagefolder":
                self._num_classes = len(list_classes(Path(self.root) / self.train_dir))  # type: ignore[arg-type]
            else:
                self._num_classes = 10
        return self._num_classes

    @property
    def in_channels(self) -> int:
        """Image channels (3 for ImageFolder RGB, 1 otherwise)."""
        return 3 if self.source == "imagefolder" else 1

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        if self.source == "imagefolder":
            root = Path(self.root)  # type: ignore[arg-type]
            eval_tf = ResizeCenterCrop(self.image_size, int(self.image_size * 8 / 7))
            train_tf: Any = RandomResizedCropFlip(self.image_size) if self.augment else eval_tf
            train = ImageFolder(root / self.train_dir, train_tf)
            val: Dataset = ImageFolder(root / self.val_dir, eval_tf, classes=train.classes)
            self._check_classes(len(train.classes))
        else:
            xtr, ytr, xva, yva = load_arrays(self.source, self.root, self.seed)
            mean, std = float(xtr.mean()) / 255.0, float(xtr.std()) / 255.0
            pad = 1 if xtr.shape[-1] <= 8 else 2
            tf = PadCropFlip(pad, flip=self.source == "fashion_mnist") if self.augment else None
            train = TensorImageDataset(torch.from_numpy(xtr), torch.from_numpy(ytr), mean, std, tf)
            val = TensorImageDataset(torch.from_numpy(xva), torch.from_numpy(yva), mean, std)
            self._check_classes(int(ytr.max()) + 1)
        self.train_set = _subset(train, self.train_subset, self.seed)
        self.val_set = _subset(val, self.val_subset, self.seed + 1)

    def _check_classes(self, found: int) -> None:
        if found > self.num_classes:
            raise ValueError(f"the data has {found} classes but `num_classes` is {self.num_classes}")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers,
                          drop_last=True, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=max(self.batch_size, 256), num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)
