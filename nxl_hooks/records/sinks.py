"""Where generation records go: the :class:`RecordSink` protocol, the registry of sink kinds and :func:`make_sink`.

    sink = make_sink("runs/llm/")                      # a folder: rotating stream files
    sink = make_sink("parquet:out.parquet")            # a registered kind, "NAME:ARG"
    register_sink("mykind", lambda arg, **options: MySink(arg))
    nxl.attach(model, sink="mykind:somewhere")         # attach builds it through make_sink

A probe's hub calls the four methods of the protocol, in one thread at a time: ``write_call`` when a call's prompt
is known, ``write_step`` per step record, ``write_end`` when the call ends, ``close`` when the probe detaches. A
sink that raises stops getting records (the host's call goes on); a sink that stops writing by itself (a full
disk) says why in its ``fault``.

Third-party kinds register through the entry-point group ``nxl_hooks.sinks`` (name: the kind, value: a factory
``factory(arg: str, **options) -> RecordSink``), loaded by :mod:`nxl_hooks.arch.plugins`: when a spec names a kind
that is not registered in the process, only that one is imported; a broken one is refused with the loader's line.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import threading
from typing import Any, Callable, Protocol, runtime_checkable

from ..arch import plugins
from ..arch.calls import unbound
from ..arch.text import install_command, typed
from .steps import GenerationCall, Step

__all__ = ["DECLARED", "ENTRY_POINT_GROUP", "BatchingSink", "FaultingSink", "LosingSink", "RecordSink", "builtin_kinds",
           "check_factory", "file_arg", "kind_name", "make_sink", "register_sink", "requirement", "sink_factory"]

#: The entry-point group through which installed distributions register sink kinds.
ENTRY_POINT_GROUP = plugins.SINKS


@runtime_checkable
class RecordSink(Protocol):
    """A destination of generation records. ``class MySink: def write_call(self, call, meta): ...`` and the rest.

    What a sink may do beyond these four is an optional protocol of its own: :class:`BatchingSink` (``write_steps``),
    :class:`FaultingSink` (``fault``), :class:`LosingSink` (``lost``).
    """

    def write_call(self, call: GenerationCall, meta: dict) -> None:
        """A call whose prompt is known (``meta``: what the probe explains, ``Probe.describe()``); or, with
        ``call.prompt_mask`` None, one whose prompt never ran recorded (not recorded: ``call.error`` says why; or
        ended before its first forward), whose ``write_end`` follows with no step."""

    def write_step(self, step: Step) -> None:
        """One step record of a call opened by ``write_call``."""

    def write_end(self, call: GenerationCall) -> None:
        """The call returned (``complete``, ``sequences``) or stopped being recorded (``error``)."""

    def close(self) -> None:
        """No more records: flush and release what the sink holds."""


@runtime_checkable
class BatchingSink(RecordSink, Protocol):
    """A :class:`RecordSink` that takes several step records at once: the hub hands a backlog over with
    ``write_steps`` (one write for all, as :class:`~nxl_hooks.Sink` does); a sink without it gets ``write_step``
    for each."""

    def write_steps(self, steps: list[Step]) -> None:
        """Step records of calls opened by ``write_call``, in order."""


@runtime_checkable
class FaultingSink(RecordSink, Protocol):
    """A :class:`RecordSink` that may stop writing by itself (a full disk, a read-only or removed folder) and says
    why in ``fault``: one line, None while it is healthy (or not set yet: it is looked at after every write)."""

    fault: str | None


@runtime_checkable
class LosingSink(RecordSink, Protocol):
    """A :class:`RecordSink` that may lose step records it had taken when it fails (a file that cannot be finished
    is removed): ``lost`` counts those of calls that returned, read when it failed; they count as not written, with
    the calls' notes."""

    lost: int


Factory = Callable[..., RecordSink]

_KINDS: dict[str, Factory] = {}
_lock = threading.Lock()
#: "NAME:ARG": a kind's name is a word of two or more characters (one letter would be a Windows drive)
_SPEC = re.compile(r"([A-Za-z][\w.-]+):(.*)", re.DOTALL)


def register_sink(name: str, factory: Factory) -> None:
    """Make ``make_sink("NAME:ARG", **options)`` call ``factory(ARG, **options)``. ``register_sink("pq", PqSink)``

    A name registered again replaces the earlier factory (the last registration wins). A built-in kind
    (:func:`builtin_kinds`: ``file``, ``folder``, ``parquet``) is refused: what ``file:``/``folder:`` promise (the
    format, a stream readable up to its last whole record after a SIGKILL) holds for every spec naming it."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z][\w.-]+", name):
        raise ValueError(f"sink kind {name!r}: use a name of two or more letters, digits, '_', '.' or '-', "
                         "starting with a letter")
    if name in builtin_kinds():
        raise ValueError(f"sink kind {name!r} is built in and cannot be replaced: register the factory under "
                         f"another name (e.g. 'my-{name}') and write that name in the sink spec")
    if not callable(factory):
        raise ValueError(f"sink kind {name!r}: the factory {factory!r} is not callable")
    with _lock:
        _KINDS[name] = factory


def _kind(name: str) -> Factory | None:
    """The factory registered as ``name``: in this process, else through an installed entry point (never for a
    built-in kind: a plugin of that name would take the records ``file:``/``folder:`` promise to the stream)."""
    with _lock:
        factory = _KINDS.get(name)
    if factory is not None or name in builtin_kinds():
        return factory
    factory = plugins.load(ENTRY_POINT_GROUP, name, log=False)  # a broken one: kind_name refuses with its line
    if factory is not None:
        register_sink(name, factory)
    return factory


#: What a module of this package declares to make built-in sink kinds, read from its source (a literal): the module
#: is imported only where one of its kinds is used, and what a kind needs only where its sink is made::
#:
#:     SINKS = {"csv": {"factory": "CsvSink"}}      # or with "needs": "a.module", "extra": "nxl_hooks extra"
#:
#: and ``"arg": "file"`` where ARG is a file the sink writes in a folder it does not make (checked up front by
#: :func:`file_arg`).
DECLARED = "SINKS"


@functools.cache
def builtin_kinds() -> dict[str, dict[str, str]]:
    """Every built-in kind -> its declaration, with ``module``: the module of this package that declares it."""
    return {kind: {**declared, "module": module}
            for module, kinds in plugins.declared(__package__, DECLARED).items() for kind, declared in kinds.items()}


def requirement(name: str) -> tuple[str, str] | None:
    """The module a built-in kind needs where its sink is made and the extra that installs it (None: nothing
    optional), for a front end whose sinks are made in another interpreter (nxl run's program, nxl attach's
    target) to ask there."""
    declared = builtin_kinds().get(name, {})
    return (declared["needs"], declared["extra"]) if "needs" in declared else None


def _builtin(name: str, here: bool = True) -> Factory:
    # checked here, where every front end validates a spec (sink_factory), so a missing extra is refused before
    # anything starts, not per model later
    declared = builtin_kinds()[name]
    needed = requirement(name)
    if here and needed is not None:
        try:
            importlib.import_module(needed[0])
        except ImportError:
            package = needed[0].partition(".")[0]
            raise ImportError(f"sink kind {name!r} needs {package}: {install_command(needed[1])}",
                              name=package) from None
    return getattr(importlib.import_module(declared["module"]), declared["factory"])


def file_arg(name: str) -> bool:
    """Whether the built-in kind ``name`` takes a file as ARG, to be made in a folder that must exist."""
    return builtin_kinds().get(name, {}).get("arg") == "file"


def kind_name(spec: Any, *, here: bool = True) -> str | None:
    """The kind a ``"NAME:ARG"`` string names (None: a path, or not a string); ValueError for a kind that nobody
    registered. A string that is an existing path is a path. ``here`` False: the sink is made in another process
    (nxl attach's target), whose plugins are not this one's and are not imported here: a kind that is not built in
    is taken as named, for that process to check."""
    match = _SPEC.fullmatch(spec) if isinstance(spec, str) else None
    if match is None:
        return None
    name = match.group(1)
    if name in builtin_kinds() or (here and _kind(name) is not None):
        return name
    if os.path.exists(spec):
        return None
    if not here:
        return name
    broken = plugins.failure(ENTRY_POINT_GROUP, name)
    if broken is not None:
        raise ValueError(f"sink {spec!r}: {broken}")
    known = sorted({*builtin_kinds(), *_KINDS, *plugins.entry_points(ENTRY_POINT_GROUP)})
    raise ValueError(f"sink {spec!r}: no sink kind {name!r} is registered (known: {', '.join(known)}); for a file "
                     "or folder whose name holds a colon, write it as ./NAME")


def _check_path(spec: str) -> None:
    """A string that is no ``NAME:ARG`` is a path only when it reads as one: it exists, has a folder part, or its
    name has a suffix (``run.nxl``). A bare word (``"raise"``, ``":x"``) is as likely a kind without its ``:ARG``
    or a typo as a file name, so it is refused rather than made into a stream file of that name."""
    if os.path.exists(spec) or "/" in spec or os.sep in spec or os.path.splitext(spec)[1]:
        return
    known = ", ".join(sorted({*builtin_kinds(), *_KINDS, *plugins.entry_points(ENTRY_POINT_GROUP)}))
    head, colon, _ = spec.partition(":")
    what = (f"{head!r} before ':' is no sink kind" if colon else "a bare name is no file path, folder or sink kind")
    raise ValueError(f"sink {spec!r}: {what}; write a stream file as NAME.nxl or ./NAME, a folder as NAME/, or a "
                     f"registered kind as KIND:ARG (known: {known})")


def sink_factory(spec: Any, *, here: bool = True) -> tuple[Factory, str] | None:
    """The factory and argument ``make_sink(spec)`` would use (None: ``spec`` already is a sink), without making
    the sink: for checking a value before any file is opened. ValueError for a spec that names no sink; an
    ImportError naming the extra a built-in kind lacks in this process, unless ``here`` is False (the sink is made
    in another interpreter, which the caller asks for :func:`requirement`)."""
    if isinstance(spec, RecordSink):
        return None
    name = kind_name(spec)
    if name is not None:
        return _kind(name) or _builtin(name, here), spec.partition(":")[2]
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        if not path:
            raise ValueError("sink='': give a file path, a folder, or NAME:ARG")
        if isinstance(spec, str):
            _check_path(path)
        folder = os.path.isdir(path) or path.endswith(os.sep)
        return _builtin("folder" if folder else "file"), path
    raise ValueError(f"sink={spec!r}: give a file path, a folder, 'NAME:ARG' for a registered kind "
                     "(e.g. 'parquet:out.parquet'), or an object with write_call, write_step, write_end and close")


def make_sink(spec: Any, **options: Any) -> RecordSink:
    """A record sink from what a user gave. ``make_sink("runs/", max_bytes=1 << 20)``

    ``spec``: an object that already is a :class:`RecordSink` (returned as it is; no ``options``); a file path (the
    crash-safe stream file, :class:`~nxl_hooks.records.writer.Sink`); an existing folder or a path ending in ``/``
    (rotating stream files, :class:`~nxl_hooks.records.writer.RotatingSink`); or ``"NAME:ARG"`` for a registered kind
    (``file:``, ``folder:``, ``parquet:`` built in; others through :func:`register_sink` or the entry-point group
    ``nxl_hooks.sinks``). ``options`` go to the kind's factory. A :class:`pathlib.Path` is always a path; a string
    that is a bare word (``"raise"``, ``":x"``: no folder part, no suffix, not an existing path) is refused. A
    factory that exits (``SystemExit``) is refused with a ValueError: the host goes on."""
    found = sink_factory(spec)
    if found is None:
        if options:
            raise ValueError(f"sink options {sorted(options)} given with a sink object: set them where it is made")
        _check_calls(spec, spec, "give a sink whose methods take them")
        return spec
    factory, arg = found
    check_factory(spec, factory, arg, options)
    try:
        sink = factory(arg, **options)
    except Exception:
        raise  # the kind's own refusal (a bad ARG, a missing extra), as it said it
    except BaseException as error:  # noqa: BLE001 - a factory's sys.exit is its failure, never the host's exit
        said = typed(plugins.contained(error), aside=True)
        raise ValueError(f"sink {spec!r}: its factory raised {said} instead of returning a "
                         "sink: fix or uninstall the package of that sink kind, or give another sink") from error
    lacks = [method for method in _METHODS if not callable(getattr(sink, method, None))]
    if lacks:
        raise ValueError(f"sink {spec!r}: its factory returned {type(sink).__name__}, which lacks "
                         f"{', '.join(lacks)}: a sink has {', '.join(_METHODS[:-1])} and close (nxl.RecordSink); "
                         "fix the package of that sink kind, or give another sink")
    _check_calls(spec, sink, "fix the package of that sink kind, or give another sink")
    return sink


#: What a probe calls on every sink (:class:`RecordSink`).
_METHODS = ("write_call", "write_step", "write_end", "close")
#: How the probe calls each method of a sink, with placeholders for its arguments (``write_steps``: a BatchingSink's)
_CALLS = {"write_call": ("call", "meta"), "write_step": ("step",), "write_end": ("call",), "close": (),
          "write_steps": ("steps",)}


def _check_calls(spec: Any, sink: Any, fix: str) -> None:
    """A ValueError naming the sink when one of its methods cannot be called as the probe calls it: else its every
    record would fail in the sink's thread, the records lost for a signature (:func:`~nxl_hooks.arch.calls.unbound`)."""
    for method, arguments in _CALLS.items():
        try:
            bound = getattr(sink, method, None)
        except Exception:  # noqa: BLE001 - a property of the sink's that raises: the probe reads it guarded too
            continue
        if callable(bound) and (why := unbound(bound, *arguments)) is not None:
            raise ValueError(f"sink {spec!r}: its {method} cannot be called as {method}({', '.join(arguments)}) "
                             f"({why}), as the probe calls it (nxl.RecordSink); {fix}")


def check_factory(spec: Any, factory: Factory, arg: str, options: dict[str, Any]) -> None:
    """A ValueError naming the sink when ``factory`` cannot be called as ``factory(ARG, **options)`` (a plugin's
    factory written with another signature: :func:`~nxl_hooks.arch.calls.unbound`)."""
    if (why := unbound(factory, arg, **options)) is not None:
        name = getattr(factory, "__qualname__", type(factory).__name__)
        raise ValueError(f"sink {spec!r}: its factory {name} cannot be called as factory(ARG, **options) "
                         f"({why}): a sink kind's factory takes the text after 'KIND:' and the options; "
                         "fix the package of that sink kind, or give another sink")

