"""Language recipe entry: ``python -m recipes.language fit -c recipes/configs/language/<config>.yaml``."""

from __future__ import annotations

from typing import Optional, Sequence

from recipes.cli import RecipeCLI, run_recipe
from recipes.data.language_data import LanguageDataModule
from recipes.tasks.language_task import LanguageModel

__all__ = ["LINKS", "main"]

LINKS = (("vocab_size", "vocab"), ("context", "context"))


def main(args: Optional[Sequence[str]] = None, run: bool = True) -> RecipeCLI:
    """Run the language-model CLI (``args=None``: ``sys.argv``)."""
    return run_recipe(LanguageModel, LanguageDataModule, LINKS, args, run)


if __name__ == "__main__":
    main()
