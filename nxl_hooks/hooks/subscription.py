"""A live feed of records, bounded and typed: :class:`Subscription`, what :meth:`Probe.subscribe` returns and what
each live reader of the control endpoint reads (the hub of :mod:`.publish` feeds it).

    steps = probe.subscribe(follow=True)     # a Subscription[Step]: iterate it from another thread
    steps.dropped                            # records it lost because its reader fell LIVE_QUEUE behind
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, Protocol, TypeVar

from ..method.select import whole_number
from ..records.steps import GenerationCall
from .guard import logger

__all__ = ["LIVE_QUEUE", "Subscription", "Unsubscribes"]

#: Records a live subscription may hold unread; one more and its oldest is dropped (counted): a slow reader never
#: stalls the publisher, nor holds records without bound.
LIVE_QUEUE = 4096


class Unsubscribes(Protocol):
    """What hands a subscription its records and stops when it closes (the probe's hub)."""

    def unsubscribe(self, subscription: "Subscription") -> None: ...


T = TypeVar("T")


class Subscription(Generic[T]):
    """A live feed of records, bounded and typed: what :meth:`Probe.subscribe` returns (of :class:`Step`), and each
    live reader's feed of the control endpoint. Registered at creation so no record is missed.

    Never stalls the writer (the hub's publisher): a subscription ``size`` items behind drops its oldest item,
    counts it in :attr:`dropped` and logs one line the first time (``size=None``: unbounded, what the deprecated
    :meth:`Probe.stream` keeps). ``close()`` (or leaving ``with probe.subscribe(...) as steps:``) ends it from any
    thread: a reader blocked in it stops at once, after the items already queued. The hub holds subscriptions
    weakly, so one that is dropped unread costs nothing.
    """

    def __init__(self, hub: Unsubscribes | None = None, *, call: GenerationCall | None = None,
                 request_id: str | None = None, follow: bool = False, size: int | None = LIVE_QUEUE,
                 calls: bool = False, kept: str | None = None) -> None:
        """``kept``: where the records it drops are still kept, said in its line when it first drops one
        (``"the sink keeps them"``; None: nowhere else)."""
        if size is not None:  # (2.5 held 3 records, True one, and '3' raised a TypeError of its comparison)
            size = whole_number(size, f"size={size!r}: give how many records a subscription may hold (1 or more), "
                                      "or None", least=1)
        self.call = call  #: the call it is bound to (None until one starts, or with ``follow``)
        self.request_id = request_id
        self.follow = follow
        self.size = size
        self.calls = calls  #: items are (call, record) pairs: a reader behind still has the call of each record
        self.dropped = 0  #: items dropped (the oldest first) because the reader was ``size`` behind
        self._kept = kept
        self._hub = hub
        self._items: collections.deque[T] = collections.deque()
        self._ready = threading.Condition(threading.Lock())
        self._ended = False

    def wants(self, call: GenerationCall) -> bool:
        if self.request_id is not None and call.request_id != self.request_id:
            return False
        if self.follow:
            return True
        if self.call is None:
            self.call = call
        return self.call is call

    def record(self, call: GenerationCall, step: object) -> None:
        """Queue ``step``, a record of ``call``: as ``(call, step)`` where the subscription was made with
        ``calls``."""
        self.put((call, step) if self.calls else step)  # type: ignore[arg-type]

    def put(self, item: T) -> None:
        """Queue ``item`` for the reader; never waits (a full subscription drops its oldest item, counted)."""
        with self._ready:
            if self._ended:
                return
            full = self.size is not None and len(self._items) >= self.size
            if full:
                self._items.popleft()
                self.dropped += 1
            self._items.append(item)
            self._ready.notify()
        if full and self.dropped == 1:
            logger.warning("nxl_hooks: a live reader fell %d records behind; its oldest records are dropped (counted "
                           "in its subscription's dropped); %s", self.size, self._kept or "nothing else keeps them")

    def end(self) -> None:
        """No more items: a reader ends after those already queued."""
        with self._ready:
            self._ended = True
            self._ready.notify_all()

    def get(self, timeout: float | None = None) -> T | None:
        """The next item; None when none came within ``timeout`` seconds or the subscription ended."""
        with self._ready:
            self._ready.wait_for(lambda: self._items or self._ended, timeout)
            return self._items.popleft() if self._items else None

    def close(self) -> None:
        """Stop receiving records; a reader iterating it ends after the records already queued. The records of
        calls that ended before are handed to it first (a call may return before its last ones are scored)."""
        if self._hub is not None:
            self._hub.unsubscribe(self)
        self.end()

    def __enter__(self) -> "Subscription[T]":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> "Subscription[T]":
        return self

    def __next__(self) -> T:
        item = self.get()
        if item is None:  # ended and drained: iterating again (or from a second reader) ends too, never blocks
            raise StopIteration
        return item
