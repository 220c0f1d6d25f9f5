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

Nothing global holds the model, and the record pipeline holds only what it reads (the head): a model the program
drops while a probe is still attached is freed at the next garbage collection (the hooks and the recorder make a
reference cycle with it: ``del model; gc.collect()``, also right after ``generate`` returns), and the probe detaches
then (its sink is closed, its records stay readable).
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
import weakref
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import torch
from torch import nn

from ..arch import plugins
from ..arch.values import real
from ..method.registry import Methods
from ..method.select import Layers, TargetOption
from ..method.subject import Subject, unwrap
from ..records.attribution import Attribution
from ..records.sinks import RecordSink
from ..records.steps import GenerationCall, Step
from .engines import Engine, engines_for
from .generate import BATCH_STEPS, Generations
from .guard import Notice, Owned, inert, reason
from .plan import Plan, check_recording, make_plan, run_eagerly
from .publish import LIVE_QUEUE, Hub, Subscription
from .recorder import Recorder, Results
from .traced import reset_compiled

__all__ = ["Probe", "attach", "detach_all", "count_hooks"]

_LOCK = threading.RLock()  # reentrant: a model collected while it is held detaches through it too
#: backbone -> what the probe on it attached: one probe per model at a time.
_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, _Attachment]" = weakref.WeakKeyDictionary()


class _Attachment:
    """Everything one :func:`attach` put on a model, taken off once: by :meth:`Probe.detach` (the end of the
    ``with`` block), :func:`detach_all`, or the probe or the model being garbage-collected, whichever comes first.
    Holds no strong reference to the model, and nothing global holds it strongly after it ran."""

    def __init__(self, handles: list, gens: Generations | None, engines: list[Engine], hub: Hub,
                 backbone: nn.Module, restore_compiled: Callable[[], None] | None,
                 settle: Callable[[], Callable[[], None] | None]) -> None:
        self._handles = handles
        self._settle: Callable[[], Callable[[], None] | None] | None = settle
        self._restore_compiled: Callable[[], None] | None = restore_compiled
        self._gens = weakref.ref(gens) if gens is not None else None
        self._engines = [weakref.ref(engine) for engine in engines]  # the hooks (the recorder) keep them alive
        self._hub = hub
        self._backbone = weakref.ref(backbone)
        self._lock = threading.RLock()
        self.alive = True
        self._detaching = False
        self._on_model = weakref.finalize(backbone, self)  # a model dropped while attached: detach then

    def undo_compiled(self, restore: Callable[[], None]) -> None:
        """What detach calls to give the model's compiled code back (:func:`_compiled_code`), once attach made it."""
        self._restore_compiled = restore

    def __call__(self) -> None:
        with self._lock:
            if not self.alive or self._detaching:
                return
            self._detaching = True
        try:
            self._take_off()
        except BaseException:
            # cut short (a Ctrl-C while it waits below, or between two hooks): still attached, what is left comes off
            # at the next detach (Probe.detach, detach_all, the probe or the model collected)
            self._detaching = False
            raise
        self.alive = False
        self._on_model.detach()
        backbone = self._backbone()
        with _LOCK:
            if backbone is not None and _ATTACHED.get(backbone) is self:
                del _ATTACHED[backbone]
        self._hub.close()  # may log a failing sink: the model is free all the same

    def _take_off(self) -> None:
        """Everything attach put on, each step once even when called again after an interruption."""
        # Taken before the hooks go: they may be what keeps these alive.
        gens = self._gens() if self._gens is not None else None
        engines = [ref() for ref in self._engines]
        self._hub.wait_later()  # a call's end made off its thread may still run the model with these hooks
        if self._settle is not None:
            # this thread's compiled forward kept for its result, assembled while the recorder and the weights it
            # ran with are still there (a result read after detach would find neither)
            settle = self._settle()
            if settle is not None:
                settle()
            self._settle = None
        if self._restore_compiled is not None:
            self._restore_compiled()
            self._restore_compiled = None
        while self._handles:
            self._handles[-1].remove()
            self._handles.pop()
        if gens is not None:
            gens.uninstall()
        self._engines.clear()
        for engine in engines:
            if engine is not None:
                try:
                    engine.uninstall()
                except BaseException as error:  # noqa: BLE001 - a broken engine (SystemExit too) never
                    # keeps the model hooked
                    reason(f"detaching engine {engine.name!r}", plugins.contained(error))


class Probe:
    """Hooks of one :func:`attach` call. ``with nxl.attach(model) as probe: model(**enc)``, then ``probe.result()``.

    Made by :func:`attach`. It detaches when asked, or when it or the model is garbage-collected, whichever comes
    first; it holds the model only weakly, so a server that unloads a model frees it (at the next garbage
    collection: ``del model; gc.collect()``).
    """

    def __init__(self, plan: Plan, results: Results, hub: Hub, attachment: _Attachment, notice: Notice,
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
        """The layers recorded, 0 (the embeddings) to :attr:`n_blocks` (the last block's output), ascending:
        ``probe.layers == [0, 12]`` for ``attach(model, layers=[0, -1])`` on a 12-block model."""
        return list(self._layers)

    @property
    def n_blocks(self) -> int:
        """How many blocks the model runs, L: its last layer's index. ``probe.n_blocks``"""
        return self._n_blocks

    def describe(self) -> dict[str, Any]:
        """What a saved result records about the model and the probe: ``probe.describe()["head_kind"]``."""
        return copy.deepcopy(self._describe)  # (the caller's: its nested versions and quantization too)

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
        if not self.attached:  # its hooks are gone: the block's calls would run unrecorded, and nothing would say so
            raise RuntimeError("this probe is detached (a `with` block ended it, or probe.detach()): the calls in "
                               "this `with` block would not be recorded; attach again: "
                               "`with nxl.attach(model, ...) as probe:`")
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
                               "the `with` block. A compiled copy of its forward (torch.compile(model.forward)) "
                               "skips the hooks where its class's forward was compiled before attaching: assign it "
                               "(model.forward = torch.compile(model.forward)) or call it under "
                               "`with torch.compiler.set_stance('force_eager'):`")
        if isinstance(last, BaseException):
            raise last
        return last

    def peek(self) -> Attribution | BaseException | None:
        """This thread's last forward as the hooks left it: its attribution, the error saying why it is not
        recorded, or None. Unlike :meth:`result` it never assembles a forward that ran wholly compiled (that is
        done for the thread that asks :meth:`result`), and never raises: for a hook that runs after each forward.
        ``last = probe.peek()``"""
        return self._results.last

    @property
    def unrecorded(self) -> str | None:
        """Why the last call that could not be followed is not recorded, and what makes it recordable (``"not
        recorded: this manager pads its inputs for CUDA graphs ...; set NXL_EAGER=1 ..."``); None while
        every call was followed. The same text is that call's ``GenerationCall.error``."""
        self._hub.settle()  # (the record pipeline may still find a call's last records lost)
        return self._notice.text

    @property
    def unrecorded_calls(self) -> int:
        """How many calls (``generate`` calls, served requests) ran while attached but were not recorded, in whole or
        from some step on; :attr:`unrecorded` says the last reason. ``if probe.unrecorded_calls: ...``"""
        self._hub.settle()
        return self._notice.count

    @property
    def sink_fault(self) -> str | None:
        """Why the records sink stopped getting records (one line: disk full, read-only), else None.
        ``if probe.sink_fault: print(probe.sink_fault)``"""
        self._hub.settle()
        return self._hub.sink_fault

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until every record made so far is in :attr:`calls` and written by the sink (records reach the sink
        from a thread of their own, so that generation never waits for it); whether that happened within
        ``timeout`` seconds (None: however long it takes). Leaving the ``with`` block flushes too; after it, a sink
        still busy when the probe detached is waited for. ``probe.flush(); nxl.read_stream(path)``"""
        # ('x' raised a TypeError from deep in threading, and -1 returned False as if the sink were behind)
        if timeout is not None and (real(timeout) is None or not timeout >= 0):
            raise ValueError(f"timeout={timeout!r}: give the seconds to wait (0 or more), or None to wait until "
                             "every record is written")
        if timeout is not None and timeout >= threading.TIMEOUT_MAX:  # (inf overflowed threading's clock): as long
            timeout = None  # as it takes
        return self._hub.flush(timeout)

    @property
    def unwritten(self) -> int:
        """How many step records the sink did not get because it had stopped (:attr:`sink_fault` says why): they
        are in memory only. ``assert probe.unwritten == 0``"""
        self._hub.settle()
        return self._hub.unwritten

    @property
    def calls(self) -> list[GenerationCall]:
        """The ``generate`` calls run while attached, in the order they started, each with its step records
        (the last ``keep_calls`` of them, and every older one still running). Waits for the records of the calls
        that have ended (a call returns while the record pipeline still makes its last ones)."""
        self._hub.settle()
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
            # (the call's error mostly starts with the words this line starts with: said once)
            why = last.error.removeprefix("not recorded: ")
            raise RuntimeError(f"the last generate() call was not recorded: {why}")
        return last.steps

    def subscribe(self, *, request_id: str | None = None, follow: bool = False,
                  size: int | None = LIVE_QUEUE, replay: bool = True, calls: bool = False) -> Subscription:
        """Iterate over step records as they are made, from another thread than the one running ``generate``.

        Yields the records of the ``generate`` call (or continuous-batching request) running now (from its first
        step; with ``keep_steps=False`` from the next step) or, if none is, of the next one, and stops when that
        call returns or raises, or when the probe detaches. ``request_id`` picks that request's call (one that has
        already ended gives its kept steps, then stops); ``follow`` yields every call's steps (with ``request_id``:
        every call of that request) until the probe detaches or ``close()`` is called on the iterator. A reader
        ``size`` records behind loses the oldest (counted in ``dropped``): generation never waits for it.
        ``replay=False``: only records made from now on, not those a running call made before. ``calls=True``:
        each item is ``(call, step)``, the record's :class:`GenerationCall` with it (a follower's reader then has the
        request of a record even where the call has left ``probe.calls``: ``keep_calls``). Subscribe before
        starting the generation, so the subscription cannot miss it::

            steps = probe.subscribe()
            threading.Thread(target=model.generate, kwargs=enc).start()
            for step in steps: print(step.step, step.token)
        """
        if not self.attached:
            raise RuntimeError("this probe is detached: call probe.subscribe() inside the `with nxl.attach(...)` block")
        return self._hub.subscribe(request_id=request_id, follow=follow, size=size, replay=replay, calls=calls)

    def stream(self, *, request_id: str | None = None, follow: bool = False) -> Subscription[Step]:
        """Deprecated: :meth:`subscribe`, which is bounded; this one holds every record its reader has not read."""
        warnings.warn("Probe.stream() is deprecated: use probe.subscribe() (the same records, bounded)",
                      DeprecationWarning, stacklevel=2)
        return self.subscribe(request_id=request_id, follow=follow, size=None)


def attach(
    model: nn.Module | Subject,
    layers: Layers = "all",
    target: TargetOption = "predicted",
    *,
    tokenizer: Any = None,
    embedding: str = "layer_input",
    on_step: Callable[[Step], Any] | None = None,
    sink: str | Path | RecordSink | None = None,
    keep_steps: bool = True,
    keep_calls: int | None = None,
    cache_dtype: torch.dtype | None = None,
    cache_device: str | torch.device | None = None,
    methods: Methods = None,
) -> Probe:
    """Hook NormXLogit onto ``model`` (a transformers task model, a PeftModel, a ``torch.compile`` wrapper, or its
    :class:`~nxl_hooks.method.subject.Subject` already resolved) until the probe detaches.

    ``with nxl.attach(model, layers="all") as probe: model(**enc)`` then ``probe.result().normxlogit``;
    ``with nxl.attach(model) as probe: model.generate(**enc)`` then ``probe.steps`` (one record per new token).

    - ``layers``: "all" (0..L), "last" (L), or ints; negative ints count from the end.
    - ``target``: "predicted" (the model's own argmax at the prediction position; in ``generate``, the token it
      emitted, sampled or not), an int id, a token or label string, a list of them (adds a trailing axis of size
      k), or a (rows,) / (rows, k) id tensor.
    - ``tokenizer``: needed for token-string targets, masked LMs and token strings in the result.
    - ``embedding``: "layer_input" (input of block 1, default) or "word" (the raw word-embedding row).
    - ``methods``: attribution methods to compute beside NormXLogit and LogAt (which every record has): names
      registered with :func:`~nxl_hooks.method.registry.register_method` (``"contrastive"``) or
      :class:`~nxl_hooks.method.protocol.Method` objects; each lands in the records' ``scores[name]``.

    While ``generate`` or a serving engine runs (:mod:`nxl_hooks.hooks.engines`: continuous batching, one call per
    request), in any thread (causal LMs; :mod:`nxl_hooks.hooks.generate`, :mod:`nxl_hooks.hooks.publish`):

    - ``on_step``: called with each :class:`~nxl_hooks.Step` once complete, in the thread that runs ``generate`` (which
      then reads each record back from the device; :meth:`Probe.stream` and the sink get them from the pipeline's);
      one that raises stops its call's records at the step it raised on (kept), said in the call's ``error``;
    - ``sink``: where the records go (:func:`~nxl_hooks.make_sink`): a stream file (``nxl.read_stream(path)``), a
      folder, ``"NAME:ARG"`` (``"parquet:out.parquet"``) or a :class:`~nxl_hooks.RecordSink`; see ``probe.sink_fault``;
    - ``keep_steps``: keep the records in ``probe.calls`` / ``probe.steps`` (False: stream them only); ``keep_calls``:
      keep only the last N calls, and every older one still running (None: all);
    - ``cache_dtype`` / ``cache_device``: where the per-layer feature cache lives (e.g. ``torch.bfloat16``, ``"cpu"``).

    The probe never raises into the model's forward or ``generate``; hooks are removed by :meth:`Probe.detach`,
    the end of the ``with`` block, :func:`detach_all`, or when the probe or the model is garbage-collected (the
    probe holds the model weakly).
    """
    plan = make_plan(model, layers=layers, target=target, tokenizer=tokenizer, embedding=embedding,  # resolves once
                     methods=methods)
    check_recording(plan, on_step=on_step, sink=sink, keep_steps=keep_steps, keep_calls=keep_calls,
                    cache_dtype=cache_dtype, cache_device=cache_device)
    backbone = plan.subject.backbone
    engines = engines_for(plan.model) if plan.generates else []  # before the lock: may import an engine's module
    with _LOCK:
        if backbone in _ATTACHED:
            raise RuntimeError(
                "a probe is already attached to this model: leave the first `with nxl.attach(...)` block "
                "(or call probe.detach(), or nxl.detach_all(model)) before attaching again; under nxl run (or "
                "import nxl_hooks.auto), which attaches every model loaded, call nxl_hooks.auto.controller().pause() "
                "first and .resume() after"
            )
        # Only now the sink file is opened: a refused probe never truncates one.
        hub = Hub(on_step=on_step, sink=sink, keep_steps=keep_steps, keep_calls=keep_calls,
                  meta=plan.describe())
        results, notice = Results(), Notice()
        try:
            gens = None
            if plan.generates:
                gens = Generations(plan, hub, notice, cache_dtype=cache_dtype, cache_device=cache_device)
                gens.backbone = backbone
            recorder = Recorder(plan, backbone, gens, engines, results, notice)
        except BaseException:
            hub.close()
            raise
        settle = weakref.WeakMethod(recorder.settle)  # (the recorder holds the model: only its hooks hold it)
        # made before anything goes on the model, so that whatever ends attach half-way (a Ctrl-C) takes off what
        # went on: the hooks and generate's wrapper were left on, with no probe that detach_all could find
        handles: list = []
        attachment = _Attachment(handles, gens, engines, hub, backbone, None, settle)
        try:
            handles.extend(recorder.register())
            if gens is not None:
                gens.install()
            attachment.undo_compiled(_compiled_code(plan.subject.given, plan.model, backbone))
            probe = Probe(plan, results, hub, attachment, notice, settle)
            _ATTACHED[backbone] = attachment
        except BaseException:
            attachment()
            raise
    for engine in engines:  # outside the lock: their own locks are never taken inside this one
        try:
            engine.install(gens)
        except BaseException as error:  # noqa: BLE001 - a broken engine (SystemExit too) never breaks attach
            engine.unfollowed = (f"engine {engine.name!r} failed to install "
                                 f"({reason(f'engine {engine.name!r}', plugins.contained(error))})")
    return probe


def _compiled_code(model: nn.Module, *inner: nn.Module) -> Callable[[], None]:
    """Compiled code of ``model`` that could skip or keep the hooks, dealt with now; returns the undo (detach). A
    ``torch.compile(model)`` wrapper runs eagerly while attached (:func:`~.plan.run_eagerly`); a forward compiled
    in place recompiles once now, tracing the hooks, and once after detach, without them."""
    undo = run_eagerly(model)
    modules = [weakref.ref(module) for module in {id(m): m for m in (model, *inner)}.values()]

    def restore() -> None:
        undo()
        reset_compiled(*(module for ref in modules if (module := ref()) is not None), detaching=True)

    try:
        reset_compiled(*(ref() for ref in modules))
    except BaseException:  # (a Ctrl-C) attach takes off what it put on, and this is not made yet
        restore()
        raise
    return restore


def detach_all(model: nn.Module) -> int:
    """Remove every nxl_hooks probe from ``model`` (also one whose probe object was lost); returns how many:
    ``nxl.detach_all(model)``"""
    if not isinstance(model, nn.Module):
        raise ValueError(f"detach_all({type(model).__name__}): give the model a probe was attached to (an "
                         "nn.Module), or call probe.detach()")
    modules = set(unwrap(model).modules())
    with _LOCK:
        attachments = [attachment for backbone, attachment in _ATTACHED.items() if backbone in modules]
    for attachment in attachments:
        attachment()
    return len(attachments)


#: How long a process about to die of a signal waits for its records (:func:`end_records`): a sink writes what is queued
#: in milliseconds, and a container manager kills the process for good 10 s after its SIGTERM (docker's default).
ENDING_SECONDS = 5.0


def end_records(signal_name: str, frame: FrameType | None, *, within: float = ENDING_SECONDS) -> None:
    """Before the process dies of a signal (``nxl run``'s and ``nxl attach``'s SIGTERM/SIGHUP handler, in the main
    thread, which the signal stopped at ``frame``), every probe attached in this process ends its records: the main
    thread's call scores the steps it has waiting (:meth:`~.generate.Generations.score_waiting`), then each running
    call ends saying that the process got ``signal_name`` (its end frame written) and the sinks write what is queued.
    Within ``within`` seconds: what is not done by then (a sink still writing; a hook the signal stopped holding what
    the pipeline waits for) is lost, as it would be without this. The hooks stay on; nothing raises."""
    for _ in range(3):  # read without _LOCK: the thread the signal stopped may hold it (another thread changes it
        try:  # in the meantime at most)
            # (a forked child's calls keep their records in its memory: nothing of it is written)
            attachments = [attachment for attachment in list(_ATTACHED.values())
                           if attachment.alive and not attachment._hub.forked]
            break
        except RuntimeError:
            continue
    else:
        return
    whole: set[int] = set()  # ids of the calls recorded up to their last token
    for attachment in attachments:
        gens = attachment._gens() if attachment._gens is not None else None
        try:
            call = gens.score_waiting(frame) if gens is not None else None
        except Exception:  # noqa: BLE001 - scoring failed: the call's error says so; its records end before
            call = None
        if call is not None:
            whole.add(id(call))

    def why(call: GenerationCall) -> str:
        said = f"the process got {signal_name} while this call ran: its records end at the last step "
        if id(call) in whole:
            return said + "made before"
        return said + (f"recorded before (those made after it were waiting: up to {BATCH_STEPS} to be scored "
                       "together, or, where its forwards ran compiled, all of them, to be recorded when it returned)")

    deadline = time.monotonic() + within
    threads = [threading.Thread(target=attachment._hub.close, args=(why,), name="nxl_hooks-ending", daemon=True)
               for attachment in attachments]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))

def count_hooks(model: nn.Module) -> int:
    """How many hooks of nxl_hooks' own are on ``model``: forward hooks and pre-hooks on its modules, plus one for
    an instance ``generate`` that is the probe's wrapper; zero once every probe is off. Only nxl_hooks' own, told by
    the module of the hook's function (transformers keeps hooks of its own on a model once a call asked for
    ``output_hidden_states``) and by the wrapper's type, :class:`~.guard.Owned` (the user may set a ``generate`` of
    their own, even one made by ``functools.wraps(model.generate)``, which copies every attribute a mark could be);
    not the ones that do nothing that a copy of an attached model holds (:func:`~.guard.inert`).
    ``assert count_hooks(model) == 0``"""
    hooks = [hook for module in model.modules()
             for hook in (*module._forward_hooks.values(), *module._forward_pre_hooks.values()) if hook is not inert]
    owners = [getattr(getattr(hook, "func", hook), "__module__", None) or "" for hook in hooks]  # a partial's too
    wrapped = isinstance(vars(model).get("generate"), Owned)
    return sum(owner.startswith("nxl_hooks.") for owner in owners) + int(wrapped)
