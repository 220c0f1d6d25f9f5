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

How. While a probe of a causal LM is attached, four methods of transformers' classes are wrapped (class-level, for
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
  record, and a request that finishes ends its call, before the manager hands the result to its caller;
- ``ContinuousBatchingManager.__init__``: with ``NXL_EAGER=1`` in the environment (``nxl run --eager``), managers
  of followed models are made with ``use_cuda_graph=False`` (a fallback: no longer needed to record them).

Padded steps (compile configs, CUDA graphs: the manager pads its inputs and runs each step compiled, or replays a
graph, where hooks added afterwards never run): the processor gets :class:`_Taps`, hooks of
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
moved (what is wrapped is :data:`~nxl_hooks.hooks.conventions.CONTINUOUS_BATCHING`, checked before wrapping). While
attached, prefix sharing is off on the paged caches the probe sees (a prefix shared from another request's cache
never runs for the request that reuses it, so that request's attribution could not be computed); each cache gets
its setting back at detach. A request that started mid-sequence anyway (it reused a prefix before the probe
attached, or it is a forked ``num_return_sequences`` child), or that had generated tokens before the probe saw it,
is marked not recorded. A request that leaves the manager unfinished (cancelled, failed, or the manager stopped)
ends incomplete.

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
from .buffers import Buffers

__all__ = ["ContinuousBatching", "patch_serving"]

#: What makes a manager that batches asynchronously recordable (said in each of its requests' call records).
_ASYNC_OFF = f"pass ContinuousBatchingConfig(use_async_batching=False), or {MAKE_EAGER}"

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
        # a padded step runs compiled (or replays a CUDA graph): the taps write it, the probe's own hooks stand by
        current = NOT_RECORDED if step is None else step if step.taps is None else step.taps.marker
        with batching.gens.running(current):
            try:
                out = original(self, model, *args, **kwargs)
            except BaseException:
                if step is not None:
                    step.abandon("the manager's forward raised")
                raise
        if step is not None and step.taps is not None:
            step.collect()
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


def _warmup(original: Callable) -> Callable:
    def warmup(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        batching = _followed(model)
        taps = batching.prepare(self) if batching is not None else None  # never raises
        if taps is None:
            return original(self, model, *args, **kwargs)
        with batching.gens.running(taps.marker):  # compiled (or captured) with the taps, as the steps will run
            return original(self, model, *args, **kwargs)

    return warmup


def _install(classes: list[type]) -> None:
    """Wrap the methods of :data:`~nxl_hooks.hooks.conventions.CONTINUOUS_BATCHING` (caller holds the lock)."""
    wrappers = {"_generation_step": _generation_step, "update_and_check_completion": _update_and_check_completion,
                "__init__": _manager_init, "warmup": _warmup}
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


#: Why a request's slice cannot be fed: it starts after the last position its run holds.
_SKIPPED = ("this request's forwards start at position {first}: positions {length}..{last} ran for another request "
            "(a prefix shared from its cache before the probe attached, or a forked num_return_sequences child), so "
            "their attribution is unknown")


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


def _stream(output: Any) -> torch.Tensor:
    """A block's hidden states (most blocks return a tensor, some a tuple that starts with them)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def _block_input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class _Taps:
    """What a padded processor's forwards write (it runs them compiled, or replays them as CUDA graphs): per packed
    token, the head features of every selected layer (``features``: slot i is ``plan.layers[i]``) and the embedding
    norm (``norms``), and the task model's logits (``logits``: the rows it samples from, in batch order, or every
    row when the model has no ``logits_to_keep``). Hooks of :class:`~.buffers.Buffers` put on before the processor
    compiles or captures, so they are traced or captured with it; they write only while ``marker`` is the thread's
    recording (the processor's own forwards: its warmup and steps), and the probe's own hooks skip that recording
    (it is a not-recorded one), so nothing of theirs runs in the compiled region."""

    def __init__(self, plan: Any, gens: Generations, processor: Any) -> None:
        self.marker = copy.copy(NOT_RECORDED)  # an object of its own: the taps' condition, constant for a trace
        marker = self.marker

        def ours() -> bool:
            return gens.current() is marker

        runner, model, head, blocks = processor.model_runner, plan.model, plan.head, plan.blocks
        rows = int(processor.cache.max_batch_tokens)
        keeps = getattr(runner, "supports_logits_to_keep", None)
        self.logits_kept = bool(callable(keeps) and keeps(model))
        embedding = model.get_input_embeddings()
        weight = embedding.weight
        with torch.no_grad():  # what the head makes of a hidden state: the features' width and dtype
            like = head.features(torch.zeros(1, 1, weight.shape[-1], dtype=weight.dtype, device=weight.device))
        self.features = Buffers(len(plan.layers), rows, like.shape[2:], dtype=like.dtype, device=like.device,
                                when=ours)
        self.norms = Buffers(1, rows, (), dtype=torch.float32, device=weight.device, when=ours)
        sampled = int(runner.cb_config.max_requests_per_batch) if self.logits_kept else rows
        self.logits = Buffers(1, sampled, (head.n_outputs,), dtype=torch.float32, device=weight.device, when=ours)
        try:
            for slot, layer in enumerate(plan.layers):
                if layer == 0:
                    self.features.tap_input(slot, blocks[0],
                                            lambda args, kwargs: head.features(_block_input(args, kwargs)))
                else:
                    self.features.tap(slot, blocks[layer - 1], lambda output: head.features(_stream(output)))
            if plan.embedding == "word":  # the raw word-embedding row: Gemma-style scaling undone, as the probe does
                scale = getattr(embedding, "embed_scale", None)
                self.norms.tap(0, embedding, lambda output: torch.linalg.vector_norm(
                    output.float() / scale.float() if scale is not None else output.float(), dim=-1))
            else:
                self.norms.tap_input(0, blocks[0], lambda args, kwargs: torch.linalg.vector_norm(
                    _block_input(args, kwargs), dim=-1, dtype=torch.float32))
            self.logits.tap(0, model, lambda output: output.logits)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        for buffers in (self.features, self.norms, self.logits):
            buffers.remove()


class _Packed:
    """One packed forward and the tokens it yields: the :class:`~nxl_hooks.hooks.engines.Recording` the probe's
    hooks feed in the manager's thread."""

    def __init__(self, batching: "ContinuousBatching", table: dict[str, Any], segments: list[_Segment],
                 taps: _Taps | None = None, prompts: dict[str, list[int]] | None = None) -> None:
        self._batching, self._table, self.segments = batching, table, segments
        #: a padded step's buffers (its features are read from them after the step, :meth:`collect`), or None
        self.taps = taps
        self._prompts = prompts or {}  # request id -> its prompt's token ids (a padded step's prefill chunks)
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
        ids = capture.input_ids
        self._feed(runs, stacked_features(self._batching.plan, capture), capture.embed_norm,
                   lambda segment, window: ids[:, window].long() if ids is not None else None)

    def collect(self) -> None:
        """After a padded step (outside the compiled region, on the host): each request's rows of the taps' buffers
        go to its run, as an eager forward's slice would; the model's own log-probabilities at the rows it sampled
        from, in one log-softmax. Never raises."""
        runs = self._runs()
        if not runs:
            return
        taps = self.taps
        try:
            total = sum(segment.length for segment in self.segments)
            emitting = [s for s in self.segments if s.new_token]
            if total > taps.features.rows or len(emitting) > taps.logits.rows:
                raise RuntimeError(f"this forward packed {total} tokens, more than the {taps.features.rows} rows its "
                                   "buffers were made for")
            features = taps.features.values[:, :total].transpose(0, 1)[None]  # (1, tokens, layers, d')
            norms = taps.norms.values[:, :total]
            logits, sampled = taps.logits.values[0], {}
            if emitting:
                rows = (list(range(len(emitting))) if taps.logits_kept
                        else [s.start + s.length - 1 for s in emitting])
                log_probs = logits[torch.tensor(rows, device=logits.device)].log_softmax(-1)
                sampled = {s.request_id: log_probs[index: index + 1] for index, s in enumerate(emitting)}
        except Exception as error:  # noqa: BLE001 - never into the manager's loop
            self.fail("this padded step", error)
            return

        def prompt_ids(segment: _Segment, window: slice) -> torch.Tensor | None:
            prompt = self._prompts.get(segment.request_id, [])[segment.first: segment.first + segment.length]
            return torch.tensor([prompt], dtype=torch.long, device=norms.device) if prompt else None

        self._feed(runs, features, norms, prompt_ids, sampled)

    def _feed(self, runs: list[tuple[_Segment, Run]], features: torch.Tensor, embed: torch.Tensor,
              ids: Callable[[_Segment, slice], torch.Tensor | None],
              sampled: dict[str, torch.Tensor] | None = None) -> None:
        """Each request's slice of a packed forward's ``features`` (1, tokens, layers, d') and ``embed`` norms
        (1, tokens) into its run, with its token ids (``ids(segment, window)``) and, for a request the manager
        samples from, the model's own log-probabilities (``sampled``, by request id)."""
        mask = torch.ones_like(embed, dtype=torch.bool)
        for segment, run in runs:
            try:
                if segment.first > run.length:
                    raise RuntimeError(_SKIPPED.format(first=segment.first, length=run.length,
                                                       last=segment.first - 1))
                window = slice(segment.start, segment.start + segment.length)
                run.feed(segment.first, features[:, window], embed[:, window], mask[:, window], ids(segment, window))
                if sampled is not None and segment.new_token:
                    run.predicted(sampled[segment.request_id])
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
        self._taps: "weakref.WeakKeyDictionary[Any, _Taps]" = weakref.WeakKeyDictionary()  # padded processors'
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
            for taps in list(self._taps.values()):  # their compiled code recompiles without them at its next call
                taps.remove()
            self._taps.clear()
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
            taps = self.prepare(processor, quiet=False) if processor.model_runner.pad_inputs else None
            segments, start, prompts = [], 0, {}
            for future in processor.inputs_and_outputs.requests_in_batch:
                state, length = future.state, future.query_length
                request_id = state.request_id
                if request_id not in table:
                    table[request_id] = self._begin(state)
                first = state.position_offset - length  # already advanced for this batch
                segments.append(_Segment(request_id=request_id, start=start, length=length, first=first,
                                         new_token=bool(future.has_new_token), run=table[request_id]))
                if taps is not None and first < len(state.initial_tokens):  # a prefill chunk: its ids, on the host
                    prompts[request_id] = state.initial_tokens
                start += length
            return _Packed(self, table, segments, taps, prompts)
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
