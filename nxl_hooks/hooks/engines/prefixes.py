"""Shared prefixes under continuous batching: the feature rows of positions a request never ran, taken from the
request that ran them.

    shared = SharedPrefixes()
    shared.keep(tokens, run.held())                # a request that ended: its rows, by the tokens they hold
    rows = shared.find(prompt, first, live)        # rows of positions 0..first-1 with those tokens, or None
    run.feed(0, *rows.narrow(first), ids)          # a request whose cache reused them starts from there

A paged KV cache with prefix sharing (transformers' ``allow_block_sharing``, on by default) gives a new request
the cached blocks of a prompt prefix that an earlier request already ran: the new request's forwards start at
the first position after them, and its feature cache would have a hole where the prefix is. The features of those
positions are a function of the tokens before them alone (causal attention, positions from 0), and the request's
own forwards read exactly the keys and values that the earlier request's forwards wrote there: so the rows the
earlier request recorded are this request's rows. They are found by tokens, not by cache blocks (whose
bookkeeping differs between transformers versions): in a request still running, or in one that ended (finished,
or left unfinished: a cancelled request's cached blocks are shared too), whose rows are kept (views, no copy) up
to :data:`SHARED_BYTES`, least recently used first out. A prefix found in neither (it was run before the probe
attached, by a request not recorded, or its rows were let go) leaves that request not recorded, said in its call
record.
"""

from __future__ import annotations

import collections
from typing import Iterable, NamedTuple, Sequence

import torch

__all__ = ["SHARED_BYTES", "Rows", "SharedPrefixes"]

#: The feature rows of ended requests kept for the requests that may reuse their prefixes (bytes, per probe).
SHARED_BYTES = 128 << 20


class Rows(NamedTuple):
    """A request's recorded positions 0..n-1: head features (1, n, layers, d'), embedding norms and mask (1, n)."""
    features: torch.Tensor
    embed: torch.Tensor
    mask: torch.Tensor

    @property
    def n(self) -> int:
        return self.features.shape[1]

    def narrow(self, n: int) -> "Rows":
        """The first ``n`` positions."""
        return Rows(*(value.narrow(1, 0, n) for value in self))

    def nbytes(self) -> int:
        """What keeping them keeps alive: the whole storage each is a view of."""
        return sum(value.untyped_storage().nbytes() for value in self)


class SharedPrefixes:
    """The rows of ended requests by their tokens (see the module docstring); not thread-safe: one manager's
    thread uses it at a time."""

    def __init__(self, budget: int | None = None) -> None:
        self._budget = SHARED_BYTES if budget is None else budget
        self._kept: collections.OrderedDict[int, tuple[list[int], Rows, int]] = collections.OrderedDict()
        self._bytes = 0
        self._counter = 0
        #: rows were let go (over the budget): a request may miss a prefix for that reason too (its record says so)
        self.let_go = False

    def keep(self, tokens: Sequence[int], rows: Rows) -> None:
        """The rows of an ended request, whose positions hold ``tokens`` (at least ``rows.n`` of them)."""
        size = rows.nbytes()
        if rows.n == 0:
            return
        if size > self._budget:
            self.let_go = True
            return
        self._counter += 1
        self._kept[self._counter] = (list(tokens[: rows.n]), rows, size)
        self._bytes += size
        while self._bytes > self._budget:
            _, (_, _, freed) = self._kept.popitem(last=False)
            self._bytes -= freed
            self.let_go = True

    def find(self, prompt: Sequence[int], first: int, live: Iterable[tuple[Sequence[int], Rows]] = ()) -> Rows | None:
        """Rows of positions 0..``first``-1 whose tokens are ``prompt[:first]``: from ``live`` (running requests'
        tokens and rows) first, else the newest kept; None when none holds them."""
        wanted = list(prompt[:first])
        if len(wanted) < first:
            return None
        for tokens, rows in live:
            if rows.n >= first and list(tokens[:first]) == wanted:
                return rows.narrow(first)
        for key in reversed(self._kept):
            tokens, rows, _ = self._kept[key]
            if rows.n >= first and tokens[:first] == wanted:
                self._kept.move_to_end(key)
                return rows.narrow(first)
        return None

    def clear(self) -> None:
        self._kept.clear()
        self._bytes = 0
        self.let_go = False
