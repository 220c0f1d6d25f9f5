"""The schema of an architecture spec: :class:`ArchSpec` and its steps, the head kinds, and reading a spec's dotted
paths on a model. Checked on its own; :mod:`.fit` checks a spec against a model, :mod:`.registry` keeps them.

    spec = ArchSpec(name="mymodel", model_types=("mymodel",), blocks="model.layers",
                    heads={"causal_lm": ("model.norm", "lm_head")})
    head_kind(model) is HeadKind.CAUSAL_LM; HeadKind.CAUSAL_LM == "causal_lm"
"""

from __future__ import annotations

import difflib
import re
import reprlib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ArchSpec", "FUNCTION_STEPS", "HEAD_CLASS_ENDINGS", "HEAD_KINDS", "HeadKind", "POST_STEPS", "RegistryError",
           "UNEXPLAINED", "UnknownArchitectureError", "class_head", "get_path", "has_path", "head_kind",
           "readout_outputs", "spec_from_mapping", "spec_head", "split_post_steps", "word_embedding"]


class HeadKind(str, Enum):
    """What a task model's head predicts, as an object: ``head_kind(model) is HeadKind.CAUSAL_LM``. A ``str``: it
    equals, hashes, formats and serializes as its value (``HeadKind.REGRESSION == "regression"``), so code and
    records that compare or store the string keep working."""

    CAUSAL_LM = "causal_lm"
    SEQUENCE_CLASSIFICATION = "sequence_classification"
    REGRESSION = "regression"  #: a sequence-classification head with one output
    MASKED_LM = "masked_lm"

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:  # messages quote a kind as they quoted the string: 'causal_lm'
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def spec_head(self) -> "HeadKind":
        """The spec head this kind reads: regression reads a sequence-classification head."""
        return HeadKind.SEQUENCE_CLASSIFICATION if self is HeadKind.REGRESSION else self

    @property
    def pooled(self) -> bool:
        """One prediction per example, read at a pooled position (sequence classification and regression)."""
        return self.spec_head is HeadKind.SEQUENCE_CLASSIFICATION

    @property
    def vocabulary(self) -> bool:
        """Predicts tokens of the vocabulary (causal and masked LMs), not labels or a value."""
        return self in (HeadKind.CAUSAL_LM, HeadKind.MASKED_LM)


#: The head kinds a spec can describe. Regression is a sequence-classification head with one output.
HEAD_KINDS = ("causal_lm", "sequence_classification", "masked_lm")

#: Head steps that are functions, by name.
FUNCTION_STEPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"tanh": torch.tanh, "gelu": F.gelu, "relu": F.relu}

#: Logit post-processing steps after the readout, ``"<op>:<config attribute>"`` (see :class:`ArchSpec`).
POST_STEPS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "softcap": lambda x, c: torch.tanh(x / c) * c,
    "scale": lambda x, s: x * s,
    "divide": lambda x, s: x / s,
}



def split_post_steps(steps: Sequence[str]) -> tuple[list[str], list[str]]:
    """A head's steps as (the steps up to the readout, the logit post-processing steps after it, in order):
    ``split_post_steps(["model.norm", "lm_head", "softcap:final_logit_softcapping"])``."""
    cut = len(steps)
    while cut and steps[cut - 1].split(":", 1)[0] in POST_STEPS:
        cut -= 1
    return list(steps[:cut]), list(steps[cut:])


_KEYS = ("model_types", "blocks", "heads", "pooling", "backbone", "layer_outputs")
#: How deep an entry's values may nest (a head is a table of lists of strings: 3); deeper is refused before any
#: recursive walk (a repr, a check) could overflow the stack.
MAX_DEPTH = 4
_SHORT = reprlib.Repr()  # values quoted in messages: one short line, however large or deep the value
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 2, 60, 60, 6, 6
_POOLINGS = ("first", "last_non_pad")
_PATH = re.compile(r"[A-Za-z_]\w*(\.([A-Za-z_]\w*|\d+))*")
_ATTRIBUTE = re.compile(r"[A-Za-z_]\w*")


class UnknownArchitectureError(LookupError):
    """The model's architecture is neither registered nor discoverable; the message prints the
    ``nxl.register_architecture(...)`` call its modules show, to fill in."""


class RegistryError(ValueError):
    """A registry entry (a ``registry/*.toml`` table or a :func:`register_architecture` call) that breaks the schema,
    or that does not fit the model it is resolved for. The message names the file, the entry and the key.
    ``try: nxl.register_file("my_arch.toml") except nxl.RegistryError as error: print(error)``"""


@dataclass(frozen=True)
class ArchSpec:
    """Where an architecture keeps its blocks, and its head-on-top per head kind.

    ``heads`` maps a head kind to the steps of HoT, applied in order to one hidden state. A step is a
    module path relative to the task model (``"model.norm"``; a path that resolves to ``None``, such as
    OPT's absent ``project_out``, is skipped), a function (``"tanh"``, ``"gelu"``, ``"relu"``), or
    ``"act:<config attribute>"`` for the activation a config names. The last module step is the readout:
    a linear map whose target rows are gathered instead of computing every logit. Steps after it are
    elementwise logit post-processing by a config value, skipped when that value is ``None``:
    ``"softcap:<attr>"`` (tanh(x / c) * c), ``"scale:<attr>"`` (x * s), ``"divide:<attr>"`` (x / s).
    They sit per head kind because transformers applies them in ``*ForCausalLM`` only.

    Every field is checked when the spec is made (:class:`RegistryError` names the file, entry and key); what only
    a model can tell (its config has each attribute a step names; a head keeps the model's final norm) is checked
    when the spec is resolved for a model.
    """

    name: str
    model_types: tuple[str, ...]
    blocks: str
    heads: Mapping[str, tuple[str, ...]]
    #: Where sequence classification reads its prediction: "first" (CLS) or "last_non_pad"
    #: (the rightmost token that is not ``pad_token_id``, as transformers' decoder classifiers pool).
    pooling: str = "last_non_pad"
    #: The module whose forward takes ``input_ids`` / ``attention_mask`` and runs the blocks, when it is not
    #: ``model.base_model`` (OPTForCausalLM calls ``model.decoder`` directly, bypassing OPTModel.forward).
    backbone: str | None = None
    #: Layer number l -> the module whose output is h[l] where that is not block l's output: a module the backbone
    #: runs on block l's output before block l + 1 (DeBERTa-v2's ``encoder.conv`` after block 1, as in
    #: deberta-v2-xlarge). A path that resolves to None (a config without that module) keeps block l's output.
    layer_outputs: Mapping[int, str] = field(default_factory=dict)
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        """Check every field against the schema (docs/adding-an-architecture.md); :class:`RegistryError` if bad.
        Lists (TOML arrays) become tuples; a lone string stays one, to be refused: ``tuple("llama")`` would be
        five one-letter model types."""
        if isinstance(self.model_types, list):
            object.__setattr__(self, "model_types", tuple(self.model_types))
        if isinstance(self.heads, Mapping):
            object.__setattr__(self, "heads", {kind: tuple(steps) if isinstance(steps, list) else steps
                                               for kind, steps in self.heads.items()})
        if not isinstance(self.name, str) or not self.name:
            raise RegistryError(f"registry entry name {self.name!r} in {self.source}: use a non-empty string")
        if not isinstance(self.model_types, tuple) or not self.model_types or not all(
                isinstance(t, str) and t for t in self.model_types):
            hint = f": write [{self.model_types!r}]" if isinstance(self.model_types, str) else ""
            self._bad("model_types",
                      f"must be a non-empty list of model_type strings, got {self._short(self.model_types)}{hint}")
        self._check_path("blocks", self.blocks)
        if self.backbone is not None:
            self._check_path("backbone", self.backbone)
        self._check_layer_outputs()
        if self.pooling not in _POOLINGS:
            self._bad("pooling", f"must be one of {_POOLINGS}, got {self.pooling!r}")
        if not isinstance(self.heads, Mapping) or not self.heads:
            self._bad("heads",
                      f"must be a table of head kinds {HEAD_KINDS} to lists of steps, got {self._short(self.heads)}")
        for kind, steps in self.heads.items():
            if kind not in HEAD_KINDS:
                self._bad(f"heads.{kind}", f"is not a head kind; use {HEAD_KINDS}")
            self._check_steps(f"heads.{kind}", steps)

    def _bad(self, key: str, problem: str) -> None:
        raise RegistryError(f"registry entry [{self.name}] in {self.source}: key {key!r} {problem}")

    def _short(self, value: object) -> str:
        return _SHORT.repr(value)

    def _check_path(self, key: str, path: object) -> None:
        if not isinstance(path, str) or not _PATH.fullmatch(path):
            self._bad(key, f"must be a dotted module path like \"model.layers\", got {self._short(path)}")

    def _check_layer_outputs(self) -> None:
        """A table of layer numbers (1 or more; TOML keys are strings of digits) to module paths; kept by number."""
        outputs = self.layer_outputs
        if not isinstance(outputs, Mapping):
            self._bad("layer_outputs", f"must be a table of layer numbers to module paths, like {{ 1 = "
                                       f"\"deberta.encoder.conv\" }}, got {self._short(outputs)}")
        numbered: dict[int, str] = {}
        for layer, path in outputs.items():
            number = layer if isinstance(layer, int) and not isinstance(layer, bool) else (
                int(layer) if isinstance(layer, str) and layer.isdecimal() and layer.isascii() else None)
            if number is None or number < 1:
                self._bad("layer_outputs", f"key {self._short(layer)} is not a layer number (1 for block 1's "
                                           "output, 2 for block 2's...)")
            self._check_path(f"layer_outputs.{number}", path)
            numbered[number] = path
        object.__setattr__(self, "layer_outputs", numbered)

    def _check_steps(self, key: str, steps: object) -> None:
        """Module paths and functions, the readout (the last module path), then only post-processing steps."""
        if not isinstance(steps, tuple) or not steps or not all(isinstance(step, str) for step in steps):
            self._bad(key, f"must be a non-empty list of step strings, got {self._short(steps)}")
        body, _ = split_post_steps(steps)
        for step in steps:
            op, colon, attribute = step.partition(":")
            if op in (*POST_STEPS, "act") and colon:
                if not _ATTRIBUTE.fullmatch(attribute):
                    self._bad(key, f"step {step!r}: name a config attribute after {op + ':'!r}")
                if op in POST_STEPS and step in body:
                    self._bad(key, f"step {step!r}: logit post-processing comes after the readout (the last module)")
            elif step in POST_STEPS and step not in body:  # split_post_steps takes a trailing bare 'softcap' as
                # one of no value, skipped (before the readout it is a module path, as any name is)
                self._bad(key, f"step {step!r}: name a config attribute after it, {step + ':<attr>'!r}")
            elif step not in FUNCTION_STEPS and not _PATH.fullmatch(step):
                self._bad(key, f"step {step!r} is neither a module path, a function {tuple(FUNCTION_STEPS)}, "
                               f"'act:<attr>' nor post-processing {tuple(p + ':<attr>' for p in POST_STEPS)}")
        if not body or not _PATH.fullmatch(body[-1]) or body[-1] in FUNCTION_STEPS:
            self._bad(key, f"must end with the readout module (then post-processing steps only), got {list(steps)}")


def _too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists/tables more than ``limit`` levels (walked without recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, Mapping) else item if isinstance(item, (list, tuple)) else None
        if children is not None:
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in children)
    return False


def spec_from_mapping(name: str, data: Any, source: str) -> ArchSpec:
    """The spec a registry table (or :func:`~nxl_hooks.arch.registry.register_architecture` call) describes, checked;
    RegistryError names the entry and key."""
    where = f"registry entry [{name}] in {source}"
    if not isinstance(data, Mapping):
        raise RegistryError(f"{where}: must be a table of keys {_KEYS}, got {type(data).__name__} {_SHORT.repr(data)}")
    unknown = [key for key in data if key not in _KEYS]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), _KEYS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RegistryError(f"{where}: unknown key {unknown[0]!r}{hint}; the keys are {_KEYS}")
    deep = next((key for key, value in data.items() if _too_deep(value, MAX_DEPTH)), None)
    if deep is not None:
        raise RegistryError(f"{where}: key {deep!r} nests deeper than {MAX_DEPTH} levels; expected a string, or "
                            "for 'heads' a table of lists of step strings")
    if "blocks" not in data or "heads" not in data:
        raise RegistryError(f"{where}: key {'blocks' if 'blocks' not in data else 'heads'!r} is missing")
    return ArchSpec(name=name, model_types=data.get("model_types", (name,)), blocks=data["blocks"],
                    heads=data["heads"], pooling=data.get("pooling", "last_non_pad"), backbone=data.get("backbone"),
                    layer_outputs=data.get("layer_outputs", {}), source=source)


#: The endings of the class names of the task models nxl_hooks explains, and the head each reads out with
#: (regression is a sequence-classification head with one output: :func:`head_kind` tells it by the config).
HEAD_CLASS_ENDINGS = {"ForCausalLM": HeadKind.CAUSAL_LM, "LMHeadModel": HeadKind.CAUSAL_LM,
                      "ForSequenceClassification": HeadKind.SEQUENCE_CLASSIFICATION, "ForMaskedLM": HeadKind.MASKED_LM}
#: What the task models nxl_hooks explains are, and what it does not explain: said wherever a model is refused for
#: its class (a VLM's *ForConditionalGeneration is what AutoModelForCausalLM builds for Gemma 3 from 4B on, so "attach
#: to a *ForCausalLM" left its user nothing to do).
UNEXPLAINED = ("NormXLogit explains the head of a decoder-only or encoder text model (a *ForCausalLM, *LMHeadModel, "
               "*ForSequenceClassification or *ForMaskedLM class); encoder-decoder (T5, BART, Marian, Whisper), "
               "vision-language (Llava, PaliGemma, Qwen2-VL, Gemma 3 from 4B), vision and audio models, token "
               "classification and question answering are not supported (docs/supported-models.md)")


def class_head(name: str, config: Any = None) -> HeadKind | None:
    """The head a transformers task model class reads out with, by its name and its ``config`` if given (regression
    not told apart), or None for a class nxl_hooks does not explain:
    ``class_head("BertForMaskedLM") is HeadKind.MASKED_LM``."""
    kind = next((kind for ending, kind in HEAD_CLASS_ENDINGS.items() if name.endswith(ending)), None)
    if getattr(config, "is_encoder_decoder", False) is True:
        # BART's, T5's, LED's *ForSequenceClassification: the head reads the decoder, whose input is the text shifted
        # right (a position's hidden state is the previous token's) and which reads the encoder besides
        return None
    if kind is HeadKind.CAUSAL_LM and getattr(config, "causal", None) is False:
        # XLM's and Flaubert's *WithLMHeadModel, bidirectional by default: a masked LM whose question is at its
        # [MASK] tokens, not at its last position
        return HeadKind.MASKED_LM
    return kind


def head_kind(model: nn.Module) -> HeadKind:
    """The head kind of a transformers task model, from its class: ``head_kind(model) is HeadKind.CAUSAL_LM``."""
    name, config = type(model).__name__, getattr(model, "config", None)
    # a user's subclass (class SentimentModel(BertForSequenceClassification)) reads out as the class it extends; its
    # own forward is checked against its logits at attach (registry.is_tested: transformers' own classes only)
    kind = next((kind for cls in type(model).__mro__ if (kind := class_head(cls.__name__, config)) is not None), None)
    if kind is None:
        raise UnknownArchitectureError(f"{name} has no head-on-top that nxl_hooks knows: {UNEXPLAINED}.")
    if kind is HeadKind.SEQUENCE_CLASSIFICATION:
        # transformers' own rule (the loss it trains with): regression where the config says so, or says nothing
        # and has one output; a one-logit classifier trained with BCE (multi_label_classification) is signed
        problem = getattr(model.config, "problem_type", None)
        if problem == "regression" or (problem is None and model.config.num_labels == 1):
            return HeadKind.REGRESSION
    return kind


def log_probabilities(model: nn.Module, outputs: torch.Tensor) -> torch.Tensor:
    """The model's own log-probabilities of its ``outputs`` (logits, last dimension the outputs), as its loss reads
    them: each output's own log-sigmoid for a classifier trained with BCE (``problem_type`` is
    ``"multi_label_classification"``: each label a yes or no of its own, one logit for a binary one), else one
    log-softmax over them. ``log_probabilities(model, logits).exp()`` is what the model gives each output."""
    if getattr(getattr(model, "config", None), "problem_type", None) == "multi_label_classification":
        return F.logsigmoid(outputs)
    return outputs.log_softmax(-1)


def spec_head(kind: str) -> str:
    """The spec head a head kind reads: regression is a sequence-classification head with one output."""
    return HeadKind(kind).spec_head


def get_path(root: nn.Module, path: str):
    """The object at a dotted spec path (``"model.layers"``, ``"h.0"``); may be None (OPT's ``project_out``)."""
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def has_path(root: nn.Module, path: str) -> bool:
    """Whether ``root`` has the dotted path (its value may be None)."""
    try:
        get_path(root, path)
    except (AttributeError, IndexError, TypeError):
        return False
    return True


def word_embedding(model: nn.Module) -> nn.Embedding | None:
    """The ``nn.Embedding`` of the model's input embeddings: the module itself, or the one a wrapper holds (PEFT's
    LoRA, trainable tokens and modules_to_save wrap it in modules of their own), whose rows and Gemma-style
    ``embed_scale`` are the model's. ``word_embedding(model).num_embeddings``"""
    return next((module for module in model.get_input_embeddings().modules() if isinstance(module, nn.Embedding)),
                None)


def readout_outputs(readout: nn.Module) -> int | None:
    """How many values a readout module gives per position: the out_features of its last Linear (itself, for a
    Linear), since a container registers its Linears in the order they run (a fine-tuned head
    ``nn.Sequential(Linear(d, h), Tanh(), Linear(h, n))``, a LoRA layer's ``lora_B`` after its base layer); None
    when it has none. A head that registers them in another order gives a width the fit check refuses.
    ``readout_outputs(model.lm_head) == model.config.vocab_size``"""
    linears = [module for module in readout.modules() if isinstance(module, nn.Linear)]
    return linears[-1].out_features if linears else None
