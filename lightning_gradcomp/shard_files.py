"""Per-rank shard files of the compression state, next to a Lightning checkpoint.

Error-feedback memories are as large as the model and differ on every rank. Instead of gathering them into
rank 0's checkpoint file, every rank writes its own state to a *shard*, and the checkpoint carries only a small
*manifest* that lists the shards with their sizes and SHA-256 checksums (the collective protocol around these
files is :mod:`lightning_gradcomp.sharded_checkpoints`; ``LocalSGDStrategy`` and ``SwarmStrategy`` shard their
per-rank models and optimizer states the same way, under ``checkpoint["localsgd"]`` and ``checkpoint["swarm"]``)::

    last.ckpt                      # Lightning's file (rank 0): model, optimizer, ..., checkpoint["gradcomp"] = manifest
    last.ckpt.gradcomp/
        rank-00000-3f9c2a1b.pt     # rank 0's hook state (torch.save), written by rank 0
        rank-00001-3f9c2a1b.pt     # rank 1's, written by rank 1
        ...

The token (``3f9c2a1b``) is new at every save, so saving over an existing checkpoint never touches the files
that the previous manifest lists: until the new checkpoint file is in place, the old one stays consistent.
Each rank deletes its stale shards after the new checkpoint file is written (:func:`remove_stale_shards`).

Files go through fsspec (Lightning's ``get_filesystem``), so remote paths (``s3://...``) work as they do for the
checkpoint itself. A shard is written atomically (:mod:`lightning_gradcomp.atomic_files`: a temporary file in the same
folder, fsync, then a rename; object stores publish an object only when its upload is complete).

The checkpoint file itself is CRC-checked before it is loaded (:func:`load_verified`, which every strategy's
``load_checkpoint`` goes through): ``torch.load`` does not verify the checksums of its zip members.

Example::

    >>> import tempfile, torch
    >>> ckpt = tempfile.mkdtemp() + "/last.ckpt"
    >>> entry = write_shard({"step": 7, "memory": {"w": torch.ones(3)}}, ckpt, rank=0, token="t0")
    >>> entry["file"], entry["bytes"] > 0
    ('rank-00000-t0.pt', True)
    >>> manifest = build_manifest([entry], compressor="TopK", replicated={"step": 7}, checkpoint_path=ckpt)
    >>> check_manifest(manifest)
    >>> load_shard(ckpt, manifest, rank=0)["memory"]["w"]
    tensor([1., 1., 1.])
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import secrets
import zipfile
from collections.abc import Callable
from typing import Any, Optional

import torch
from fsspec import AbstractFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_gradcomp.atomic_files import atomic_write

__all__ = [
    "FORMAT_VERSION",
    "SUFFIX",
    "build_manifest",
    "check_entry",
    "check_manifest",
    "is_sharded",
    "load_shard",
    "load_verified",
    "new_token",
    "read_shards",
    "resumable_hpc_checkpoint",
    "remove_shards",
    "remove_stale_shards",
    "shard_dir",
    "shard_name",
    "shard_path",
    "verify_checkpoint_file",
    "write_shard",
]

FORMAT_VERSION = 2
"""Version of the sharded ``checkpoint["gradcomp"]`` entry (version 1 held every rank's state inline)."""

SUFFIX = ".gradcomp"
"""The shard folder is the checkpoint path plus this suffix."""

_NAME = re.compile(r"rank-(\d{5,})-([0-9A-Za-z_]+)\.pt")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MANIFEST_KEYS = ("version", "compressor", "world_size", "dir", "replicated", "shards")
_HPC_CHECKPOINT = re.compile(r"hpc_ckpt_(\d+)\.ckpt")


# ---------------------------------------------------------------------------------------------- paths
def shard_dir(checkpoint_path: Any) -> str:
    """The shard folder of a checkpoint: ``<checkpoint_path>.gradcomp``."""
    return f"{os.fspath(checkpoint_path)}{SUFFIX}"


def shard_name(rank: int, token: str) -> str:
    """A shard's file name: ``rank-00003-<token>.pt``."""
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"`rank` must be a non-negative int, got {rank!r}")
    name = f"rank-{rank:05d}-{token}.pt"
    if not _NAME.fullmatch(name):
        raise ValueError(f"`token` must be letters, digits or '_', got {token!r}")
    return name


def shard_path(checkpoint_path: Any, rank: int, token: str) -> str:
    """The path of rank ``rank``'s shard of the save ``token`` of ``checkpoint_path``."""
    return _join(shard_dir(checkpoint_path), shard_name(rank, token))


def new_token() -> str:
    """A fresh save token (8 hex digits): every save of a checkpoint writes new shard files."""
    return secrets.token_hex(4)


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}" if "://" in folder else os.path.join(folder, name)


def _parent(path: str) -> str:
    return path.rpartition("/")[0] if "://" in path else os.path.dirname(path)


def _base(path: str) -> str:
    return path.rstrip("/").rpartition("/")[2] if "://" in path else os.path.basename(path)


# ---------------------------------------------------------------------------------------------- write
def write_shard(state: dict[str, Any], checkpoint_path: Any, rank: int, token: str) -> dict[str, Any]:
    """Write this rank's ``state`` (``torch.save``) atomically to its shard; create the folder if needed.

    Args:
        state: this rank's compression state (tensors, numbers, strings: ``weights_only``-loadable).
        checkpoint_path: the Lightning checkpoint the shard belongs to (local path or fsspec URL).
        rank: this rank's global rank.
        token: the save token, the same on every rank (:func:`new_token`, broadcast from rank 0).

    Returns:
        The manifest entry ``{"rank", "file", "bytes", "sha256"}`` of the bytes written.
    """
    path = shard_path(checkpoint_path, rank, token)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getbuffer()
    fs = get_filesystem(path)
    fs.makedirs(_parent(path), exist_ok=True)
    atomic_write(path, data)
    return {"rank": rank, "file": _base(path), "bytes": data.nbytes, "sha256": hashlib.sha256(data).hexdigest()}


# ---------------------------------------------------------------------------------------------- manifest
def build_manifest(
    shards: list[dict[str, Any]], compressor: str, replicated: dict[str, Any], checkpoint_path: Any
) -> dict[str, Any]:
    """The ``checkpoint["gradcomp"]`` entry: format version, compressor, world size, shard folder and shards.

    Args:
        shards: every rank's :func:`write_shard` entry, in rank order (``len(shards)`` is the world size).
        compressor: the compressor's class name (a resume with another one is refused).
        replicated: the parts of the state that are identical on every rank (step, beta, per-layer
            parameters); a resume on another world size keeps only these.
        checkpoint_path: the checkpoint the shards belong to; its shard folder's *name* is recorded, so a
            symbolic link to the checkpoint (``ModelCheckpoint(save_last="link")``) finds the shards.
    """
    manifest = {
        "version": FORMAT_VERSION,
        "compressor": compressor,
        "world_size": len(shards),
        "dir": _base(shard_dir(checkpoint_path)),
        "replicated": replicated,
        "shards": list(shards),
    }
    check_manifest(manifest)
    return manifest


def is_sharded(entry: Any) -> bool:
    """Whether a ``checkpoint["gradcomp"]`` entry is a shard manifest (format version 2)."""
    return isinstance(entry, dict) and entry.get("version") == FORMAT_VERSION


def check_manifest(manifest: Any, key: str = "gradcomp") -> None:
    """Validate a manifest's structure (``key``: the checkpoint entry it came from, for the message).

    Raises:
        ValueError: a key is missing or has the wrong type, the shards are not one per rank in rank order, or a
            file name is not a shard name (no folders: a manifest cannot point outside its shard folder).
    """
    problem = _manifest_problem(manifest)
    if problem:
        raise ValueError(
            f"checkpoint entry {key!r} is malformed or from an unknown version ({problem}; "
            f"expected version {FORMAT_VERSION} with one shard per rank)"
        )


def check_entry(saved: Any, sharded: bool, key: str, required: tuple[str, ...], legacy_version: int) -> None:
    """Validate a strategy's checkpoint entry: a manifest (``sharded``) holding the strategy's ``required`` keys,
    or the single-file format before shards (``"version": legacy_version`` with a ``"per_rank"`` list).

    Raises:
        ValueError: the entry is malformed; the message names ``key`` and what is missing or expected.
    """
    if sharded:
        check_manifest(saved, key=key)
        missing = [name for name in required if name not in saved]
        if missing:
            raise ValueError(f"checkpoint entry {key!r} is malformed (it has no {', '.join(missing)})")
    elif not isinstance(saved, dict) or saved.get("version") != legacy_version or "per_rank" not in saved:
        raise ValueError(
            f"checkpoint entry {key!r} is malformed or from an unknown version (expected version "
            f"{FORMAT_VERSION} with one shard per rank, or version {legacy_version} with one state "
            f"per rank)"
        )


def _manifest_problem(manifest: Any) -> Optional[str]:
    if not isinstance(manifest, dict) or any(key not in manifest for key in _MANIFEST_KEYS):
        return f"expected a dict with the keys {', '.join(_MANIFEST_KEYS)}"
    if manifest["version"] != FORMAT_VERSION:
        return f"version {manifest['version']!r}"
    world, shards, folder = manifest["world_size"], manifest["shards"], manifest["dir"]
    if not isinstance(manifest["compressor"], str) or not isinstance(manifest["replicated"], dict):
        return "'compressor' must be a str and 'replicated' a dict"
    if not isinstance(folder, str) or not folder.endswith(SUFFIX) or "/" in folder or os.sep in folder:
        return f"'dir' must be a folder name ending in {SUFFIX!r}, got {folder!r}"
    if not isinstance(world, int) or world < 1 or not isinstance(shards, list) or len(shards) != world:
        return f"{len(shards) if isinstance(shards, list) else 'no'} shards for world size {world!r}"
    for rank, shard in enumerate(shards):
        if not isinstance(shard, dict) or shard.get("rank") != rank:
            return f"shard entry {rank} is not a dict for rank {rank}"
        match = _NAME.fullmatch(str(shard.get("file")))
        if match is None or int(match.group(1)) != rank:
            return f"shard entry {rank} has the file name {shard.get('file')!r}"
        if not isinstance(shard.get("bytes"), int) or not _SHA256.fullmatch(str(shard.get("sha256"))):
            return f"shard entry {rank} needs 'bytes' (int) and 'sha256' (64 hex digits)"
    return None


# ---------------------------------------------------------------------------------------------- read
def load_shard(
    checkpoint_path: Any,
    manifest: dict[str, Any],
    rank: int,
    weights_only: bool = True,
    *,
    what: str = "compression-state",
    contents: str = "error-feedback memory and compressor state",
) -> dict[str, Any]:
    """Read rank ``rank``'s shard, check its size and SHA-256 against the manifest, and load it (on CPU).

    The shard folder is the manifest's ``dir`` next to ``checkpoint_path``, else ``<checkpoint_path>.gradcomp``
    (a checkpoint renamed together with its folder). ``what`` and ``contents`` word the error messages
    (``"<what> shard '...' is missing ...: every rank's <contents> live in the folder ..."``).

    Raises:
        FileNotFoundError: the shard is missing; the message names the file and says what to do.
        RuntimeError: the shard's size or checksum differs from the manifest's, or it does not load; the message
            names the file.
    """
    check_manifest(manifest)
    checkpoint_path = os.fspath(checkpoint_path)
    entry = manifest["shards"][rank]
    path = _locate(checkpoint_path, manifest["dir"], entry["file"])
    fs = get_filesystem(path)
    try:
        with fs.open(path, "rb") as file:
            data = file.read()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{what} shard '{path}' of checkpoint '{checkpoint_path}' is missing (rank {rank} of "
            f"{manifest['world_size']}): every rank's {contents} live in the folder "
            f"'{manifest['dir']}' next to the checkpoint file. Copy that folder together with the checkpoint (and "
            f"make it visible to every rank), or resume from an earlier checkpoint"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != entry["bytes"] or digest != entry["sha256"]:
        raise RuntimeError(
            f"{what} shard '{path}' of checkpoint '{checkpoint_path}' is corrupted: it has {len(data)} "
            f"bytes with SHA-256 {digest[:16]}..., the checkpoint's manifest expects {entry['bytes']} bytes with "
            f"{entry['sha256'][:16]}... (the file was changed, truncated or copied only partly, or belongs to "
            f"another save); resume from an earlier checkpoint"
        )
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - the checksum matched, so this is a foreign or unsafe payload
        raise RuntimeError(f"cannot load {what} shard '{path}': {type(err).__name__}: {_first_line(err)}") from err


def read_shards(checkpoint_path: Any, weights_only: bool = True, key: str = "gradcomp") -> list[dict[str, Any]]:
    """Every rank's state of a sharded checkpoint, verified (for tools and tests: a rank loads only its own).

    ``key`` is the checkpoint entry holding the manifest (``"localsgd"``, ``"swarm"`` for those strategies).

    Raises:
        ValueError: the checkpoint has no shard manifest.
        FileNotFoundError, RuntimeError: see :func:`load_shard`.
    """
    fs = get_filesystem(checkpoint_path)
    with fs.open(os.fspath(checkpoint_path), "rb") as file:
        manifest = torch.load(file, map_location="cpu", weights_only=weights_only).get(key)
    if not is_sharded(manifest):
        raise ValueError(f"checkpoint '{checkpoint_path}' holds no sharded {key!r} entry")
    return [load_shard(checkpoint_path, manifest, rank, weights_only) for rank in range(manifest["world_size"])]


def resumable_hpc_checkpoint(checkpoint_path: Any) -> Any:
    """``checkpoint_path``, or, when it is a missing ``hpc_ckpt_<n>.ckpt``, the newest HPC checkpoint file beside it.

    On SLURM, ``fit(ckpt_path=None)`` resumes from ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``, ``n`` being the
    largest number Lightning finds in any name there that contains ``hpc_ckpt_``, files and folders alike. A save
    killed before its file was in place (SLURM's SIGKILL after the grace time) leaves the shard folder
    ``hpc_ckpt_<n>.ckpt.gradcomp`` or a temporary file ``hpc_ckpt_<n>.ckpt.tmp-<random>`` (whose digits Lightning
    appends to ``n``) without ``hpc_ckpt_<n>.ckpt``. Plain DDP's killed save leaves no such name, so Lightning
    resumes from the save before; this returns that one too, with a warning. Any other path is returned as given.
    """
    if not isinstance(checkpoint_path, (str, os.PathLike)):
        return checkpoint_path
    path = os.fspath(checkpoint_path)
    fs = get_filesystem(path)
    if not _HPC_CHECKPOINT.fullmatch(_base(path)) or fs.exists(path):
        return checkpoint_path
    folder = _parent(path)
    try:
        names = [_base(name) for name in fs.ls(folder, detail=False)]
    except FileNotFoundError:
        return checkpoint_path
    numbers = [int(match.group(1)) for name in names if (match := _HPC_CHECKPOINT.fullmatch(name))]
    if not numbers:
        return checkpoint_path
    found = _join(folder, f"hpc_ckpt_{max(numbers)}.ckpt")
    rank_zero_warn(
        f"HPC checkpoint '{path}' does not exist: its save was interrupted (what is left of it, a shard folder "
        f"or a temporary file, made Lightning pick it). Resuming from '{found}', the newest complete one"
    )
    return found


def _locate(checkpoint_path: str, folder: str, name: str) -> str:
    recorded = _join(_join(_parent(checkpoint_path), folder), name)
    renamed = _join(shard_dir(checkpoint_path), name)
    if (
        recorded != renamed
        and not get_filesystem(recorded).exists(recorded)
        and get_filesystem(renamed).exists(renamed)
    ):
        return renamed
    return recorded


# ---------------------------------------------------------------------------------------------- checkpoint file
def verify_checkpoint_file(path: Any) -> None:
    """Check the CRC-32 of every member of a local zip-format checkpoint (what ``torch.save`` writes).

    ``torch.load`` does not verify the checksums, so a flipped bit in a tensor would load silently. Remote
    paths, non-zip (legacy) files and missing files are left to the loader (which reports them itself).

    Raises:
        RuntimeError: a member's data does not match its checksum, or the archive is damaged; the message
            names the file.
    """
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path) or not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        raise _unreadable(path, err) from err
    if bad is not None:
        raise RuntimeError(
            f"checkpoint file '{path}' is corrupted: member {bad!r} does not match its "
            f"CRC-32 checksum; resume from an earlier checkpoint"
        )


def load_verified(load: Callable[[], dict[str, Any]], path: Any) -> dict[str, Any]:
    """CRC-check ``path`` (:func:`verify_checkpoint_file`), then ``load()``; failures name the file.

    Raises:
        RuntimeError: the file is damaged or unreadable (a missing file keeps Lightning's own error).
    """
    verify_checkpoint_file(path)
    try:
        return load()
    except FileNotFoundError:
        raise  # Lightning's message names the file
    except Exception as err:  # noqa: BLE001 - garbage makes the unpickler fail in arbitrary ways
        raise _unreadable(path, err) from err


def _unreadable(path: Any, err: BaseException) -> RuntimeError:
    if "weights only" in str(err).lower():
        why = "it holds pickled objects that `weights_only=True` loading refuses"
    else:
        why = (
            "the file is truncated or corrupted (for example, copied or written only partly) or is not a "
            "PyTorch checkpoint; resume from an earlier checkpoint"
        )
    return RuntimeError(f"cannot load checkpoint file '{path}': {why} ({type(err).__name__}: {_first_line(err)})")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"


# ---------------------------------------------------------------------------------------------- remove
def remove_stale_shards(checkpoint_path: Any, rank: int, keep: str, token: str = "") -> None:
    """Delete rank ``rank``'s shard files of ``checkpoint_path`` other than ``keep`` (earlier saves, leftovers);
    with ``token``, only those of that save (a save that failed).

    Each rank deletes only its own files, so this also works where every node has its own disk.
    """
    folder = shard_dir(checkpoint_path)
    fs = get_filesystem(folder)
    prefix = f"rank-{rank:05d}-{token}"
    try:
        names = [_base(path) for path in fs.ls(folder, detail=False)]
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(prefix) and name != keep:
            _remove_quietly(fs, _join(folder, name))


def remove_shards(checkpoint_path: Any, rank: int) -> None:
    """Delete rank ``rank``'s shard files of ``checkpoint_path``, then the folder once it is empty."""
    remove_stale_shards(checkpoint_path, rank, keep="")
    folder = shard_dir(checkpoint_path)
    fs = get_filesystem(folder)
    try:
        if fs.exists(folder) and not fs.ls(folder, detail=False):
            fs.rmdir(folder)
    except Exception:  # noqa: BLE001 - best effort: another rank's file is still there, or it removed the folder
        pass


def _remove_quietly(fs: AbstractFileSystem, path: str) -> None:
    try:
        fs.rm(path)
    except FileNotFoundError:
        pass
