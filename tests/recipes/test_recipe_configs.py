"""Every YAML config parses with its recipe's CLI; the CPU-sized ones (and the full-scale ones moved to CPU)
also instantiate: trainer, strategy, compressor, callbacks, model and data module."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from recipes import CONFIG_DIR, RECIPES, config_path
from recipes.cli import RecipeCLI

CONFIGS = sorted((task, p.stem) for task in RECIPES for p in (CONFIG_DIR / task).glob("*.yaml"))
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
CPU_OVERRIDES = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.precision=32-true"]


@pytest.fixture
def free_the_models():
    """Free the models a test built before the next test runs.

    A CLI's trainer, strategy and model refer to one another, so only the collector's rare full pass frees them: the
    full-scale models (90-300 MB each) stayed in the test process, which grew to 3.4 GB. Every later multi-process
    test forks its ranks from that process, and a fork costs more the more it holds (about 25 ms at 0.5 GB, 80 ms at
    2.5 GB, over some 1,800 forks).
    """
    yield
    gc.collect()


class _ParseOnly(RecipeCLI):
    def instantiate_classes(self) -> None:  # parse and validate types, build nothing
        self.instantiated = False


def _cli_args(task: str) -> tuple:
    module = __import__(RECIPES[task].module, fromlist=["LINKS"])
    return module.LINKS


def _model_and_data(task: str) -> tuple[type, type]:
    from recipes.data.image_data import ImageDataModule
    from recipes.data.language_data import LanguageDataModule
    from recipes.data.speech_data import SpeechDataModule
    from recipes.data.translation_data import TranslationDataModule
    from recipes.tasks import ImageClassifier, LanguageModel, SpeechRecognizer, Translator

    return {"image": (ImageClassifier, ImageDataModule), "translation": (Translator, TranslationDataModule),
            "speech": (SpeechRecognizer, SpeechDataModule), "language": (LanguageModel, LanguageDataModule)}[task]


def _twin(name: str) -> str:
    """``X_long_cpu`` (a CPU run with a horizon, issue 49) sits beside ``X_cpu``; ``X_cpu`` beside ``X``."""
    if name.endswith("_long_cpu"):
        return name[: -len("_long_cpu")] + "_cpu"
    return name[:-4] if name.endswith("_cpu") else name + "_cpu"


def test_every_task_has_dense_and_cpu_twins():
    for task, recipe in RECIPES.items():
        names = set(recipe.configs)
        assert {"dense", "dense_cpu"} <= names, task
        for name in names:
            assert _twin(name) in names, f"{task}/{name} has no {_twin(name)}"


@pytest.mark.parametrize("task, name", CONFIGS)
def test_config_parses(task: str, name: str):
    model, data = _model_and_data(task)
    cli = _ParseOnly(model, data, links=_cli_args(task), run=False, args=["-c", str(config_path(task, name))])
    strategy = cli.config.trainer.strategy
    assert strategy.class_path.startswith("lightning_gradcomp.")
    assert cli.config.report.path.endswith("summary.json")


@pytest.mark.usefixtures("free_the_models")
@pytest.mark.parametrize("task, name", CONFIGS)
def test_config_instantiates(task: str, name: str, tmp_path: Path):
    model, data = _model_and_data(task)
    args = ["-c", str(config_path(task, name)), f"--trainer.default_root_dir={tmp_path}"]
    if not name.endswith("_cpu"):
        args += CPU_OVERRIDES
    cli = RecipeCLI(model, data, links=_cli_args(task), run=False, args=args)
    assert type(cli.trainer.strategy).__name__ == cli.config.trainer.strategy.class_path.rsplit(".", 1)[-1]
    compressor = cli.config.trainer.strategy.init_args.get("compressor")
    if compressor is not None:
        assert type(cli.trainer.strategy.compressor).__name__ == compressor.class_path.rsplit(".", 1)[-1]


def test_config_path_errors_list_choices():
    with pytest.raises(ValueError, match="dense_cpu"):
        config_path("image", "nope")
    with pytest.raises(ValueError, match="image"):
        config_path("video", "dense")
