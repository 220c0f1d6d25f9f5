"""Where finished generation records go: the probe's call list, the ``on_step`` callback, live subscribers
(:meth:`Probe.stream`) and the crash-safe sink. One hub per probe, shared by the calls of every thread.

- ``probe.calls`` keeps the last ``keep_calls`` calls (all by default) and, unless ``keep_steps=False``, their steps;
- ``on_step(step)`` runs in the thread that runs ``generate``; an exception it raises is the caller's own and
  stops that generation (under continuous batching, it stops recording that request: the manager's loop never
  sees it);
- a subscription yields the steps of one call (the one running when it was made, else the next to start, or the
  one of a given request, also after it ended) or, with ``follow``, of every call until the probe detaches or the
  subscription is closed;
- the sink gets a ``call`` frame when a prompt is known, a ``step`` frame per record and an ``end`` frame.

After the probe detaches, calls still running in other threads finish in memory only: their sink is closed and
their subscribers have ended.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import weakref
from typing import Any, Callable

import torch

from ..records.sinks import RecordSink, make_sink
from ..records.steps import GenerationCall, Step
from .guard import reason

__all__ = ["Hub", "Subscription"]


class _End:
    """Queue sentinel: the watched call ended (or the probe detached)."""


class Subscription:
    """The iterator :meth:`Probe.stream` returns; registered at creation so no record is missed.

    ``close()`` (or leaving ``with probe.stream(...) as steps:``) ends it from any thread: a reader blocked in it
    stops at once. The hub holds subscriptions weakly, so one that is dropped unread costs nothing.
    """

    def __init__(self, hub: "Hub | None" = None, *, call: GenerationCall | None = None,
                 request_id: str | None = None, follow: bool = False) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.call = call  #: the call it is bound to (None until one starts, or with ``follow``)
        self.request_id = request_id
        self.follow = follow
        self._hub = hub

    def wants(self, call: GenerationCall) -> bool:
        if self.request_id is not None and call.request_id != self.request_id:
            return False
        if self.follow:
            return True
        if self.call is None:
            self.call = call
        return self.call is call

    def close(self) -> None:
        """Stop receiving records; a reader iterating it ends after the records already queued."""
        if self._hub is not None:
            self._hub.unsubscribe(self)
        self.queue.put(_End)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> "Subscription":
        return self

    def __next__(self) -> Step:
        item = self.queue.get()
        if item is _End:
            self.queue.put(_End)  # iterating again (or from a second reader) ends too, never blocks
            raise StopIteration
        return item


class Hub:
    """Hands every finished record to the call list, the callback, the subscribers and the sink."""

    def __init__(self, *, on_step: Callable[[Step], Any] | None, sink: Any, keep_steps: bool,
                 keep_calls: int | None = None) -> None:
        """``sink``: anything :func:`~nxl_hooks.records.sinks.make_sink` takes, or None."""
        if keep_calls is not None and keep_calls < 0:
            raise ValueError(f"keep_calls={keep_calls}: give a number of calls to keep (0 or more), or None for all")
        self._calls: collections.deque[GenerationCall] = collections.deque(maxlen=keep_calls)
        self._on_step = on_step
        self._sink: RecordSink | None = None if sink is None else make_sink(sink)
        #: why the sink stopped getting records (one line), None while it is healthy or when there is none
        self.sink_fault: str | None = None
        self._keep = keep_steps
        # Reentrant: a model collected (by a garbage collection any allocation may start) while this thread holds a
        # lock closes its probe's hub from inside that thread.
        self._lock = threading.RLock()
        # Sink writes and the sink's closing, one at a time: a call in another thread never writes into a sink the
        # probe closed while it ran (and its frames never interleave with the end frames written at detach).
        self._sink_lock = threading.RLock()
        self._counter = 0
        self._subscribers: "weakref.WeakSet[Subscription]" = weakref.WeakSet()
        self._running: list[GenerationCall] = []
        self._closed = False  # the probe detached: a late subscriber must not wait for a call that never comes

    @property
    def calls(self) -> list[GenerationCall]:
        with self._lock:
            return list(self._calls)

    def begin(self, layers: list[int], *, request_id: str | None, thread: str | None,
              error: str | None = None) -> GenerationCall:
        """A new call record; with ``error`` it is one that is not recorded (its reason says why)."""
        with self._lock:
            call = GenerationCall(index=self._counter, layers=list(layers), request_id=request_id, thread=thread,
                                  error=error)
            if self.sink_fault is not None:
                call.notes.append(self._fault_note())
            self._counter += 1
            self._calls.append(call)
            if error is None and not self._closed:
                self._running.append(call)
        return call

    @property
    def listened(self) -> bool:
        """Whether a step record made now goes anywhere: kept, a callback, a subscriber or a sink."""
        return self._keep or self._on_step is not None or self._sink is not None or bool(self._subscribers)

    def prompt(self, call: GenerationCall, ids: torch.Tensor | None, mask: torch.Tensor, meta: dict) -> None:
        call.prompt_ids, call.prompt_mask = ids, mask
        self._write(lambda sink: sink.write_call(call, meta), call)

    def publish(self, call: GenerationCall, step: Step) -> None:
        call.link(step)  # the step's context texts, for to_attribution() wherever the step goes
        with self._lock:
            if self._keep:
                call.steps.append(step)
            if self._subscribers:  # iterating an empty WeakSet is not free, and this runs once per step
                for subscriber in list(self._subscribers):
                    if subscriber.wants(call):
                        subscriber.queue.put(step)
        self._write(lambda sink: sink.write_step(step), call)
        if self._on_step is not None:
            self._on_step(step)

    def end(self, call: GenerationCall, sequences: torch.Tensor | None, error: str | None = None) -> None:
        """The call returned (``sequences``: its output ids) or raised (None); ``error``: why records are missing."""
        with self._lock:
            if call not in self._running:  # ended already (the probe detached while it ran)
                call.sequences = sequences
                return
            self._running.remove(call)
            call.sequences, call.error, call.ended = sequences, call.error or error, time.time()
            call.complete = sequences is not None and call.error is None
            ended = self._release(call)
        if call.prompt_mask is not None:
            self._write(lambda sink: sink.write_end(call), call)
        for subscriber in ended:
            subscriber.queue.put(_End)

    def _release(self, call: GenerationCall) -> list[Subscription]:
        """The subscribers bound to ``call`` alone, taken off the list (caller holds the lock)."""
        ended = [s for s in self._subscribers if not s.follow and s.call is call]
        for subscriber in ended:
            self._subscribers.discard(subscriber)
        return ended

    def subscribe(self, *, request_id: str | None = None, follow: bool = False) -> Subscription:
        """A live iterator of step records (see the module docstring)."""
        subscription = Subscription(self, request_id=request_id, follow=follow)
        with self._lock:
            if self._closed:
                subscription.queue.put(_End)
                return subscription
            running = [call for call in self._running if subscription.wants(call)]
            if not running and not follow and request_id is not None:
                # that request already ended: its kept records, then the end
                done = next((c for c in reversed(self._calls) if c.request_id == request_id), None)
                if done is not None:
                    subscription.call = done
                    for step in done.steps:
                        subscription.queue.put(step)
                    subscription.queue.put(_End)
                    return subscription
            for call in running if follow else running[:1]:  # joined mid-call: replay what it already produced
                subscription.call = None if follow else call
                for step in call.steps:
                    subscription.queue.put(step)
            self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            self._subscribers.discard(subscription)

    def close(self, why: str = "the probe detached while this call ran") -> None:
        """The probe detaches: running calls are marked incomplete (end frames written), streams end, the sink
        closes. Calls still running in other threads go on unharmed and keep their records in memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            running, self._running = self._running, []
            subscribers = list(self._subscribers)
            self._subscribers = weakref.WeakSet()
            for call in running:
                call.error = call.error or why
        with self._sink_lock:
            for call in running:
                if call.prompt_mask is not None:
                    self._write_locked(lambda sink, call=call: sink.write_end(call), call)
            self._write_locked(lambda sink: sink.close())
            self._sink = None
        for subscriber in subscribers:
            subscriber.queue.put(_End)

    def _write(self, action: Callable[[RecordSink], None], call: GenerationCall) -> None:
        """One sink frame, unless the probe has detached (then the records stay in memory only)."""
        if self._sink is None:
            return
        with self._sink_lock:
            if not self._closed:
                self._write_locked(action, call)

    def _write_locked(self, action: Callable[[RecordSink], None], call: GenerationCall | None = None) -> None:
        """``action`` (one call of a RecordSink method, for ``call``) on the sink. A failing sink (a full disk, a
        read-only folder) is dropped: its fault is kept in :attr:`sink_fault`, noted on every call it leaves in
        memory only, and logged once; it is never raised into the host."""
        sink = self._sink
        if sink is None:
            return
        try:
            action(sink)
            fault = getattr(sink, "fault", None)  # optional in the protocol: a sink that stopped by itself says why
        except Exception as error:  # noqa: BLE001 - the host's call goes on; its records stay in memory
            where = getattr(sink, "path", None) or type(sink).__name__
            fault = f"{type(error).__name__}: {reason(f'records sent to the sink {where}', error)}"
        if fault is None:
            return
        self._sink, self.sink_fault = None, str(fault)
        with self._lock:
            affected = list(self._running)
            if call is not None and call not in affected:  # a call that just ended
                affected.append(call)
            for each in affected:
                each.notes.append(self._fault_note())

    def _fault_note(self) -> str:
        return f"not written to the sink, which stopped: {self.sink_fault}"
