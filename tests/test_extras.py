"""Every documented command works with the extra the docs name (issue 52, item 9): the ``[recipes]`` extra provides
every third-party module the recipes import (besides the documented optional readers), and ``[test]`` includes the
``[recipes]`` and ``[plots]`` extras. (A fresh venv with ``pip install -e ".[recipes]"`` was tried by hand.)"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OPTIONAL = {"PIL", "sklearn", "sentencepiece", "soundfile"}  # docs/recipes.md, "Optional packages"
LOCAL = {"recipes", "lightning_gradcomp"}
IMPORT_NAMES = {"jsonargparse": "jsonargparse", "lightning": "lightning", "numpy": "numpy", "rich": "rich",
                "torch": "torch", "torchmetrics": "torchmetrics", "matplotlib": "matplotlib"}


def _distribution(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def _imported_modules(folder: Path) -> set[str]:
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - LOCAL - {"__future__"}


def test_the_recipes_extra_provides_what_the_recipes_import() -> None:
    provided = {IMPORT_NAMES.get(_distribution(r), _distribution(r))
                for r in [*PROJECT["dependencies"], *PROJECT["optional-dependencies"]["recipes"]]}
    missing = _imported_modules(ROOT / "recipes") - OPTIONAL - provided
    assert not missing, f"the recipes import {sorted(missing)}, which neither the dependencies nor [recipes] install"
    # LightningCLI (every recipe entry) needs jsonargparse with its signatures extra
    assert any(r.replace(" ", "").startswith("jsonargparse[signatures]")
               for r in PROJECT["optional-dependencies"]["recipes"])


def test_the_test_extra_includes_recipes_and_plots() -> None:
    extras = PROJECT["optional-dependencies"]
    assert "matplotlib" in {_distribution(r) for r in extras["plots"]}
    assert any(r.replace(" ", "") == "lightning-gradcomp[recipes,plots]" for r in extras["test"])


def test_the_docs_install_the_extras_that_exist() -> None:
    extras = set(PROJECT["optional-dependencies"])
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        for named in re.findall(r'pip install [^`\n]*-e "?\.\[([\w,]+)\]', text):
            assert set(named.split(",")) <= extras, (page.name, named)
        assert "pip install matplotlib" not in text, f"{page.name}: the [plots] extra installs it"
    assert 'pip install -e ".[recipes]"' in (ROOT / "docs" / "recipes.md").read_text()
