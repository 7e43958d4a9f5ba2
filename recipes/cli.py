"""The LightningCLI shared by the recipes: data -> model argument links and the always-on :class:`RecipeReport`."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

__all__ = ["RecipeCLI", "run_recipe"]


class RecipeCLI(LightningCLI):
    """``LightningCLI`` with ``data.<attr>`` -> ``model.<arg>`` links (applied after the data module is built)
    and a ``report`` section configuring :class:`recipes.report.RecipeReport`.

    Args:
        links: ``(data attribute, model argument)`` pairs, e.g. ``("num_classes", "num_classes")``.
        *args, **kwargs: forwarded to ``LightningCLI``.
    """

    def __init__(self, *args: Any, links: Sequence[tuple[str, str]] = (), **kwargs: Any) -> None:
        self._links = tuple(links)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        from recipes.report import RecipeReport

        parser.add_lightning_class_args(RecipeReport, "report")
        for source, target in self._links:
            parser.link_arguments(f"data.{source}", f"model.{target}", apply_on="instantiate")

    def check_data(self) -> None:
        """The data module's ``check_data()`` (a missing data path raises ``FileNotFoundError`` naming the argument),
        before a subcommand runs: in the launching process, before any rank starts, rather than in each rank's
        ``setup``. Not called with ``run=False``."""
        check = getattr(self.datamodule, "check_data", None)
        if callable(check):
            check()

    def before_fit(self) -> None:
        self.check_data()

    def before_validate(self) -> None:
        self.check_data()

    def before_test(self) -> None:
        self.check_data()

    def before_predict(self) -> None:
        self.check_data()


def run_recipe(model_class: type[pl.LightningModule], datamodule_class: type[pl.LightningDataModule],
               links: Sequence[tuple[str, str]], args: Optional[Sequence[str]] = None,
               run: bool = True) -> RecipeCLI:
    """Build (and with ``run`` execute) the CLI of one recipe; ``args=None`` reads ``sys.argv``."""
    import lightning_gradcomp  # noqa: F401 - registers the gradcomp strategy names with Lightning

    return RecipeCLI(model_class, datamodule_class, links=links, args=list(args) if args is not None else None,
                     run=run, save_config_kwargs={"overwrite": True})
