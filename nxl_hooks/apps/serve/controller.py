"""The models a running program loaded, their probes, and what the control endpoint changes at run time.

    ctl = controller()                      # this process's, from the NXL_* environment (made on first use)
    ctl.adopt(model, "./my-model")          # what the from_pretrained patch calls: attached unless paused/excluded
    ctl.pause(); ctl.resume()               # paused: zero hooks on every model
    ctl.configure(layers="last")            # re-attach with other options
    ctl.records()                           # [(watch, record, meta)] of every model, oldest first

Three parts, each with its own lock: :class:`Models` (the watched models and their records in memory),
:class:`Rules` (when a model carries a probe: attach, detach, pause, re-attach with other options) and
:class:`Live` (the live readers' feeds). :class:`Controller` holds the three and the control endpoint.

Records: a ``GenerationCall`` per ``generate`` call (or continuous-batching request) of a causal LM, and a
:class:`Forward` per plain forward: every request of the other heads (classifiers, masked LMs), and a causal LM's
``model(...)`` beside its ``generate`` calls (scoring, log-probabilities). Forwards are kept in memory only.

Lifetimes. The probe lives on the model object (``model._nxl_probe``) and nowhere else: when the program drops a
model (``transformers serve --model-timeout``), model and probe are freed together and the probe's finalizer
closes its sink. The controller holds models only through weak references, and what ``attach`` keeps globally
(its stream of step records) holds no model either.

Never harm the host: every entry point here catches its own failures and logs one line on the ``nxl_hooks``
logger; the live readers are fed from the probe's stream, in a thread of the controller's own (one per watched
model), never in the host's generation thread, through bounded subscriptions (:class:`Live`).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import re
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ...arch.registry import HeadKind
from ...method.subject import Subject, unwrap
from ...hooks.generate import REQUEST_ID
from ...hooks.guard import one_line, reason, typed
from ...hooks.plan import TokenTexts, make_plan, token_texts, tokenizer_mismatch
from ...hooks.probe import Probe, attach, count_hooks
from ...hooks.recorder import traced
from ...hooks.subscription import Subscription
from ...method.placement import sharded
from ...method.select import special_mask
from ...records.attribution import Attribution
from ...records.writer import RotatingSink
from ...records.sinks import make_sink
from ...records.steps import GenerationCall, Step
from ...records.tokens import untexted
from .runs import check_private
from .settings import NoMatch, Settings, matches

__all__ = ["Controller", "Forward", "Live", "LiveStep", "Models", "Rules", "Texts", "Watch", "controller", "end",
           "start", "stop"]

_log = logging.getLogger("nxl_hooks")
_PROBE = "_nxl_probe"  #: the attribute of a model that holds its probe


class Texts:
    """A watched model's token ids as people read them: its tokenizer, loaded on first use, and the readable-text
    cache every probe with that tokenizer shares (:func:`~nxl_hooks.hooks.plan.token_texts`)."""

    def __init__(self, name: str, revision: str | None = None) -> None:
        self._name, self._revision = name, revision
        self._tokenizer: Any = None
        self._texts: TokenTexts | None = None  # held here: the shared cache lives while a holder does
        self._loaded = False
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded from local files on first use (None when there is none)."""
        with self._lock:
            if not self._loaded:
                self._loaded = True
                try:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(self._name, revision=self._revision,
                                                                    local_files_only=True)
                    self._texts = token_texts(self._tokenizer)
                except Exception as error:  # noqa: BLE001 - ids are shown instead
                    _log.warning("nxl_hooks: no tokenizer for %s (%s); token ids are shown instead", self._name,
                                 one_line(error)[:200])
            return self._tokenizer

    def text(self, token_id: int) -> str:
        """``readable`` text of ``token_id`` (``#ID`` without a tokenizer)."""
        self.tokenizer  # noqa: B018 - loads it (and its texts) on first use
        return self._texts([token_id])[0] if self._texts is not None else untexted(token_id)

    def special(self, ids: list[int]) -> list[bool] | None:
        tokenizer = self.tokenizer
        if tokenizer is None or not ids:
            return None
        import torch

        mask = special_mask(torch.tensor([ids]), tokenizer)
        return mask[0].tolist() if mask is not None else None


def _engine(model: Any) -> str | None:
    """What recording depends on in the engine that runs ``model`` (its ``engine`` line: a vLLM model's view has
    one), or None."""
    try:
        line = getattr(model, "engine", None) if model is not None else None
    except Exception as error:  # noqa: BLE001 - status is always answered
        line = f"unknown ({type(error).__name__}: {error})"
    return line if isinstance(line, str) else None


@dataclass(eq=False)
class Forward:
    """One plain forward (a classifier's request, a causal LM's ``model(...)``): the request it served and its
    attribution."""

    request_id: str  #: REQUEST_ID where the program set it, else a generated id
    thread: str
    attribution: Attribution
    #: when it ran (was kept, as it returned: a forward is short), in seconds since the epoch, as a call's ``started``
    started: float = field(default_factory=time.time)


def _started(kept: tuple[GenerationCall | Forward, dict]) -> float:
    """When a kept (record, meta) started: what the request lists are ordered by."""
    return kept[0].started or 0.0  # (a call read back from an older stream file may not say)


class Lost(NamedTuple):
    """What a model's probes did not record or write, as status says it (:meth:`Watch.describe`)."""

    sink_fault: str | None
    unwritten: int
    unrecorded: str | None
    unrecorded_calls: int

    def add(self, probe: Probe) -> "Lost":
        """These, and what ``probe`` lost since: its counts added, its texts (the newer) where it has them."""
        return Lost(probe.sink_fault or self.sink_fault, self.unwritten + probe.unwritten,
                    probe.unrecorded or self.unrecorded, self.unrecorded_calls + probe.unrecorded_calls)


class Watch:
    """One model the program loaded: a weak reference to it, its name, why it is not attached, and the calls of
    its earlier probes (each re-attach starts a new probe)."""

    def __init__(self, model: Any, name: str, slug: str, *, excluded: bool, keep_calls: int) -> None:
        self.ref = weakref.ref(model)
        self.name, self.slug = name, slug
        self.model_class = type(model).__name__
        self.excluded = excluded  #: not recorded: --models did not select it, or `nxl ctl detach` took it off
        self.error: str | None = None  #: why the last attach failed
        # (a vLLM model's tokenizer may come from elsewhere than its weights: vllm serve MODEL --tokenizer DIR)
        self.texts = Texts(getattr(model, "tokenizer_name_or_path", None) or name,
                           getattr(model, "tokenizer_revision", None))
        self.retired: collections.deque[tuple[GenerationCall, dict]] = collections.deque(maxlen=keep_calls)
        #: held while the probe is taken off and while :attr:`retired` is trimmed to what the probe leaves room for
        self.held = threading.Lock()
        self.forwards: collections.deque[Forward] = collections.deque(maxlen=keep_calls)
        self.hook: Any = None  #: the forward hook that keeps :attr:`forwards`, while attached
        self.attached_at = 0.0  #: when the probe on it now was put on (status's ``recording`` reads what came since)
        #: the probe's steps, read for the live readers while attached and any reader is connected
        self.live: Subscription[tuple[GenerationCall, Step]] | None = None
        self.dropped_before = 0  #: steps earlier live feeds of this model did not get (:attr:`live`'s are its own)
        # what the probes this model carried before did not record or write: a pause, a resume, an `nxl ctl attach`
        # each starts a new probe, and status must not forget the records lost before it (:meth:`retire`)
        self.detached: Probe | None = None  #: its last probe taken off, read as it stands (see retire)
        self.lost_before = Lost(None, 0, None, 0)  #: those before that one, as they stood when the next went

    @property
    def probe(self) -> Probe | None:
        model = self.ref()
        return vars(model).get(_PROBE) if model is not None else None

    def records(self) -> list[tuple[GenerationCall | Forward, dict]]:
        """(record, meta) of this model's calls and forwards in memory, oldest first (by when they started)."""
        while True:
            probe = self.probe
            calls = probe.calls if probe is not None else []  # (waits for ended calls' records: not under the lock)
            with self.held:
                if self.probe is not probe:  # taken off meanwhile: its calls are among the retired ones now
                    continue
                meta = probe.describe() if probe is not None else {}  # (once: one probe's calls share it, as
                live = [(call, meta) for call in calls]  # the retired ones do)
                # the probe keeps its own last keep_calls; those of the probes before it (a pause, an `nxl ctl
                # attach`) only fill what it leaves, so the model holds keep_calls in all, not that many per probe
                while self.retired and len(self.retired) + len(live) > self.retired.maxlen:
                    self.retired.popleft()
                retired = list(self.retired)
            return sorted(retired + live + [(forward, forward.attribution.meta) for forward in self.forwards],
                          key=_started)

    def retire(self, probe: Probe) -> None:
        """``probe`` is taken off the model: what it did not record or write still counts. It is read as it stands
        (a sink stuck at the detach says so then, and counts what its thread held if it ever comes back) until the
        next one is taken off; then it is added to :attr:`lost_before`."""
        older, self.detached = self.detached, probe
        if older is not None:
            self.lost_before = self.lost_before.add(older)

    def describe(self) -> dict:
        """The model as status shows it. ``sink_fault``: why its records stopped reaching the sink (disk full,
        read-only, folder removed, too slow to keep up), ``unwritten`` how many step records it did not get;
        ``unrecorded``: why the last of its calls that ran unrecorded was not recorded, and ``unrecorded_calls`` how
        many did; None (and 0) while everything is recorded. Counted over every probe the model carried since it
        was watched (a pause and resume, an ``nxl ctl attach``, each makes a new one); the texts are the newest,
        the current probe's, else the last one's that had one: a fault once met stays said, with the records it
        cost, after a resume onto a sink that works. ``live_dropped``: steps the
        live readers did not get because the live feed fell behind (still kept and written). ``recorded``: how
        many of the ``calls`` in memory were recorded whole (ended without an error), ``running`` how many have
        not ended yet. ``recording``: attached, and what the probe on it now made (not the calls of a probe before a
        pause or an ``nxl ctl attach``, which may have been cut by it) is nothing yet, a plain forward, or calls of
        which some are recorded or running. ``head_kind``: what its head predicts while attached (``causal_lm``;
        another kind's requests are plain forwards, none of which makes a token)."""
        model, probe = self.ref(), self.probe
        now = probe.calls if probe is not None else []
        kept = any(forward.started >= self.attached_at for forward in self.forwards)  # (a plain forward is whole)
        records = [record for record, _ in self.records()]
        lost = self.lost_before
        for each in (self.detached, probe):
            lost = lost.add(each) if each is not None else lost
        return {"name": self.name, "folder": self.slug, "class": self.model_class, "alive": model is not None,
                "attached": probe is not None, "excluded": self.excluded, "error": self.error,
                "head_kind": probe.kind.value if probe is not None else None,
                "layers": probe.layers if probe is not None else None,
                "hooks": count_hooks(model) if model is not None else 0,
                "calls": len(records),
                "recorded": sum(getattr(record, "complete", True) for record in records),  # (a forward is whole)
                "running": sum(_running(record) for record in records),
                "recording": probe is not None and (kept or not now or any(_records(call) for call in now)),
                **lost._asdict(),
                "live_dropped": self.dropped_before + (live.dropped if (live := self.live) is not None else 0),
                "engine": _engine(model)}


def _running(record: GenerationCall | Forward) -> bool:
    """Whether ``record`` is a call that has not ended yet (its end may still say why it is not recorded)."""
    return isinstance(record, GenerationCall) and record.ended is None and record.error is None


def _records(call: GenerationCall) -> bool:
    """Whether ``call`` says its probe records: it was recorded whole, or it runs."""
    return call.complete or _running(call)


class Models:
    """The models this process loaded, held weakly, in load order: found by name, with their records in memory."""

    def __init__(self, keep_calls: int) -> None:
        self.keep_calls = keep_calls
        self._lock = threading.Lock()
        self._watches: list[Watch] = []

    def add(self, model: Any, name: str, *, excluded: bool) -> Watch | None:
        """Watch ``model`` (loaded from ``name``); None when it is watched already."""
        with self._lock:
            if any(watch.ref() is model for watch in self._watches):
                return None
            watch = Watch(model, name, self._slug(name), excluded=excluded, keep_calls=self.keep_calls)
            self._watches.append(watch)
            return watch

    def _slug(self, name: str) -> str:
        # caller holds the lock
        tail = re.sub(r"[^A-Za-z0-9._-]+", "_", name.rstrip("/").rpartition("/")[2])[:48] or "model"
        base = f"{os.getpid()}-{tail}"
        taken = {watch.slug for watch in self._watches}
        slug, n = base, 1
        while slug in taken:
            n += 1
            slug = f"{base}-{n}"
        return slug

    def alive(self, models: str | list[str] | None = None) -> list[Watch]:
        """The models still alive (dead ones are dropped here), only those whose name matches one of the globs
        ``models`` (a list, as ``Settings.changes`` reads them, or a comma list) when given."""
        if isinstance(models, str):
            models = [glob.strip() for glob in models.split(",") if glob.strip()]
        globs = models or ["*"]
        with self._lock:
            self._watches = [watch for watch in self._watches if watch.ref() is not None]
            return [watch for watch in self._watches if matches(watch.name, globs)]

    def records(self) -> list[tuple[Watch, GenerationCall | Forward, dict]]:
        """(watch, record, meta) of every model's calls and forwards in memory, oldest first (by when they
        started, across models)."""
        return sorted([(watch, record, meta) for watch in self.alive() for record, meta in watch.records()],
                      key=lambda found: _started(found[1:]))

    def find(self, request_id: str, *, generation: bool = False,
             started: float | None = None) -> tuple[Watch, GenerationCall | Forward, dict] | None:
        """The newest call or forward in memory that served ``request_id`` (the newest generation call, with
        ``generation``: a request may score its prompt with a plain forward, then generate); with ``started``, the
        one that started then, as the request list says it (an id may serve several calls and forwards)."""
        for watch, record, meta in reversed(self.records()):
            if (record.request_id == request_id and (isinstance(record, GenerationCall) or not generation)
                    and (started is None or record.started == started)):
                return watch, record, meta
        return None

    def after_fork(self) -> None:
        self._lock = threading.Lock()


def tensor_parallel(name: str, model: Any) -> None:
    """ValueError (one line) for a model tensor parallelism shards (``tp_plan``): its probe gathers the sharded head,
    a collective every rank must enter at the same point, so it is attached only as the program loads it, on every
    rank at once. From nxl attach's thread or the control endpoint's (one process, at any moment) the gather met the
    ranks' own collectives and hung the program."""
    if sharded(unwrap(model)):
        raise ValueError(f"{name} is split over torchrun processes (tensor parallel), whose probes gather its head "
                         "together, each at the same point: it is recorded only from its load, so launch the "
                         "program under torchrun -m nxl_hooks run (not nxl attach, nxl ctl resume or nxl ctl attach)")


class Rules:
    """When and how a watched model carries a probe: attached with the current options unless paused or excluded;
    detached keeps its calls. Every change holds one lock, so a model loaded meanwhile gets the new rule."""

    def __init__(self, settings: Settings, live: "Live") -> None:
        self.settings = settings
        self.options = settings.attach_options()  #: layers, target, embedding: what `nxl ctl attach` changes
        self.paused = False
        self.live = live
        self._lock = threading.RLock()

    def adopt(self, watch: Watch, subject: Subject | None = None, *, at_load: bool = False) -> None:
        """A model just watched: attached unless paused or excluded (``subject``: the model already resolved).
        ``at_load``: called as the program's from_pretrained returns, in its own thread (:func:`tensor_parallel`)."""
        with self._lock:
            model = watch.ref()
            if not (self.paused or watch.excluded) and watch.probe is None and model is not None:
                self._attach(watch, model, subject, at_load)

    def _attach(self, watch: Watch, model: Any, subject: Subject | None, at_load: bool) -> None:
        # caller holds the lock
        settings = self.settings
        sink = None
        try:
            if not at_load:
                tensor_parallel(watch.name, model)
            subject = subject if subject is not None else Subject.of(model)  # resolved once, attach takes it
            # generate records (steps, a sink) only for models that generate; a classifier keeps its forwards
            generates = subject.kind is HeadKind.CAUSAL_LM
            if generates and settings.sink_spec:
                sink = make_sink(settings.sink_spec.replace("{model}", watch.slug))
            elif generates and settings.sink:  # only in the run folder nxl run or nxl attach made (0700): one
                # removed since (an interrupted nxl attach removes its own) is not made again here, 0755, by the sink
                sink = make_sink(f"folder:{check_private(settings.run_dir.resolve()) / watch.slug}",
                                 max_bytes=settings.sink_max_bytes, max_files=settings.sink_max_files)
            # the model's own tokenizer (loaded once, shared with the live view): every record, live or on disk,
            # carries its tokens' texts, and word targets (--target " Paris") resolve
            probe = attach(subject, **self.options, tokenizer=self._tokenizer(watch, model, self.options), sink=sink,
                           keep_steps=True, keep_calls=settings.keep_calls)
        except Exception as error:  # noqa: BLE001 - an unsupported model runs unrecorded
            if sink is not None:
                sink.close()  # a RotatingSink removes its empty file
            if isinstance(sink, RotatingSink):
                try:
                    sink.folder.rmdir()
                except OSError:  # not empty: earlier records of this model
                    pass
            watch.error = reason(f"model {watch.name}", error)
            return
        vars(model)[_PROBE] = probe  # the model's own: freed with it
        watch.error, watch.attached_at = None, time.time()
        if generates:
            self.live.follow(watch, probe)
        # a plain forward is a request of its own (a classifier's are all such; a causal LM's model(...) beside its
        # generate calls): keep each one's attribution
        watch.hook = probe.model.register_forward_hook(functools.partial(self._on_forward, watch, threading.local()))

    @staticmethod
    def _on_forward(watch: Watch, kept: threading.local, module: Any, args: tuple, output: Any) -> None:
        """After each forward of the model, in the host's thread, once the probe's own hook (put on before this
        one) has assembled it: keep a plain forward's attribution with the request it served. ``kept``: this
        thread's last one kept, which a forward inside a ``generate`` call leaves as the thread's result (its step
        is recorded in its call, never kept twice). Traced (the user's ``torch.compile(model)``), it does nothing:
        dynamo cannot follow the probe's per-thread state, and a traced hook must add no graph break. It peeks, never
        assembles: a compiled forward is assembled for the thread that asks ``probe.result()``, not taken here into
        whichever thread runs the next forward."""
        probe = watch.probe
        if probe is None or traced():
            return
        result = probe.peek()
        if not isinstance(result, Attribution) or result is getattr(kept, "last", None):
            return  # none yet, a forward the probe could not record (its reason was logged), or one kept already
        kept.last = result
        request_id = REQUEST_ID.get() or uuid.uuid4().hex
        watch.forwards.append(Forward(request_id, threading.current_thread().name, result))

    @staticmethod
    def _tokenizer(watch: Watch, model: Any, options: dict) -> Any:
        """The model's own tokenizer, so that every record carries its tokens' texts; None (ids recorded) when it
        does not fit the model (a program that added tokens and resized after loading) and no target names a
        token, rather than leave the model unrecorded."""
        tokenizer = watch.texts.tokenizer
        target = options.get("target")
        named = any(isinstance(t, str) and t != "predicted" for t in (target if isinstance(target, list) else [target]))
        if tokenizer is not None and not named and tokenizer_mismatch(unwrap(model), tokenizer):
            return None
        return tokenizer

    def _detach(self, watch: Watch) -> None:
        # caller holds the lock
        model = watch.ref()
        with watch.held:  # (a reader that took this probe's calls as live ones then reads them again as retired)
            probe = vars(model).pop(_PROBE, None) if model is not None else None
        if watch.hook is not None:
            watch.hook.remove()
            watch.hook = None
        if probe is not None:
            watch.retire(probe)  # before the detach: status counts what it lost while it detaches, and after
            meta = probe.describe()
            calls = probe.calls
            probe.detach()
            with watch.held:
                watch.retired.extend((call, meta) for call in calls)

    def pause(self, watches: list[Watch]) -> None:
        """Detach every probe: the models carry zero hooks until :meth:`resume`."""
        with self._lock:
            self.paused = True
            for watch in watches:
                self._detach(watch)

    def resume(self, watches: list[Watch]) -> None:
        """Attach again every model that is not excluded, with the current options."""
        with self._lock:
            self.paused = False
            for watch in watches:
                self.adopt(watch)

    def configure(self, watches: list[Watch], **options: Any) -> None:
        """Record ``watches`` with new attach ``options`` (layers, target, embedding), which become the process's
        options; unpaused, they are re-attached now. Options that do not fit one of them (a layer out of range...)
        raise ValueError and change nothing."""
        with self._lock:
            wanted = {**self.options, **{k: v for k, v in options.items() if v is not None}}
            subjects: dict[int, Subject] = {}  # each model resolved once: checked here, attached with it below
            for watch in watches:  # check first: a typo must not stop the recording
                model = watch.ref()
                if model is not None:
                    try:
                        tensor_parallel(watch.name, model)
                        subjects[id(watch)] = make_plan(model, **wanted,
                                                        tokenizer=self._tokenizer(watch, model, wanted)).subject
                    except Exception as error:  # noqa: BLE001 - said to the operator, nothing changed
                        raise ValueError(f"{watch.name}: {one_line(error)}; nothing changed") from None
            self.options = wanted
            for watch in watches:
                watch.excluded = False
                self._detach(watch)
                self.adopt(watch, subjects.get(id(watch)))

    def exclude(self, watches: list[Watch]) -> None:
        """Stop recording ``watches`` until :meth:`configure` takes them."""
        with self._lock:
            for watch in watches:
                watch.excluded = True
                self._detach(watch)

    def after_fork(self) -> None:
        self._lock = threading.RLock()


class LiveStep(NamedTuple):
    """One step as the live readers get it: the watched model, its call and the record."""

    watch: Watch
    call: GenerationCall
    step: Step


class Live:
    """The live readers (``nxl tail``, ``/v1/stream``): while any is connected, a thread per watched model reads its
    probe's subscription (the record pipeline's, off the host's generation thread) and hands each step to the bounded
    subscription of every reader that wants its request. A reader that falls behind loses its oldest steps (counted
    in its ``dropped``), never the host's time. With no reader the probes have no subscription, so their records are
    made as they cost least (a subscription makes each as its token is: ``BATCH_STEPS`` in hooks/generate.py)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readers: tuple[Subscription[LiveStep], ...] = ()  # replaced, never mutated: read without the lock
        self._followed: "weakref.WeakSet[Watch]" = weakref.WeakSet()  # watches whose probes feed the readers

    def follow(self, watch: Watch, probe: Probe) -> None:
        """Hand every step record of ``probe`` (``watch``'s new one) to the live readers while any is connected,
        until the probe detaches."""
        with self._lock:
            self._followed.add(watch)
            if self._readers:
                self._feed(watch, probe)

    def _feed(self, watch: Watch, probe: Probe) -> None:
        """Start reading ``probe``'s steps made from now on for the readers, from a thread of its own (caller holds
        the lock). A probe detached meanwhile (``nxl ctl pause`` in another thread) is not read."""
        self._stop(watch)
        try:
            live = probe.subscribe(follow=True, replay=False, calls=True)
        except RuntimeError:  # detached since: the watch's next probe is followed when it attaches
            return
        watch.live = live
        threading.Thread(target=self._hand_out, args=(watch, live), name="nxl_hooks-live", daemon=True).start()

    @staticmethod
    def _stop(watch: Watch) -> None:
        """Stop reading ``watch``'s probe for the readers, keeping the count of steps its feed dropped."""
        if watch.live is not None:
            watch.live.close()
            watch.dropped_before += watch.live.dropped
            watch.live = None

    def _hand_out(self, watch: Watch, steps: Subscription[tuple[GenerationCall, Step]]) -> None:
        for call, step in steps:
            if watch.live is not steps:  # stopped: what it still holds is for readers gone (a new feed serves others)
                return
            self.publish(watch, call, step)

    def subscribe(self, request_id: str | None = None) -> Subscription[LiveStep]:
        """A live reader of every step made from now on (only ``request_id``'s, when given)."""
        reader: Subscription[LiveStep] = Subscription(request_id=request_id, follow=True,
                                                      kept="the run's records keep them")
        with self._lock:
            first = not self._readers
            self._readers = (*self._readers, reader)  # before the feeds start: their first steps are its
            if first:  # the models' steps are read from now on
                for watch in list(self._followed):
                    probe = watch.probe
                    if probe is not None:
                        self._feed(watch, probe)
        return reader

    def unsubscribe(self, reader: Subscription[LiveStep]) -> None:
        with self._lock:
            self._readers = tuple(each for each in self._readers if each is not reader)
            if not self._readers:  # the last one left: nobody reads the models' steps as they are made
                for watch in list(self._followed):
                    self._stop(watch)
        reader.end()

    def publish(self, watch: Watch, call: GenerationCall, step: Step) -> None:
        """A step of ``call`` of ``watch``'s probe, in its live thread: hand it to the live readers, if any."""
        readers = self._readers
        if not readers:
            return
        try:
            for reader in readers:
                if reader.request_id is None or reader.wants(call):
                    reader.put(LiveStep(watch, call, step))
        except Exception as error:  # noqa: BLE001 - a live view must never stop a generation
            _log.warning("nxl_hooks: a live step was not handed out (%s: %s)", type(error).__name__, error)

    def after_fork(self) -> None:
        self._lock = threading.Lock()
        self._readers = ()


class Controller:
    """This process's :class:`Models`, the :class:`Rules` they are recorded by, its :class:`Live` readers and its
    control endpoint (module docstring). What the endpoint calls is here, each handed to the part that does it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.models = Models(settings.keep_calls)
        self.live = Live()
        self.rules = Rules(settings, self.live)
        self.endpoint: Any = None
        self._endpoint_lock = threading.Lock()
        self._endpoint_tried = False

    @property
    def options(self) -> dict:
        """The attach options models are recorded with now."""
        return self.rules.options

    @property
    def paused(self) -> bool:
        return self.rules.paused

    def adopt(self, model: Any, name: str, *, at_load: bool = False) -> None:
        """A model the program just loaded from ``name`` (``at_load``: as its from_pretrained returns, in its thread)
        or found loaded (nxl attach): watched, and attached unless paused or not selected."""
        try:
            watch = self.models.add(model, name, excluded=not self.settings.selects(name))
            if watch is not None:
                self.rules.adopt(watch, at_load=at_load)
            self._ensure_endpoint()
        except Exception as error:  # noqa: BLE001 - never into the program's from_pretrained
            reason(f"model {name}", error)

    def watches(self) -> list[Watch]:
        """The models still alive."""
        return self.models.alive()

    def pause(self) -> None:
        """Detach every probe: the models carry zero hooks until :meth:`resume`."""
        self.rules.pause(self.models.alive())

    def resume(self) -> None:
        """Attach again every model that is selected, with the current options."""
        self.rules.resume(self.models.alive())

    def configure(self, *, models: str | list[str] | None = None, **options: Any) -> None:
        """Record the models matching ``models`` (all by default) with new attach ``options`` (:meth:`Rules.configure`);
        :class:`NoMatch` when none does."""
        self.rules.configure(self._chosen(models), **options)

    def exclude(self, models: str | list[str] | None = None) -> None:
        """Stop recording the models matching ``models`` (all by default) until :meth:`configure` takes them;
        :class:`NoMatch` when none does."""
        self.rules.exclude(self._chosen(models))

    def _chosen(self, models: str | list[str] | None) -> list[Watch]:
        """The models alive that ``models`` selects (every one when not given); :class:`NoMatch` when globs given
        select none."""
        watches = self.models.alive(models)
        if models and not watches:
            raise NoMatch(models if isinstance(models, str) else ",".join(models),
                          [watch.name for watch in self.models.alive()])
        return watches

    def records(self) -> list[tuple[Watch, GenerationCall | Forward, dict]]:
        """(watch, record, meta) of every model's calls and forwards in memory, oldest first."""
        return self.models.records()

    def find(self, request_id: str, *, generation: bool = False,
             started: float | None = None) -> tuple[Watch, GenerationCall | Forward, dict] | None:
        """The newest call or forward in memory that served ``request_id`` (generation call, with ``generation``;
        the one that started at ``started``, when given: :meth:`Models.find`)."""
        return self.models.find(request_id, generation=generation, started=started)

    def subscribe(self, request_id: str | None = None) -> Subscription[LiveStep]:
        """A live reader of every step made from now on (only ``request_id``'s, when given)."""
        return self.live.subscribe(request_id)

    def unsubscribe(self, reader: Subscription[LiveStep]) -> None:
        self.live.unsubscribe(reader)

    def status(self) -> dict:
        """This process as ``/v1/status`` and ``nxl ctl status`` show it; each model's ``sink_fault`` and
        ``unrecorded`` say what is not being recorded and why."""
        return {"pid": os.getpid(), "paused": self.paused, "options": dict(self.options),
                "sink": self.settings.sink_spec or (str(self.settings.run_dir) if self.settings.sink else None),
                "keep_calls": self.settings.keep_calls,
                # forwards: how many of each model's calls in memory are plain forwards, which make no token
                "models": [{**watch.describe(), "forwards": len(watch.forwards)} for watch in self.watches()],
                "endpoint": self.endpoint.describe() if self.endpoint is not None else None}

    def close(self) -> None:
        """Detach every probe and close the endpoint: recording ends for good (``nxl_hooks.auto.controller()
        .close()``)."""
        self.pause()
        if self.endpoint is not None:
            self.endpoint.stop()
            self.endpoint = None

    def _ensure_endpoint(self) -> None:
        with self._endpoint_lock:
            if self._endpoint_tried:
                return
            self._endpoint_tried = True
        try:
            from .endpoint import ControlServer

            self.endpoint = ControlServer(self)
            self.endpoint.start()
        except Exception as error:  # noqa: BLE001 - recording goes on without a live readout
            self.endpoint = None
            _log.warning("nxl_hooks: no control endpoint in process %d (%s); records are kept all the same",
                         os.getpid(), typed(error))

    def after_fork(self) -> None:
        """In a child the program forked: fresh locks, and an endpoint of its own once it loads a model (the
        parent's threads are not here). The probes it inherited keep recording in memory; their files belong to
        the parent and are not written (:class:`~nxl_hooks.records.writer.RotatingSink`)."""
        for part in (self.models, self.rules, self.live):
            part.after_fork()
        for watch in self.models.alive():  # the parent's live thread is not here (nor its readers)
            Live._stop(watch)
        self._endpoint_lock = threading.Lock()
        self.endpoint, self._endpoint_tried = None, False


_CONTROLLER: Controller | None = None
_CONTROLLER_LOCK = threading.Lock()
_ENDED = False  #: nxl detach stopped this process's controller (nxl attach's start() clears it)
_FORK_HOOKED = False  #: start() registered _after_fork


def controller() -> Controller:
    """This process's controller, made on first use from the ``NXL_*`` environment (a private temporary run folder
    when ``NXL_RUN_DIR`` is not set, as under a plain ``import nxl_hooks.auto``)."""
    global _CONTROLLER
    with _CONTROLLER_LOCK:
        if _CONTROLLER is None and _ENDED:
            raise RuntimeError(f"recording in process {os.getpid()} was ended by nxl detach")
        if _CONTROLLER is None:
            run_dir = None
            if not os.environ.get("NXL_RUN_DIR"):
                from .runs import private_run_dir

                run_dir = private_run_dir()
            _CONTROLLER = Controller(Settings.from_env(os.environ, run_dir=run_dir))
            os.register_at_fork(after_in_child=_CONTROLLER.after_fork)
        return _CONTROLLER


def end() -> Controller | None:
    """End this process's recording: its controller, if it has one, is forgotten and returned (the caller closes
    it), and none is made again (:func:`controller` refuses, as after :func:`stop`): ``nxl detach`` of a process
    that records through the environment (a model process an attached server started)."""
    global _CONTROLLER, _ENDED
    with _CONTROLLER_LOCK:
        ctl, _CONTROLLER, _ENDED = _CONTROLLER, None, True
        return ctl


def start(settings: Settings) -> Controller:
    """Make this process's controller from ``settings`` instead of the environment: what ``nxl attach`` does inside
    a running process. RuntimeError when the process has one already (``nxl run``, ``import nxl_hooks.auto``, an
    earlier ``nxl attach``).

        ctl = start(Settings(run_dir=folder, layers="last")); ctl.adopt(model, "./my-model"); ...; stop(ctl)
    """
    global _CONTROLLER, _ENDED, _FORK_HOOKED
    with _CONTROLLER_LOCK:
        if _CONTROLLER is not None:
            raise RuntimeError(f"process {os.getpid()} is recorded already (run folder {_CONTROLLER.settings.run_dir})")
        _CONTROLLER, _ENDED = Controller(settings), False
        if not _FORK_HOOKED:  # once per process: fork hooks cannot be removed, the module's function holds none
            os.register_at_fork(after_in_child=_after_fork)
            _FORK_HOOKED = True
        return _CONTROLLER


def stop(ctl: Controller) -> None:
    """Close ``ctl`` (every probe detached, the endpoint closed) and forget it if it is this process's controller,
    so that nothing of it stays: ``nxl detach``."""
    global _CONTROLLER, _ENDED
    with _CONTROLLER_LOCK:
        if _CONTROLLER is ctl:
            _CONTROLLER, _ENDED = None, True  # a late patched call must not start a new one (controller())
    ctl.close()


def _after_fork() -> None:
    if _CONTROLLER is not None:
        _CONTROLLER.after_fork()
