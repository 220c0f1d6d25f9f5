"""The engine for transformers' continuous batching: every request its own :class:`~nxl_hooks.GenerationCall`,
one Step per generated token.

    with nxl.attach(model, layers="all") as probe:
        out = model.generate_batch(prompts, generation_config=config)   # or a ContinuousBatchingManager, or
    {c.request_id: len(c.steps) for c in probe.calls}                   # `transformers serve --continuous-batching`

``model.generate_batch``, a manager from ``model.init_continuous_batching`` and ``transformers serve
--continuous-batching`` never call ``generate``: a background thread runs packed forwards of shape (1, N) over
several requests at once (prefill chunks and one-token decodes side by side, each request at its own positions,
over a paged KV cache), then gives a token to every request whose prompt is done. ``request_id`` is the manager's
id for the request (under ``transformers serve``, the ``X-Request-ID`` header, else the server's own id).

How. While a probe of a causal LM is attached, six methods of transformers' classes are wrapped (class-level, for
every model; requests of a model with no probe pass straight through; the originals come back when the last such
probe detaches):

- ``ContinuousBatchProcessor._generation_step``: before the forward, the batch's layout (which request owns which
  slice of the packed input, from which position) is read from the scheduler's list of the batch. An eager step:
  the probe's hooks check it against the forward's own ``cu_seq_lens_q``, ``position_ids`` and
  ``logits_indices``, then append each slice's features to that request's feature cache (a
  :class:`~nxl_hooks.hooks.generate.Run`, as under ``generate``: the prefix is never re-run), and keep the model's
  own probabilities at the rows it samples from. A padded step (below): after it, each request's rows of the
  taps' buffers go to its run the same way;
- ``ContinuousBatchProcessor.warmup``: a padded processor's warmup runs with its taps, so that what it compiles or
  captures holds them;
- ``RequestState.update_and_check_completion``: the token the manager gives a request becomes that request's step
  record, and a request that finishes ends its call, before the manager hands the result to its caller; the
  records of one step go to the record pipeline together, once the step's last token is handed out;
- ``ContinuousBatchProcessor.fail_all_requests`` (the manager's loop ends: stopped, or failed): the requests it
  still holds end incomplete, saying why, before it fails them (no later step finds them gone);
- ``ContinuousBatchProcessor.prepare_next_batch``: when it finds nothing to run (the manager idles), the runs of
  requests that left the manager meanwhile (cancelled: a client that went away) end at once, as the next step's
  sweep would end them (no step opens while it idles);
- ``ContinuousBatchingManager.__init__``: with ``NXL_EAGER=1`` in the environment (``nxl run --eager``), managers
  of followed models are made with ``use_cuda_graph=False`` and ``use_async_batching=False``, whatever their config
  asks (a fallback: no longer needed to record graphs or compiled steps; it makes an asynchronous manager recordable).

Padded steps (compile configs, CUDA graphs: the manager pads its inputs and runs each step compiled, or replays a
graph, where hooks added afterwards never run): the processor gets :class:`~.transformers_cb_step._Taps`, hooks of
:class:`~.buffers.Buffers` put on before it compiles or captures, which write each packed token's head features
(every selected layer), embedding norm and sampled logits into fixed device tensors, with no host read, no branch
on a tensor's value, no lock and no allocation: they are traced into the compiled step or captured in its graphs.
They write only while the processor's own marker is the thread's recording, a not-recorded one, so the probe's own
hooks stand by in the compiled region. Code compiled before the first taps existed skips them (dynamo does not
guard on a module without hooks): it is compiled again once (``torch._dynamo.reset_code_caches()``); CUDA graphs
captured before are captured again. At detach the taps go and dynamo recompiles the step without them (it guards on
the number of hooks it traced); graphs captured with them keep their buffers alive with the processor.

Not followed (requests run unchanged; each request's call record says ``not recorded: why; what to do``, logged
once): asynchronous batching (each step starts before the last one's tokens are handed out;
``ContinuousBatchingConfig(use_async_batching=False)`` or ``NXL_EAGER=1``), and a transformers whose internals
moved (what is wrapped is :data:`~nxl_hooks.hooks.conventions.CONTINUOUS_BATCHING`, checked before wrapping).
Prefix sharing stays on: a request whose cache reuses the blocks of a prefix another request ran starts
mid-sequence, and its feature cache gets that prefix's rows from the request that ran it, still running or ended
(:mod:`.prefixes`, which keeps ended requests' rows up to a budget). A request whose prefix the probe does not hold
(it ran before the probe attached, the request that ran it was not recorded, or its rows were let go), or that had
generated tokens before the probe saw it, is marked not recorded. A request that leaves the manager unfinished
(cancelled, failed, or the manager stopped) ends incomplete, its rows kept as a finished one's: transformers still
shares its cached pages.

Here: the wrappers and :class:`ContinuousBatching`, the engine of one probe. One packed step's record (its layout,
the features fed to each request's run, a padded step's taps, the tokens handed out) is
:mod:`.transformers_cb_step`. :func:`patch_serving` (from :mod:`.transformers_serve`, importable from here too)
carries each request's id from ``transformers serve``'s handler to the ``generate`` call that serves it when serve
runs without continuous batching (``nxl run`` applies it when ``transformers.cli.serving.utils`` is imported).
"""

from __future__ import annotations

import copy
import functools
import threading
import weakref
from typing import Any, Callable

import torch
from torch import nn

from ..conventions import CONTINUOUS_BATCHING, continuous_batching_classes
from ..generate import EAGER, MAKE_EAGER, REQUEST_NAMES, Generations, Run, eager
from ..guard import logger, one_line, reason, typed
from ..publish import DETACHED
from ..recording import NOT_RECORDED
from .prefixes import Rows, SharedPrefixes
from .transformers_cb_step import _abandon, _local, _Packed, _Segment, _Table, _Taps, logits_kept
from .transformers_serve import patch_serving

__all__ = ["ContinuousBatching", "patch_serving"]

#: What makes a manager that batches asynchronously recordable (said in each of its requests' call records).
_ASYNC_OFF = (f"pass ContinuousBatchingConfig(use_async_batching=False), or {MAKE_EAGER}, which makes "
              "managers with use_async_batching=False and use_cuda_graph=False")

_LOCK = threading.RLock()  # reentrant: a model collected while the lock is held detaches through here too
#: task model -> its probe's Batching (weakly both ways: the model's hooks keep the Batching alive)
_FOLLOWED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[ContinuousBatching]]" = weakref.WeakKeyDictionary()
_INSTALLED: list[tuple[type, str, Callable, Callable, list[bool]]] = []  # (class, name, original, wrapper, live)


def _tokens(state: Any) -> list[int]:
    """The tokens of a request's positions so far, as transformers hashes its cache blocks by them: its prompt,
    then what it generated."""
    return list(state.initial_tokens) + list(state.generated_tokens)


def _soft_reset(state: Any) -> bool:
    """Whether ``state`` is a request transformers queued again under its id, its prompt holding what it had
    generated (``create_equivalent_initial_request``: cache pressure), not a new request."""
    return bool(getattr(state, "_true_initial_tokens", 0))


def _has_children(scheduler: Any, request_id: str) -> bool:
    """Whether ``scheduler`` still holds ``num_return_sequences`` children forked from ``request_id``, which reuse
    its first positions."""
    if scheduler is None:
        return False
    prefix = f"{request_id}__child#"
    return any(str(r).startswith(prefix) for r in (*scheduler.active_requests, *scheduler.waiting_requests))


def _packed(arguments: dict[str, Any]) -> bool:
    """Whether a backbone forward called with ``arguments`` is a packed continuous-batching forward."""
    return "cu_seq_lens_q" in arguments or "logits_indices" in arguments


def _after_this_thread(processor: Any) -> None:
    """The step about to run on ``processor``'s own compute stream (an accelerator's: its eager forward's kernels,
    and the probe's hooks in it) starts after what this thread queued on its current stream: the probe's reads and
    copies of the last steps' tensors (a request's decoding rows fed later, its feature cache grown). The caching
    allocator hands a freed block back to the stream that made it at once, so without this the next forward could
    write a block those reads had not read yet. (The other way round, the manager synchronizes its compute stream
    after each step, before the probe reads what the step wrote.)"""
    stream = getattr(processor.inputs_and_outputs, "compute_stream", None)
    if stream is not None:
        stream.wait_stream(torch.get_device_module(stream.device).current_stream(stream.device))


def _followed(model: nn.Module) -> "ContinuousBatching | None":
    ref = _FOLLOWED.get(model)
    return ref() if ref is not None else None


def _followers() -> list["ContinuousBatching"]:
    """The engines following a model now (a processor's own model is not at hand where it fails or idles)."""
    with _LOCK:
        followers = [ref() for ref in _FOLLOWED.values()]
    return [batching for batching in followers if batching is not None]


def _generation_step(original: Callable) -> Callable:
    def _generation_step(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        batching = _followed(model)
        _local.pending = None
        if batching is None:
            return original(self, model, *args, **kwargs)
        batching.gens.hub.release()  # the last step's records, if its tokens were not all handed out
        # never raises; None: this step is not recorded; else its runs are this thread's until it leaves the step
        step = batching.open(self)
        # a padded step runs compiled (or replays a CUDA graph): the taps write it, the probe's own hooks stand by
        current = NOT_RECORDED if step is None else step if step.taps is None else step.taps.marker
        try:
            with batching.gens.running(current):
                try:
                    out = original(self, model, *args, **kwargs)
                except BaseException:
                    batching.gens.hub.release()  # the thread may end here: nothing it gathered stays behind
                    if step is not None:
                        step.abandon("the manager's forward raised")
                    raise
            if step is not None and step.taps is not None:
                step.collect()
            if step is not None and step.awaiting:
                _local.pending = step  # until the manager has handed out this forward's tokens
        finally:
            if step is not None:
                step.leave()
        return out

    return _generation_step


def _update_and_check_completion(original: Callable) -> Callable:
    def update_and_check_completion(self: Any, token_id: Any, *args: Any, **kwargs: Any) -> Any:
        step = getattr(_local, "pending", None)
        if step is None:
            return original(self, token_id, *args, **kwargs)
        before = len(self.generated_tokens)
        finished = original(self, token_id, *args, **kwargs)
        step.settle(self, token_id, appended=len(self.generated_tokens) > before, finished=bool(finished))
        return finished

    return update_and_check_completion


def _manager_init(original: Callable) -> Callable:
    def __init__(self: Any, model: Any, generation_config: Any, continuous_batching_config: Any, *args: Any,
                 **kwargs: Any) -> Any:
        if eager() and _followed(model) is not None:
            try:  # a copy: the caller's config object stays as it wrote it
                continuous_batching_config = copy.copy(continuous_batching_config)
                continuous_batching_config.use_cuda_graph = False
                continuous_batching_config.use_async_batching = False  # asked for explicitly too: not followed
            except Exception as error:  # noqa: BLE001 - the manager is made as asked
                reason(f"{EAGER} on this manager", error)
        return original(self, model, generation_config, continuous_batching_config, *args, **kwargs)

    return __init__


def _warmup(original: Callable) -> Callable:
    def warmup(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        batching = _followed(model)
        taps = batching.prepare(self) if batching is not None else None  # never raises
        if taps is None:
            return original(self, model, *args, **kwargs)
        with batching.gens.running(taps.marker):  # compiled (or captured) with the taps, as the steps will run
            return original(self, model, *args, **kwargs)

    return warmup


def _fail_all_requests(original: Callable) -> Callable:
    def fail_all_requests(self: Any, error: Any, *args: Any, **kwargs: Any) -> Any:
        for batching in _followers():
            batching.stopped(self, error)  # never raises
        return original(self, error, *args, **kwargs)

    return fail_all_requests


def _prepare_next_batch(original: Callable) -> Callable:
    def prepare_next_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        available = original(self, *args, **kwargs)
        if not available:  # idle: no step opens to find the requests cancelled meanwhile gone
            for batching in _followers():
                batching.idle(self)  # never raises
        return available

    return prepare_next_batch


def _install(classes: list[type]) -> None:
    """Wrap the methods of :data:`~nxl_hooks.hooks.conventions.CONTINUOUS_BATCHING` (caller holds the lock)."""
    wrappers = {"_generation_step": _generation_step, "update_and_check_completion": _update_and_check_completion,
                "__init__": _manager_init, "warmup": _warmup, "fail_all_requests": _fail_all_requests,
                "prepare_next_batch": _prepare_next_batch}
    for owner, (_, _, name) in zip(classes, CONTINUOUS_BATCHING):
        original = vars(owner)[name]
        wrapper, live = _gated(wrappers[name](original), original)
        wrapper.__wrapped__ = original
        wrapper.__nxl_hook__ = True
        setattr(owner, name, wrapper)
        _INSTALLED.append((owner, name, original, wrapper, live))


def _gated(wrapper: Callable, original: Callable) -> tuple[Callable, list[bool]]:
    """``wrapper``, calling ``original`` instead once its flag (returned) is cleared: a wrapper left behind at
    uninstall follows nothing more, while the next install wraps the method again above it (each step would be
    opened twice, and every request of that probe go unrecorded)."""
    live = [True]

    @functools.wraps(wrapper)
    def gated(*args: Any, **kwargs: Any) -> Any:
        return (wrapper if live[0] else original)(*args, **kwargs)

    return gated, live


def _uninstall() -> None:
    """The originals back (caller holds the lock). A wrapper someone else wrapped again stays, as a pass-through
    (:func:`_gated`): taking it out would drop theirs."""
    while _INSTALLED:
        owner, name, original, wrapper, live = _INSTALLED.pop()
        live[0] = False
        if vars(owner).get(name) is wrapper:
            setattr(owner, name, original)



class ContinuousBatching:
    """The :class:`~nxl_hooks.hooks.engines.Engine` of transformers' continuous batching, for one probe: the runs of
    the requests of its model's batch processors.

    Made by :func:`~nxl_hooks.attach` for causal LMs; :meth:`install` follows the model, :meth:`uninstall` (at
    detach) stops. ``unfollowed``: why continuous batching is not followed, or None.
    """

    name = "transformers-continuous-batching"

    def __init__(self) -> None:
        self.unfollowed: str | None = None
        self._uninstalled = False
        self._tables: "weakref.WeakKeyDictionary[Any, _Table]" = weakref.WeakKeyDictionary()
        self._finalizers: list[weakref.finalize] = []
        #: processors not followed (said once in the log) -> why, and the ids of their requests marked not recorded
        self._skipped: "weakref.WeakKeyDictionary[Any, tuple[str, set[str]]]" = weakref.WeakKeyDictionary()
        #: the rows of ended requests, for requests whose caches reuse their prefixes (kept while a followed
        #: cache shares prefixes: ``_sharing``)
        self._shared = SharedPrefixes()
        self._sharing = False
        self._taps: "weakref.WeakKeyDictionary[Any, _Taps]" = weakref.WeakKeyDictionary()  # padded processors'
        #: each processor's request states by id, as its runs last saw them: a new state under an id a run follows
        #: is another request (the one before left unseen), unless it is that one's soft reset
        self._states: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()
        self._recompiled = False
        self._lock = threading.RLock()

    def claims(self, model: nn.Module) -> bool:
        return callable(getattr(model, "init_continuous_batching", None))

    def install(self, gens: Generations) -> None:
        self.gens, self.plan = gens, gens.plan
        classes, self.unfollowed = continuous_batching_classes()
        if not classes:
            return
        with _LOCK:
            if self._uninstalled:  # the probe detached (another thread's detach_all) before it got here
                return
            if not _INSTALLED:
                _install(classes)
            _FOLLOWED[self.plan.model] = weakref.ref(self)

    def uninstall(self) -> None:
        """Stop following: the model's requests pass straight through from the next forward; the requests in flight
        end incomplete, each saying how many of its steps waiting to be scored it dropped (:func:`_abandon`): now,
        or, where the manager's thread is in a step, by that thread as it leaves it (:meth:`leave`; detach does not
        wait for it: a user's ``on_step`` may hold it)."""
        with _LOCK, self._lock:
            self._uninstalled = True
        plan = getattr(self, "plan", None)
        with _LOCK:
            if plan is not None and _followed(plan.model) is self:
                del _FOLLOWED[plan.model]
            if not _FOLLOWED:
                _uninstall()
        with self._lock:
            self._shared.clear()
            for taps in list(self._taps.values()):  # their compiled code recompiles without them at its next call
                taps.remove()
            self._taps.clear()
            for finalizer in self._finalizers:
                finalizer.detach()
            self._finalizers.clear()
            tables = list(self._tables.values())
        for table in tables:  # (read after the flag above is set: enter() sets its own, then reads this one's)
            if not table.inside:  # their features are freed now, not when their manager goes
                _abandon(table, DETACHED)

    def stray(self, arguments: dict[str, Any]) -> str | None:
        if not _packed(arguments):
            return None
        return ("the last forward packed several sequences into one row (cu_seq_lens_q: continuous batching, or "
                "padding-free inputs), which a plain forward's record cannot explain: "
                + (self.unfollowed or "a forward outside the manager's generation steps, e.g. its warmup"))

    # -- in the manager's thread -------------------------------------------------------------------------

    def open(self, processor: Any) -> _Packed | None:
        """The packed step about to run on ``processor``, or None when it is not recorded (never raises)."""
        if processor in self._skipped:
            self._mark(processor)
            return None
        table = None
        try:
            why = self._unfollowable(processor)
            if why is not None:
                self._skipped[processor] = (why, set())
                logger.warning("nxl_hooks: continuous-batching requests are not recorded: %s; they run unchanged", why)
                self._mark(processor)
                return None
            table = self._table(processor)
            if table is None:  # detached meanwhile
                return None
            _after_this_thread(processor)
            taps = self.prepare(processor, quiet=False) if processor.model_runner.pad_inputs else None
            segments, start, prompts = [], 0, {}
            states = self._states.setdefault(processor, {})
            batch = processor.inputs_and_outputs.requests_in_batch
            for future in batch:
                state = future.state
                followed = states.get(state.request_id)  # the state its run follows
                if state.request_id in table and followed is not state and not _soft_reset(state):
                    # its id is another request's now: the one the run followed left while the manager idled (a
                    # cancel; the sweep runs as a step opens), and a client sent the same id again. Ended before
                    # any new run looks for its prefix: its rows are kept, and no running request's tokens are
                    # paired with them
                    self.left(table, request_id=state.request_id, state=followed, scheduler=processor.scheduler)
            for future in batch:
                state, length = future.state, future.query_length
                request_id = state.request_id
                first = state.position_offset - length  # already advanced for this batch
                states[request_id] = state
                if request_id not in table:
                    table[request_id] = self._begin(processor, state, first)
                segments.append(_Segment(request_id=request_id, start=start, length=length, first=first,
                                         new_token=bool(future.has_new_token), run=table[request_id], state=state))
                if taps is not None and first < len(state.initial_tokens):  # a prefill chunk: its ids, on the host
                    prompts[request_id] = state.initial_tokens
                start += length
            self.gens.hub.gather()  # the step's records go on together once its tokens are handed out
            return _Packed(self, table, segments, taps, prompts, scheduler=processor.scheduler,
                           kept=logits_kept(processor, self.plan.model))
        except Exception as error:  # noqa: BLE001 - never into the manager's loop
            # said once: this manager's requests are not recorded from now on
            self._skipped[processor] = (reason("continuous batching on this manager", error), set())
            self._mark(processor)
            table = table if table is not None else self._tables.get(processor)  # (_table may raise once inside)
            if table is not None and table.inside:
                self.leave(table)
            return None

    def _mark(self, processor: Any) -> None:
        """Each request of ``processor``'s batch not seen before gets a call record saying it is not recorded
        (already said in the log). Never raises."""
        try:
            why, marked = self._skipped[processor]
            scheduler = processor.scheduler
            marked.intersection_update(set(scheduler.active_requests) | set(scheduler.waiting_requests))
            for future in processor.inputs_and_outputs.requests_in_batch:
                request_id = str(future.state.request_id)
                if request_id not in marked:
                    marked.add(request_id)
                    self.gens.unrecorded(REQUEST_NAMES(request_id), "this request", RuntimeError(why), log=False)
        except Exception as error:  # noqa: BLE001 - never into the manager's loop
            reason("the records of a continuous-batching manager that is not followed", error)

    @staticmethod
    def _unfollowable(processor: Any) -> str | None:
        if hasattr(processor.inputs_and_outputs, "io_pairs"):
            return ("this manager batches asynchronously (each step starts before the last one's tokens are handed "
                    f"out), which nxl_hooks does not follow; {_ASYNC_OFF}")
        return None

    def prepare(self, processor: Any, *, quiet: bool = True) -> _Taps | None:
        """The taps of a padded ``processor`` (made the first time, before it compiles or captures: its warmup, or
        its first step), or None when it runs eagerly, is not followed, or the probe detached. Code torch.compile
        traced before the taps existed skips them (dynamo does not guard on a module that had no hooks): the first
        time, that code is compiled again once. ``quiet``: a failure is said by the caller. Never raises."""
        try:
            if not processor.model_runner.pad_inputs or self._unfollowable(processor) is not None:
                return None
            with self._lock:
                if self._uninstalled:
                    return None
                taps = self._taps.get(processor)
                if taps is None:
                    taps = self._taps[processor] = _Taps(self.plan, self.gens, processor)
                    self._finalizers.append(weakref.finalize(processor, taps.remove))  # its hooks go with it
                    self._fresh(processor, taps)
            return taps
        except Exception as error:  # noqa: BLE001 - the manager runs as it would; its steps say why not recorded
            if not quiet:
                raise
            reason("continuous batching on this manager", error)
            return None

    def _fresh(self, processor: Any, taps: _Taps) -> None:
        """Code and graphs made before ``taps`` existed run again with them: the compiled code is traced again once
        per probe (every code torch.compile compiled in this process recompiles at its next call: which of it
        called this model cannot be told), CUDA graphs already captured are captured again at their next step, and
        the graphs keep the buffers they write alive (they replay into them as long as the manager lives)."""
        runner = processor.model_runner
        if not self._recompiled and (getattr(runner, "_compiled_varlen", None) is not None
                                     or getattr(runner, "_compiled_decode", None) is not None):
            self._recompiled = True
            torch._dynamo.reset_code_caches()
            logger.info("nxl_hooks: code compiled by torch.compile before the probe attached compiles again once, "
                        "with the continuous-batching taps traced in")
        if any(getattr(runner, name, False) for name in ("use_cuda_graph_varlen", "use_cuda_graph_decode")):
            vars(processor)["_nxl_hooks_taps"] = taps
            io = processor.inputs_and_outputs
            graphs = getattr(io, "graphs", None)
            if graphs is not None:
                io.graphs = type(graphs)()  # the old graphs are reset when their holder goes

    def _table(self, processor: Any) -> _Table | None:
        """``processor``'s runs by request id (None once detached), this thread's until it leaves the step
        (:meth:`leave`); first time: a sweep when it goes, and finished requests' rows kept from now on if its
        cache shares prefixes."""
        with self._lock:
            if self._uninstalled:
                return None
            table = self._tables.get(processor)
            if table is None:
                table = self._tables[processor] = _Table()
                self._finalizers.append(weakref.finalize(processor, _abandon, table, "the manager went away"))
                self._sharing = self._sharing or bool(getattr(processor.cache, "use_prefix_sharing", False))
            table.inside = True  # (under the lock detach takes to set its flag: enter()'s order holds)
        scheduler, states = processor.scheduler, self._states.get(processor, {})
        for request_id in [r for r in table if r not in scheduler.active_requests
                           and r not in scheduler.waiting_requests]:
            self.left(table, request_id=request_id, state=states[request_id], scheduler=scheduler)
        for request_id in [r for r in states if r not in table]:
            del states[request_id]
        return table

    def enter(self, table: _Table) -> bool:
        """The manager's thread is about to touch ``table``'s runs (a token to settle); False where the probe
        detached (it leaves them alone: they are ended). No lock (this runs per token): its flag is set first, then
        the detach's read, while :meth:`uninstall` sets its own first, then reads this one, so either the thread sees
        the detach, or the detach sees the thread inside and leaves the runs to it (:meth:`leave`)."""
        table.inside = True
        if self._uninstalled:
            self.leave(table)
            return False
        return True

    def leave(self, table: _Table) -> None:
        """The manager's thread is done with ``table``'s runs for now (:meth:`enter`, or a step: :meth:`_table`);
        where the probe detached meanwhile it ends them, which :meth:`uninstall` left to it."""
        table.inside = False
        if self._uninstalled:
            _abandon(table, DETACHED)

    def left(self, table: dict[str, Any], *, request_id: str, state: Any, scheduler: Any,
             why: str = "the request left the manager before it finished (cancelled or failed)") -> None:
        """The run of a request that left the manager without finishing (cancelled, failed by it, its forward
        raised) ends; its rows are kept first, as a finished request's (:meth:`keep`): transformers keeps the cached
        blocks of its prefix for the requests that reuse them (a client that dropped a request and sends its prompt
        again). Every position of those blocks was fed to the run: transformers offers a block once the step that
        completed it is over, and the probe feeds a step's rows in it; the rows of positions it offers no block for
        are never taken (:meth:`_prefix` takes the first positions the new request skips, and no more)."""
        run = table.pop(request_id, None)
        if run is not None:
            self.keep(state, run, scheduler)
            run.finish(None, why, what="this request")

    def stopped(self, processor: Any, error: Any) -> None:
        """``processor``'s manager stopped (asked to, or its loop failed with ``error``) and fails the requests it
        still holds: each run of them ends now, saying why (no later step sweeps them, and a failed manager's
        process may run on without one), and each one still queued is a record saying it was not recorded. Never
        raises."""
        try:
            with self._lock:
                table = self._tables.get(processor)
            states = self._states.get(processor, {})
            why = f"the request left the manager before it finished (its manager stopped: {one_line(error)})"
            # the ones still queued fail with it, and had no record at all: no step of theirs ran (said once); one
            # offloaded back to the queue has its run
            queued = [r for r in processor.scheduler.waiting_requests if table is not None and r not in table]
            for request_id in list(table or ()):
                self.left(table, request_id=request_id, state=states[request_id], scheduler=processor.scheduler,
                          why=why)
            stopped = RuntimeError(f"the request was still queued when its manager stopped ({one_line(error)}): "
                                   "no token of it was made")
            for request_id in queued:
                self.gens.unrecorded(REQUEST_NAMES(request_id), "this request", stopped, log=request_id == queued[0])
        except Exception as failure:  # noqa: BLE001 - never into the manager's loop
            reason("the end of the requests of a stopped continuous-batching manager", failure)

    def idle(self, processor: Any) -> None:
        """``processor``'s manager found nothing to run: the runs of requests that left it meanwhile (a cancel) end
        now, as the next step's sweep (:meth:`_table`) would, not when the next request comes (an idle server held
        them running, their records unended and their features in memory). Never raises."""
        try:
            with self._lock:
                table = self._tables.get(processor)
            if not table:  # nothing running (this runs each time the idle loop wakes)
                return
            self.gens.hub.release()  # the last step's records, if its tokens were not all handed out
            table = self._table(processor)
            if table is not None:
                self.leave(table)
        except Exception as error:  # noqa: BLE001 - never into the manager's loop
            reason("the end of the cancelled requests of a continuous-batching manager", error)

    def _prefix(self, processor: Any, state: Any, first: int) -> Rows:
        """The rows of positions 0..first-1 of a new request whose forwards start at ``first``: its cache reused
        their blocks from another request (prefix sharing, or the parent of a forked ``num_return_sequences``
        child); they come from the request that ran them, running or finished (:mod:`.prefixes`). RuntimeError
        (why the request cannot be recorded) where the probe holds none."""
        table, active = self._tables.get(processor, {}), processor.scheduler.active_requests

        def live():  # requests still running, checked one by one until one holds the prefix
            for request_id, other in list(active.items()):
                source = table.get(request_id)
                if source is not None and not source.failed and source.length >= first:
                    yield _tokens(other), Rows(*source.held())

        with self._lock:
            rows = self._shared.find(state.initial_tokens, first, live())
        if rows is not None:
            return rows
        before = f"its first {first} positions ran before the probe attached"
        if not getattr(processor.cache, "use_prefix_sharing", False) and "__child#" not in str(state.request_id):
            raise RuntimeError(f"{before}, so their attribution is unknown; requests added after attaching are "
                               "recorded")
        # (a request that ran them after the probe attached keeps its rows however it ended, unless it was not
        # recorded or they were let go: said only where some were)
        let_go = (", its features were let go to stay within nxl_hooks.hooks.engines.prefixes.SHARED_BYTES"
                  if self._shared.let_go else "")
        raise RuntimeError(
            f"{before}, or came from the cache's copy of another request's prefix (prefix sharing, or the request it "
            f"was forked from) whose features the probe does not hold (that request ran before the probe attached"
            f"{let_go}, or was not recorded itself: its call record says why), so their attribution is unknown; "
            "requests added after attaching are recorded, and ContinuousBatchingConfig(allow_block_sharing=False) "
            "makes every request run whole")

    def keep(self, state: Any, run: Run, scheduler: Any = None) -> None:
        """``run``'s request ended (it finished, or left unfinished: :meth:`left`): its rows are kept for requests
        that may reuse its prefix (while a followed cache shares prefixes, or ``scheduler`` still holds children
        forked from it). Never raises."""
        if run.failed or run.length == 0:
            return
        try:
            if not self._sharing and not _has_children(scheduler, state.request_id):
                return
            rows = Rows(*run.held())
            with self._lock:
                if not self._uninstalled:
                    self._shared.keep(_tokens(state), rows)
        except Exception as error:  # noqa: BLE001 - its own records are whole; a later request may miss its prefix
            logger.warning("nxl_hooks: an ended request's features were not kept for the requests that may reuse "
                           "its prefix (%s)", typed(error))

    def _begin(self, processor: Any, state: Any, first: int) -> Run | None:
        """A run for a request seen for the first time, its forwards starting at ``first`` (its positions before,
        from a prefix another request ran, fed first), or None (with a call record saying why)."""
        request_id = REQUEST_NAMES(str(state.request_id))  # (the client's, where a server named the request)
        try:
            # (a num_return_sequences child that did not fit the cache is queued whole, its prompt its parent's
            # with nothing generated: its _true_initial_tokens is that prompt's length)
            true = getattr(state, "_true_initial_tokens", 0)
            if state.generated_tokens or (true and len(state.initial_tokens) > true):
                raise RuntimeError("this request had generated tokens before the probe saw it (it started before "
                                   "the probe attached, or resumed after an offload)")
            rows = self._prefix(processor, state, first) if first > 0 else None
            run = self.gens.new_run(request_id=request_id, prompt_len=len(state.initial_tokens), eos=None,
                                    wait=None, engine=True)
        except Exception as error:  # noqa: BLE001
            self.gens.unrecorded(request_id, "this request", error)
            return None
        if rows is not None:
            try:
                ids = torch.tensor([list(state.initial_tokens[:first])], dtype=torch.long, device=rows.embed.device)
                run.feed(0, rows.features, rows.embed, rows.mask, ids)
            except Exception as error:  # noqa: BLE001 - never into the manager's loop
                run.fail("this request", error)
        return run


#: This module's engine (:func:`nxl_hooks.hooks.engines.builtin_engines` finds it).
ENGINE = ContinuousBatching
