"""The LightningCLI shared by the recipes: data -> model argument links and the always-on :class:`RecipeReport`."""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

__all__ = ["RecipeCLI", "run_recipe", "strategy_override"]


def strategy_override(argv: Sequence[str]) -> str:
    """A label for the strategy the command line sets over the config's (``""`` when it sets none).

    ``--trainer.strategy=scalecom`` (or ``--trainer.strategy scalecom``) gives ``scalecom``; any other
    ``--trainer.strategy...`` option (a nested init argument, a class path) gives ``strategy-`` and a short hash of
    those options, so that two different overrides never share a folder.
    """
    named, nested = [], []
    for i, arg in enumerate(argv):
        if not arg.startswith("--trainer.strategy"):
            continue
        key, _, value = arg.partition("=")
        if not value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
        if key == "--trainer.strategy" and re.fullmatch(r"[\w.-]+", value):
            named.append(value.rsplit(".", 1)[-1])
        else:
            nested.append(f"{key}={value}")
    if nested:
        named.append("strategy-" + hashlib.sha1("\0".join(nested).encode()).hexdigest()[:8])
    return "+".join(named)


class RecipeCLI(LightningCLI):
    """``LightningCLI`` with ``data.<attr>`` -> ``model.<arg>`` links (applied after the data module is built)
    and a ``report`` section configuring :class:`recipes.report.RecipeReport`.

    Args:
        links: ``(data attribute, model argument)`` pairs, e.g. ``("num_classes", "num_classes")``.
        *args, **kwargs: forwarded to ``LightningCLI``.
    """

    def __init__(self, *args: Any, links: Sequence[tuple[str, str]] = (), **kwargs: Any) -> None:
        self._links = tuple(links)
        given = kwargs.get("args")
        self._argv = [str(a) for a in given] if isinstance(given, (list, tuple)) else sys.argv[1:]
        super().__init__(*args, **kwargs)

    def before_instantiate_classes(self) -> None:
        """Key the run's folder by the strategy actually used, and log with a CSVLogger there.

        A config's ``trainer.default_root_dir`` and ``report.path`` name its own strategy
        (``runs/image/dense_cpu``); a ``--trainer.strategy...`` option on the command line moves both to
        ``<default_root_dir>+<label>`` (:func:`strategy_override`), unless they are given on the command line too,
        so a compressed run never overwrites its config's summary. ``trainer.logger`` left unset becomes a
        ``CSVLogger`` in that folder (``logs/version_N/metrics.csv``), which ``lightning-gradcomp report`` reads.
        """
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        trainer = config.trainer
        root = trainer.get("default_root_dir")
        label = strategy_override(self._argv)
        given = {arg.partition("=")[0] for arg in self._argv}
        if label and root and "--trainer.default_root_dir" not in given:
            moved = f"{str(root).rstrip('/')}+{label}"
            report = config.get("report")
            path = report.get("path") if report is not None else None
            if path and "--report.path" not in given and Path(path).parent == Path(root):
                report.path = str(Path(moved) / Path(path).name)
            trainer.default_root_dir = root = moved
        if trainer.get("logger") in (None, True):
            trainer.logger = Namespace(
                class_path="lightning.pytorch.loggers.CSVLogger",
                init_args=Namespace(save_dir=str(root or "."), name="logs"),
            )

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
        self._log_compression()

    def _log_compression(self) -> None:
        """Add a ``CompressionLogger`` (bytes, ratio, error: what ``report`` plots) unless the config has one."""
        from lightning_gradcomp.callbacks import CompressionLogger

        if self.trainer.logger is not None and not any(isinstance(c, CompressionLogger) for c in self.trainer.callbacks):
            self.trainer.callbacks.append(CompressionLogger())

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
