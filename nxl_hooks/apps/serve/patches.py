"""What the bootstrap changes in transformers, as each module is first imported (:mod:`.lazy`).

- ``transformers.modeling_utils``: ``PreTrainedModel.from_pretrained`` hands every model it returns to the
  process's :class:`~nxl_hooks.apps.serve.controller.Controller` (only the outermost call, when loads nest).
- ``transformers.cli.serving.utils``: ``transformers serve`` without continuous batching runs ``model.generate``
  on its inference thread and does not pass the request id along. ``GenerateManager.generate_streaming`` /
  ``generate_non_streaming`` now set :data:`~nxl_hooks.hooks.generate.REQUEST_ID` to the request's id (the
  ``X-Request-ID`` header, or the uuid serve made), and what they submit to the inference thread runs in a copy of
  that context, so the ``generate`` call of the request carries its id. (Under continuous batching the manager
  has the id itself: ``add_request(..., request_id=...)``.)

Each patch is applied once (a marker on the wrapper), keeps the original's name and signature, and never raises
into the program: a failure inside a wrapper is logged as one line and the original runs on.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import threading
from types import ModuleType
from typing import Any, Callable

from ...hooks.generate import REQUEST_ID
from ...hooks.guard import reason
from .controller import controller

__all__ = ["patch_modeling_utils", "patch_serving"]

_MARK = "__nxl_patched__"
_loading = threading.local()  # depth of from_pretrained calls in this thread


def _patched(function: Any) -> bool:
    return getattr(function, _MARK, False)


def patch_modeling_utils(module: ModuleType) -> None:
    """Wrap ``PreTrainedModel.from_pretrained``: every model it returns is adopted by the controller."""
    cls = module.PreTrainedModel
    original = cls.__dict__["from_pretrained"].__func__
    if _patched(original):
        return

    @functools.wraps(original)
    def from_pretrained(klass: type, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_loading, "depth", 0)
        if depth == 0:
            kwargs = _with_defaults(args, kwargs)
        _loading.depth = depth + 1
        try:
            model = original(klass, *args, **kwargs)
        finally:
            _loading.depth = depth
        if depth == 0:  # a model class loading its parts calls from_pretrained again: adopt the whole only
            name = args[0] if args else kwargs.get("pretrained_model_name_or_path", "")
            _adopt(model, str(name))
        return model

    setattr(from_pretrained, _MARK, True)
    cls.from_pretrained = classmethod(from_pretrained)


def _with_defaults(args: tuple, kwargs: dict) -> dict:
    """``kwargs`` plus the loading options of ``nxl run`` (--dtype, --load-in-8bit...) the program did not set
    itself, for the models ``--models`` selects."""
    try:
        settings = controller().settings
    except Exception:  # noqa: BLE001 - bad NXL_* settings: _adopt says so, once
        return kwargs
    name = str(args[0] if args else kwargs.get("pretrained_model_name_or_path", ""))
    if not settings.load or not settings.selects(name):
        return kwargs
    try:
        from ..loading import program_defaults

        return {**program_defaults(settings.load), **kwargs}
    except Exception as error:  # noqa: BLE001 - the program loads as it asked
        reason("the loading options of nxl run", error)
        return kwargs


def _adopt(model: Any, name: str) -> None:
    try:
        controller().adopt(model, name)
    except Exception as error:  # noqa: BLE001 - bad NXL_* settings: the program runs unrecorded
        reason(f"model {name}", error)


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
    """Carry each request's id from ``transformers serve``'s handler to the ``generate`` call that serves it."""
    manager = getattr(module, "GenerateManager", None)
    names = ("generate_streaming", "generate_non_streaming", "submit", "async_submit")
    if manager is None or not all(callable(getattr(manager, name, None)) for name in names):
        reason("request ids of transformers serve", RuntimeError(
            "this transformers version has no GenerateManager with " + ", ".join(names) +
            "; calls get generated ids"))
        return
    if _patched(manager.generate_streaming):
        return
    for name in ("generate_streaming", "generate_non_streaming"):
        setattr(manager, name, _tag(getattr(manager, name)))
    for name in ("submit", "async_submit"):
        setattr(manager, name, _in_context(getattr(manager, name)))
