"""What the probe's hooks do inside a forward that ``torch.compile`` traces: nothing, unless the forward is a plain
one (outside every recorded call).

    model.forward = torch.compile(model.forward, fullgraph=True)   # after attaching
    model(**batch)
    probe.result()                     # assembled from what the traced hooks kept (TracedForward)

Compiled code runs the hooks that existed when it was traced, as part of its graph, so anything they compute or
copy becomes part of the model's compiled kernels. Inductor fuses it into the model's own kernels and tunes those
anew (their block sizes, hence the order of their sums), and on a GPU the model's bf16 output then changes in the
last place: measured on an H200 (Llama-2-7B shape, ``reduce-overhead``) with a recorder that only copied each
layer's hidden states inside the compiled decoding step, the logits differed from plain's within a few dozen
tokens and the greedy tokens parted (four designs tried, copies fused or kept apart by an opaque operator: each
changed the model's kernels; docs/benchmarks.md). So inside a recorded call the hooks do nothing at all and the
compiled code is the model's own: a ``generate`` call records the forwards that ran compiled by running the model
again eagerly over its tokens when it ends (:meth:`Run._replay <nxl_hooks.hooks.generate.Run._replay>`), and a
serving engine's taps copy each step's rows (:mod:`.engines.buffers`).

A plain forward traced by torch.compile (the user compiled the model, or its ``forward``, after attaching) is
recorded from what its traced hooks keep (:class:`TracedForward`), the hidden states as outputs of its graph. Code
compiled before the hooks existed never calls them: :func:`reset_compiled` makes a forward the user compiled in
place recompile with them (and without them at detach), at attach or (:class:`Recompiled`) at its first call.
"""

from __future__ import annotations

import copy
import functools
import threading
import types
import weakref
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from .conventions import start
from .forward import Capture
from .guard import logger

__all__ = ["Recompiled", "Traced", "TracedForward", "compiled_forward", "eager_frame", "eager_twin", "reset_compiled"]


def compiled_forward(*modules: nn.Module) -> bool:
    """Whether the user compiled one of ``modules``' forward in place (``m.forward = torch.compile(m.forward)``)."""
    return any(getattr(vars(module).get("forward"), "_torchdynamo_orig_callable", None) is not None
               for module in modules)


def _compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled: its forward compiled in place, or the module itself (``module.compile()``,
    transformers' regional compilation of its blocks)."""
    return compiled_forward(module) or getattr(module, "_compiled_call_impl", None) is not None


def eager_twin(model: nn.Module, *modules: nn.Module) -> nn.Module:
    """``model`` as it runs uncompiled, for a call of the probe's own in the calling thread: where ``model`` or one of
    ``modules`` inside it had its forward compiled in place or was compiled itself (``module.compile()``), a shallow
    copy whose copies of those run their class's forward, sharing everything else (parameters, buffers, hooks, every
    other module); ``model`` itself when none did. Other threads' calls of ``model`` are not touched (as torch's
    process-wide ``force_eager`` stance would).

        eager_twin(model, backbone, *blocks)(**inputs)     # the hooks run, not traced"""
    compiled = {id(module) for module in (model, *modules) if _compiled(module)}
    if not compiled:  # (every refill asks: no walk of the model's modules then)
        return model
    paths = [name for name, module in model.named_modules() if id(module) in compiled]

    def twin(module: nn.Module, path: str) -> nn.Module:
        made = copy.copy(module)
        if id(module) in compiled:
            vars(made).pop("forward", None)
            vars(made)["_compiled_call_impl"] = None
        vars(made)["_modules"] = {
            name: twin(child, inner) if child is not None and any(
                found == inner or found.startswith(inner + ".") for found in paths) else child
            for name, child in module._modules.items() for inner in [f"{path}.{name}" if path else name]}
        return made

    return twin(model, "")


@functools.cache
def eager_frame(function: Callable) -> None:
    """Run ``function`` (a hook of the task model) as plain Python, what it calls too, where dynamo would compile it
    as a frame of its own: a compiled ``Module.__call__`` (transformers' compiled call of ``generate``,
    ``torch.compile(model)``) runs the module's hooks from torch's eager ``_call_impl``, and dynamo compiled each
    hook with guards on the probe's state, so a later call recompiled it (raising under the ``fail_on_recompile``
    stance). Eager there, it records as around a forward compiled in place. Inlined into a traced forward, it is
    traced as before. Set at the first attach (dynamo is not imported before), once; a torch without this
    switch compiles the hook as before."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:
        return
    set_code_exec_strategy(function.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


class Traced(NamedTuple):
    """What a traced plain forward's hooks kept (:meth:`TracedForward.take`)."""

    #: None where the task model's hooks were traced and its backbone's never ran: compiled code from before the hooks
    capture: Capture | None
    output: Any  #: the task model's output as seen (its logits: None where not seen)
    arguments: dict[str, Any]  #: the backbone's arguments (:meth:`TracedForward.begin`)
    past: Any  #: the positions before its tokens
    keep: Any  #: the ``logits_to_keep`` the task model was called with, where its hooks were traced
    #: block (1-based) -> the hidden states it was called on, where they must be what the block before gave
    given: dict[int, Any]


class _Slot:
    """One thread's last traced forward. A plain object: dynamo replays a store into its attribute in the thread that
    ran the compiled code, reaching it through :class:`_Slots` then; a store into a ``threading.local``'s own
    attribute it drops silently."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] | None = None  # input_ids, attention_mask, embed, hidden {layer: h}, last, logits...


class _Slots(threading.local):
    def __init__(self) -> None:
        self.slot = _Slot()


class TracedForward:
    """A plain forward (not a step of a recorded call) traced by torch.compile: its hooks keep what they saw here,
    a side effect dynamo replays after the compiled code ran (the hidden states are outputs of the graph), and the
    probe assembles its attribution from it eagerly: when the task model's own hook runs outside the compiled code
    (``model.forward = torch.compile(model.forward)``, ``torch.compile(model)``: :func:`eager_frame`), else
    when :meth:`~nxl_hooks.Probe.result` is read, or the probe detaches, in that thread (a function of the user's
    that calls the model, compiled: the task model's hooks traced too). The last traced forward of each thread is
    kept, as each thread's result is its own."""

    def __init__(self, norms: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._norms = norms  # the embedding norms of the rows kept, taken in take(), outside the graph
        self._slots = _Slots()

    def task(self, keep: Any) -> None:
        """The task model's forward starts, traced, called with ``logits_to_keep`` ``keep``: what its backbone's
        hooks keep follows (if they run at all)."""
        self._slots.slot.seen = {"hidden": {}, "keep": keep}

    def begin(self, arguments: dict[str, Any]) -> None:
        """The backbone's forward starts, traced with ``arguments``: kept whole, with the positions before its tokens
        as the forward says them now (a cache has grown by the time it is assembled), for the checks an eager
        forward has at its start (a KV cache it continues, packed rows, an engine's own forward), made in take()'s
        caller, outside the graph."""
        seen = self._slots.slot.seen
        # the task model's logits_to_keep where its start was traced too (not an earlier forward's, never taken)
        keep = seen.get("keep") if seen is not None and "input_ids" not in seen else None
        self._slots.slot.seen = {
            "input_ids": arguments.get("input_ids"), "inputs_embeds": arguments.get("inputs_embeds"),
            "attention_mask": arguments.get("attention_mask"), "hidden": {}, "given": {}, "arguments": arguments,
            "past": start(arguments)[0], "keep": keep}

    def keep(self, name: str, value: Any) -> None:
        seen = self._slots.slot.seen
        if seen is not None:
            seen[name] = value

    def layer(self, layer: int, hidden: torch.Tensor) -> None:
        seen = self._slots.slot.seen
        if seen is not None:
            seen["hidden"][layer] = hidden.detach()

    def given(self, block: int, hidden: Any) -> None:
        """Block ``block`` (1-based) was called on ``hidden``: checked against what the probe kept as the block
        before's output when the forward is assembled, outside the graph (:class:`Traced`)."""
        seen = self._slots.slot.seen
        if seen is not None and "given" in seen:
            seen["given"][block] = hidden

    def discard(self) -> None:
        """A later forward of this thread ran eagerly: it, not the traced one kept, is the thread's last."""
        self._slots.slot.seen = None

    def take(self) -> Traced | None:
        """This thread's last traced forward (:class:`Traced`), once; None when no forward was traced since."""
        slot = self._slots.slot
        seen, slot.seen = slot.seen, None
        if seen is None:
            return None
        if "input_ids" not in seen:
            return Traced(None, None, {}, None, seen.get("keep"), {})
        ids = seen["input_ids"]
        reference = ids if ids is not None else seen["inputs_embeds"]
        rows = seen.get("embed")  # the embedding's rows
        capture = Capture(input_ids=ids, attention_mask=seen["attention_mask"],
                          shape=(int(reference.shape[0]), int(reference.shape[1])),
                          embed_norm=self._norms(rows, seen.get("embed_ids")) if rows is not None else None,
                          hidden=seen["hidden"], last_hidden=seen.get("last"))
        return Traced(capture, types.SimpleNamespace(logits=seen.get("logits")), seen["arguments"], seen["past"],
                      seen["keep"], seen["given"])


class Recompiled:
    """Forwards compiled in place while attached (``model.forward = torch.compile(model.forward)``), each made to
    recompile once with the hooks, at its first call: dynamo does not guard on a module's hooks, so it would reuse
    code of the class's forward compiled before they existed (another instance of the class, or this one compiled
    before and uncompiled again), which never calls them. Asked by the module's own pre-hook, which runs outside
    its compiled forward. (transformers' own compiled call of ``generate`` shares that code: it recompiles once then,
    as it would for the user's new compile anyway.)"""

    def __init__(self) -> None:
        self._done: weakref.WeakSet = weakref.WeakSet()

    def check(self, module: nn.Module) -> None:
        """Never raises: a forward not recompiled runs without the hooks, and the result says so."""
        if "forward" not in vars(module):  # (the task model's and the backbone's every forward asks)
            return
        try:
            if compiled_forward(module) and (forward := vars(module)["forward"]) not in self._done:
                self._done.add(forward)
                reset_compiled(module)
        except Exception:  # noqa: BLE001 - never into the host's forward
            pass


#: torch.compiler stances under which dropping compiled code breaks the model: its next call raises, or runs
#: eagerly from then on (also after detach)
_NO_RECOMPILE = ("fail_on_recompile", "eager_on_recompile")


def reset_compiled(*modules: nn.Module, detaching: bool = False) -> None:
    """Drop the code dynamo compiled for the forwards of ``modules`` that the user compiled in place
    (``m.forward = torch.compile(m.forward)``): code compiled before the hooks existed never calls them, and code
    compiled while attached keeps calling them after detach. The next call recompiles (once), with the hooks
    there are then. Other instances of the same class share that code and recompile too. Not under a stance that
    forbids recompiling (:data:`_NO_RECOMPILE`): the code stays, said in one line."""
    for module in modules:
        original = getattr(vars(module).get("forward"), "_torchdynamo_orig_callable", None)
        code = getattr(getattr(original, "__func__", original), "__code__", None)
        if code is None:
            continue
        # (torch keeps the stance private; one without it has no stance that forbids recompiling)
        stance = getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", None)
        if stance in _NO_RECOMPILE:  # its code stays: said, with what that code does then
            does = ("holds the detached probe's hooks if it was compiled while attached (they record nothing)"
                    if detaching else "never reaches the probe's hooks: its forwards are not recorded")
            logger.warning("nxl_hooks: %s.forward, compiled in place, keeps its compiled code under torch.compiler's "
                           "stance %r, which forbids recompiling it, so it %s; attach and detach under the default "
                           "stance", type(module).__name__, stance, does)
            continue
        torch._dynamo.reset_code(code)
