"""Checkpoint safety: ``weights_only`` loading, and clear errors (naming the file) instead of partial loads."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.shard_files import read_shards
from lightning_gradcomp.compressors import CLTK, Compressor, TopK
from lightning_gradcomp.strategy import CHECKPOINT_KEY, verify_checkpoint_file
from reliability.launch import STATEFUL, load, losses, run, text
from reliability.scenarios import CKPT_STEP, config, errors


def _strategy(compressor: Compressor, world: int = 2, rank: int = 0) -> GradCompStrategy:
    strategy = GradCompStrategy(compressor=compressor)
    env = LightningEnvironment()
    env.set_world_size(world)
    env.set_global_rank(rank)
    strategy.cluster_environment = env
    return strategy


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in (k, *_leaves(v))]
    if isinstance(tree, (list, tuple)):
        return [leaf for v in tree for leaf in _leaves(v)]
    return [tree]


# ---------------------------------------------------------------------------------------------- weights_only
@pytest.mark.slow
@pytest.mark.parametrize("case", STATEFUL)
def test_every_checkpoint_loads_with_weights_only(killed_run: Any, case: str) -> None:
    files = sorted(killed_run(case).ckpt_dir.glob("*.ckpt"))
    assert [f.name for f in files] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    for path in files:
        saved = torch.load(path, weights_only=True)
        key = "swarm" if case == "swarm" else CHECKPOINT_KEY
        entry = saved[key]
        assert entry["world_size"] == 2 and len(entry["shards"]) == 2
        entry = {"manifest": entry, "shards": read_shards(path, key=key)}  # read with weights_only=True
        assert all(isinstance(leaf, (torch.Tensor, int, float, str, bool, type(None))) for leaf in _leaves(entry))
        verify_checkpoint_file(path)  # intact


# ---------------------------------------------------------------------------------------------- damaged files
@pytest.fixture(scope="module")
def topk_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real two-rank TopK checkpoint (one epoch)."""
    root = tmp_path_factory.mktemp("topk_ckpt")
    cfg = config(root / "run", "topk", ckpt_dir=str(root / "ckpt"), max_epochs=1)
    assert run(cfg) == [0, 0], errors(root / "run", 2)
    return root / "ckpt" / "last.ckpt"


def _flip_a_tensor_byte(data: bytes, path: Path) -> bytes:
    """Flip one byte inside the largest tensor of a ``torch.save`` zip archive."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26: info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    damaged = bytearray(data)
    damaged[start + info.file_size // 2] ^= 0x10
    return bytes(damaged)


DAMAGE = {
    "truncated": lambda data, path: data[: len(data) // 2],
    "tail_cut": lambda data, path: data[:-64],
    "empty": lambda data, path: b"",
    "not_a_checkpoint": lambda data, path: b"this is not a checkpoint\n" * 40,
    "bit_flip": _flip_a_tensor_byte,
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_file_raises_naming_it(topk_checkpoint: Path, tmp_path: Path, damage: str) -> None:
    bad = tmp_path / f"{damage}.ckpt"
    bad.write_bytes(DAMAGE[damage](topk_checkpoint.read_bytes(), topk_checkpoint))
    if damage == "bit_flip":  # torch.load alone would not notice: the damage would load silently
        assert torch.load(bad, weights_only=True)["global_step"] == 4
    with pytest.raises(RuntimeError, match=rf"checkpoint file '{bad}'.*(truncated or corrupted|is corrupted)"):
        _strategy(TopK(0.05)).load_checkpoint(bad)


def test_intact_file_loads_and_stashes_this_ranks_state(topk_checkpoint: Path) -> None:
    strategy = _strategy(TopK(0.05), rank=1)
    checkpoint = strategy.load_checkpoint(topk_checkpoint)
    state, per_rank = strategy._pending
    assert per_rank and checkpoint[CHECKPOINT_KEY]["shards"][1]["rank"] == 1 and state["memory"]
    want = read_shards(topk_checkpoint)[1]["memory"]
    assert state["memory"].keys() == want.keys() and all(torch.equal(state["memory"][k], want[k]) for k in want)


def test_another_compressor_is_rejected_naming_both(topk_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=rf"cannot resume from '{topk_checkpoint}': checkpoint was written with "
                                         r"compressor TopK, but this strategy uses CLTK"):
        _strategy(CLTK(0.05)).load_checkpoint(topk_checkpoint)


@pytest.mark.parametrize("edit", ["missing_rank", "not_a_dict", "rank_entry_not_a_dict", "no_compressor"])
def test_malformed_entry_is_rejected(topk_checkpoint: Path, tmp_path: Path, edit: str) -> None:
    saved = torch.load(topk_checkpoint, weights_only=True)
    entry = saved[CHECKPOINT_KEY]
    if edit == "missing_rank":
        entry["shards"] = entry["shards"][:1]
    elif edit == "not_a_dict":
        saved[CHECKPOINT_KEY] = [entry]
    elif edit == "rank_entry_not_a_dict":
        entry["shards"][1] = "state"
    else:
        del entry["compressor"]
    path = tmp_path / "edited.ckpt"
    torch.save(saved, path)
    with pytest.raises(ValueError, match=rf"'{path}': checkpoint entry 'gradcomp' is malformed"):
        _strategy(TopK(0.05), rank=1).load_checkpoint(path)


@pytest.mark.parametrize("problem", ["truncated", "other_compressor"])
def test_a_bad_checkpoint_stops_every_rank_cleanly(topk_checkpoint: Path, tmp_path: Path, problem: str) -> None:
    path = topk_checkpoint
    case = "topk"
    if problem == "truncated":
        path = tmp_path / "truncated.ckpt"
        path.write_bytes(topk_checkpoint.read_bytes()[:-64])
    else:
        case = "cltk"
    out = tmp_path / "run"
    assert run(config(out, case, ckpt_path=str(path)), timeout=60.0) == [1, 1]
    for rank in range(2):
        error = text(out, "error", rank)
        assert str(path) in error.splitlines()[0]
        assert losses(out, rank) == []  # nothing trained on a partial state


# ---------------------------------------------------------------------------------------------- plain DDP
def test_plain_ddp_checkpoint_resumes_with_fresh_compression_state(tmp_path: Path) -> None:
    first, ckpt_dir = tmp_path / "ddp", tmp_path / "ckpt"
    assert run(config(first, "ddp", ckpt_dir=str(ckpt_dir), max_epochs=2)) == [0, 0], errors(first, 2)
    out = tmp_path / "topk"
    assert run(config(out, "topk", ckpt_path=str(ckpt_dir / "last.ckpt"))) == [0, 0], errors(out, 2)
    assert "the checkpoint has no 'gradcomp' entry" in text(out, "warnings", 0)
    assert "starts fresh" in text(out, "warnings", 0)
    for rank in range(2):
        start, end = load(out, "start", rank), load(out, "end", rank)
        assert start["global_step"] == CKPT_STEP and start["hook"]["step"] == 0 and start["hook"]["memory"] == {}
        assert end["hook"]["stats"]["compressed_steps"] == 2 and end["hook"]["memory"]  # compressing again
        assert torch.equal(end["params"], load(out, "end", 0)["params"])
