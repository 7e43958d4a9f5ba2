"""Per-rank shard files of the compression state: the module alone, then end to end with Lightning (fork, gloo)."""

from __future__ import annotations

import io
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import fsspec
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.models import ReadyOrderNet, TinyNet, fit
from helpers.shards import damage_shard
from lightning_gradcomp import GradCompStrategy, shard_files
from lightning_gradcomp.shard_files import (build_manifest, check_manifest, load_shard, read_shards,
                                                  remove_shards, remove_stale_shards, shard_dir, shard_name,
                                                  shard_path, write_shard)
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.strategy import CHECKPOINT_KEY


def _state(rank: int, numel: int = 1000) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank)
    return {"step": 7, "beta": 1.0, "layer_params": {"a": 0.1}, "memory": {"w": torch.randn(numel, generator=gen)},
            "compressor": {}, "stats": {"steps": 7}}


def _sharded(ckpt: Any, world: int = 3, token: str = "t0") -> dict[str, Any]:
    shards = [write_shard(_state(rank), ckpt, rank, token) for rank in range(world)]
    return build_manifest(shards, "TopK", {"step": 7}, ckpt)


# ---------------------------------------------------------------------------------------------- paths
def test_paths_sit_next_to_the_checkpoint() -> None:
    assert shard_dir("/ckpt/last.ckpt") == "/ckpt/last.ckpt.gradcomp"
    assert shard_name(3, "ab12") == "rank-00003-ab12.pt"
    assert shard_path("/ckpt/last.ckpt", 3, "ab12") == os.path.join("/ckpt/last.ckpt.gradcomp", "rank-00003-ab12.pt")
    assert shard_path("s3://bucket/run/last.ckpt", 0, "ab") == "s3://bucket/run/last.ckpt.gradcomp/rank-00000-ab.pt"
    assert shard_dir(Path("/ckpt") / "a.ckpt") == "/ckpt/a.ckpt.gradcomp"
    with pytest.raises(ValueError, match="`token` must be"):
        shard_name(0, "../x")
    with pytest.raises(ValueError, match="`rank` must be"):
        shard_name(-1, "ab")


# ---------------------------------------------------------------------------------------------- manifest
def test_manifest_round_trip(tmp_path: Path) -> None:
    ckpt = tmp_path / "sub" / "last.ckpt"  # the folder does not exist yet: write_shard creates it
    manifest = _sharded(ckpt)
    buffer = io.BytesIO()
    torch.save({CHECKPOINT_KEY: manifest}, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=True)[CHECKPOINT_KEY]
    check_manifest(again)
    assert again == manifest and again["world_size"] == 3 and again["dir"] == "last.ckpt.gradcomp"
    assert sorted(os.listdir(shard_dir(ckpt))) == [shard_name(r, "t0") for r in range(3)]  # no temporary files
    for rank, entry in enumerate(again["shards"]):
        assert entry["bytes"] == os.path.getsize(shard_path(ckpt, rank, "t0"))
        assert torch.equal(load_shard(ckpt, again, rank)["memory"]["w"], _state(rank)["memory"]["w"])


def _edit(manifest: dict[str, Any], edit: str) -> Any:
    if edit == "not_a_dict":
        return [manifest]
    if edit == "missing_rank":
        manifest["shards"] = manifest["shards"][:2]
    elif edit == "ranks_swapped":
        manifest["shards"][0], manifest["shards"][1] = manifest["shards"][1], manifest["shards"][0]
    elif edit == "path_in_file_name":
        manifest["shards"][1]["file"] = "../../etc/rank-00001-t0.pt"
    elif edit == "path_in_dir":
        manifest["dir"] = "../elsewhere.gradcomp"
    elif edit == "bad_checksum_field":
        manifest["shards"][2]["sha256"] = "abc"
    elif edit == "no_replicated":
        del manifest["replicated"]
    return manifest


@pytest.mark.parametrize("edit", ["not_a_dict", "missing_rank", "ranks_swapped", "path_in_file_name", "path_in_dir",
                                  "bad_checksum_field", "no_replicated"])
def test_malformed_manifest_is_rejected(tmp_path: Path, edit: str) -> None:
    manifest = _edit(_sharded(tmp_path / "last.ckpt"), edit)
    with pytest.raises(ValueError, match="checkpoint entry 'gradcomp' is malformed"):
        check_manifest(manifest)


# ---------------------------------------------------------------------------------------------- damage
@pytest.mark.parametrize("damage", ["one_byte", "truncated", "other_save"])
def test_damaged_shard_raises_naming_it(tmp_path: Path, damage: str) -> None:
    ckpt = tmp_path / "last.ckpt"
    manifest = _sharded(ckpt)
    path = Path(shard_path(ckpt, 1, "t0"))
    data = bytearray(path.read_bytes())
    if damage == "one_byte":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncated":
        data = data[:-10]
    else:  # a valid shard, but not the one the manifest lists
        write_shard(_state(5), ckpt, 1, "t0")
        data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=rf"shard '{re.escape(str(path))}' of checkpoint .* is corrupted.*"
                                           r"resume from an earlier checkpoint"):
        load_shard(ckpt, manifest, 1)
    load_shard(ckpt, manifest, 0)  # the other ranks' shards are intact


def test_missing_shard_raises_naming_it(tmp_path: Path) -> None:
    ckpt = tmp_path / "last.ckpt"
    manifest = _sharded(ckpt)
    path = shard_path(ckpt, 2, "t0")
    os.remove(path)
    with pytest.raises(FileNotFoundError, match=rf"shard '{re.escape(path)}' of checkpoint '{re.escape(str(ckpt))}' "
                                                r"is missing \(rank 2 of 3\).*Copy that folder together"):
        load_shard(ckpt, manifest, 2)


def test_a_linked_or_renamed_checkpoint_finds_its_shards(tmp_path: Path) -> None:
    ckpt = tmp_path / "epoch=1.ckpt"
    manifest = _sharded(ckpt, world=1)
    link = tmp_path / "last.ckpt"
    link.symlink_to(ckpt.name)  # ModelCheckpoint(save_last="link")
    assert load_shard(link, manifest, 0)["step"] == 7  # through the recorded folder name
    renamed = tmp_path / "moved" / "renamed.ckpt"
    renamed.parent.mkdir()
    os.rename(shard_dir(ckpt), shard_dir(renamed))
    assert load_shard(renamed, manifest, 0)["step"] == 7  # through <checkpoint>.gradcomp


# ---------------------------------------------------------------------------------------------- remove, remote
def test_each_rank_removes_only_its_own_shards(tmp_path: Path) -> None:
    ckpt = tmp_path / "last.ckpt"
    _sharded(ckpt, world=2, token="old")
    _sharded(ckpt, world=2, token="new")
    Path(shard_path(ckpt, 0, "new") + ".tmp-123").write_bytes(b"left over by a crash")
    remove_stale_shards(ckpt, 0, keep=shard_name(0, "new"))
    assert sorted(os.listdir(shard_dir(ckpt))) == ["rank-00000-new.pt", "rank-00001-new.pt", "rank-00001-old.pt"]
    remove_shards(ckpt, 0)
    assert os.path.isdir(shard_dir(ckpt))  # rank 1's files are still there
    remove_shards(ckpt, 1)
    assert not os.path.exists(shard_dir(ckpt))
    remove_shards(ckpt, 1)  # nothing left: no error


def test_fsspec_paths_work() -> None:
    ckpt = "memory://gradcomp-test/run/last.ckpt"
    manifest = _sharded(ckpt, world=2)
    fs = fsspec.filesystem("memory")
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls("/gradcomp-test/run/last.ckpt.gradcomp", detail=False)) == [
        "rank-00000-t0.pt", "rank-00001-t0.pt"]
    assert torch.equal(load_shard(ckpt, manifest, 1)["memory"]["w"], _state(1)["memory"]["w"])
    for rank in range(2):
        remove_shards(ckpt, rank)
    assert not fs.exists("/gradcomp-test/run/last.ckpt.gradcomp/rank-00000-t0.pt")


# ---------------------------------------------------------------------------------------------- Lightning
def _strategy(**kwargs: Any) -> GradCompStrategy:
    return GradCompStrategy(compressor=TopK(0.05), start_method="fork", **kwargs)


def _model(world: int, **kwargs: Any) -> pl.LightningModule:
    return (TinyNet if world == 2 else ReadyOrderNet)(samples=32 * world, **kwargs)  # 4 steps per epoch


def _assert_same_run(resumed: list[dict[str, Any]], straight: list[dict[str, Any]]) -> None:
    for rank, (got, want) in enumerate(zip(resumed, straight, strict=True)):
        tail = want["params"][-len(got["params"]):]
        assert all(torch.equal(a, b) for a, b in zip(got["params"], tail, strict=True)), f"rank {rank}"
        assert got["hook_step"] == want["hook_step"]
        assert got["memory"].keys() == want["memory"].keys()
        assert all(torch.equal(got["memory"][k], want["memory"][k]) for k in got["memory"])


@pytest.mark.parametrize("world", [2, 3])
def test_resume_from_shards_reproduces_the_uninterrupted_run(tmp_path: Path, world: int) -> None:
    straight = fit(_strategy(), tmp_path / "straight", devices=world, model=_model(world), max_epochs=4)
    ckpt_dir = tmp_path / "ckpt"
    first = fit(_strategy(), tmp_path / "first", devices=world, model=_model(world), max_epochs=2,
                callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], enable_checkpointing=True)
    last = ckpt_dir / "last.ckpt"
    listed = [shard["file"] for shard in torch.load(last, weights_only=True)[CHECKPOINT_KEY]["shards"]]
    assert sorted(os.listdir(shard_dir(last))) == listed  # saved twice: the first save's shards are gone
    states = read_shards(last)
    for rank, state in enumerate(states):  # each shard holds its own rank's state
        assert all(torch.equal(state["memory"][k], first[rank]["memory"][k]) for k in first[rank]["memory"])
    assert not torch.equal(states[0]["memory"]["body.2.weight" if world == 2 else "mid.weight"],
                           states[1]["memory"]["body.2.weight" if world == 2 else "mid.weight"])
    resumed = fit(_strategy(), tmp_path / "resumed", devices=world, model=_model(world), max_epochs=4,
                  ckpt_path=str(last))
    _assert_same_run(resumed, straight)


def test_old_single_file_checkpoint_still_resumes(tmp_path: Path) -> None:
    """A version-1 checkpoint (every rank's state inline in rank 0's file, no shard folder) resumes exactly."""
    straight = fit(_strategy(), tmp_path / "straight", model=_model(2), max_epochs=4)
    ckpt_dir = tmp_path / "ckpt"
    fit(_strategy(), tmp_path / "first", model=_model(2), max_epochs=2,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], enable_checkpointing=True)
    saved = torch.load(ckpt_dir / "last.ckpt", weights_only=True)
    old = tmp_path / "old.ckpt"
    saved[CHECKPOINT_KEY] = {"version": 1, "compressor": "TopK", "world_size": 2,
                             "per_rank": read_shards(ckpt_dir / "last.ckpt")}
    torch.save(saved, old)
    assert not os.path.exists(shard_dir(old))
    resumed = fit(_strategy(), tmp_path / "resumed", model=_model(2), max_epochs=4, ckpt_path=str(old))
    _assert_same_run(resumed, straight)


def test_linked_last_checkpoint_and_removed_top_k(tmp_path: Path) -> None:
    """``save_last="link"`` resumes through the link; a checkpoint ModelCheckpoint removes takes its shards along."""
    ckpt_dir = tmp_path / "ckpt"
    fit(_strategy(), tmp_path / "first", model=_model(2), max_epochs=2, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=1, save_last="link")])
    assert os.path.islink(ckpt_dir / "last.ckpt")
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=1-step=8.ckpt", "epoch=1-step=8.ckpt.gradcomp", "last.ckpt"]
    resumed = fit(_strategy(), tmp_path / "resumed", model=_model(2), max_epochs=3,
                  ckpt_path=str(ckpt_dir / "last.ckpt"))
    assert resumed[0]["hook_step"] == 12 and resumed[0]["memory"]


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-rank TopK checkpoint after one epoch."""
    root = tmp_path_factory.mktemp("shards")
    fit(_strategy(), root / "first", model=_model(2), max_epochs=1, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", save_last=True)])
    return root / "ckpt" / "last.ckpt"


def _copy_checkpoint(ckpt: Path, dest: Path) -> Path:
    """Copy a checkpoint and its shard folder (the folder name recorded in the manifest is kept)."""
    dest.mkdir()
    target = dest / ckpt.name
    target.write_bytes(ckpt.read_bytes())
    os.mkdir(shard_dir(target))
    for name in os.listdir(shard_dir(ckpt)):
        Path(shard_dir(target), name).write_bytes(Path(shard_dir(ckpt), name).read_bytes())
    return target


@pytest.mark.parametrize("damage", ["missing", "one_byte"])
def test_a_damaged_shard_stops_the_resume_naming_it(two_rank_checkpoint: Path, tmp_path: Path, damage: str) -> None:
    ckpt = _copy_checkpoint(two_rank_checkpoint, tmp_path / "copy")
    message = damage_shard(ckpt, CHECKPOINT_KEY, "compression-state", damage)
    with pytest.raises(Exception, match=message):
        fit(_strategy(timeout=timedelta(seconds=60)), tmp_path / "resumed", model=_model(2), max_epochs=2,
            ckpt_path=str(ckpt))
    assert not (tmp_path / "resumed" / "rank0.pt").exists()  # nothing trained


class _FailShardWrite(pl.Callback):
    """Makes rank 1's next shard write fail (the fork launcher: the patch stays in rank 1's process)."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 1:
            def fail(*args: Any, **kwargs: Any) -> Any:
                raise OSError("No space left on device (simulated)")
            shard_files.write_shard = fail


def test_a_failed_shard_write_stops_every_rank(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"No space left on device \(simulated\)"):
        fit(_strategy(timeout=timedelta(seconds=60)), tmp_path / "run", model=_model(2), max_epochs=1,
            enable_checkpointing=True,
            callbacks=[_FailShardWrite(), ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
    assert not (tmp_path / "ckpt" / "last.ckpt").exists()


def test_rank_zero_file_holds_no_memories_at_w4(tmp_path: Path) -> None:
    """At W = 4 the checkpoint file grows by a few KiB (the manifest), not by 4 memories; each shard holds one."""
    world, ckpt_dir = 4, tmp_path / "ckpt"
    model = TinyNet(hidden=256, in_features=256, samples=32 * world)
    compressed = {name: p.numel() for name, p in model.named_parameters() if p.dim() > 1 and p.numel() >= 1024}
    memory_bytes = 4 * sum(compressed.values())  # one rank's error-feedback memory: ~0.5 MiB
    fit(_strategy(), tmp_path / "run", devices=world, model=model, max_epochs=1, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)])
    last = ckpt_dir / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    entry = saved.pop(CHECKPOINT_KEY)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    assert os.path.getsize(last) - buffer.tell() < 16 * 1024 < memory_bytes  # the manifest is all it adds
    assert entry["world_size"] == world and "memory" not in entry["replicated"]
    states = read_shards(last)
    for rank, shard in enumerate(entry["shards"]):
        assert memory_bytes <= shard["bytes"] < memory_bytes + 64 * 1024  # one rank's memory, once
        assert set(states[rank]["memory"]) == set(compressed)
    assert len({float(s["memory"]["body.2.weight"].abs().sum()) for s in states}) == world  # per-rank memories


def test_the_old_module_name_warns_and_is_the_same_module() -> None:
    import importlib
    import sys

    sys.modules.pop("lightning_gradcomp.checkpoint_shards", None)
    with pytest.warns(DeprecationWarning, match="renamed lightning_gradcomp.shard_files"):
        old = importlib.import_module("lightning_gradcomp.checkpoint_shards")
    assert old is shard_files
