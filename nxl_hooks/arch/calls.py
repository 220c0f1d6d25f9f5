"""How PyTorch calls a ``with_kwargs`` hook that is removed while a forward runs: the lowest layer, so every layer
that puts such hooks on a user's model (the registry oracle's counters, the probe's hooks) takes that call by one
rule.

    def hook(module, args, kwargs, output=SHORT):
        if output is SHORT:  # called after its removal
            return
"""

from __future__ import annotations

from typing import Any

__all__ = ["SHORT"]

#: The default of a ``with_kwargs`` hook's last parameter (a pre-hook's ``kwargs``, a forward hook's ``output``),
#: which finds it there only when PyTorch called the hook the short way: ``_call_impl`` takes its list of hooks, then
#: asks per hook whether it takes kwargs, and a hook removed in between (a detach in another thread, or by a hook of
#: the user's earlier on the module) is called as ``hook(module, args)`` or ``hook(module, args, output)``. Such a
#: hook does nothing and returns None: the forward runs on unrecorded, as after the detach (a parameter without a
#: default raised TypeError into the user's call). A default, not a wrapper: a block's hook runs per block and token.
SHORT: Any = object()
