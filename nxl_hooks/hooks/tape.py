"""The graph-safe recorder: what the probe's hooks do inside a forward that ``torch.compile`` traces.

    tape.arm(batch=2, capacity=64, device=device)   # before the compiled forwards of a call, on the host
    ... compiled forwards: the hooks write into the tape (traced into the compiled graph)
    end = tape.written()                            # one host read, when the call ends

Compiled code runs the hooks that existed when it was traced, as part of its graph: there the hooks may not read
the device, branch on a tensor's value, take a lock or look up per-thread state. So under tracing
(``torch.compiler.is_compiling()``, a constant for dynamo) they write into a :class:`Tape` instead of feeding the
call's :class:`~nxl_hooks.hooks.generate.Run`: fixed device buffers, allocated when a call is armed, indexed by the
forward's positions (a device tensor: ``cache_position`` or the static cache's own length), written with
``index_copy_``; no host read, no branch on values, no allocation that depends on a value. Per forward it keeps each
selected layer's hidden states and the embedding rows as the model made them, which tokens are real, and the
model's log-probability of the token this forward was fed (the one the previous forward predicted: its logits are
kept in the tape by the task model's hook). When the call returns, the run reads how far the tape was written (one
read), takes the head features (final norm included) and the embedding norms of all positions at once, and scores
the compiled steps exactly as the eager hooks would have (:meth:`Run.finish
<nxl_hooks.hooks.generate.Run.finish>`), so both paths make the same records; the step records of a compiled call
are published when it returns.

Only copies run inside the graph, never a norm: inductor merges a norm of the probe's with the model's own norm of
the same hidden states (the next block's input norm: the same reduction) into other fused kernels, whose bf16
arithmetic then differs from the model's alone. Measured on an H200 (Llama-2-7B shape, bf16, ``reduce-overhead``)
with the norms in the graph: the recorded call's logits differed from plain's by up to 0.13 and its greedy tokens
parted at step 46, while plain repeated itself to the bit.

The buffers are marked static addresses (as transformers' static cache is), so ``mode="reduce-overhead"`` keeps its
CUDA graphs, which replay the writes. They are kept while attached, for the next call of the same shape (a new
shape would recompile), and freed at detach.

The tape accumulates one call's positions across its forwards and is read once, when the call ends. Serving engines,
which map each step's packed tokens to requests on the host between steps, write a per-step scratch instead
(:class:`~nxl_hooks.hooks.engines.buffers.Buffers`) and read it after every step.

:class:`CompiledCalls` makes transformers' own compiled ``generate`` trace the hooks: compiled code already cached
for the model (before :func:`~nxl_hooks.attach`) does not call hooks added later, and dynamo does not guard on
hooks, so while attached the model's compiled call is a fresh one (its own code object, so no cached code is
reused) and at detach the model gets its own back.
"""

from __future__ import annotations

import functools
import itertools
import types
import weakref
from typing import Any, Callable

import torch
from torch import nn

from .conventions import seen_keys, start
from .forward import Capture, embedding_norms, head_features
from .plan import Plan

__all__ = ["CompiledCalls", "Tape", "TracedForward", "compiled_forward", "reset_compiled"]


def compiled_forward(*modules: nn.Module) -> bool:
    """Whether the user compiled one of ``modules``' forward in place (``m.forward = torch.compile(m.forward)``):
    then every forward of a call is traced, the prefill included."""
    return any(getattr(vars(module).get("forward"), "_torchdynamo_orig_callable", None) is not None
               for module in modules)


class Tape:
    """The fixed buffers compiled forwards of one model write into (one armed call at a time: transformers' static
    cache, which the compiled forwards write, is shared by the model's calls too)."""

    def __init__(self, plan: Plan, *, device: torch.device | None) -> None:
        self._plan = plan
        self._device = device
        self._slots = {layer: slot for slot, layer in enumerate(plan.layers)}
        #: A Python bool dynamo guards on: a forward traced while it is False writes nothing, and arming recompiles
        #: it once with the writes.
        self.armed = False
        self.capacity = 0
        self.hidden: list[torch.Tensor] = []  # per selected layer: (batch, capacity, d), as the model made them
        self.rows = self.mask = self.log_prob = self.logits = self.end = None  # rows: the embedding's
        self.pos: torch.Tensor | None = None  # the positions of the forward being traced (set by begin)

    def arm(self, *, batch: int, capacity: int, k: int, device: torch.device) -> None:
        """Make room for ``capacity`` positions of ``batch`` rows (``k`` explained targets per step) and record
        from now on; buffers of the same shape are reused (no recompile)."""
        device = self._device or device
        shape = (batch, capacity, k, device)
        if self.end is None or shape != self._shape:
            self._allocate(batch, capacity, k, device)
            self._shape = shape
        self.end.zero_()
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def free(self) -> None:
        """Drop the buffers (detach): compiled code traced with them is dropped with the model's compiled call."""
        self.armed = False
        self.hidden, self.rows, self.mask, self.log_prob, self.logits, self.end = [], None, None, None, None, None

    def _allocate(self, batch: int, capacity: int, k: int, device: torch.device) -> None:
        plan = self._plan
        dtype, width = next(plan.model.parameters()).dtype, plan.model.config.hidden_size
        self.hidden = [torch.zeros(batch, capacity, width, dtype=dtype, device=device) for _ in plan.layers]
        self.rows = torch.zeros(batch, capacity, width, dtype=dtype, device=device)
        self.mask = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.log_prob = torch.zeros(batch, capacity, k, dtype=torch.float32, device=device)
        self.logits = torch.zeros(batch, plan.head.n_outputs, dtype=torch.float32, device=device)
        self.end = torch.zeros((), dtype=torch.long, device=device)
        self.capacity = capacity
        for buffer in (*self.hidden, self.rows, self.mask, self.log_prob, self.logits, self.end):
            torch._dynamo.mark_static_address(buffer)

    # -- traced: called by the probe's hooks under torch.compile -----------------------------------------

    def begin(self, arguments: dict[str, Any]) -> None:
        """A backbone forward starts: its positions (kept for the other hooks), how far the tape is written, which
        of its tokens are real, and the log-probability the previous forward gave the token this one was fed."""
        past, new = start(arguments)
        ids = arguments.get("input_ids")
        device = self.end.device
        past = past if past is not None else 0
        positions = torch.arange(new, device=device) + (past.to(device) if isinstance(past, torch.Tensor) else past)
        self.end.copy_(positions[-1] + 1)  # unclamped: a call that ran past the capacity is told apart
        self.pos = positions.clamp(max=self.capacity - 1)
        mask = arguments.get("attention_mask")
        real = torch.ones(self.mask.shape[0], new, dtype=torch.bool, device=device)
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            real = mask[:, -new:].to(device=device, dtype=torch.bool)
        elif isinstance(mask, torch.Tensor) and mask.dim() == 4:  # (batch, 1, queries, keys): the last query's row
            real = seen_keys(mask[:, 0, -1].to(device).index_select(-1, self.pos))
        self.mask.index_copy_(1, self.pos, real)
        if ids is not None:
            targets = self._plan.explained(ids[:, :1].to(device))
            fed = self.logits.log_softmax(-1).gather(-1, targets)
            # The first forward of a call has no previous one: it writes position 0, which a later forward of a
            # one-token prompt overwrites and which is otherwise a prompt position, never read as a step's.
            self.log_prob.index_copy_(1, (self.pos[:1] - 1).clamp(min=0), fed[:, None])

    def embedding(self, rows: torch.Tensor) -> None:
        """The embedding rows of the forward's tokens, (batch, new, d): what the embedding norm is taken of."""
        self.rows.index_copy_(1, self.pos, rows.detach().to(device=self.rows.device, dtype=self.rows.dtype))

    def layer(self, layer: int, hidden: torch.Tensor) -> None:
        """Layer ``layer``'s hidden states (batch, new, d)."""
        buffer = self.hidden[self._slots[layer]]
        buffer.index_copy_(1, self.pos, hidden.detach().to(device=buffer.device, dtype=buffer.dtype))

    def task_output(self, output: Any) -> None:
        """The task model returned: its last position's logits, for the next forward's log-probability (also
        called by the eager hooks while the tape is armed, so a prefill that runs eagerly hands them on)."""
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.shape[-1] == self.logits.shape[-1]:
            self.logits.copy_(logits[:, -1].to(device=self.logits.device, dtype=torch.float32))

    # -- read on the host, when the call ends ------------------------------------------------------------

    def written(self) -> int:
        """One past the last position a compiled forward wrote (0: none): one read of the device."""
        return int(self.end)

    def positions(self, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(head features (batch, n, layers, d'), embedding norms (batch, n), mask (batch, n)) of positions
        first..end-1."""
        with torch.no_grad():
            return (head_features(self._plan, self.hidden, first, end),
                    embedding_norms(self._plan, self.rows[:, first:end]), self.mask[:, first:end])


class TracedForward:
    """A plain forward (not a step of a recorded call) traced by torch.compile: its hooks keep what they saw here,
    a side effect dynamo replays after the compiled code ran (the hidden states are outputs of the graph), and the
    probe assembles its attribution from it eagerly: when the task model's own hook runs outside the compiled code
    (``model.forward = torch.compile(model.forward)``), else when :meth:`~nxl_hooks.Probe.result` is read
    (``torch.compile(model)``). Only the last traced forward is kept, not per thread."""

    def __init__(self, norms: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._norms = norms  # the embedding norms of the rows kept, taken in take(), outside the graph
        self.seen: dict[str, Any] | None = None  # input_ids, attention_mask, embed, hidden {layer: h}, last, logits

    def task(self) -> None:
        """The task model's forward starts, traced: what its backbone's hooks keep follows (if they run at all)."""
        self.seen = {"hidden": {}}

    def begin(self, arguments: dict[str, Any]) -> None:
        self.seen = {"input_ids": arguments.get("input_ids"), "inputs_embeds": arguments.get("inputs_embeds"),
                     "attention_mask": arguments.get("attention_mask"), "hidden": {}}

    def keep(self, name: str, value: Any) -> None:
        if self.seen is not None:
            self.seen[name] = value

    def layer(self, layer: int, hidden: torch.Tensor) -> None:
        if self.seen is not None:
            self.seen["hidden"][layer] = hidden.detach()

    def take(self) -> tuple[Capture | None, Any] | None:
        """The last traced forward's capture (None: the task model's hooks were traced, its backbone's never ran:
        compiled code from before the hooks) and the task model's output (its logits: None when not seen), once;
        None when no forward was traced since."""
        seen, self.seen = self.seen, None
        if seen is None:
            return None
        if "input_ids" not in seen:
            return None, None
        ids = seen["input_ids"]
        reference = ids if ids is not None else seen["inputs_embeds"]
        rows = seen.get("embed")  # the embedding's rows
        capture = Capture(input_ids=ids, attention_mask=seen["attention_mask"],
                          shape=(int(reference.shape[0]), int(reference.shape[1])),
                          embed_norm=self._norms(rows) if rows is not None else None,
                          hidden=seen["hidden"], last_hidden=seen.get("last"))
        return capture, types.SimpleNamespace(logits=seen.get("logits"))


def reset_compiled(*modules: nn.Module) -> None:
    """Drop the code dynamo compiled for the forwards of ``modules`` that the user compiled in place
    (``m.forward = torch.compile(m.forward)``): code compiled before the hooks existed never calls them, and code
    compiled while attached keeps calling them after detach. The next call recompiles (once), with the hooks
    there are then. Other instances of the same class share that code and recompile too."""
    for module in modules:
        original = getattr(vars(module).get("forward"), "_torchdynamo_orig_callable", None)
        code = getattr(getattr(original, "__func__", original), "__code__", None)
        if code is not None:
            torch._dynamo.reset_code(code)


class CompiledCalls:
    """While attached, transformers' ``generate`` compiles a fresh call of the model that traces the probe's hooks;
    :meth:`restore` gives the model its own compiled call back (detach)."""

    _fresh = itertools.count()

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._kept = {name: vars(model)[name] for name in ("get_compiled_call", "_compiled_call",
                                                             "_last_compile_config") if name in vars(model)}
        self._compiled: tuple[Any, Callable] | None = None
        original = model.get_compiled_call

        @functools.wraps(original)
        def get_compiled_call(compile_config: Any = None) -> Callable:
            return self._get(compile_config)

        model.get_compiled_call = get_compiled_call

    def _get(self, compile_config: Any) -> Callable:
        model = self._model()
        config = compile_config or getattr(model.generation_config, "compile_config", None) \
            or model._default_compile_config()
        if self._compiled is None or self._compiled[0] != config:
            self._compiled = (config, torch.compile(_fresh_call(model, next(self._fresh)), **config.to_dict()))
        return self._compiled[1]

    def restore(self) -> None:
        model = self._model()
        self._compiled = None
        if model is None:
            return
        for name in ("get_compiled_call", "_compiled_call", "_last_compile_config"):
            vars(model).pop(name, None)
        vars(model).update(self._kept)


def _fresh_call(model: nn.Module, n: int) -> Callable:
    """``model.__call__`` as a function with a code object of its own: dynamo keeps compiled code per code object
    and does not guard on hooks, so code compiled for ``model.__call__`` before the hooks existed is never reused."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    code = call.__code__.replace(co_name=f"nxl_hooks_call_{n}")
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)
