"""Translation recipe entry: ``python -m recipes.translation fit -c recipes/configs/translation/<config>.yaml``."""

from __future__ import annotations

from typing import Optional, Sequence

from recipes.cli import RecipeCLI, run_recipe
from recipes.data.translation_data import TranslationDataModule
from recipes.tasks.translation_task import Translator

__all__ = ["LINKS", "main"]

LINKS = (("src_vocab_size", "src_vocab"), ("tgt_vocab_size", "tgt_vocab"), ("max_len", "max_len"))


def main(args: Optional[Sequence[str]] = None, run: bool = True) -> RecipeCLI:
    """Run the translation CLI (``args=None``: ``sys.argv``)."""
    return run_recipe(Translator, TranslationDataModule, LINKS, args, run)


if __name__ == "__main__":
    main()
