"""Request ids of ``transformers serve`` without continuous batching: :func:`patch_serving`.

    patch_serving(transformers.cli.serving.utils)   # nxl run applies it when that module is imported

Serve then runs ``model.generate`` on its inference thread without passing the request's id along; the patch
carries the id from serve's handler to the ``generate`` call that serves the request (under continuous batching the
manager has the id itself: :mod:`.transformers_cb`). :data:`~nxl_hooks.apps.serve.lazy.HOOKS` names it.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from types import ModuleType
from typing import Any, Callable

from ..conventions import SERVE_HANDLERS, SERVE_SUBMITS
from ..generate import REQUEST_ID
from ..guard import reason

__all__ = ["patch_serving"]

_MARK = "__nxl_patched__"


def _patched(function: Any) -> bool:
    return getattr(function, _MARK, False)


def _request_id(signature: inspect.Signature, args: tuple, kwargs: dict) -> str | None:
    try:
        value = signature.bind_partial(*args, **kwargs).arguments.get("request_id")
    except TypeError:
        return None
    return value if isinstance(value, str) and value else None


def _tag(original: Callable) -> Callable:
    """``original`` (sync or async) run with REQUEST_ID set to its ``request_id`` argument."""
    signature = inspect.signature(original)
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def tagged(*args: Any, **kwargs: Any) -> Any:
            token = REQUEST_ID.set(_request_id(signature, args, kwargs))
            try:
                return await original(*args, **kwargs)
            finally:
                REQUEST_ID.reset(token)
    else:
        @functools.wraps(original)
        def tagged(*args: Any, **kwargs: Any) -> Any:
            token = REQUEST_ID.set(_request_id(signature, args, kwargs))
            try:
                return original(*args, **kwargs)
            finally:
                REQUEST_ID.reset(token)
    setattr(tagged, _MARK, True)
    return tagged


def _in_context(original: Callable) -> Callable:
    """``submit(fn, ...)`` whose ``fn`` runs, in the other thread, in a copy of the submitter's context."""
    @functools.wraps(original)
    def submit(self: Any, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if REQUEST_ID.get() is not None:
            fn = functools.partial(contextvars.copy_context().run, fn)
        return original(self, fn, *args, **kwargs)

    setattr(submit, _MARK, True)
    return submit


def patch_serving(module: ModuleType) -> None:
    """Carry each request's id from ``transformers serve``'s handler to the ``generate`` call that serves it.

    ``transformers serve`` without continuous batching runs ``model.generate`` on its inference thread and does not
    pass the request id along. ``GenerateManager.generate_streaming`` / ``generate_non_streaming`` now set
    :data:`~nxl_hooks.hooks.generate.REQUEST_ID` to the request's id (the ``X-Request-ID`` header, or the uuid serve
    made), and what they submit to the inference thread runs in a copy of that context, so the ``generate`` call of
    the request carries its id. (Under continuous batching the manager has the id itself.) Applied once per class
    (a marker on the wrapper); never raises into the program."""
    manager = getattr(module, "GenerateManager", None)
    names = SERVE_HANDLERS + SERVE_SUBMITS
    if manager is None or not all(callable(getattr(manager, name, None)) for name in names):
        reason("request ids of transformers serve", RuntimeError(
            "this transformers version has no GenerateManager with " + ", ".join(names) +
            "; calls get generated ids"))
        return
    if _patched(manager.generate_streaming):
        return
    for name in SERVE_HANDLERS:
        setattr(manager, name, _tag(getattr(manager, name)))
    for name in SERVE_SUBMITS:
        setattr(manager, name, _in_context(getattr(manager, name)))
