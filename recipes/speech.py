"""Speech recipe entry: ``python -m recipes.speech fit -c recipes/configs/speech/<config>.yaml``."""

from __future__ import annotations

from typing import Optional, Sequence

from recipes.cli import RecipeCLI, run_recipe
from recipes.data.speech_data import SpeechDataModule
from recipes.tasks.speech_task import SpeechRecognizer

__all__ = ["LINKS", "main"]

LINKS = (("n_mels", "n_feats"), ("num_classes", "num_classes"))


def main(args: Optional[Sequence[str]] = None, run: bool = True) -> RecipeCLI:
    """Run the speech CLI (``args=None``: ``sys.argv``)."""
    return run_recipe(SpeechRecognizer, SpeechDataModule, LINKS, args, run)


if __name__ == "__main__":
    main()
