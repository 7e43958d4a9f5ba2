"""The package map of docs/design.md holds: a module imports only from its own floor or below, at module level and
inside functions alike, and the package's imports form no cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_gradcomp"

FLOORS = {  # docs/design.md, "Map of the package"
    1: {"checks", "distributed", "failures", "atomic_files", "shard_files", "checkpoint_shards", "functional", "comm",
        "wire_bytes", "comm_stats", "futures", "gloo_workers", "advise.costs", "resident",
        "rate_corrected_adamw"},
    2: {"compressors", "schedule", "memory", "plan", "observers", "step_transaction"},
    3: {"reduction", "front_end", "hierarchical_reduction", "hook", "fsdp_reduction", "commthread", "hierarchy",
        "sharded_checkpoints", "replicas"},
    4: {"strategy", "gradcomp_checkpoints", "gradcomp_groups", "gradcomp_checks", "fabric_strategy", "fsdp_strategy",
        "presets", "gradcomp_presets", "swarm", "localsgd", "localsgd.fsdp", "callbacks", "bench", "report", "cli",
        "__init__", "advise", "advise.fsdp"},
}

LATE_BINDINGS = {  # (importer, imported): why the import sits in a function. Keep this list tiny.
    ("lightning_gradcomp.presets", "lightning_gradcomp.strategy"):
        "register_preset(..., strategy=None) builds a GradCompStrategy, and strategy.py imports presets (its "
        "register_strategies re-registers the presets); the class is looked up when a preset is built",
}
"""The function-level imports allowed to go up a floor or to close a cycle (none goes up today)."""


class Import(NamedTuple):
    module: str  # the package module imported (a submodule when ``from package import submodule``)
    line: int
    nested: bool  # inside a function or class: runs when called, not when the module is imported


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


MODULES = sorted(PACKAGE.rglob("*.py"))
NAMES = {module_name(path) for path in MODULES}


def _target(module: str, name: str) -> str:
    """What ``from module import name`` imports: the submodule ``module.name`` when there is one, else ``module``."""
    return f"{module}.{name}" if f"{module}.{name}" in NAMES else module


def imported_modules(path: Path) -> list[Import]:
    """Every package module ``path`` imports (:func:`imports_in`)."""
    return imports_in(path.read_text(), str(path))


def imports_in(source: str, where: str = "<source>") -> list[Import]:
    """Every package module ``source`` imports: every import statement of its syntax tree, at module level (including
    ``if``/``try`` blocks) and inside functions and classes."""
    tree = ast.parse(source)
    top = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:  # module-level statements, through if/try/with blocks but not into functions or classes
        node = stack.pop()
        top.add(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stack += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{where}: relative import"
            if node.module and node.module.split(".")[0] == "lightning_gradcomp":
                names = [_target(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.split(".")[0] == "lightning_gradcomp"]
        out += [Import(name, node.lineno, node not in top) for name in names]
    return out


def import_graph(*, nested: bool) -> dict[str, set[str]]:
    """Module -> the package modules it imports (with ``nested``: in functions too, but the :data:`LATE_BINDINGS`).

    Importing ``a.b.c`` runs the package ``a.b``'s ``__init__`` first; that implicit step is not an edge (a package
    ``__init__`` re-exports, and a submodule of a package still being initialised imports fine)."""
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        me = module_name(path)
        graph[me] = {
            imp.module
            for imp in imported_modules(path)
            if imp.module != me and (not imp.nested or (nested and (me, imp.module) not in LATE_BINDINGS))
        }
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (``[a, b, ..., a]``), or ``[]``."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt)
            if found:
                return found
        path.pop()
        done.add(node)
        return []

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return []


def test_every_module_has_a_floor() -> None:
    for path in MODULES:
        floor_of(module_name(path))  # raises StopIteration for a module missing from the map


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_floors(path: Path) -> None:
    """Function-level imports included: a late import up a floor is still a dependency on the higher floor."""
    me = module_name(path)
    mine = floor_of(me)
    upward = [
        f"{imp.module} (line {imp.line}{', in a function' if imp.nested else ''})"
        for imp in imported_modules(path)
        if floor_of(imp.module) > mine and (me, imp.module) not in LATE_BINDINGS
    ]
    assert not upward, f"{me} (floor {mine}) imports from a higher floor: {upward}"


def test_the_module_level_imports_form_no_cycle() -> None:
    cycle = find_cycle(import_graph(nested=False))
    assert not cycle, f"import cycle: {' -> '.join(cycle)}"


def test_no_cycle_through_function_level_imports_but_the_listed_ones() -> None:
    cycle = find_cycle(import_graph(nested=True))
    assert not cycle, f"import cycle through a function-level import: {' -> '.join(cycle)} (move the code, or list the "
    "import in LATE_BINDINGS with its reason)"


def test_the_late_bindings_are_function_level_imports_that_exist() -> None:
    for importer, imported in LATE_BINDINGS:
        path = next(p for p in MODULES if module_name(p) == importer)
        found = [imp for imp in imported_modules(path) if imp.module == imported]
        assert found and all(imp.nested for imp in found), (importer, imported)


def test_the_checks_see_an_upward_import_and_a_cycle() -> None:
    assert floor_of("lightning_gradcomp.strategy") > floor_of("lightning_gradcomp.compressors.cltk")
    assert floor_of("lightning_gradcomp.functional.packing") == 1 and floor_of("lightning_gradcomp") == 4
    assert floor_of("lightning_gradcomp.advise.costs") == 1 and floor_of("lightning_gradcomp.advise.calibrate") == 4
    assert floor_of("lightning_gradcomp.advise.costs.step_replay") == 1  # the whole subpackage
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    source = (
        "import os\n"
        "from lightning_gradcomp.compressors import registry, Compressor\n"
        "if os.name:\n    import lightning_gradcomp.plan\n"
        "def f():\n    from lightning_gradcomp.strategy import GradCompStrategy\n"
    )
    assert imports_in(source) == [
        Import("lightning_gradcomp.compressors.registry", 2, False),
        Import("lightning_gradcomp.compressors", 2, False),
        Import("lightning_gradcomp.plan", 4, False),
        Import("lightning_gradcomp.strategy", 6, True),
    ]


def test_importing_the_compressors_imports_nothing_from_lightning() -> None:
    """The compressors and everything they import stay below the Lightning floor.

    ``import lightning_gradcomp.compressors`` runs ``lightning_gradcomp/__init__.py`` first, which imports
    ``GradCompStrategy`` and declares the presets with Lightning (``import lightning_gradcomp`` promises that), so the
    subprocess stands in an empty package object for it and imports ``compressors`` and its own imports only."""
    code = (
        "import sys, types\n"
        f"package = types.ModuleType('lightning_gradcomp'); package.__path__ = [{str(PACKAGE)!r}]\n"
        "sys.modules['lightning_gradcomp'] = package\n"
        "import lightning_gradcomp.compressors\n"
        "assert 'lightning_gradcomp.compressors.topk' in sys.modules\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning'))\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
