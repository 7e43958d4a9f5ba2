"""Training recipes for ``lightning_gradcomp``: one LightningCLI entry per task, YAML configs per compressor.

Launch from a clone (the repository root on ``sys.path``)::

    python -m recipes.image fit -c recipes/configs/image/dense_cpu.yaml
    python -m recipes.main_job            # the README's one-command demo

:data:`RECIPES` lists which (entry, config) pairs exist; see ``docs/recipes.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["CONFIG_DIR", "RECIPES", "Recipe", "config_path"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""Folder holding ``<task>/<config>.yaml``."""


@dataclass(frozen=True)
class Recipe:
    """One task: its CLI module and the configs that exist for it.

    Attributes:
        name: task name, also the config sub-folder (``image``, ``translation``, ``speech``, ``language``).
        module: the module run with ``python -m`` (``recipes.image``...).
        description: one line.
    """

    name: str
    module: str
    description: str

    @property
    def configs(self) -> list[str]:
        """Names of the configs in ``configs/<name>/`` (without ``.yaml``), sorted."""
        return sorted(p.stem for p in (CONFIG_DIR / self.name).glob("*.yaml"))


RECIPES: dict[str, Recipe] = {
    r.name: r for r in (
        Recipe("image", "recipes.image", "ResNet on ImageNet (ImageFolder) / Fashion-MNIST offline"),
        Recipe("translation", "recipes.translation", "Transformer on WMT-style parallel text / number words offline"),
        Recipe("speech", "recipes.speech", "BiLSTM-CTC on a wav/flac corpus / synthesised digits or words offline"),
        Recipe("language", "recipes.language", "byte-level Transformer LM on a text file / Ding EN-DE sentences"),
    )
}


def config_path(task: str, config: str) -> Path:
    """Path of ``configs/<task>/<config>.yaml``; ``ValueError`` listing the choices when missing."""
    if task not in RECIPES:
        raise ValueError(f"`task` must be one of {sorted(RECIPES)}, got {task!r}")
    path = CONFIG_DIR / task / f"{config}.yaml"
    if not path.is_file():
        raise ValueError(f"`config` must be one of {RECIPES[task].configs} for task {task!r}, got {config!r}")
    return path
