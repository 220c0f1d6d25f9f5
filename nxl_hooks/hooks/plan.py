"""What one :func:`~nxl_hooks.attach` call explains, fixed and checked when it attaches: the model's spec and head,
the layers, the targets, the embedding norm, and the tokenizer facts the rules need. Shared, read-only, by every
forward and generate call the probe records, in any thread.

    plan = make_plan(model, layers="all", target="predicted", tokenizer=tok, embedding="layer_input")  # or a Subject
    examples, positions = plan.rows(input_ids, attention_mask, shape=(batch, seq))
    check_recording(plan, on_step=None, sink="run.nxl", keep_calls=None, cache_dtype=None, cache_device=None)
    restore = run_eagerly(model)          # a torch.compile'd model runs its hooked Python modules while attached
"""

from __future__ import annotations

import copy
import functools
import os
import threading
import weakref
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..arch.calls import unbound
from ..arch.registry import ArchSpec, HeadKind, word_embedding
from ..arch.text import one_line
from ..arch.version import versions
from ..method import scores as _scores
from ..method.chat import locate_template
from ..method.head import Head
from ..method.placement import quantization
from ..method.protocol import Checked, Given, Method, TargetChecked
from ..method.registry import resolve_methods
from ..method.subject import Subject, compiled_original, unwrap
from ..records.sinks import sink_factory
from ..records.tokens import clean_up_spaces, continuation, readable_ids, record_text, separator
from ..method.select import (
    EMBEDDINGS,
    VIRTUAL_ID,
    Target,
    explained,
    from_numpy,
    parse_embedding,
    is_predicted,
    pad_token_id,
    prediction_rows,
    resolve_layers,
    special_ids,
    special_mask,
    target_ids,
)

__all__ = ["EMBEDDINGS", "Plan", "Scoring", "TokenTexts", "check_recording", "made_by", "make_plan", "model_name",
           "run_eagerly", "token_texts", "tokenizer_mismatch", "virtual_name"]

_KEPT = "_nxl_hooks_compiled_"  # where run_eagerly keeps a module's compiled callable while attached

_READABLE_KEPT = 1 << 18  # token texts a plan remembers at most (more than most vocabularies)


def virtual_name(index: int) -> str:
    """How the ``index``-th virtual token of a row is shown, as its token and its readable text."""
    return f"[virtual {index}]"


class TokenTexts:
    """The readable text of a tokenizer's token ids (:func:`~nxl_hooks.records.tokens.readable_ids`), remembered
    per id: a generation step asks for one per emitted token, and a token's text does not depend on its context.
    One per tokenizer (:func:`token_texts`), shared by every plan and by ``nxl run``'s live view, in any thread.

        token_texts(tok)([504, 7042])     # ['The', '␣Paris']
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._known: dict[int, str] = {}  # read and added to by every thread, never cleared

    def __call__(self, ids: list[int]) -> list[str]:
        known = self._known
        found = {i: known.get(i) for i in ids}
        missing = [i for i, text in found.items() if text is None]
        if missing:
            texts = dict(zip(missing, readable_ids(self.tokenizer, missing)))
            found.update(texts)
            if len(known) < _READABLE_KEPT:
                known.update(texts)
        return [found[i] for i in ids]


_TEXTS: weakref.WeakValueDictionary[int, TokenTexts] = weakref.WeakValueDictionary()  # id(tokenizer) -> its texts
_TEXTS_LOCK = threading.Lock()


def token_texts(tokenizer: Any) -> TokenTexts:
    """The one :class:`TokenTexts` of ``tokenizer`` while anything holds it (it holds the tokenizer, so the id is
    not reused meanwhile)."""
    with _TEXTS_LOCK:
        texts = _TEXTS.get(id(tokenizer))
        if texts is None:
            texts = _TEXTS[id(tokenizer)] = TokenTexts(tokenizer)
        return texts


@dataclass(frozen=True, eq=False)
class Scoring:
    """What making a step's records reads of its :class:`Plan` (``plan.scoring``), without the model: the record
    pipeline holds this, not the plan, once a call has returned, so a model the program drops then is not kept alive
    while the call's last records are still being made. (The head holds the model only weakly.)"""

    head: Head
    layers: list[int]
    n_blocks: int
    fixed_targets: torch.Tensor | None
    label_axis: bool
    methods: tuple[Method, ...]

    @functools.cached_property
    def pointwise(self) -> bool:
        """Whether every method the probe computes is pointwise (:func:`~nxl_hooks.method.scores.pointwise`)."""
        return _scores.pointwise(self.methods)

    def explained(self, predicted: torch.Tensor) -> torch.Tensor:
        """(rows, k) ids explained, given the (rows, 1) predicted ids."""
        return explained(self.fixed_targets, predicted)

    def scores(self, given: Given) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """({method: scores}, targets) of every method the probe computes, the label axis kept only when several
        labels were asked for."""
        return _scores.method_scores(self.methods, given, label_axis=self.label_axis)


@dataclass(frozen=True, eq=False)
class Plan:
    """The fixed part of a probe: what every recorded call explains and how."""

    subject: Subject  #: the model, resolved once: its spec, head and head kind
    layers: list[int]
    embedding: str
    tokenizer: Any
    fixed_targets: torch.Tensor | None  #: (1 or rows, k) ids, or None for the model's own prediction
    label_axis: bool  #: scores keep a trailing axis of k labels
    texts: TokenTexts | None = field(default=None, repr=False)  #: the tokenizer's readable texts (shared)
    methods: tuple[Method, ...] = field(default_factory=lambda: resolve_methods(None))  #: what each record scores

    @property
    def model(self) -> nn.Module:
        """The transformers task model (inside a PeftModel, the base model)."""
        return self.subject.model

    @property
    def spec(self) -> ArchSpec:
        return self.subject.spec

    @property
    def kind(self) -> HeadKind:
        return self.subject.kind

    @property
    def head(self) -> Head:
        return self.subject.head

    @property
    def blocks(self) -> nn.ModuleList:
        return self.subject.blocks

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def name(self) -> str:
        """The model's name as records carry it (:func:`model_name`)."""
        return model_name(self.model)

    @property
    def special_ids(self) -> list[int] | None:
        """The tokenizer's special token ids (:func:`~nxl_hooks.method.select.special_ids`), None without one."""
        return special_ids(self.tokenizer) if self.tokenizer is not None else None

    @property
    def joining(self) -> tuple[str, str, bool, bool]:
        """How the tokenizer's decode joins token texts: what it puts between them, a WordPiece continuation prefix,
        whether its decoder cleans up each token and whether its decode cleans up the text
        (:func:`~.records.tokens.separator`, :func:`~.records.tokens.continuation`,
        :func:`~.records.tokens.clean_up_spaces`)."""
        return (separator(self.tokenizer), *continuation(self.tokenizer), clean_up_spaces(self.tokenizer))

    @property
    def generates(self) -> bool:
        """Whether the model has a ``generate`` whose steps the probe records (causal LMs)."""
        return self.kind is HeadKind.CAUSAL_LM and callable(getattr(self.model, "generate", None))

    def rows(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
             shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(example, position) of every explained row (:func:`nxl_hooks.method.select.prediction_rows`), CPU."""
        return prediction_rows(
            self.kind, self.spec.pooling, input_ids, attention_mask, shape=shape,
            pad_id=pad_token_id(self.model),
            mask_id=getattr(self.tokenizer, "mask_token_id", None),
        )

    def explained(self, predicted: torch.Tensor) -> torch.Tensor:
        """(rows, k) ids explained, given the (rows, 1) predicted ids."""
        return self.scoring.explained(predicted)

    @functools.cached_property
    def scoring(self) -> Scoring:
        """What making records reads of this plan, without the model (:class:`Scoring`)."""
        return Scoring(self.head, self.layers, self.n_blocks, self.fixed_targets, self.label_axis, self.methods)

    @property
    def pointwise(self) -> bool:
        """Whether every method the probe computes is pointwise (:func:`~nxl_hooks.method.scores.pointwise`)."""
        return self.scoring.pointwise

    def scores(self, given: Given) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """({method: scores}, targets) of every method the probe computes, the label axis kept only when several
        labels were asked for."""
        return self.scoring.scores(given)

    def _named(self, input_ids: torch.Tensor, name: Callable[[list[int]], list[str]]) -> list[list[str]]:
        """``name`` of each row's ids, the virtual tokens (:data:`VIRTUAL_ID`, the row's first ones) named as such."""
        named = []
        for row in input_ids.tolist():
            virtual = next((i for i, one in enumerate(row) if one != VIRTUAL_ID), len(row))
            named.append([virtual_name(i) for i in range(virtual)] + name(row[virtual:]))
        return named

    def token_strings(self, input_ids: torch.Tensor | None) -> list[list[str]] | None:
        """The token strings of each row, when a tokenizer was given."""
        if self.tokenizer is None or input_ids is None:
            return None
        return self._named(input_ids.cpu(), self.tokenizer.convert_ids_to_tokens)

    def special(self, input_ids: torch.Tensor | None) -> torch.Tensor | None:
        """True on the tokenizer's special tokens, when a tokenizer and ids are known, and on virtual tokens
        (:data:`VIRTUAL_ID`), with a tokenizer or without: no text of the user's, they never rank."""
        if input_ids is None:
            return None
        virtual = input_ids.cpu() == VIRTUAL_ID
        special = special_mask(input_ids, self.tokenizer) if self.tokenizer is not None else None
        if not virtual.any():
            return special
        return virtual if special is None else special | virtual

    def template(self, input_ids: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
        """bool (rows, seq): True on the chat template's own tokens of each row's real tokens
        (:func:`~nxl_hooks.method.chat.locate_template`), which do not rank; None without a tokenizer that has a
        chat template, or when no row is a chat-templated prompt."""
        if self.tokenizer is None or input_ids is None or not getattr(self.tokenizer, "chat_template", None):
            return None
        flags, found = torch.zeros(input_ids.shape, dtype=torch.bool), False
        for row, real in enumerate(mask.bool()):
            try:
                located = locate_template(self.tokenizer, input_ids[row][real].tolist())
            except Exception:  # noqa: BLE001 - a tokenizer's own error: rank every token rather than stop recording
                located = None
            if located is not None:
                flags[row, real], found = located, True
        return flags if found else None

    def readable(self, ids: list[int]) -> list[str] | None:
        """The readable text of each token id (:class:`TokenTexts`), None without a tokenizer."""
        return self.texts(ids) if self.texts is not None else None

    @functools.cached_property
    def target_texts(self) -> dict[int, str] | None:
        """The readable text of each fixed target id (:meth:`readable`), which a call records once
        (:attr:`~nxl_hooks.GenerationCall.target_texts`); None for the model's own prediction or without a tokenizer."""
        if self.fixed_targets is None or self.texts is None:
            return None
        ids = sorted(set(self.fixed_targets.reshape(-1).tolist()))
        return dict(zip(ids, self.readable(ids)))

    def readable_rows(self, ids: torch.Tensor | None) -> list[list[str]] | None:
        """:meth:`readable` of each row of a (rows, seq) id tensor; None without a tokenizer or ids."""
        if self.tokenizer is None or ids is None:
            return None
        return self._named(ids.cpu(), self.readable)

    def describe(self) -> dict[str, Any]:
        """What a saved result records about the model and the probe: ``plan.describe()["head_kind"]``."""
        return {
            "model_type": self.model.config.model_type,
            "model_class": type(self.model).__name__,
            "head_kind": self.kind,
            "embedding": self.embedding,
            "n_blocks": self.n_blocks,
            "spec": self.spec.name,
            "methods": [method.name for method in self.methods],
            # (a copy, nested dicts too: a result's meta is its reader's to edit, and the next record's must not
            # change with it)
            **copy.deepcopy(self._made_by),
        }

    @functools.cached_property
    def _made_by(self) -> dict[str, Any]:
        """:func:`made_by` of the model, read once per attach: :meth:`describe` runs for every forward's record, and a
        quantizer's ``to_dict``, the model's dtype (a walk over its parameters) and the versions are host work no
        forward needs to repeat."""
        return made_by(self.model)


def made_by(model: nn.Module) -> dict[str, Any]:
    """What it takes to make a model's numbers again: which weights (:func:`model_name`), in which dtype and
    quantization (:func:`~nxl_hooks.method.placement.quantization`), by what code (the packages' versions). What an
    attribution's ``meta`` and the outputs of ``nxl evaluate`` / ``nxl audit`` say about each model.
    ``made_by(model) == {"model": "my-model", "dtype": "float32", "quantization": None, "versions": {...}}``"""
    model = unwrap(model)  # (a PeftModel or a torch.compile wrapper: the model inside, as a probe records it)
    dtype = getattr(model, "dtype", None)  # (None for a model that says none, not the text "None")
    return {
        "model": model_name(model),
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "quantization": quantization(model),
        "versions": versions(),
    }


def model_name(model: nn.Module) -> str:
    """What a model is called in records and by ``nxl run``: the folder or hub id it was loaded from, else its class
    name. ``model_name(model) == "HuggingFaceTB/SmolLM2-135M-Instruct"``; a folder name that is not UTF-8 as
    :func:`~nxl_hooks.records.tokens.record_text` keeps it (``models/caf\\xe9``): Parquet takes no other."""
    return record_text(str(getattr(model, "name_or_path", "") or type(model).__name__))


def tokenizer_mismatch(model: nn.Module, tokenizer: Any) -> str | None:
    """Why ``tokenizer`` cannot be ``model``'s (no tokenizer object at all, or more tokens than embedding rows), or
    None when it may be."""
    if isinstance(tokenizer, (str, os.PathLike)):  # its name, which every forward's token texts would fail on
        return (f"tokenizer={os.fspath(tokenizer)!r} is a name, not a tokenizer: pass the tokenizer object, "
                f"AutoTokenizer.from_pretrained({os.fspath(tokenizer)!r})")
    if not (isinstance(tokenizer, Sized) and callable(getattr(tokenizer, "convert_ids_to_tokens", None))):
        given = "None" if tokenizer is None else f"<{type(tokenizer).__name__}>"
        return (f"tokenizer={given} is not a tokenizer (it has no len() or convert_ids_to_tokens): pass the model's "
                "tokenizer, AutoTokenizer.from_pretrained(...) (a processor's is processor.tokenizer)")
    embedding = word_embedding(model)  # (inside a PEFT wrapper of the input embeddings)
    rows = embedding.num_embeddings if embedding is not None else None
    if rows is not None and len(tokenizer) > rows:
        return (f"the tokenizer does not match the model: it has {len(tokenizer)} tokens but the model's "
                f"embedding has {rows} rows; pass the tokenizer saved with this model")
    return None


def make_plan(model: nn.Module | Subject, *, layers: Any, target: Target, tokenizer: Any, embedding: str,
              methods: Any = None) -> Plan:
    """Resolve and check everything :func:`~nxl_hooks.attach` was given, before any hook goes on.

    ``model``: the model as given (wrapped or not) or its :class:`~nxl_hooks.method.subject.Subject`, resolved
    here only if it is not one yet. Raises ValueError / UnknownArchitectureError.
    """
    subject = Subject.of(model)
    model, kind, head = subject.model, subject.kind, subject.head
    parse_embedding(embedding)
    chosen = resolve_methods(methods)
    for method in chosen:
        if isinstance(method, Checked):  # its settings against this model's head, once, here
            method.check_outputs(head.n_outputs)
    if tokenizer is not None and (mismatch := tokenizer_mismatch(model, tokenizer)):
        raise ValueError(mismatch)
    if kind is HeadKind.MASKED_LM and getattr(tokenizer, "mask_token_id", None) is None:
        raise ValueError("masked-LM attribution needs attach(..., tokenizer=tok) with a mask token, to find the "
                         "[MASK] positions it explains")
    target, layers = from_numpy(target), from_numpy(layers)
    texts = token_texts(tokenizer) if tokenizer is not None else None
    fixed = None if is_predicted(target) else target_ids(model, kind, tokenizer, target, head.n_outputs, texts)
    for method in chosen if fixed is not None else ():
        if isinstance(method, TargetChecked):  # its settings against the explained ids, before the forward
            method.check_targets(fixed)
    return Plan(subject=subject, layers=resolve_layers(layers, len(subject.blocks)), embedding=embedding,
                tokenizer=tokenizer, fixed_targets=fixed, label_axis=_scores.label_axis(target),
                texts=texts, methods=chosen)


def check_recording(plan: Plan, *, on_step: Any, sink: Any, keep_steps: Any, keep_calls: Any, cache_dtype: Any,
                    cache_device: Any) -> None:
    """Check what :func:`~nxl_hooks.attach` was given for ``generate`` records, before any file is opened: a refused
    probe never truncates an existing sink file. ValueError says what to change."""
    given = [name for name, value in (("on_step", on_step), ("sink", sink), ("cache_dtype", cache_dtype),
                                      ("cache_device", cache_device)) if value is not None]
    if given and not plan.generates:
        raise ValueError(
            f"{', '.join(given)}: these record generate() steps, but {type(plan.model).__name__} is a {plan.kind} "
            "model, not a causal LM that generates; drop them (a forward's result: probe.result(), Attribution.save)"
        )
    if on_step is not None and not callable(on_step):
        raise ValueError(f"on_step={on_step!r}: give a function that takes a Step")
    # (its TypeError came at the first step, ending that call's records, and said in every call's error)
    if on_step is not None and (why := unbound(on_step, None)) is not None:
        raise ValueError(f"on_step={getattr(on_step, '__qualname__', type(on_step).__name__)} cannot be called as "
                         f"on_step(step) ({why}): give a function that takes a Step")
    if sink is not None:
        sink_factory(sink)  # a spec that names no sink kind is refused here, before any file is opened
    numpy_bool = type(keep_steps).__module__ == "numpy" and type(keep_steps).__name__ in ("bool", "bool_")
    if not (isinstance(keep_steps, bool) or numpy_bool):  # ("no" is true: the records meant to be dropped were kept)
        raise ValueError(f"keep_steps={keep_steps!r}: give True (keep the records in probe.calls) or False (stream "
                         "them only)")
    if keep_calls is not None and (isinstance(keep_calls, bool) or not isinstance(keep_calls, int)):
        raise ValueError(f"keep_calls={keep_calls!r}: give a whole number of calls to keep, or None for all")
    if cache_dtype is not None and not (isinstance(cache_dtype, torch.dtype) and cache_dtype.is_floating_point):
        raise ValueError(f"cache_dtype={cache_dtype!r}: use a floating-point dtype (torch.float32, torch.bfloat16, "
                         "torch.float16) or None for the model's own")
    if cache_device is not None:
        try:
            device = torch.device(cache_device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"cache_device={cache_device!r} is not a device: use e.g. 'cpu' or 'cuda:0'") from None
        # one no tensor can go to failed every call at its first forward ('cuda' on a CPU build of torch), and the meta
        # device, which holds no data, every record, as if the scoring had returned no data
        if device.type == "meta":
            raise ValueError(f"cache_device={cache_device!r} holds no data: use e.g. 'cpu' or 'cuda:0'")
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as error:  # (a CPU build says "not compiled with CUDA" by an assert)
            raise ValueError(f"cache_device={cache_device!r} cannot hold tensors here ({one_line(error)}): use "
                             "'cpu' or a device this torch has") from None


def run_eagerly(model: nn.Module) -> Callable[[], None]:
    """Make a ``torch.compile``'d ``model`` run its own Python modules while attached; returns the undo.

    Compiled code does not call hooks added after it was compiled (dynamo does not guard on module hooks), and
    tracing would run the hooks on fake tensors. So while attached, a ``torch.compile(model)`` wrapper calls its
    original module and modules compiled in place (``module.compile()``) their uncompiled call: the forward runs
    eagerly, recorded; after detach the compiled code runs again, as it was. The undo holds weak references only
    (the compiled callables are kept on their modules), so a dropped model is still freed.
    """
    changed: list[tuple[weakref.ref, str]] = []

    def restore() -> None:
        while changed:
            ref, name = changed.pop()
            module = ref()
            if module is not None and _KEPT + name in vars(module):  # (not there: listed, then cut short)
                setattr(module, name, vars(module).pop(_KEPT + name))

    wrapper = model
    try:  # each change listed before it is made: one a Ctrl-C cut short is undone with the others
        while (inner := compiled_original(wrapper)) is not None:
            changed.append((weakref.ref(wrapper), "forward"))
            vars(wrapper)[_KEPT + "forward"] = wrapper.forward
            wrapper.forward = inner.__call__
            wrapper = inner
        for module in model.modules():
            compiled = getattr(module, "_compiled_call_impl", None)
            if compiled is not None:
                changed.append((weakref.ref(module), "_compiled_call_impl"))
                vars(module)[_KEPT + "_compiled_call_impl"] = compiled
                module._compiled_call_impl = None
    except BaseException:
        restore()
        raise
    return restore
