"""ImageFolder layout (``root/<class>/<image>``, as ImageNet's train/ and val/ folders) read with Pillow."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Union

from torch.utils.data import Dataset

__all__ = ["IMAGE_EXTENSIONS", "ImageFolder", "list_classes"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def list_classes(root: Union[str, Path]) -> list[str]:
    """Sorted names of the sub-folders of ``root`` (the classes); ``FileNotFoundError`` when none."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise FileNotFoundError(f"image folder {root} has no class sub-folders")
    return classes


class ImageFolder(Dataset):
    """Images under ``root/<class>/**`` with label = index of ``<class>`` in the sorted class list.

    Args:
        root: the split folder (e.g. ``/data/imagenet/train``).
        transform: maps an RGB (or ``mode``) ``PIL.Image`` to a tensor.
        classes: class names to use (defaults to the sub-folders of ``root``; pass the train split's list
            when reading val, so indices agree).
        mode: Pillow mode the images are converted to (``"RGB"`` or ``"L"``).
    """

    def __init__(self, root: Union[str, Path], transform: Callable[[Any], Any], classes: Optional[list[str]] = None,
                 mode: str = "RGB") -> None:
        self.root = Path(root)
        self.classes = list(classes) if classes is not None else list_classes(self.root)
        self.transform = transform
        self.mode = mode
        self.samples: list[tuple[Path, int]] = []
        for label, name in enumerate(self.classes):
            folder = self.root / name
            if not folder.is_dir():
                continue
            files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
            self.samples.extend((p, label) for p in files)
        if not self.samples:
            raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {self.root}")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        from PIL import Image  # optional dependency, needed only for this layout

        path, label = self.samples[index]
        with Image.open(path) as img:
            return self.transform(img.convert(self.mode)), label
