"""A generated 10-class image set (28x28 grey shapes), the last-resort offline fallback of the image recipe.

Classes: filled disc, ring, filled square, square outline, horizontal bar, vertical bar, plus sign,
diagonal cross, triangle, two dots; each drawn at a random position, size and brightness with pixel noise.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SHAPE_CLASSES", "make_shapes"]

SHAPE_CLASSES = ("disc", "ring", "square", "outline", "hbar", "vbar", "plus", "cross", "triangle", "dots")


def _draw(kind: int, yy: np.ndarray, xx: np.ndarray, cy: float, cx: float, r: float) -> np.ndarray:
    dy, dx = yy - cy, xx - cx
    dist = np.sqrt(dy ** 2 + dx ** 2)
    box = np.maximum(abs(dy), abs(dx))
    width = max(1.5, r / 3)
    masks = [
        dist <= r,
        abs(dist - r) <= width / 2 + 0.5,
        box <= r,
        abs(box - r) <= width / 2 + 0.5,
        (abs(dy) <= width / 2 + 0.5) & (abs(dx) <= r),
        (abs(dx) <= width / 2 + 0.5) & (abs(dy) <= r),
        ((abs(dy) <= width / 2) & (abs(dx) <= r)) | ((abs(dx) <= width / 2) & (abs(dy) <= r)),
        ((abs(dy - dx) <= width * 0.7) | (abs(dy + dx) <= width * 0.7)) & (box <= r),
        (dy <= r) & (dy >= -r) & (abs(dx) <= (dy + r) / 2),
        (np.sqrt(dy ** 2 + (dx - r * 0.6) ** 2) <= r / 2.5) | (np.sqrt(dy ** 2 + (dx + r * 0.6) ** 2) <= r / 2.5),
    ]
    return masks[kind].astype(np.float32)


def make_shapes(n: int, seed: int = 0, size: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images (n, size, size) uint8 and labels (n,) int64, balanced over the 10 classes."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % len(SHAPE_CLASSES)
    rng.shuffle(labels)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    images = np.empty((n, size, size), dtype=np.uint8)
    for i, kind in enumerate(labels):
        r = rng.uniform(size * 0.18, size * 0.32)
        cy, cx = rng.uniform(r + 1, size - r - 1, size=2)
        img = _draw(int(kind), yy, xx, cy, cx, r) * rng.uniform(0.5, 1.0)
        img += rng.normal(0.0, 0.12, img.shape)
        images[i] = np.clip(img * 255, 0, 255).astype(np.uint8)
    return images, labels.astype(np.int64)
