"""Run a function when a module is first imported, without importing it: how ``nxl run`` waits for transformers.

    when_imported("transformers.modeling_utils", "nxl_hooks.apps.serve.patches:patch_modeling_utils")

The target (``"module:function"``, imported only then) is called with the module once it has executed, in the
thread that imported it; if the module is already imported it is called at once. Standard library only, and
nothing here raises into the program: a failing target logs one line. The bootstrap's ``sitecustomize.py`` loads
this file by path before the program starts (importing the package would import torch); the finder it puts on
``sys.meta_path`` is shared with later copies of this module, so targets run once however they were registered.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not at run time: with importlib.abc and logging they doubled the bootstrap's start-up
    from importlib.machinery import ModuleSpec
    from typing import Any, Mapping, Sequence

__all__ = ["BOOTSTRAP", "HOOKS", "bootstrapped", "install", "uninstall", "when_imported"]

#: What ``nxl run`` and ``import nxl_hooks.auto`` hook: (module, "module:function" called with it once imported).
#: The one list of import-time patches: an engine that must patch its host before a model exists (a server's
#: request ids) names its function here, as a string, since importing an engine would import torch at start-up.
HOOKS = (("transformers.modeling_utils", "nxl_hooks.apps.serve.patches:patch_modeling_utils"),
         ("transformers.models.auto.modeling_auto", "nxl_hooks.apps.serve.patches:patch_auto_models"),
         ("transformers.cli.serving.utils", "nxl_hooks.hooks.engines.transformers_serve:patch_serving"),
         ("transformers.cli.serving.model_manager", "nxl_hooks.hooks.engines.transformers_serve:patch_engine_client"),
         ("vllm.engine.arg_utils", "nxl_hooks.hooks.engines.vllm:patch_engine_args"),
         ("vllm.v1.worker.gpu_model_runner", "nxl_hooks.apps.serve.patches:patch_vllm_runner"),
         ("vllm.v1.worker.cpu_model_runner", "nxl_hooks.apps.serve.patches:patch_vllm_runner"),
         ("vllm.v1.worker.gpu.model_runner", "nxl_hooks.apps.serve.patches:patch_vllm_runner"))

#: The folder of the bootstrap's ``sitecustomize.py``, which a Python started with it first on PYTHONPATH imports at
#: start-up.
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")


def bootstrapped(env: "Mapping[str, str]", settings: "Mapping[str, str]") -> dict[str, str]:
    """``env`` as a Python started with it runs nxl run's bootstrap: ``settings`` (the ``NXL_*`` variables) added,
    :data:`BOOTSTRAP` first on PYTHONPATH. ``os.execvpe(program[0], program, bootstrapped(os.environ, variables))``"""
    path = os.pathsep.join(p for p in (BOOTSTRAP, env.get("PYTHONPATH")) if p)
    return {**env, **settings, "PYTHONPATH": path}


def _call(target: str, module: ModuleType) -> None:
    try:
        name, _, function = target.partition(":")
        getattr(importlib.import_module(name), function)(module)
    except Exception as error:  # noqa: BLE001 - the program's import must go on
        import logging

        logging.getLogger("nxl_hooks").warning("nxl_hooks: could not hook %s (%s); the program runs unrecorded",
                                               module.__name__, _typed(error))


def _typed(error: Exception) -> str:
    """arch/text.py's rule for a foreign failure, that file loaded by path as the bootstrap loads this one (the
    package may be what failed to import, and importing it imports torch); its type alone should that fail too."""
    import importlib.util
    import os

    try:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "arch",
                            "text.py")
        spec = importlib.util.spec_from_file_location("_nxl_hooks_text", path)
        text = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(text)
        return text.typed(error)
    except Exception:  # noqa: BLE001 - never into the program's import
        return type(error).__name__


class _PostImportFinder:
    """First on ``sys.meta_path``: for a watched module, finds its spec with the other finders and runs the
    targets right after the module's own code. (``find_spec`` is all the import system asks of a meta path finder;
    the ``importlib.abc.MetaPathFinder`` base would only add its import time.)"""

    nxl_post_import = True  # how a second copy of this module recognises the finder

    def __init__(self) -> None:
        self.targets: dict[str, list[str]] = {}  # not run yet
        self.seen: set[tuple[str, str]] = set()  # every (module, target) ever registered
        self.lock = threading.Lock()

    def add(self, name: str, target: str) -> bool:
        """Register ``target`` for ``name``; False when it was registered before (and has run, or will)."""
        with self.lock:
            if (name, target) in self.seen:
                return False
            self.seen.add((name, target))
            self.targets.setdefault(name, []).append(target)
            return True

    def take(self, name: str, target: str | None = None) -> list[str]:
        """The targets of ``name`` not run yet (only ``target``, if given), now marked as run."""
        with self.lock:
            pending = self.targets.get(name, [])
            taken = [each for each in pending if target is None or each == target]
            self.targets[name] = [each for each in pending if each not in taken]
            if not self.targets[name]:
                del self.targets[name]
            return taken

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> ModuleSpec | None:
        if name not in self.targets:
            return None
        for finder in list(sys.meta_path):
            if getattr(finder, "nxl_post_import", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            if module.__name__ != name:  # a loader shared by several modules: only ours is watched
                return original(module)
            try:
                vars(loader).pop("exec_module", None)
            except TypeError:
                pass
            original(module)
            for each in self.take(name):
                _call(each, module)

        try:
            loader.exec_module = exec_module  # an instance attribute: the loader's class is untouched
        except (AttributeError, TypeError):
            return spec
        return spec


def _finder() -> Any:
    for finder in sys.meta_path:
        if getattr(finder, "nxl_post_import", False):
            return finder
    finder = _PostImportFinder()
    sys.meta_path.insert(0, finder)
    return finder


def when_imported(name: str, target: str) -> None:
    """Call ``target`` (``"package.module:function"``) with module ``name`` when it is first imported (now, if it
    is imported already). Each (name, target) pair runs once per process, however often it is registered."""
    finder = _finder()
    if not finder.add(name, target):
        return
    module = sys.modules.get(name)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        for each in finder.take(name, target):
            _call(each, module)


def install() -> None:
    """Register every :data:`HOOKS` entry."""
    for name, target in HOOKS:
        when_imported(name, target)


def uninstall() -> None:
    """Forget every registered target not run yet (its module never imported): nothing is patched after this
    process's recording ended (``nxl detach``)."""
    for finder in sys.meta_path:
        if getattr(finder, "nxl_post_import", False):
            with finder.lock:
                finder.targets.clear()
