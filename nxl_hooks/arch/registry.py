"""Per-architecture specs: where the blocks are and what the head-on-top (HoT) is made of.

Specs are declarative TOML files in ``registry/`` (shipped inside the wheel as ``nxl_hooks/_registry``).
A model whose ``model_type`` no file names is handled by generic discovery when its layout is the common
one; otherwise :class:`UnknownArchitectureError` says how to register it::

    nxl.register_architecture("mymodel", blocks="model.layers",
                              heads={"causal_lm": ["model.norm", "lm_head"]})
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from torch import nn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "ArchSpec",
    "HEAD_KINDS",
    "UnknownArchitectureError",
    "blocks",
    "get_path",
    "head_kind",
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


class UnknownArchitectureError(LookupError):
    """The model's architecture is neither registered nor discoverable."""


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
        unknown = set(self.heads) - set(HEAD_KINDS)
        if unknown:
            raise ValueError(f"spec {self.name!r}: unknown head kind(s) {sorted(unknown)}; use {HEAD_KINDS}")
        if self.pooling not in ("first", "last_non_pad"):
            raise ValueError(f"spec {self.name!r}: pooling must be 'first' or 'last_non_pad'")
        for kind, steps in self.heads.items():
            if not steps:
                raise ValueError(f"spec {self.name!r}: head {kind!r} has no steps")


_SPECS: dict[str, ArchSpec] = {}


def _spec_from_mapping(name: str, data: Mapping, source: str) -> ArchSpec:
    data = dict(data)
    heads = {kind: tuple(steps) for kind, steps in data.pop("heads", {}).items()}
    model_types = tuple(data.pop("model_types", (name,)))
    try:
        return ArchSpec(name=name, model_types=model_types, heads=heads, source=source, **data)
    except TypeError as err:
        raise ValueError(f"registry entry {name!r} in {source}: {err}") from None


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
    """
    spec = _spec_from_mapping(
        name,
        {"blocks": blocks, "heads": heads, "model_types": model_types or (name,), **options},
        source="register_architecture()",
    )
    return _add(spec)


def _add(spec: ArchSpec) -> ArchSpec:
    for model_type in spec.model_types:
        _SPECS[model_type] = spec
    return spec


def register_file(path: str | Path) -> list[ArchSpec]:
    """Load every ``[name]`` table of a TOML file as an architecture spec.

    ``nxl.register_file("my_arch.toml")``
    """
    path = Path(path)
    with path.open("rb") as fh:
        tables = tomllib.load(fh)
    return [_add(_spec_from_mapping(name, table, source=str(path))) for name, table in tables.items()]


def _registry_dir() -> Path:
    package = Path(__file__).resolve().parent.parent
    shipped = package / "_registry"  # inside an installed wheel
    return shipped if shipped.is_dir() else package.parent / "registry"  # source checkout / editable install


def _load_builtin() -> None:
    for path in sorted(_registry_dir().glob("*.toml")):
        register_file(path)


def specs() -> dict[str, ArchSpec]:
    """All registered specs by ``model_type``. ``nxl.registry.specs()["llama"].blocks``"""
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
    except (AttributeError, IndexError):
        return False
    return True


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a PeftModel (the object PEFT forwards through); any other model as is."""
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


def _discover(model: nn.Module, kind: str) -> ArchSpec | None:
    """The common decoder layout: one ModuleList of num_hidden_layers blocks, a final norm, a Linear head."""
    config = model.config
    if _logit_post_processing(model, kind):
        return None
    n_layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    base = model.base_model
    prefix = next((n for n, m in model.named_children() if m is base), None)
    if n_layers is None or prefix is None:
        return None
    blocks = next(
        (f"{prefix}.{n}" for n, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers),
        None,
    )
    norm = next((f"{prefix}.{n}" for n in _FINAL_NORM_NAMES if isinstance(getattr(base, n, None), nn.Module)), None)
    head_name = {"causal_lm": "lm_head", "sequence_classification": "score"}.get(kind)
    if blocks is None or norm is None or not isinstance(getattr(model, head_name or "", None), nn.Linear):
        return None
    return ArchSpec(
        name=f"discovered:{config.model_type}",
        model_types=(config.model_type,),
        blocks=blocks,
        heads={kind: (norm, head_name)},
        source="generic discovery",
    )


def resolve(model: nn.Module) -> tuple[ArchSpec, str]:
    """The spec and head kind for a transformers task model (not a PeftModel: :func:`unwrap` it first)."""
    kind = head_kind(model)
    spec_kind = spec_head(kind)
    model_type = model.config.model_type
    spec = _SPECS.get(model_type)
    if spec is not None and spec_kind in spec.heads and _has_path(model, spec.blocks):
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
        "(see README, 'Adding an architecture')."
    )


_load_builtin()
