"""Per-architecture specs: where the blocks are and what the head-on-top (HoT) is made of.

Specs are declarative TOML files in ``registry/`` (shipped inside the wheel as ``nxl_hooks/_registry``).
A model whose ``model_type`` no file names is handled by generic discovery when its layout is the common
one; otherwise :class:`UnknownArchitectureError` says how to register it::

    nxl.register_architecture("mymodel", blocks="model.layers",
                              heads={"causal_lm": ["model.norm", "lm_head"]})
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
import reprlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "ArchSpec",
    "FUNCTION_STEPS",
    "HEAD_KINDS",
    "POST_STEPS",
    "RegistryError",
    "UnknownArchitectureError",
    "blocks",
    "compiled_original",
    "get_path",
    "head_kind",
    "is_shipped",
    "readout_outputs",
    "split_post_steps",
    "load_file",
    "register_architecture",
    "register_file",
    "resolve",
    "spec_head",
    "specs",
    "unwrap",
]

#: The head kinds a spec can describe. Regression is a sequence-classification head with one output.
HEAD_KINDS = ("causal_lm", "sequence_classification", "masked_lm")

_FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")

# Config values that some *ForCausalLM apply to the logits after lm_head. Their meaning varies by family
# (HyperCLOVA X multiplies by logits_scaling, Granite divides by it), so discovery refuses such a model
# rather than give numbers that miss the model's own logits; a registry entry names the step.
_LOGIT_POST_ATTRIBUTES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")


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


_KEYS = ("model_types", "blocks", "heads", "pooling", "backbone")
#: How deep an entry's values may nest (a head is a table of lists of strings: 3); deeper is refused before any
#: recursive walk (a repr, a check) could overflow the stack.
_MAX_DEPTH = 4
_SHORT = reprlib.Repr()  # values quoted in messages: one short line, however large or deep the value
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 2, 60, 60, 6, 6
_DISCOVERED = "generic discovery"
_POOLINGS = ("first", "last_non_pad")
_PATH = re.compile(r"[A-Za-z_]\w*(\.([A-Za-z_]\w*|\d+))*")
_ATTRIBUTE = re.compile(r"[A-Za-z_]\w*")


class UnknownArchitectureError(LookupError):
    """The model's architecture is neither registered nor discoverable."""


class RegistryError(ValueError):
    """A registry entry (a ``registry/*.toml`` table or a :func:`register_architecture` call) that breaks the schema,
    or that does not fit the model it is resolved for. The message names the file, the entry and the key."""


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
            elif step not in FUNCTION_STEPS and not _PATH.fullmatch(step):
                self._bad(key, f"step {step!r} is neither a module path, a function {tuple(FUNCTION_STEPS)}, "
                               f"'act:<attr>' nor post-processing {tuple(p + ':<attr>' for p in POST_STEPS)}")
        if not body or not _PATH.fullmatch(body[-1]) or body[-1] in FUNCTION_STEPS:
            self._bad(key, f"must end with the readout module (then post-processing steps only), got {list(steps)}")


_SPECS: dict[str, ArchSpec] = {}


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


def _spec_from_mapping(name: str, data: Any, source: str) -> ArchSpec:
    where = f"registry entry [{name}] in {source}"
    if not isinstance(data, Mapping):
        raise RegistryError(f"{where}: must be a table of keys {_KEYS}, got {type(data).__name__} {_SHORT.repr(data)}")
    unknown = [key for key in data if key not in _KEYS]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), _KEYS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RegistryError(f"{where}: unknown key {unknown[0]!r}{hint}; the keys are {_KEYS}")
    deep = next((key for key, value in data.items() if _too_deep(value, _MAX_DEPTH)), None)
    if deep is not None:
        raise RegistryError(f"{where}: key {deep!r} nests deeper than {_MAX_DEPTH} levels; expected a string, or "
                            "for 'heads' a table of lists of step strings")
    if "blocks" not in data or "heads" not in data:
        raise RegistryError(f"{where}: key {'blocks' if 'blocks' not in data else 'heads'!r} is missing")
    return ArchSpec(name=name, model_types=data.get("model_types", (name,)), blocks=data["blocks"],
                    heads=data["heads"], pooling=data.get("pooling", "last_non_pad"), backbone=data.get("backbone"),
                    source=source)


def register_architecture(
    name: str,
    *,
    blocks: str,
    heads: Mapping[str, Sequence[str]],
    model_types: Sequence[str] | None = None,
    **options: str | None,
) -> ArchSpec:
    """Register (or replace) an architecture at run time; same fields as a ``registry/*.toml`` entry.

    ``nxl.register_architecture("mymodel", blocks="model.layers", heads={"causal_lm": ["model.norm", "lm_head"]})``
    Raises :class:`RegistryError` for an entry that breaks the schema.
    """
    fields = {"blocks": blocks, "heads": heads, **options}
    if model_types is not None:
        fields["model_types"] = model_types
    return _add(_spec_from_mapping(name, fields, source="register_architecture()"))


def _add(spec: ArchSpec) -> ArchSpec:
    for model_type in spec.model_types:
        _SPECS[model_type] = spec
    return spec


def load_file(path: str | Path) -> list[ArchSpec]:
    """The specs of every ``[name]`` table of a TOML file, checked, not registered: ``load_file("my_arch.toml")``.

    Raises :class:`RegistryError` (file, entry and key named) for a file that is not TOML or breaks the schema.
    """
    path = Path(path)
    try:
        tables = tomllib.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise RegistryError(f"{path} is not a valid TOML registry file: {err}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise RegistryError(f"{path} nests arrays or tables too deeply to parse; registry entries nest at most "
                            f"{_MAX_DEPTH} levels") from None
    return [_spec_from_mapping(name, table, source=str(path)) for name, table in tables.items()]


def register_file(path: str | Path) -> list[ArchSpec]:
    """Load every ``[name]`` table of a TOML file as an architecture spec (all or none of them).

    ``nxl.register_file("my_arch.toml")``; raises :class:`RegistryError` as :func:`load_file`.
    """
    return [_add(spec) for spec in load_file(path)]


def _registry_dir() -> Path:
    package = Path(__file__).resolve().parent.parent
    shipped = package / "_registry"  # inside an installed wheel
    return shipped if shipped.is_dir() else package.parent / "registry"  # source checkout / editable install


_SHIPPED: set[int] = set()  # id() of the specs of the shipped registry files, tested against the oracle per family


def _load_builtin() -> None:
    for path in sorted(_registry_dir().glob("*.toml")):
        _SHIPPED.update(id(spec) for spec in register_file(path))


def is_shipped(spec: ArchSpec) -> bool:
    """Whether ``spec`` is one of the shipped ``registry/*.toml`` entries or generic discovery (both tested per
    family), not a user's registration: ``is_shipped(specs()["llama"])``."""
    return id(spec) in _SHIPPED or spec.source == _DISCOVERED


def specs() -> dict[str, ArchSpec]:
    """All registered specs by ``model_type``. ``nxl_hooks.arch.registry.specs()["llama"].blocks``"""
    return dict(_SPECS)


def head_kind(model: nn.Module) -> str:
    """The head kind of a transformers task model: causal_lm, sequence_classification, regression, masked_lm."""
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal_lm"
    if name.endswith("ForMaskedLM"):
        return "masked_lm"
    if name.endswith("ForSequenceClassification"):
        config = model.config
        if config.num_labels == 1 or getattr(config, "problem_type", None) == "regression":
            return "regression"
        return "sequence_classification"
    raise UnknownArchitectureError(
        f"{name} has no head-on-top that nxl_hooks knows: attach to a *ForCausalLM, *LMHeadModel, "
        "*ForSequenceClassification or *ForMaskedLM model (NormXLogit explains a head's prediction)."
    )


def spec_head(kind: str) -> str:
    """The spec head a head kind reads: regression is a sequence-classification head with one output."""
    return "sequence_classification" if kind == "regression" else kind


def get_path(root: nn.Module, path: str):
    """The object at a dotted spec path (``"model.layers"``, ``"h.0"``); may be None (OPT's ``project_out``)."""
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _has_path(root: nn.Module, path: str) -> bool:
    try:
        get_path(root, path)
    except (AttributeError, IndexError, TypeError):
        return False
    return True


def compiled_original(model: nn.Module) -> nn.Module | None:
    """The module ``torch.compile(module)`` wrapped (its ``_orig_mod``), when ``model`` is such a wrapper; else None."""
    inner = model._modules.get("_orig_mod") if type(model).__name__ == "OptimizedModule" else None
    return inner if isinstance(inner, nn.Module) else None


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``torch.compile`` wrapper and/or a PeftModel (the object PEFT forwards
    through); any other model as is. ``unwrap(torch.compile(peft_model)) is peft_model.get_base_model()``"""
    model = compiled_original(model) or model
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def blocks(model: nn.Module, spec: "ArchSpec") -> nn.ModuleList:
    """The blocks a spec names: their count is the model's L everywhere (layers 0..L, negative layer numbers)."""
    return get_path(model, spec.blocks)


def _logit_post_processing(model: nn.Module, kind: str) -> list[str]:
    """The ``attr=value`` logit post-processing settings a causal LM's config sets (see above)."""
    config = model.config.get_text_config()
    found = [(name, getattr(config, name, None)) for name in _LOGIT_POST_ATTRIBUTES] if kind == "causal_lm" else []
    return [f"{name}={value}" for name, value in found if value is not None]


def _final_norm(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(path, module) of the final norm a decoder keeps right under its base model (``model.norm``,
    ``transformer.ln_f``...), when it has one of the known names."""
    base = getattr(model, "base_model", None)
    prefix = next((n for n, m in model.named_children() if m is base), None) if isinstance(base, nn.Module) else None
    for name in _FINAL_NORM_NAMES if prefix is not None else ():
        module = getattr(base, name, None)
        if isinstance(module, nn.Module):
            return f"{prefix}.{name}", module
    return None


def readout_outputs(readout: nn.Module) -> int | None:
    """How many values a readout module gives per position: the out_features of its (first) Linear; None when it
    has none. ``readout_outputs(model.lm_head) == model.config.vocab_size``"""
    return next((module.out_features for module in readout.modules() if isinstance(module, nn.Linear)), None)


def _found(obj: object) -> str:
    """What a path names, in a few words, for messages."""
    if isinstance(obj, nn.Module):
        return f"a {type(obj).__name__}"
    if isinstance(obj, torch.Tensor):
        return f"a {type(obj).__name__} of shape {tuple(obj.shape)}, not a module"
    if callable(obj):
        return f"the method/function {getattr(obj, '__name__', type(obj).__name__)!r}, not a module"
    return f"a {type(obj).__name__}, not a module"


def _expected_outputs(model: nn.Module, spec_kind: str) -> tuple[set[int], str]:
    """The readout widths that fit the model's head kind, and how to say so."""
    if spec_kind == "sequence_classification":
        labels = model.config.num_labels
        return {labels}, f"num_labels = {labels}"
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    embedding = model.get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)
    widths = {n for n in (vocab, rows) if isinstance(n, int)}
    return widths, f"the vocabulary size {' or '.join(map(str, sorted(widths)))}"


def _check_post_value(spec: ArchSpec, key: str, step: str, value: object) -> None:
    """A post-processing step's config value: a finite float scale / cap, not a token id, count or size."""
    op, _, attribute = step.partition(":")
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        spec._bad(key, f"step {step!r}: config.{attribute} is {spec._short(value)}, not a number (or None to skip "
                       "the step)")
    if isinstance(value, int) or attribute.endswith(("_id", "_ids")):
        spec._bad(key, f"step {step!r}: config.{attribute} is {value!r}, an integer (a token id, count or size); "
                       f"expected a float {'cap' if op == 'softcap' else 'scale'} such as final_logit_softcapping "
                       "or logit_scale")
    if not math.isfinite(value) or (value == 0 and op != "scale") or (op == "softcap" and value < 0):
        spec._bad(key, f"step {step!r}: config.{attribute} is {value!r}; expected a finite "
                       f"{'positive' if op == 'softcap' else 'non-zero'} float")


def _check_backbone(model: nn.Module, spec: ArchSpec, block_list: nn.Module) -> None:
    """``backbone`` names a module that takes input_ids (or inputs_embeds) and runs the blocks."""
    if spec.backbone is None:
        return
    expected = "expected the module that takes input_ids and runs the blocks (e.g. 'model.decoder')"
    if not _has_path(model, spec.backbone):
        spec._bad("backbone", f"names {spec.backbone!r}, which {type(model).__name__} does not have; {expected}")
    found = get_path(model, spec.backbone)
    if not isinstance(found, nn.Module):
        spec._bad("backbone", f"names {spec.backbone!r}, {_found(found)}; {expected}")
    if not any(sub is block_list for sub in found.modules()):
        spec._bad("backbone", f"names {spec.backbone!r}, a {type(found).__name__} that does not contain the blocks "
                              f"{spec.blocks!r}; {expected}")
    try:
        parameters = inspect.signature(found.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    if not {"input_ids", "inputs_embeds"} & set(parameters):
        spec._bad("backbone", f"names {spec.backbone!r}, a {type(found).__name__} whose forward takes no input_ids "
                              f"or inputs_embeds; {expected}")


def _check_blocks(model: nn.Module, spec: ArchSpec) -> nn.ModuleList:
    found = get_path(model, spec.blocks)
    if not isinstance(found, nn.ModuleList) or not len(found):
        what = "an empty ModuleList" if isinstance(found, nn.ModuleList) else _found(found)
        spec._bad("blocks", f"names {spec.blocks!r}, {what}; expected the ModuleList of the model's blocks (a "
                            "sequence of modules that each run once in the forward, e.g. 'model.layers')")
    return found


def _check_fits(model: nn.Module, spec: ArchSpec, spec_kind: str) -> None:
    """What only the model can tell about a registry entry (:class:`RegistryError`, one line naming entry, key, what
    was found and what was expected): ``blocks`` is a non-empty ModuleList; every head step names a module outside
    the blocks (or None, or a config value of the right kind: an activation name, a float scale / cap); the readout
    gives one value per vocabulary token or label; the head applies the model's final norm; ``backbone`` takes
    input_ids and runs the blocks. Whether the entry's numbers equal the model's own logits is checked by running
    it (:func:`nxl_hooks.method.verify.check_numbers`)."""
    key, steps, config = f"heads.{spec_kind}", spec.heads[spec_kind], model.config
    block_list = _check_blocks(model, spec)
    in_blocks = {id(sub) for sub in block_list.modules()}
    readout: tuple[str, nn.Module] | None = None
    for step in steps:
        op, colon, attribute = step.partition(":")
        if colon:
            if not hasattr(config, attribute):
                close = difflib.get_close_matches(attribute, [n for n in dir(config) if not n.startswith("_")], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                spec._bad(key, f"step {step!r}: {type(config).__name__} has no attribute {attribute!r}{hint}")
            value = getattr(config, attribute)
            if op in POST_STEPS:
                _check_post_value(spec, key, step, value)
            elif not isinstance(value, str) or not _is_activation(value):
                spec._bad(key, f"step {step!r}: config.{attribute} is {spec._short(value)}; expected the name of an "
                               "activation function (such as config.hidden_act)")
            continue
        if step in FUNCTION_STEPS or not _has_path(model, step):
            continue  # a path a variant lacks: Head says so, naming the step
        found = get_path(model, step)
        if found is None:
            continue  # an optional module this model does not have (OPT's project_out)
        if not isinstance(found, nn.Module):
            spec._bad(key, f"step {step!r} is {_found(found)}; expected a module of the head-on-top")
        if id(found) in in_blocks:
            spec._bad(key, f"step {step!r} is a {type(found).__name__} inside the blocks {spec.blocks!r}; expected a "
                           "module of the head-on-top, which runs after the last block")
        if any(sub is block_list for sub in found.modules()):
            spec._bad(key, f"step {step!r} is a {type(found).__name__} that contains the blocks {spec.blocks!r}; "
                           "expected a module of the head-on-top, which runs after the last block")
        readout = (step, found)
    if readout is not None:
        width, (widths, expected) = readout_outputs(readout[1]), _expected_outputs(model, spec_kind)
        if width is None or (widths and width not in widths):
            what = "has no Linear layer" if width is None else f"gives {width} values per position"
            spec._bad(key, f"readout {readout[0]!r} ({type(readout[1]).__name__}) {what}; expected {expected} "
                           f"of {type(model).__name__}'s head")
    _check_backbone(model, spec, block_list)
    norm = _final_norm(model)
    if norm is None:
        return
    path, module = norm
    for step in steps:
        found = get_path(model, step) if step not in FUNCTION_STEPS and _has_path(model, step) else None
        if isinstance(found, nn.Module) and any(sub is module for sub in found.modules()):
            return
    spec._bad(key, f"leaves out the model's final norm {path!r} ({type(module).__name__}): the head-on-top applies it "
                   f"before the readout; add {path!r} as the first step")


def _is_activation(name: str) -> bool:
    from transformers.activations import ACT2FN

    return name in ACT2FN


def _discover(model: nn.Module, kind: str) -> ArchSpec | None:
    """The common decoder layout: one ModuleList of num_hidden_layers blocks, a final norm, a Linear head."""
    config = model.config
    if _logit_post_processing(model, kind):
        return None
    n_layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    norm = _final_norm(model)
    if n_layers is None or norm is None:
        return None
    prefix = norm[0].split(".")[0]
    blocks = next(
        (f"{prefix}.{n}" for n, m in model.base_model.named_modules()
         if isinstance(m, nn.ModuleList) and len(m) == n_layers),
        None,
    )
    head_name = {"causal_lm": "lm_head", "sequence_classification": "score"}.get(kind)
    if blocks is None or not isinstance(getattr(model, head_name or "", None), nn.Linear):
        return None
    return ArchSpec(
        name=f"discovered:{config.model_type}",
        model_types=(config.model_type,),
        blocks=blocks,
        heads={kind: (norm[0], head_name)},
        source=_DISCOVERED,
    )


def _check_acyclic(model: nn.Module) -> None:
    """A ValueError (one line) when a module holds, as a submodule, a module that contains it (a back-reference such
    as ``block.owner = model``): torch's own ``train()``, ``eval()``, ``state_dict()`` and ``repr`` recurse forever on
    such a graph, and "inside the blocks" has no meaning. Walked without recursion: depth-first, each module's
    children once, with the modules on the current path kept to tell a cycle from a module shared by two parents."""
    on_path: set[int] = set()
    done: set[int] = set()
    stack: list[tuple[str, nn.Module, bool]] = [("", model, False)]
    while stack:
        name, module, leaving = stack.pop()
        if leaving:
            on_path.discard(id(module))
            done.add(id(module))
            continue
        if id(module) in on_path:
            raise ValueError(
                f"{type(model).__name__} has a cycle of submodules: {name} is a {type(module).__name__} that "
                "contains it, so torch's train(), eval() and state_dict() recurse forever; keep such a "
                "back-reference outside the module tree (a weakref, or object.__setattr__(obj, name, value))")
        if id(module) in done:
            continue  # shared by two parents (tied modules): walked once
        on_path.add(id(module))
        stack.append((name, module, True))
        for child_name, child in module._modules.items():
            if child is not None:
                stack.append((f"{name}.{child_name}" if name else child_name, child, False))


def resolve(model: nn.Module) -> tuple[ArchSpec, str]:
    """The spec and head kind for a transformers task model (not a PeftModel: :func:`unwrap` it first).

    Raises :class:`UnknownArchitectureError` when nothing fits, :class:`RegistryError` when the registry entry for
    this model_type does not fit the model (see :func:`_check_fits`). A shipped entry whose ``blocks`` a variant
    lacks gives way to generic discovery; a user's entry is refused. A module graph with a cycle is a ValueError
    (:func:`_check_acyclic`)."""
    kind = head_kind(model)  # (refuses what is no model at all)
    _check_acyclic(model)
    spec_kind = spec_head(kind)
    model_type = model.config.model_type
    spec = _SPECS.get(model_type)
    if spec is not None and spec_kind in spec.heads and not is_shipped(spec) and not _has_path(model, spec.blocks):
        spec._bad("blocks", f"names {spec.blocks!r}, which {type(model).__name__} does not have; expected the path "
                            "to the ModuleList of its blocks (e.g. 'model.layers')")
    if spec is not None and spec_kind in spec.heads and _has_path(model, spec.blocks):
        _check_fits(model, spec, spec_kind)
        return spec, kind
    discovered = _discover(model, spec_kind)
    if discovered is not None:
        return discovered, kind
    post = _logit_post_processing(model, spec_kind)
    if spec is not None:
        reason = f"its registry entry ({spec.source}) has no {spec_kind!r} head matching {type(model).__name__}"
    elif post:
        reason = (
            f"its config sets logit post-processing ({', '.join(post)}) that generic discovery cannot interpret; "
            "add it as a last head step, e.g. 'softcap:final_logit_softcapping', 'scale:<attr>' or 'divide:<attr>'"
        )
    else:
        reason = "no registry entry names it and generic discovery found no blocks/final norm/head"
    raise UnknownArchitectureError(
        f"model_type {model_type!r} ({type(model).__name__}) is not supported: {reason}. Register it with "
        f"nxl.register_architecture({model_type!r}, blocks='<path to the ModuleList of blocks>', "
        f"heads={{{spec_kind!r}: ['<final norm path>', '<head path>']}}), or add a registry/*.toml entry "
        "(see docs/adding-an-architecture.md)."
    )


_load_builtin()
