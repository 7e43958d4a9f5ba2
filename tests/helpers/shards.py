"""Damaging one rank's checkpoint shard, for the tests that a resume stops with an error naming it."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from lightning_gradcomp.shard_files import shard_dir


def damage_shard(ckpt: Path, key: str, what: str, damage: str, rank: int = 1, world: int = 2) -> str:
    """Remove (``damage="missing"``) or flip one bit of (``"one_byte"``) ``rank``'s shard of ``ckpt``, whose
    manifest is under ``key``; return the regex of the error a resume must raise (``what``: how the strategy names
    its shards, e.g. ``"compression-state"``)."""
    name = torch.load(ckpt, weights_only=True)[key]["shards"][rank]["file"]
    shard = Path(shard_dir(ckpt), name)
    prefix = rf"{what} shard '{re.escape(str(shard))}' .* is "
    if damage == "missing":
        shard.unlink()
        return prefix + rf"missing \(rank {rank} of {world}\)"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return prefix + "corrupted"
