"""How calls are made across the package's seams, by one rule each, in the lowest layer: how PyTorch calls a
``with_kwargs`` hook that is removed while a forward runs (every layer that puts such hooks on a user's model, the
registry oracle's counters and the probe's hooks, takes that call alike), and whether a plugin's callable can take
the call it is registered for (:func:`unbound`: a sink's factory, a method's ``score``).

    def hook(module, args, kwargs, output=SHORT):
        if output is SHORT:  # called after its removal
            return
    why = unbound(method.score, given)      # None, or the TypeError's message on one line
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from .text import one_line

__all__ = ["SHORT", "unbound"]

#: The default of a ``with_kwargs`` hook's last parameter (a pre-hook's ``kwargs``, a forward hook's ``output``),
#: which finds it there only when PyTorch called the hook the short way: ``_call_impl`` takes its list of hooks, then
#: asks per hook whether it takes kwargs, and a hook removed in between (a detach in another thread, or by a hook of
#: the user's earlier on the module) is called as ``hook(module, args)`` or ``hook(module, args, output)``. Such a
#: hook does nothing and returns None: the forward runs on unrecorded, as after the detach (a parameter without a
#: default raised TypeError into the user's call). A default, not a wrapper: a block's hook runs per block and token.
SHORT: Any = object()


def unbound(function: Callable, /, *args: Any, **kwargs: Any) -> str | None:
    """Why ``function`` cannot be called with ``args`` and ``kwargs`` (the TypeError's message, on one line), checked
    against its signature without calling it; None where it can, or where its signature cannot be read (a builtin or
    C callable, taken as it is). Checked when a plugin's callable is registered or configured: its TypeError, raised
    only when called, would name neither the plugin nor what it must take."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        return one_line(error)
    return None
