"""The package layout is the architecture: dependencies point one way, with no import cycle.

Every ``import`` in ``src/modelpatch`` is read with :mod:`ast`, including imports inside functions (which hide
cycles from the interpreter but not from a reader), and checked against the layer order documented in
``modelpatch/__init__.py``.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil

import pytest

import modelpatch
from modelpatch.deprecation import MOVED

SRC = pathlib.Path(modelpatch.__file__).parent

# component -> components it may import (besides itself). Top-down order of the package map.
ALLOWED = {
    "errors": set(),
    "versions": {"errors"},
    "undo": {"errors"},
    "lazy_imports": set(),
    "patching": {"errors", "undo"},
    "outputs": {"errors", "undo", "lazy_imports", "patching"},
    "conversion": {"errors", "undo", "lazy_imports", "patching"},
    "routing": {"errors", "undo"},
    "integrations": {"errors", "versions", "undo", "lazy_imports", "patching", "outputs", "conversion", "routing"},
    "apply": {
        "errors",
        "versions",
        "undo",
        "lazy_imports",
        "patching",
        "outputs",
        "conversion",
        "routing",
        "integrations",
    },
    "recipes": {"errors", "undo", "patching", "conversion", "integrations", "apply"},
    "dev": {"errors", "versions"},
    "deprecation": set(),
    "cli": {
        "errors",
        "versions",
        "undo",
        "lazy_imports",
        "patching",
        "outputs",
        "conversion",
        "routing",
        "integrations",
        "apply",
        "recipes",
        "__init__",
    },
    "__init__": None,  # the public API re-exports everything
}


def _module_names() -> list[str]:
    names = ["modelpatch"]
    for info in pkgutil.walk_packages([str(SRC)], prefix="modelpatch."):
        names.append(info.name)
    return names


def _path_of(name: str) -> pathlib.Path:
    parts = name.split(".")[1:]
    candidate = SRC.joinpath(*parts)
    if candidate.is_dir():
        return candidate / "__init__.py"
    return candidate.with_suffix(".py")


def _imports(name: str, modules: set[str]) -> set[str]:
    """Modules of modelpatch that ``name`` imports anywhere in its source (module level or inside functions)."""
    path = _path_of(name)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
            found.update(t for t in targets if t.split(".")[0] == "modelpatch")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if origin.split(".")[0] != "modelpatch":
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{origin}.{alias.name}"
                found.add(sub if sub in modules else origin)
    found.discard(name)
    return {m for m in found if m in modules}


def _component(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    names = _module_names()
    for name in names:  # every module imports on its own (no order-dependent import)
        importlib.import_module(name)
    modules = set(names)
    return {name: _imports(name, modules) for name in names}


def test_every_component_imports_only_the_layers_below_it(graph):
    wrong = []
    for name, targets in graph.items():
        if name in MOVED:  # a deprecated alias (modelpatch.deprecation): imports its new home by name, when used
            continue
        allowed = ALLOWED[_component(name)]
        if allowed is None:
            continue
        for target in targets:
            own = _component(target)
            if own != _component(name) and own not in allowed:
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def test_no_import_cycle_even_through_imports_inside_functions(graph):
    # a package's __init__ re-exports its submodules; a submodule importing a sibling through the package
    # would show up as an edge to the package and is reported too
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == []


def test_every_subpackage_opens_with_a_docstring_that_maps_its_modules():
    for package in ("patching", "conversion", "outputs", "routing", "apply", "recipes", "cli", "integrations"):
        init = SRC / package / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        modules = sorted(p.stem for p in (SRC / package).glob("*.py") if p.stem != "__init__")
        aliases = {m for m in modules if f"modelpatch.{package}.{m}" in MOVED}  # deprecated, not in the map
        missing = [m for m in modules if f"``{m}``" not in doc and f"{m}`" not in doc and m not in aliases]
        assert missing == [], f"modelpatch.{package}: modules missing from the docstring map: {missing}"


def test_every_blind_except_says_why():
    """ruff selects BLE (blind except); each ``# noqa: BLE001`` carries its reason after `` - ``."""
    bare = [
        f"{path.relative_to(SRC.parent)}:{number}"
        for path in sorted(SRC.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "# noqa: BLE001" in line and not line.split("# noqa: BLE001", 1)[1].startswith(" - ")
    ]
    assert bare == []


def _own_imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("modelpatch")):
            yield node


def test_no_module_imports_a_private_name_of_another():
    """A name another module uses is public (within its package at least): ``from .x import _y`` is refused."""
    found = [
        f"{path.relative_to(SRC.parent)}:{node.lineno} {alias.name}"
        for path in sorted(SRC.rglob("*.py"))
        for node in _own_imports(ast.parse(path.read_text()))
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert found == []


def test_imports_of_modelpatch_inside_functions_only_where_the_reason_is_documented():
    """Outside the CLI (whose docstring gives the reason: start-up cost) and the PEP 562 ``__getattr__`` of the
    package (``import modelpatch`` does not import the recipes), modelpatch's own modules are imported at module
    level: an import inside a function would hide a cycle."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "cli":
            continue
        for func in ast.walk(ast.parse(path.read_text())):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if rel.parts == ("__init__.py",) and func.name == "__getattr__":
                continue
            found += [f"{rel}:{node.lineno}" for node in _own_imports(func)]
    assert found == []
