"""Where finished generation records go: the probe's call list, the ``on_step`` callback, live subscribers
(:meth:`Probe.stream`) and the crash-safe sink. One hub per probe, shared by the calls of every thread.

- ``probe.calls`` keeps the last ``keep_calls`` calls (all by default) and, unless ``keep_steps=False``, their steps;
- ``on_step(step)`` runs in the thread that runs ``generate``; an exception it raises is the caller's own and
  stops that generation;
- a subscription yields the steps of one call (the one running when it was made, else the next to start, or the
  one of a given request) or, with ``follow``, of every call until the probe detaches;
- the sink gets a ``call`` frame when a prompt is known, a ``step`` frame per record and an ``end`` frame.

After the probe detaches, calls still running in other threads finish in memory only: their sink is closed and
their subscribers have ended.
"""

from __future__ import annotations

import collections
import queue
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from ..records.sink import Sink
from ..records.steps import GenerationCall, Step
from .guard import reason

__all__ = ["Hub", "Subscription"]


class _End:
    """Queue sentinel: the watched call ended (or the probe detached)."""


class Subscription:
    """The iterator :meth:`Probe.stream` returns; registered at creation so no record is missed."""

    def __init__(self, *, call: GenerationCall | None = None, request_id: str | None = None,
                 follow: bool = False) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.call = call  #: the call it is bound to (None until one starts, or with ``follow``)
        self.request_id = request_id
        self.follow = follow

    def wants(self, call: GenerationCall) -> bool:
        if self.request_id is not None and call.request_id != self.request_id:
            return False
        if self.follow:
            return True
        if self.call is None:
            self.call = call
        return self.call is call

    def __iter__(self) -> "Subscription":
        return self

    def __next__(self) -> Step:
        item = self.queue.get()
        if item is _End:
            raise StopIteration
        return item


class Hub:
    """Hands every finished record to the call list, the callback, the subscribers and the sink."""

    def __init__(self, *, on_step: Callable[[Step], Any] | None, sink: "str | Path | Sink | None",
                 keep_steps: bool, keep_calls: int | None = None) -> None:
        if keep_calls is not None and keep_calls < 0:
            raise ValueError(f"keep_calls={keep_calls}: give a number of calls to keep (0 or more), or None for all")
        self._calls: collections.deque[GenerationCall] = collections.deque(maxlen=keep_calls)
        self._on_step = on_step
        self._sink = sink if isinstance(sink, Sink) or sink is None else Sink(sink)
        self._keep = keep_steps
        self._lock = threading.Lock()
        self._counter = 0
        self._subscribers: list[Subscription] = []
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
            self._counter += 1
            self._calls.append(call)
            if error is None and not self._closed:
                self._running.append(call)
        return call

    def prompt(self, call: GenerationCall, ids: torch.Tensor | None, mask: torch.Tensor, meta: dict) -> None:
        call.prompt_ids, call.prompt_mask = ids, mask
        with self._lock:
            sink = None if self._closed else self._sink
        if sink is not None:
            self._write(sink.write_call, call, meta)

    def publish(self, call: GenerationCall, step: Step) -> None:
        with self._lock:
            if self._keep:
                call.steps.append(step)
            for subscriber in self._subscribers:
                if subscriber.wants(call):
                    subscriber.queue.put(step)
            sink = None if self._closed else self._sink
        if sink is not None:
            self._write(sink.write_step, step)
        if self._on_step is not None:
            self._on_step(step)

    def end(self, call: GenerationCall, sequences: torch.Tensor | None, error: str | None = None) -> None:
        """The call returned (``sequences``: its output ids) or raised (None); ``error``: why records are missing."""
        with self._lock:
            if call not in self._running:  # ended already (the probe detached while it ran)
                call.sequences = sequences
                return
            self._running.remove(call)
            call.sequences, call.error = sequences, call.error or error
            call.complete = sequences is not None and call.error is None
            sink = None if self._closed else self._sink
            ended = self._release(call)
        if sink is not None and call.prompt_mask is not None:
            self._write(sink.write_end, call)
        for subscriber in ended:
            subscriber.queue.put(_End)

    def _release(self, call: GenerationCall) -> list[Subscription]:
        """The subscribers bound to ``call`` alone, taken off the list (caller holds the lock)."""
        ended = [s for s in self._subscribers if not s.follow and s.call is call]
        self._subscribers = [s for s in self._subscribers if s not in ended]
        return ended

    def subscribe(self, *, request_id: str | None = None, follow: bool = False) -> Subscription:
        """A live iterator of step records (see the module docstring)."""
        subscription = Subscription(request_id=request_id, follow=follow)
        with self._lock:
            if self._closed:
                subscription.queue.put(_End)
                return subscription
            running = [call for call in self._running if subscription.wants(call)]
            for call in running if follow else running[:1]:  # joined mid-call: replay what it already produced
                subscription.call = None if follow else call
                for step in call.steps:
                    subscription.queue.put(step)
            self._subscribers.append(subscription)
        return subscription

    def close(self, why: str = "the probe detached while this call ran") -> None:
        """The probe detaches: running calls are marked incomplete (end frames written), streams end, the sink
        closes. Calls still running in other threads go on unharmed and keep their records in memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            running, self._running = self._running, []
            subscribers, self._subscribers = self._subscribers, []
        for call in running:
            call.error = call.error or why
            if self._sink is not None and call.prompt_mask is not None:
                self._write(self._sink.write_end, call)
        for subscriber in subscribers:
            subscriber.queue.put(_End)
        if self._sink is not None:
            self._write(self._sink.close)

    def _write(self, write: Callable, *args: Any) -> None:
        """One sink write; a failing sink (a full disk) is dropped with one log line, never raised into the host."""
        try:
            write(*args)
        except Exception as error:  # noqa: BLE001 - the host's call goes on; its records stay in memory
            reason(f"the stream file {getattr(self._sink, 'path', '')}", error)
            with self._lock:
                self._sink = None