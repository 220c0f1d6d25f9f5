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
it, so forwards and ``generate`` calls in several threads on one attached model are recorded separately; under
continuous batching and other serving engines (:mod:`.engines`) each request of a packed forward is recorded on its
own.

Nothing global holds the model: a model the program drops while a probe is still attached is freed, and the probe
detaches then (its sink is closed, its records stay readable).
"""

from __future__ import annotations

import inspect
import logging
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..method.protocol import Method
from ..method.select import Target
from ..method.subject import Subject, unwrap
from ..records.attribution import Attribution
from ..records.sinks import RecordSink
from ..records.steps import GenerationCall, Step
from .engines import Engine, engines_for
from .forward import Capture, assemble, open_capture
from .generate import Generations, Notice
from .guard import logger, reason
from .plan import Plan, check_recording, make_plan, run_eagerly
from .publish import Hub, Subscription
from .recording import Recording
from .tape import TracedForward, reset_compiled

__all__ = ["Probe", "attach", "detach_all"]

_LOCK = threading.RLock()  # reentrant: a model collected while it is held detaches through it too
#: backbone -> what the probe on it attached: one probe per model at a time.
_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, _Attachment]" = weakref.WeakKeyDictionary()


def _hidden(output: Any) -> torch.Tensor:
    # Most transformers v5 blocks return a tensor; Falcon, Bloom, MPT, GPT-J, DeBERTa-v2 return tuples.
    return output[0] if isinstance(output, (tuple, list)) else output


def _without_traceback(error: BaseException) -> BaseException:
    # Kept for result(): a traceback would keep every tensor of the failed forward's frames alive.
    return error.with_traceback(None)


class _Results(threading.local):
    """The last forward's attribution (or why there is none), per thread. Shared by the probe and its hooks: the
    probe keeps it after it detaches, without keeping the model."""

    last: Attribution | BaseException | None = None


class _Task:
    """One task-model forward running in this thread: whether it is a step of a recorded call, whether its blocks
    reached the hooks, and (a plain forward) its backbone's capture, assembled when the task model returns."""

    __slots__ = ("in_call", "blocks_ran", "capture")

    def __init__(self, in_call: bool) -> None:
        self.in_call, self.blocks_ran = in_call, False
        self.capture: Capture | None = None


class _Recorder:
    """The hooks, and the per-thread state of the calls they record. The model holds it (through its hooks), never
    the :class:`Probe`, so neither a dropped probe nor a dropped model is kept alive by the other."""

    def __init__(self, plan: Plan, backbone: nn.Module, gens: Generations | None, engines: list[Engine],
                 results: _Results, notice: Notice) -> None:
        self.plan, self.backbone, self.gens, self.engines = plan, backbone, gens, engines
        self.notice = notice
        self._signature = inspect.signature(backbone.forward)
        # The backbone's **kwargs (flash / continuous-batching arguments arrive there) are read like named ones.
        self._var_keyword = next((name for name, parameter in self._signature.parameters.items()
                                  if parameter.kind is inspect.Parameter.VAR_KEYWORD), None)
        self._local = threading.local()
        self.results = results
        self._told_stray = False
        # Layers whose features a hook computes; the last block is hooked in any case, for final logits.
        self._wanted = set(plan.layers)
        # Under torch.compile the hooks only write these (graph-safe: no per-thread state, no host read, no lock):
        # the tape while a recorded call armed it, else what a plain forward saw.
        self.tape = gens.tape if gens is not None else None
        self.plain = TracedForward()

    # -- per-thread state --------------------------------------------------------------------------------

    def _stacks(self) -> tuple[list[Capture | None], list[_Task]]:
        local = self._local
        try:
            return local.captures, local.tasks
        except AttributeError:
            local.captures, local.tasks = [], []
            return local.captures, local.tasks

    def _run(self) -> Recording | None:
        return self.gens.current() if self.gens is not None else None

    def _fail(self, what: str, error: BaseException) -> None:
        """This thread's current capture failed: nothing more is recorded for its call."""
        captures, _ = self._stacks()
        if captures:
            captures[-1] = None
        run = self._run()
        if run is not None:
            run.fail(what, error)
        else:
            reason(what, error)
            self.results.last = _without_traceback(error)

    def _current(self) -> Capture | None:
        captures, _ = self._stacks()
        return captures[-1] if captures else None

    def _arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        if not args and self._var_keyword not in kwargs:  # keywords only, as task models call their backbone:
            return dict(kwargs)  # binding would give the same names, once flattened
        arguments = self._signature.bind_partial(*args, **kwargs).arguments
        extra = arguments.pop(self._var_keyword, None) if self._var_keyword else None
        if extra:
            arguments.update(extra)
        return arguments

    def _stray(self, arguments: dict[str, Any]) -> bool:
        """Whether a forward outside every recorded call is an engine's own (its warmup, or a step it cannot
        follow), which a plain forward's record cannot explain: then it is not recorded, and the result says why.
        Said once per probe: as a warning when the engine cannot follow its host at all (also kept as
        ``Probe.unrecorded``), else as information."""
        for engine in self.engines:
            why = engine.stray(arguments)
            if why is None:
                continue
            self.results.last = RuntimeError(why)
            if engine.unfollowed:
                self.notice.text = f"not recorded: {engine.unfollowed}"
            if not self._told_stray:
                self._told_stray = True
                logger.log(logging.WARNING if engine.unfollowed else logging.INFO,
                           "nxl_hooks: %s forwards are not recorded (%s); they run unchanged", engine.name,
                           engine.unfollowed or "a forward outside its generation steps, e.g. a warmup")
            return True
        if arguments.get("cu_seq_lens_q") is not None:  # padding-free inputs, in a model no engine follows
            self.results.last = RuntimeError(
                "the last forward packed several sequences into one row (cu_seq_lens_q: padding-free inputs), which "
                "a plain forward's record cannot explain; pass a padded batch")
            return True
        return False

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

    def _traced(self) -> bool:
        """Whether this hook runs inside a forward dynamo traces (:mod:`.tape`)."""
        return torch.compiler.is_compiling()

    def _taping(self) -> bool:
        return self.tape is not None and self.tape.armed

    def settle(self) -> None:
        """Assemble the last plain forward that ran wholly compiled (the task model's hooks traced too)."""
        seen = self.plain.take()
        if seen is not None and seen[0] is not None:
            self._finish(*seen)
        elif seen is not None:
            self.results.last = self._skipped()

    def on_task_start(self, module: nn.Module, args: tuple) -> None:
        if self._traced():
            if not self._taping():
                self.plain.task()
            return
        _, tasks = self._stacks()
        tasks.append(_Task(in_call=self._run() is not None))

    def on_task_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._taping() and output is not None:
            self.tape.task_output(output)  # eager too: a prefill that ran eagerly hands its logits on
        if self._traced():
            if not self._taping():
                self.plain.keep("logits", getattr(output, "logits", None))
            return
        _, tasks = self._stacks()
        if not tasks:
            return
        task = tasks.pop()
        if task.capture is not None:
            self._finish(task.capture, output)
        elif task.in_call:
            run = self._run()
            if run is not None and not run.failed and output is not None:
                try:  # a step of a call: its logits give the probability of the token it emits
                    run.after_task(output)
                except Exception as error:  # noqa: BLE001 - never into the host's forward
                    run.fail("this call", error)
        elif not task.blocks_ran and output is not None and (seen := self.plain.take()) and seen[0] is not None:
            self._finish(seen[0], output)  # its forward ran compiled, tracing the blocks' hooks
        elif not task.blocks_ran and output is not None:  # its hooks ran, those of its blocks did not: compiled code
            self.results.last = self._skipped()

    def _skipped(self) -> RuntimeError:
        return RuntimeError(
            f"{type(self.plan.model).__name__} ran, but its blocks never reached the probe's hooks: the call ran "
            "code compiled by torch.compile before the hooks existed, which skips them. Attach to the compiled model "
            "itself (nxl.attach(compiled) runs it eagerly while attached), call the uncompiled module, or run the "
            "call under `with torch.compiler.set_stance('force_eager'):`")

    def on_backbone_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._traced():
            (self.tape if self._taping() else self.plain).begin(self._arguments(args, kwargs))
            return
        captures, _ = self._stacks()
        run = self._run()
        captures.append(None)  # replaced below once the inputs are known; a failure or a skipped call leaves None
        if run is not None and run.failed:
            return
        try:
            bound = self._arguments(args, kwargs)
            if run is None and self._stray(bound):
                return
            capture = open_capture(bound)
            if run is not None:
                run.before_forward(bound)
            captures[-1] = capture
        except Exception as error:  # noqa: BLE001 - never into the host's forward
            self._fail("this forward", error)

    def on_block_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._traced():
            hidden = args[0] if args else kwargs["hidden_states"]
            if self.plan.embedding == "layer_input":
                self._traced_embedding(torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float32))
            if 0 in self._wanted:
                (self.tape if self._taping() else self.plain).layer(0, hidden)
            return
        captures, tasks = self._stacks()
        if tasks:
            tasks[-1].blocks_ran = True
        if not captures:
            self.results.last = _without_traceback(RuntimeError(
                f"{type(self.plan.model).__name__} ran its blocks without calling "
                f"{type(self.backbone).__name__}.forward, so nxl_hooks saw no input_ids: set `backbone` (the module "
                f"that takes input_ids and runs the blocks) in the registry entry for "
                f"{self.plan.model.config.model_type!r}"))
            return
        capture = captures[-1]
        if capture is None:
            return
        try:
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.requires_grad:
                hidden = hidden.detach()
            with torch.no_grad():
                if self.plan.embedding == "layer_input":
                    capture.embed_norm = torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float32)
                if 0 in self._wanted:
                    capture.hidden[0] = hidden
        except Exception as error:  # noqa: BLE001
            self._fail("this forward", error)

    def on_word_embedding(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self._traced():
            self._traced_embedding(self._word_norms(module, output))
            return
        capture = self._current()
        if capture is None:  # the embedding called on its own, outside a forward of the model
            return
        try:
            capture.embed_norm = self._word_norms(module, output)
        except Exception as error:  # noqa: BLE001
            self._fail("this forward", error)

    def _traced_embedding(self, norms: torch.Tensor) -> None:
        if self._taping():
            self.tape.embedding(norms)
        else:
            self.plain.keep("embed", norms)

    @staticmethod
    def _word_norms(module: nn.Module, output: torch.Tensor) -> torch.Tensor:
        # Gemma-style scaled embeddings multiply inside the module; the paper's norm is of the raw row.
        scale = getattr(module, "embed_scale", None)
        rows = output.detach().float()
        if scale is not None:
            rows = rows / scale.to(rows.device).float()
        return torch.linalg.vector_norm(rows, dim=-1)

    def _block_hook(self, index: int) -> Callable:
        # Decided once: this runs for every block of every forward, one-token decoding steps included.
        wanted, last = index in self._wanted, index == self.plan.n_blocks

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._traced():
                if wanted:
                    (self.tape if self._taping() else self.plain).layer(index, _hidden(output))
                if last and not self._taping():
                    self.plain.keep("last", _hidden(output).detach())
                return
            capture = self._current()
            if capture is None:
                return
            try:
                hidden = _hidden(output)
                if hidden.requires_grad:  # under no_grad (serving, generate) there is nothing to detach from
                    hidden = hidden.detach()
                if last:
                    capture.last_hidden = hidden
                if wanted:
                    capture.hidden[index] = hidden
            except Exception as error:  # noqa: BLE001
                self._fail("this forward", error)

        return hook

    def on_backbone_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._traced():
            return
        captures, tasks = self._stacks()
        capture = captures.pop() if captures else None
        if capture is None:
            return
        run = self._run()
        if output is None:  # the model's own forward raised (an always_call hook): nothing to record
            if run is None:
                self.results.last = RuntimeError("the last forward raised inside the model, so nothing was recorded")
            return
        if run is not None:
            try:
                with torch.no_grad():
                    run.after_forward(capture)
            except Exception as error:  # noqa: BLE001
                run.fail("this call", error)
        elif tasks and not tasks[-1].in_call and tasks[-1].blocks_ran:
            tasks[-1].capture = capture  # assembled when the task model returns, with its own logits
        else:
            self._finish(capture, None)

    def _finish(self, capture: Capture, output: Any) -> None:
        if output is None:
            self.results.last = RuntimeError("the last forward raised inside the model, so nothing was recorded")
            return
        try:
            with torch.no_grad():
                self.results.last = assemble(self.plan, capture, output)
        except Exception as error:  # noqa: BLE001
            self._fail("this forward", error)


class _Attachment:
    """Everything one :func:`attach` put on a model, taken off once: by :meth:`Probe.detach` (the end of the
    ``with`` block), :func:`detach_all`, or the probe or the model being garbage-collected, whichever comes first.
    Holds no strong reference to the model, and nothing global holds it strongly after it ran."""

    def __init__(self, handles: list, gens: Generations | None, engines: list[Engine], hub: Hub,
                 backbone: nn.Module, restore_compiled: Callable[[], None]) -> None:
        self._handles = handles
        self._restore_compiled = restore_compiled
        self._gens = weakref.ref(gens) if gens is not None else None
        self._engines = [weakref.ref(engine) for engine in engines]  # the hooks (the recorder) keep them alive
        self._hub = hub
        self._backbone = weakref.ref(backbone)
        self._lock = threading.RLock()
        self.alive = True
        self._on_model = weakref.finalize(backbone, self)  # a model dropped while attached: detach then

    def __call__(self) -> None:
        with self._lock:
            if not self.alive:
                return
            self.alive = False
        # Taken before the hooks go: they may be what keeps these alive.
        gens = self._gens() if self._gens is not None else None
        engines = [ref() for ref in self._engines]
        try:
            self._restore_compiled()
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            if gens is not None:
                gens.uninstall()
            for engine in engines:
                if engine is not None:
                    try:
                        engine.uninstall()
                    except Exception as error:  # noqa: BLE001 - a broken engine never keeps the model hooked
                        reason(f"detaching engine {engine.name!r}", error)
        finally:
            self._on_model.detach()
            backbone = self._backbone()
            with _LOCK:
                if backbone is not None and _ATTACHED.get(backbone) is self:
                    del _ATTACHED[backbone]
            self._hub.close()  # may log a failing sink: the model is free all the same


class Probe:
    """Hooks of one :func:`attach` call. ``with nxl.attach(model) as probe: model(**enc)``, then ``probe.result()``.

    Made by :func:`attach`. It detaches when asked, or when it or the model is garbage-collected, whichever comes
    first; it holds the model only weakly, so a server that unloads a model frees it.
    """

    def __init__(self, plan: Plan, results: _Results, hub: Hub, attachment: _Attachment, notice: Notice,
                 settle: Callable[[], Callable[[], None] | None]) -> None:
        self._plan = weakref.ref(plan)
        self._model = weakref.ref(plan.model)
        self.kind = plan.kind  #: causal_lm, sequence_classification, regression or masked_lm
        self._layers, self._n_blocks, self._describe = list(plan.layers), plan.n_blocks, plan.describe()
        self._results, self._hub, self._attachment, self._notice = results, hub, attachment, notice
        self._finalizer = weakref.finalize(self, attachment)
        self._settle = settle  # assembles a plain forward that ran wholly compiled, when the result is read

    # -- what the probe explains -------------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The transformers task model the hooks are on (inside a PeftModel, its base model)."""
        model = self._model()
        if model is None:
            raise RuntimeError("the model this probe was attached to has been freed (the program dropped it)")
        return model

    @property
    def plan(self) -> Plan:
        """What the probe explains, while it is attached."""
        plan = self._plan()
        if plan is None or not self.attached:
            raise RuntimeError("this probe is detached: its plan went with its hooks (probe.describe() stays)")
        return plan

    @property
    def layers(self) -> list[int]:
        return list(self._layers)

    @property
    def n_blocks(self) -> int:
        return self._n_blocks

    def describe(self) -> dict[str, Any]:
        """What a saved result records about the model and the probe: ``probe.describe()["head_kind"]``."""
        return dict(self._describe)

    # -- attach / detach ---------------------------------------------------------------------------------

    def detach(self) -> None:
        """Remove every hook of this probe; the model is as it was before :func:`attach`. Calls still running in
        other threads go on unharmed, and their records end incomplete."""
        self._attachment()

    @property
    def attached(self) -> bool:
        """True until :meth:`detach` (or the end of the ``with`` block, or the model being freed)."""
        return self._attachment.alive

    def __enter__(self) -> "Probe":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- results -----------------------------------------------------------------------------------------

    def result(self) -> Attribution:
        """The attribution of the last forward this thread ran while attached.

        Raises the reason when that forward could not be recorded (an empty input, a target that does not fit...).
        """
        settle = self._settle()
        if settle is not None:
            settle()
        last = self._results.last
        if last is None:
            raise RuntimeError("no forward has run under this probe yet (in this thread): call the model inside "
                               "the `with` block")
        if isinstance(last, BaseException):
            raise last
        return last

    @property
    def unrecorded(self) -> str | None:
        """Why the last call that could not be followed is not recorded, and what makes it recordable (``"not
        recorded: this manager pads its inputs for CUDA graphs ...; set NXL_EAGER=1 ..."``); None while
        every call was followed. The same text is that call's ``GenerationCall.error``."""
        return self._notice.text

    @property
    def unrecorded_calls(self) -> int:
        """How many calls (``generate`` calls, served requests) ran while attached but were not recorded, in whole or
        from some step on; :attr:`unrecorded` says the last reason. ``if probe.unrecorded_calls: ...``"""
        return self._notice.count

    @property
    def sink_fault(self) -> str | None:
        """Why the records sink stopped getting records (one line: disk full, read-only), else None.
        ``if probe.sink_fault: print(probe.sink_fault)``"""
        return self._hub.sink_fault

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every record made so far is in :attr:`calls` and written by the sink (records reach the sink
        from a thread of their own, so that generation never waits for it); whether that happened within
        ``timeout`` seconds. Leaving the ``with`` block flushes too; after it, a sink still busy when the probe
        detached is waited for. ``probe.flush(); nxl.read_stream(path)``"""
        return self._hub.flush(timeout)

    @property
    def unwritten(self) -> int:
        """How many step records the sink did not get because it had stopped (:attr:`sink_fault` says why): they
        are in memory only. ``assert probe.unwritten == 0``"""
        return self._hub.unwritten

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

        Yields the records of the ``generate`` call (or continuous-batching request) running now (from its first
        step; with ``keep_steps=False`` from the next step) or, if none is, of the next one, and stops when that
        call returns or raises, or when the probe detaches. ``request_id`` picks that request's call (one that has
        already ended gives its kept steps, then stops); ``follow`` yields every call's steps (with ``request_id``:
        every call of that request) until the probe detaches or ``close()`` is called on the iterator. Subscribe
        before starting the generation, so the stream cannot miss it::

            steps = probe.stream()
            threading.Thread(target=model.generate, kwargs=enc).start()
            for step in steps: print(step.step, step.token)
        """
        if not self.attached:
            raise RuntimeError("this probe is detached: call probe.stream() inside the `with nxl.attach(...)` block")
        return self._hub.subscribe(request_id=request_id, follow=follow)


def attach(
    model: nn.Module | Subject,
    layers: str | int | Sequence[int] = "all",
    target: Target = "predicted",
    *,
    tokenizer: Any = None,
    embedding: str = "layer_input",
    on_step: Callable[[Step], Any] | None = None,
    sink: str | Path | RecordSink | None = None,
    keep_steps: bool = True,
    keep_calls: int | None = None,
    cache_dtype: torch.dtype | None = None,
    cache_device: str | torch.device | None = None,
    methods: Sequence[str | Method] | str | None = None,
) -> Probe:
    """Hook NormXLogit onto ``model`` (a transformers task model, a PeftModel, a ``torch.compile`` wrapper, or its
    :class:`~nxl_hooks.method.subject.Subject` already resolved) until the probe detaches.

    ``with nxl.attach(model, layers="all") as probe: model(**enc)`` then ``probe.result().normxlogit``;
    ``with nxl.attach(model) as probe: model.generate(**enc)`` then ``probe.steps`` (one record per new token).

    - ``layers``: "all" (0..L), "last" (L), or ints; negative ints count from the end.
    - ``target``: "predicted" (the model's own argmax at the prediction position), an int id, a token or
      label string, a list of them (adds a trailing axis of size k), or a (rows,) / (rows, k) id tensor.
    - ``tokenizer``: needed for token-string targets, masked LMs and token strings in the result.
    - ``embedding``: "layer_input" (input of block 1, default) or "word" (the raw word-embedding row).
    - ``methods``: attribution methods to compute beside NormXLogit and LogAt (which every record has): names
      registered with :func:`~nxl_hooks.method.registry.register_method` (``"contrastive"``) or
      :class:`~nxl_hooks.method.protocol.Method` objects; each lands in the records' ``scores[name]``.

    While ``generate`` or a serving engine runs (:mod:`nxl_hooks.hooks.engines`: continuous batching, one call per
    request), in any thread (causal LMs; :mod:`nxl_hooks.hooks.generate`, :mod:`nxl_hooks.hooks.publish`):

    - ``on_step``: called with each :class:`~nxl_hooks.Step` once complete, in the thread that runs ``generate`` (which
      then reads each record back from the device; :meth:`Probe.stream` and the sink get them from the pipeline's);
    - ``sink``: where the records go (:func:`~nxl_hooks.make_sink`): a stream file (``nxl.read_stream(path)``), a
      folder, ``"NAME:ARG"`` (``"parquet:out.parquet"``) or a :class:`~nxl_hooks.RecordSink`; see ``probe.sink_fault``;
    - ``keep_steps``: keep the records in ``probe.calls`` / ``probe.steps`` (False: stream them only); ``keep_calls``:
      keep only the last N calls (None: all);
    - ``cache_dtype`` / ``cache_device``: where the per-layer feature cache lives (e.g. ``torch.bfloat16``, ``"cpu"``).

    The probe never raises into the model's forward or ``generate``; hooks are removed by :meth:`Probe.detach`,
    the end of the ``with`` block, :func:`detach_all`, or when the probe or the model is garbage-collected (the
    probe holds the model weakly).
    """
    plan = make_plan(model, layers=layers, target=target, tokenizer=tokenizer, embedding=embedding,  # resolves once
                     methods=methods)
    check_recording(plan, on_step=on_step, sink=sink, keep_calls=keep_calls, cache_dtype=cache_dtype,
                    cache_device=cache_device)
    backbone = plan.subject.backbone
    engines = engines_for(plan.model) if plan.generates else []  # before the lock: may import an engine's module
    with _LOCK:
        if backbone in _ATTACHED:
            raise RuntimeError(
                "a probe is already attached to this model: leave the first `with nxl.attach(...)` block "
                "(or call probe.detach(), or nxl.detach_all(model)) before attaching again"
            )
        # Only now the sink file is opened: a refused probe never truncates one.
        hub = Hub(on_step=on_step, sink=sink, keep_steps=keep_steps, keep_calls=keep_calls)
        results, notice = _Results(), Notice()
        try:
            gens = None
            if plan.generates:
                gens = Generations(plan, hub, notice, cache_dtype=cache_dtype, cache_device=cache_device)
                gens.backbone = backbone
            recorder = _Recorder(plan, backbone, gens, engines, results, notice)
            handles = recorder.register()
        except BaseException:
            hub.close()
            raise
        if gens is not None:
            gens.install()
        attachment = _Attachment(handles, gens, engines, hub, backbone,
                                 _compiled_code(plan.subject.given, plan.model, backbone))
        probe = Probe(plan, results, hub, attachment, notice, weakref.WeakMethod(recorder.settle))
        _ATTACHED[backbone] = attachment
    for engine in engines:  # outside the lock: their own locks are never taken inside this one
        try:
            engine.install(gens)
        except Exception as error:  # noqa: BLE001 - a broken engine never breaks attach
            engine.unfollowed = f"engine {engine.name!r} failed to install ({reason(engine.name, error)})"
    return probe


def _compiled_code(model: nn.Module, *inner: nn.Module) -> Callable[[], None]:
    """Compiled code of ``model`` that could skip or keep the hooks, dealt with now; returns the undo (detach). A
    ``torch.compile(model)`` wrapper runs eagerly while attached (:func:`~.plan.run_eagerly`); a forward compiled
    in place recompiles once now, tracing the hooks, and once after detach, without them."""
    undo = run_eagerly(model)
    modules = [weakref.ref(module) for module in {id(m): m for m in (model, *inner)}.values()]
    reset_compiled(*(ref() for ref in modules))

    def restore() -> None:
        undo()
        reset_compiled(*(module for ref in modules if (module := ref()) is not None))

    return restore


def detach_all(model: nn.Module) -> int:
    """Remove every nxl_hooks probe from ``model`` (also one whose probe object was lost); returns how many:
    ``nxl.detach_all(model)``"""
    modules = set(unwrap(model).modules())
    with _LOCK:
        attachments = [attachment for backbone, attachment in _ATTACHED.items() if backbone in modules]
    for attachment in attachments:
        attachment()
    return len(attachments)
