"""Reader for the IDX format of MNIST / Fashion-MNIST (``*-images-idx3-ubyte[.gz]``, ``*-labels-idx1-ubyte[.gz]``).

An IDX file is: 2 zero bytes, a dtype code, the number of dimensions ``d``, ``d`` big-endian int32 sizes,
then the data in C order.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path
from typing import Union

import numpy as np

__all__ = ["find_idx_pair", "read_idx", "write_idx"]

_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
           0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: Union[str, Path]) -> np.ndarray:
    """Read one IDX file (gzip-compressed when it ends in ``.gz``) into an array of its shape."""
    path = Path(path)
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic {raw[:4]!r})")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}i", raw[4:4 + 4 * ndim])
    dtype = np.dtype(_DTYPES[raw[2]])
    count = int(np.prod(dims)) if dims else 1
    data = np.frombuffer(raw, dtype=dtype, count=count, offset=4 + 4 * ndim)
    return data.reshape(dims).astype(dtype.newbyteorder("="))


def write_idx(path: Union[str, Path], array: np.ndarray) -> None:
    """Write a uint8 array as IDX (gzip when ``path`` ends in ``.gz``); used to make test fixtures."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    raw = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape) + array.tobytes()
    path = Path(path)
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


def find_idx_pair(root: Union[str, Path], split: str) -> tuple[Path, Path]:
    """The (images, labels) files of ``split`` (``"train"`` or ``"t10k"``) in ``root``, gzipped or not."""
    root = Path(root)
    found = []
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        names = [root / f"{split}-{kind}{ext}" for ext in (".gz", "")]
        hit = next((p for p in names if p.is_file()), None)
        if hit is None:
            raise FileNotFoundError(f"no {split}-{kind}[.gz] in {root}")
        found.append(hit)
    return found[0], found[1]
