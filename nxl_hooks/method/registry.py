"""The registry of attribution methods: built-in ones, those registered in code, and installed plugins.

    @register_method                              # a class (instantiated without arguments) or an instance
    class Doubled(Method): ...
    register_method(Doubled(), replace=True)      # or a call; replace=True to redefine a name
    get_method("doubled"); method_names()         # lookups: ("normxlogit", "logat", "contrastive", "doubled")
    nxl.attach(model, methods=["doubled"])        # what a probe computes beyond DEFAULT

Built-in methods are the modules of :mod:`nxl_hooks.method.methods` (each defines ``METHOD``). Installed
distributions add methods through the entry-point group ``nxl_hooks.methods`` (name: the method's name, value: a
Method class or instance), loaded by the package's one plugin loader (:mod:`nxl_hooks.arch.plugins`, with its
``NXL_PLUGINS`` allow-list) when a name is looked up that nothing registered in the process has, or every method is
listed; :func:`load_plugin` is what the loader calls for each. A broken one is left out with one logged line.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections import abc
from typing import Any, Iterable, Union

from ..arch import plugins
from ..arch.calls import unbound
from . import methods as _builtin_package
from .protocol import Method, check_name

__all__ = ["DEFAULT", "ENTRY_POINT_GROUP", "Method", "Methods", "builtin_names", "get_method", "load_plugin",
           "method_names", "register_method", "resolve_methods", "wanted_name"]

#: The entry-point group through which installed distributions register methods.
ENTRY_POINT_GROUP = plugins.METHODS
#: What every probe computes (at no cost beyond the target logits it needs anyway), in this order.
DEFAULT = ("normxlogit", "logat")
#: Names a method cannot take: the fields and Parquet columns its scores sit beside, and evaluation's baselines
#: (written here, as this layer imports neither; tests/oracle/test_methods.py checks that they cover both).
RESERVED = frozenset({
    "request_id", "call", "choice_prompt", "choice_sample", "row", "step", "emitted_position", "emitted_id",
    "emitted_text", "active", "layer",
    "position", "token_id", "token_text", "target_index", "target_id", "target_text", "probability", "embed_norm",
    "model", "time", "in_prompt", "prediction_position", "special", "template", "ranked", "token", "target", "mask",
    "scores", "layers", "random", "grad_norm", "grad_x_input", "integrated_gradients",
})

#: What ``attach(methods=...)`` takes: method names or Method objects (instances, or classes made without
#: arguments), a list of them, one of them, or a comma-separated string of names
Methods = Union[Iterable[Union[str, Method, type[Method]]], str, Method, type[Method], None]

_METHODS: dict[str, Method] = {}
_INSTALLED: set[str] = set()  # names whose method came from a plugin: code registering one replaces it
_lock = threading.RLock()
_loaded = False  # built-ins imported
_BUILTIN: tuple[str, ...] = ()  # their names, DEFAULT first


def _instance(method: Any) -> Method:
    if isinstance(method, type) and (why := unbound(method)) is not None:
        # its TypeError named neither the method nor that a class is made without arguments here
        raise TypeError(f"{method.__qualname__} cannot be made without arguments ({why}): give an instance "
                        f"({method.__qualname__}(...)) instead of the class, or defaults to its arguments")
    method = method() if isinstance(method, type) else method
    what = type(method).__qualname__
    if not isinstance(method, Method) or not callable(method.score):
        lacks = ", ".join(member for member in ("name", "description", "score") if not hasattr(method, member))
        raise TypeError(f"{what} is not an attribution method: it lacks {lacks or 'a callable score'}; a method has "
                        "a name, a description and score(given) -> tensor (nxl_hooks.method.protocol.Method)")
    _check_score(method, what)
    name = check_name(method.name)
    if name in RESERVED:
        raise ValueError(f"method name {name!r} is taken by a record field or Parquet column: choose another")
    return method


def _check_score(method: Method, what: str) -> None:
    """A TypeError now, naming the method, when its ``score`` cannot be called as ``score(given)``: else every
    forward it scores would go unrecorded for the same mistake (:func:`~nxl_hooks.arch.calls.unbound`)."""
    if (why := unbound(method.score, None)) is not None:
        raise TypeError(f"{what} is not an attribution method: its score cannot be called as score(given) "
                        f"({why}); define it as def score(self, given) -> tensor")


def register_method(method: Any = None, *, replace: bool = False) -> Any:
    """Register a :class:`~nxl_hooks.method.protocol.Method` (class or instance) under its ``name``; usable as a
    decorator (returns what it was given). A name already registered is refused unless ``replace``; an installed
    plugin's method is replaced (code wins, whether or not the plugins were read first).
    ``register_method(MyMethod())``"""
    if method is None:  # @register_method(replace=True)
        return lambda given: register_method(given, replace=replace)
    instance = _instance(method)
    if instance.name in DEFAULT:  # replace=True put it in every record's place, every probe's scores changed unsaid
        raise ValueError(f"method name {instance.name!r} is the built-in method every record holds "
                         f"(res.{instance.name}), which no registration replaces: give yours another name")
    with _lock:
        _builtins()
        if instance.name in _METHODS and not replace and instance.name not in _INSTALLED:
            raise ValueError(f"an attribution method named {instance.name!r} is registered already: pass "
                             "replace=True to redefine it")
        _METHODS[instance.name] = instance
        _INSTALLED.discard(instance.name)
    return method


def load_plugin(name: str, loaded: Any) -> Method:
    """Register what an entry point of ``nxl_hooks.methods`` named ``name`` loaded (a Method class or instance);
    the one function a plugin loader calls. ValueError when its name is not the entry point's."""
    instance = _instance(loaded)
    if instance.name != name:
        raise ValueError(f"entry point {name!r} gives a method named {instance.name!r}: the names must match")
    with _lock:
        if name not in _METHODS:  # a method registered in code wins over an installed one (register_method)
            _METHODS[name] = instance
            _INSTALLED.add(name)
        return _METHODS[name]


def _read_plugins() -> None:
    """Every allowed ``nxl_hooks.methods`` plugin through :func:`load_plugin` (each imported once by the loader; a
    broken one, or one :func:`load_plugin` refuses, is left out with its one logged line)."""
    plugins.load_all(ENTRY_POINT_GROUP, register=load_plugin)


def _builtins() -> None:
    global _loaded, _BUILTIN
    if _loaded:
        return
    _loaded = True
    found = [importlib.import_module(f"{_builtin_package.__name__}.{module.name}").METHOD
             for module in pkgutil.iter_modules(_builtin_package.__path__)]
    found.sort(key=lambda m: DEFAULT.index(m.name) if m.name in DEFAULT else len(DEFAULT))
    _BUILTIN = tuple(method.name for method in found)
    for method in found:
        _METHODS.setdefault(method.name, _instance(method))


def builtin_names() -> tuple[str, ...]:
    """The built-in methods' names, :data:`DEFAULT` first: one per module of :mod:`nxl_hooks.method.methods`, so
    that a new method file is all it takes for every list of them (``nxl evaluate``'s default, ``--method``'s help).
    ``builtin_names()`` -> ``("normxlogit", "logat", "contrastive")``"""
    with _lock:
        _builtins()
        return _BUILTIN


def wanted_name(name: object) -> str:
    """``name`` when a probe may be asked to compute a method of that name (registered or not yet: a program may
    register its own before it attaches), else ValueError: not a method name, or one that a record field or an
    evaluation baseline takes (:data:`RESERVED`), which no method ever has."""
    name = check_name(name)
    if name in RESERVED:
        raise ValueError(f"{name!r} names a record field or one of nxl evaluate's baselines, never a method a probe "
                         f"computes: choose from {', '.join(builtin_names())}, or a method a plugin or your program "
                         "registers")
    return name


def get_method(name: str | Method) -> Method:
    """The method registered as ``name`` (a Method is returned as it is); ValueError naming the registered ones.
    ``nxl.get_method("contrastive").description``"""
    if not isinstance(name, str):
        return _instance(name)
    with _lock:
        _builtins()
        if name not in _METHODS:
            _read_plugins()
        if name in _METHODS:
            return _METHODS[name]
    broken = plugins.failure(ENTRY_POINT_GROUP, name)
    raise ValueError(f"unknown attribution method {name!r}: " + (broken if broken else (
        f"choose from {', '.join(method_names())} (or register one: nxl_hooks.register_method)")))


def method_names() -> tuple[str, ...]:
    """Every registered method's name, built-in ones first (installed plugins included). ``nxl.method_names()``"""
    with _lock:
        _builtins()
        _read_plugins()
        return tuple(_METHODS)


def _same(one: Method, other: Method) -> bool:
    """Whether two methods compute the same: one object, equal ones, or one class's with equal settings (a class given
    twice is made twice: ``methods=[LogitGap, LogitGap]``)."""
    try:
        return bool(one is other or one == other or (type(one) is type(other) and vars(one) == vars(other)))
    except Exception:  # noqa: BLE001 - settings that do not compare (tensors, vars of a slotted class): not the same
        return False


def _shown(method: Method) -> str:
    """``method`` as its own repr shows it (``Contrastive(foil=3)``), on one line and cut short (a tensor setting's
    repr runs over several), or its class's name where that says nothing."""
    if type(method).__repr__ is object.__repr__:
        return type(method).__name__
    try:
        shown = " ".join(repr(method).split())
    except Exception:  # noqa: BLE001 - a user's __repr__ that raises: its class still says which method
        return type(method).__name__
    return shown if len(shown) <= 80 else shown[:79] + "…"


def resolve_methods(methods: Methods) -> tuple[Method, ...]:
    """The methods a probe computes: :data:`DEFAULT` first, then each of ``methods`` (names or Method instances,
    or one comma-separated string, or one Method instance or class) not among them. ValueError for an unknown
    name, for ``methods`` that is none of these, or for two different methods of one name (a name the registry
    gives counts as its method, DEFAULT's always)."""
    if isinstance(methods, str):
        methods = [part.strip() for part in methods.split(",") if part.strip()]
    elif isinstance(methods, (Method, type)):  # methods=Contrastive(foil=3): one method, not a list of them
        methods = [methods]
    elif methods is not None and not isinstance(methods, abc.Iterable):
        raise ValueError(f"methods={methods!r}: give method names or Method objects (a list, one of them, or a "
                         "comma-separated string of names)")
    chosen: dict[str, Method] = {name: get_method(name) for name in DEFAULT}
    for method in methods or ():
        found = get_method(method)
        before = chosen.setdefault(found.name, found)
        # a record holds one score tensor per name: a second method of that name (Contrastive(foil=3) and
        # Contrastive(foil=5); an object named 'normxlogit') took the first's place with nothing said
        if _same(before, found):
            continue
        if found.name in DEFAULT:
            raise ValueError(f"methods= gives a method named {found.name!r} ({_shown(found)}): that is the built-in "
                             "method every record holds; give yours another name")
        raise ValueError(f"methods= gives two methods named {found.name!r} ({_shown(before)} and {_shown(found)}): "
                         "a record holds one score per method name; give one of them")
    return tuple(chosen.values())
