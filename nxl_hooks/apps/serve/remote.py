"""What ``nxl attach PID`` and ``nxl detach PID`` do inside the target process (:mod:`.inject` gets them there).

    handle({"action": "attach", "env": settings.to_env(), "wait": 0})   # {"ok": True, "status": {...}} or an error

Attach: the live transformers models of the process (every ``PreTrainedModel`` the garbage collector tracks that is
not part of another one, named by the path or hub id it was loaded from) are handed to the same controller as
under ``nxl run`` (:func:`.controller.start`), with the same selection rules (``--models``), run folder, sink and
control endpoint; the same patches of transformers are applied to the modules already imported (models loaded
later are recorded too, and ``transformers serve`` passes each request's id). Detach: the controller is closed
(every probe off, endpoint and its threads ended) and forgotten, and every patched method is given back.

A server whose models run in processes of their own (``transformers serve`` from 5.25: ``nxl attach`` found
spawned children, ``"front": True``, and the process runs serve's API server) holds no model: attached with none,
it gets only the patches that send each request's id to the model's process (the ``transformers.cli.serving``
modules'), and ``nxl attach`` attaches its model processes each as a target of its own; its detach answers
``"front": True``, and ``nxl detach`` then detaches them. A model process it starts while attached gets a wrapped
loader (:class:`_Recorded`), which makes that process record (:data:`SPAWNED_BY` in its environment) before its
model loads.

Runs in a short-lived thread of the target (never its main thread); every outcome is a dict, nothing raises.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import importlib
import inspect
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from ...hooks.conventions import SERVE_CLIENT
from ...hooks.generate import EAGER
from ...hooks.guard import logger, one_line, typed
from ...hooks.plan import model_name
from ...hooks.probe import count_hooks
from ...records.sinks import sink_factory
from .controller import Controller, end, start, stop
from .endpoint import own_signals
from .lazy import HOOKS, install, uninstall
from .settings import Settings

__all__ = ["handle", "live_models"]

_MARK = "__nxl_patched__"  #: what :mod:`.patches` sets on each wrapper it installs (the original is ``__wrapped__``)
_LOCK = threading.Lock()
_ATTACHED: Controller | None = None  #: the controller ``nxl attach`` started here, until ``nxl detach``
_FRONT: str | None = None  #: the run folder of a server front's attach (no controller, its patches only)
#: the modules whose patches a server front gets: those that send request ids to the model's process
_FRONT_MODULES = "transformers.cli.serving."
#: what makes a process with spawned children and no model a server front: transformers serve's API server
_FRONT_MODULE = "transformers.cli.serving.model_manager"
#: Set in the environment of a model process that a server front ``nxl attach`` reached started later, to the
#: front's pid (:class:`_Recorded`): its recording is an attached one, which ``nxl detach`` ends
SPAWNED_BY = "NXL_ATTACHED_FRONT"
_SET_HERE: dict[str, str | None] = {}  #: what :func:`_record_here` set in this process's environment: as it was
_EAGER_BEFORE: list[str | None] = []  #: NXL_EAGER as it was before an ``nxl attach --eager``, given back at detach
#: the main-thread calls :func:`_settle_signals_later` queued: ctypes frees a callback nothing holds, and one is
#: called after the thread that queued it has ended
_QUEUED: list[Any] = []
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  #: those the attach's script sets its handler for


def handle(request: dict, wanted: Callable[[], bool] = lambda: True) -> dict:
    """Carry out ``request`` (``{"action": "attach", "env": {NXL_*}, "wait": s}`` or ``{"action": "detach"}``) and
    return its outcome. ``wanted``: whether nxl attach still waits for the answer; one it gave up on (Ctrl-C, its
    timeout: it told its user nothing was attached, and removed the run folder it made) is not carried out, nor
    kept when it gave up meanwhile."""
    try:
        with _LOCK:
            if request.get("action") == "detach":
                return _detach()
            outcome = _attach(request.get("env", {}), float(request.get("wait", 0)), wanted,
                              front=request.get("front") is True)
    except Exception as error:  # noqa: BLE001 - said to nxl attach, never raised in the target
        outcome = {"ok": False, "code": "failed", "error": typed(error)}
    if request.get("action") != "detach":
        _settle_signals_later()
    return outcome


def _settle_signals_later() -> None:
    """After an attach request, SIGTERM and SIGHUP as what is attached then needs: with nothing attached (the
    request refused), the default action back where the attach's script set its handler (it did, in the main
    thread, before the refusal), so a refused attach leaves the process as it was; attached, the endpoint's handler
    where the default is (:func:`~.endpoint.own_signals`: a request refused meanwhile, whose call ran first, gave it
    back). Python sets handlers in the main thread alone, so the call is queued for it (``Py_AddPendingCall``: at its
    next bytecode), as the script's own part ran there; it reads what is attached when it runs, so the last one
    queued leaves them as the last request did. nxl detach's script gives the default back by the same mark."""

    def settle(_: Any) -> int:
        try:
            if _ATTACHED is not None:  # (a server front has no endpoint to close on SIGTERM: the default)
                own_signals()
            else:
                for signum in _SIGNALS:
                    if getattr(signal.getsignal(signum), "__nxl_attach__", False):
                        signal.signal(signum, signal.SIG_DFL)
        except Exception:  # noqa: BLE001 - never into the program's main thread
            pass
        return 0  # (non-zero would raise in the main thread)

    try:
        call = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(settle)
        if ctypes.pythonapi.Py_AddPendingCall(call, None) == 0:
            _QUEUED.append(call)
    except Exception:  # noqa: BLE001 - no ctypes: a handler stays until nxl detach, which acts on it like the default
        pass


def live_models(wait: float = 0.0, selects: Any = None) -> list[tuple[Any, str]]:
    """(model, name) of every top-level transformers model alive in this process, polled for up to ``wait`` s
    until one that ``selects(name)`` is found (``selects``: None takes any)."""
    deadline = time.monotonic() + wait
    while True:
        started = time.monotonic()
        found = _scan()
        now = time.monotonic()
        if any(selects is None or selects(name) for _, name in found) or now >= deadline:
            return found
        # a scan holds the GIL for its whole length (a tenth of a second over a heap of millions of objects): the
        # host's threads get at least 95% of the time between two
        time.sleep(min(max(0.5, 20 * (now - started)), max(deadline - now, 0.0)))


def _scan() -> list[tuple[Any, str]]:
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:  # transformers not imported: no model, and nothing to import here
        return []
    # type(), not isinstance: isinstance asks each object its __class__, and some answer with a warning into
    # the host's stderr (torch.distributed.reduce_op's FutureWarning) or an exception
    models = [obj for obj in gc.get_objects() if issubclass(type(obj), modeling.PreTrainedModel)]
    if gc.get_freeze_count():  # frozen objects are not listed (transformers serve's model process freezes its own)
        listed = {id(model) for model in models}
        models += [model for model in _in_frames(modeling.PreTrainedModel) if id(model) not in listed]
    inner = {id(sub) for model in models for sub in model.modules() if sub is not model}
    return [(model, model_name(model)) for model in models if id(model) not in inner]


def _in_frames(kind: type) -> list[Any]:
    """The ``kind`` objects the running frames of every thread hold: a local, or a local's ``model`` (a runner's),
    once each. What a program that froze its objects (``gc.freeze``: the garbage collector lists them no more)
    still shows of its models."""
    found: dict[int, Any] = {}
    for frame in sys._current_frames().values():
        while frame is not None:
            for value in list(frame.f_locals.values()):
                # (read without running anything of the program's: no property, no __getattr__)
                for candidate in (value, inspect.getattr_static(value, "model", None)):
                    if issubclass(type(candidate), kind):
                        found.setdefault(id(candidate), candidate)
            frame = frame.f_back
    return list(found.values())


def _attach(env: dict[str, str], wait: float, wanted: Callable[[], bool], front: bool = False) -> dict:
    global _ATTACHED, _FRONT
    if _FRONT is not None:
        return {"ok": False, "code": "attached", "error": f"process {os.getpid()} is recorded already (its model "
                f"processes, run folder {_FRONT}): nxl detach {os.getpid()} first"}
    # (nxl attach saw processes it spawned: transformers serve's, if this is its API server, hold its models)
    front = front and _FRONT_MODULE in sys.modules
    settings = Settings.from_env(env)
    try:
        if settings.sink_spec:
            sink_factory(settings.sink_spec)
    except ImportError as error:  # the sink kind's extra, missing here where the sink is made: nxl attach says it
        return {"ok": False, "code": "missing-extra", "module": error.name, "error": one_line(error)}
    found = live_models(0.0 if front else wait, settings.selects)
    if not wanted():
        return {"ok": False, "code": "withdrawn", "error": "nxl attach gave up on the request: nothing attached"}
    if not settings.run_dir.is_dir():  # nxl attach makes it (0700); one removed since is not made again here
        return {"ok": False, "code": "no-run-folder",
                "error": f"the run folder {settings.run_dir} is gone: nothing attached; attach again"}
    names = sorted({name for _, name in found})
    if front and not names:  # its models are in processes of its own: here, only what sends them request ids
        if _ATTACHED is not None:
            return {"ok": False, "code": "attached", "error": f"process {os.getpid()} is recorded already (run "
                    f"folder {_ATTACHED.settings.run_dir}): see nxl ctl status, or nxl detach {os.getpid()}"}
        _patch(lambda name: name.startswith(_FRONT_MODULES))
        follows = _follow_spawns(sys.modules[_FRONT_MODULE], env)
        _FRONT = str(settings.run_dir)
        return {"ok": True, "front": True, "follows": follows, "status": {"models": []}}
    if not any(settings.selects(name) for name in names):
        what = (f"no model matches --models {','.join(settings.models)} (found: {', '.join(names)})" if names else
                "no transformers model is loaded in this process yet")
        waited = f" (waited {wait:g} s); try again once it is, or with a longer --wait" if wait else (
            "; try again once it is, or with --wait SECONDS")
        return {"ok": False, "code": "no-model", "error": what + waited}
    try:
        ctl = start(settings)
    except RuntimeError as error:
        return {"ok": False, "code": "attached", "error": f"{error}: see nxl ctl status, or nxl detach {os.getpid()}"}
    _ATTACHED = ctl
    try:
        if settings.eager:  # what nxl run --eager sets in the program's environment, the engines read it there
            _EAGER_BEFORE.append(os.environ.get(EAGER))
            os.environ[EAGER] = "1"
        _patch()
        for model, name in found:
            ctl.adopt(model, name)
        status = ctl.status()
        if not wanted():  # it gave up while the models were attached: nothing of this attach stays
            raise RuntimeError("nxl attach gave up on the request while it was carried out")
        if not any(model["attached"] for model in status["models"]):
            raise ValueError("no model could be attached (" + "; ".join(
                f"{model['name']}: {model['error'] or 'not selected'}" for model in status["models"]) + ")")
    except BaseException:
        _detach()  # all or nothing: a failed attach leaves no hook, patch or endpoint behind
        raise
    return {"ok": True, "status": status}


def _patch(which: Callable[[str], bool] = lambda name: True) -> None:
    """Apply nxl run's patches to the modules already imported (none is waited for: nothing stays behind on
    ``sys.meta_path``); ``which``: of the modules it names."""
    for name, target in HOOKS:
        module = sys.modules.get(name)
        if module is not None and which(name):
            where, _, function = target.partition(":")
            getattr(importlib.import_module(where), function)(module)


def _follow_spawns(module: Any, env: dict[str, str]) -> bool:
    """Make the model processes serve's ``EngineClient`` starts from now on (a model loaded on demand, or again
    after ``--model-timeout``) record as those the attach reached: the loader it hands each one is wrapped
    (:class:`_Recorded`), and a new process records into the same run folder with the attach's settings (``env``)
    from its model's load on. Nothing of the server's own changes but that argument. Whether it could (another
    transformers: no)."""
    client = getattr(module, SERVE_CLIENT, None)
    original = vars(client).get("start_process") if isinstance(client, type) else None
    if not isinstance(original, staticmethod) or getattr(original.__func__, _MARK, False):
        return False
    function, variables = original.__func__, {**env, SPAWNED_BY: str(os.getpid())}
    signature = inspect.signature(function)
    if "loader" not in signature.parameters:
        return False

    @functools.wraps(function)
    def start_process(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
            bound.arguments["loader"] = _Recorded(bound.arguments["loader"], variables)
        except Exception:  # noqa: BLE001 - never into the server: that process runs unrecorded
            return function(*args, **kwargs)
        return function(*bound.args, **bound.kwargs)

    setattr(start_process, _MARK, True)
    client.start_process = staticmethod(start_process)
    return True


class _Recorded:
    """A serve ``ModelLoader`` as a front's model process gets it (pickled, by this class's name): its
    ``load_model_and_processor``, which that process calls first, makes the process record before the model loads
    (:func:`_record_here`); everything else is the loader's own."""

    def __init__(self, loader: Any, variables: dict[str, str]) -> None:
        self._nxl_loader, self._nxl_variables = loader, variables

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_nxl_") or name.startswith("__"):  # (unpickling looks up hooks before __dict__ is set)
            raise AttributeError(name)
        return getattr(self._nxl_loader, name)

    def load_model_and_processor(self, *args: Any, **kwargs: Any) -> Any:
        _record_here(self._nxl_variables)
        return self._nxl_loader.load_model_and_processor(*args, **kwargs)


def _record_here(variables: dict[str, str]) -> None:
    """Make this process (a model process a front started) record as under ``nxl run``: the attach's settings
    in its own environment (where the controller reads them; its children inherit them, as under ``nxl run``), and
    nxl run's patches of transformers (:func:`~.lazy.install`). Never raises: the model loads as it would."""
    try:
        _SET_HERE.update({key: os.environ.get(key) for key in variables if key not in _SET_HERE})
        os.environ.update(variables)
        install()
    except Exception as error:  # noqa: BLE001 - the model process runs unrecorded, said once
        logger.warning("nxl_hooks: this model process runs unrecorded (%s)", one_line(error))


def _unpatch() -> int:
    """Give back every original the patches replaced in the hooked modules' classes; how many."""
    restored = 0
    for name, _ in HOOKS:
        module = sys.modules.get(name)
        for cls in [value for value in vars(module).values() if isinstance(value, type)] if module else []:
            for attr, value in list(vars(cls).items()):
                bound = isinstance(value, (classmethod, staticmethod))
                function = value.__func__ if bound else value
                if getattr(function, _MARK, False):
                    original = function.__wrapped__
                    setattr(cls, attr, type(value)(original) if bound else original)
                    restored += 1
    return restored


def _detach() -> dict:
    global _ATTACHED, _FRONT
    ctl = _ATTACHED
    if ctl is None and _FRONT is not None:
        run_dir, _FRONT = _FRONT, None
        return {"ok": True, "front": True, "run_dir": run_dir, "patches": _unpatch(), "hooks": 0, "threads": []}
    if ctl is None and os.environ.get(SPAWNED_BY):  # a model process its attached server front started
        return _detach_spawned()
    if ctl is None:
        return {"ok": False, "code": "not-attached",
                "error": "not attached by nxl attach (nothing to detach)"}  # nxl detach names the process
    models = _models(ctl)
    run_dir = str(ctl.settings.run_dir)
    restored = _unpatch()  # first: a from_pretrained returning meanwhile must not adopt into a new controller
    stop(ctl)
    _ATTACHED = None
    while _EAGER_BEFORE:  # the environment as it was before the attach
        before = _EAGER_BEFORE.pop()
        if before is None:
            os.environ.pop(EAGER, None)
        else:
            os.environ[EAGER] = before
    return _detached(run_dir, restored, models)


def _detach_spawned() -> dict:
    """Detach a model process a front started while attached (:func:`_record_here`): no patch, import hook or
    controller of its recording stays, its recording is ended (a load under way adopts nothing), and the settings
    leave its environment (a Python it starts later is not taken for one under ``nxl run``)."""
    uninstall()  # nothing it imports from now on is patched
    restored = _unpatch()
    ctl = end()  # (None: its model had not loaded)
    models = _models(ctl) if ctl else []
    run_dir = str(ctl.settings.run_dir) if ctl else os.environ.get("NXL_RUN_DIR", "")
    if ctl is not None:
        ctl.close()
    for key, value in _SET_HERE.items():  # as the process was given them
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _SET_HERE.clear()
    return _detached(run_dir, restored, models)


def _models(ctl: Controller) -> list[Any]:
    """The models ``ctl`` still holds (weakly)."""
    return [model for model in (watch.ref() for watch in ctl.watches()) if model is not None]


def _detached(run_dir: str, restored: int, models: list[Any]) -> dict:
    """A detach's answer: its run folder, the patches given back, and what is left of it (hooks on ``models``, the
    nxl threads still running)."""
    return {"ok": True, "run_dir": run_dir, "patches": restored, "hooks": sum(count_hooks(m) for m in models),
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("nxl-")
                              and t is not threading.current_thread())}
