"""Where users look (the strategy's docstring, ``lightning-gradcomp --help``), the defaults that differ from
DDPStrategy's are stated (issue 52, item 8), in plain text on the command line."""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest
from lightning.pytorch.strategies import DDPStrategy

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.cli import main


def test_the_defaults_that_differ_from_ddp_are_what_the_docs_say() -> None:
    ours, ddp = GradCompStrategy(), DDPStrategy()
    assert ours._timeout == timedelta(minutes=10) and ddp._timeout == timedelta(minutes=30)
    assert ours._ddp_kwargs["gradient_as_bucket_view"] and not ddp._ddp_kwargs.get("gradient_as_bucket_view", False)
    assert ours.single_process == "dense"


def test_the_docstring_opens_with_the_defaults_that_differ_from_ddp() -> None:
    head = inspect.getdoc(GradCompStrategy).split("Example::")[0]
    assert "10 minutes (DDP's is 30)" in head
    assert "gradient_as_bucket_view=True`` (DDP's is ``False``)" in head
    assert 'single_process="dense"' in head


def test_help_states_them_in_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out
    assert "10 minutes (DDPStrategy: 30)" in out and "True (DDPStrategy: False)" in out and "single_process" in out
