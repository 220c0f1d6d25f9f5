"""Where finished generation records go: the probe's call list, the ``on_step`` callback, live subscribers
(:meth:`Probe.subscribe`) and the crash-safe sink. One hub per probe, shared by the calls of every thread.

- ``probe.calls`` keeps the last ``keep_calls`` calls (all by default), and every call still running, and unless
  ``keep_steps=False`` their steps;
- ``on_step(step)`` runs in the thread that runs ``generate``; an exception it raises never reaches ``generate``
  (nor a continuous-batching manager's loop; ``KeyboardInterrupt`` and ``SystemExit`` do, which is how Ctrl-C and
  ``nxl attribute --generate | head`` end it): that call (request) stops being recorded there, keeping the records
  the callback was handed, the one it raised on the last (also where several are scored together: a compiled
  call's), its error and one line in the log saying so;
- a subscription (bounded: a reader that falls behind loses its oldest records, counted, never stalling the
  generation) yields the steps of one call (the one running when it was made, else the next to start, or the
  one of a given request, also after it ended) or, with ``follow``, of every call until the probe detaches or the
  subscription is closed;
- the sink gets a ``call`` frame when a prompt is known (at the end, with no prompt, for a call whose prompt never
  ran: not recorded, or ended first), a ``step`` frame per record and an ``end`` frame.

The record pipeline. The thread that runs ``generate`` (the hot path) hands the steps it scores together to a
bounded queue (a :class:`Batch`: their tokens, the model's log-probabilities and what they read of the call's feature
cache, all where the model computed them) and goes on. On a GPU they are not scored yet: the hub's publisher thread
scores them (makes their records) while the generating thread waits for the device; elsewhere they come scored. The
publisher moves the records to the host, keeps them and feeds the subscribers, then queues their frames for the sink
thread, which writes them. So:

- the hot path reads nothing back from the device per step (``on_step`` is the exception: a callback in the
  generating thread gets each record there, on the host, scored there);
- the generating thread scores a batch itself where the head's readout cannot be read in another thread while the
  model runs (offloaded, quantized or adapter-wrapped: it is read between the model's forwards), and where the
  batches already waiting to be scored in the publisher keep :data:`UNSCORED_BYTES` (a publisher that falls behind
  holds no more); a batch still to be scored is never held back (below);
- a batch whose scoring fails in the publisher is lost, and its call is not recorded from there on: its error says
  why, in one line in the log, as for a failure in the hot path;
- a sink never stalls or raises into the host's call: one that raises (anything, ``SystemExit`` and
  ``KeyboardInterrupt`` included) or stops by itself (``fault``), or that falls :data:`SINK_QUEUE` frames behind,
  is stopped and closed; :attr:`Hub.sink_fault` says why (and one line in the log: a probe detached as the
  interpreter exits is read by nobody), :attr:`Hub.unwritten` counts the step records it did not get, and each
  call it leaves in memory only says so in its ``notes``;
- the records a call scores together (``generate``'s, :data:`~nxl_hooks.hooks.generate.BATCH_STEPS`) come as one
  item, and an engine's packed step gathers its requests' records (:meth:`Hub.gather`) and hands them on when its
  tokens are handed out: the publisher, and the sink thread after it, wake up once for them all (a wake-up costs
  the generating thread more than handing on the record does);
- while nothing reads records live (no sink, no subscriber), they are handed on together at the call's end (at
  most :data:`HELD` records at a time): the publisher wakes up once per call, not once per step;
- what the publisher handles in one go (the records of one continuous-batching step, or a backlog) reaches the
  sink thread and the subscribers at once, when it is done: one wake-up of each reader per batch rather than one
  per record, and a sink with ``write_steps`` (a :class:`~nxl_hooks.Sink`) writes the batch's step frames (and
  any backlog) with one ``write``; a batch holds only what was already waiting, so nothing is held back;
- the end of a call never waits for the sink, and for the publisher only as far as it must: while something
  reads records live (a subscriber, an ``on_step`` callback), until the call's records are handed to it; else
  until the call that ended before it has its records kept, so the steps a call emitted last are scored while the
  host goes on (one call's lag at most). Whoever reads the records waits for those of the calls that have ended
  (:meth:`Hub.settle`: ``probe.calls``, ``probe.steps``, ``probe.unrecorded``, ``probe.sink_fault``), so
  ``probe.steps`` holds every record once ``generate`` has returned; detaching waits up to :data:`DRAIN_SECONDS`
  for the sink to write what is queued, so a stream file read after the ``with`` block holds every record;
- a stream file on disk stays whole after SIGKILL: frames are written in order, each whole, so the file ends
  with a whole frame or a torn last one (the records still queued are lost).

After the probe detaches, calls still running in other threads finish in memory only: their sink is closed and
their subscribers have ended. The records such a call had made and not yet handed on (a batch scored together)
count as unwritten, :data:`CLOSED_AT_DETACH` in :attr:`Hub.sink_fault` and the call's notes saying why.
"""

from __future__ import annotations

import collections
import copy
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable, NamedTuple, Protocol, Union

import torch

from ..method.registry import DEFAULT
from ..records.sinks import BatchingSink, FaultingSink, LosingSink, RecordSink, make_sink
from ..records.steps import STEP_TENSORS, GenerationCall, Step
from ..records.view import Choice
from ..records.tokens import record_text
from ..records.writer import PartlyWritten
from .guard import logger, one_line, typed
from .subscription import LIVE_QUEUE, Subscription

__all__ = ["DETACHED", "DRAIN_SECONDS", "LIVE_QUEUE", "QUEUE", "SINK_QUEUE", "UNSCORED_BYTES", "Batch", "Hub",
           "Subscription", "host_copies", "on_host"]

#: Step records the publisher may have waiting; one more and the record is dropped (its call stops being recorded).
QUEUE = 4096
#: Frames the sink may have waiting; one more and the sink is stopped: it cannot keep up with generation.
SINK_QUEUE = 256
#: Step records held back while nothing reads them live (no sink, no subscriber): handed on together, at the
#: call's end or once this many wait, so that the publisher wakes up once per call rather than once per step.
HELD = 64
#: How long detaching waits for the sink to write the frames still queued.
DRAIN_SECONDS = 10.0
#: How long the end of a call waits for the publisher to hand on its records (it never waits for user code).
FLUSH_SECONDS = 60.0
#: The ``error`` of a call the probe's detach cut short (an engine's request may say more: the steps it dropped).
DETACHED = "the probe detached while this call ran"
#: :attr:`Hub.sink_fault` once a call the detach cut hands on records after it (see :meth:`Hub._to_sink`).
CLOSED_AT_DETACH = ("it was closed when the probe detached while a call ran in another thread: the step records that "
                    "call had not yet handed on then are in memory only")
#: What the batches handed on to be scored in the publisher may keep while they wait (their log-probability rows):
#: past this, the generating thread scores a batch itself, so a publisher that falls behind holds no more.
UNSCORED_BYTES = 256 << 20

#: Turns a step's token ids into their readable texts (None without a tokenizer).
Texts = Callable[[list[int]], "list[str] | None"]


#: A record's tensors beside its scores.
_FIELDS = tuple(name for name in (*STEP_TENSORS, "probability") if name not in DEFAULT)
#: Those of them that grow with its context, as its scores do.
_SIZED = frozenset({"embed_norm", "mask"})
#: What a record's context-sized tensor may hold on to of a storage other records share, beyond twice its own bytes.
_PINNED_BYTES = 16 << 10


def on_host(steps: list[Step], texts: Texts | None = None) -> list[Step]:
    """``steps`` with their tensors moved to the CPU (in place) and, given ``texts``, their ``readable`` token texts:
    what the publisher does with each batch of records, off the generating thread. Records scored together share
    their device tensors (each holds views of them): each device storage crosses once (:func:`host_copies`). On the
    host, a record's scores, embedding norms and mask that read a small part of what they share (the batch's
    longest context, every step's rows) become copies of their own, so that a record kept holds its own bytes, not
    its batch's. ``on_host(steps, plan.texts)``"""
    places: list[tuple[dict, str, bool]] = []  # (where a tensor sits, its key, whether it grows with the context)
    for step in steps:
        fields = vars(step)
        places += [(fields, name, name in _SIZED) for name in _FIELDS if isinstance(fields.get(name), torch.Tensor)]
        places += [(step.scores, name, True) for name in step.scores]
    for (where, name, sized), value in zip(places, host_copies([where[name] for where, name, _ in places])):
        where[name] = _own(value) if sized else value
    if texts is not None:
        for step in steps:
            step.readable = texts(step.token.tolist())
    return steps


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (on the host), or a compact copy of it where it holds on to a storage much larger than it reads."""
    read = tensor.numel() * tensor.element_size()
    return tensor.clone() if tensor.untyped_storage().nbytes() > 2 * read + _PINNED_BYTES else tensor


def host_copies(tensors: list[torch.Tensor], move: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.cpu, *,
                crosses: Callable[[torch.Tensor], bool] = lambda tensor: tensor.device.type != "cpu"
                ) -> list[torch.Tensor]:
    """``tensors`` on the CPU, each device storage they view crossing in one copy (``move`` of its span: from the
    first element any of them reads to the last): views of one storage come back views of one host storage, with
    their own offsets and strides. A storage read as several dtypes, or whose span is mostly what none of them reads
    (views of a larger buffer), crosses view by view; tensors that do not ``cross`` (those on the CPU) come back as
    they are."""
    out = list(tensors)
    shared: dict[tuple[torch.device, int], list[int]] = {}
    for index, tensor in enumerate(tensors):
        if crosses(tensor):
            shared.setdefault((tensor.device, tensor.untyped_storage().data_ptr()), []).append(index)
    for indices in shared.values():
        views = [tensors[index] for index in indices]
        spans = [(view.storage_offset(), view.storage_offset() + sum((size - 1) * stride for size, stride in
                                                                    zip(view.shape, view.stride())) + 1)
                 for view in views if view.numel()]
        first = min((start for start, _ in spans), default=0)
        length = max((end for _, end in spans), default=0) - first
        if len({view.dtype for view in views}) != 1 or length > 2 * sum(view.numel() for view in views) + _SLACK:
            for index in indices:
                out[index] = move(tensors[index])
            continue
        host = move(views[0].as_strided((length,), (1,), first))
        for index, view in zip(indices, views):
            out[index] = host.as_strided(view.shape, view.stride(), view.storage_offset() - first if view.numel()
                                         else 0)
    return out


#: Elements of a device storage that may cross with the views of it a batch of records holds and not be read.
_SLACK = 1 << 16


class Batch(Protocol):
    """Consecutive step records of one call, scored together, handed to :meth:`Hub.publish` before they are made:
    the hub makes them (:meth:`records`) in its publisher thread, off the generating one, where ``elsewhere`` allows
    and the batches waiting there keep less than :data:`UNSCORED_BYTES`, else at once in the generating thread."""

    count: int  #: how many records
    elsewhere: bool  #: whether its records may be made in another thread while the model runs
    nbytes: int  #: what it keeps until its records are made
    devices: tuple[torch.device, ...]  #: the CUDA devices of what it reads: made once the work queued there is done

    def records(self) -> list[Step]:
        """Its records, in order, their tensors where they were computed."""
        ...

    @property
    def dropped(self) -> bool:
        """Whether its call stopped being recorded before it (a batch before it was lost): its records are not
        delivered, even made."""
        ...

    def handed(self, count: int) -> None:
        """Its first ``count`` records were handed on (an ``on_step`` callback that raises after that does not take
        them back): its call's records reach at least the last of them, unless it is :meth:`lost`."""
        ...

    def lost(self, error: BaseException, step: int | None = None) -> None:
        """Making its records (those from its record of ``step`` on; None: all) failed in the publisher thread: they
        are lost, and its call says so (its error, one line in the log) and stops being recorded."""
        ...


def _unscored(item: "_Item") -> Batch | None:
    """The batch ``item`` hands the publisher to score, or None (records made already, or another item)."""
    return item.batch if isinstance(item, _StepItem) and item.steps is None else None


def _give(subscriber: Subscription, item: tuple[GenerationCall, Step] | None) -> None:
    """A record for ``subscriber`` (with its call), or (None) its end."""
    if item is None:
        subscriber.end()
    else:
        subscriber.record(*item)


class _StepItem(NamedTuple):
    """Consecutive step records of one call for the publisher (``records`` of them): made (``steps``), or not yet
    (None: the publisher makes ``batch``'s); ``ready``: the CUDA events after which what they read may be read."""
    call: GenerationCall
    steps: tuple[Step, ...] | None
    batch: Batch
    texts: Texts | None
    ready: tuple[torch.cuda.Event, ...]
    records: int


class _CallItem(NamedTuple):
    """A call's prompt was seen: its call frame for the sink."""
    call: GenerationCall


class _EndItem(NamedTuple):
    """A call returned or raised; ``done`` is set once its records are with the subscribers."""
    call: GenerationCall
    sequences: torch.Tensor | None
    error: str | None
    done: threading.Event


#: Why a call the probe's detach cut short ends where it does: one text, or each call's (:meth:`Hub.close`).
Why = Union[str, Callable[[GenerationCall], str]]


class _CloseItem(NamedTuple):
    """The probe detached (``why``): the publisher's last item."""
    why: Why


class _FlushItem(NamedTuple):
    """``written`` is set once the sink has written what was queued before it."""
    written: threading.Event


#: What the hot path hands the publisher thread, in order.
_Item = Union[_StepItem, _CallItem, _EndItem, _CloseItem, _FlushItem]


class Hub:
    """Hands every finished record to the call list, the callback, the subscribers and the sink (through the
    pipeline of the module docstring)."""

    def __init__(self, *, on_step: Callable[[Step], Any] | None, sink: Any, keep_steps: bool,
                 keep_calls: int | None = None, meta: dict | None = None) -> None:
        """``sink``: anything :func:`~nxl_hooks.records.sinks.make_sink` takes, or None; ``meta``: what the probe
        explains (``plan.describe()``), in every call frame."""
        if keep_calls is not None and keep_calls < 0:
            raise ValueError(f"keep_calls={keep_calls}: give a number of calls to keep (0 or more), or None for all")
        self._calls: collections.deque[GenerationCall] = collections.deque()
        self._keep_calls = keep_calls
        self._on_step = on_step
        self._callback = threading.local()  # the calls whose on_step callback this thread is in (calling_back)
        self._sink: RecordSink | None = None if sink is None else make_sink(sink)
        if self._sink is not None:
            _claim_sink(self._sink, self)
        self._owner = os.getpid()  # the process whose sink it is (see _parents_sink)
        #: why the sink stopped getting records (one line), None while it is healthy or when there is none
        self.sink_fault: str | None = None
        #: step records the sink did not get because it had stopped (or was still behind at detach)
        self.unwritten = 0
        self._lost = 0  # of those, the ones the sink lost after taking them (its ``lost``)
        self._keep = keep_steps
        self._meta = dict(meta or {})
        # Reentrant: a model collected (by a garbage collection any allocation may start) while this thread holds a
        # lock closes its probe's hub from inside that thread.
        self._lock = threading.RLock()
        self._counter = 0
        self._subscribers: "weakref.WeakSet[Subscription]" = weakref.WeakSet()
        self._running: list[GenerationCall] = []
        self._ended: threading.Event | None = None  # the last call's end handed on: set once its records are kept
        self._later: threading.Thread | None = None  # the last call end made in a thread of its own (end_later)
        self._later_lock = threading.Lock()  # who starts the next one, once the one before is done
        self._closed = False  # the probe detached: records go to memory only, in the calling thread
        # The publisher and the sink thread, their queues and their backlogs (started with the first record, and
        # again in a forked child, which has none of its parent's threads).
        self._pid = -1
        self._items: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._frames: queue.SimpleQueue = queue.SimpleQueue()
        self._publisher: threading.Thread | None = None
        self._writer: threading.Thread | None = None
        self._waiting = self._frames_waiting = 0
        # items queued (or held) for the publisher and not yet handled, frames the sink thread is writing: with
        # _frames_waiting, whether anything handed on is still on its way (flush's answer when nothing is)
        self._unfinished = self._writing = 0
        self._unscored_bytes = 0  # bytes the batches waiting to be scored in the publisher keep (see UNSCORED_BYTES)
        self._held: collections.deque[_Item] = collections.deque()  # see HELD
        self._held_records = 0
        #: each gathering thread's step records waiting for release() (by thread object: an id is reused)
        self._gathered: dict[threading.Thread, list[tuple[_Item, int]]] = {}
        # what the publisher's current batch hands on when it is done: frames for the sink thread, records for
        # the subscribers
        self._outbox: list[tuple] = []
        self._live: list[tuple[Subscription, tuple[GenerationCall, Step] | None]] = []
        # the frames the sink thread took from its queue and has not yet begun to write (see _take)
        self._hand: collections.deque[tuple] = collections.deque()
        self._stopped = False  # the sink was stopped (fault, behind or detach): frames are counted, not written
        self._released = False  # the sink was closed (once, by the sink thread when there is one)
        self._last_frame = False  # the sink was handed its close frame (the probe detached): it takes no more

    @property
    def calls(self) -> list[GenerationCall]:
        with self._lock:
            return list(self._calls)

    @property
    def forked(self) -> bool:
        """Whether this process was forked from the one that made the hub (the sink and the threads are that one's,
        and its locks may have been held by one of that one's threads at the fork)."""
        return self._owner != os.getpid()

    def begin(self, layers: list[int], *, request_id: str | None, thread: str | None, model: str | None = None,
              error: str | None = None, ended: bool = True, choice: Choice | None = None) -> GenerationCall:
        """A new call record (of ``model``, by name, for ``choice`` of its request); with ``error`` it is one that is
        not recorded (its reason says why), ended at once: the sink gets its call frame, with no prompt, and its end
        frame, which says why.
        ``ended=False``: the caller ends it (:meth:`end`) when the call itself has returned or raised."""
        # its own, nested dicts (versions, quantization) too: a reader may edit it, and the call frames the sink gets
        # after it are written from this hub's (copied before the lock, which the publisher takes for every record)
        meta = copy.deepcopy(self._meta) if self._meta else None
        with self._lock:
            # every text a record takes from outside as records keep it (a thread's or request's name may be any str)
            call = GenerationCall(index=self._counter, layers=list(layers), request_id=record_text(request_id),
                                  thread=record_text(thread), model=record_text(model), error=record_text(error),
                                  meta=meta, choice=choice)
            if self.sink_fault is not None:
                call.notes.append(self._fault_note())
            self._counter += 1
            self._calls.append(call)
            if not self._closed:
                self._running.append(call)
            self._trim()
        if error is not None and ended:
            self.end(call, None, error, wait=False)
        return call

    def _trim(self) -> None:
        """Keep the last ``keep_calls`` calls, and every older one still running: the live feed and the lookups by
        request id find a request through it while its steps are made (caller holds the lock)."""
        older = 0 if self._keep_calls is None else len(self._calls) - self._keep_calls
        if older > 0:
            running = set(self._running)
            self._calls = collections.deque(call for index, call in enumerate(self._calls)
                                            if index >= older or call in running)

    @property
    def listened(self) -> bool:
        """Whether a step record made now goes anywhere: kept, a callback, a subscriber or a sink."""
        return self._keep or self._sink is not None or self.live

    @property
    def calls_back(self) -> bool:
        """Whether an ``on_step`` callback wants each record in the thread that made it (made there, then)."""
        return self._on_step is not None

    def calling_back(self, call: GenerationCall) -> bool:
        """Whether this thread is in an ``on_step`` callback of ``call``'s records: a forward that reaches the call
        meanwhile is the callback's, not the call's (:meth:`~.generate.Run.before_forward`); a ``generate`` call the
        callback makes is a call of its own."""
        return self._on_step is not None and any(waiting is call for waiting in getattr(self._callback, "calls", ()))

    @property
    def live(self) -> bool:
        """Whether a step record is read as it is made: an ``on_step`` callback or a subscriber."""
        return self._on_step is not None or bool(self._subscribers)

    # -- the hot path ------------------------------------------------------------------------------------

    def prompt(self, call: GenerationCall, ids: torch.Tensor | None, mask: torch.Tensor, *,
               readable: list[list[str]] | None, template: torch.Tensor | None, special_ids: list[int] | None,
               target_texts: dict[int, str] | None = None,
               joining: tuple[str, str, bool, bool] = ("", "", False, False)) -> None:
        """``call``'s prompt ran recorded: its ids, mask, token texts, template positions, special ids, fixed
        targets' texts and how its tokenizer joins tokens (``joining``: :meth:`~.plan.Plan.joining`), set in one
        place, the mask last: a detach meanwhile writes the call frame with all of them or, the mask still None,
        with none (:func:`~nxl_hooks.records.writer.encode_call`)."""
        with self._lock:
            call.readable, call.prompt_template, call.special_ids = readable, template, special_ids
            call.target_texts = target_texts
            call.separator, call.continuation, call.cleanup, call.clean_up_spaces = joining
            call.prompt_ids = ids
            call.prompt_mask = mask
        self._submit(_CallItem(call))

    def publish(self, call: GenerationCall, batch: Batch, texts: Texts | None = None) -> None:
        """Hand on ``batch``, consecutive records of ``call`` scored together (``texts`` makes their readable texts,
        on the host), as one item: the publisher makes them, moves them to the host, and it and the sink thread wake
        up once for them all. Made here instead where the batch cannot be made elsewhere, or for an ``on_step``
        callback (which wants each record in this thread, on the host: each is handed on alone, then given to it);
        then what making them raises, or the callback, is the caller's; made here too once the batches waiting to be
        made there keep :data:`UNSCORED_BYTES`. RuntimeError when the publisher would be more than :data:`QUEUE`
        records behind: that call stops being recorded.
        ``hub.publish(call, batch, plan.texts)``"""
        if self._on_step is not None:
            # each record handed on just before the callback gets it: one that raises (the call's records stop
            # there) leaves its call with the records it was handed, its own the last, as one per batch would
            for index, step in enumerate(on_host(batch.records(), texts)):
                call.claim(step)  # its call's flags for the callback's to_attribution(), whatever the publisher did
                self._submit(_StepItem(call, (step,), batch, None, (), 1), records=1)
                batch.handed(index + 1)
                waiting = self._callback.__dict__.setdefault("calls", [])
                waiting.append(call)
                try:
                    self._on_step(step)
                finally:
                    waiting.pop()
            return
        here = not batch.elsewhere or self._unscored_bytes + batch.nbytes > UNSCORED_BYTES
        made = tuple(batch.records()) if here else None
        # the publisher reads them once the work queued so far on this thread's streams is done (a blocking event:
        # waiting for it sleeps instead of spinning a core)
        ready = [torch.cuda.Event(blocking=True) for _ in batch.devices]
        for event, device in zip(ready, batch.devices):
            event.record(torch.cuda.current_stream(device))
        self._submit(_StepItem(call, made, batch, texts, tuple(ready), batch.count), records=batch.count)
        batch.handed(batch.count)

    def end(self, call: GenerationCall, sequences: torch.Tensor | None, error: str | None = None, *,
            wait: bool = True) -> None:
        """The call returned (``sequences``: its output ids) or raised (None); ``error``: why records are missing.
        Returns once its records are kept and handed to the subscribers while something reads them live (a
        subscriber, an ``on_step`` callback), else once the call that ended before it has its records kept: its own
        are then scored while the host goes on, off its critical path (readers of the calls wait for them:
        :meth:`settle`), and the publisher is never more than one call behind. Never waits for the sink.
        ``wait=False`` (an engine's request, ended in the loop that runs every request's steps): returns at once;
        :data:`QUEUE` and :data:`UNSCORED_BYTES` bound how far behind the publisher falls."""
        done = threading.Event()
        with self._lock:
            if not self._closed:
                self._start()  # first: a forked child has no earlier call of its own to wait for
            previous, self._ended = self._ended, done
            awaited = done if self.live else previous
        try:
            queued = self._submit(_EndItem(call, sequences, error, done))
        except BaseException:
            done.set()  # never handed on: no reader waits for it
            raise
        if not queued:
            done.set()  # handled here: the probe detached
        elif wait and awaited is not None and not self._on_thread():
            awaited.wait(FLUSH_SECONDS)

    def end_later(self, finish: Callable[[], None]) -> None:
        """Run ``finish``, which ends a call (it calls :meth:`end`), in a thread of its own, so that the caller goes
        on: a compiled ``generate`` call's positions are run again there when it returns
        (:meth:`~.generate.Run.finish`). One at a time, in order: the caller first waits until the one before is
        done, so at most one call's end is behind. The records' readers (:meth:`settle`, :meth:`flush`) wait for
        it, and so does the probe's detach (:meth:`wait_later`), before its hooks go. ``finish`` never raises."""
        with self._later_lock:
            self._join(self._later, FLUSH_SECONDS)
            thread = threading.Thread(target=finish, name="nxl_hooks-refill", daemon=True)
            thread.start()  # (one that cannot start is never waited for: the caller makes the end itself)
            self._later = thread

    def wait_later(self, timeout: float = FLUSH_SECONDS) -> bool:
        """Wait until the call ends handed to :meth:`end_later` so far are made; whether they were within
        ``timeout``. Not in that thread itself, nor in the publisher or the sink thread (a garbage collection there
        may detach the probe), which that thread's end may wait for."""
        return not self._on_thread() and self._join(self._later, timeout)

    def settle(self, timeout: float = FLUSH_SECONDS) -> bool:
        """Wait until every call that has ended (:meth:`end_later`'s too) has its records kept and handed to the
        subscribers (the publisher handles them in order: the last end handed on is done last); whether they were
        within ``timeout``."""
        if self._on_thread():
            return True
        self.wait_later(timeout)
        ended = self._ended
        return ended is None or ended.wait(timeout)

    def flush(self, timeout: float = DRAIN_SECONDS) -> bool:
        """Wait until the records handed on so far are kept and written by the sink (or the sink stopped); whether
        they were within ``timeout`` seconds (True with nothing on its way, whatever the timeout: ``flush(0)``).
        After the probe detached: until a sink still busy then has finished (what it had not written counted in
        :attr:`unwritten`, its calls noted)."""
        self.wait_later(timeout)
        if self._closed:
            return self._join(self._writer, timeout)
        if self._idle():
            return True
        written = threading.Event()
        if self._submit(_FlushItem(written)) and self._on_thread():
            return False
        return written.wait(timeout)

    def _idle(self) -> bool:
        """Nothing handed on is on its way: no call end being made (:meth:`end_later`), no item queued, held or
        gathered for the publisher or in its hands, no frame waiting for the sink thread or being written."""
        # the call end's thread first: asked after the counts, it could hand its end on and finish in between
        later = self._later
        if later is not None and later.is_alive():
            return False
        with self._lock:
            if self._pid != os.getpid():  # nothing handed on in this process yet (or only a parent's, not ours)
                return True
            return not (self._unfinished or self._frames_waiting or self._writing or any(self._gathered.values()))

    def gather(self) -> None:
        """Step records this thread publishes from now on wait, in order, until :meth:`release` (or anything else
        handed on, by any thread) sends them: an engine's packed step hands on its requests' records together, so
        the publisher wakes up once per step, not once per request. ``hub.gather(); ...; hub.release()``"""
        self.release()
        with self._lock:
            if not self._closed:
                self._gathered[threading.current_thread()] = []

    def release(self) -> None:
        """Send the step records this thread gathered (see :meth:`gather`), and stop gathering."""
        with self._lock:
            gathered = self._gathered.pop(threading.current_thread(), None)
            if gathered and not self._closed:
                self._queue(gathered)

    def _submit(self, item: _Item, *, records: int = 0) -> bool:
        """Queue ``item`` for the publisher (True) or, after the probe detached, handle it here, in memory only
        (False). RuntimeError when an item of step ``records`` would put more than :data:`QUEUE` records in
        waiting: that call stops being recorded. Records gathered by any thread (:meth:`gather`) go before it."""
        with self._lock:
            if not self._closed:
                self._start()  # first: a forked child starts with its own threads and counts
                if records and self._waiting + records > QUEUE:
                    raise RuntimeError(f"the record pipeline is {QUEUE} step records behind (its publisher thread "
                                       "is starved); this call's later steps are not recorded")
                self._waiting += records
                batch = _unscored(item)
                self._unscored_bytes += batch.nbytes if batch is not None else 0
                gathered = self._gathered.get(threading.current_thread()) if records else None
                if gathered is not None:
                    gathered.append((item, records))
                    return True
                gathering = threading.current_thread() in self._gathered
                earlier = self._take_gathered()  # other threads hand on directly until they gather again
                if gathering:  # this one goes on gathering its step's later records
                    self._gathered[threading.current_thread()] = []
                self._queue([*earlier, (item, records)])
                return True
        self._join(self._publisher, FLUSH_SECONDS)  # what was queued before the detach comes first
        self._handle(item)
        return False

    def _take_gathered(self) -> list[tuple[_Item, int]]:
        """Every thread's gathered step records, in order, and no thread gathering any more (caller holds the
        lock)."""
        taken = [entry for waiting in self._gathered.values() for entry in waiting]
        self._gathered.clear()
        return taken

    def _queue(self, items: list[tuple[_Item, int]]) -> None:
        """Queue items (of step ``records`` each) for the publisher in order, each step item held back while nothing
        reads records live (:data:`HELD`), but one still to be scored (the publisher scores it now, while the
        generating thread waits for its device); caller holds the lock, the hub is open and started."""
        for item, records in items:
            self._unfinished += 1  # (until the publisher has handled it: _publish_loop)
            if (records and self._sink is None and not self._subscribers and self._held_records < HELD
                    and _unscored(item) is None):
                self._held.append(item)
                self._held_records += records
            else:
                self._hand_on()
                self._items.put(item)

    def _hand_on(self) -> None:
        """Queue the step records held back, in order (caller holds the lock)."""
        while self._held:
            self._items.put(self._held.popleft())
        self._held_records = 0

    def _on_thread(self) -> bool:
        """Whether this is the publisher or the sink thread (a garbage collection there may close the hub)."""
        return threading.current_thread() in (self._publisher, self._writer)

    @staticmethod
    def _join(thread: threading.Thread | None, timeout: float) -> bool:
        """Wait for ``thread`` to end (not when it is this one); whether it has."""
        if thread is None or thread is threading.current_thread():
            return thread is None
        thread.join(timeout)
        return not thread.is_alive()

    def _start(self) -> None:
        """The publisher thread, and the sink thread when there is a sink (caller holds the lock)."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()  # a forked child starts its own threads, with fresh queues
        self._items, self._frames = queue.SimpleQueue(), queue.SimpleQueue()
        self._held.clear()
        self._gathered.clear()
        self._held_records = 0
        self._outbox, self._live, self._hand = [], [], collections.deque()
        self._waiting = self._frames_waiting = self._unscored_bytes = self._unfinished = self._writing = 0
        self._ended = None  # (a parent's last call is not this process's to wait for)
        self._publisher = threading.Thread(target=self._publish_loop, name="nxl_hooks-publisher", daemon=True)
        self._publisher.start()
        self._writer = self._sink_thread() if self._sink is not None and not self._parents_sink() else None

    def _sink_thread(self) -> threading.Thread | None:
        """The sink thread, started on the current frame queue; None where no thread can start (the interpreter
        is shutting down): the frames are then written in the thread that queues them."""
        writer = threading.Thread(target=self._write_loop, args=(self._frames,), name="nxl_hooks-sink", daemon=True)
        try:
            writer.start()
        except RuntimeError:
            return None
        return writer

    # -- the publisher -----------------------------------------------------------------------------------

    def _publish_loop(self) -> None:
        items = self._items
        while True:
            item = items.get()
            try:
                self._handle(item)
            except BaseException as error:  # noqa: BLE001 - the publisher outlives any one record
                logger.warning("nxl_hooks: a record was lost (%s); the model's own call is unaffected", typed(error))
            finally:
                if isinstance(item, _StepItem):
                    with self._lock:
                        self._waiting -= item.records
                        batch = _unscored(item)
                        self._unscored_bytes -= batch.nbytes if batch is not None else 0
                if isinstance(item, (_EndItem, _CloseItem)) or len(self._outbox) >= HELD or items.empty():
                    self._send()  # before the end is signalled: its records are with the subscribers
                if isinstance(item, _EndItem):
                    item.done.set()
                with self._lock:
                    self._unfinished -= 1  # (after its frames went to the sink thread's queue: counted there)
            if isinstance(item, _CloseItem):
                return
            item = batch = None  # a batch handled holds its call's run, and so the model: not while this one waits

    def _send(self) -> None:
        """Hand on what this batch made: the sink thread's frames in one queue item, the subscribers' records."""
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self._frames.put(batch)
        if self._live:
            live, self._live = self._live, []
            for subscriber, step in live:
                _give(subscriber, step)

    def _tell(self, subscriber: Subscription, item: tuple[GenerationCall, Step] | None) -> None:
        """Give ``subscriber`` a record (None: the end): with the publisher's batch, after the records before it."""
        if threading.current_thread() is self._publisher:
            self._live.append((subscriber, item))
        else:
            _give(subscriber, item)

    def _handle(self, item: _Item) -> None:
        if isinstance(item, _StepItem):
            made, batch = item.steps, item.batch
            if batch.dropped:  # a batch of its call before it was lost here: not recorded from there on (made in
                return  # the generating thread meanwhile, or not yet)
            if made is not None:
                for event in item.ready:
                    event.synchronize()
            else:
                try:
                    for event in item.ready:
                        event.synchronize()
                    made = tuple(batch.records())
                except BaseException as error:  # noqa: BLE001 - its call says so (its ``lost``); the publisher goes on
                    batch.lost(error)
                    if not isinstance(error, Exception) and not self._on_thread():
                        raise  # handled in the caller's thread (the hub closed): an interrupt is the caller's
                    return
            try:
                steps = on_host(list(made), item.texts)
            except Exception:  # noqa: BLE001 - one record's texts or copy failed: the others still go on
                steps = self._one_by_one(item, made)
            for step in steps:
                self._deliver(item.call, step)
        elif isinstance(item, _CallItem):
            self._to_sink(item.call, lambda sink: sink.write_call(item.call, self._meta))
        elif isinstance(item, _EndItem):
            self._end(item.call, item.sequences, item.error)
        elif isinstance(item, _CloseItem):
            self._shut(item.why)
        else:
            self._to_sink(None, item.written)

    def _one_by_one(self, item: _StepItem, made: tuple[Step, ...]) -> list[Step]:
        """``made``'s records that reach the host one by one, their batch having failed to. A record whose token
        texts cannot be made goes on without them (said in its call's notes); the first that cannot cross is lost,
        and its call's records stop there, as a lost batch's do: a call's steps never have a gap (a reader takes one
        for damage)."""
        crossed = []
        for step in made:
            try:
                on_host([step])
            except Exception as error:  # noqa: BLE001 - its call says so (its batch's ``lost``)
                item.batch.lost(error, step.step)
                break
            if item.texts is not None:
                try:
                    step.readable = item.texts(step.token.tolist())
                except Exception as error:  # noqa: BLE001 - the tokenizer's code: the record keeps its numbers
                    self.note(item.call, f"the token texts of step {step.step} could not be made ({typed(error)})")
            crossed.append(step)
        return crossed

    def note(self, call: GenerationCall, lost: str, *, log: bool = True) -> None:
        """Records of ``call`` were ``lost`` past what its error says: one line in the log (unless ``log`` is False:
        what the call itself chose, not a fault), one in its notes.
        ``hub.note(call, "the record of step 3 was lost (...)")``"""
        if log:
            logger.warning("nxl_hooks: %s; the model's own call is unaffected", lost)
        with self._lock:
            call.notes.append(lost)

    def _deliver(self, call: GenerationCall, step: Step) -> None:
        call.link(step)  # the step's context texts, for to_attribution() wherever the step goes
        with self._lock:
            if self._keep:
                call.steps.append(step)
            if self._subscribers:  # iterating an empty WeakSet is not free, and this runs once per step
                for subscriber in list(self._subscribers):
                    if subscriber.wants(call):
                        self._tell(subscriber, (call, step))
        self._to_sink(call, None, step=step)

    def _end(self, call: GenerationCall, sequences: torch.Tensor | None, error: str | None) -> None:
        with self._lock:
            if call not in self._running:  # ended already (the probe detached while it ran)
                call.sequences = sequences
                if error is not None and call.error is not None and error.startswith(call.error):
                    # the thread that ran it ended it after the detach, saying more of what the detach cut (an
                    # engine's request: the steps it dropped unscored); the records in memory say it, a stream ended
                    call.error = error
                return
            self._running.remove(call)
            call.sequences, call.error, call.ended = sequences, call.error or error, time.time()
            call.complete = sequences is not None and call.error is None
            ended = self._release(call)
            self._trim()
        self._end_frames(call)
        for subscriber in ended:
            self._tell(subscriber, None)

    def _end_frames(self, call: GenerationCall) -> None:
        """``call``'s end frame for the sink; first its call frame, with no prompt, where its prompt never ran (not
        recorded, or ended before its first forward): a stream says what became of every call."""
        if call.prompt_mask is None:
            self._to_sink(call, lambda sink: sink.write_call(call, self._meta))
        self._to_sink(call, lambda sink: sink.write_end(call))

    def _release(self, call: GenerationCall) -> list[Subscription]:
        """The subscribers bound to ``call`` alone, taken off the list (caller holds the lock)."""
        ended = [s for s in self._subscribers if not s.follow and s.call is call]
        for subscriber in ended:
            self._subscribers.discard(subscriber)
        return ended

    def subscribe(self, *, request_id: str | None = None, follow: bool = False,
                  size: int | None = LIVE_QUEUE, replay: bool = True, calls: bool = False) -> Subscription:
        """A live iterator of step records, holding up to ``size`` unread (see the module docstring); ``replay``:
        a call already running gives the steps it made before first; ``calls``: each item is ``(call, step)``."""
        # what the line of a reader that falls behind says of the records it drops: only where they are kept
        kept = [where for where, keeps in (("probe.calls", self._keep), ("the sink", self._sink is not None)) if keeps]
        subscription: Subscription = Subscription(self, request_id=request_id, follow=follow, size=size,
                                                  calls=calls, kept=f"{' and '.join(kept)} keep"
                                                  f"{'s' if len(kept) == 1 else ''} them" if kept else None)
        self.settle()  # the calls that have ended are done (kept, not read live) before this reader starts
        with self._lock:
            self._hand_on()  # from now on records are read live
            if self._closed:
                subscription.end()
                return subscription
            running = [call for call in self._running if subscription.wants(call)]
            if not running and not follow and request_id is not None:
                # that request already ended: its kept records, then the end
                done = next((c for c in reversed(self._calls) if c.request_id == request_id), None)
                if done is not None:
                    subscription.call = done
                    for step in done.steps:
                        subscription.record(done, step)
                    subscription.end()
                    return subscription
            for call in running if follow else running[:1]:  # joined mid-call: replay what it already produced
                subscription.call = None if follow else call
                for step in call.steps if replay else ():
                    subscription.record(call, step)
            self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self.settle()  # a call that ended before may still be scored (off its thread, on a GPU): its records first
        with self._lock:
            self._subscribers.discard(subscription)

    # -- detach ------------------------------------------------------------------------------------------

    def close(self, why: Why = DETACHED) -> None:
        """The probe detaches: running calls are marked incomplete (end frames written), saying ``why`` (a text, or
        one per call), streams end, the sink writes what is queued (for up to :data:`DRAIN_SECONDS`) and closes.
        Calls still running in other threads go on unharmed and keep their records in memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            started = self._pid == os.getpid()
            if started:
                self._hand_on()
                for item, _ in self._take_gathered():  # what threads gathered comes after that, before the end
                    self._items.put(item)
                    self._unfinished += 1
                self._items.put(_CloseItem(why))
                self._unfinished += 1
                writer = self._writer
            else:  # detached before any record: the sink still closes in a thread of its own, so that the detach
                # waits for it no longer than after a call (a forked child leaves its parent's sink alone)
                writer = self._writer = (self._sink_thread() if self._sink is not None and not self._parents_sink()
                                         else None)
        if not started:
            self._shut(why)
        if self._on_thread():  # a garbage collection in the pipeline's own thread: it finishes by itself
            return
        self._join(self._publisher if started else None, FLUSH_SECONDS)
        if self._join(writer, DRAIN_SECONDS):
            return
        with self._lock:
            closing = self._released  # every frame was written: its thread is in the sink's close
        if closing:  # (a Parquet file is written there): it is left to finish; a failure there is said then
            logger.warning("nxl_hooks: the sink %s is still closing %g s after the probe detached; it finishes in "
                           "its own thread", _named(self._sink), DRAIN_SECONDS)
            return
        self._stop_sink(f"it was still writing when the probe detached ({DRAIN_SECONDS:g} s later); the records "
                        "still queued were not written", None,
                        queued=f"it was still writing {DRAIN_SECONDS:g} s after the probe detached")

    def _shut(self, why: Why) -> None:
        """The publisher's last item: end the running calls and the streams, then the sink."""
        with self._lock:
            running, self._running = self._running, []
            subscribers = list(self._subscribers)
            self._subscribers = weakref.WeakSet()
            ended = time.time()  # they stop being recorded now, though they go on running (GenerationCall.ended)
            for call in running:
                call.error, call.ended = call.error or (why if isinstance(why, str) else why(call)), ended
            self._trim()
        for call in running:
            self._end_frames(call)
        self._to_sink(None, None)
        for subscriber in subscribers:
            self._tell(subscriber, None)

    # -- the sink thread ---------------------------------------------------------------------------------

    def _to_sink(self, call: GenerationCall | None, action: Callable[[RecordSink], None] | None, *,
                 step: Step | None = None) -> None:
        """Queue one frame for the sink thread: ``step``'s record, else ``action`` (one RecordSink call; None: close
        the sink; an Event: set it once what comes before is written). The publisher's frames go in its current
        batch (:meth:`_send`). A sink :data:`SINK_QUEUE` frames behind is stopped."""
        control = step is None and (action is None or isinstance(action, threading.Event))
        if self._sink is None:
            if isinstance(action, threading.Event):
                action.set()
            return
        self._parents_sink()
        with self._lock:
            if self._last_frame and step is not None and self.sink_fault is None:
                # a call the detach cut runs on in another thread and hands on the records it had waiting (a
                # batch scored together): they were made while attached, so they count as unwritten, and say why
                self.sink_fault = CLOSED_AT_DETACH
            if (self._stopped or self._last_frame) and not control:
                self._count(call, step is not None)
                return
            if control or self._frames_waiting < SINK_QUEUE:
                self._frames_waiting += 1
                self._last_frame = self._last_frame or (step is None and action is None)
                if self._writer is None or not self._writer.is_alive():  # detached before any record
                    self._write(call, action, step)
                elif threading.current_thread() is self._publisher:
                    self._outbox.append((call, action, step))
                else:
                    self._frames.put([(call, action, step)])
                return
        self._stop_sink(f"it fell behind: {SINK_QUEUE} frames were waiting to be written while generation went on, "
                        "so it was stopped to keep generation at its speed", call, steps=step is not None)

    def _write_loop(self, frames: queue.SimpleQueue) -> None:
        try:
            many = self._sink.write_steps if isinstance(self._sink, BatchingSink) else None
        except Exception:  # noqa: BLE001 - the sink's code (Python 3.11's isinstance reads it): one frame at a time
            many = None
        while True:
            batch = frames.get()
            while not frames.empty():  # a backlog goes in one batch
                batch += frames.get()
            with self._lock:
                self._hand.extend(batch)
            while taken := self._take(many is not None):
                call, action, step = taken[0]
                if many is not None and step is not None:
                    self._write_steps(many, taken)
                    continue
                self._write(call, action, step)
                if step is None and action is None:
                    return

    def _take(self, many: bool) -> list[tuple]:
        """The next frames the sink thread writes at once, out of the batch in its hand: a run of step frames where
        the sink takes several (``many``), else one. Under the lock: what is left in the hand while the sink
        writes them is :meth:`_abandon_queued`'s to count, should the sink never come back."""
        with self._lock:
            taken = [self._hand.popleft()] if self._hand else []
            while many and taken and taken[0][2] is not None and self._hand and self._hand[0][2] is not None:
                taken.append(self._hand.popleft())
            return taken

    def _write(self, call: GenerationCall | None, action: Callable[[RecordSink], None] | None,
               step: Step | None) -> None:
        """Write one frame (``step``'s, else ``action``'s; ``action`` None: close the sink); a sink that fails or
        stops by itself is stopped, and a stopped sink is closed here, once."""
        with self._lock:
            self._frames_waiting -= 1
            self._writing += 1
            sink = None if self._stopped or self._released else self._sink
        try:
            if isinstance(action, threading.Event):
                action.set()
            elif sink is None:
                self._count(call, step is not None)
            elif step is not None or action is not None:
                self._attempt(sink, call, 1 if step is not None else 0,
                              lambda: sink.write_step(step) if step is not None else action(sink))
            if (step is None and action is None) or self._stopped:
                self._close_sink()
        finally:
            with self._lock:
                self._writing -= 1

    def _write_steps(self, many: Callable[[list[Step]], None], frames: list[tuple]) -> None:
        """Write a run of step frames with the sink's ``write_steps`` (one write for all)."""
        with self._lock:
            self._frames_waiting -= len(frames)
            self._writing += len(frames)
            stopped = self._stopped or self._released
        try:
            if stopped:
                for call, _, _ in frames:
                    self._count(call, True)
            else:
                self._attempt(self._sink, frames[-1][0], len(frames), lambda: many([step for _, _, step in frames]))
                if self._stopped:
                    for call, _, _ in frames[:-1]:
                        self._count(call, False)  # the fault noted on each call the batch held
            if self._stopped:
                self._close_sink()
        finally:
            with self._lock:
                self._writing -= len(frames)

    def _attempt(self, sink: RecordSink, call: GenerationCall | None, steps: int, write: Callable[[], None]) -> None:
        """Run ``write``; a sink that raises or says it stopped (its ``fault``) is stopped, its ``steps`` step
        records counted as not written."""
        try:
            write()
            # asked after each write (on the sink's thread, not the model's): a sink may set ``fault`` only when it
            # stops
            fault = sink.fault if _follows(sink, FaultingSink) else None
        except BaseException as error:  # noqa: BLE001 - SystemExit too: a sink never ends the host's call
            if isinstance(error, PartlyWritten):  # the frames before the failure are on disk
                steps, error = steps - error.written, error.__cause__ or error
            fault = typed(error)
        if fault is not None:  # (an empty one is a stop all the same: said, so that it reads as a fault)
            said = fault if isinstance(fault, str) else one_line(fault)  # the sink's object: its str() may raise
            said = said or f"the sink {_named(sink)} stopped writing without saying why"
            self._stop_sink(said, call, steps=steps)
            self._count_lost(sink)

    def _close_sink(self) -> None:
        """Close the sink (once), releasing its file."""
        with self._lock:
            if self._released:
                return
            self._released, sink = True, self._sink
        try:
            sink.close()
        except BaseException as error:  # noqa: BLE001 - never into the host
            said = typed(error)
            logger.warning("nxl_hooks: closing the sink failed (%s)", said)
            with self._lock:
                self.sink_fault = self.sink_fault or said
            self._count_lost(sink)

    def _count_lost(self, sink: RecordSink) -> None:
        """The step records a failed sink had taken and then lost (its optional ``lost``), counted once as not
        written and noted on every call kept in memory (which of them it held is the sink's to know). A ``lost``
        that cannot be read counts none, said in one line."""
        try:
            lost = sink.lost if isinstance(sink, LosingSink) else 0
        except BaseException as error:  # noqa: BLE001 - a failed sink's attribute never ends the sink thread
            logger.warning("nxl_hooks: the sink's count of lost records could not be read (%s); the records "
                           "it had taken are not counted as unwritten", typed(error))
            return
        with self._lock:
            if not isinstance(lost, int) or lost <= self._lost:
                return
            self.unwritten += lost - self._lost
            self._lost = lost
            for call in self._calls:
                if self._fault_note() not in call.notes:
                    call.notes.append(self._fault_note())

    def _count(self, call: GenerationCall | None, steps: int) -> None:
        """A frame the stopped sink did not get (``steps``: the step records it held)."""
        with self._lock:
            self.unwritten += steps
            if call is not None and self.sink_fault is not None and self._fault_note() not in call.notes:
                call.notes.append(self._fault_note())

    def _stop_sink(self, fault: str, call: GenerationCall | None, *, steps: int = 0,
                   queued: str | None = None) -> None:
        """The sink gets nothing more: ``fault`` is kept in :attr:`sink_fault` and noted on every call it leaves
        in memory only (the frames still queued are counted as the sink thread meets them); the sink thread
        closes it when it comes back from the sink (here, without one). ``queued``: the sink thread is not coming
        back in time (the detach's deadline): the frames queued are counted now (:meth:`_abandon_queued`), and
        the line says ``queued`` and how many step records they held. Of a sink already stopped, only ``steps``
        (and the frames ``queued`` counts) are counted.

        The one line in the log is said here, where the sink stops, whatever stopped it (it raised, set its
        ``fault``, fell behind, was still writing at the detach): what the probe counts (``unwritten``,
        ``sink_fault``) is read only by who asks, and a probe detached at interpreter exit (its finalizer) by
        nobody. A write still in flight when it stopped fails or faults after it: no second line."""
        with self._lock:
            stops, writer = not self._stopped, self._writer
            away = writer is not None and writer.is_alive() and writer is not threading.current_thread()
            if not stops:
                self._count(call, steps)
            else:
                self._stopped, self.sink_fault = True, fault
                affected = list(self._running)
                if call is not None and call not in affected:  # a call that just ended
                    affected.append(call)
                for each in affected:
                    each.notes.append(self._fault_note())
                self.unwritten += steps
                if away:
                    self._frames_waiting += 1
                    self._frames.put([(None, _nothing, None)])  # an idle sink thread wakes up and closes it
        if stops and (writer is None or not writer.is_alive()):  # (no sink thread to close it)
            self._close_sink()
        if queued is not None:  # (also when the sink had stopped already: its thread is not coming back either)
            before = self.unwritten
            self._abandon_queued()
            fault = f"{queued}: {self.unwritten - before} step record(s) were still queued for it"
        if stops:
            logger.warning("nxl_hooks: records sent to the sink %s not written (%s); the model's own call is "
                           "unaffected", _named(self._sink), fault)

    def _abandon_queued(self) -> None:
        """The sink thread did not come back from the sink by the detach's deadline: the frames still queued for it,
        and those its thread took with the ones it is writing, are counted (and noted on their calls) as not
        written now, not when it comes back, which may be never. The close frame goes back in the queue: the thread
        ends with it, closing the sink, if it ever comes back."""
        with self._lock:
            waiting = list(self._hand)
            self._hand.clear()
        while True:
            try:
                waiting += self._frames.get_nowait()
            except queue.Empty:
                break
        kept = []
        for call, action, step in waiting:
            if step is None and action is None:
                kept.append((call, action, step))
                continue
            with self._lock:
                self._frames_waiting -= 1
            if isinstance(action, threading.Event):
                action.set()
            else:
                self._count(call, step is not None)
        if kept:
            self._frames.put(kept)

    def _parents_sink(self) -> bool:
        """Whether this process forked from the one whose sink it is (the sink's file, its lock, which a thread of
        the parent may have held at the fork, its buffered rows are the parent's). The child then never touches
        it, not even to close it: it is stopped here, and the child's frames are counted and noted as not
        written (its records stay in its memory)."""
        if not self.forked:
            return False
        with self._lock:
            if not self._released:
                self._released = True
                if not self._stopped:
                    self._stopped = True
                    self.sink_fault = (f"this process ({os.getpid()}) was forked from the one that opened the sink "
                                       f"({self._owner}): the sink is that process's, so this one's records stay in "
                                       "its memory; attach a sink of its own in the child")
                    for each in self._running:
                        each.notes.append(self._fault_note())
        return True

    def _fault_note(self) -> str:
        return f"not written to the sink, which stopped: {self.sink_fault}"


#: The hub each sink was given to, by the sink's id (a hub holds its sink: the id is not reused while it stands).
_OWNERS: "weakref.WeakValueDictionary[int, Hub]" = weakref.WeakValueDictionary()
_OWNERS_LOCK = threading.Lock()


def _claim_sink(sink: RecordSink, hub: Hub) -> None:
    """Give ``sink`` to ``hub``; ValueError while another hub has it and has not closed it: two probes number
    their calls alike, so their frames in one stream make a file no one can read."""
    with _OWNERS_LOCK:
        owner = _OWNERS.get(id(sink))
        if owner is not None and owner._sink is sink and not owner._released:
            raise ValueError(f"the sink {_named(sink)} is given to another attached probe already: give each probe a "
                             "sink of its own (one path per model), or detach the other first")
        _OWNERS[id(sink)] = hub


def _follows(sink: RecordSink | None, protocol: type) -> bool:
    """Whether ``sink`` follows the optional ``protocol``; True where looking at its attributes raised (Python
    3.11's isinstance reads them): reading one where it is used then fails as the sink's own error, never here."""
    try:
        return isinstance(sink, protocol)
    except Exception:  # noqa: BLE001 - the sink's code, never into attach
        return True


def _named(sink: RecordSink) -> str:
    """How a sink is named in a line: its path, else its class."""
    return str(getattr(sink, "path", None) or type(sink).__name__)


def _nothing(sink: RecordSink) -> None:
    """A frame that writes nothing: wakes the sink thread up to close a stopped sink."""
