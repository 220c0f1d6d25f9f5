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

How. While a probe of a causal LM is attached, three methods of transformers' classes are wrapped (class-level, for
every model; requests of a model with no probe pass straight through; the originals come back when the last such
probe detaches):

- ``ContinuousBatchProcessor._generation_step``: before the forward, the batch's layout (which request owns which
  slice of the packed input, from which position) is read from the scheduler's list of the batch; the probe's
  hooks check it against the forward's own ``cu_seq_lens_q``, ``position_ids`` and ``logits_indices``, then append
  each slice's features to that request's feature cache (a :class:`~nxl_hooks.hooks.generate.Run`, as under
  ``generate``: the prefix is never re-run), and keep the model's own probabilities at the rows it samples from;
- ``RequestState.update_and_check_completion``: the token the manager gives a request becomes that request's step
  record, and a request that finishes ends its call, before the manager hands the result to its caller;
- ``ContinuousBatchingManager.__init__``: with ``NXL_EAGER=1`` in the environment (``nxl run --eager``), managers
  of followed models are made with ``use_cuda_graph=False``, so they can be recorded.

Not followed (requests run unchanged; each request's call record says ``not recorded: why; what to do``, logged
once): a manager that pads its inputs for CUDA graphs or torch.compile (hooks do not run when a graph replays;
``ContinuousBatchingConfig(use_cuda_graph=False)``, ``transformers serve --no-cb-use-cuda-graph`` or
``NXL_EAGER=1`` makes it followable), and a transformers whose internals moved (what is wrapped is
:data:`~nxl_hooks.hooks.conventions.CONTINUOUS_BATCHING`, checked before wrapping). While attached,
prefix sharing is off on the paged caches the probe sees (a prefix shared from another request's cache never runs
for the request that reuses it, so that request's attribution could not be computed); each cache gets its setting
back at detach. A request that started mid-sequence anyway (it reused a prefix before the probe attached, or it is a
forked ``num_return_sequences`` child), or that had generated tokens before the probe saw it, is marked not
recorded. A request that leaves the manager unfinished (cancelled, failed, or the manager stopped) ends incomplete.

Also here: :func:`patch_serving`, which carries each request's id from ``transformers serve``'s handler to the
``generate`` call that serves it when serve runs without continuous batching (``nxl run`` applies it when
``transformers.cli.serving.utils`` is imported).
"""

from __future__ import annotations

import contextvars
import copy
import functools
import inspect
import threading
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch
from torch import nn

from ..conventions import CONTINUOUS_BATCHING, SERVE_HANDLERS, SERVE_SUBMITS, continuous_batching_classes
from ..forward import Capture
from ..generate import EAGER, MAKE_EAGER, REQUEST_ID, Generations, Run, eager, stacked_features
from ..guard import logger, reason
from ..recording import NOT_RECORDED

__all__ = ["ContinuousBatching", "patch_serving"]

#: What makes a manager that uses CUDA graphs recordable (said in each of its requests' call records).
_GRAPHS_OFF = (f"{MAKE_EAGER}, pass ContinuousBatchingConfig(use_cuda_graph=False) without compile configs, or run "
               "`transformers serve --no-cb-use-cuda-graph`")

_LOCK = threading.RLock()  # reentrant: a model collected while the lock is held detaches through here too
#: task model -> its probe's Batching (weakly both ways: the model's hooks keep the Batching alive)
_FOLLOWED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[ContinuousBatching]]" = weakref.WeakKeyDictionary()
_INSTALLED: list[tuple[type, str, Callable, Callable]] = []  # (class, name, original, wrapper)
_local = threading.local()  # .pending: this thread's last packed step, whose tokens the manager hands out next


def _packed(arguments: dict[str, Any]) -> bool:
    """Whether a backbone forward called with ``arguments`` is a packed continuous-batching forward."""
    return "cu_seq_lens_q" in arguments or "logits_indices" in arguments


def _followed(model: nn.Module) -> "ContinuousBatching | None":
    ref = _FOLLOWED.get(model)
    return ref() if ref is not None else None


def _generation_step(original: Callable) -> Callable:
    def _generation_step(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        batching = _followed(model)
        _local.pending = None
        if batching is None:
            return original(self, model, *args, **kwargs)
        step = batching.open(self)  # never raises; None: this step is not recorded
        with batching.gens.running(step if step is not None else NOT_RECORDED):
            try:
                out = original(self, model, *args, **kwargs)
            except BaseException:
                if step is not None:
                    step.abandon("the manager's forward raised")
                raise
        if step is not None and step.awaiting:
            _local.pending = step  # until the manager has handed out this forward's tokens
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
            except Exception as error:  # noqa: BLE001 - the manager is made as asked
                reason(f"{EAGER} on this manager", error)
        return original(self, model, generation_config, continuous_batching_config, *args, **kwargs)

    return __init__


def _install(classes: list[type]) -> None:
    """Wrap the methods of :data:`~nxl_hooks.hooks.conventions.CONTINUOUS_BATCHING` (caller holds the lock)."""
    wrappers = {"_generation_step": _generation_step, "update_and_check_completion": _update_and_check_completion,
                "__init__": _manager_init}
    for owner, (_, _, name) in zip(classes, CONTINUOUS_BATCHING):
        wrap = wrappers[name]
        original = vars(owner)[name]
        wrapper = wrap(original)
        wrapper.__wrapped__ = original
        wrapper.__nxl_hook__ = True
        setattr(owner, name, wrapper)
        _INSTALLED.append((owner, name, original, wrapper))


def _uninstall() -> None:
    """The originals back (caller holds the lock). A wrapper someone else wrapped again stays, as a pass-through:
    taking it out would drop theirs."""
    while _INSTALLED:
        owner, name, original, wrapper = _INSTALLED.pop()
        if vars(owner).get(name) is wrapper:
            setattr(owner, name, original)


@dataclass(frozen=True)
class _Segment:
    """One request's slice of a packed forward."""

    request_id: str
    start: int  #: first index in the packed input
    length: int
    first: int  #: the request's position of that first index
    new_token: bool  #: the manager samples a token for this request from this forward
    run: Any  #: the request's Run, or None when it is not recorded


def _check_layout(arguments: dict[str, Any], segments: list[_Segment]) -> int:
    """The forward's own packing equals the layout read from the scheduler (ValueError otherwise); returns the packed
    length."""
    cumulative = arguments.get("cu_seq_lens_q")
    positions, ids = arguments.get("position_ids"), arguments.get("input_ids")
    if cumulative is None or positions is None or ids is None:
        raise ValueError("this continuous-batching forward has no cu_seq_lens_q / position_ids / input_ids: a "
                         "packing nxl_hooks does not know")
    expected = [0] + [s.start + s.length for s in segments]
    logits = arguments.get("logits_indices")
    emitting = [s.start + s.length - 1 for s in segments if s.new_token]
    order = torch.cat([torch.arange(s.first, s.first + s.length) for s in segments])
    if (cumulative.tolist() != expected or ids.shape != (1, expected[-1])
            or not torch.equal(positions[0].cpu().long(), order)
            or (logits is not None and logits.tolist()[: len(emitting)] != emitting)):
        raise ValueError(f"the packed forward (cu_seq_lens_q {cumulative.tolist()}) does not match the batch the "
                         f"manager scheduled ({expected}): the layout of this transformers version is not understood")
    return expected[-1]


class _Packed:
    """One packed forward and the tokens it yields: the :class:`~nxl_hooks.hooks.engines.Recording` the probe's
    hooks feed in the manager's thread."""

    def __init__(self, batching: "ContinuousBatching", table: dict[str, Any], segments: list[_Segment]) -> None:
        self._batching, self._table, self.segments = batching, table, segments
        self._ids = {segment.request_id for segment in segments}
        self._fed: set[str] = set()
        self.awaiting = sum(segment.new_token for segment in segments)  #: tokens the manager has yet to hand out
        self.failed = False
        self._length = 0  # of the packed input, once checked

    def _runs(self) -> list[tuple[_Segment, Run]]:
        return [(s, s.run) for s in self.segments if s.run is not None and not s.run.failed]

    def before_forward(self, arguments: dict[str, Any]) -> None:
        self._length = _check_layout(arguments, self.segments)

    def after_task(self, output: Any) -> None:
        """The model's own log-probabilities at each sampled row go to that request's run (its step's
        ``probability``), all rows in one log-softmax. The logits are the whole packed input's, or (with
        ``logits_to_keep``) those of the sampled rows in batch order."""
        logits = getattr(output, "logits", None)
        emitting = [s for s in self.segments if s.new_token]
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or not emitting:
            return
        if logits.shape[1] == self._length:
            rows = torch.tensor([s.start + s.length - 1 for s in emitting], device=logits.device)
        elif logits.shape[1] >= len(emitting):
            rows = torch.arange(len(emitting), device=logits.device)
        else:
            return
        log_probs = logits[0, rows].float().log_softmax(-1)
        for index, segment in enumerate(emitting):
            if segment.run is not None and not segment.run.failed:
                segment.run.predicted(log_probs[index: index + 1])

    def after_forward(self, capture: Capture) -> None:
        """Each request's slice of the forward into its own feature cache."""
        runs = self._runs()
        if not runs:
            return
        features, embed, ids = stacked_features(self._batching.plan, capture), capture.embed_norm, capture.input_ids
        mask = torch.ones(1, capture.shape[1], dtype=torch.bool, device=embed.device)
        for segment, run in runs:
            try:
                if segment.first > run.length:
                    raise RuntimeError(
                        f"this request's forwards start at position {segment.first}: positions {run.length}.."
                        f"{segment.first - 1} ran for another request (a prefix shared from its cache before the "
                        "probe attached, or a forked num_return_sequences child), so their attribution is unknown")
                window = slice(segment.start, segment.start + segment.length)
                run.feed(segment.first, features[:, window], embed[:, window], mask[:, window],
                         ids[:, window].long() if ids is not None else None)
                self._fed.add(segment.request_id)
            except Exception as error:  # noqa: BLE001 - one request's failure is that request's alone
                run.fail("this request", error)

    def fail(self, what: str, error: BaseException) -> None:
        """The forward as a whole could not be followed: every request in it stops recording."""
        self.failed = True
        for _, run in self._runs():
            run.fail(what, error)

    def abandon(self, why: str) -> None:
        """The host's forward raised: the requests in it end incomplete (the host fails them too)."""
        for segment in self.segments:
            run = self._table.pop(segment.request_id, None)
            if run is not None:
                run.finish(None, why, what="this request")

    def settle(self, state: Any, token: Any, *, appended: bool, finished: bool) -> None:
        """The manager gave ``token`` to the request of ``state``: its step record; its end if it ``finished``."""
        self.awaiting -= 1
        if self.awaiting <= 0:  # the last one: the thread lets go of this step (and of the model through it)
            _local.pending = None
        run = self._table.get(state.request_id)
        if run is None or state.request_id not in self._ids:
            if finished:
                self._table.pop(state.request_id, None)
            return
        try:
            if appended and not run.failed:
                if state.request_id not in self._fed:
                    raise RuntimeError("the probe did not see the forward that produced this token")
                run.emit(torch.tensor([int(token)]))
        except Exception as error:  # noqa: BLE001 - never into the manager's loop
            run.fail("this request", error)
        if finished:
            self._table.pop(state.request_id, None)
            try:
                output = state.to_generation_output()
                sequences = torch.tensor([list(output.prompt_ids) + list(output.generated_tokens)], dtype=torch.long)
            except Exception as error:  # noqa: BLE001
                run.fail("the end of this request", error)
                sequences = None
            run.finish(sequences, what="this request")


def _abandon(table: dict[str, Any], why: str) -> None:
    """Every request still in ``table`` ends incomplete."""
    while table:
        _, run = table.popitem()
        if run is not None:
            run.finish(None, why, what="this request")


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
        self._tables: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()
        self._finalizers: list[weakref.finalize] = []
        #: processors not followed (said once in the log) -> why, and the ids of their requests marked not recorded
        self._skipped: "weakref.WeakKeyDictionary[Any, tuple[str, set[str]]]" = weakref.WeakKeyDictionary()
        self._caches: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()  # cache -> its sharing
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
        """Stop following: the model's requests pass straight through from the next forward; prefix sharing comes
        back; the requests in flight end incomplete (their calls are marked by the hub's close)."""
        with _LOCK, self._lock:
            self._uninstalled = True
        plan = getattr(self, "plan", None)
        with _LOCK:
            if plan is not None and _followed(plan.model) is self:
                del _FOLLOWED[plan.model]
            if not _FOLLOWED:
                _uninstall()
        with self._lock:
            for cache, sharing in list(self._caches.items()):
                cache.use_prefix_sharing = sharing
            self._caches.clear()
            for finalizer in self._finalizers:
                finalizer.detach()
            self._finalizers.clear()
            tables = list(self._tables.values())
        for table in tables:
            table.clear()  # the features of requests in flight are freed now, not when their manager goes

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
            segments, start = [], 0
            for future in processor.inputs_and_outputs.requests_in_batch:
                state, length = future.state, future.query_length
                request_id = state.request_id
                if request_id not in table:
                    table[request_id] = self._begin(state)
                segments.append(_Segment(request_id=request_id, start=start, length=length,
                                         first=state.position_offset - length,  # already advanced for this batch
                                         new_token=bool(future.has_new_token), run=table[request_id]))
                start += length
            return _Packed(self, table, segments)
        except Exception as error:  # noqa: BLE001 - never into the manager's loop
            # said once: this manager's requests are not recorded from now on
            self._skipped[processor] = (reason("continuous batching on this manager", error), set())
            self._mark(processor)
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
                    self.gens.unrecorded(request_id, "this request", RuntimeError(why), log=False)
        except Exception as error:  # noqa: BLE001 - never into the manager's loop
            reason("the records of a continuous-batching manager that is not followed", error)

    @staticmethod
    def _unfollowable(processor: Any) -> str | None:
        runner = processor.model_runner
        if getattr(runner, "pad_inputs", True) or hasattr(processor.inputs_and_outputs, "io_pairs"):
            return ("this manager pads its inputs for CUDA graphs or torch.compile, and hooks do not run when a graph "
                    f"replays; {_GRAPHS_OFF}")
        return None

    def _table(self, processor: Any) -> dict[str, Any] | None:
        """``processor``'s runs by request id (None once detached); first time: prefix sharing off, and a sweep
        when it goes."""
        with self._lock:
            if self._uninstalled:  # checked under the lock uninstall restores prefix sharing with
                return None
            table = self._tables.get(processor)
            if table is None:
                table = self._tables[processor] = {}
                self._finalizers.append(weakref.finalize(processor, _abandon, table, "the manager went away"))
                cache = processor.cache
                if cache not in self._caches:
                    self._caches[cache] = cache.use_prefix_sharing
                    if cache.use_prefix_sharing:
                        cache.use_prefix_sharing = False
                        logger.info("nxl_hooks: prefix sharing is off on this continuous-batching cache while the "
                                    "probe is attached (a shared prefix never runs for the request reusing it)")
        scheduler = processor.scheduler
        for request_id in [r for r in table if r not in scheduler.active_requests
                           and r not in scheduler.waiting_requests]:
            run = table.pop(request_id, None)
            if run is not None:  # cancelled, or failed by the manager: it left without finishing
                run.finish(None, "the request left the manager before it finished (cancelled or failed)",
                           what="this request")
        return table

    def _begin(self, state: Any) -> Run | None:
        """A run for a request seen for the first time, or None (with a call record saying why)."""
        request_id = str(state.request_id)
        try:
            if state.generated_tokens or getattr(state, "_true_initial_tokens", 0):
                raise RuntimeError("this request had generated tokens before the probe saw it (it started before "
                                   "the probe attached, or resumed after an offload)")
            return self.gens.new_run(request_id=request_id, prompt_len=len(state.initial_tokens), eos=None)
        except Exception as error:  # noqa: BLE001
            self.gens.unrecorded(request_id, "this request", error)
            return None


# -- transformers serve without continuous batching: request ids ------------------------------------------

_MARK = "__nxl_patched__"


def _patched(function: Any) -> bool:
    return getattr(function, _MARK, False)


def _request_id(signature: inspect.Signature, args: tuple, kwargs: dict) -> str | None:
    try:
        value = signature.bind_partial(*args, **kwargs).arguments.get("request_id")
    except TypeError:
        return None
    return value if isinstance(value, str) and value else None


def _tag(original: Callable) -> Callable:
    """``original`` (sync or async) run with REQUEST_ID set to its ``request_id`` argument."""
    signature = inspect.signature(original)
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def tagged(*args: Any, **kwargs: Any) -> Any:
            token = REQUEST_ID.set(_request_id(signature, args, kwargs))
            try:
                return await original(*args, **kwargs)
            finally:
                REQUEST_ID.reset(token)
    else:
        @functools.wraps(original)
        def tagged(*args: Any, **kwargs: Any) -> Any:
            token = REQUEST_ID.set(_request_id(signature, args, kwargs))
            try:
                return original(*args, **kwargs)
            finally:
                REQUEST_ID.reset(token)
    setattr(tagged, _MARK, True)
    return tagged


def _in_context(original: Callable) -> Callable:
    """``submit(fn, ...)`` whose ``fn`` runs, in the other thread, in a copy of the submitter's context."""
    @functools.wraps(original)
    def submit(self: Any, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if REQUEST_ID.get() is not None:
            fn = functools.partial(contextvars.copy_context().run, fn)
        return original(self, fn, *args, **kwargs)

    setattr(submit, _MARK, True)
    return submit


def patch_serving(module: ModuleType) -> None:
    """Carry each request's id from ``transformers serve``'s handler to the ``generate`` call that serves it.

    ``transformers serve`` without continuous batching runs ``model.generate`` on its inference thread and does not
    pass the request id along. ``GenerateManager.generate_streaming`` / ``generate_non_streaming`` now set
    :data:`~nxl_hooks.hooks.generate.REQUEST_ID` to the request's id (the ``X-Request-ID`` header, or the uuid serve
    made), and what they submit to the inference thread runs in a copy of that context, so the ``generate`` call of
    the request carries its id. (Under continuous batching the manager has the id itself.) Applied once per class
    (a marker on the wrapper); never raises into the program."""
    manager = getattr(module, "GenerateManager", None)
    names = SERVE_HANDLERS + SERVE_SUBMITS
    if manager is None or not all(callable(getattr(manager, name, None)) for name in names):
        reason("request ids of transformers serve", RuntimeError(
            "this transformers version has no GenerateManager with " + ", ".join(names) +
            "; calls get generated ids"))
        return
    if _patched(manager.generate_streaming):
        return
    for name in SERVE_HANDLERS:
        setattr(manager, name, _tag(getattr(manager, name)))
    for name in SERVE_SUBMITS:
        setattr(manager, name, _in_context(getattr(manager, name)))
