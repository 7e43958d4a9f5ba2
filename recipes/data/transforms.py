"""Image augmentation without torchvision: ImageNet-style (Pillow) and small-image (tensor) transforms.

Randomness comes from torch's global generator, which Lightning seeds per rank and per worker.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "PadCropFlip", "RandomResizedCropFlip", "ResizeCenterCrop", "pil_to_tensor"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def pil_to_tensor(img: Any, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """PIL image -> (C, H, W) float tensor scaled to [0, 1] and normalised per channel."""
    arr = np.asarray(img, dtype=np.float32) / 255.0
    x = torch.from_numpy(arr.reshape(arr.shape[0], arr.shape[1], -1).copy()).permute(2, 0, 1)
    return (x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]


def _uniform(low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand(()))


class RandomResizedCropFlip:
    """Training transform for ImageNet: random area/aspect crop resized to ``size``, horizontal flip, normalise.

    Args:
        size: output side in pixels.
        scale: range of the crop area as a fraction of the image area.
        ratio: range of the crop aspect ratio (width / height).
        mean: per-channel mean subtracted after scaling to [0, 1].
        std: per-channel standard deviation divided by.
    """

    def __init__(self, size: int = 224, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), mean: Sequence[float] = IMAGENET_MEAN,
                 std: Sequence[float] = IMAGENET_STD) -> None:
        self.size, self.scale, self.ratio, self.mean, self.std = size, scale, ratio, mean, std

    def _box(self, width: int, height: int) -> tuple[int, int, int, int]:
        area = width * height
        for _ in range(10):
            target = area * _uniform(*self.scale)
            aspect = math.exp(_uniform(math.log(self.ratio[0]), math.log(self.ratio[1])))
            w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                x, y = int(torch.randint(0, width - w + 1, ())), int(torch.randint(0, height - h + 1, ()))
                return x, y, x + w, y + h
        side = min(width, height)  # fallback: central square
        x, y = (width - side) // 2, (height - side) // 2
        return x, y, x + side, y + side

    def __call__(self, img: Any) -> Tensor:
        from PIL import Image

        img = img.resize((self.size, self.size), Image.BILINEAR, box=self._box(*img.size))
        if bool(torch.rand(()) < 0.5):
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        return pil_to_tensor(img, self.mean, self.std)


class ResizeCenterCrop:
    """Evaluation transform for ImageNet: resize the short side to ``resize``, centre-crop ``size``, normalise."""

    def __init__(self, size: int = 224, resize: int = 256, mean: Sequence[float] = IMAGENET_MEAN,
                 std: Sequence[float] = IMAGENET_STD) -> None:
        self.size, self.resize, self.mean, self.std = size, resize, mean, std

    def __call__(self, img: Any) -> Tensor:
        from PIL import Image

        w, h = img.size
        s = self.resize / min(w, h)
        w, h = max(self.size, round(w * s)), max(self.size, round(h * s))
        img = img.resize((w, h), Image.BILINEAR)
        x, y = (w - self.size) // 2, (h - self.size) // 2
        return pil_to_tensor(img.crop((x, y, x + self.size, y + self.size)), self.mean, self.std)


class PadCropFlip:
    """Small-image training transform on (C, H, W) float tensors: zero-pad, random crop back, optional flip."""

    def __init__(self, pad: int = 2, flip: bool = True) -> None:
        self.pad, self.flip = pad, flip

    def __call__(self, x: Tensor) -> Tensor:
        if self.pad:
            _, h, w = x.shape
            x = torch.nn.functional.pad(x, (self.pad,) * 4)
            i, j = (int(v) for v in torch.randint(0, 2 * self.pad + 1, (2,)))
            x = x[:, i:i + h, j:j + w]
        if self.flip and bool(torch.rand(()) < 0.5):
            x = x.flip(-1)
        return x
