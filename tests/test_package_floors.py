"""The package map of docs/design.md holds: a module imports (at module level) only from its own floor or below."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_gradcomp"

FLOORS = {  # docs/design.md, "Map of the package"
    1: {"checks", "distributed", "failures", "atomic_files", "checkpoint_shards", "functional", "comm", "gloo_workers",
        "advise.costs", "resident"},
    2: {"compressors", "presets", "schedule", "memory", "plan", "observers", "step_transaction"},
    3: {"reduction", "hierarchical_reduction", "hook", "commthread", "hierarchy", "sharded_checkpoints", "replicas",
        "fsdp_reduction"},
    4: {"strategy", "fsdp_strategy", "swarm", "localsgd", "callbacks", "bench", "report", "cli", "__init__", "advise"},
}


def floor_of(module: str) -> int:
    """The floor of ``lightning_gradcomp[.part[...]]`` (the package itself is the top floor); a ``part.module`` entry
    (``advise.costs``) places that module apart from the rest of its subpackage."""
    parts = module.split(".")
    first = parts[1] if len(parts) > 1 else "__init__"
    nested = ".".join(parts[1:3])
    if any(nested in names for names in FLOORS.values()):
        first = nested
    return next(floor for floor, names in FLOORS.items() if first in names)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 2 else parts).replace(".__init__", "")


def imported_modules(path: Path) -> list[str]:
    """Package modules imported at module level (function-level imports are deliberate late bindings)."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            if node.module == "lightning_gradcomp":
                out += [f"lightning_gradcomp.{alias.name}" for alias in node.names]
            elif node.module and node.module.startswith("lightning_gradcomp."):
                out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [alias.name for alias in node.names if alias.name.startswith("lightning_gradcomp")]
    return out


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_floor() -> None:
    for path in MODULES:
        floor_of(module_name(path))  # raises StopIteration for a module missing from the map


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_floors(path: Path) -> None:
    mine = floor_of(module_name(path))
    upward = [m for m in imported_modules(path) if floor_of(m) > mine]
    assert not upward, f"{module_name(path)} (floor {mine}) imports {upward} from a higher floor"


def test_the_check_sees_an_upward_import() -> None:
    assert floor_of("lightning_gradcomp.strategy") > floor_of("lightning_gradcomp.compressors.cltk")
    assert floor_of("lightning_gradcomp.functional.packing") == 1 and floor_of("lightning_gradcomp") == 4
    assert floor_of("lightning_gradcomp.advise.costs") == 1 and floor_of("lightning_gradcomp.advise.calibrate") == 4
