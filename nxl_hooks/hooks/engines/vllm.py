"""The engine for vLLM (V1 model runner; compiled, as vLLM chooses, or eager with ``nxl run --eager``): every
request a vLLM worker serves its own :class:`~nxl_hooks.GenerationCall`, one Step per generated token.

    nxl run --layers all --sink runs/ -- vllm serve ./model --logprobs-mode raw_logits
    nxl run -- python script.py            # a script that uses vllm.LLM

vLLM runs the model in a worker process (API server -> EngineCore -> Worker, separate processes even with one
worker), on its own model classes: no ``generate``, no transformers model. In the worker, once the model runner has
loaded its model, ``nxl run`` (:mod:`nxl_hooks.apps.serve.patches`) hands the process's controller a
:class:`VllmForCausalLM`: a transformers-shaped view of vLLM's model (its config, final norm and ``lm_head``
weights, shared, never copied) that :func:`~nxl_hooks.attach` makes its plan and head from, and that
:class:`VllmEngine` claims. The engine then follows the runner:

- ``execute_model`` (wrapped on the runner instance): new requests get their runs (the request id is the client's
  ``X-Request-ID``: vLLM's worker ids are ``chatcmpl-<id>-<8 hex>``; a response's own id under ``/v1/responses``:
  :func:`request_id`), requests vLLM says are finished end theirs;
  during the packed forward, forward hooks keep the embedding output and the residual stream after each selected
  decoder layer (``hidden + residual``: vLLM's layers return both and fuse the add into the next norm), and the
  logits of the rows vLLM samples from; after it, each request's rows (``input_batch.req_ids``,
  ``query_start_loc``, from the position the runner's ``positions`` buffer gives, with the token ids of its
  ``input_ids``: the inputs a full CUDA graph replays from, where no hook on the model runs) go to its run
  (:meth:`~nxl_hooks.hooks.generate.Run.feed`, as under continuous batching);
- ``sample_tokens``: each token the step gives a request (a prefill chunk that does not finish its prompt gives
  none) becomes that request's step record (:meth:`~nxl_hooks.hooks.generate.Run.emit`).

Chunked prefill: each chunk feeds its positions. Preemption: a resumed request recomputes from its first position
and its features are replaced from there. A request ends with the token that meets its stop rules (EOS, a stop
token id, max_tokens, the model length, repetition detection), checked in the worker as vLLM's scheduler checks
them. A request that leaves otherwise (the client went away, a stop string the API server matched, an abort; vLLM
tells the worker at its next step, not why) ends incomplete, with the steps it made and a reason saying so.

Compiled mode (vLLM's default, kept under ``nxl run``): hooks added after vLLM compiled its model never run. When
vLLM is to compile, the view puts hooks on vLLM's layers when the model is loaded, before vLLM compiles, that copy
the residual stream into fixed buffers (:class:`~.buffers.Buffers`, shared with transformers' continuous
batching); they are traced into the compiled model, and the engine reads each step's rows from the buffers after
the step. ``nxl run --eager`` (:data:`~nxl_hooks.hooks.generate.EAGER`) makes the engine eager instead
(``enforce_eager``): plain forward hooks then keep the selected layers only.

Not followed (requests run unchanged, each one's call record says ``not recorded: why; what to do``): a model
vLLM compiled without those buffers, prefix caching (a cached prefix never runs for the request that reuses it),
async scheduling, speculative decoding, pipeline or tensor parallelism, a streaming-input session's inputs after
its first, a LoRA adapter that changes ``lm_head`` (vLLM applies it to the logits; the view holds the base weight).
:func:`recording_engine_args` turns prefix caching and async scheduling off in the engine arguments while ``nxl
run`` records (and compilation, with ``nxl run --eager``). Model classes: vLLM's Llama, Mistral, Qwen2 and Qwen3
only (:data:`_FOLLOWED`); any other is not followed, its requests each saying so, as its layers, embedding or
logits may differ from what the view reads (Gemma 4's layers return ``(hidden, None)``, Granite scales its
embedding and logits); one without a final norm, layers and ``lm_head`` is said once when it loads.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from types import ModuleType
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from ...method.scores import row_norms
from ...records.view import Choice
from ..guard import Owned, described, logger, reason
from ..generate import EAGER, Generations, Run, eager
from .buffers import Buffers

__all__ = ["VllmEngine", "VllmForCausalLM", "WorkerRequest", "patch_engine_args", "recording_engine_args",
           "unfollowable", "unfollowable_compile", "worker_request"]

#: What makes a vLLM engine recordable, said with each reason it is not.
_RECORDABLE = ("start it under nxl run, which turns prefix caching and async scheduling off and puts its capture "
               "into the model before vLLM compiles it, or pass --no-enable-prefix-caching --no-async-scheduling "
               "yourself")

#: vLLM's request ids in the worker: a sample's index of a request with ``n`` > 1 (``2_``: parallel sampling's
#: children, read before the API's prefix or vLLM's own numbers only, so that a client's ``2024_run`` stays whole),
#: the API's prefix (``cmpl-`` adds the prompt's index after the id), the client's X-Request-ID (or vLLM's own
#: id), a random suffix the engine adds. ``/v1/responses`` ignores X-Request-ID: its id is the response's
#: (``resp_<hex>``, the reply's ``id``), each turn's request adding ``_<turn>``, dropped. (``/v1/chat/completions/
#: batch`` adds ``_<conversation>`` to a chat id: kept, as a chat client's own ``job_7`` cannot be told from it.)
_WORKER_ID = re.compile(r"^(?:(?P<sample>\d{1,9})_(?=chatcmpl-|cmpl-|\d+-[0-9a-f]{8}$))?"
                        r"(?:chatcmpl-(?P<chat>.+)|cmpl-(?P<completion>.+)-(?P<prompt>\d{1,9})"
                        r"|(?P<response>resp_.+)_\d+|(?P<id>.+))-[0-9a-f]{8}$", re.DOTALL)

#: Why a request is not recorded that this probe first saw after it started (``nxl ctl resume``, ``nxl attach``).
_BEFORE = "it started before the probe attached, so its first positions were never seen"

#: A step of vLLM's beam search, each beam's next token a request of its own (max_tokens 1): the API's prefix, the
#: client's id, a random 16-hex id per step and the beam's index, the engine's suffix. A completion's beam search is
#: named by the request's id alone, without the prompt's index its other requests carry (vLLM's completion serving).
_BEAM = re.compile(r"^(?:chatcmpl-|cmpl-)?(?P<id>.+)-[0-9a-f]{16}-beam-\d+-[0-9a-f]{8}$", re.DOTALL)


class WorkerRequest(NamedTuple):
    """What a vLLM worker's request id says: the client's request id, and where the reply puts what the request
    generates (None for a beam-search step, a token of one beam)."""

    request_id: str
    choice: Choice | None


def worker_request(worker_id: str) -> WorkerRequest:
    """The client's request in a vLLM worker's request id: ``worker_request("chatcmpl-r1-0123abcd") == ("r1",
    Choice(None, 0))``, ``worker_request("cmpl-r1-2-0123abcd") == ("r1", Choice(2, 0))`` (each prompt of a completion
    request is its own call, as each sample of one with ``n`` > 1: ``worker_request("1_chatcmpl-r1-0123abcd") ==
    ("r1", Choice(None, 1))``), each beam-search step ``worker_request("cmpl-r1-85d3d8d25a5c2b0d-beam-1-0123abcd")
    == ("r1", None)``; a response's turn, its response's id: ``worker_request("resp_3f2a_0-0123abcd") ==
    ("resp_3f2a", Choice(None, 0))``; an id given to vLLM's engine itself, ``("mine", None)`` (its samples are
    ``0_mine``, ``1_mine``, ...). Indices are at most 9 digits (records keep int32): more is part of the id."""
    beam = _BEAM.match(worker_id)
    if beam is not None:
        return WorkerRequest(beam.group("id"), None)
    match = _WORKER_ID.match(worker_id)
    if match is None:  # not vLLM's shape: nothing known of its choice
        return WorkerRequest(worker_id, None)
    found = match.groupdict()
    client = next(found[name] for name in ("chat", "completion", "response", "id") if found[name] is not None)
    if found["id"] is not None and found["sample"] is None and not client.isdigit():
        return WorkerRequest(client, None)  # an id given to vLLM's engine itself: its samples are ids of their own
    prompt = found["prompt"]
    return WorkerRequest(client, Choice(None if prompt is None else int(prompt), int(found["sample"] or 0)))


# -- what nxl run changes in the engine arguments -----------------------------------------------------------

#: EngineArgs field -> (value while recording, what the status says about it)
_SETTINGS = {"enable_prefix_caching": (False, "prefix caching off (a cached prefix never runs for the request "
                                              "that reuses it, so it would have no features)"),
             "enforce_eager": (True, f"compile and CUDA graphs off: enforce_eager (asked for: {EAGER}=1, nxl run "
                                     "--eager)"),
             "async_scheduling": (False, "async scheduling off (each step's tokens are read before the next step)")}


#: vLLM's choice of model runner: its V2 runner (vLLM's own choice wherever Triton is, so on every CUDA install,
#: since 0.25) is not followed (:func:`_refusal`), so recording asks for the V1 runner unless the user chose.
_V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"
#: The module defining that V2 runner (CPU's V2 runner subclasses its class).
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"


def recording_engine_args(args: Any) -> list[str]:
    """Set on vLLM's ``EngineArgs`` ``args`` what recording needs (:data:`_SETTINGS`; compilation stays as asked
    unless :data:`~nxl_hooks.hooks.generate.EAGER` asks for eager calls), and :data:`_V2_RUNNER` to 0 in this
    process's environment unless it is set (vLLM reads it where it picks the runner: in the engine's processes,
    which inherit it, started after this); returns what was changed, as status lines. A field ``args`` lacks is
    left alone."""
    changed = []
    keep_compiled = not eager()
    for name, (value, said) in _SETTINGS.items():
        if name == "enforce_eager" and keep_compiled:
            continue
        if hasattr(args, name) and getattr(args, name) != value:
            setattr(args, name, value)
            changed.append(said)
    # (HiSparse attention needs the V2 runner: vLLM refuses to start it with V1, so it is left to say not recorded)
    needs_v2 = getattr(getattr(args, "attention_config", None), "hisparse_config", None) is not None
    if not os.environ.get(_V2_RUNNER) and not needs_v2:
        os.environ[_V2_RUNNER] = "0"
        changed.append(f"vLLM's V2 model runner off: {_V2_RUNNER}=0 (nxl_hooks follows the V1 model runner)")
    return changed


def patch_engine_args(module: ModuleType) -> None:
    """Wrap ``EngineArgs.create_engine_config`` of ``vllm.engine.arg_utils`` so that every engine vLLM makes is one
    the probe can follow (:func:`recording_engine_args`); logs what it changed, once per engine. ``nxl run``
    applies it in every process it starts (:data:`~nxl_hooks.apps.serve.lazy.HOOKS`). Applied once (a marker on
    the wrapper); never raises into vLLM."""
    cls = getattr(module, "EngineArgs", None)
    original = getattr(cls, "create_engine_config", None)
    if original is None or getattr(original, "__nxl_patched__", False):
        if original is None:
            reason("vLLM's engine arguments", RuntimeError("this vLLM has no EngineArgs.create_engine_config; its "
                                                           "engines are made as asked"))
        return

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            changed = recording_engine_args(self)
            if changed:
                logger.warning("nxl_hooks: recording this vLLM engine: %s", "; ".join(changed))
        except Exception as error:  # noqa: BLE001 - the engine is made as asked; the worker says why not recorded
            reason("vLLM's engine arguments", error)
        return original(self, *args, **kwargs)

    create_engine_config.__wrapped__ = original
    create_engine_config.__nxl_patched__ = True
    cls.create_engine_config = create_engine_config


def unfollowable_compile(config: Any) -> str | None:
    """Why vLLM's compiled model (``config``: a ``VllmConfig``) cannot be followed, or None when it runs eagerly."""
    from vllm.config import CompilationMode, CUDAGraphMode

    compilation = config.compilation_config
    if compilation.mode != CompilationMode.NONE or compilation.cudagraph_mode != CUDAGraphMode.NONE:
        return ("vLLM compiled the model (torch.compile or CUDA graphs), and hooks added after it compiled never "
                f"run; {_RECORDABLE}")
    return None


def unfollowable(config: Any) -> str | None:
    """Why the engine of ``config`` (a ``VllmConfig``) cannot be followed, or None."""

    cache, parallel, scheduler = config.cache_config, config.parallel_config, config.scheduler_config
    if cache.enable_prefix_caching:
        return f"prefix caching is on: a cached prefix never runs for the request that reuses it; {_RECORDABLE}"
    if getattr(scheduler, "async_scheduling", False):
        return f"async scheduling is on: a step's tokens are not known when the next step runs; {_RECORDABLE}"
    if config.speculative_config is not None:
        return "speculative decoding runs several candidate tokens per request and step; serve without it"
    if parallel.pipeline_parallel_size > 1 or parallel.tensor_parallel_size > 1:
        return "tensor or pipeline parallelism splits the model over several workers; serve on one worker"
    if getattr(config.model_config, "enable_prompt_embeds", False):
        return ("prompt embeddings are enabled (--enable-prompt-embeds): vLLM then runs every request from "
                "embeddings, and a step's token ids and embedding rows are not where nxl_hooks reads them; serve "
                "without it")
    return None


# -- the transformers-shaped view of vLLM's model ------------------------------------------------------------


class _RmsNorm(nn.Module):
    """The final RMS norm of vLLM's model, as transformers computes it (float32 inside), on vLLM's own weight."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden.to(dtype)


def _buffers(runner: Any, model: nn.Module) -> Buffers:
    """Where a compiled vLLM model writes its residual stream, step after step: (layers + 1, max tokens, d), row t of
    layer l the stream after block l at the step's packed token t (layer 0: the embedding output). The hooks are put
    on vLLM's modules before vLLM compiles, so they are traced into the compiled model (:class:`~.buffers.Buffers`);
    the engine reads each step's rows after it. They stay on the model as long as it lives: compiled code cannot
    drop them."""
    inner = model.model
    weight = inner.embed_tokens.weight
    buffers = Buffers(len(inner.layers) + 1, int(runner.max_num_tokens), weight.shape[1:], dtype=weight.dtype,
                      device=weight.device)
    buffers.tap(0, inner.embed_tokens, lambda output: output)
    for index, layer in enumerate(inner.layers, start=1):
        buffers.tap(index, layer, lambda output: output[0] + output[1])  # layers return (hidden, residual)
    return buffers


#: vLLM's model classes the view follows (module, class): an unscaled embedding lookup, decoder layers that return
#: ``(hidden, residual)`` (the stream after the block is their sum), an RMS final norm, logits that ``lm_head`` gives
#: unscaled and uncapped. A class is matched exactly: a subclass, or a class of the same shape, may differ in any of
#: these and be recorded wrong (Granite's multipliers) or break vLLM's forward (Gemma 4's ``(hidden, None)``).
_FOLLOWED = {("vllm.model_executor.models.llama", "LlamaForCausalLM"): "Llama",
            ("vllm.model_executor.models.mistral", "MistralForCausalLM"): "Mistral",
            ("vllm.model_executor.models.qwen2", "Qwen2ForCausalLM"): "Qwen2",
            ("vllm.model_executor.models.qwen3", "Qwen3ForCausalLM"): "Qwen3"}


def _refusal(runner: Any, model: nn.Module) -> str | None:
    """Why the view cannot follow vLLM's ``model``, loaded by ``runner``, or None."""
    if any(base.__module__ == V2_RUNNER_MODULE for base in type(runner).__mro__):
        return (f"vLLM's V2 model runner is not followed, so vLLM serves unrecorded: set {_V2_RUNNER}=0 (nxl run "
                "sets it unless it is set; a vLLM feature that needs the V2 runner cannot be recorded)")
    cls = type(model)
    if (cls.__module__, cls.__qualname__) not in _FOLLOWED:
        return (f"vLLM's {cls.__name__} is not a model class nxl_hooks follows in vLLM (it follows "
                f"{', '.join(_FOLLOWED.values())}), so vLLM serves it unrecorded")
    logits = getattr(model, "logits_processor", None)
    if getattr(logits, "scale", 1.0) != 1.0 or getattr(logits, "soft_cap", None) is not None:
        return (f"vLLM's {cls.__name__} scales or caps its logits (logit_scale, soft_cap in its config), which "
                "nxl_hooks does not follow in vLLM, so vLLM serves it unrecorded")
    return None


class VllmForCausalLM(nn.Module):
    """vLLM's model as :func:`~nxl_hooks.attach` reads a transformers causal LM: its config, ``model.norm`` and
    ``lm_head`` (vLLM's weights, shared), ``model.layers`` (one placeholder per decoder layer: the hooks go on
    vLLM's own modules, through :class:`VllmEngine`). ``VllmForCausalLM(runner)``; ``refused``: why vLLM's model
    is not one this view follows (:data:`_FOLLOWED`), its requests each saying so; ValueError when it has no parts
    the view can be made of."""

    base_model_prefix = "model"

    def __init__(self, runner: Any) -> None:
        super().__init__()
        model = runner.get_model()
        #: why vLLM's model is not followed, or None: the engine then marks each request not recorded, with it
        self.refused = _refusal(runner, model)
        inner = getattr(model, "model", None)
        norm, layers = getattr(inner, "norm", None), getattr(inner, "layers", None)
        head = getattr(model, "lm_head", None)
        if getattr(norm, "weight", None) is None or getattr(head, "weight", None) is None or layers is None:
            raise ValueError(self.refused or f"vLLM's {type(model).__name__} has no final norm, layers or lm_head "
                                             "that nxl_hooks can read, so vLLM serves it unrecorded")
        # vLLM's model is a submodule of the view: the hooks the engine puts on it count as the probe's (status)
        self.runner, self.vllm_model = runner, model
        #: the compiled model's buffers, made now, before vLLM compiles (None: vLLM runs it eagerly)
        self.buffers = (_buffers(runner, model) if self.refused is None  # no tap on a model it cannot read
                        and unfollowable_compile(runner.vllm_config) is not None else None)
        self.config = model.config
        #: what records call the model (:func:`~nxl_hooks.hooks.plan.model_name`): the folder or hub id vLLM loaded,
        #: as a transformers model's ``name_or_path``, not this view's class
        self.name_or_path = str(runner.vllm_config.model_config.model)
        #: where vLLM's tokenizer comes from (``--tokenizer``; vLLM's default: the model's own folder or hub id): the
        #: one the records' token texts are read with
        self.tokenizer_name_or_path = str(runner.vllm_config.model_config.tokenizer or self.name_or_path)
        #: ... at the revision vLLM reads it at (``--tokenizer-revision``, else the model's ``--revision``; None: main)
        self.tokenizer_revision = getattr(runner.vllm_config.model_config, "tokenizer_revision", None)
        vocab, hidden = int(self.config.vocab_size), int(self.config.hidden_size)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Identity() for _ in range(len(layers)))
        self.model.embed_tokens = nn.Embedding(vocab, hidden, device="meta")  # its size only
        self.model.norm = _RmsNorm(norm.weight, float(getattr(norm, "variance_epsilon", 1e-6)))  # (refused: unused)
        self.lm_head = nn.Linear(hidden, vocab, bias=False, device="meta")
        weight = head.weight  # vLLM pads its vocabulary rows: the first vocab_size are the model's
        self.lm_head.weight = weight if weight.shape[0] == vocab else nn.Parameter(weight[:vocab], requires_grad=False)

    @property
    def base_model(self) -> nn.Module:
        return self.model

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype vLLM computes in (its ``--dtype``; its CPU build's default, bfloat16, for a float32 checkpoint),
        as a transformers model's ``dtype``: what a record's meta says made its numbers (None where vLLM says none)."""
        dtype = getattr(self.runner.vllm_config.model_config, "dtype", None)
        return dtype if isinstance(dtype, torch.dtype) else None

    @property
    def engine(self) -> str:
        """What recording depends on in this vLLM engine, in one line (``nxl ctl status`` shows it)."""
        import vllm

        config = self.runner.vllm_config
        compilation = config.compilation_config
        # (a model the view refuses is compiled without buffers: compiled all the same, and not recorded)
        compiled = "off (enforce_eager)" if unfollowable_compile(config) is None else (
            f"on ({compilation.mode.name}, CUDA graphs {compilation.cudagraph_mode.name}), "
            + ("recorded through buffers compiled into the model" if self.buffers is not None else "not recorded"))
        prefix = "on: not recorded" if config.cache_config.enable_prefix_caching else "off"
        return (f"vLLM {vllm.__version__} ({type(self.runner).__name__}): prefix caching {prefix}, compile and CUDA "
                f"graphs {compiled}")

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Not callable: vLLM generates, its worker is followed by :class:`VllmEngine`."""
        raise TypeError("this is vLLM's model as nxl_hooks sees it: generate through vLLM")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("this is vLLM's model as nxl_hooks sees it: run it through vLLM")


# -- following the runner -------------------------------------------------------------------------------------


class _Capture:
    """What the hooks keep of one packed forward."""

    def __init__(self) -> None:
        self.embed_norm: torch.Tensor | None = None
        self.hidden: dict[int, torch.Tensor] = {}
        self.logits: torch.Tensor | None = None
        self.error: Exception | None = None  # what a hook on vLLM's model failed with, kept for the step's requests


class VllmEngine:
    """The :class:`~nxl_hooks.hooks.engines.Engine` of a vLLM worker's model runner, for one probe of a
    :class:`VllmForCausalLM`: the runs of the requests the runner serves. ``unfollowed``: why the runner cannot be
    followed (its requests are then marked not recorded), or None."""

    name = "vllm"

    def __init__(self) -> None:
        self.unfollowed: str | None = None
        self._lock = threading.Lock()
        self._handles: list[Any] = []
        self._restore: list[tuple[Any, str]] = []
        self._runs: dict[str, Run | None] = {}  # worker request id -> its run (None: not recorded)
        self._tokens: dict[str, list[int]] = {}  # worker request id -> prompt and generated ids
        self._capture: _Capture | None = None  # set while a step's forward runs
        self._fed: dict[str, Run] = {}  # requests whose rows the last forward fed, awaiting their token
        self._layers: torch.Tensor | None = None  # the selected layers' rows of the view's buffers, when not all
        self._told = False
        self._adapters: dict[tuple[int, str], str | None] = {}  # (LoRA id, path) -> why not recorded, or None

    def claims(self, model: nn.Module) -> bool:
        return isinstance(model, VllmForCausalLM)

    def install(self, gens: Generations) -> None:
        self.gens, self.plan = gens, gens.plan
        shell: VllmForCausalLM = gens.plan.model
        runner = shell.runner
        if shell.buffers is not None:  # the selected rows of the buffers (None: all of them, read as they are)
            every = list(range(shell.buffers.values.shape[0]))
            self._layers = (None if list(self.plan.layers) == every else
                            torch.tensor(self.plan.layers, device=shell.buffers.values.device))
        try:
            self.unfollowed = shell.refused or unfollowable(runner.vllm_config)
            if self.unfollowed is None and shell.buffers is None:
                self.unfollowed = unfollowable_compile(runner.vllm_config)
        except Exception as error:  # noqa: BLE001 - a vLLM whose config this does not know
            self.unfollowed = f"this vLLM's configuration is not one nxl_hooks knows ({reason('vLLM', error)})"
        with self._lock:
            self._wrap(runner, "execute_model", self._execute_model)
            self._wrap(runner, "sample_tokens", self._sample_tokens)
            if self.unfollowed is None:
                self._hook(shell)

    def _wrap(self, runner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(runner, name)
        wrapper = make(original)
        wrapper.__nxl_hook__ = True
        setattr(runner, name, wrapper)  # an instance attribute: the class, and other runners, are untouched
        self._restore.append((runner, name))

    def _hook(self, shell: VllmForCausalLM) -> None:
        """The logits (computed outside the model: never compiled nor replayed) always; the layers through hooks of
        this probe on an eager model, through the view's buffers on a compiled one. Each :class:`~..guard.Owned`, as
        every hook of the probe's: a copy of the model takes none along."""
        model, wanted = shell.vllm_model, set(self.plan.layers)
        inner = model.model
        self._handles.append(model.logits_processor.register_forward_hook(Owned(self._on_logits)))
        if shell.buffers is not None:
            return
        self._handles.append(inner.embed_tokens.register_forward_hook(Owned(self._kept(self._keep_embedding))))
        for index, layer in enumerate(inner.layers, start=1):
            if index in wanted:
                self._handles.append(layer.register_forward_hook(Owned(self._kept(functools.partial(
                    self._keep_layer, index)))))

    def uninstall(self) -> None:
        """Hooks and wrappers off; the requests in flight end incomplete (among them one that a stop string ended
        last: with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` vLLM runs no further step to tell the worker)."""
        with self._lock:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            while self._restore:
                runner, name = self._restore.pop()
                vars(runner).pop(name, None)
            runs = [run for run in self._runs.values() if run is not None]
            self._runs.clear()
            self._tokens.clear()
            self._fed.clear()
            self._capture = None
        for run in runs:  # (vLLM tells its worker at the next step that a request left: none may come before exit)
            run.finish(None, "recording stopped before vLLM told its worker that this request ended (detached, "
                             "paused, re-attached, or the program ended first: a request that a stop string, an abort "
                             "or the client ended is told at vLLM's next step)", what="this request")

    def stray(self, arguments: dict[str, Any]) -> str | None:
        return None  # the view's own forward never runs: vLLM calls its own model

    # -- the hooks, in the worker's thread, only inside a followed step -----------------------------------

    def _kept(self, keep: Callable[[_Capture, Any], None]) -> Callable:
        """A forward hook that gives ``keep`` the running step's capture and the module's output. Never raises into
        vLLM's forward: what fails is kept, and the step's requests stop recording with it (:meth:`_feed`)."""
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            capture = self._capture
            if capture is None or capture.error is not None:
                return
            try:
                keep(capture, output)
            except Exception as error:  # noqa: BLE001
                capture.error = error

        return hook

    def _keep_embedding(self, capture: _Capture, output: torch.Tensor) -> None:
        capture.embed_norm = row_norms(output)
        if 0 in self.plan.layers:  # a copy: the next layer's fused add-norm updates its residual input in place
            capture.hidden[0] = output.clone()

    @staticmethod
    def _keep_layer(index: int, capture: _Capture, output: Any) -> None:
        hidden, residual = output
        capture.hidden[index] = hidden + residual  # the residual stream: a new tensor, safe from in-place adds

    def _on_logits(self, module: nn.Module, args: tuple, output: Any) -> None:
        capture = self._capture
        if capture is not None and isinstance(output, torch.Tensor):
            capture.logits = output

    # -- the runner's steps ---------------------------------------------------------------------------------

    def _execute_model(self, original: Callable) -> Callable:
        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._begin_step(scheduler_output)
            self._capture = _Capture() if self.unfollowed is None else None
            try:
                return original(scheduler_output, *args, **kwargs)
            finally:
                capture, self._capture = self._capture, None
                if capture is not None and capture.logits is not None:  # the step ran the model (it had tokens)
                    self._feed(capture)

        return execute_model

    def _sample_tokens(self, original: Callable) -> Callable:
        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            fed, self._fed = self._fed, {}
            if fed:
                self._emit(output, fed)
            return output

        return sample_tokens

    def _begin_step(self, scheduler_output: Any) -> None:
        """Runs end for the requests vLLM finished; new requests get theirs. Never raises."""
        try:
            for worker_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
                self._end(worker_id)
            for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
                self._start(new)
        except Exception as error:  # noqa: BLE001 - never into vLLM's loop
            reason("vLLM's scheduled requests", error)

    def _start(self, new: Any) -> None:
        worker_id = str(new.req_id)
        named = worker_request(worker_id)
        prompt = list(new.prompt_token_ids or ())
        try:
            if self.unfollowed is not None:
                raise RuntimeError(self.unfollowed)
            if not prompt:
                raise RuntimeError("this request came as embeddings, not token ids")
            adapter = getattr(new, "lora_request", None)
            if adapter is not None:
                self._check_adapter(adapter)
            if int(getattr(new, "num_computed_tokens", 0) or 0) > 0:
                # (the runner still holds the state of a streaming-input session's request: read before its step)
                if worker_id in getattr(self.gens.plan.model.runner, "requests", ()):
                    raise RuntimeError(
                        "it is a later input of a streaming-input session (an input stream given to vLLM's "
                        f"AsyncLLM.generate, the realtime API), whose first {new.num_computed_tokens} positions ran "
                        "for its earlier inputs: the session's first input is recorded, a call of its own under the "
                        "same id, its later ones are not; send each input as a request of its own")
                raise RuntimeError(f"its first {new.num_computed_tokens} positions came from vLLM's prefix cache and "
                                   f"never ran for it; {_RECORDABLE}")
            run = self._runs[worker_id] = self.gens.new_run(request_id=named.request_id, choice=named.choice,
                                                             prompt_len=len(prompt), eos=None, wait=0, engine=True)
            if _BEAM.match(worker_id):  # the call is one token of one beam, not the client's whole reply
                run.call.notes.append("a beam-search step: vLLM runs each beam's next token as a request of its "
                                      "own (max_tokens 1), under the client's id")
            self._tokens[worker_id] = prompt
        except Exception as error:  # noqa: BLE001
            self._runs[worker_id] = None
            self._unrecorded(worker_id, error, log=not self._told)
            self._told = True

    def _check_adapter(self, adapter: Any) -> None:
        """Raises why a request served with the LoRA adapter ``adapter`` (vLLM's ``LoRARequest``) cannot be recorded:
        one whose ``lm_head`` vLLM applies when it computes the logits (its LoRA logits processor), so that every
        layer's score, made with the base ``lm_head`` the view holds, would not be the served model's. The adapter's
        other modules (attention, MLP, embeddings) run inside the layers and embedding the hooks read, and are
        recorded. Read as vLLM's worker reads it (on the CPU), once per adapter."""
        runner = self.gens.plan.model.runner
        if type(self.gens.plan.model.vllm_model.logits_processor).__name__ != "LogitsProcessorWithLoRA":
            return  # vLLM applies no adapter's lm_head: served with the base weight the view holds
        key = (adapter.lora_int_id, adapter.lora_path)
        if key not in self._adapters:
            try:
                modules = runner.lora_manager._load_adapter(adapter).loras
                self._adapters[key] = None if not any("lm_head" in name.split(".") for name in modules) else (
                    f"its LoRA adapter {adapter.lora_name!r} changes lm_head, which vLLM applies to its logits and the "
                    "head nxl_hooks scores with does not hold (the base weight); serve the adapter without lm_head, or "
                    "merged into the model")
            except Exception as error:  # noqa: BLE001 - vLLM says its own failure to load it, if any
                self._adapters[key] = (f"its LoRA adapter {adapter.lora_name!r} could not be read "
                                       f"({described(error)}), so whether it changes lm_head, "
                                       "which the head nxl_hooks scores with does not hold, is unknown")
        if self._adapters[key] is not None:
            raise RuntimeError(self._adapters[key])

    def _end(self, worker_id: str, *, stopped: bool = False) -> None:
        """The request left the worker: ``stopped`` by its own stop rules (its call is complete), or otherwise (vLLM
        told the worker at a later step: its call keeps the steps it made and says it ended early). One vLLM says
        finished that this worker never scheduled (aborted while it waited in vLLM's queue) is a call saying so."""
        if worker_id not in self._runs:
            self._unseen(worker_id)
            return
        run, tokens = self._runs.pop(worker_id), self._tokens.pop(worker_id, None)
        if stopped:  # vLLM says it finished at its next step: not then a request this worker never saw
            self._runs[worker_id] = None
        if run is None:
            return
        if tokens is None or run.call.prompt_mask is None:
            run.finish(None, "the request left vLLM before its prompt was processed (aborted)", what="this request")
        else:
            run.finish(torch.tensor([tokens], dtype=torch.long), None if stopped else self._left(worker_id),
                       what="this request")

    def _unseen(self, worker_id: str) -> None:
        """A call record for a request vLLM finished that this probe never saw scheduled and its runner never held:
        it left vLLM's queue before any of it ran (a client that went away, an abort), and had no record at all. One
        the runner holds ran before the probe attached and none of it since: no record here, as before (after a
        pause, the probe before this one has its record, which ``nxl ctl`` would then find under a newer one saying
        it was not recorded). Never raises (inside :meth:`_begin_step`)."""
        if worker_id in getattr(self.gens.plan.model.runner, "requests", ()):
            return
        self._unrecorded(worker_id, RuntimeError(
            "it left vLLM before any of it ran (aborted, or its client went away, while it waited in vLLM's queue)"))

    def _unrecorded(self, worker_id: str, error: BaseException, *, log: bool = False) -> None:
        """The call record of a request that is not recorded (``error`` says why), under its client's id and
        choice."""
        named = worker_request(worker_id)
        self.gens.unrecorded(named.request_id, "this vLLM request", error, log=log, choice=named.choice)

    def _left(self, worker_id: str) -> str:
        """Why the call of a request that left otherwise than by its stop rules ends incomplete. One with stop strings
        says that its last steps may be past the reply: vLLM matches them on the text it returns, outside the worker,
        and tells the worker a step or more later (read before the runner's step drops the request's state)."""
        why = ("the request left vLLM before its EOS, stop token or max_tokens (the client went away, the API server "
               "matched a stop string, or it was aborted): its steps up to then are recorded")
        state = getattr(self.gens.plan.model.runner, "requests", {}).get(worker_id)
        if getattr(getattr(state, "sampling_params", None), "stop", None):
            why += (", the last of them possibly after the reply's last token (it has stop strings, which vLLM "
                    "matches outside its worker and tells the worker of a step or more later)")
        return why

    def _stops(self, worker_id: str, token: int) -> bool:
        """Whether ``token`` ends the request, by the engine's own stop rules, in the order vLLM's scheduler checks
        them (``check_stop``: its EOS or stop token ids, its max_tokens, the model length, then past min_tokens its
        repetition detection): then its call ends now, not when vLLM tells the worker at its next step. (Stop
        strings and aborts are the API server's: those requests end at that next step.)"""
        runner = self.gens.plan.model.runner
        state = runner.requests.get(worker_id)
        params = getattr(state, "sampling_params", None)
        if params is None:
            return False
        tokens = self._tokens[worker_id]
        generated = len(tokens) - len(state.prompt_token_ids or ())
        if (token == params.eos_token_id or token in (params.stop_token_ids or ())
                or generated >= (params.max_tokens or float("inf"))
                or len(tokens) >= runner.vllm_config.model_config.max_model_len):
            return True
        detection = getattr(params, "repetition_detection", None)
        if detection is None or generated < (params.min_tokens or 0):
            return False
        from vllm.v1.core.sched.utils import check_sequence_repetition

        return check_sequence_repetition(tokens[len(tokens) - generated:], detection)

    def _feed(self, capture: _Capture) -> None:
        """Each request's rows of the forward into its run; the logits of the rows vLLM samples from become the
        probability of the token it samples. Never raises."""
        step: list[str] | None = None  # this step's requests, once known
        try:
            runner = self.gens.plan.model.runner
            batch = runner.input_batch
            count = batch.num_reqs
            step = list(batch.req_ids[:count])
            if capture.error is not None:
                raise RuntimeError(f"a hook on vLLM's model failed ({capture.error})")
            starts = [int(s) for s in runner.query_start_loc.np[: count + 1]]
            discard = runner.discard_request_mask.np[:count].tolist()
            # the step's token ids and positions where vLLM puts them for its forward: no hook on the model sees them
            # in a step replayed from a full CUDA graph (no Python runs in the model), which replays from these
            positions = runner.positions
            firsts = positions[torch.tensor(starts[:-1], device=positions.device)].tolist()
            total = starts[-1]
            buffers = self.gens.plan.model.buffers
            if buffers is not None:  # the compiled model wrote this step's rows there: every layer in one read
                rows = buffers.values.narrow(1, 0, total)
                capture.embed_norm = row_norms(rows[0])
                hidden = (rows if self._layers is None else rows.index_select(0, self._layers)).transpose(0, 1)
            else:
                hidden = torch.stack([capture.hidden[layer][:total] for layer in self.plan.layers], dim=1)
            features = self.plan.head.features(hidden)[None]  # (1, tokens, layers, d')
            embed = capture.embed_norm[None, :total]
            mask = torch.ones_like(embed, dtype=torch.bool)
            ids = runner.input_ids.gpu[None, :total].long()
            log_probs = capture.logits.float().log_softmax(-1)
        except Exception as error:  # noqa: BLE001 - this step's requests stop recording
            for worker_id in step if step is not None else list(self._runs):
                run = self._runs.get(worker_id)
                if run is not None and not run.failed:
                    run.fail("this vLLM step", error)
            return
        for index, worker_id in enumerate(step):
            if worker_id not in self._runs:  # it started before this probe attached (nxl ctl resume / attach)
                self._runs[worker_id] = None
                self._unrecorded(worker_id, RuntimeError(_BEFORE))
            run = self._runs.get(worker_id)
            if run is None or run.failed:
                continue
            try:
                window = slice(starts[index], starts[index + 1])
                run.feed(int(firsts[index]), features[:, window], embed[:, window], mask[:, window], ids[:, window])
                if not discard[index]:
                    run.predicted(log_probs[index: index + 1])
                    self._fed[worker_id] = run
            except Exception as error:  # noqa: BLE001 - one request's failure is that request's alone
                run.fail("this vLLM request", error)

    def _emit(self, output: Any, fed: dict[str, Run]) -> None:
        """The token each fed request got from this step: its step record. Never raises."""
        try:
            ids, sampled = list(output.req_ids), output.sampled_token_ids
        except Exception as error:  # noqa: BLE001 - an output this does not know (async): not recorded
            for run in fed.values():
                run.fail("this vLLM step", RuntimeError(f"its sampled tokens could not be read ({error})"))
            return
        for worker_id, tokens in zip(ids, sampled):
            run = fed.pop(worker_id, None)
            if run is None or not len(tokens):
                continue
            try:
                if len(tokens) != 1:
                    raise RuntimeError(f"vLLM gave this request {len(tokens)} tokens in one step (speculative "
                                       "decoding), which nxl_hooks does not follow")
                token = int(tokens[0])
                run.emit(token)
                self._tokens[worker_id].append(token)
                if self._stops(worker_id, token):
                    self._end(worker_id, stopped=True)
            except Exception as error:  # noqa: BLE001
                run.fail("this vLLM request", error)
        for run in fed.values():
            run.fail("this vLLM request", RuntimeError("vLLM sampled no token for it after a forward that finished "
                                                       "its prompt"))


#: This module's engine (:func:`nxl_hooks.hooks.engines.builtin_engines` finds it).
ENGINE = VllmEngine
