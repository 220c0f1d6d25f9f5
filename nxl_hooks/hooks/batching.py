"""Continuous batching: every request its own :class:`~nxl_hooks.GenerationCall`, one Step per generated token.

    with nxl.attach(model, layers="all") as probe:
        out = model.generate_batch(prompts, generation_config=config)   # or a ContinuousBatchingManager, or
    {c.request_id: len(c.steps) for c in probe.calls}                   # `transformers serve --continuous-batching`

``model.generate_batch``, a manager from ``model.init_continuous_batching`` and ``transformers serve
--continuous-batching`` never call ``generate``: a background thread runs packed forwards of shape (1, N) over
several requests at once (prefill chunks and one-token decodes side by side, each request at its own positions,
over a paged KV cache), then gives a token to every request whose prompt is done. ``request_id`` is the manager's
id for the request (under ``transformers serve``, the ``X-Request-ID`` header, else the server's own id).

How. While a probe of a causal LM is attached, two methods of transformers' classes are wrapped (class-level, for
every model; requests of a model with no probe pass straight through; the originals come back when the last such
probe detaches):

- ``ContinuousBatchProcessor._generation_step``: before the forward, the batch's layout (which request owns which
  slice of the packed input, from which position) is read from the scheduler's list of the batch; the probe's
  hooks check it against the forward's own ``cu_seq_lens_q``, ``position_ids`` and ``logits_indices``, then append
  each slice's features to that request's feature cache (a :class:`~nxl_hooks.hooks.generate.Run`, as under
  ``generate``: the prefix is never re-run);
- ``RequestState.update_and_check_completion``: the token the manager gives a request becomes that request's step
  record, and a request that finishes ends its call, before the manager hands the result to its caller.

Not followed (requests run unchanged; one log line says why): a manager that pads its inputs for CUDA graphs or
torch.compile (hooks do not run when a graph replays; ``ContinuousBatchingConfig(use_cuda_graph=False)``, or
``transformers serve --no-cb-use-cuda-graph``, makes it followable), and transformers versions outside
:data:`VERSIONS`. While attached, prefix sharing is off on the paged caches the probe sees (a prefix shared from
another request's cache never runs for the request that reuses it, so that request's attribution could not be
computed); each cache gets its setting back at detach. A request that started mid-sequence anyway (it reused a
prefix before the probe attached, or it is a forked ``num_return_sequences`` child), or that had generated tokens
before the probe saw it, is marked not recorded. A request that leaves the manager unfinished (cancelled, failed,
or the manager stopped) ends incomplete.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .forward import Capture
from .generate import Generations, Run, stacked_features
from .guard import logger, reason

__all__ = ["Batching", "VERSIONS", "packed"]

#: transformers versions whose continuous-batching internals were checked: (major, minor) from .. below.
VERSIONS = ((5, 23), (6, 0))

_LOCK = threading.RLock()  # reentrant: a model collected while the lock is held detaches through here too
#: task model -> its probe's Batching (weakly both ways: the model's hooks keep the Batching alive)
_FOLLOWED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[Batching]]" = weakref.WeakKeyDictionary()
_INSTALLED: list[tuple[type, str, Callable, Callable]] = []  # (class, name, original, wrapper)
_local = threading.local()  # .pending: this thread's last packed step, whose tokens the manager hands out next


def packed(arguments: dict[str, Any]) -> bool:
    """Whether a backbone forward called with ``arguments`` is a packed continuous-batching forward."""
    return "cu_seq_lens_q" in arguments or "logits_indices" in arguments


def _classes() -> tuple[tuple[type, type] | None, str | None]:
    """(ContinuousBatchProcessor, RequestState), or None and why continuous batching cannot be followed here."""
    try:
        import transformers
        from packaging.version import Version
        from transformers.generation.continuous_batching import continuous_api, requests
    except ImportError as error:
        return None, f"transformers' continuous batching is not importable ({error})"
    version = Version(transformers.__version__).release[:2]
    if not VERSIONS[0] <= version < VERSIONS[1]:
        return None, (f"transformers {transformers.__version__} is not a version whose continuous-batching "
                      f"internals nxl_hooks checked ({'.'.join(map(str, VERSIONS[0]))} up to "
                      f"{'.'.join(map(str, VERSIONS[1]))})")
    processor, state = continuous_api.ContinuousBatchProcessor, requests.RequestState
    missing = [name for owner, name in ((processor, "_generation_step"), (state, "update_and_check_completion"))
               if not callable(vars(owner).get(name))]
    if missing:
        return None, f"transformers {transformers.__version__} has no {', '.join(missing)}"
    return (processor, state), None


def _followed(model: nn.Module) -> "Batching | None":
    ref = _FOLLOWED.get(model)
    return ref() if ref is not None else None


def _generation_step(original: Callable) -> Callable:
    def _generation_step(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        batching = _followed(model)
        _local.pending = None
        if batching is None:
            return original(self, model, *args, **kwargs)
        step = batching.open(self)  # never raises
        with batching.gens.running(step):
            try:
                out = original(self, model, *args, **kwargs)
            except BaseException:
                if isinstance(step, _Packed):
                    step.abandon("the manager's forward raised")
                raise
        if isinstance(step, _Packed) and step.awaiting:
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


def _install(classes: tuple[type, type]) -> None:
    """Wrap the two methods (caller holds the lock)."""
    processor, state = classes
    for owner, name, wrap in ((processor, "_generation_step", _generation_step),
                              (state, "update_and_check_completion", _update_and_check_completion)):
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


def _check_layout(arguments: dict[str, Any], segments: list[_Segment]) -> None:
    """The forward's own packing equals the layout read from the scheduler; ValueError otherwise."""
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


class _Packed:
    """One packed forward and the tokens it yields: the run the probe's hooks feed in the manager's thread (the same
    protocol as :class:`~nxl_hooks.hooks.generate.Run`: ``before_forward``, ``after_forward``, ``fail``)."""

    def __init__(self, batching: "Batching", table: dict[str, Any], segments: list[_Segment]) -> None:
        self._batching, self._table, self.segments = batching, table, segments
        self._ids = {segment.request_id for segment in segments}
        self._fed: set[str] = set()
        self.awaiting = sum(segment.new_token for segment in segments)  #: tokens the manager has yet to hand out
        self.failed = False

    def _runs(self) -> list[tuple[_Segment, Run]]:
        return [(s, s.run) for s in self.segments if s.run is not None and not s.run.failed]

    def before_forward(self, arguments: dict[str, Any]) -> None:
        _check_layout(arguments, self.segments)

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


class Batching:
    """One probe's view of continuous batching: the runs of the requests of its model's batch processors.

    Made by :func:`~nxl_hooks.attach` for causal LMs; :meth:`install` follows the model, :meth:`uninstall` (at
    detach) stops. ``unfollowed``: why continuous batching is not followed, or None.
    """

    def __init__(self, gens: Generations) -> None:
        self.gens, self.plan = gens, gens.plan
        self.unfollowed: str | None = None
        self._uninstalled = False
        self._tables: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()
        self._finalizers: list[weakref.finalize] = []
        self._skipped: "weakref.WeakSet[Any]" = weakref.WeakSet()  # processors not followed (said once, in the log)
        self._caches: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()  # cache -> its sharing
        self._lock = threading.RLock()

    def install(self) -> None:
        classes, self.unfollowed = _classes()
        if classes is None:
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
        with _LOCK:
            if _followed(self.plan.model) is self:
                del _FOLLOWED[self.plan.model]
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

    # -- in the manager's thread -------------------------------------------------------------------------

    def open(self, processor: Any) -> Any:
        """The packed step about to run on ``processor``, or ``Generations.UNRECORDED`` (never raises)."""
        if processor in self._skipped:
            return Generations.UNRECORDED
        try:
            why = self._unfollowable(processor)
            if why is not None:
                self._skipped.add(processor)
                logger.warning("nxl_hooks: continuous-batching requests are not recorded: %s; they run unchanged", why)
                return Generations.UNRECORDED
            table = self._table(processor)
            if table is None:  # detached meanwhile
                return Generations.UNRECORDED
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
            self._skipped.add(processor)  # said once: this manager's requests are not recorded from now on
            reason("continuous batching on this manager", error)
            return Generations.UNRECORDED

    @staticmethod
    def _unfollowable(processor: Any) -> str | None:
        runner = processor.model_runner
        if getattr(runner, "pad_inputs", True) or hasattr(processor.inputs_and_outputs, "io_pairs"):
            return ("this manager pads its inputs for CUDA graphs or torch.compile, and hooks do not run when a graph "
                    "replays (ContinuousBatchingConfig(use_cuda_graph=False) without compile configs, or "
                    "`transformers serve --no-cb-use-cuda-graph`, lets the probe follow it)")
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
