"""Checkpoints of GradCompFSDPStrategy: Lightning's distributed checkpoint plus each rank's compression state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsdp.models import fit_sharded
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gradcomp import GradCompFSDPStrategy
from lightning_gradcomp.compressors import CLTK, DIANA, PowerSGD

STATEFUL = {
    "cltk": lambda: CLTK(density=0.05),
    "powersgd": lambda: PowerSGD(rank=1, min_compression_rate=1.0),
    "diana": lambda: DIANA(),
}


def _strategy(name: str, distributed: bool = True) -> GradCompFSDPStrategy:
    return GradCompFSDPStrategy(compressor=STATEFUL[name](), shard_size=2, start_method="fork", min_numel=8,
                                start_step=2, save_distributed_checkpoint=distributed)


def _save_after_two_epochs(name: str, out: Path, distributed: bool = True) -> Path:
    """12 steps (two epochs of 6), checkpointed at the end of the fit; the checkpoint's path."""
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", save_last=True)
    fit_sharded(_strategy(name, distributed), out / "first", max_steps=-1, max_epochs=2, callbacks=[ckpt],
                enable_checkpointing=True)
    return out / "ckpt" / "last.ckpt"


@pytest.mark.parametrize(("name", "distributed"), [(name, True) for name in sorted(STATEFUL)] + [("cltk", False)])
def test_resume_equals_the_uninterrupted_run(tmp_path: Path, name: str, distributed: bool) -> None:
    """``distributed=False``: Lightning gathers the full model and optimizer into rank 0's file instead."""
    straight = fit_sharded(_strategy(name), tmp_path / "straight", max_steps=-1, max_epochs=4)
    path = _save_after_two_epochs(name, tmp_path, distributed)
    resumed = fit_sharded(_strategy(name, distributed), tmp_path / "resumed", max_steps=-1, max_epochs=4,
                          ckpt_path=str(path))
    for rank, (rec, ref) in enumerate(zip(resumed, straight)):
        assert len(rec["params"]) == 12
        for step, (a, b) in enumerate(zip(rec["params"], ref["params"][12:])):
            assert torch.equal(a, b), f"{name}: rank {rank} differs after resumed step {step}"
        assert rec["step"] == ref["step"] == 24
        assert rec["memory"].keys() == ref["memory"].keys()
        assert all(torch.equal(rec["memory"][k], ref["memory"][k]) for k in rec["memory"])


def _shard_files(path: Path) -> list[Path]:
    return sorted(Path(f"{path}.gradcomp").glob("rank-*.pt"))


def test_every_rank_saves_its_own_state(tmp_path: Path) -> None:
    path = _save_after_two_epochs("cltk", tmp_path)
    files = _shard_files(path)
    assert [f.name[:10] for f in files] == [f"rank-0000{r}" for r in range(4)]
    memories = [torch.load(f, weights_only=True)["memory"] for f in files]
    assert memories[0] and not all(
        torch.equal(memories[0][k], memories[1][k]) for k in memories[0] if k in memories[1]
    )


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_missing_or_corrupt_rank_state_names_the_file(tmp_path: Path, damage: str) -> None:
    path = _save_after_two_epochs("cltk", tmp_path)
    victim = _shard_files(path)[1]
    if damage == "missing":
        victim.unlink()
    else:
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    with pytest.raises(Exception) as info:
        fit_sharded(_strategy("cltk"), tmp_path / "resumed", max_steps=-1, max_epochs=4, ckpt_path=str(path))
    assert victim.name in str(info.value)


def test_the_manifest_is_in_the_metadata_and_another_compressor_is_refused(tmp_path: Path) -> None:
    path = _save_after_two_epochs("cltk", tmp_path)
    meta = torch.load(path / "meta.pt", weights_only=True)["gradcomp_fsdp"]
    assert meta["compressor"] == "CLTK" and meta["world_size"] == 4 and len(meta["shards"]) == 4
    with pytest.raises(Exception, match="written with compressor CLTK"):
        fit_sharded(_strategy("diana"), tmp_path / "resumed", max_steps=-1, max_epochs=4, ckpt_path=str(path))
