"""Module paths from before the layered package (nxl_hooks 0.1), kept importable for existing code:
``from nxl_hooks import evaluate as ev``, ``import nxl_hooks.stream``, ``python -m nxl_hooks.cli`` still work.

Each old name maps to the modules its names now live in; importing it gives a read-only view that looks names up
there, in order. New code imports the new paths (the table below says where each name went).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

__all__ = ["MOVED", "install"]

#: old module (under nxl_hooks) -> the modules that now hold its names, searched in order.
MOVED: dict[str, tuple[str, ...]] = {
    "attribution": ("records.attribution",),
    "audit": ("eval.audit",),
    "baselines": ("eval.baselines",),
    "capture": ("hooks.probe", "method.select", "hooks.plan"),
    "cli": ("apps.cli",),
    "dataset": ("apps.dataset",),
    "evaluate": ("eval.faithfulness", "eval.metrics"),
    "generation": ("hooks.generate",),
    "head": ("method.head", "method.placement"),
    "loading": ("apps.loading",),
    "registry": ("arch.registry",),
    "stream": ("records.steps", "records.sink", "apps.terminal"),
    "terminal": ("apps.terminal",),
    "viz": ("records.html", "apps.reports"),
}
_PACKAGE = __name__.rpartition(".")[0]


class _View(types.ModuleType):
    """An old module: every attribute is looked up in the modules that took its names."""

    __nxl_sources__: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> object:
        for source in self.__nxl_sources__:
            module = importlib.import_module(source)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r} (it moved: see nxl_hooks._moved)")

    def __setattr__(self, name: str, value: object) -> None:
        # Setting a name here (a monkeypatch) would not reach the module that uses it: say so instead.
        if not (name.startswith("__") and name.endswith("__")):
            raise AttributeError(f"{self.__name__} is an alias of {', '.join(self.__nxl_sources__)}: set {name!r} "
                                 "on the module that holds it")
        super().__setattr__(name, value)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != _PACKAGE or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _View(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        sources = tuple(f"{_PACKAGE}.{source}" for source in MOVED[module.__name__.rpartition(".")[2]])
        module.__nxl_sources__ = sources
        warnings.warn(f"{module.__name__} moved to {', '.join(sources)}", DeprecationWarning, stacklevel=2)

    def get_code(self, fullname: str) -> types.CodeType:
        """``python -m nxl_hooks.cli`` runs the module that took its place."""
        target = f"{_PACKAGE}.{MOVED[fullname.rpartition('.')[2]][0]}"
        return compile(f"import runpy\nrunpy.run_module({target!r}, run_name='__main__', alter_sys=True)\n",
                       fullname, "exec")


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.append(_Finder())
