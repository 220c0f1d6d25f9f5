"""The package's imports run one way: arch < method < records < hooks < eval < apps, and never in a circle.

Every import counts: module level, inside functions, under TYPE_CHECKING, and module names written as strings
(importlib).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "nxl_hooks"
LAYERS = ("arch", "method", "records", "hooks", "eval", "apps")
#: Modules outside the layers: the public face and entry points (they may import any layer; no layer imports
#: them), and the shipped demo data (imports nothing of the package).
OUTSIDE = {"nxl_hooks", "nxl_hooks.__main__", "nxl_hooks.auto"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = re.fullmatch(r"(nxl_hooks(?:\.\w+)+)(?::\w+)?", node.value)
            # a string names a module only where it is one ("nxl_hooks.attribution" is a file format's name)
            targets = [match.group(1)] if match and match.group(1) in modules else []
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """Each module's imports of the package, parsed once for the tests that read it (none changes it)."""
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_is_in_a_layer():
    stray = [m for m in _modules() if _layer(m) is None and m not in OUTSIDE and not m.startswith("nxl_hooks.demo")]
    assert not stray, f"put these modules in one of the layers {LAYERS}: {stray}"


def test_imports_only_go_down(graph):
    upward = []
    for module, targets in graph.items():
        for target in targets:
            if module.startswith("nxl_hooks.demo"):
                upward.append((module, target))  # the demo data imports nothing of the package
            elif _layer(module) is not None and (target in OUTSIDE or _layer(target) is None and
                                                 not target.startswith("nxl_hooks.demo")):
                upward.append((module, target))
            elif _layer(module) is not None and _layer(target) is not None and _layer(target) > _layer(module):
                upward.append((module, target))
    assert not upward, "imports that go up a layer: " + ", ".join(f"{a} -> {b}" for a, b in sorted(upward))


#: The rooms a contributor adds to (a sink, a serving engine, a recording path): each is a typing.Protocol in the
#: layer named by its module, walked by the checks above like every other module.
ROOMS = {"nxl_hooks.records.sinks": "RecordSink", "nxl_hooks.hooks.engines": "Engine",
         "nxl_hooks.hooks.recording": "Recording"}


def test_the_extension_rooms_are_protocols_in_their_layers(graph):
    for module, protocol in ROOMS.items():
        assert module in graph and _layer(module) is not None, module
        cls = getattr(importlib.import_module(module), protocol)
        assert getattr(cls, "_is_protocol", False), f"{module}.{protocol} is not a typing.Protocol"
        # a room imports nothing above its own layer (a sink knows no hook, an engine no command)
        assert all(_layer(target) is None or _layer(target) <= _layer(module) for target in graph[module]), module


def test_no_import_cycle(graph):
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for target in graph[module]:
            if seen.get(target) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(target):] + [module, target]))
            if target not in seen:
                visit(target, path + [module])
        seen[module] = 2

    for module in graph:
        if module not in seen:
            visit(module, [])


def test_the_checker_sees_function_level_and_string_imports(tmp_path, monkeypatch):
    """The walk itself: an upward import inside a function, and one written as a string, are both found."""
    modules = {"nxl_hooks.arch.x": tmp_path / "x.py", "nxl_hooks.apps.cli": tmp_path / "cli.py"}
    modules["nxl_hooks.arch.x"].write_text("def f():\n    from ..apps import cli\n    return 'nxl_hooks.apps.cli:main'\n")
    assert _imports("nxl_hooks.arch.x", modules["nxl_hooks.arch.x"], modules) == {"nxl_hooks.apps.cli"}


def test_docs_layout_lists_every_module_once_and_nothing_else():
    """docs/layout.md has one ``- `path`: ...`` line per module of the package (a package: its folder), so the
    manual's map cannot name a module that is gone (it once named hooks/batching.py) or miss a new one."""
    text = (PACKAGE.parent / "docs" / "layout.md").read_text()
    listed = re.findall(r"^- `(nxl_hooks/[\w/.]*)`: \S", text, flags=re.MULTILINE)
    actual = {str(path.parent.relative_to(PACKAGE.parent)) + "/" if path.name == "__init__.py"
              else str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")}
    twice = sorted({path for path in listed if listed.count(path) > 1})
    assert not twice, f"listed twice in docs/layout.md: {twice}"
    assert not actual - set(listed), f"modules missing from docs/layout.md: {sorted(actual - set(listed))}"
    assert not set(listed) - actual, f"docs/layout.md lists what the package lacks: {sorted(set(listed) - actual)}"


@pytest.mark.parametrize("page", ["adding-an-architecture.md", "engines.md", "methods.md", "records-and-sinks.md"])
def test_each_page_on_shipping_a_new_module_names_its_line_in_the_layout(page):
    """A contributor adding a built-in engine or sink kind "in one file", as engines.md and records-and-sinks.md
    said, met the layout test above failing on the new module, with no word of it on the page."""
    assert "[the layout](layout.md)" in (PACKAGE.parent / "docs" / page).read_text()
