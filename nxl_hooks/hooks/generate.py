"""Attribution while ``model.generate`` runs: one :class:`~nxl_hooks.Step` per emitted token, KV cache kept.

    with nxl.attach(model, tokenizer=tok) as probe:
        out = model.generate(**enc, max_new_tokens=32)
    probe.steps[-1].normxlogit    # (len(layers), batch, context_len)

How. :func:`~nxl_hooks.attach` sets a thin wrapper as the model instance's ``generate`` (removed at detach; a
text-generation pipeline and ``PeftModel.generate`` both end up in it). The wrapper only marks where a call starts
and ends, in the thread that makes it, and reads generate's return value; the user's call is unchanged. Inside it
the probe's hooks see one prefill forward with the whole prompt (or several, with ``prefill_chunk_size``), then one
forward per new token with one position and a KV cache holding everything before it. Each forward's block outputs
(all selected layers stacked, one head call) become head features and are appended to the call's feature cache,
so the prefix is never re-run. The prediction read at the last position explains the token generate emits next.
That token is known only at the next forward (its ``input_ids``) or, for the last one, which never passes through
the blocks, from generate's return value; so step t's record is completed when forward t+1 starts (or when
generate returns). It explains the token actually emitted, whatever chose it: greedy, sampling, logits
processors, a streamer or not. A processor that runs the model itself (classifier-free guidance) runs it unrecorded
(:meth:`Generations._apart`).

Host reads. Per generated token the recorder reads nothing back from the device: the emitted token, its scores,
the rows that finished (EOS, a stop string) and the decoding step's position stay device tensors; the steps go to
the hub's publisher (:mod:`.publish`), which moves their records to the host in its own thread. On a GPU it scores
them there too (one matmul for the steps scored together, then the methods), off the generating thread, while that
one waits for the device (:data:`SCORED_ELSEWHERE`). What the host reads is a constant per call: the prompt (ids,
mask), the first decoding step's position, whether a later step ran at another position (one flag), which of the
tokens its forwards fed back are not those it returned (one read: :meth:`Run._undid`), and generate's output.

Compiled calls. Forwards that run compiled (a static cache, with which ``generate`` compiles its decoding steps
itself, or a ``forward`` the user compiled) run the model's own compiled code: the hooks, traced into it, do nothing
there (anything of theirs would become part of the model's kernels and change its output: :mod:`.traced`). When
such a call returns, :meth:`Run._replay` runs the model once more, eagerly, over the positions the hooks did not see
(the tokens generate fed back, against what the call's cache holds of the positions that ran eagerly; every
position where the prompt ran compiled too), and records them from those forwards as the eager hooks would have,
each step with the model's distribution at the position before it; so a compiled call's records are those of the
same tokens run eagerly, and its output is the one it has unrecorded, to the bit. Those forwards are a chunked
prefill of the generated tokens per call (:data:`REFILL_POSITIONS`) when the call returns: on the calling thread,
or where its steps are scored off it (:data:`SCORED_ELSEWHERE`: on a GPU) in a thread of their own while the host
goes on (:meth:`Run.finish`; reading the records and detaching wait for them).

Threads. Each ``generate`` call has its own :class:`Run`, found through the calling thread, so calls in several
threads on one attached model are recorded separately; each record says its thread and request.

Memory. The feature cache is the only thing that grows with the context: per selected layer and token, batch × d
values of ``cache_dtype`` (d: the head's feature size, the hidden size for most decoders; default dtype: the
model's), e.g. 512 × 4 B = 2 KiB per token per layer for a float32 model with d = 512 at batch 1; plus, per
token, batch × (4 B embedding norm + 1 B mask). Its capacity doubles as it grows, so at most twice that is
allocated. It lives on ``cache_device`` (default: the last selected block's device, where the layers meet under a
device_map); ``cache_device="cpu"`` keeps it off the accelerator, and the per-step dot products then run on the
CPU. Nothing vocabulary-sized is kept (but the log-probability rows of the steps waiting to be scored together,
:data:`BATCH_STEPS`): per step only the emitted token's row of the readout is read, once for all layers (a quantized
or adapter-wrapped readout is called instead, which is vocabulary-sized while it runs).
The records themselves are the caller's: 2 × 4 B × layers × batch × context per step (normxlogit and logat);
``keep_steps=False`` with ``on_step`` / ``sink`` streams them out without keeping them (and with none of those,
nor a :meth:`~nxl_hooks.Probe.stream` subscriber, a step's record is not even made).

Beam search, assisted decoding with a second model and prompt lookup are recorded as a compiled call is, whole, when
they return (:func:`replayed`, :meth:`Run.replay_whole`): a beam search's forwards run candidate beams, reordered and
pruned between steps, so a row of theirs is not one sequence; assisted decoding's verify several candidate tokens
each and drop some. The sequences they return are one each. Not recorded (the call runs unchanged,
``GenerationCall.error`` says why): multi-token prediction (``use_mtp``) and generate resuming from a filled
``past_key_values`` (positions the probe never saw).
``num_return_sequences`` with sampling works: its rows are independent sequences. Self-speculative decoding
(``assistant_early_exit``) is recorded as a compiled call is: its draft forwards stop at an early block (no last
block's output), so the hooks follow the call no more (:meth:`Run._unfollow`) and :meth:`Run._replay` records it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
import operator
import os
import threading
import time
import uuid
from types import CodeType, FrameType
from typing import Any, Callable, Iterator, NamedTuple, Sequence, TypeVar

import torch
from torch import nn

from ..arch.text import record_text
from ..method.head import same_weights, weights_state
from ..method.placement import offloaded
from ..method.protocol import Given
from ..method.select import empty_row
from ..records.steps import GenerationCall, Step
from ..records.view import Choice
from .recording import NOT_RECORDED, Recording
from .conventions import (UnfollowedForward, cache_keyword, cache_length, find_cache, positions, prefix_cache, start,
                          token_mask)
from .forward import NEEDS_IDS, Capture, embed_norms, head_features, layer_states, pin_last_layer
from .guard import Notice, Owned, described, raised, reason, typed
from .plan import Plan
from .publish import Hub
from .traced import eager_twin

__all__ = ["EAGER", "REQUEST_ID", "REQUEST_NAMES", "Generations", "Notice", "RequestNames", "Run", "between_steps",
           "eager", "stacked_features"]

#: The environment variable (``"1"``, ``nxl run --eager``) that makes recorded calls run eagerly, a fallback (compiled
#: calls are recorded too): ``generate`` without its automatic torch.compile (``disable_compile=True``),
#: continuous-batching managers without CUDA graphs.
EAGER = "NXL_EAGER"
#: What makes a call that ran through compiled code or CUDA graphs recordable.
MAKE_EAGER = f"set {EAGER}=1 (nxl run --eager)"

#: The request the current context serves; a server integration sets it (``X-Request-ID``), else calls get an id.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("nxl_hooks_request_id", default=None)


class RequestNames:
    """The client's ids of requests an engine knows by ids of its own (``transformers serve`` from 5.25 numbers the
    requests its API servers hand the model's process), which a server integration sets as each request arrives
    and the engine names its records by (continuous batching's). The newest :attr:`KEPT` only: an id whose request
    never began (cancelled while queued) is let go with them.

        REQUEST_NAMES.name("1099511627776", "chat-7")   # then a record of request "1099511627776" is "chat-7"'s
    """

    KEPT = 4096

    def __init__(self) -> None:
        self._names: dict[str, str] = {}
        self._lock = threading.Lock()  # (once per request, never per step)

    def name(self, engine_id: str, client_id: str) -> None:
        with self._lock:
            self._names.pop(engine_id, None)
            self._names[engine_id] = client_id
            while len(self._names) > self.KEPT:
                del self._names[next(iter(self._names))]

    def __call__(self, request_id: str | None) -> str | None:
        """The client's id of ``request_id``, or ``request_id`` itself."""
        with self._lock:
            return self._names.get(request_id, request_id) if request_id is not None else None


#: This process's :class:`RequestNames`.
REQUEST_NAMES = RequestNames()


#: Emitted steps a call scores together while nothing reads its records live (no ``on_step``, no subscriber): one
#: matmul reads the feature cache once for all of them instead of once per token, a decoding step's hidden states are
#: normed with theirs, and the publisher wakes once per batch. Their records reach the sink at most that many of the
#: call's tokens after their token (sooner for a ``generate`` call: :data:`BATCH_SECONDS`; a continuous-batching
#: request its scheduler pauses keeps them until it goes on), all of them when the call ends; a live reader gets each
#: as it is made. Under transformers' continuous batching this is what each request's records cost
#: least with: its manager interleaves many requests, so each step of each request reads that request's cache cold
#: from memory (32 requests on the CPU, benchmarks/bench_batching.py: 0.91 of plain throughput scored per step, 0.97
#: scored together). vLLM's requests still score each step as it comes (together measured no better there:
#: docs/vllm.md).
BATCH_STEPS = 16
#: A ``generate`` call's waiting steps are scored at the first token that finds the first of them this old (beside a
#: slow token, scoring it alone costs little, and its one cache stays warm between tokens).
BATCH_SECONDS = 0.25
#: Where a call's feature cache is (where its steps are scored) on these devices, its steps are scored in the hub's
#: publisher thread, off the generating one: a model there computes asynchronously, so the generating thread waits
#: for it, and the scoring fits in those waits. A model on the CPU computes in the generating thread itself: the
#: steps are scored there, between its forwards (scored in the publisher instead, the two threads contend for the
#: interpreter and the cores: transformers' continuous-batching manager on the CPU took 45 to 60 µs more wall time
#: per request and token, its own CPU time unchanged). The same holds for the eager forwards that record a compiled
#: ``generate`` call when it returns (:meth:`Run.finish`): on these devices they run in a thread of their own.
SCORED_ELSEWHERE = frozenset({"cuda"})
#: Whether an engine's request (:meth:`Generations.new_run` ``engine=True``: continuous batching, vLLM) ends as a
#: ``generate`` call does, waiting until the publisher has kept the records of the call that ended before it. False:
#: its end returns at once, since the engine's loop runs every request's steps (a publisher held up, by a slow
#: reader's scoring say, made the whole loop wait, up to :data:`~.publish.FLUSH_SECONDS` per request); on a GPU the
#: device may then sit idle meanwhile. ``benchmarks/bench_batching.py`` measures both, side by side.
ENGINE_ENDS_WAIT = False
#: Positions a compiled call's forwards are run again in at a time when it ends (:meth:`Run._replay`), fewer where
#: their logits would pass :data:`BATCH_BYTES`: each run holds their hidden states, head features and logits.
REFILL_POSITIONS = 512
#: What the waiting steps keep (the model's log-probability rows) and their scores at once stay under this many bytes
#: (scoring them together holds up to about three times that while it runs: :meth:`Run._scored`'s stacked copies;
#: a batch handed on to the publisher keeps its rows until it is scored, all of them under
#: :data:`~.publish.UNSCORED_BYTES`).
BATCH_BYTES = 64 << 20


#: The code of the hooks' wrappers that wait for the host's code while it runs (generate's, and that of the list of its
#: stopping criteria or logits processors): a thread stopped with no other frame of nxl_hooks' recording code on its
#: stack is between two of the hooks' steps (:func:`between_steps`). Each is added where it is defined (:func:`_waits`).
_WAITING: set[CodeType] = set()
#: The modules of nxl_hooks' recording code (its apps run the host's program and load its models, around the hooks).
_RECORDING = ("nxl_hooks.hooks.", "nxl_hooks.method.", "nxl_hooks.records.", "nxl_hooks.arch.")
_F = TypeVar("_F", bound=Callable)


def _waits(function: _F) -> _F:
    """``function`` is a wrapper that waits for the host's code (:data:`_WAITING`)."""
    _WAITING.add(function.__code__)
    return function


def between_steps(frame: FrameType | None) -> bool:
    """Whether a thread stopped at ``frame`` (where a signal handler found the main thread) is between two of the
    hooks' steps: no frame of nxl_hooks' recording code on its stack but a wrapper waiting for the host's code. There,
    what each call holds is whole, and its waiting steps can be scored (:meth:`Generations.score_waiting`)."""
    if frame is None:
        return False
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(_RECORDING) and frame.f_code not in _WAITING:
            return False
        frame = frame.f_back
    return True


class _Emitted(NamedTuple):
    """A step emitted and not scored yet: its token, active rows, log-probabilities and context length."""
    token: torch.Tensor | int  #: (batch,), or a request's one token as the host gave it (made a tensor when scored)
    active: torch.Tensor
    log_prob: torch.Tensor | None  #: (batch, k) given by the caller (a replayed compiled step), else None
    log_probs: torch.Tensor | None  #: (batch, vocabulary): the model's own, from the forward that predicted it
    logits: torch.Tensor | None  #: or its raw logits (batch, vocabulary), log-softmaxed when scored
    n: int
    time: float  #: when it was emitted (``time.time()``): its record's ``time``
    #: ``logits`` are the model's readout on a slice of its forward's positions (the prefill's last, logits_to_keep):
    #: LogAt at l = L and the step's position is set to them (:func:`~.forward.pin_last_layer`)
    sliced: bool = False


def _stacked_tokens(emitted: list[_Emitted]) -> torch.Tensor:
    """The tokens of ``emitted`` steps (steps, batch): host ints become one tensor for all of them."""
    device = emitted[0].active.device  # where the run's tokens are
    if all(isinstance(item.token, int) for item in emitted):
        return torch.tensor([[item.token] for item in emitted], device=device)
    return torch.stack([torch.tensor([item.token], device=device) if isinstance(item.token, int) else item.token
                        for item in emitted])


def _beams_going(generated: torch.Tensor, eos: list[int], pad: int | None) -> list[torch.Tensor]:
    """Per generated token but the last, the rows a beam search had not finished after it, read off the ``generated``
    (rows, tokens) part of the sequences it returned (where :meth:`Run.stopped` follows a greedy call's criteria, a
    beam search runs them on candidate beams): a row ends at its first EOS id (also where the pad id is one), or
    where only filler follows, which generate fills a finished beam with: its pad id, an EOS id, or -1 where it has
    neither (transformers 5.x). The output alone cannot tell filler from the same ids generated: a beam ended by a
    stop string or the user's criterion and filled with an EOS id is read as going one token more, and pad ids a
    beam generated up to its last token as filler."""
    is_eos = torch.isin(generated, torch.tensor(eos, dtype=generated.dtype, device=generated.device))
    seen = is_eos.cumsum(1)
    filler = (generated < 0) | (generated == pad) if pad is not None else generated < 0
    filler &= ~(is_eos & (seen == 1))  # a row's first EOS is its last real token, whatever fills it after
    ended = seen > 0
    real = (~filler).flip(1).cumsum(1).flip(1) > 0  # a token other than filler at or after each
    return list((real[:, 1:] & ~ended[:, :-1]).unbind(1))


def _joined_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(rows)`` of (batch, V) tensors, as a view where they are consecutive entries of one contiguous
    (steps, batch, V) tensor, as :meth:`Run._probabilities` makes the log-probabilities of steps scored together
    (no second copy of every step's vocabulary row)."""
    first, base = rows[0], rows[0]._base
    if base is not None and base.dim() == 3 and base.is_contiguous() and first.shape == base.shape[1:]:
        size, offset = first.numel(), first.storage_offset() - base.storage_offset()
        if offset % size == 0 and all(row._base is base and row.shape == first.shape and row.is_contiguous()
                                      and row.storage_offset() == first.storage_offset() + index * size
                                      for index, row in enumerate(rows)):
            return base.narrow(0, offset // size, len(rows)).view(-1, base.shape[-1])
    return torch.cat(rows)


class _Context(NamedTuple):
    """What a batch of waiting steps reads of its call's feature cache (its first ``n`` positions, ``n`` the last
    step's), as the cache held it when the batch was handed on (:meth:`_Growing.snapshot`)."""
    features: torch.Tensor  #: (batch, n, layers, d') head features
    embed: torch.Tensor  #: (batch, n) embedding norms
    mask: torch.Tensor  #: (batch, n)
    dtype: torch.dtype  #: what the features are scored in


class _Batch:
    """Emitted steps of one :class:`Run` scored together and the context they read: a :class:`~.publish.Batch`,
    which the hub makes into records (:meth:`Run._record`) in its publisher thread where ``elsewhere``
    (:meth:`Run._elsewhere`), else at once; ``nbytes``: what it keeps until then."""

    def __init__(self, run: "Run", emitted: list[_Emitted], context: _Context, *, elsewhere: bool) -> None:
        self._run, self._emitted, self._context = run, emitted, context
        self.count, self.elsewhere = len(emitted), elsewhere
        self.failure: Exception | None = None  # what making its records raised (Run.flush: scoring, not a callback)

    @functools.cached_property
    def devices(self) -> tuple[torch.device, ...]:
        """Every CUDA device what it reads was computed on (a device_map's embedding norms sit on the first block's);
        none to look for before CUDA is initialized."""
        if not torch.cuda.is_initialized():
            return ()
        context = self._context
        read = {context.features.device, context.embed.device, context.mask.device,
                *(tensor.device for item in self._emitted for tensor in (item.active, item.log_prob, item.log_probs,
                                                                          item.logits) if tensor is not None)}
        return tuple(device for device in read if device.type == "cuda")

    @functools.cached_property
    def nbytes(self) -> int:  # read only for a batch that may wait in the publisher
        return sum(self._run._step_bytes(item) for item in self._emitted)

    def records(self) -> list[Step]:
        try:
            return self._run._record(self._emitted, self._context)
        except Exception as error:
            self.failure = error
            raise

    @property
    def dropped(self) -> bool:
        return self._run._unscored

    def handed(self, count: int) -> None:
        self._run._handed = self._emitted[count - 1].n + 1 - (self._run._prompt_len or 0)

    def lost(self, error: BaseException, step: int | None = None) -> None:
        self._run._lost(self._emitted[0].n - (self._run._prompt_len or 0) if step is None else step, error)


class _Growing:
    """A (batch, n, ...) tensor growing along dim 1; capacity doubles so appends cost amortized O(new). What a kept
    :meth:`snapshot` reads is never written again: positions rewritten below it go to a new buffer of the same
    capacity (the batch that holds the snapshot is scored on the publisher thread, later)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self.n = 0
        self._read = 0  # the buffer's first positions a snapshot holds

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    # narrow + copy_, not slice indexing: the same two ops without the indexing machinery, once per step
    def append(self, values: torch.Tensor) -> None:
        new = values.shape[1]
        need = self.n + new
        buffer = self._buffer
        grow = buffer is None or need > buffer.shape[1]
        if grow or self.n < self._read:
            # grown: capacity doubles; rewritten below a snapshot: a buffer of the same capacity
            capacity = max(need, 2 * buffer.shape[1] if buffer is not None else 0, 16) if grow else buffer.shape[1]
            grown = values.new_empty((values.shape[0], capacity, *values.shape[2:]))
            if buffer is not None:
                grown.narrow(1, 0, self.n).copy_(buffer.narrow(1, 0, self.n))
            self._buffer = buffer = grown
            self._read = 0
        buffer.narrow(1, self.n, new).copy_(values)
        self.n = need

    def view(self) -> torch.Tensor:
        return self._buffer.narrow(1, 0, self.n)

    def snapshot(self, n: int, *, kept: bool) -> torch.Tensor:
        """The first ``n`` positions; ``kept``: as they stay, read later (on the publisher thread): appends never
        write them again (a rewrite goes to a new buffer)."""
        if kept:
            self._read = max(self._read, n)
        return self.view().narrow(1, 0, n)


def _setting(model: nn.Module, kwargs: dict, name: str) -> Any:
    """A generate setting as generate reads it: the call's argument (None too: ``eos_token_id=None`` turns EOS off),
    else the call's ``generation_config``, else (a field it leaves unset) the model's own."""
    if name in kwargs:
        return kwargs[name]
    value = None
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        if value is None:
            value = getattr(config, name, None)
    return value


def _named(generate: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A ``generate`` call's arguments by name, as generate reads them: positional ones bound to its signature (a
    GenerationConfig passed second is its ``generation_config``, which :func:`_setting` and :func:`unsupported`
    read), its ``**kwargs`` as given; where it names none (a ``*args`` wrapper), the first positional one is its
    ``inputs``."""
    named = dict(kwargs)
    try:
        bound = inspect.signature(generate).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):  # arguments generate refuses itself (it says why), or no signature to read
        bound = None
    if bound is None:
        if args:
            named.setdefault("inputs", args[0])
        return named
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                named.setdefault("inputs", value[0])
        elif kind is not inspect.Parameter.VAR_KEYWORD:
            named[name] = value
    return named


def _changes_itself(module: nn.Module) -> bool:
    """A rotary embedding transformers rescales to each forward's positions (``dynamic``, ``longrope``): its forward
    writes its own frequencies."""
    kinds = getattr(module, "rope_type", None)
    return any(isinstance(kind, str) and ("dynamic" in kind or kind == "longrope")
               for kind in (kinds.values() if isinstance(kinds, dict) else [kinds]))


def eager() -> bool:
    """Whether this recording session asked for eager calls (:data:`EAGER`)."""
    return os.environ.get(EAGER) == "1"


def embedded(prompt_len: int, ids_beside: bool) -> str:
    """The note of a call whose prompt ran as embeddings (``inputs_embeds``): the record holds no ids or texts of it,
    and generate's output begins with the new tokens (:attr:`GenerationCall.prompt_embedded`)."""
    return (f"the prompt came as embeddings (inputs_embeds), not token ids: its {prompt_len} position(s) have no ids "
            f"or texts in the record (they read @0..@{prompt_len - 1}), only its generated tokens do"
            + ("" if ids_beside else "; call.sequences is generate's output, the new tokens only"))


#: Why a ``generate`` call that drafts candidate tokens for another model's assisted decoding is not recorded.
_DRAFTS = ("this model drafts candidate tokens for another model's assisted decoding (it is that model's "
           "assistant_model), which that model accepts or drops: a draft is not a generation of its own; attach to "
           "the model that generates (its call with assistant_model is recorded)")
#: The settings that make generate verify drafted candidate tokens, several per forward (recorded whole: Whole).
_ASSISTED = "assistant_model / prompt_lookup_num_tokens"


def unsupported(model: nn.Module, kwargs: dict) -> str | None:
    """Why a ``generate`` call cannot be recorded step by step, or None when it can."""
    # (use_mtp: multi-token-prediction drafts, transformers' own; an older GenerationConfig without it reads None)
    if _setting(model, kwargs, "use_mtp"):
        return ("multi-token prediction (use_mtp) drafts candidate tokens with the model's own prediction layers, "
                "which no record follows; generate without use_mtp")
    cache = find_cache(kwargs)
    # (a static cache's length is a device tensor: read once per call, as the prompt's forward reads it anyway)
    # (UnfollowedForward: recurrent states that took in tokens without counting them)
    held = int(cache_length(cache)) if cache is not None else 0
    if held:
        return (f"generate was given a KV cache already holding positions 0..{held - 1}, filled by forwards that are "
                "not this call's, so the context of its steps was never recorded; generate from the full prompt "
                "without that cache (leave out cache / past_key_values)")
    return None


class Whole(NamedTuple):
    """A ``generate`` call whose forwards the hooks follow none of: the sequences it returns are recorded when it
    returns, from the model run again over them (:meth:`Run.replay_whole`)."""

    what: str  #: what its forwards run, as a record's reason says it
    instead: str  #: what else records it (as any greedy or sampled call)
    beams: bool  #: its stopping criteria run on candidate beams, not its rows: which rows ended is read off its output


def replayed(model: nn.Module, kwargs: dict) -> Whole | None:
    """Whether a ``generate`` call is recorded whole when it returns (:class:`Whole`), else None: a beam search
    (``num_beams`` > 1: its forwards run candidate beams, reordered and pruned between steps, so a row of theirs is
    not one sequence), assisted decoding with a second model or prompt lookup (each forward verifies several
    candidate tokens and generate drops some of them, cropping its cache)."""
    if (_setting(model, kwargs, "num_beams") or 1) > 1:
        return Whole("beam search", "use num_beams=1", beams=True)
    if kwargs.get("assistant_model") is not None or _setting(model, kwargs, "prompt_lookup_num_tokens"):
        return Whole("assisted decoding", f"generate without {_ASSISTED}", beams=False)
    return None


def stacked_features(plan: Plan, capture: Capture, first: int = 0, end: int | None = None) -> torch.Tensor:
    """Every selected layer of a forward as head features, (batch, seq, len(layers), d') of its positions
    first..end-1 (default: all), all layers in one head call (:func:`~.forward.head_features`; one-token decoding
    steps would pay the head's overhead per layer). Under a device_map the layers meet on the last selected block's
    device (one position per step moves)."""
    hidden = layer_states(plan, capture)
    device, end = hidden[-1].device, hidden[-1].shape[1] if end is None else end
    return head_features(plan, [h[:, first:end] if h.device == device else h[:, first:end].to(device) for h in hidden],
                         0, end - first)


#: The forward inputs :meth:`Generations.refill` makes itself (or, for the prompt, that cannot be run again).
_REFILLED = frozenset({"input_ids", "attention_mask", "position_ids", "inputs_embeds", "past_key_values",
                       "cache_position", "logits_to_keep", "use_cache"})


class _Refilled:
    """The :class:`~.recording.Recording` of :meth:`Generations.refill`'s forward: keeps its capture and logits."""

    failed = False

    def __init__(self) -> None:
        self.capture: Capture | None = None
        self.logits: torch.Tensor | None = None

    def before_forward(self, arguments: dict) -> None:
        pass

    def after_forward(self, capture: Capture) -> None:
        self.capture = capture

    def after_task(self, output: Any) -> None:
        logits = getattr(output, "logits", None)
        self.logits = logits if isinstance(logits, torch.Tensor) and logits.dim() == 3 else None

    def fail(self, what: str, error: BaseException) -> None:
        raise RuntimeError(f"running the model again over the call's tokens failed in {what}") from error


#: :meth:`Generations.refill`: (ids, mask, position ids, keep, cache, start, other inputs) -> (capture of the
#: positions from ``start`` on, logits at the last ``keep`` positions), or None.
Refill = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, Any, int, dict],
                  "tuple[Capture, torch.Tensor] | None"]


class Run:
    """One recorded sequence batch: its feature cache and its pending step.

    ``generate`` makes one per call, fed by the probe's hooks (:meth:`before_forward`, :meth:`after_forward`); under
    continuous batching (:mod:`.batching`) each request has one, fed its slice of every packed forward
    (:meth:`feed`) and given each token the manager samples for it (:meth:`emit`).
    """

    def __init__(self, plan: Plan, hub: Hub, call: GenerationCall, *, prompt_len: int | None, eos: Any,
                 cache_dtype: torch.dtype | None, cache_device: torch.device | None,
                 notice: Notice | None = None, refill: Refill | None = None, refill_apart: bool = False,
                 wait: float | None = BATCH_SECONDS, engine: bool = False) -> None:
        self._plan, self._hub, self.call, self._notice = plan, hub, call, notice
        self._scoring = plan.scoring  # what the pipeline's batches read (_record), which outlives the call's plan
        # Runs the model eagerly over positions whose forwards ran compiled (the hooks saw none of them), when the
        # call ends (:meth:`_replay`)
        self._refill = refill
        # ... and may do so in a thread of its own, while the host's next call runs the model (finish)
        self._refill_apart = refill is not None and refill_apart
        self.attention_mask: torch.Tensor | None = None  # the one the call was given (a prompt that ran compiled)
        self.pad_id: int | None = None  # generate's pad token id (a prompt that ran compiled without a mask)
        # the call's other tensor inputs of the model's forward (token_type_ids): what its refill must pass too
        self.forward_inputs: dict[str, torch.Tensor] = {}
        self.position_ids: torch.Tensor | None = None  # the prompt's, where the call was given them (_positions)
        # generate processes its forwards' logits in place (assisted decoding, assistant_early_exit: a float32
        # model's are not copied first), so the row kept of them is a copy (after_task)
        self.copy_logits = False
        self._cache: Any = None  # the KV cache the prompt's forward was given (its eager positions are reused)
        self._prefix: tuple[int, Any] | None = None  # (start, a copy of what that cache holds before it): _later
        # the model's weights as the call returned, where its compiled steps are run again beside the host (_later)
        self._weights: tuple | None = None
        self.ids_given = True  # the prompt came as input_ids: generate's sequences begin with it
        # input_ids given with inputs_embeds: the prompt ran as the embeddings, generate's sequences begin with the ids
        self.ids_beside_embeds = False
        self._ids_fed = False  # the prompt came as token ids (generate's sequences then hold it)
        self._prompt_len = prompt_len
        self._eos = torch.as_tensor(eos).reshape(-1).tolist() if eos is not None else []
        self._eos_ids: torch.Tensor | None = None  # the EOS ids on the tokens' device, made at the first step
        self._cache_dtype, self._cache_device = cache_dtype, cache_device
        self._features = _Growing()  # (batch, n, len(layers), d): all layers in one tensor, one head call per step
        self._embed, self._mask = _Growing(), _Growing()
        self._real: list[torch.Tensor] = []  # per generated position: is its token real (row not finished)?
        # The tokens the call's forwards fed back (batch, steps), each of which completed a step, from position
        # _fed_from on: checked once against generate's output when it returns (_undid), as a loop may run a forward
        # on a token it then does not return (a lookahead on a copy of its cache) with nothing after it to tell.
        self._fed, self._fed_from = _Growing(), 0
        self._prompt_ids: list[torch.Tensor] = []
        # the token ids of the last forward from position 0 (the prompt's, a use_cache=False step's): a forward that
        # recomputes the record from position 0 begins with them (_recomputes)
        self._from_start: torch.Tensor | None = None
        self._active: torch.Tensor | None = None  # rows that have not emitted an EOS token (a new tensor per step)
        self._going: list[torch.Tensor] = []  # per generated token: the rows generate had not finished after it
        # Decoding steps after the first are checked on the device (their positions are device tensors, e.g. a
        # static cache's length): whether any ran elsewhere than where the record continues, read at the end.
        self._checked = False
        self._drift: torch.Tensor | None = None
        self._compute_dtype: torch.dtype | None = None
        self._n = self._past = 0
        self._pending = False
        # the last forward the hooks followed gave its logits (after_task): else its task model ran compiled code
        self._predicted = True
        # False once a forward ran partly compiled: the hooks follow the call no more, _replay records the rest
        self._following = True
        # why the hooks follow none of the call's forwards, all of it recorded by _replay (replay_whole), else None
        self._whole: Whole | None = None
        self._log_probs: torch.Tensor | None = None  # the model's own log-softmax at the last position of the last forward
        self._logits: torch.Tensor | None = None  # or its raw logits there, the log-softmax taken when scored
        self._sliced = False  # those logits are of a slice of the forward's positions (_Emitted.sliced)
        self._deferred: list[_Emitted] = []  # emitted, not scored yet (see BATCH_STEPS)
        self._limit = BATCH_STEPS  # how many of them may wait (:meth:`_batch_limit`, worked out at the first of them)
        self._sizes: tuple[int, int] | None = None  # (bytes of a step's kept rows, rows): :meth:`_step_bytes`
        self._wait = wait  # how long emitted steps may wait to be scored together (0: none; None: up to BATCH_STEPS)
        # an engine's request: its end, in the loop that runs every request's steps, does not wait for the publisher
        # (unless ENGINE_ENDS_WAIT)
        self._engine = engine
        # decoding positions whose hidden states are not in the feature cache yet: (layers' hidden states, embedding
        # norms, mask) each, stacked and normed together when the waiting steps are scored (:meth:`_fill`)
        # (an engine's step: its head features already, (batch, 1, layers, d'), instead of the layers' hidden states)
        self._unfed: list[tuple[list[torch.Tensor] | torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._ones: torch.Tensor | None = None  # the all-ones mask of a one-token step (generate drops it)
        self._one_device: bool | None = None  # whether a decoding step's layers are all on one device (_fills_later)
        self.failed = False
        self._unscored = False  # scoring a batch failed in the publisher thread: the later ones are dropped
        self._said = threading.Lock()  # a failure is said once, by the generating thread or the publisher
        # the step after the last one handed to the hub (a failure says the records stop there; a rewrite can take
        # it back down)
        self._handed = 0

    @property
    def length(self) -> int:
        """How many positions of the sequence the run holds (the next token's position)."""
        return self._n

    def wants_ids(self, past: int) -> bool:
        """Whether :meth:`feed` at position ``past`` reads the token ids it is given: while the prompt is still coming
        in, or from position 0 (a request its engine runs again from the start)."""
        return past == 0 or self.call.prompt_mask is None

    def held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of what the run holds of its positions: head features (batch, n, layers, d'), embedding norms and
        mask (batch, n); what a request that reuses this one's cached prefix is fed (:mod:`.engines.prefixes`)."""
        self._fill()
        return self._features.view(), self._embed.view(), self._mask.view()

    def fail(self, what: str, error: BaseException) -> None:
        """Stop recording this call (the generation itself goes on); the first failure is counted and said once,
        with the step its records stop at. The steps emitted before it are whole: their records are made here first
        (made in the publisher, one that failed there could be said in its place)."""
        first = not self.failed and self.call.error is None
        self.failed = True
        if not first or not self._said.acquire(blocking=False):
            return  # said already: a batch lost in the publisher
        try:
            self.flush(here=True)
        except Exception:  # noqa: BLE001 - the first failure is the one said
            self._deferred = []
        finally:  # an interrupt meanwhile is the caller's, and the call still says why it stops being recorded
            self._tell(what, error, self._handed)

    def _lost(self, step: int, error: BaseException) -> None:
        """Scoring the steps from ``step`` on failed in the publisher thread (their records are lost): the call stops
        being recorded there, said once as :meth:`fail` says it; the steps handed on after them are dropped too.
        Where the call's records were said to stop already, its notes and the log say which more were lost."""
        self.failed = self._unscored = True
        if self.call.error is None and self._said.acquire(blocking=False):
            self._tell("scoring its steps", error, step)
        else:
            self._hub.note(self.call, f"the records of its steps from step {step} on were lost (scoring them raised "
                                      f"{typed(error)})")

    def _tell(self, what: str, error: BaseException, done: int) -> None:
        """The call is not recorded from its step ``done`` on: its error, and the notice's one line (said by whoever
        took :attr:`_said`)."""
        self.call.error = described(error)
        if self._notice is None:
            reason(what, error)
            return
        self._notice.unrecorded(f"not recorded{f' after step {done - 1}' if done else ''} ({what}): "
                                f"{self.call.error}")

    # -- fed by the probe's hooks under generate ---------------------------------------------------------

    def before_forward(self, bound: dict) -> None:
        """Check the forward continues what the run holds; complete the pending step with its first token."""
        if not self._following:
            return
        if self._hub.calling_back(self.call):  # (its positions said "several candidate tokens, or a cropped cache")
            raise UnfollowedForward(
                "the on_step callback ran the model inside this call: the call's records follow its own forwards "
                "only, and one of the callback's came between two of them, so they stop here; run the model after "
                "generate returns (keep what the callback needs until then)")
        if self._logits_missed():
            self._unfollow()
            return
        n = self._n
        if n == 0 and self._refill is not None:
            self._cache = find_cache(bound)
        decoding = self._prompt_len is not None and n >= self._prompt_len
        if decoding and self._checked and self._continues_on_device(bound, n):
            past = n
        else:
            past = self._check(bound, n, decoding)
        if self._pending:
            ids = bound.get("input_ids")
            if ids is None:
                raise RuntimeError("generate fed embeddings instead of token ids while decoding: cannot tell the "
                                   "emitted token; pass input_ids to generate")
            rows = self._mask.view().shape[0]
            if ids.shape[0] != rows:
                raise UnfollowedForward(
                    f"a forward of this call ran {ids.shape[0]} rows while its record holds {rows}: candidate tokens "
                    "run as rows of their own (a lookahead, as contrastive search makes) cannot be followed")
            if not self._fed.n:
                self._fed_from = n
            self._fed.truncate(n - self._fed_from)
            self._fed.append(ids.narrow(1, n - past, 1))  # (narrow and select: no index parsing, every token)
            self.emit(ids.select(1, n - past))
        self._past, self._predicted = past, False

    def _continues_on_device(self, bound: dict, n: int) -> bool:
        """A one-token decoding step whose position is checked without reading the device (the check is read once,
        when the call ends); False when it is another kind of forward, checked on the host."""
        past, new = start(bound, n)
        if new != 1 or past is None:
            return False
        if not isinstance(past, torch.Tensor):
            return past == n
        drift = past.reshape(-1)[:1] != n
        self._drift = drift if self._drift is None else self._drift | drift
        return True

    def _check(self, bound: dict, n: int, decoding: bool) -> int:
        """Where this forward starts, read on the host (the prefill and the first decoding step: a constant per
        call); UnfollowedForward unless it continues the record or recomputes it from position 0."""
        where = positions(bound, n)
        past, new = where.past, where.new
        continues = past == n and (new == 1 or not decoding)
        recomputes = past == 0 and (n == 0 or (decoding and new == n + 1))  # first forward, or use_cache=False
        if n == 0 and self._prompt_len is not None and new > self._prompt_len:
            virtual = self._plan.subject.prompt_tokens
            if virtual and new == self._prompt_len + virtual:  # (PEFT puts them before the prompt's embeddings)
                raise UnfollowedForward(
                    f"PEFT prompt tuning ran {virtual} virtual tokens before this call's {self._prompt_len}-token "
                    "prompt, whose positions a generate call's records cannot follow; explain the prompt with a "
                    "plain forward of the PeftModel (model(**inputs), or nxl.explain), which records them")
            if bound.get("input_ids") is None:  # (assisted decoding feeds its candidates as token ids)
                raise UnfollowedForward(
                    f"the first forward of this call ran {new} positions of embeddings for its "
                    f"{self._prompt_len}-token prompt: a wrapper put on the model after the probe attached (PEFT "
                    "prompt tuning) prepends embeddings of its own, whose positions a generate call's records cannot "
                    "follow; attach to the wrapper itself, and explain the prompt with a plain forward of it "
                    "(model(**inputs), or nxl.explain)")
            # (not a prompt: candidate tokens after it, which assisted decoding feeds and may drop)
            raise UnfollowedForward(
                f"the first forward of this call ran positions 0..{new - 1}, past its {self._prompt_len}-token "
                "prompt: several candidate tokens per forward (assisted decoding the call's settings do not name) "
                f"cannot be followed; name it with {_ASSISTED}, which records the call when it returns")
        if not (continues or recomputes):
            if self._foreign(bound.get("input_ids"), past, new):
                raise UnfollowedForward(
                    f"a forward of this call ran positions {past}..{past + new - 1} on other token ids than the "
                    "call's prompt holds there: the model run on ids of its own inside the call (by a stopping "
                    "criterion or a streamer) cannot be told from the call's own forward; run it outside generate")
            said = "it had no cache" if where.source == "no cache" else f"from its {where.source}"
            raise UnfollowedForward(
                f"a forward of this call ran positions {past}..{past + new - 1} ({said}) while the "
                f"call's record holds positions 0..{n - 1}: a forward that neither continues the record by one token "
                "nor recomputes it from position 0 cannot be followed (several candidate tokens per forward, a "
                "cropped cache, or the model run inside the call on the call's own tokens, by a stopping criterion "
                f"or a streamer: run it outside generate){self._undone(past)}"
            )
        if recomputes:
            self._recomputes(bound.get("input_ids"), n)
        self._checked = decoding and continues
        return past

    def _foreign(self, ids: torch.Tensor | None, past: int, new: int) -> bool:
        """Whether a forward at positions ``past`` .. ``past + new - 1`` that starts in the prompt runs other ids
        than the prompt there: not the call's own (it never changes its prompt), so it undoes none of the tokens the
        call emitted, and the steps before it are kept (:meth:`_undone` drops them for a forward that may be the
        call's own). One device read, as the record stops."""
        prompt = self.call.prompt_ids
        if ids is None or prompt is None or past >= prompt.shape[1]:
            return False
        if ids.shape != (prompt.shape[0], new):  # other rows than the call's
            return True
        end = min(past + new, prompt.shape[1])
        return not torch.equal(ids[:, :end - past].to("cpu", prompt.dtype), prompt[:, past:end])

    def _undone(self, past: int) -> str:
        """A forward the record cannot follow runs from position ``past`` again: the tokens at ``past`` and after,
        which completed steps when the forwards that ran them started, may be ones the call undid (it looked ahead
        with a candidate on a copy of its cache, then emitted another). Those steps not handed on yet are dropped
        (the records stop before them, never holding a token the call may not have returned); what to add to the
        call's error for those already handed on (a live reader got each as it came)."""
        # the first step whose token sits at ``past`` or after (0 for a forward back inside the prompt)
        first = max(past - (self._prompt_len or 0), 0)
        self._deferred = [item for item in self._deferred if item.n < past]
        if self._handed <= first:
            return ""
        return (f"; the records of steps {first}..{self._handed - 1}, handed on already, explain tokens at "
                "positions it ran again, which it may have replaced")

    def _recomputes(self, ids: torch.Tensor | None, n: int) -> None:
        """A forward of ``ids`` from position 0 while the record holds ``n`` positions: past the prompt, it runs the
        tokens the last such forward ran (the prompt, the tokens emitted so far), else UnfollowedForward (the model
        run inside the call on ids of its own: by a stopping criterion or a streamer, say, which the record cannot
        tell from the call's own forward; its logits processors run apart, :meth:`Generations._apart`). Reads the
        device once per such forward (a call without a KV cache)."""
        held, self._from_start = self._from_start, ids
        if n and held is not None and ids is not None and not (
                ids.shape[0] == held.shape[0] and torch.equal(ids[:, :held.shape[1]], held)):
            raise UnfollowedForward(
                f"a forward of this call ran positions 0..{n} with other token ids than the call's prompt and the "
                "tokens it emitted: the model run on other ids inside the call (by a stopping criterion or a "
                "streamer) cannot be told from the call's own forward; run it outside generate")

    def after_forward(self, capture: Capture) -> None:
        """Append this forward's features; its last position's prediction is the next pending step."""
        if not self._following:
            return
        if capture.last_hidden is None:  # its blocks ran compiled (regional compilation), its backbone's hooks not
            self._unfollow()
            return
        new, embed = capture.shape[1], embed_norms(capture)
        if self._prompt_len is None:  # generate started from its bos token, not a prompt we were shown
            self._prompt_len = new
        mask = token_mask(capture.attention_mask, self._past, new)
        if mask is None:  # generate drops an all-ones mask
            mask = self._all_ones(capture.shape[0], new, embed.device)
        hidden = layer_states(self._plan, capture)
        if new == 1 and self._past == self._n and self._fills_later(*hidden):
            self._unfed.append((hidden, embed, mask))  # a decoding step: no work until it is scored
            self._n += 1
        else:
            self.feed(self._past, stacked_features(self._plan, capture), embed, mask, capture.input_ids)
        self._pending = self._n >= self._prompt_len

    def _all_ones(self, rows: int, new: int, device: torch.device) -> torch.Tensor:
        """A (rows, new) all-True mask; a decoding step's is made once per call (it is only read)."""
        if new != 1:
            return torch.ones(rows, new, dtype=torch.bool, device=device)
        if self._ones is None or self._ones.shape[0] != rows or self._ones.device != device:
            self._ones = torch.ones(rows, 1, dtype=torch.bool, device=device)
        return self._ones

    def _fills_later(self, *tensors: torch.Tensor) -> bool:
        """Whether a decoding position's ``tensors`` (its layers' hidden states, or its head features) may wait for
        :meth:`_fill`: the prompt is in, and they are where and as the feature cache keeps them (else they are
        normed and moved now, block by block's device)."""
        if self.call.prompt_mask is None:
            return False
        if len(tensors) == 1 and self._cache_device is None and self._cache_dtype is None:
            return True  # kept where and as it is: nothing to read off it (an engine's step, in its loop)
        device, dtype = tensors[-1].device, tensors[-1].dtype
        if self._cache_device not in (None, device) or self._cache_dtype not in (None, dtype):
            return False
        if self._one_device is None:  # the layers' devices are the blocks': looked at once per call
            self._one_device = all(t.device == device for t in tensors)
        return self._one_device

    def _fill(self) -> None:
        """The decoding positions still waiting go into the feature cache: every layer of all of them stacked and
        normed in one head call (not one per token), or their features joined in one copy, with their embedding
        norms and masks."""
        if not self._unfed:
            return
        unfed, count = self._unfed, len(self._unfed)
        with torch.no_grad():  # (finish runs outside generate's no_grad)
            if isinstance(unfed[0][0], torch.Tensor):  # features already (an engine's steps)
                features = torch.cat([f for f, _, _ in unfed], dim=1)
            else:
                layers = len(unfed[0][0])
                stacked = torch.stack([h for hidden, _, _ in unfed for h in hidden])  # (count * layers, batch, 1, d)
                stacked = stacked.view(count, layers, *stacked.shape[1:]).squeeze(3).permute(2, 0, 1, 3).contiguous()
                features = self._plan.head.features(stacked)  # (batch, count, layers, d')
            self._unfed = []
            self._n -= count
            self.feed(self._n, features, torch.cat([e for _, e, _ in unfed], dim=1),
                      torch.cat([m for _, _, m in unfed], dim=1), None)

    def _logits_missed(self) -> bool:
        """Whether the last forward's logits never came though its step is pending: its task model ran compiled code
        (:meth:`_unfollow`)."""
        return self._pending and not self._predicted

    def _unfollow(self) -> None:
        """The last forward's backbone ran eagerly and its task model compiled code, so its logits never reached the
        hooks: dynamo ran part of a compiled decoding step eagerly, a recompile it may not make
        (``torch.compiler.set_stance("eager_on_recompile")``, its ``recompile_limit``); or its blocks ran compiled
        code while its backbone's hooks ran eagerly (a backbone's forward or its blocks compiled in place). That
        forward and every later one of the call are recorded as compiled ones, by :meth:`_replay` when the call ends;
        never scored with another forward's logits."""
        self._fill()
        for cache in (self._features, self._embed, self._mask):
            cache.truncate(self._past)
        # (the step at its first position was emitted before it ran, with the forward before's logits)
        self._n, self._pending, self._following = self._past, False, False

    def replay_whole(self, whole: Whole) -> None:
        """The hooks follow none of the call's forwards (a beam search's rows are candidate beams, reordered and
        pruned between steps; assisted decoding verifies candidate tokens and drops some), and :meth:`_replay`
        records every position of the sequences it returns, from the prompt on, when it returns: each step is the
        model's own at that returned sequence's position, as a greedy or sampled call's (its probability the
        model's, not a beam's score)."""
        self._following, self._whole = False, whole

    def ran_compiled(self) -> None:
        """A forward of the call ran wholly compiled: neither its backbone's hooks nor its blocks' ran, so the positions
        it added are not in the record. The hooks follow the call no more: a later forward that runs eagerly (dynamo
        ran a step eagerly past its ``recompile_limit``, as when a guard on a ``TorchFunctionMode`` of the user's
        fails at every step) would start past the record's last position and stop the call's records; every position
        from the record's last on is recorded by :meth:`_replay` when the call ends."""
        if not self._following:
            return
        if self._logits_missed():  # (it ran partly compiled)
            self._unfollow()
        else:
            self._following = False

    def after_task(self, output: Any) -> None:
        """The task model returned: keep its own logits at the last position, for the pending step's probability."""
        if not self._following:
            return
        self._predicted = True
        logits = getattr(output, "logits", None)
        usable = (isinstance(logits, torch.Tensor) and logits.dim() == 3
                  and logits.shape[-1] == self._plan.head.n_outputs)
        # generate reads its own copy of them: this row stays as the model made it (a copy of it when the forward
        # gave every position's, which are not kept alive for it, or when generate writes into them: copy_logits)
        # (select, not logits[:, -1]: indexing parses its tuple per token)
        row = ((logits.select(1, -1) if logits.shape[1] == 1 and not self.copy_logits else logits.select(1, -1).clone())
               if usable else None)
        self._log_probs, self._logits = None, row
        # fewer rows than the positions after_forward just fed (_n - _past): the prefill with logits_to_keep
        self._sliced = usable and logits.shape[1] < self._n - self._past

    def predicted(self, log_probs: torch.Tensor | None) -> None:
        """The model's own log-probabilities (batch, vocabulary) for the next token: its step's ``probability``."""
        usable = log_probs is not None and log_probs.shape[-1] == self._plan.head.n_outputs
        self._log_probs, self._logits, self._sliced = log_probs if usable else None, None, False

    # -- shared by generate and continuous batching ------------------------------------------------------

    def feed(self, past: int, features: torch.Tensor, embed_norm: torch.Tensor, mask: torch.Tensor,
             input_ids: torch.Tensor | None, *, later: bool = False) -> None:
        """Positions ``past`` .. ``past + new - 1`` of the sequence: their head features (batch, new, layers, d'),
        embedding norms and attention mask (batch, new), and token ids (for the prompt; None for embeddings).
        Positions from ``past`` on are replaced (a forward that recomputes them); none may be skipped.
        ``later``: a one-token decoding position that continues the run may wait, as the tensors given (which must
        stay as they are), to go into the feature cache with the others when the waiting steps are scored (an
        engine's step: a copy per request and step costs a few device operations each)."""
        if later and past == self._n and features.shape[1] == 1 and self._wait != 0 and self._fills_later(features):
            if len(self._unfed) >= BATCH_STEPS:  # nothing scores them (nobody listens): they wait no longer
                self._fill()
            self._unfed.append((features, embed_norm, mask))
            self._n += 1
            return
        self._fill()
        if past > self._n:
            raise RuntimeError(f"positions {self._n}..{past - 1} of this sequence never ran through the model "
                               "while the probe watched it, so the context of its tokens is unknown")
        new = features.shape[1]
        if past < self._n:  # positions the waiting steps read are rewritten: score them first, here (not later,
            self.flush(here=True)  # in the publisher: that would keep the buffer these go over alive till then)
            if self._prompt_ids:  # a prefill recomputed before it finished (an engine preempted it): ids from past on
                self._prompt_ids = [torch.cat(self._prompt_ids, dim=1)[:, :past]]  # come again, as its features
        for cache in (self._features, self._embed, self._mask):
            cache.truncate(past)
        self._compute_dtype = features.dtype
        if past == 0:
            self._ids_fed = input_ids is not None
        self._features.append(features.to(device=self._cache_device or features.device,
                                          dtype=self._cache_dtype or features.dtype))
        self._embed.append(embed_norm)
        self._mask.append(self._real_mask(mask, past, new))
        self._n = past + new
        if self.call.prompt_mask is None:  # still in the prefill (which may come in chunks)
            if input_ids is not None:
                self._prompt_ids.append(input_ids[:, : self._prompt_len - past])
            if self._n >= self._prompt_len:
                ids = torch.cat(self._prompt_ids, dim=1).cpu() if self._prompt_ids else None
                self._prompt_ids = []
                mask = self._mask.view()[:, : self._prompt_len].cpu()
                self._hub.prompt(self.call, ids, mask, readable=self._plan.readable_rows(ids),
                                 template=self._plan.template(ids, mask), special_ids=self._plan.special_ids,
                                 target_texts=self._plan.target_texts, joining=self._plan.joining)
                if ids is None:  # said in its record, which else reads as if its prompt and sequences were cut
                    self._hub.note(self.call, embedded(self._prompt_len, self.ids_beside_embeds), log=False)
                empty = empty_row(mask)  # (a plain forward's result() refuses such a row by the same rule)
                if empty is not None:
                    self._hub.note(self.call, f"{empty}: generate's tokens for it follow no prompt, and its steps "
                                   "have no prompt token to explain; drop empty rows")

    def _real_mask(self, mask: torch.Tensor, past: int, new: int) -> torch.Tensor:
        """``mask`` with generated positions whose token a finished row only padded switched off (on the device:
        which rows finished is never read back)."""
        first = max(self._prompt_len, past)
        real = self._real[first - self._prompt_len: past + new - self._prompt_len]
        if not real or not (self._eos or self._going):  # else no row ever finishes
            return mask
        mask = mask.clone()
        mask[:, first - past: first - past + len(real)] &= torch.stack(real, dim=1).to(mask.device)
        return mask

    def finish(self, sequences: torch.Tensor | None, error: str | None = None, *, what: str = "this generate call"
               ) -> None:
        """generate returned ``sequences`` (None: it raised): the last token's record, then the call's end.
        ``error``: why the call's records are incomplete, when the host says so (a failed request); ``what`` names
        the call in the reason recorded when its end cannot be published. Where forwards of the call ran compiled
        and its steps are scored off the calling thread (on a GPU: :meth:`_elsewhere`), the eager forwards that
        record them (:meth:`_replay`) and the call's end are made in a thread of their own
        (:meth:`~.publish.Hub.end_later`) while the host goes on: :meth:`_later` copies what they read first.
        Never raises."""
        try:
            if self._following and self._logits_missed() and not self.failed:
                self._unfollow()
            later = self._later(sequences)
        except Exception:  # noqa: BLE001 - then made here, where a failure is said as it would have been
            self._prefix, later = None, None
        if later is None:
            self._finish(sequences, error, what)
            return
        copied, inference, stream = later

        def finish() -> None:
            # the calling thread's inference mode (what the feature cache was made in) and device stream (where
            # the copies were made); other thread-local state (autocast) keeps the call here (_later)
            begun = False
            try:
                with torch.inference_mode(inference), (torch.cuda.stream(stream) if stream is not None
                                                       else contextlib.nullcontext()):
                    begun = True
                    self._finish(copied, error, what)  # (never raises)
            except Exception:  # noqa: BLE001 - entering those failed (a device error): the end is made all the same
                if not begun:
                    self._finish(copied, error, what)

        try:
            self._hub.end_later(finish)
        except Exception:  # noqa: BLE001 - no thread to be had: made here then
            finish()

    def _later(self, sequences: torch.Tensor | None) -> tuple[torch.Tensor, bool, Any] | None:
        """What :meth:`finish` needs to be made off the calling thread: a copy of the call's tokens (the caller may
        write its output), what its cache holds of the positions that ran eagerly (a new cache: its tensors are
        copies, so the call's own is let go), the thread's inference mode and device stream; or None, made here:
        nothing ran compiled, the prompt did too (its cache is not reused then), nothing takes the records, its
        steps are scored in this thread (autocast on among the reasons: :meth:`_elsewhere`), or the model's
        forward changes its own state (``refill_apart`` False: the two threads would race on it)."""
        prompt_len, n = self._prompt_len, self._n
        if (sequences is None or self.failed or self.call.error is not None or not self._refill_apart
                or prompt_len is None or not self.ids_given or n < max(prompt_len, 1)
                or sequences.shape[1] - 1 <= n or not self._hub.listened or not self._elsewhere()):
            return None
        device = self._features.view().device
        kept = prefix_cache(self._cache, n)
        if kept is None:
            return None
        self._prefix, self._cache = (n, kept), None
        # (host integers: no device read; not where accelerate loads offloaded weights anew at each forward)
        model = self._plan.model
        self._weights = None if any(offloaded(module) for module in model.modules()) else weights_state(model)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        return sequences.clone(), torch.is_inference_mode_enabled(), stream

    def _finish(self, sequences: torch.Tensor | None, error: str | None, what: str) -> None:
        """:meth:`finish`'s work, in the calling thread or, with its copies, in one of its own."""
        try:
            ran = self._beams_ran(sequences)
            if sequences is not None and not self.failed and self.call.error is None:
                try:
                    self._replay(ran)
                except BaseException as failure:  # noqa: BLE001 - said as what it is; the steps before it go out
                    self.fail(f"recording its {'returned sequences' if self._whole is not None else 'compiled steps'}",
                              failure)
                    if not isinstance(failure, Exception):  # (Ctrl-C in its forwards: the caller's, said first)
                        raise
            # (a call the probe detached from mid-way already says so: its later forwards ran unhooked on purpose)
            missed = (self._missed(sequences) if sequences is not None and not self.failed and self.call.error is None
                      else None)
            if missed is None and self._drift is not None and not self.failed and bool(self._drift.any()):
                missed = ("not recorded: a decoding step of this call ran at another position than the one after "
                          "the record's last (a cropped or reused cache); its records from there on are not its own")
            if missed is None and sequences is not None and not self.failed and self.call.error is None:
                missed = self._undid(sequences)
            if missed is not None:
                self.failed = True
                if self._said.acquire(blocking=False):
                    self.call.error = missed
                    if self._notice is not None:
                        self._notice.unrecorded(missed)
                else:  # a batch lost in the publisher meanwhile was said
                    self._hub.note(self.call, missed)
            if sequences is not None and self._pending and not self.failed:
                emitted = self._n + 1 - self._prompt_len  # the pending token included
                # A deferred stop check (mps) may run one forward whose token generate then undoes.
                if sequences.shape[1] in (self._n + 1, emitted):
                    self.emit(ran[:, -1])
            self.flush()  # the steps emitted so far go out, whatever the checks above found
        except Exception as failure:  # noqa: BLE001 - never into the host's generate
            self.fail("the last generated token", failure)
        finally:
            self._features = self._embed = self._mask = self._logits = self._log_probs = self._cache = None
            self._prefix = self._weights = None
            self._deferred, self._unfed = [], []
            # The plan and the refill hold the model: the batches still to be made read _scoring only, so a model
            # the program drops once its call returned is freed without waiting for the record pipeline.
            self._plan = self._refill = None
            try:
                # a copy on the CPU too: the caller may write the tensor generate returned
                self._hub.end(self.call, sequences.to("cpu", copy=True) if sequences is not None else None, error,
                              wait=ENGINE_ENDS_WAIT or not self._engine)
            except Exception as failure:  # noqa: BLE001 - a failing sink or subscriber never reaches the host
                self.fail(f"the end of {what}", failure)

    def _beams_ran(self, sequences: torch.Tensor | None) -> torch.Tensor | None:
        """The tokens :meth:`_replay` runs and records: generate's own ``sequences``; a beam search's with the rows it
        had finished read off them first (:func:`_beams_going`), and the -1 it fills a finished beam with where the
        call has no pad id nor EOS id recorded as id 0 (an inactive step)."""
        if sequences is None or self._whole is None or not self._whole.beams or self._prompt_len is None:
            return sequences
        self._going = _beams_going(sequences[:, self._prompt_len:], self._eos, self.pad_id)
        return sequences.clamp(min=0)

    def _replay(self, sequences: torch.Tensor) -> None:
        """Record the positions whose forwards ran compiled (generate compiles its decoding steps with a static cache,
        or the user compiled the model's ``forward``), which the hooks never saw: eager forwards of the model over
        them (:data:`Refill`) give their hidden states, embedding rows and the model's distribution at each, and
        they are recorded as the eager hooks would have recorded them: each decoding step's token (from
        ``sequences``) completes the pending step, then its positions are fed. Nothing of the probe runs inside the
        compiled code, so the call's own output is the one it has unrecorded, to the bit. Where the prompt ran
        eagerly, the forwards run only the positions after the eager ones, against what the call's cache holds of
        those (what their eager forwards put there), else every position; in chunks of :data:`REFILL_POSITIONS`, fewer
        where their logits would pass :data:`BATCH_BYTES`, each chunk's steps handed on before the next runs."""
        cache, self._cache = self._cache, None
        prefix, self._prefix = self._prefix, None
        n, prompt_len = self._n, self._prompt_len or 0
        held = self.ids_given or self.ids_beside_embeds  # generate's sequences begin with the prompt's ids
        end = sequences.shape[1] - 1 + (0 if held else prompt_len)  # the last token never ran
        if end <= n or self._refill is None:
            return
        if not self._hub.listened:  # nobody takes records (keep_steps=False, nothing else): none are made
            self._ids_fed = self._ids_fed or (n < prompt_len and self.ids_given)  # (the prompt too: _missed)
            self._n, self._pending = end, True
            return
        if self._prompt_len is None:
            raise RuntimeError("its forwards ran compiled from the start and it was given no prompt, so what ran "
                               "cannot be told; pass input_ids")
        if not self.ids_given:
            raise RuntimeError("its forwards ran compiled and its prompt came as inputs_embeds, so they cannot be "
                               "run again to record them; pass input_ids (without inputs_embeds)")
        first = max(n, prompt_len)
        emitting = first if self._pending or n < prompt_len else first + 1  # a prompt fed below leaves a step pending
        mask = self._attention(sequences, end)
        positions = self._positions(mask, end)
        start = n if n >= prompt_len else 0  # every position before ran eagerly: the cache holds their own
        start, kept = prefix if prefix is not None else (start, prefix_cache(cache, start, self._plan.model.config))
        del cache  # the call's own (a static cache is no one else's once generate returned)
        if kept is None:
            start, kept = 0, prefix_cache(None, 0, self._plan.model.config)
        extra = self._extended(sequences.shape[0], end)
        each = max(1, min(REFILL_POSITIONS, BATCH_BYTES // (4 * sequences.shape[0] * self._plan.head.n_outputs)))
        for low in range(start, end, each):
            high = min(end, low + each)
            refilled = self._refill(sequences[:, :high], mask[:, :high], positions[:, :high], high - low, kept, low,
                                    {name: value[:, :high] for name, value in extra.items()})
            if refilled is None:
                raise RuntimeError("the probe was detached while the call ran")
            self._replay_chunk(sequences, mask, *refilled, low, high, start, emitting, end)
            if self.failed:  # its scoring failed in this thread (said): nothing after it is recorded, nor re-run
                return
        self._pending = True

    def _replay_chunk(self, sequences: torch.Tensor, mask: torch.Tensor, capture: Capture, logits: torch.Tensor,
                      low: int, high: int, start: int, emitting: int, end: int) -> None:
        """Record positions low..high-1 from a refill forward over them (``capture``, ``logits`` at each): a part of
        the prompt that ran compiled is fed; each decoding step whose distribution is the model's at one of them
        (the first step's, where that is the prompt's last, is the eager prompt forward's, kept) is emitted there,
        then the generated positions are fed and the steps handed on."""
        prompt_len = self._prompt_len or 0
        if low < prompt_len:  # the prompt itself ran compiled (a model whose forward the user compiled)
            top = min(high, prompt_len)
            self.feed(low, *self._refilled(capture, mask, low, low, top), sequences[:, low:top])
            self._pending = top == prompt_len
        for position in range(emitting if low == start else max(emitting, low + 1), min(end, high + 1)):
            if position - 1 >= low:
                self._logits, self._log_probs, self._sliced = logits[:, position - 1 - low], None, False
            self._emit(sequences[:, position].long(), at=position, hold=True)
        first = max(low, prompt_len)
        if first < high:
            try:
                self.feed(first, *self._refilled(capture, mask, low, first, high), None)
            except BaseException:
                # the steps whose context was not fed cannot be scored; those before them still go out (fail, flush)
                self._deferred = [item for item in self._deferred if item.n <= self._n]
                raise
        # after the last chunk: the token generate returned last's
        self._logits, self._log_probs, self._sliced = logits[:, -1], None, False
        if self._weights is not None and not same_weights(self._weights, weights_state(self._plan.model)):
            self._deferred = []  # (the chunks before went out: they ran before the weights changed)
            raise RuntimeError("the model's weights changed (trained, loaded) after the call returned, before its "
                               "compiled steps were run again to record them, which on this device runs beside the "
                               "program: they would be of neither model; wait for its records (probe.flush(), "
                               "probe.calls) before changing the weights")
        self.flush()

    def _extended(self, rows: int, end: int) -> dict[str, torch.Tensor]:
        """The call's other forward inputs over its first ``end`` positions, as generate extends them per token
        (``token_type_ids``: the last one repeated; rows repeated as it repeats them, ``num_return_sequences``)."""
        extended = {}
        for name, value in self.forward_inputs.items():
            if name != "token_type_ids" or value.dim() != 2 or rows % value.shape[0]:
                raise RuntimeError(f"{self._rerun()[0]} with {name}, which running them again to record them cannot "
                                   f"reproduce; {self._rerun()[1]}")
            value = value.repeat_interleave(rows // value.shape[0], dim=0)
            extended[name] = torch.cat([value, value[:, -1:].expand(-1, end - value.shape[1])], dim=1)
        return extended

    def _rerun(self) -> tuple[str, str]:
        """(why the call's forwards are run again to record them, what records it otherwise): what a refusal of
        :meth:`_replay`'s says."""
        if self._whole is not None:
            return f"its forwards ran {self._whole.what}", self._whole.instead
        return "its forwards ran compiled", "pass disable_compile=True to generate"

    def _attention(self, sequences: torch.Tensor, end: int) -> torch.Tensor:
        """The attention mask of the call's first ``end`` positions, as generate gives it: the prompt's (as the hooks
        saw it, else as the call was given it), then every generated token's on."""
        prompt_len = self._prompt_len or 0
        if self._n >= prompt_len:
            prompt = self._mask.view()[:, :prompt_len]
        elif self.attention_mask is not None:  # (rows repeated as generate repeats them: num_return_sequences)
            prompt = self.attention_mask.to(sequences.device).bool()
            prompt = prompt.repeat_interleave(sequences.shape[0] // prompt.shape[0], dim=0)
        else:  # none given: as generate infers one, padding where the pad id is (unless it is also an EOS id)
            ids = sequences[:, :prompt_len]
            pad = self.pad_id
            padded = pad is not None and pad not in self._eos and bool((ids == pad).any())
            prompt = ids != pad if padded else torch.ones_like(ids, dtype=torch.bool)
        generated = torch.ones(sequences.shape[0], end - prompt_len, dtype=torch.bool, device=prompt.device)
        return torch.cat([prompt, generated], dim=1)

    def _positions(self, mask: torch.Tensor, end: int) -> torch.Tensor:
        """The position ids generate gives the call's first ``end`` positions: the prompt's as the call was given them
        (rows repeated as generate repeats them, ``num_return_sequences``; its last ``prompt_len``, as generate slices
        them), else counted along its mask (padding at 0); then each generated token one past the prompt's last
        (generate's ``_update_model_kwargs_for_generation``, given position ids or not)."""
        prompt_len, given = self._prompt_len or 0, self.position_ids
        if given is None:
            prompt = (mask[:, :prompt_len].long().cumsum(-1) - 1).masked_fill(~mask[:, :prompt_len], 0)
        elif given.dim() != 2 or given.shape[1] < prompt_len or mask.shape[0] % given.shape[0]:
            raise RuntimeError(f"{self._rerun()[0]} with position_ids of shape {tuple(given.shape)}, which running "
                               f"them again to record them cannot reproduce; {self._rerun()[1]}")
        else:
            prompt = given[:, given.shape[1] - prompt_len:].to(mask.device, torch.long)
            prompt = prompt.repeat_interleave(mask.shape[0] // given.shape[0], dim=0)
        after = prompt[:, -1:] + 1 if prompt_len else torch.zeros_like(mask[:, :1], dtype=torch.long)
        return torch.cat([prompt, after + torch.arange(end - prompt_len, device=mask.device)], dim=1)

    def _refilled(self, capture: Capture, mask: torch.Tensor, start: int, first: int, end: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(head features, embedding norms, mask) of positions first..end-1, from the refill forward's ``capture``
        of the positions from ``start`` on."""
        return (stacked_features(self._plan, capture, first - start, end - start),
                capture.embed_norm[:, first - start:end - start], mask[:, first:end])

    def _undid(self, sequences: torch.Tensor) -> str | None:
        """``not recorded: ...`` when a token a forward of the call fed back, which completed a step, is not the one
        generate returned at its position (its loop ran a forward on a token it did not keep), else None; the steps
        from there on not handed on yet are dropped. One host read per call."""
        fed = self._fed.n
        if not fed:
            return None
        held = self._ids_fed or self.ids_beside_embeds  # the sequences begin with the prompt's ids
        first = self._fed_from - (0 if held else self._prompt_len or 0)
        returned = sequences[:, first:first + fed].to(self._fed.view().device)
        same = (self._fed.view()[:, :returned.shape[1]] == returned).all(dim=0).tolist() + [False] * (
            fed - returned.shape[1])
        if all(same):
            return None
        position = self._fed_from + same.index(False)
        self._deferred = [item for item in self._deferred if item.n < position]
        step = position - (self._prompt_len or 0)
        handed = (f"; the records of steps {step}..{self._handed - 1}, handed on already, are of those tokens"
                  if self._handed > step else "")
        return (f"not recorded: the token step {step} of this call was recorded with is not the one generate "
                f"returned there: its loop ran a forward on a token it did not keep (a custom_generate that looks "
                f"ahead on a copy of its cache), and its records from there on are not its own{handed}")

    def _missed(self, sequences: torch.Tensor) -> str | None:
        """``not recorded: ...`` when the host returned tokens from forwards the hooks never saw, else None. Such
        forwards ran compiled code: ``generate`` with a static cache compiles its decoding steps itself."""
        held = self._ids_fed or self.ids_beside_embeds  # the sequences begin with the prompt's ids
        seen = self._n + 1 - (0 if held else self._prompt_len or 0)  # with the pending token
        if self._n and sequences.shape[1] <= seen:
            return None
        missing = sequences.shape[1] - max(seen, 1) if self._n else sequences.shape[1]
        return (f"not recorded: {missing} of the generated tokens came from forwards that never reached the probe's "
                "hooks: code compiled by torch.compile (generate compiles its decoding steps with a static cache, "
                "cache_implementation='static') or a CUDA graph; pass disable_compile=True to generate, or "
                f"{MAKE_EAGER}")

    # -- one record --------------------------------------------------------------------------------------

    def emit(self, token: torch.Tensor | int, *, log_prob: torch.Tensor | None = None) -> None:
        """The step record of ``token`` (batch,), emitted at the position after the last one fed; ``log_prob``:
        the model's log-probability of each explained target (batch, k), else read from its last logits. An int:
        the one row's token as the host holds it (an engine's request), made a tensor with the others it is scored
        with, not one by one in the engine's loop."""
        self._emit(token.long() if isinstance(token, torch.Tensor) else operator.index(token), log_prob)

    def stopped(self, done: torch.Tensor, length: int) -> None:
        """generate's stopping criteria ran on its sequences, ``length`` tokens long: ``done`` (batch,) says which
        rows finished at their latest token (an EOS, a stop string, the user's own criterion), so that from the next
        step on generate only pads them. Kept on the device, one tensor per generated token; :meth:`_emit` reads
        which rows are active from them. Never raises (a failure stops the call's records, said as any other)."""
        if self.failed or (self._whole is not None and self._whole.beams):  # (run on candidate beams)
            return
        try:
            # as generate reads it (unfinished_sequences & ~done): a criterion of the user's may give 0/1 integers
            going = ~done if done.dtype == torch.bool else (~done & 1).bool()
            before = self._going[-1] if self._going else torch.ones_like(going)
            # One call per token, but an assisted iteration's covers every token it accepted: those before its last
            # were emitted while the rows still went (generate's sequences begin with the prompt's ids, if given).
            held = self.ids_given or self.ids_beside_embeds
            covered = length - ((self._prompt_len or 0) if held else 0)
            self._going.extend([before] * max(0, covered - len(self._going) - 1))
            self._going.append(before & going)
        except Exception as failure:  # noqa: BLE001 - never into the host's generate
            self.fail("following which rows generate finished", failure)

    def pads_nothing(self) -> None:
        """generate's stopping criteria hold no EOS id, so it pads no row: none finishes, whatever EOS id the call's
        settings seemed to name."""
        self._eos = []

    def _emit(self, token: torch.Tensor | int, log_prob: torch.Tensor | None = None, *, at: int | None = None,
              hold: bool = False) -> None:
        """The step record of ``token`` ((batch,) int64, or one host int), emitted at position ``at`` (default: after
        the last one fed); ``log_prob`` as :meth:`emit`'s. ``hold``: it waits to be scored until the caller flushes
        (a compiled call's step, emitted before its position is fed). The rows still active are those generate's
        stopping criteria had not finished (:meth:`stopped`), else those that emitted no EOS token before; without
        either no row ever finishes, and every step holds the call's one all-True tensor. The token stays on the
        device, never read here: the publisher reads it (texts) off this thread."""
        active, host = self._active, isinstance(token, int)
        if active is None:
            active = self._active = (torch.ones(1, dtype=torch.bool) if host else
                                     torch.ones(token.shape[0], dtype=torch.bool, device=token.device))
        if not host and token.device != active.device:  # a model split across devices: the first step's device
            token = token.to(active.device)  # for the call
        at = self._n if at is None else at
        generated = at - (self._prompt_len or 0)  # the token's index among the call's generated ones
        rows = active
        if self._going:  # (the criteria ran on every token before this one; a step they skipped changed nothing)
            if generated > 0:
                rows = self._going[min(generated, len(self._going)) - 1]
        elif self._eos:  # a row that emits an EOS token only pads from the next step on
            if self._eos_ids is None:
                self._eos_ids = torch.tensor(self._eos, dtype=torch.long, device=active.device)
            self._active = active & ~torch.isin(token, self._eos_ids)
        # Nobody to hand it to (keep_steps=False, no on_step, sink or subscriber): the record is not made.
        if self._hub.listened:
            now, deferred = time.time(), self._deferred
            deferred.append(_Emitted(token, rows, log_prob, self._log_probs, self._logits, at, now, self._sliced))
            if len(deferred) == 1:  # the first of a batch: how many may wait with it
                self._limit = self._batch_limit()
            if not hold and (self._hub.live or self._wait == 0 or len(deferred) >= self._limit
                             or (self._wait is not None and now - deferred[0].time >= self._wait)):
                self.flush()
        self._real.append(rows)
        self._pending = False

    def drop_waiting(self) -> int:
        """Let go of the emitted steps still waiting to be scored (where scoring them cannot be done: a collected
        manager's requests); how many there were."""
        dropped, self._deferred = len(self._deferred), []
        return dropped

    def _batch_limit(self) -> int:
        """How many emitted steps may wait to be scored together: :data:`BATCH_STEPS`, fewer where what each keeps
        and the scores of all of them at once would pass :data:`BATCH_BYTES`."""
        return max(1, min(BATCH_STEPS, BATCH_BYTES // self._step_bytes(self._deferred[-1])))

    def _step_bytes(self, item: _Emitted) -> int:
        """What scoring ``item`` together with others holds for it: the model's log-probability rows it keeps and its
        scores. (Rows that are views of a step's rows for several requests, as an engine's, count as their share of
        it.) Read off the tensors once per run (every step keeps rows of the same shape): this runs for every step
        handed on, in the engine's loop."""
        kept = item.log_probs if item.log_probs is not None else item.logits
        if self._sizes is None or (kept is not None and self._sizes[0] == 0):
            self._sizes = (kept.numel() * kept.element_size() if kept is not None else 0, item.active.shape[0])
        kept_bytes, rows = self._sizes
        return (kept_bytes if kept is not None else 0) + 4 * rows * len(self._scoring.layers) * item.n

    def flush(self, *, here: bool = False) -> None:
        """Hand the emitted steps still waiting to the hub, to be scored together (as many at a time as
        :data:`BATCH_BYTES` allows) and published in order: the hub scores them (:meth:`_record`), in its publisher
        thread where :meth:`_elsewhere` (and not ``here``), reading the feature cache as it holds them now."""
        if not self._deferred:
            return
        self._fill()
        emitted, self._deferred = self._deferred, []
        each = max(1, BATCH_BYTES // self._step_bytes(emitted[-1]))  # the last is the longest
        elsewhere = not here and self._elsewhere()
        for first in range(0, len(emitted), each):
            batch = emitted[first:first + each]
            n = batch[-1].n
            context = _Context(*(cache.snapshot(n, kept=elsewhere) for cache in (self._features, self._embed,
                                                                                 self._mask)), self._compute_dtype)
            made = _Batch(self, batch, context, elsewhere=elsewhere)
            try:
                self._hub.publish(self.call, made, self._plan.texts)  # (not plan.readable: it holds the model)
            except Exception as error:
                if error is not made.failure:
                    raise  # an on_step callback's, the hub's: the caller says it
                # scored in this thread: said as the publisher says it, from this batch's first step (the ones
                # handed on before it are kept); the later batches are dropped
                self.fail("scoring its steps", error)
                return

    def _elsewhere(self) -> bool:
        """Whether this call's steps may be scored in the publisher thread: its feature cache (where the scoring
        computes) is on a device of :data:`SCORED_ELSEWHERE`, the head can be read there
        (:attr:`~nxl_hooks.method.head.Head.readable_elsewhere`), no ``on_step`` callback wants each record in
        this thread, and autocast is off (it is per thread: another would compute without it, not as the model)."""
        device = self._features.view().device.type
        return (device in SCORED_ELSEWHERE and self._plan.head.readable_elsewhere and not self._hub.calls_back
                and not torch.is_autocast_enabled(device))

    def _record(self, emitted: list[_Emitted], context: _Context) -> list[Step]:
        """The records of ``emitted`` steps (in order, each at its own context length), reading ``context``: the
        head's rows of all their tokens are gathered once and the feature cache is read once, in one matmul, for all
        of them, and their scores are computed together (:meth:`_scored`). What the records have in common is made
        once and each holds a view of it: their tokens, active rows, probabilities and scores, and the context's
        embedding norms and mask (copies, not views of the growing cache). Their tensors stay on the device: the
        hub's publisher moves them to the host."""
        plan, batch, last = self._scoring, emitted[0].active.shape[0], emitted[-1].n
        with torch.no_grad():
            tokens = _stacked_tokens(emitted)  # (steps, batch)
            active = torch.stack([item.active for item in emitted]).unbind(0)
            embed, mask = context.embed.clone(), context.mask.clone()
            targets = [plan.explained(ids) for ids in tokens[:, :, None].unbind(0)]  # each (batch, k)
            log_probs, probabilities = self._probabilities(emitted, targets)
            features = context.features.to(context.dtype)  # (batch, last, layers, d)
            layers = features.shape[2]
            with plan.head.reading() as readout:
                def head_logits(ids: torch.Tensor, n: int = last, steps: Sequence[int] = (),
                                first: int = 0) -> torch.Tensor:  # (layers, batch, n, m)
                    """``steps``: the steps (counted from ``first``) whose ids ``ids`` holds, one block of columns
                    each: l = L at a step's position is set to its model's own logits of them where they are
                    sliced or the head is not per position (:func:`~.forward.pin_last_layer`)."""
                    flat = features.narrow(1, 0, n).reshape(batch, -1, features.shape[-1])  # all layers, one gather
                    logits = readout.target_logits(flat, ids).view(batch, n, layers, -1).permute(2, 0, 1, 3)
                    width = ids.shape[1] // max(len(steps), 1)
                    for block, index in enumerate(steps):
                        item = emitted[first + index]
                        if item.logits is not None and (item.sliced or not plan.head.per_position):
                            columns = slice(block * width, (block + 1) * width)
                            pin_last_layer(plan.layers, plan.n_blocks, logits[..., columns], slice(None), item.n - 1,
                                           item.logits.gather(-1, ids[:, columns].to(item.logits.device)))
                    return logits

                # (layers, batch, last, steps * k)
                together = head_logits(torch.cat(targets, dim=1), steps=range(len(emitted)))
                k, scored = targets[0].shape[1], []
                # steps whose model log-probabilities are known, and those whose are not (a compiled call's
                # replayed steps), scored apart: a method may read them
                for _, group in itertools.groupby(range(len(emitted)), key=lambda index: log_probs[index] is None):
                    indices = list(group)
                    first, end = indices[0], indices[-1] + 1
                    scored += self._scored(together[..., first * k:end * k],
                                           functools.partial(head_logits, first=first), embed, mask,
                                           targets[first:end],
                                           log_probs[first:end], [item.n for item in emitted[first:end]])
        steps, tokens, n_blocks = [], tokens.unbind(0), plan.n_blocks
        for index, (item, (scores, chosen)) in enumerate(zip(emitted, scored)):
            n, probability = item.n, probabilities[index]
            if probability is not None and not plan.label_axis:
                probability = probability[:, 0]
            steps.append(Step(call=self.call.index, step=n - self._prompt_len, position=n, token=tokens[index],
                              target=chosen, scores=scores, embed_norm=embed.narrow(1, 0, n),
                              mask=mask.narrow(1, 0, n), active=active[index], layers=list(plan.layers),
                              n_blocks=n_blocks, probability=probability, time=item.time))
        return steps

    def _scored(self, together: torch.Tensor, head_logits: Callable[..., torch.Tensor], embed: torch.Tensor,
                mask: torch.Tensor, targets: list[torch.Tensor], log_probs: list[torch.Tensor | None],
                lengths: list[int]) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """Each step's (scores, explained ids): its ``targets`` (batch, k) read against its first ``lengths``
        positions of ``embed`` and ``mask``; ``together``: (layers, batch, last, steps * k), every target's logits
        at every position the longest step reads, as ``head_logits(ids, steps=...)`` gives them for other (batch, m)
        ids of those steps (one block of columns each, in the order ``steps`` gives them).
        Pointwise methods (:attr:`Plan.pointwise`) score every step in one call: the steps' rows stacked, each
        context padded to the longest, each record a view of its own rows and positions; other methods, one call
        per step."""
        plan, count, k = self._scoring, len(targets), targets[0].shape[1]
        layers, batch, last = together.shape[:3]
        if count == 1 or not plan.pointwise:
            return [plan.scores(Given(together[:, :, :n, index * k:(index + 1) * k].contiguous(),
                                      embed.narrow(1, 0, n), explained, log_probs[index],
                                      functools.partial(head_logits, n=n, steps=(index,)), mask.narrow(1, 0, n)))
                    for index, (n, explained) in enumerate(zip(lengths, targets))]

        def stacked(values: torch.Tensor) -> torch.Tensor:  # (layers, batch, last, count * m) -> (layers, rows, ...)
            return (values.view(layers, batch, last, count, -1).permute(0, 3, 1, 2, 4)
                    .reshape(layers, count * batch, last, -1))

        def stacked_logits(ids: torch.Tensor) -> torch.Tensor:  # (rows, m): each step's rows against its context
            return stacked(head_logits(ids.reshape(count, batch, -1).transpose(0, 1).reshape(batch, -1),
                                       steps=range(count)))

        scores, chosen = plan.scores(Given(
            stacked(together), embed.expand(count, -1, -1).reshape(count * batch, last), torch.cat(targets),
            None if log_probs[0] is None else _joined_rows(log_probs), stacked_logits,
            mask.expand(count, -1, -1).reshape(count * batch, last)))
        each = {name: value.view(layers, count, batch, *value.shape[2:]).unbind(1) for name, value in scores.items()}
        return [({name: values[index].narrow(2, 0, n) for name, values in each.items()}, explained)
                for index, (n, explained) in enumerate(zip(lengths, chosen.view(count, batch, *chosen.shape[1:])
                                                           .unbind(0)))]

    @staticmethod
    def _probabilities(emitted: list[_Emitted], targets: list[torch.Tensor]
                       ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Each step's model log-probabilities (batch, vocabulary), and its probability of each explained target
        (batch, k), or None where unknown: every waiting step's raw logits log-softmaxed in one operation and
        gathered in one, every probability exponentiated in one."""
        full = [item.log_probs for item in emitted]
        picked = [item.log_prob for item in emitted]

        def gathered(rows: torch.Tensor, indices: list[int]) -> tuple[torch.Tensor, ...]:
            """The log-probabilities of steps ``indices``' targets, from their ``rows`` (steps, batch, V)."""
            return rows.gather(-1, torch.stack([targets[index] for index in indices]).to(rows.device)).unbind(0)

        raw = [index for index, item in enumerate(emitted) if item.logits is not None]
        if raw:
            taken = torch.stack([emitted[index].logits for index in raw]).float().log_softmax(-1)  # (raw, batch, V)
            for row, (index, value) in enumerate(zip(raw, gathered(taken, raw))):
                full[index] = taken[row]
                picked[index] = value if picked[index] is None else picked[index]
        given = [index for index, log_probs in enumerate(full) if picked[index] is None and log_probs is not None]
        if given:  # rows of their own (an engine's requests): gathered in one operation
            for index, value in zip(given, gathered(torch.stack([full[index] for index in given]), given)):
                picked[index] = value
        known = [index for index, value in enumerate(picked) if value is not None]
        probabilities: list[torch.Tensor | None] = [None] * len(emitted)
        if known:
            device = picked[known[0]].device
            values = [picked[index] for index in known]
            values = [value if value.device == device else value.to(device) for value in values]
            for index, value in zip(known, (torch.stack(values) if len(values) > 1 else values[0][None]).exp()):
                probabilities[index] = value
        return full, probabilities


@functools.cache
def _watched(kind: type) -> type:
    """A subclass of generate's list ``kind`` (its stopping criteria, its logits processors) whose call runs inside
    ``apart()`` and hands its result to ``seen`` (the rows the criteria finished, kept on the device, and the length
    of the sequences they read); a list of the user's own kind stays one."""

    class Watched(kind):  # type: ignore[misc, valid-type]
        apart: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        seen: Callable[[torch.Tensor, int], None] | None = None

        @_waits
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            if not self and self.seen is None:  # no processor to run apart (greedy decoding's list, every token)
                return super().__call__(input_ids, scores, **kwargs)
            with self.apart():
                result = super().__call__(input_ids, scores, **kwargs)
            if self.seen is not None:
                self.seen(result, input_ids.shape[1])  # (never raises)
            return result

    return Watched


class Generations:
    """The ``generate`` wrapper on one model instance, and the :class:`~nxl_hooks.hooks.engines.Recording` of each
    thread's running call.

    ``gens.current()`` is what the probe's hooks ask: the calling thread's recording (a :class:`Run` under
    ``generate``, an engine's step under continuous batching, :data:`~nxl_hooks.hooks.engines.NOT_RECORDED` inside
    a call that is not recorded), or None outside every call.
    """

    def __init__(self, plan: Plan, hub: Hub, notice: Notice, *, cache_dtype: torch.dtype | None,
                 cache_device: str | torch.device | None) -> None:
        # cache_dtype and cache_device were checked by plan.check_recording, before attach built this
        self.plan, self.hub, self.notice = plan, hub, notice
        self.cache_dtype = cache_dtype
        self.cache_device = torch.device(cache_device) if cache_device is not None else None
        self._local = threading.local()
        #: the attributes install set: (the instance's own before, if any; the wrapper set)
        self._restore: dict[str, tuple[Callable | None, Callable]] = {}
        self._detached = False
        self.backbone: nn.Module | None = None  # set by attach: a forward the user compiled in place is seen there
        # a forward that writes the model's own state is never run by the probe beside the host's (Run.finish)
        self._stateful = any(_changes_itself(module) for module in plan.model.modules())
        self._drafted = False  # a draft for another model's assisted decoding was said (_begin: once per attach)

    def current(self) -> Recording | None:
        return getattr(self._local, "run", None)

    def score_waiting(self, frame: FrameType | None) -> GenerationCall | None:
        """Before the process dies of a signal (:func:`~.probe.end_records`), in the thread it stopped at ``frame``:
        score the steps this thread's call has waiting (:data:`BATCH_STEPS`), where the thread is :func:`between_steps`
        (stopped inside a hook, the call's state may be half changed: they are left). The call, now recorded up to
        its last token; None where there is none here, or its waiting steps were left."""
        # (the call generate runs here: inside its logits processors, current() is NOT_RECORDED: _apart)
        run = getattr(self._local, "tracked", None)
        if not isinstance(run, Run) or not between_steps(frame):
            return None
        run.flush(here=True)
        # a call whose forwards ran compiled is recorded when it returns (Run._replay): none of its steps since is
        return run.call if run._following else None

    @contextlib.contextmanager
    def running(self, run: Recording) -> Iterator[None]:
        """``run`` is this thread's current recording inside the block: the probe's hooks feed it."""
        previous = self.current()
        self._local.run = run
        try:
            yield
        finally:
            self._local.run = previous

    def new_run(self, *, request_id: str | None, prompt_len: int | None, eos: Any,
                wait: float | None = BATCH_SECONDS, refill: bool = False, engine: bool = False,
                choice: Choice | None = None) -> Run:
        """A recorded call in the calling thread, with a fresh feature cache. ``wait``: how long its emitted steps may
        wait to be scored together while nothing reads them live (0: each as it is emitted; None: until
        :data:`BATCH_STEPS` wait, or the call ends). ``refill``: positions its forwards ran compiled are recorded by
        running the model over them when it ends (a ``generate`` call: :meth:`refill`). ``engine``: a serving
        engine's request, whose end does not make the engine's loop wait for the publisher (a ``generate`` call's
        end waits for the call before it: :meth:`~.publish.Hub.end`; :data:`ENGINE_ENDS_WAIT`). ``choice``: which of
        its request's choices it generates, where a server says (:attr:`~.steps.GenerationCall.choice`)."""
        call = self.hub.begin(self.plan.layers, request_id=request_id, thread=threading.current_thread().name,
                              model=self.plan.name, choice=choice)
        return Run(self.plan, self.hub, call, prompt_len=prompt_len, eos=eos, cache_dtype=self.cache_dtype,
                   cache_device=self.cache_device, notice=self.notice, refill=self.refill if refill else None,
                   refill_apart=not self._stateful, wait=wait, engine=engine)

    def refill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, keep: int, cache: Any,
               start: int, extra: dict[str, torch.Tensor]) -> tuple[Capture, torch.Tensor] | None:
        """One eager forward of the model over positions ``start``.. of ``ids`` (batch, n), with attention ``mask``,
        position ids ``positions`` and the other per-position inputs ``extra`` (batch, n) as generate ran them,
        against ``cache``, a KV cache holding the positions
        before ``start`` (a new one: the call's own is left as it is), which it appends to. The probe's hooks capture
        it for the calling thread (:class:`_Refilled`); returns that capture and the model's logits at the last
        ``keep`` positions (batch, keep, vocabulary), or None once detached (no hook runs). A ``forward`` the user
        compiled in place is not used (:func:`~.traced.eager_twin`: the hooks run, and other threads' calls stay
        compiled)."""
        if self._detached:
            return None
        model, kept = self.plan.model, _Refilled()
        parameters = inspect.signature(model.forward).parameters
        keyword = cache_keyword(parameters)
        if keyword is None:
            raise RuntimeError("the model's forward takes no KV cache, which running the call's positions again "
                               "needs")
        arguments: dict[str, Any] = {"input_ids": ids[:, start:], "attention_mask": mask.long(), "use_cache": True,
                                     keyword: cache}
        if "position_ids" in parameters:
            arguments["position_ids"] = positions[:, start:]
        arguments.update((name, value[:, start:]) for name, value in extra.items())
        if "logits_to_keep" in parameters:  # not a vocabulary-sized row per prompt token
            arguments["logits_to_keep"] = keep
        with torch.no_grad(), self.running(kept):
            eager_twin(model, self.backbone or model, *self.plan.blocks)(**arguments)
        if kept.capture is None or kept.logits is None:
            raise RuntimeError("running the model again over the call's tokens recorded nothing (its forward did not "
                               "reach the probe's hooks, or returned no logits)")
        return kept.capture, kept.logits[:, -keep:]

    def unrecorded(self, request_id: str | None, what: str, error: BaseException, *, log: bool = True,
                   ended: bool = True, choice: Choice | None = None) -> GenerationCall:
        """A call record whose error says ``not recorded: why`` (``why``: ``error``, which names what makes it
        recordable); logs one line unless ``log`` is False (the caller said it once for many calls). The same
        text becomes :attr:`notice`'s. ``ended=False``: ended by :meth:`_refused_end` once the call has run."""
        if log:
            reason(what, error)
        text = f"not recorded: {described(error)}"
        self.notice.unrecorded(text, log=False)
        return self.hub.begin(self.plan.layers, request_id=request_id, thread=threading.current_thread().name,
                              model=self.plan.name, error=text, ended=ended, choice=choice)

    def _refused_end(self, call: GenerationCall, error: BaseException | None) -> None:
        """End ``call``, a generate call refused before it ran (:meth:`_begin`), once generate has returned or raised
        (``error``): generate's own refusal of its arguments (``num_return_sequences`` above ``num_beams``) is what
        the record says first, ours second, so the record never blames the probe for a call that never ran."""
        if error is not None and call.error is not None:
            why = call.error.removeprefix("not recorded: ")
            call.error = record_text(f"not recorded: generate raised {raised(error)}; it would not be recorded "
                                     f"either: {why}")
        self.hub.end(call, None, wait=False)

    # -- the wrapper -------------------------------------------------------------------------------------

    def install(self) -> None:
        model = self.plan.model
        original = model.generate

        @_waits
        def generate(*args: Any, **kwargs: Any) -> Any:
            return self._track(original, args, kwargs)

        functools.update_wrapper(self._set("generate", generate, original), original)
        criteria = getattr(model, "_get_stopping_criteria", None)
        if callable(criteria):
            self._set("_get_stopping_criteria", self._watching(criteria), criteria)
        processors = getattr(model, "_get_logits_processor", None)
        if callable(processors):
            self._set("_get_logits_processor", self._apart(processors), processors)
        heal = getattr(model, "heal_tokens", None)
        if callable(heal):
            self._set("heal_tokens", self._healing(heal), heal)

    def _set(self, name: str, wrapper: Callable, wrapped: Callable) -> Owned:
        """``wrapper`` of ``wrapped`` as the model instance's attribute ``name`` until :meth:`uninstall`; a copy of
        the model made meanwhile gets ``wrapped`` (:class:`~.guard.Owned`)."""
        model, owned = self.plan.model, Owned(wrapper, wrapped)
        self._restore[name] = (vars(model).get(name), owned)
        setattr(model, name, owned)
        return owned

    def _watching(self, criteria: Callable) -> Callable:
        """generate's ``_get_stopping_criteria``, whose list, for a recorded call, also hands each token's finished
        rows to the call's run (:meth:`Run.stopped`): a row a stop string or the user's criterion finished is
        padded from then on as one that emitted an EOS token. Only where generate pads finished rows: it does when
        one of the criteria has an ``eos_token_id`` (its own rule); else such a row goes on with real tokens."""

        @functools.wraps(criteria)
        def stopping_criteria(*args: Any, **kwargs: Any) -> Any:
            found = criteria(*args, **kwargs)
            run = self.current()
            if not isinstance(run, Run) or getattr(self._local, "inner", 0):
                return found
            if not any(hasattr(each, "eos_token_id") for each in found):
                run.pads_nothing()
                return found
            try:
                watched = _watched(type(found))(found)
            except Exception:  # noqa: BLE001 - a list of the user's own kind that cannot be copied: EOS ids then
                return found
            watched.seen = run.stopped
            return watched

        return stopping_criteria

    def _apart(self, processors: Callable) -> Callable:
        """generate's ``_get_logits_processor``, whose list, for a recorded call, runs outside its record: a processor
        that runs the model itself (classifier-free guidance's unconditional branch, ``guidance_scale``; one of the
        user's) runs it unrecorded, as a forward of no call, so the record follows the call's own forwards only."""

        @functools.wraps(processors)
        def logits_processor(*args: Any, **kwargs: Any) -> Any:
            found = processors(*args, **kwargs)
            if not isinstance(self.current(), Run):
                return found
            try:
                apart = _watched(type(found))(found)
            except Exception:  # noqa: BLE001 - a list of the user's own kind that cannot be copied: Run._check then
                return found
            apart.apart = functools.partial(self.running, NOT_RECORDED)
            return apart

        return logits_processor

    def _healing(self, heal: Callable) -> Callable:
        """generate's ``heal_tokens`` (``token_healing=True``), which, for a recorded call, runs outside its record:
        it runs generate on each prompt less its last token to pick that token anew, before the call's own prefill
        runs the healed prompt from position 0, where its record starts."""

        @functools.wraps(heal)
        def heal_tokens(*args: Any, **kwargs: Any) -> Any:
            healing = getattr(self._local, "healing", False)
            self._local.healing = True  # (the generate calls it makes are the call's own: _track)
            try:
                if not isinstance(self.current(), Run):
                    return heal(*args, **kwargs)
                with self.running(NOT_RECORDED):
                    return heal(*args, **kwargs)
            finally:
                self._local.healing = healing

        return heal_tokens

    def uninstall(self) -> None:
        """Give the model its own ``generate`` back; calls running in other threads finish unrecorded. A wrapper
        someone else set over the probe's while attached (the user's, another library's) stays, and the probe's
        under it passes every call through (``_detached``): taking it out would drop theirs."""
        self._detached = True
        model = self.plan.model
        for name, (own, wrapper) in self._restore.items():
            if vars(model).get(name) is not wrapper:
                continue
            if own is not None:
                setattr(model, name, own)
            else:
                del vars(model)[name]
        self._restore = {}

    @_waits
    def _track(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        if self._detached:
            return original(*args, **kwargs)
        named = _named(original, args, kwargs)
        if self.current() is not None and (getattr(self._local, "healing", False)
                                           or _setting(self.plan.model, named, "is_assistant")):
            # generate calling generate (assistant_early_exit's draft, token healing's): the outer call is tracked,
            with self._inner():  # with its own stopping criteria only
                return original(*args, **kwargs)
        # (any other generate call inside one, the user's from its streamer, stopping criterion or logits processor,
        # is a call of its own: fed to the outer call's record, its forwards ended it, saying a wrong why)
        run = self._begin(named)
        # the record _begin made of a call it refused, ended once generate has returned or raised
        refused, self._local.refused = getattr(self._local, "refused", None), None
        if eager() and isinstance(run, Run):  # a recording session: generate's own compile would skip the hooks
            kwargs = {"disable_compile": True, **kwargs}
        tracked = getattr(self._local, "tracked", None)
        self._local.tracked = run  # (what score_waiting finds, also inside the call's logits processors)
        with self.running(run):
            try:
                out = original(*args, **kwargs)
            except BaseException as error:
                if refused is not None:
                    self._refused_end(refused, error)
                else:
                    self._end(run, None, f"generate raised {raised(error)}: its records end at the last step made "
                                         "before")
                raise
            finally:
                self._local.tracked = tracked
        if refused is not None:
            self._refused_end(refused, None)
        self._end(run, out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None))
        return out

    @contextlib.contextmanager
    def _inner(self) -> Iterator[None]:
        """A ``generate`` call made inside this thread's tracked one (``assistant_early_exit``'s draft runs the model's
        own generate): its stopping criteria, which end each draft, are not the tracked call's (:meth:`_watching`)."""
        depth = getattr(self._local, "inner", 0)
        self._local.inner = depth + 1
        try:
            yield
        finally:
            self._local.inner = depth

    def _begin(self, kwargs: dict) -> Recording:
        """A :class:`Run` for this call, given its arguments by name (:func:`_named`), or
        :data:`~nxl_hooks.hooks.engines.NOT_RECORDED` (with a call record saying why)."""
        request_id = REQUEST_ID.get() or uuid.uuid4().hex
        if _setting(self.plan.model, kwargs, "is_assistant"):
            # the other model's candidate generator calls generate once per draft, from the cache of the ones before:
            # said once, not once per draft
            self.unrecorded(request_id, "this model's drafts", ValueError(_DRAFTS), log=not self._drafted)
            self._drafted = True
            return NOT_RECORDED
        try:
            why = unsupported(self.plan.model, kwargs)
            if why is not None:
                raise ValueError(why)
            if self.plan.embedding == "word" and kwargs.get("inputs_embeds") is not None:
                raise ValueError(NEEDS_IDS)  # (its prompt's forward would find no word embeddings)
            prompt = next((kwargs[k] for k in ("inputs", "input_ids", "inputs_embeds") if kwargs.get(k) is not None),
                          None)
            prompt_len = prompt.shape[1] if isinstance(prompt, torch.Tensor) and prompt.dim() > 1 else None
            whole = replayed(self.plan.model, kwargs)
            if whole is not None and (kwargs.get("inputs_embeds") is not None or prompt_len is None):
                raise ValueError(f"{whole.what} is recorded from the model run again over the sequences generate "
                                 "returns, which needs its prompt as token ids: pass input_ids (without "
                                 "inputs_embeds)")
            run = self.new_run(request_id=request_id, prompt_len=prompt_len, wait=BATCH_SECONDS,
                               eos=_setting(self.plan.model, kwargs, "eos_token_id"), refill=True)
            embeds = kwargs.get("inputs_embeds")
            run.ids_given = embeds is None
            run.ids_beside_embeds = embeds is not None and isinstance(prompt, torch.Tensor) and prompt is not embeds
            mask = kwargs.get("attention_mask")
            run.attention_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
            pad = _setting(self.plan.model, kwargs, "pad_token_id")
            run.pad_id = int(torch.as_tensor(pad).reshape(-1)[0]) if pad is not None else None
            parameters = inspect.signature(self.plan.model.forward).parameters
            run.forward_inputs = {name: value for name, value in kwargs.items() if name in parameters
                                  and name not in _REFILLED and isinstance(value, torch.Tensor)}
            run.copy_logits = bool(_setting(self.plan.model, kwargs, "assistant_early_exit"))
            given = kwargs.get("position_ids")
            run.position_ids = given if isinstance(given, torch.Tensor) else None
            if whole is not None:
                run.replay_whole(whole)
            return run
        except Exception as error:  # noqa: BLE001 - never into the host's generate
            # ended when generate has run (_track): it may refuse its own arguments, which the record then says
            self._local.refused = self.unrecorded(request_id, "this generate call", error, ended=False)
            return NOT_RECORDED

    def _end(self, run: Recording, sequences: torch.Tensor | None, error: str | None = None) -> None:
        if isinstance(run, Run):
            run.finish(sequences, error)
