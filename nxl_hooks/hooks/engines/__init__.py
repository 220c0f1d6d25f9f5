"""Serving engines: generation that does not go through ``model.generate``, followed request by request.

    from nxl_hooks.hooks.engines import register_engine
    register_engine("my-engine", MyEngine)          # or an entry point in the group ``nxl_hooks.engines``

:func:`~nxl_hooks.attach` builds one :class:`Engine` per registered factory for each probe of a model that
generates, keeps those that :meth:`~Engine.claims` the model, calls :meth:`~Engine.install` with the probe's
:class:`~nxl_hooks.hooks.generate.Generations` and :meth:`~Engine.uninstall` at detach. An engine makes a
:class:`~nxl_hooks.hooks.recording.Recording` for each step its host runs (a packed batch of requests, say) and puts it as the thread's current
recording (``gens.running(recording)``) around the host's forward; the probe's hooks then feed it that forward.

Built in: every module of this package that defines ``ENGINE`` (a factory, usually the engine's class, whose
``name`` is the engine's): transformers' continuous batching (:mod:`.transformers_cb`) and vLLM's model runner
(:mod:`.vllm`, which claims only its own view of a vLLM model). A new built-in engine is one file here. Third
parties add an engine in one module and declare it in their package metadata::

    [project.entry-points."nxl_hooks.engines"]
    my-engine = "my_package.nxl_engine:MyEngine"

Entry points are read and loaded by :mod:`nxl_hooks.arch.plugins`: all of them at the first attach of a model that
generates, never at import (``nxl run``'s bootstrap stays torch-free and cheap); a name registered in code wins;
one that fails to load is left out with one log line; ``NXL_PLUGINS`` is the allow-list.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import threading
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from ...arch import plugins
from ..guard import reason
from ..recording import NOT_RECORDED, Recording

if TYPE_CHECKING:
    from torch import nn

    from ..generate import Generations

__all__ = ["GROUP", "NOT_RECORDED", "Engine", "Recording", "builtin_engines", "engines_for", "register_engine"]

#: The entry-point group third-party engines are declared in.
GROUP = plugins.ENGINES


@runtime_checkable
class Engine(Protocol):
    """One way a model generates outside ``generate``, followed for one probe. Made per attach by a factory
    registered with :func:`register_engine` (cheap to make: nothing happens before :meth:`install`).

    ``name``: the registered name. ``unfollowed``: why the engine cannot follow its host here (a version it does
    not know, CUDA graphs...), or None; shown by ``Probe.unrecorded`` once the host ran such a step.
    """

    name: str
    unfollowed: str | None

    def claims(self, model: nn.Module) -> bool:
        """Whether this engine follows ``model`` (a transformers task model that generates)."""
        ...

    def install(self, gens: Generations) -> None:
        """Start following: ``gens`` makes the records (``gens.new_run``, ``gens.unrecorded``, ``gens.running``)."""
        ...

    def uninstall(self) -> None:
        """Stop following (the probe detaches); runs in flight end incomplete. Never raises."""
        ...

    def stray(self, arguments: dict[str, Any]) -> str | None:
        """Why a forward called with ``arguments`` outside every recorded call is this engine's own (its warmup, a
        step it cannot follow) and cannot be read as a plain forward; None when it is not the engine's."""
        ...


EngineFactory = Callable[[], Engine]

_LOCK = threading.Lock()
#: name -> factory, registered in code (a built-in engine of that name is replaced)
_FACTORIES: dict[str, EngineFactory] = {}


def register_engine(name: str, factory: EngineFactory) -> None:
    """Make ``factory()`` (an :class:`Engine`) part of every later :func:`~nxl_hooks.attach`; a name registered
    before is replaced. ``register_engine("my-engine", MyEngine)``"""
    if not isinstance(name, str) or not name:
        raise ValueError("register_engine needs a non-empty name, e.g. register_engine('my-engine', MyEngine)")
    if not callable(factory):
        raise TypeError(f"register_engine({name!r}, ...) needs a callable that makes an Engine (a class, say), "
                        f"not {type(factory).__name__}")
    with _LOCK:
        _FACTORIES[name] = factory


@functools.cache
def builtin_engines() -> dict[str, EngineFactory]:
    """Every built-in engine: the ``ENGINE`` (a factory, a class with its ``name``) of each module of this package
    that defines one, imported at the first attach of a model that generates (never at import: ``nxl run``'s
    bootstrap stays torch-free); a module that fails to import is left out with one log line."""
    found = {}
    for module in pkgutil.iter_modules(__path__, f"{__name__}."):
        try:
            factory = getattr(importlib.import_module(module.name), "ENGINE", None)
        except BaseException as error:  # noqa: BLE001 - a broken engine (SystemExit too) never breaks attach
            reason(f"engine module {module.name!r}", plugins.contained(error))
            continue
        if factory is not None:
            found[factory.name] = factory
    return found


def engines_for(model: nn.Module) -> list[Engine]:
    """One new engine per registered factory that claims ``model``, in registration order. An engine that fails to
    load, build or answer is left out with one log line: attaching never fails because of an engine."""
    builtin = builtin_engines()
    installed = plugins.load_all(GROUP)  # outside the lock: imports the plugins' modules (once)
    with _LOCK:  # built-in and registered in code first; a name registered in code wins over a built-in or a plugin's
        named = {**builtin, **_FACTORIES}
    named.update((name, factory) for name, factory in installed.items() if name not in named)
    chosen = []
    for name, factory in named.items():
        try:
            engine = factory()
            lacks = [member for member in _MEMBERS if not hasattr(engine, member)]
            if lacks:  # else what it lacks is an AttributeError where attach reports it
                raise TypeError(f"it made {type(engine).__name__!r}, which lacks {', '.join(lacks)} (an Engine has "
                                f"{', '.join(_MEMBERS)})")
        except BaseException as error:  # noqa: BLE001 - a broken engine (SystemExit too) never breaks attach
            if installed.get(name) is factory:  # a plugin: its loader's line, once per process, and left out since
                plugins.broken(GROUP, name, plugins.contained(error))
            else:
                reason(f"engine {name!r}", plugins.contained(error))
            continue
        try:
            if engine.claims(model):
                chosen.append(engine)
        except BaseException as error:  # noqa: BLE001 - an engine that cannot answer for this model follows none
            reason(f"engine {name!r}", plugins.contained(error))
    return chosen


#: What :func:`engines_for` finds on every engine (the :class:`Engine` protocol).
_MEMBERS = ("name", "unfollowed", "claims", "install", "uninstall", "stray")
