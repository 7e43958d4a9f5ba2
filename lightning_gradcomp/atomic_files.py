"""Writing a file so that a reader finds the old bytes or the new ones, never a part of them.

A local file is written to a temporary file in the target's folder, flushed to the disk (``fsync``), renamed over
the target (``os.replace``, atomic within one file system), and the folder is flushed so that the rename survives a
crash. A full disk or a crash mid-write leaves the target as it was. (fsspec's local transaction, which Lightning's
``TorchCheckpointIO`` uses, writes to the system's temporary folder and then *moves* the file: across file systems
that is a copy into the target, which a full disk leaves truncated.) Object stores publish an object only once its
upload is complete; other fsspec file systems get a temporary name and a rename.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Any, Union

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem

__all__ = ["atomic_save", "atomic_write"]

_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"}

Bytes = Union[bytes, memoryview]


def atomic_write(path: Any, data: Bytes) -> None:
    """Replace the file at ``path`` (local path or fsspec URL) by ``data`` at once; create its folder if needed."""
    fs = get_filesystem(path)
    if isinstance(fs, LocalFileSystem):
        _replace_local(fs._strip_protocol(str(path)), data)
        return
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & _OBJECT_STORES:  # an object appears only once its upload is complete
        fs.pipe_file(str(path), bytes(data))
        return
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with fs.open(temporary, "wb") as file:
            file.write(data)
        fs.mv(temporary, str(path))  # a rename within the folder
    finally:
        if fs.exists(temporary):
            fs.rm(temporary)


def atomic_save(obj: Any, path: Any) -> None:
    """``torch.save(obj)`` to ``path`` through :func:`atomic_write`."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write(path, buffer.getbuffer())


def _replace_local(path: str, data: Bytes) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f"{os.path.basename(path)}.tmp-")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: str) -> None:
    """Flush ``folder``'s entries (the rename) to the disk, where the platform allows it."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:  # some file systems refuse fsync on a folder
        pass
    finally:
        os.close(handle)
