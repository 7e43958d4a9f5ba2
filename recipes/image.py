"""Image recipe entry: ``python -m recipes.image fit -c recipes/configs/image/<config>.yaml``."""

from __future__ import annotations

from typing import Optional, Sequence

from recipes.cli import RecipeCLI, run_recipe
from recipes.data.image_data import ImageDataModule
from recipes.tasks.image_task import ImageClassifier

__all__ = ["LINKS", "main"]

LINKS = (("num_classes", "num_classes"), ("in_channels", "in_channels"))


def main(args: Optional[Sequence[str]] = None, run: bool = True) -> RecipeCLI:
    """Run the image CLI (``args=None``: ``sys.argv``)."""
    return run_recipe(ImageClassifier, ImageDataModule, LINKS, args, run)


if __name__ == "__main__":
    main()
