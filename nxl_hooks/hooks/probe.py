"""Forward hooks on a live model: :func:`attach` puts them on, :meth:`Probe.detach` takes them off.

    with nxl.attach(model, layers="all") as probe:
        model(**enc)                    # your own call, unchanged
    probe.result().normxlogit           # (layers, rows, seq)

Hooks sit on the task model, its backbone (``model.base_model``, or the spec's ``backbone``), its blocks and, for
``embedding="word"``, the input embedding; ``generate`` gets a thin wrapper (:mod:`.generate`). Nothing else on the
model is touched, and detaching (the end of the ``with`` block, also when the user's code raised; or the probe being
garbage-collected; or :func:`detach_all`) removes every one of them.

The hooks never raise into the model's forward or ``generate`` (:mod:`.guard`): what they could not record, they
say in :meth:`Probe.result` and ``GenerationCall.error``. The state of each call lives with the thread that makes
it, so forwards and ``generate`` calls in several threads on one attached model are recorded separately.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..arch.registry import get_path, unwrap
from ..method.placement import input_device
from ..method.select import Target
from ..records.attribution import Attribution
from ..records.sink import Sink
from ..records.steps import GenerationCall, Step
from .forward import Capture, assemble, open_capture
from .generate import Generations
from .guard import reason
from .plan import Plan, check_recording, make_plan, run_eagerly
from .publish import Hub, Subscription

__all__ = ["Probe", "attach", "detach_all", "explain"]

_LOCK = threading.Lock()
#: backbone -> the finalizer that detaches the probe on it: one probe per model at a time.
_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, weakref.finalize]" = weakref.WeakKeyDictionary()
_PENDING = object()  # a task forward whose blocks have not run (eagerly) yet
_RAN = object()  # a task forward whose blocks ran, whose backbone has not finished yet


def _hidden(output: Any) -> torch.Tensor:
    # Most transformers v5 blocks return a tensor; Falcon, Bloom, MPT, GPT-J, DeBERTa-v2 return tuples.
    return output[0] if isinstance(output, (tuple, list)) else output


def _without_traceback(error: BaseException) -> BaseException:
    # Kept for result(): a traceback would keep every tensor of the failed forward's frames alive.
    return error.with_traceback(None)


class _Recorder:
    """The hooks, and the per-thread state of the calls they record. The model holds it (through its hooks), never
    the :class:`Probe`, so a probe dropped without detaching is collected and its finalizer removes the hooks."""

    def __init__(self, plan: Plan, backbone: nn.Module, gens: Generations | None) -> None:
        self.plan, self.backbone, self.gens = plan, backbone, gens
        self._signature = inspect.signature(backbone.forward)
        self._local = threading.local()
        # Layers whose features a hook computes; the last block is hooked in any case, for final logits.
        self._wanted = set(plan.layers)

    # -- per-thread state --------------------------------------------------------------------------------

    def _stacks(self) -> tuple[list, list]:
        local = self._local
        if not hasattr(local, "captures"):
            local.captures, local.tasks, local.last = [], [], None
        return local.captures, local.tasks

    def last(self) -> Attribution | BaseException | None:
        return getattr(self._local, "last", None)

    def _run(self) -> Any:
        return self.gens.current() if self.gens is not None else None

    def _fail(self, what: str, error: BaseException) -> None:
        """This thread's current capture failed: nothing more is recorded for its call."""
        captures, _ = self._stacks()
        if captures:
            captures[-1] = None
        run = self._run()
        if run is not None and run is not Generations.UNRECORDED:
            run.fail(what, error)
        else:
            reason(what, error)
            self._local.last = _without_traceback(error)

    def _current(self) -> Capture | None:
        captures, _ = self._stacks()
        return captures[-1] if captures else None

    # -- hooks -------------------------------------------------------------------------------------------

    def register(self) -> list[torch.utils.hooks.RemovableHandle]:
        plan, handles = self.plan, []
        try:
            handles.append(plan.model.register_forward_pre_hook(self.on_task_start))
            handles.append(plan.model.register_forward_hook(self.on_task_end, always_call=True))
            handles.append(self.backbone.register_forward_pre_hook(self.on_backbone_start, with_kwargs=True))
            handles.append(self.backbone.register_forward_hook(self.on_backbone_end, always_call=True))
            handles.append(plan.blocks[0].register_forward_pre_hook(self.on_block_input, with_kwargs=True))
            for index, block in enumerate(plan.blocks, start=1):
                if index in self._wanted or index == plan.n_blocks:
                    handles.append(block.register_forward_hook(self._block_hook(index)))
            if plan.embedding == "word":
                handles.append(plan.model.get_input_embeddings().register_forward_hook(self.on_word_embedding))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def on_task_start(self, module: nn.Module, args: tuple) -> None:
        _, tasks = self._stacks()
        tasks.append(None if self._run() is not None else _PENDING)

    def on_task_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        _, tasks = self._stacks()
        entry = tasks.pop() if tasks else None
        if isinstance(entry, Capture):
            self._finish(entry, output)
        elif entry is _PENDING and output is not None:  # its hooks ran, those of its blocks did not: compiled code
            self._local.last = RuntimeError(
                f"{type(self.plan.model).__name__} ran, but its blocks never reached the probe's hooks: the call ran "
                "code compiled by torch.compile, which skips hooks added after it was compiled (or traces them). "
                "Attach to the compiled model itself (nxl.attach(compiled) runs it eagerly while attached), call the "
                "uncompiled module, or run the call under `with torch.compiler.set_stance('force_eager'):`")

    def on_backbone_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        captures, _ = self._stacks()
        run = self._run()
        if run is Generations.UNRECORDED or getattr(run, "failed", False):
            captures.append(None)
            return
        captures.append(None)  # replaced below once the inputs are known; a failure leaves it None
        try:
            bound = self._signature.bind_partial(*args, **kwargs).arguments
            capture = open_capture(bound)
            if run is not None:
                run.before_forward(bound)
            captures[-1] = capture
        except Exception as error:  # noqa: BLE001 - never into the host's forward
            self._fail("this forward", error)

    def on_block_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        captures, tasks = self._stacks()
        if tasks and tasks[-1] is _PENDING:
            tasks[-1] = _RAN
        if not captures:
            self._local.last = _without_traceback(RuntimeError(
                f"{type(self.plan.model).__name__} ran its blocks without calling "
                f"{type(self.backbone).__name__}.forward, so nxl_hooks saw no input_ids: set `backbone` (the module "
                f"that takes input_ids and runs the blocks) in the registry entry for "
                f"{self.plan.model.config.model_type!r}"))
            return
        capture = captures[-1]
        if capture is None:
            return
        try:
            hidden = (args[0] if args else kwargs["hidden_states"]).detach()
            with torch.no_grad():
                if self.plan.embedding == "layer_input":
                    capture.embed_norm = hidden.float().norm(dim=-1)
                if 0 in self._wanted:
                    capture.hidden[0] = hidden
        except Exception as error:  # noqa: BLE001
            self._fail("this forward", error)

    def on_word_embedding(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        capture = self._current()
        if capture is None:  # the embedding called on its own, outside a forward of the model
            return
        try:
            # Gemma-style scaled embeddings multiply inside the module; the paper's norm is of the raw row.
            scale = getattr(module, "embed_scale", None)
            rows = output.detach().float()
            if scale is not None:
                rows = rows / scale.to(rows.device).float()
            capture.embed_norm = rows.norm(dim=-1)
        except Exception as error:  # noqa: BLE001
            self._fail("this forward", error)

    def _block_hook(self, index: int) -> Callable:
        wanted = index in self._wanted

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            capture = self._current()
            if capture is None:
                return
            try:
                hidden = _hidden(output).detach()
                if index == self.plan.n_blocks:
                    capture.last_hidden = hidden
                if wanted:
                    capture.hidden[index] = hidden
            except Exception as error:  # noqa: BLE001
                self._fail("this forward", error)

        return hook

    def on_backbone_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        captures, tasks = self._stacks()
        capture = captures.pop() if captures else None
        if capture is None:
            return
        run = self._run()
        if output is None:  # the model's own forward raised (an always_call hook): nothing to record
            if run is None:
                self._local.last = RuntimeError("the last forward raised inside the model, so nothing was recorded")
            return
        if run is not None:
            try:
                with torch.no_grad():
                    run.after_forward(capture)
            except Exception as error:  # noqa: BLE001
                run.fail("this generate call", error)
        elif tasks and tasks[-1] is _RAN:
            tasks[-1] = capture  # assembled when the task model returns, with its own logits
        else:
            self._finish(capture, None)

    def _finish(self, capture: Capture, output: Any) -> None:
        if output is None:
            self._local.last = RuntimeError("the last forward raised inside the model, so nothing was recorded")
            return
        try:
            with torch.no_grad():
                self._local.last = assemble(self.plan, capture, output)
        except Exception as error:  # noqa: BLE001
            self._fail("this forward", error)


def _detach(handles: list, gens_ref: weakref.ref, hub: Hub, backbone_ref: weakref.ref,
            restore_compiled: Callable[[], None]) -> None:
    """Everything :class:`Probe` put on the model comes off. Holds no strong reference to the model (finalizers
    live in a global registry): a model that its program drops is freed, probe and all."""
    try:
        restore_compiled()
        for handle in handles:
            handle.remove()
        handles.clear()
        gens = gens_ref()
        if gens is not None:
            gens.uninstall()
    finally:
        backbone = backbone_ref()
        with _LOCK:
            if backbone is not None:
                _ATTACHED.pop(backbone, None)
        hub.close()  # may log a failing sink: the model is free all the same


class Probe:
    """Hooks of one :func:`attach` call. ``with nxl.attach(model) as probe: model(**enc)``, then ``probe.result()``.

    Made by :func:`attach`; ``detach`` runs when the probe detaches or is garbage-collected, whichever comes first.
    """

    def __init__(self, plan: Plan, recorder: _Recorder, hub: Hub, detach: Callable[[], None]) -> None:
        self.plan = plan
        self._recorder, self._hub = recorder, hub
        self._finalizer = weakref.finalize(self, detach)

    # -- what the probe explains -------------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The transformers task model the hooks are on (inside a PeftModel, its base model)."""
        return self.plan.model

    @property
    def kind(self) -> str:
        """causal_lm, sequence_classification, regression or masked_lm."""
        return self.plan.kind

    @property
    def layers(self) -> list[int]:
        return list(self.plan.layers)

    @property
    def n_blocks(self) -> int:
        return self.plan.n_blocks

    def describe(self) -> dict[str, Any]:
        """What a saved result records about the model and the probe: ``probe.describe()["head_kind"]``."""
        return self.plan.describe()

    # -- attach / detach ---------------------------------------------------------------------------------

    def detach(self) -> None:
        """Remove every hook of this probe; the model is as it was before :func:`attach`. Calls still running in
        other threads go on unharmed, and their records end incomplete."""
        self._finalizer()

    @property
    def attached(self) -> bool:
        """True until :meth:`detach` (or the end of the ``with`` block)."""
        return self._finalizer.alive

    def __enter__(self) -> "Probe":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- results -----------------------------------------------------------------------------------------

    def result(self) -> Attribution:
        """The attribution of the last forward this thread ran while attached.

        Raises the reason when that forward could not be recorded (an empty input, a target that does not fit...).
        """
        last = self._recorder.last()
        if last is None:
            raise RuntimeError("no forward has run under this probe yet (in this thread): call the model inside "
                               "the `with` block (a model compiled by torch.compile after attach skips the hooks: "
                               "attach to the compiled model instead)")
        if isinstance(last, BaseException):
            raise last
        return last

    @property
    def calls(self) -> list[GenerationCall]:
        """The ``generate`` calls run while attached, in the order they started, each with its step records
        (the last ``keep_calls`` of them)."""
        return self._hub.calls

    @property
    def steps(self) -> list[Step]:
        """The step records of the last ``generate`` call (one per emitted token); earlier calls: :attr:`calls`."""
        calls = self.calls
        if not calls:
            raise RuntimeError(
                "no generate() call has run under this probe: call model.generate(...) inside the `with` block "
                "(for a plain forward, use probe.result())"
            )
        last = calls[-1]
        if last.error is not None and not last.steps:
            raise RuntimeError(f"the last generate() call was not recorded: {last.error}")
        return last.steps

    def stream(self, *, request_id: str | None = None, follow: bool = False) -> Subscription:
        """Iterate over step records as they are made, from another thread than the one running ``generate``.

        Yields the records of the ``generate`` call running now (from its first step; with ``keep_steps=False``
        from the next step) or, if none is, of the next one, and stops when that call returns or raises, or when
        the probe detaches. ``request_id`` picks that request's call; ``follow`` yields every call's steps until
        the probe detaches. Subscribe before starting the generation, so the stream cannot miss it::

            steps = probe.stream()
            threading.Thread(target=model.generate, kwargs=enc).start()
            for step in steps: print(step.step, step.token)
        """
        if not self.attached:
            raise RuntimeError("this probe is detached: call probe.stream() inside the `with nxl.attach(...)` block")
        return self._hub.subscribe(request_id=request_id, follow=follow)


def attach(
    model: nn.Module,
    layers: str | int | Sequence[int] = "all",
    target: Target = "predicted",
    *,
    tokenizer: Any = None,
    embedding: str = "layer_input",
    on_step: Callable[[Step], Any] | None = None,
    sink: str | Path | Sink | None = None,
    keep_steps: bool = True,
    keep_calls: int | None = None,
    cache_dtype: torch.dtype | None = None,
    cache_device: str | torch.device | None = None,
) -> Probe:
    """Hook NormXLogit onto ``model`` (a transformers task model or a PeftModel) until the probe detaches.

    ``with nxl.attach(model, layers="all") as probe: model(**enc)`` then ``probe.result().normxlogit``;
    ``with nxl.attach(model) as probe: model.generate(**enc)`` then ``probe.steps`` (one record per new token).

    - ``layers``: "all" (0..L), "last" (L), or ints; negative ints count from the end.
    - ``target``: "predicted" (the model's own argmax at the prediction position), an int id, a token or
      label string, a list of them (adds a trailing axis of size k), or a (rows,) / (rows, k) id tensor.
    - ``tokenizer``: needed for token-string targets, masked LMs and token strings in the result.
    - ``embedding``: "layer_input" (input of block 1, default) or "word" (the raw word-embedding row).

    While ``generate`` runs (causal LMs; see :mod:`nxl_hooks.hooks.generate` and :mod:`nxl_hooks.hooks.publish`):

    - ``on_step``: called with each :class:`~nxl_hooks.Step` as soon as it is complete;
    - ``sink``: a file path (or :class:`~nxl_hooks.Sink`) the records are appended to, crash-safe;
      read it with ``nxl.read_stream(path)``;
    - ``keep_steps``: keep the records in ``probe.calls`` / ``probe.steps`` (set False to stream them only);
      ``keep_calls``: keep only the last N calls (None: all);
    - ``cache_dtype`` / ``cache_device``: where the per-layer feature cache lives (batch × d values per token
      per selected layer; e.g. ``torch.bfloat16``, ``"cpu"``).

    The probe never raises into the model's forward or ``generate``; hooks are removed by :meth:`Probe.detach`,
    the end of the ``with`` block, :func:`detach_all`, or when the probe is garbage-collected.
    """
    plan = make_plan(unwrap(model), layers=layers, target=target, tokenizer=tokenizer, embedding=embedding)
    check_recording(plan, on_step=on_step, sink=sink, keep_calls=keep_calls, cache_dtype=cache_dtype,
                    cache_device=cache_device)
    backbone = get_path(plan.model, plan.spec.backbone) if plan.spec.backbone else plan.model.base_model
    with _LOCK:
        if backbone in _ATTACHED:
            raise RuntimeError(
                "a probe is already attached to this model: leave the first `with nxl.attach(...)` block "
                "(or call probe.detach(), or nxl.detach_all(model)) before attaching again"
            )
        # Only now the sink file is opened: a refused probe never truncates one.
        hub = Hub(on_step=on_step, sink=sink, keep_steps=keep_steps, keep_calls=keep_calls)
        try:
            gens = Generations(plan, hub, cache_dtype=cache_dtype, cache_device=cache_device) if plan.generates else None
            recorder = _Recorder(plan, backbone, gens)
            handles = recorder.register()
        except BaseException:
            hub.close()
            raise
        if gens is not None:
            gens.install()
        gens_ref = weakref.ref(gens) if gens is not None else (lambda: None)
        probe = Probe(plan, recorder, hub, functools.partial(_detach, handles, gens_ref, hub, weakref.ref(backbone),
                                                             run_eagerly(model)))
        _ATTACHED[backbone] = probe._finalizer
    return probe


def detach_all(model: nn.Module) -> int:
    """Remove every nxl_hooks probe from ``model`` (also one whose probe object was lost); returns how many.

    ``nxl.detach_all(model)``
    """
    modules = set(unwrap(model).modules())
    with _LOCK:
        finalizers = [finalizer for backbone, finalizer in _ATTACHED.items() if backbone in modules]
    for finalizer in finalizers:
        finalizer()
    return len(finalizers)


def explain(model: nn.Module, tokenizer: Any, text: str | list[str], **options: Any) -> Attribution:
    """Attach, run one forward on ``text`` (a string or a batch of them, padded), detach: its attribution.

    ``nxl.explain(model, tok, "The capital of France is", layers="all").top(3)``; ``options`` go to :func:`attach`.
    """
    enc = tokenizer(text, return_tensors="pt", padding=True, return_token_type_ids=False).to(input_device(model))
    with torch.no_grad(), attach(model, tokenizer=tokenizer, **options) as probe:
        model(**enc)
    return probe.result()
