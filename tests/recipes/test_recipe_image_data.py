"""Image loaders on small generated files in the real formats: IDX (gzipped), an ImageFolder tree of PNG/JPEG."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recipes.data.idx import find_idx_pair, read_idx, write_idx
from recipes.data.image_data import ImageDataModule
from recipes.data.imagefolder import ImageFolder, list_classes
from recipes.data.shapes import SHAPE_CLASSES, make_shapes
from recipes.data.transforms import PadCropFlip, RandomResizedCropFlip, ResizeCenterCrop

Image = pytest.importorskip("PIL.Image")


def _write_mnist_like(root: Path, n_train: int = 40, n_test: int = 20) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8)
    labels = (np.arange(n_train) % 10).astype(np.uint8)
    write_idx(root / "train-images-idx3-ubyte.gz", images)
    write_idx(root / "train-labels-idx1-ubyte.gz", labels)
    write_idx(root / "t10k-images-idx3-ubyte", images[:n_test])  # uncompressed works too
    write_idx(root / "t10k-labels-idx1-ubyte", labels[:n_test])
    return images, labels


def test_idx_round_trip_and_header_checks(tmp_path: Path):
    images, labels = _write_mnist_like(tmp_path)
    img_path, lab_path = find_idx_pair(tmp_path, "train")
    assert img_path.name.endswith(".gz")
    assert np.array_equal(read_idx(img_path), images)
    assert np.array_equal(read_idx(lab_path), labels)
    raw = (tmp_path / "t10k-images-idx3-ubyte").read_bytes()
    assert raw[:4] == bytes([0, 0, 8, 3]) and int.from_bytes(raw[4:8], "big") == 20
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an IDX"):
        read_idx(tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="t10k-images"):
        find_idx_pair(tmp_path / "missing", "t10k")


def test_idx_datamodule_normalises_and_augments(tmp_path: Path):
    _write_mnist_like(tmp_path)
    dm = ImageDataModule(source="mnist", root=str(tmp_path), batch_size=8, val_subset=10)
    dm.setup("fit")
    assert (dm.num_classes, dm.in_channels) == (10, 1)
    assert len(dm.train_set) == 40 and len(dm.val_set) == 10
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 1, 28, 28) and y.dtype == torch.int64
    xs = torch.stack([dm.val_set[i][0] for i in range(10)])
    assert abs(float(xs.mean())) < 0.2  # normalised with the training mean / std


def _write_image_folder(root: Path) -> None:
    rng = np.random.default_rng(0)
    for split, per_class in (("train", 4), ("val", 2)):
        for c, name in enumerate(("cat", "dog", "fish")):
            folder = root / split / name / ("nested" if c == 2 else "")
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                h, w = int(rng.integers(20, 60)), int(rng.integers(20, 60))
                arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                ext, mode = (".png", "RGB") if i % 2 == 0 else (".JPG", "RGB")
                img = Image.fromarray(arr, mode) if i != 1 else Image.fromarray(arr[..., 0], "L")
                img.save(folder / f"img{i}{ext}")
            (folder / "notes.txt").write_text("not an image")


def test_image_folder_reads_nested_png_and_jpeg(tmp_path: Path):
    _write_image_folder(tmp_path)
    assert list_classes(tmp_path / "train") == ["cat", "dog", "fish"]
    ds = ImageFolder(tmp_path / "train", ResizeCenterCrop(16, 18))
    assert len(ds) == 12
    x, y = ds[len(ds) - 1]
    assert x.shape == (3, 16, 16) and y == 2  # the grey ("L") image was converted to RGB
    with pytest.raises(FileNotFoundError):
        ImageFolder(tmp_path / "nope", ResizeCenterCrop(16))


def test_image_folder_datamodule_uses_the_train_class_order(tmp_path: Path):
    _write_image_folder(tmp_path)
    (tmp_path / "val" / "bird").mkdir()  # an extra, empty class in val must not shift the indices
    dm = ImageDataModule(source="imagefolder", root=str(tmp_path), image_size=24, batch_size=4)
    assert (dm.num_classes, dm.in_channels) == (3, 3)
    dm.setup("fit")
    assert len(dm.val_set) == 6
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 24, 24)
    assert sorted({int(dm.val_set[i][1]) for i in range(6)}) == [0, 1, 2]
    with pytest.raises(ValueError, match="root"):
        ImageDataModule(source="imagefolder")


def test_transforms_shapes_and_flip():
    torch.manual_seed(0)
    img = Image.fromarray(np.arange(40 * 30 * 3, dtype=np.uint8).reshape(30, 40, 3) % 255, "RGB")
    assert RandomResizedCropFlip(20)(img).shape == (3, 20, 20)
    out = ResizeCenterCrop(10, 12, mean=(0, 0, 0), std=(1, 1, 1))(img)
    assert out.shape == (3, 10, 10) and 0.0 <= float(out.min()) and float(out.max()) <= 1.0
    x = torch.arange(16.0).reshape(1, 4, 4)
    flips = {tuple(PadCropFlip(pad=0, flip=True)(x)[0, 0].tolist()) for _ in range(40)}
    assert flips == {(0.0, 1.0, 2.0, 3.0), (3.0, 2.0, 1.0, 0.0)}
    shifted = PadCropFlip(pad=2, flip=False)(x)
    assert shifted.shape == x.shape


def test_generated_shapes_are_balanced_and_deterministic():
    a, la = make_shapes(50, seed=3)
    b, lb = make_shapes(50, seed=3)
    assert a.shape == (50, 28, 28) and a.dtype == np.uint8
    assert np.array_equal(a, b) and np.array_equal(la, lb)
    assert np.bincount(la, minlength=len(SHAPE_CLASSES)).tolist() == [5] * 10


def test_digits_source_when_sklearn_is_installed():
    pytest.importorskip("sklearn")
    dm = ImageDataModule(source="digits", batch_size=16)
    dm.setup("fit")
    assert len(dm.train_set) == 1400 and len(dm.val_set) == 397
    x, _ = dm.val_set[0]
    assert x.shape == (1, 8, 8)


@pytest.mark.parametrize("name", ["train_subset", "val_subset"])
@pytest.mark.parametrize("value", [0, -5])
def test_a_subset_of_no_sample_is_refused(name: str, value: int):
    """``train_subset=0`` emptied the training set (the sampler's ``num_samples=0`` on every rank); ``-5`` dropped five
    samples."""
    with pytest.raises(ValueError, match=f"`{name}` must be >= 1"):
        ImageDataModule(source="shapes", **{name: value})
