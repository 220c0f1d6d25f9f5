"""One packed forward of transformers' continuous batching, as its engine (:mod:`.transformers_cb`) records it.

    step = _Packed(batching, table, segments, taps, prompts, scheduler=..., kept=...)  # ContinuousBatching.open
    ...                                                         # the probe's hooks feed it (eager), or step.collect()
    step.settle(state, token, appended=True, finished=False)   # each token the manager hands out after it

A :class:`_Packed` is the :class:`~nxl_hooks.hooks.recording.Recording` of one of the manager's generation steps:
which request owns which slice of the packed input (:class:`_Segment`, read from the scheduler and checked against
the forward's own packing by :func:`_check_layout`), each slice's features into that request's
:class:`~nxl_hooks.hooks.generate.Run`, then the tokens the manager hands out. A padded step (run compiled, or
replayed as a CUDA graph) is read after it ran from its processor's :class:`_Taps`, the
:class:`~.buffers.Buffers` hooks traced or captured into it. ``_local.pending`` is the thread's last step whose
tokens are still to be handed out. Internal to the engine: :mod:`.transformers_cb` makes and drives all of it.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..forward import Capture, embedding_norms, head_features
from ..generate import Generations, Run, stacked_features
from ..recording import NOT_RECORDED
from .buffers import Buffers

__all__: list[str] = []

_local = threading.local()  # .pending: this thread's last packed step, whose tokens the manager hands out next


#: Why a request's slice cannot be fed: it starts after the last position its run holds.
_SKIPPED = ("this request's forwards start at position {first}: positions {length}..{last} ran for another request "
            "(a prefix shared from its cache: cached before the probe attached, a forked num_return_sequences "
            "child's, or taken up again after the manager preempted this request part way through its prompt), so "
            "their attribution is unknown")


class _Table(dict):
    """A processor's runs by request id. ``inside``: its manager's thread is in the probe's code, touching them (a
    step opening or fed, a token settled: :meth:`~.transformers_cb.ContinuousBatching.enter`), so a detach leaves
    them to that thread to end as it leaves."""

    inside = False


@dataclass(frozen=True)
class _Segment:
    """One request's slice of a packed forward."""

    request_id: str
    start: int  #: first index in the packed input
    length: int
    first: int  #: the request's position of that first index
    new_token: bool  #: the manager samples a token for this request from this forward
    run: Any  #: the request's Run, or None when it is not recorded
    state: Any  #: the manager's state of the request (its tokens, by which its rows are kept should it leave)


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
    order = [position for s in segments for position in range(s.first, s.first + s.length)]
    if (cumulative.tolist() != expected or ids.shape != (1, expected[-1]) or positions[0].tolist() != order
            or (logits is not None and logits.tolist()[: len(emitting)] != emitting)):
        raise ValueError(f"the packed forward (cu_seq_lens_q {cumulative.tolist()}) does not match the batch the "
                         f"manager scheduled ({expected}): the layout of this transformers version is not understood")
    return expected[-1]


def _sampled(logits: torch.Tensor, emitting: list[_Segment], *, every_row: bool) -> tuple[torch.Tensor, ...]:
    """The model's own log-probabilities (1, vocabulary) at the row each of ``emitting`` samples from, in its order:
    ``logits`` (rows, vocabulary) are the whole packed input's (``every_row``), else those of the sampled rows in
    batch order (``logits_to_keep``). One log-softmax for all of them, and each request's row a view of it made in
    the same operation, not a copy per request and step (a CUDA-graph step is bound by such launches). A step's rows
    stay alive while one of them waits to be scored: at most :data:`~..generate.BATCH_STEPS` steps of a request its
    scheduler pauses, as its features (:meth:`_Packed._feed`)."""
    picked = (logits[torch.tensor([s.start + s.length - 1 for s in emitting], device=logits.device)] if every_row
              else logits.narrow(0, 0, len(emitting)))
    return picked.float().log_softmax(-1)[:, None].unbind(0)


def _stream(output: Any) -> torch.Tensor:
    """A block's hidden states (most blocks return a tensor, some a tuple that starts with them)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def _block_input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class _Taps:
    """What a padded processor's forwards write (it runs them compiled, or replays them as CUDA graphs): per packed
    token, the hidden states of every selected layer (``hidden``: slot i is ``plan.layers[i]``) and the embedding row
    (``embedding``), as the model made them, and the task model's logits (``logits``: the rows it samples from, in
    batch order, or every row when the model has no ``logits_to_keep``). Hooks of :class:`~.buffers.Buffers` put on
    before the processor compiles or captures, so they are traced or captured with it; they write only while
    ``marker`` is the thread's recording (the processor's own forwards: its warmup and steps), and the probe's own
    hooks skip that recording (it is a not-recorded one), so nothing of theirs runs in the compiled region. They only
    copy: the head features and embedding norms are taken after the step (:meth:`read`), since a norm compiled with
    the model's own changes the model's kernels. Copies do too, under inductor (:mod:`..traced` says how): a GPU's
    bf16 output of the compiled padded path may differ from plain's in the last place; the CUDA-graph path, which
    captures the model's own eager kernels, is not changed (tests/gpu/test_cb_graphs.py)."""

    def __init__(self, plan: Any, gens: Generations, processor: Any) -> None:
        self.marker = copy.copy(NOT_RECORDED)  # an object of its own: the taps' condition, constant for a trace
        marker = self.marker

        def ours() -> bool:
            return gens.current() is marker

        runner, model, head, blocks = processor.model_runner, plan.model, plan.head, plan.blocks
        outputs = plan.subject.layer_modules  # where h[l] is read (a module after block l, for some families)
        rows = int(processor.cache.max_batch_tokens)
        self.logits_kept = logits_kept(processor, model)
        embedding = model.get_input_embeddings()
        weight = embedding.weight
        self._plan = plan
        width = plan.model.config.hidden_size  # the blocks'; a word embedding may be narrower (projected after it)
        self.hidden = Buffers(len(plan.layers), rows, (width,), dtype=weight.dtype, device=weight.device, when=ours)
        self.embedding = Buffers(1, rows, weight.shape[-1:] if plan.embedding == "word" else (width,),
                                 dtype=weight.dtype, device=weight.device, when=ours)
        sampled = int(runner.cb_config.max_requests_per_batch) if self.logits_kept else rows
        self.logits = Buffers(1, sampled, (head.n_outputs,), dtype=torch.float32, device=weight.device, when=ours)
        try:
            for slot, layer in enumerate(plan.layers):
                if layer == 0:
                    self.hidden.tap_input(slot, blocks[0], _block_input)
                else:
                    self.hidden.tap(slot, outputs[layer - 1], _stream)
            if plan.embedding == "word":
                self.embedding.tap(0, embedding, lambda output: output)
            else:
                self.embedding.tap_input(0, blocks[0], _block_input)
            self.logits.tap(0, model, lambda output: output.logits)
        except BaseException:
            self.remove()
            raise

    @property
    def rows(self) -> int:
        return self.hidden.rows

    def read(self, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(head features (1, tokens, layers, d'), embedding norms (1, tokens)) of the step's first ``total`` packed
        tokens, from the rows the taps copied."""
        with torch.no_grad():
            return (head_features(self._plan, self.hidden.values[:, None], 0, total),
                    embedding_norms(self._plan, self.embedding.values[:, :total]))

    def remove(self) -> None:
        for buffers in (self.hidden, self.embedding, self.logits):
            buffers.remove()


def logits_kept(processor: Any, model: nn.Module) -> bool:
    """Whether ``processor``'s forwards give the model's logits at the rows its requests sample from alone
    (``logits_to_keep``, in their order), not at every packed token (the runner remembers it: cheap per step)."""
    keeps = getattr(getattr(processor, "model_runner", None), "supports_logits_to_keep", None)
    return bool(callable(keeps) and keeps(model))


class _Packed:
    """One packed forward and the tokens it yields: the :class:`~nxl_hooks.hooks.engines.Recording` the probe's
    hooks feed in the manager's thread."""

    def __init__(self, batching: Any, table: dict[str, Any], segments: list[_Segment],
                 taps: _Taps | None = None, prompts: dict[str, list[int]] | None = None, *, scheduler: Any = None,
                 kept: bool = False) -> None:
        self._batching, self._table, self.segments = batching, table, segments
        self._scheduler = scheduler  # the manager's (a finished request's forked children may still be waiting)
        self._kept = kept  # the logits are the sampled rows' alone (:func:`logits_kept`), not every packed token's
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
        """The model's own log-probabilities at each sampled row go to that request's run, its step's
        ``probability`` (:func:`_sampled`)."""
        logits = getattr(output, "logits", None)
        emitting = [s for s in self.segments if s.new_token]
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or not emitting:
            return
        # (not told by the shapes: one sampled row per packed token, all of them one-token slices, is either)
        every_row = not self._kept
        if (logits.shape[1] != self._length) if every_row else (logits.shape[1] < len(emitting)):
            return
        for segment, row in zip(emitting, _sampled(logits[0], emitting, every_row=every_row)):
            if segment.run is not None and not segment.run.failed:
                segment.run.predicted(row)

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
            if total > taps.rows or len(emitting) > taps.logits.rows:
                raise RuntimeError(f"this forward packed {total} tokens, more than the {taps.rows} rows its "
                                   "buffers were made for")
            features, norms = taps.read(total)
            logits, sampled = taps.logits.values[0], {}
            if emitting:
                sampled = dict(zip((s.request_id for s in emitting),
                                   _sampled(logits, emitting, every_row=not taps.logits_kept)))
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
        samples from, the model's own log-probabilities (``sampled``, by request id).

        The one-token slices (the decoding requests: most of a busy step) are gathered into one tensor of their own,
        and each waits in its run as a view of it, fed with the steps it scores together (``feed(later=True)``): a
        copy per request and step into its feature cache costs a few device operations each, which a step replayed
        as a CUDA graph in a few milliseconds feels. Only those rows are kept alive, not the step's prefill chunks;
        a request its scheduler pauses keeps the steps it waits with (at most BATCH_STEPS) alive until it goes on."""
        mask = torch.ones_like(embed, dtype=torch.bool)
        single = [index for index, (segment, _) in enumerate(runs) if segment.length == 1]
        gathered = {}
        if single:
            rows = torch.tensor([runs[index][0].start for index in single], device=features.device)
            own_features, own_embed = features.index_select(1, rows), embed.index_select(1, rows.to(embed.device))
            # each one's features, embedding norm and mask (the same one-position all-True view: only read)
            gathered = dict(zip(single, zip(own_features.split(1, dim=1), own_embed.split(1, dim=1),
                                            [mask[:, :1]] * len(single))))
        for index, (segment, run) in enumerate(runs):
            try:
                if segment.first > run.length:
                    raise RuntimeError(_SKIPPED.format(first=segment.first, length=run.length,
                                                       last=segment.first - 1))
                window = slice(segment.start, segment.start + segment.length)
                # (a device copy each, made only where the run reads them)
                known = ids(segment, window) if run.wants_ids(segment.first) else None
                if index in gathered:
                    run.feed(segment.first, *gathered[index], known, later=True)
                else:
                    run.feed(segment.first, features[:, window], embed[:, window], mask[:, window], known)
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
        """The host's forward raised: the requests in it end incomplete (the host fails them too), their rows kept
        for the requests that reuse their cached prefixes (a manager started again keeps its cache's blocks)."""
        for segment in self.segments:
            self._batching.left(self._table, request_id=segment.request_id, state=segment.state,
                                scheduler=self._scheduler, why=why)

    def leave(self) -> None:
        """The manager's thread is done with this step's forward
        (:meth:`~.transformers_cb.ContinuousBatching.leave`)."""
        self._batching.leave(self._table)

    def settle(self, state: Any, token: Any, *, appended: bool, finished: bool) -> None:
        """The manager gave ``token`` to the request of ``state``: its step record; its end if it ``finished``.
        Nothing of it once the probe detached (the runs were ended)."""
        self.awaiting -= 1
        try:
            if self._batching.enter(self._table):
                try:
                    self._settle(state, token, appended=appended, finished=finished)
                finally:
                    self._batching.leave(self._table)
        finally:
            if self.awaiting <= 0:  # the last one: its records go on together; the thread lets go of this step
                _local.pending = None
                self._batching.gens.hub.release()

    def _settle(self, state: Any, token: Any, *, appended: bool, finished: bool) -> None:
        run = self._table.get(state.request_id)
        if run is None or state.request_id not in self._ids:
            if finished:
                self._table.pop(state.request_id, None)
            return
        try:
            if appended and not run.failed:
                if state.request_id not in self._fed:
                    raise RuntimeError("the probe did not see the forward that produced this token")
                run.emit(int(token))
        except Exception as error:  # noqa: BLE001 - never into the manager's loop
            run.fail("this request", error)
        if finished:
            self._table.pop(state.request_id, None)
            self._batching.keep(state, run, self._scheduler)  # before its end lets go of its features
            try:
                output = state.to_generation_output()
                sequences = torch.tensor([list(output.prompt_ids) + list(output.generated_tokens)], dtype=torch.long)
            except Exception as error:  # noqa: BLE001
                run.fail("the end of this request", error)
                sequences = None
            run.finish(sequences, what="this request")


def _abandon(table: dict[str, Any], why: str) -> None:
    """Every request still in ``table`` ends incomplete: its manager was collected (this may run inside a garbage
    collection, on any thread), or the probe detached while the manager ran (in the detaching thread, or in the
    manager's as it leaves the step it was in). The steps still waiting to be scored are dropped, not scored, and
    the call says how many. Two threads may end one table at once: each run is ended by the one that takes it."""
    while True:
        try:
            _, run = table.popitem()
        except KeyError:  # none left
            return
        if run is not None:
            waiting = run.drop_waiting()
            run.finish(None, f"{why}; its last {waiting} steps were not scored" if waiting else why,
                       what="this request")

