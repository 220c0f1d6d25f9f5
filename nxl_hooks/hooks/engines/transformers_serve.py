"""Request ids of ``transformers serve``: :func:`patch_serving` and, from transformers 5.25,
:func:`patch_engine_client`.

    patch_serving(transformers.cli.serving.utils)               # nxl run applies them when the modules are imported
    patch_engine_client(transformers.cli.serving.model_manager)

Up to 5.24 serve runs ``model.generate`` on its inference thread without passing the request's id along; the patch
carries the id from serve's handler to the ``generate`` call that serves the request (under continuous batching the
manager has the id itself: :mod:`.transformers_cb`). From 5.25 each model runs in a process of its own, to which the
API server hands its requests numbered: the id (``X-Request-ID``, or the one serve made) goes with the request's
generation settings, as a key an unpatched model process never reads (:func:`carry`), and the model's process
names the request's records by it (its ``generate`` call, or its continuous-batching request). Both processes run
the patches under ``nxl run`` (the bootstrap is inherited); ``nxl attach`` injects into both.
:data:`~nxl_hooks.apps.serve.lazy.HOOKS` names them.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from types import ModuleType
from typing import Any, Callable

from ..conventions import SERVE_CLIENT, SERVE_HANDLERS, SERVE_MIDDLEWARE, SERVE_RUNNERS, SERVE_SUBMITS
from ..generate import REQUEST_ID, REQUEST_NAMES
from ..guard import reason

__all__ = ["carry", "patch_engine_client", "patch_serving"]

_MARK = "__nxl_patched__"


def _patched(function: Any) -> bool:
    return getattr(function, _MARK, False)


def _request_id(signature: inspect.Signature, args: tuple, kwargs: dict) -> str | None:
    try:
        value = signature.bind_partial(*args, **kwargs).arguments.get("request_id")
    except TypeError:
        return None
    return value if isinstance(value, str) and value else None


def _nothing() -> None:
    """What :func:`_around` runs after a call that leaves nothing to undo."""


def _around(original: Callable, prepare: Callable[[tuple, dict], tuple[tuple, dict, Callable[[], Any]]]) -> Callable:
    """``original`` (sync or async) whose every call first goes through ``prepare(args, kwargs)``, which gives the
    arguments to call it with and what to run once it returned or raised; marked as the probe's (:data:`_MARK`)."""
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            args, kwargs, done = prepare(args, kwargs)
            try:
                return await original(*args, **kwargs)
            finally:
                done()
    else:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            args, kwargs, done = prepare(args, kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                done()
    setattr(wrapper, _MARK, True)
    return wrapper


def _tag(original: Callable) -> Callable:
    """``original`` (sync or async) run with REQUEST_ID set to its ``request_id`` argument."""
    signature = inspect.signature(original)

    def tagged(args: tuple, kwargs: dict) -> tuple[tuple, dict, Callable[[], Any]]:
        return args, kwargs, functools.partial(REQUEST_ID.reset, REQUEST_ID.set(_request_id(signature, args, kwargs)))

    return _around(original, tagged)


def _in_this_context(fn: Callable) -> Callable:
    """``fn``, to be run in another thread, run there in a copy of this context (its :data:`REQUEST_ID`)."""
    return functools.partial(contextvars.copy_context().run, fn)


def _in_context(original: Callable) -> Callable:
    """``submit(fn, ...)`` whose ``fn`` runs, in the other thread, in a copy of the submitter's context."""
    @functools.wraps(original)
    def submit(self: Any, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if REQUEST_ID.get() is not None:
            fn = _in_this_context(fn)
        return original(self, fn, *args, **kwargs)

    setattr(submit, _MARK, True)
    return submit


def patch_serving(module: ModuleType) -> None:
    """Carry each request's id from ``transformers serve``'s handler to the ``generate`` call that serves it.

    Up to 5.24, ``transformers serve`` without continuous batching runs ``model.generate`` on its inference thread
    and does not pass the request id along. ``GenerateManager.generate_streaming`` / ``generate_non_streaming`` now
    set :data:`~nxl_hooks.hooks.generate.REQUEST_ID` to the request's id (the ``X-Request-ID`` header, or the uuid
    serve made), and what they submit to the inference thread runs in a copy of that context, so the ``generate``
    call of the request carries its id. (Under continuous batching the manager has the id itself.) From 5.25:
    the API server's middleware sets the id for the request's handler (:func:`patch_engine_client` sends it to the
    model's process), and the model's process's runners take it out of each request they are handed. Applied once
    per class (a marker on the wrapper); never raises into the program."""
    manager = getattr(module, "GenerateManager", None)
    if manager is None and _runners(module):
        return _patch_split(module)
    names = SERVE_HANDLERS + SERVE_SUBMITS
    if manager is None or not all(callable(getattr(manager, name, None)) for name in names):
        reason("request ids of transformers serve", RuntimeError(
            "this transformers version has no GenerateManager with " + ", ".join(names) + ", nor "
            + " and ".join(f"{name}.generate" for name in SERVE_RUNNERS) + "; calls get generated ids"))
        return
    if _patched(manager.generate_streaming):
        return
    for name in SERVE_HANDLERS:
        setattr(manager, name, _tag(getattr(manager, name)))
    for name in SERVE_SUBMITS:
        setattr(manager, name, _in_context(getattr(manager, name)))


# -- transformers 5.25 and newer: the model in a process of its own ------------------------------------------------

#: The first item of the key :func:`carry` adds to a request's generation settings; the second is the id.
_CARRIED = "nxl_hooks.request_id"


def carry(generation_kwargs: dict, request_id: str) -> dict:
    """``generation_kwargs`` (a copy) with ``request_id`` in it, for the model's process: as a key, ``(_CARRIED,
    request_id)``, whose value is None. A model process that nxl_hooks did not patch never sees it: ``generate`` is
    given only the settings that are not None, and continuous batching reads the ones it knows."""
    return {**generation_kwargs, (_CARRIED, request_id): None}


def _taken(generation_kwargs: Any) -> str | None:
    """The id :func:`carry` put in ``generation_kwargs``, taken out of it; None without one."""
    if not isinstance(generation_kwargs, dict):
        return None
    keys = [key for key in generation_kwargs if isinstance(key, tuple) and len(key) == 2 and key[0] == _CARRIED]
    for key in keys:
        del generation_kwargs[key]
    return keys[-1][1] if keys and isinstance(keys[-1][1], str) else None


def _runners(module: ModuleType) -> list[type]:
    """The model process's runner classes of ``module`` (5.25's ``transformers.cli.serving.utils``), or [] where
    one is missing or takes no ``generate``."""
    found = [getattr(module, name, None) for name in SERVE_RUNNERS]
    return found if all(isinstance(cls, type) and callable(vars(cls).get("generate")) for cls in found) else []


@functools.lru_cache(maxsize=None)
def _seen_class(cls: type, names: tuple[str, ...]) -> type:
    """A subclass of ``cls`` whose attributes ``names`` read what :func:`_seen` was given instead."""
    def instead(name: str) -> property:
        return property(lambda self: self._nxl_instead[name],
                        lambda self, value: self.__dict__.__setitem__(name, value))

    return type(cls.__name__, (cls,), {"__slots__": ("_nxl_instead",), **{name: instead(name) for name in names}})


def _seen(target: Any, **instead: Any) -> Any:
    """``target`` as a method of it sees itself, but for the attributes given: an instance of its class (``super()``
    and ``isinstance`` work) sharing its attributes (whatever the method reads or sets is the target's own), so
    nothing of the target changes and nothing is left behind to undo. ``target`` itself where that cannot be made
    (a class of another make: its requests keep serve's ids, said once)."""
    try:
        seen = object.__new__(_seen_class(type(target), tuple(sorted(instead))))
        seen.__dict__ = target.__dict__
        seen._nxl_instead = instead
        return seen
    except Exception as error:  # noqa: BLE001 - the request goes on as serve made it
        if type(target) not in _UNSEEN:  # (once per class, not once per request)
            _UNSEEN.add(type(target))
            reason(f"request ids of transformers serve ({type(target).__name__})", error)
        return target


_UNSEEN: set[type] = set()  #: the classes :func:`_seen` could not make a view of


class _InContext:
    """A queue whose ``put((request_id, function, ...))`` queues ``function`` run in a copy of the putter's context
    (the runner's thread then calls it with the request's :data:`REQUEST_ID`); anything else as it is."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue

    def put(self, item: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(item, tuple) and len(item) > 1 and callable(item[1]):
            item = (item[0], _in_this_context(item[1]), *item[2:])
        return self._queue.put(item, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def _named(original: Callable, batching: bool) -> Callable:
    """A runner's ``generate(request_id, inputs, generation_kwargs, stream)`` that takes the client's id out of the
    request's settings: ``batching``, its continuous-batching request (the manager's id is ``str(request_id)``) is
    named by it (:data:`~nxl_hooks.hooks.generate.REQUEST_NAMES`); else the ``generate`` call it queues runs with it
    as :data:`REQUEST_ID`."""
    @functools.wraps(original)
    def generate(self: Any, request_id: Any, inputs: Any, generation_kwargs: Any, *args: Any, **kwargs: Any) -> Any:
        name = _taken(generation_kwargs)
        if name is None:
            return original(self, request_id, inputs, generation_kwargs, *args, **kwargs)
        if batching:
            REQUEST_NAMES.name(str(request_id), name)
            return original(self, request_id, inputs, generation_kwargs, *args, **kwargs)
        queue = getattr(self, "queue", None)
        seen = _seen(self, queue=_InContext(queue)) if queue is not None else self
        token = REQUEST_ID.set(name)
        try:
            return original(seen, request_id, inputs, generation_kwargs, *args, **kwargs)
        finally:
            REQUEST_ID.reset(token)

    setattr(generate, _MARK, True)
    return generate


def _identified(original: Callable) -> Callable:
    """The API server's ``RequestIdMiddleware.__call__``, whose app (the handler) runs with the request's id (the
    one the middleware put in ``scope["state"]``) as :data:`REQUEST_ID`."""
    @functools.wraps(original)
    async def call(self: Any, scope: Any, receive: Any, send: Any) -> Any:
        app = self.app

        async def identified(scope: Any, receive: Any, send: Any) -> Any:
            state = scope.get("state") if isinstance(scope, dict) else None
            request_id = state.get("request_id") if isinstance(state, dict) else None
            token = REQUEST_ID.set(request_id if isinstance(request_id, str) and request_id else None)
            try:
                return await app(scope, receive, send)
            finally:
                REQUEST_ID.reset(token)

        return await original(_seen(self, app=identified), scope, receive, send)

    setattr(call, _MARK, True)
    return call


def _carrying(original: Callable) -> Callable:
    """``EngineClient.generate_streaming`` / ``generate_non_streaming(inputs, generation_kwargs, ...)`` (sync or
    async) that send the request's :data:`REQUEST_ID` with its settings (:func:`carry`)."""
    def carried(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        request_id = REQUEST_ID.get()
        if request_id is None:
            return args, kwargs
        if "generation_kwargs" in kwargs and isinstance(kwargs["generation_kwargs"], dict):
            return args, {**kwargs, "generation_kwargs": carry(kwargs["generation_kwargs"], request_id)}
        if len(args) > 2 and isinstance(args[2], dict):  # (self, inputs, generation_kwargs, ...)
            return (*args[:2], carry(args[2], request_id), *args[3:]), kwargs
        return args, kwargs

    return _around(original, lambda args, kwargs: (*carried(args, kwargs), _nothing))


def _patch_split(module: ModuleType) -> None:
    """5.25's ``transformers.cli.serving.utils``: its middleware (API server) and runners (model's process)."""
    middleware = getattr(module, SERVE_MIDDLEWARE, None)
    if isinstance(middleware, type) and callable(vars(middleware).get("__call__")):
        if not _patched(middleware.__call__):
            middleware.__call__ = _identified(middleware.__call__)
    else:
        reason("request ids of transformers serve", RuntimeError(
            f"this transformers version has no {SERVE_MIDDLEWARE}; calls get generated ids"))
    for cls in _runners(module):
        if not _patched(vars(cls)["generate"]):
            cls.generate = _named(vars(cls)["generate"], batching=cls.__name__ == SERVE_RUNNERS[1])


def patch_engine_client(module: ModuleType) -> None:
    """5.25's ``transformers.cli.serving.model_manager``: the API server's ``EngineClient`` sends each request's id
    to the model's process with its generation settings (:func:`carry`). Never raises into the program."""
    client = getattr(module, SERVE_CLIENT, None)
    if client is None and hasattr(sys.modules.get(module.__name__.rpartition(".")[0] + ".utils"), "GenerateManager"):
        return  # (up to 5.24: the model in the API server's process, patch_serving's part)
    if not isinstance(client, type) or not all(callable(vars(client).get(name)) for name in SERVE_HANDLERS):
        reason("request ids of transformers serve", RuntimeError(
            f"this transformers version has no {SERVE_CLIENT} with " + ", ".join(SERVE_HANDLERS)
            + "; calls get generated ids"))
        return
    for name in SERVE_HANDLERS:
        if not _patched(vars(client)[name]):
            setattr(client, name, _carrying(vars(client)[name]))
