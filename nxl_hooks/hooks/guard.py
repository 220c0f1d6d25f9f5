"""The probe never harms the host: a failure inside a hook stops recording for that call, is logged once as one
line on the ``nxl_hooks`` logger, and is kept as the call's reason; the model's own forward or ``generate`` goes
on unchanged. :meth:`Probe.result` and ``GenerationCall.error`` tell the user what went wrong.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
from typing import Any, Callable, Iterator

from ..arch.calls import SHORT  # the one rule for a hook called after its removal, kept here for the hooks
from ..arch.text import one_line, typed  # the one rule for a foreign message, kept here for the hooks that say it

__all__ = ["SHORT", "Notice", "Owned", "described", "inert", "logger", "one_line", "raised", "reason", "typed"]

logger = logging.getLogger("nxl_hooks")


def inert(*args: Any, **kwargs: Any) -> None:
    """A hook of the probe's in a copy of the model (:class:`Owned`): it does nothing, and is no hook of the
    probe's (:func:`~.probe.count_hooks`)."""


def _same(value: Any) -> Any:
    return value


class Owned(functools.partial):
    """``func``, a hook or wrapper the probe puts on the model, which a copy of the model does not take along:
    ``copy.deepcopy`` and pickling (``torch.save(model)``) give ``copied`` in its place (a hook: one that does
    nothing; a wrapper: what it wraps, bound to the copy), so a copy made while attached is the plain model,
    unrecorded, and copying it never meets the probe's locks and threads (it raised into the user's code). A
    partial: it calls ``func`` from C, a block's hook runs once per block and token."""

    def __new__(cls, func: Callable, copied: Callable = inert) -> "Owned":
        self = super().__new__(cls, func)
        self.copied = copied
        self.__name__ = getattr(func, "__name__", type(func).__name__)  # (recorder._always_called keys on it)
        return self

    def __deepcopy__(self, memo: dict) -> Callable:
        return copy.deepcopy(self.copied, memo)  # a method of the model being copied: the copy's (memo holds it)

    def __reduce__(self) -> tuple:
        return _same, (self.copied,)


def raised(error: BaseException, limit: int = 200) -> str:
    """``error`` as a call's reason says the host's own exception: its type, and its message on one line (cut at
    ``limit`` characters) where it has one, so the user knows why."""
    return typed(error, limit, aside=True)


def described(error: BaseException) -> str:
    """``error`` as a call keeps it when its recording stops on it: :func:`one_line`, after its type's name
    ("KeyError: 1", not a bare "1"), but for the library's own sentences (a plain RuntimeError or ValueError, or an
    error class of nxl_hooks: those say what happened and what to do) and a message-less error."""
    text = one_line(error)
    kind = type(error)
    own = kind in (RuntimeError, ValueError) or kind.__module__.split(".")[0] == __name__.split(".")[0]
    return text if own or text == kind.__name__ else f"{kind.__name__}: {text}"


#: ``on`` while this thread runs a forward whose caller raises the reason it is not recorded (:func:`told_by_caller`)
_told = threading.local()


@contextlib.contextmanager
def told_by_caller() -> Iterator[None]:
    """This thread's forwards not recorded meanwhile are said by the caller, which raises the reason
    (:func:`~nxl_hooks.explain`): not logged too, which said it twice (``nxl attribute``'s stderr had both)."""
    before = getattr(_told, "on", False)
    _told.on = True
    try:
        yield
    finally:
        _told.on = before


def reason(what: str, error: BaseException) -> str:
    """Log ``error`` (raised while ``what``) as one line, unless the caller says it (:func:`told_by_caller`), and
    return the text kept with the call."""
    if not getattr(_told, "on", False):
        logger.warning("nxl_hooks: %s not recorded (%s); the model's own call is unaffected", what, typed(error))
    return one_line(error)


class Notice:
    """How many calls (``generate`` calls, served requests) could not be recorded, in whole or from some step on,
    and the last reason (``not recorded: why; what to do``), or 0 and None: shared by the probe
    (``Probe.unrecorded``, ``Probe.unrecorded_calls``, which outlive the model) and its hooks."""

    text: str | None = None
    count = 0

    def __init__(self) -> None:
        self._lock = threading.Lock()  # calls fail in several threads; taken once per failed call, never per step

    def unrecorded(self, text: str, *, log: bool = True) -> None:
        """One more call is not recorded, because of ``text``; logged as one line unless ``log`` is False (the
        caller said it already)."""
        with self._lock:
            self.count += 1
            self.text = text
        if log:
            logger.warning("nxl_hooks: %s; the model's own call is unaffected", text)
