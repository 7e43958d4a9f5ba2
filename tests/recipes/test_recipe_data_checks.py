"""Missing local data stops a recipe before training, in the launching process, with the argument and path named
(``check_data`` of each data module, called by the CLI's ``before_<subcommand>``); present data passes the check."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from recipes import RECIPES, config_path
from recipes.data.idx import write_idx
from recipes.data.image_data import ImageDataModule
from recipes.data.speech_data import SpeechDataModule
from recipes.data.translation_data import TranslationDataModule

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


def _idx_files(root: Path, splits: tuple[str, ...] = ("train", "t10k")) -> None:
    import numpy as np

    for split in splits:
        write_idx(root / f"{split}-images-idx3-ubyte", np.zeros((2, 4, 4), dtype=np.uint8))
        write_idx(root / f"{split}-labels-idx1-ubyte", np.zeros(2, dtype=np.uint8))


def test_image_idx_files_are_checked(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"`data.root`: no train-images-idx3-ubyte\[.gz\] in .*none"):
        ImageDataModule(source="fashion_mnist", root=str(tmp_path / "none")).check_data()
    _idx_files(tmp_path, ("train",))
    with pytest.raises(FileNotFoundError, match="`data.root`: no t10k-images"):
        ImageDataModule(source="mnist", root=str(tmp_path)).check_data()
    _idx_files(tmp_path)
    ImageDataModule(source="mnist", root=str(tmp_path)).check_data()


def test_image_folder_splits_are_checked(tmp_path: Path):
    module = ImageDataModule(source="imagefolder", root=str(tmp_path), num_classes=3, val_dir="validation")
    with pytest.raises(FileNotFoundError, match=r"`data.root` / `data.train_dir`: image folder .*train does not"):
        module.check_data()
    (tmp_path / "train" / "cat").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"`data.val_dir`: image folder .*validation does not exist"):
        module.check_data()
    (tmp_path / "validation").mkdir()
    with pytest.raises(FileNotFoundError, match="validation has no class sub-folders"):
        module.check_data()
    (tmp_path / "validation" / "cat").mkdir()
    module.check_data()


@pytest.mark.parametrize("source", ["digits", "shapes"])
def test_generated_image_sources_need_nothing(source: str):
    ImageDataModule(source=source).check_data()


def test_speech_corpus_splits_are_checked(tmp_path: Path):
    module = SpeechDataModule(source="corpus", root=str(tmp_path), train_dir="train-clean", val_dir="dev-clean")
    with pytest.raises(FileNotFoundError, match=r"`data.train_dir`: speech corpus folder .*train-clean does not"):
        module.check_data()
    (tmp_path / "train-clean").mkdir()
    with pytest.raises(FileNotFoundError, match=r"`data.val_dir`: speech corpus folder .*dev-clean does not"):
        module.check_data()
    (tmp_path / "dev-clean").mkdir()
    module.check_data()
    SpeechDataModule(source="digits", cache_dir=str(tmp_path / "cache")).check_data()  # generated: nothing to check


def test_translation_files_are_checked(tmp_path: Path):
    names = ["train.en", "train.de", "val.en", "val.de"]
    files = dict(zip(["train_src", "train_tgt", "val_src", "val_tgt"], (str(tmp_path / n) for n in names)))
    module = TranslationDataModule(source="parallel", **files)  # construction reads no file
    for side, name in zip(files, names):
        with pytest.raises(FileNotFoundError, match=rf"`data.{side}`: .*{name} is not a file"):
            module.check_data()
        (tmp_path / name).write_text("a\n")
    module.check_data()
    with pytest.raises(FileNotFoundError, match=r"`data.root`: the Ding dictionary .*missing is not a file"):
        TranslationDataModule(source="ding", root=str(tmp_path / "missing")).check_data()
    TranslationDataModule(source="numbers").check_data()


@pytest.mark.parametrize(
    "task, overrides, message",
    [
        ("image", ["--data.source=fashion_mnist", "--data.root={missing}"], "`data.root`"),
        ("speech", ["--data.source=corpus", "--data.root={missing}"], "`data.train_dir`"),
        (
            "translation",
            ["--data.source=parallel", *(f"--data.{f}={{missing}}/{f}" for f in
                                         ("train_src", "train_tgt", "val_src", "val_tgt"))],
            "`data.train_src`",
        ),
    ],
)
def test_fit_stops_before_any_rank_starts(task: str, overrides: list, message: str, tmp_path: Path):
    """``fit`` with a missing data path raises in this process, from the recipe's CLI (its ``main``), before the
    trainer launches ranks."""
    recipe = importlib.import_module(RECIPES[task].module)
    launched = []
    args = ["fit", "-c", str(config_path(task, "dense_cpu")), f"--trainer.default_root_dir={tmp_path}",
            *(o.format(missing=tmp_path / "missing") for o in overrides)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("lightning.pytorch.Trainer.fit", lambda *a, **k: launched.append(a))
        with pytest.raises(FileNotFoundError, match=message):
            recipe.main(args)
    assert not launched
