"""Per-architecture specs: where the blocks are and what the head-on-top (HoT) is made of.

Specs are declarative TOML files in ``registry/`` (shipped inside the wheel as ``nxl_hooks/_registry``).
A model whose ``model_type`` no file names is handled by generic discovery when its layout is the common
one; otherwise :class:`UnknownArchitectureError` says how to register it::

    nxl.register_architecture("mymodel", blocks="model.layers",
                              heads={"causal_lm": ["model.norm", "lm_head"]})
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from torch import nn

from .fit import base_prefix, check_acyclic, check_fits, final_norm, takes_input_ids
from .plugins import ARCHITECTURES, broken, contained, failure, load
from .spec import (FUNCTION_STEPS, HEAD_KINDS, MAX_DEPTH, POST_STEPS, ArchSpec, HeadKind, RegistryError,
                   UnknownArchitectureError, get_path, has_path, head_kind, log_probabilities, readout_outputs,
                   spec_from_mapping, spec_head, split_post_steps, word_embedding)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "ArchSpec",
    "FUNCTION_STEPS",
    "HEAD_KINDS",
    "HeadKind",
    "POST_STEPS",
    "RegistryError",
    "UnknownArchitectureError",
    "blocks",
    "get_path",
    "head_kind",
    "is_discovered",
    "is_shipped",
    "is_tested",
    "layer_modules",
    "log_probabilities",
    "readout_outputs",
    "split_post_steps",
    "load_file",
    "register_architecture",
    "register_file",
    "resolve",
    "spec_head",
    "specs",
    "word_embedding",
]


# Config values that some *ForCausalLM apply to the logits after lm_head. Their meaning varies by family
# (HyperCLOVA X multiplies by logits_scaling, Granite divides by it), so discovery refuses such a model
# rather than give numbers that miss the model's own logits; a registry entry names the step. (RecurrentGemma
# softcaps by logits_soft_cap.)
_LOGIT_POST_ATTRIBUTES = ("final_logit_softcapping", "logits_soft_cap", "logit_scale", "logits_scaling",
                          "lm_head_multiplier", "logits_mup_width_multiplier")

_DISCOVERED = "generic discovery"

_SPECS: dict[str, ArchSpec] = {}


def register_architecture(
    name: str,
    *,
    blocks: str,
    heads: Mapping[str, Sequence[str]],
    model_types: Sequence[str] | None = None,
    **options: str | Mapping[int | str, str] | None,
) -> ArchSpec:
    """Register (or replace) an architecture at run time; same fields as a ``registry/*.toml`` entry.

    ``nxl.register_architecture("mymodel", blocks="model.layers", heads={"causal_lm": ["model.norm", "lm_head"]})``
    Raises :class:`RegistryError` for an entry that breaks the schema.
    """
    fields = {"blocks": blocks, "heads": heads, **options}
    if model_types is not None:
        fields["model_types"] = model_types
    return _add(spec_from_mapping(name, fields, source="register_architecture()"))


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
                            f"{MAX_DEPTH} levels") from None
    return [spec_from_mapping(name, table, source=str(path)) for name, table in tables.items()]


def register_file(path: str | Path) -> list[ArchSpec]:
    """Load every ``[name]`` table of a TOML file as an architecture spec (all or none of them).

    ``nxl.register_file("my_arch.toml")``; raises :class:`RegistryError` as :func:`load_file`.
    """
    return [_add(spec) for spec in load_file(path)]


def _registry_dir() -> Path:
    package = Path(__file__).resolve().parent.parent
    shipped = package / "_registry"  # inside an installed wheel
    return shipped if shipped.is_dir() else package.parent / "registry"  # source checkout / editable install


#: id() -> the specs of the shipped registry files, tested against the oracle per family: held, so that a user's
#: spec never takes the id of a shipped one it replaced (and skips the check of its numbers)
_SHIPPED: dict[int, ArchSpec] = {}


def _load_builtin() -> None:
    for path in sorted(_registry_dir().glob("*.toml")):
        _SHIPPED.update((id(spec), spec) for spec in register_file(path))


def is_shipped(spec: ArchSpec) -> bool:
    """Whether ``spec`` is one of the shipped ``registry/*.toml`` entries (tested per family), not a user's
    registration nor generic discovery: ``is_shipped(specs()["llama"])``."""
    return _SHIPPED.get(id(spec)) is spec


#: Where transformers defines its own model classes; remote code loads as ``transformers_modules.*``.
_TRANSFORMERS_MODELS = "transformers.models."


def is_tested(spec: ArchSpec, model: nn.Module) -> bool:
    """Whether ``spec`` is a shipped entry and ``model``'s class transformers' own class of a model type the entry
    names: the pairs tested per family against the oracle. A subclass, a remote-code class or any other class may
    compute its logits otherwise (the ``model_type`` it reuses says nothing of its forward), so a shipped entry is
    checked against such a model's own numbers as a user's entry is: ``is_tested(specs()["llama"], model)``."""
    cls = type(model)
    own_type = getattr(getattr(cls, "config_class", None), "model_type", None)
    return is_shipped(spec) and cls.__module__.startswith(_TRANSFORMERS_MODELS) and own_type in spec.model_types


def is_discovered(spec: ArchSpec) -> bool:
    """Whether ``spec`` is generic discovery's guess of a model's layout (checked against the model's own logits
    at its first attach, as a user's entry is): ``is_discovered(spec)``."""
    return spec.source == _DISCOVERED


def specs() -> dict[str, ArchSpec]:
    """All registered specs by ``model_type``. ``nxl_hooks.arch.registry.specs()["llama"].blocks``"""
    return dict(_SPECS)


def blocks(model: nn.Module, spec: ArchSpec) -> nn.ModuleList:
    """The blocks a spec names: their count is the model's L everywhere (layers 0..L, negative layer numbers)."""
    return get_path(model, spec.blocks)


def layer_modules(model: nn.Module, spec: ArchSpec) -> list[nn.Module]:
    """The module whose output is h[l], for l = 1..L: block l, unless the spec's ``layer_outputs`` names the module
    the backbone runs on it before the next block (and the model has one). ``layer_modules(model, spec)[0]``"""
    found = list(blocks(model, spec))
    for layer, path in spec.layer_outputs.items():
        module = get_path(model, path)
        if module is not None:
            found[layer - 1] = module
    return found


def _logit_post_processing(model: nn.Module, kind: HeadKind) -> list[str]:
    """The ``attr=value`` logit post-processing settings a causal LM's config sets (see above)."""
    config = model.config.get_text_config()
    causal = kind is HeadKind.CAUSAL_LM
    found = [(name, getattr(config, name, None)) for name in _LOGIT_POST_ATTRIBUTES] if causal else []
    return [f"{name}={value}" for name, value in found if value is not None]


def _block_path(model: nn.Module) -> str | None:
    """The path of the ModuleList of num_hidden_layers blocks under the base model (the common layout), if any."""
    n_layers, prefix = getattr(model.config.get_text_config(), "num_hidden_layers", None), base_prefix(model)
    if n_layers is None or prefix is None:
        return None
    return next((f"{prefix}.{n}" for n, m in getattr(model, prefix).named_modules()
                 if isinstance(m, nn.ModuleList) and len(m) == n_layers), None)


#: Where torch and transformers define their activation modules (nn.Tanh, GELUActivation)
_ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")
#: An activation module's function step, where it computes exactly that function (as a module step, a module
#: without weights would compute where no weights tell: on the CPU)
_ACTIVATION_STEPS = {nn.Tanh: "tanh", nn.ReLU: "relu"}


def _activation_step(model: nn.Module, module: nn.Module) -> str | None:
    """The step of an activation module (BERT's pooler tanh, its MLM transform's ACT2FN[hidden_act]):
    ``act:hidden_act`` for the class the config's activation builds, else a function step, else None."""
    from transformers.activations import ACT2FN

    configured = getattr(model.config, "hidden_act", None)
    if isinstance(configured, str) and configured in ACT2FN and type(module) is type(ACT2FN[configured]):
        return "act:hidden_act"
    if type(module) is nn.GELU and module.approximate == "none":
        return "gelu"
    return _ACTIVATION_STEPS.get(type(module))


def _reads_first(model: nn.Module, post_ln: bool) -> bool:
    """Whether a classifier of ``model``'s family reads its first token (CLS): an encoder's does, as the families
    transformers builds a masked LM of (ModernBERT, with a final norm), a decoder's reads its last; for a model_type
    transformers does not know, a post-LN encoder's (``post_ln``: no final norm found) does."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    model_type = model.config.model_type
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES or model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    return post_ln


def _template(model: nn.Module, kind: HeadKind) -> str:
    """The registration of ``model``'s layout as its modules tell it, for the refusal to print: its blocks, its final
    norm (none in a post-LN encoder), the first token for an encoder's classifier (:func:`_reads_first`), then the
    modules with weights and the activations registered after the blocks (BERT's pooler dense and tanh, then its
    classifier), a placeholder for what is not found. A function its forward applies with no module (MPNet's tanh),
    or modules registered in another order than they run, are not seen: the entry is checked against the model's own
    logits at attach."""
    blocks = _block_path(model)
    norm = final_norm(model, blocks)
    steps, readout = [norm[0]] if norm is not None else [], False
    skip = {id(sub) for sub in norm[1].modules()} if norm is not None else set()
    modules = list(model.named_modules())
    if blocks is not None:
        skip |= {id(sub) for sub in get_path(model, blocks).modules()}
    start = [path for path, _ in modules].index(blocks) + 1 if blocks is not None else len(modules)
    for path, module in modules[start:]:
        if id(module) in skip or next(module.children(), None) is not None:
            continue
        if type(module).__module__ in _ACTIVATION_MODULES:
            steps.append(_activation_step(model, module) or path)
        elif next(module.parameters(), None) is not None and not isinstance(module, nn.Embedding):  # (MPNet's bias)
            steps.append(path)
            readout = True
    if not readout:
        steps.append("<head path>")
    pooling = ", pooling='first'" if kind.pooled and _reads_first(model, norm is None) else ""
    blocks = blocks or "<path to the ModuleList of blocks>"
    return (f"nxl.register_architecture({model.config.model_type!r}, blocks={blocks!r}{pooling}, "
            f"heads={{{kind.spec_head!r}: {steps!r}}})")


def _discover(model: nn.Module, kind: HeadKind) -> ArchSpec | None:
    """The common decoder layout: one ModuleList of num_hidden_layers blocks, a final norm, a Linear head. Blocks held
    in a module under the base model (MBart's ``model.decoder``, which MBartForCausalLM calls directly, bypassing its
    wrapper's forward) make that module the backbone where it takes input_ids, as OPT's entry names it."""
    config = model.config
    if _logit_post_processing(model, kind):
        return None
    blocks = _block_path(model)
    norm = final_norm(model, blocks)
    if norm is None:
        return None
    head_name = {"causal_lm": "lm_head", "sequence_classification": "score"}.get(kind)
    head = getattr(model, head_name or "", None)
    # a Linear, or PEFT's wrapper of one (LoRA on lm_head; the modules_to_save copy of a SEQ_CLS adapter's score)
    if blocks is None or not isinstance(head, nn.Module) or readout_outputs(head) is None:
        return None
    holder = blocks.rpartition(".")[0]
    backbone = holder if "." in holder and takes_input_ids(get_path(model, holder)) else None
    key = (config.model_type, kind, blocks, norm[0], head_name)
    with _discovered_lock:  # one spec per layout: checked once against the model (method.verify), as an entry is
        return _DISCOVERED_SPECS.setdefault(key, ArchSpec(
            name=f"discovered:{config.model_type}",
            model_types=(config.model_type,),
            blocks=blocks,
            backbone=backbone,
            heads={kind: (norm[0], head_name)},
            source=_DISCOVERED,
        ))


_DISCOVERED_SPECS: dict[tuple, ArchSpec] = {}
_discovered_lock = threading.Lock()


def _from_plugin(model_type: str) -> ArchSpec | None:
    """The spec the ``nxl_hooks.architectures`` plugin named ``model_type`` gives (:mod:`nxl_hooks.arch.plugins`):
    its object is a function that registers the architecture, or returns specs or a TOML file's path, or is such a
    value itself.
    A plugin that fails, or gives no entry for ``model_type``, is one log line (the loader's), and the model is
    resolved as if it were not installed. A plugin only adds model types: an entry it gives for one that an entry
    names already (shipped, registered in code) is left out with one line, since attaching one model must not
    change how every other family is read. What it adds names the plugin as its source, for the messages."""
    found = load(ARCHITECTURES, model_type)
    if found is None:
        return None
    before = dict(_SPECS)
    try:
        found = found() if callable(found) else found
        if isinstance(found, (str, os.PathLike)):
            register_file(found)
        elif found is not None:
            # anything else it gave (a number, a dict) is named as it gave it, not as an error iterating it
            specs = [found] if isinstance(found, ArchSpec) else list(found) if isinstance(found, Iterable) else [found]
            if not all(isinstance(spec, ArchSpec) for spec in specs):
                raise TypeError(f"it gave {found!r:.80}; expected ArchSpecs, a TOML file's path, or None (after "
                                "calling nxl.register_architecture)")
            for spec in specs:
                _add(spec)
    except BaseException as error:  # noqa: BLE001 - a broken plugin (SystemExit too) is its line, not the user's
        broken(ARCHITECTURES, model_type, contained(error))
        for kind in set(_SPECS) - set(before):  # a failed plugin leaves nothing behind, as if it were not installed
            del _SPECS[kind]
        _SPECS.update(before)
        return None
    given = {kind: spec for kind, spec in _SPECS.items() if before.get(kind) is not spec}
    plugin, named = f"plugin {model_type!r} ({ARCHITECTURES})", {}
    kept = [kind for kind in given if kind in before]
    for kind, spec in given.items():
        _SPECS[kind] = before[kind] if kind in before else named.setdefault(id(spec), dataclasses.replace(
            spec, source=f"{plugin[:-1]}, {spec.source})" if spec.source else plugin))
    if kept:
        logging.getLogger("nxl_hooks").warning(
            "nxl_hooks: %s also gave entries for %s, which the registry names already: those are kept (a plugin "
            "adds model types no entry names)", plugin, ", ".join(map(repr, kept)))
    if model_type not in _SPECS:
        others = f" (only for {', '.join(map(repr, given))})" if given else ""
        broken(ARCHITECTURES, model_type, LookupError(f"it gave no entry for model_type {model_type!r}{others}"))
    return _SPECS.get(model_type)


def resolve(model: nn.Module) -> tuple[ArchSpec, HeadKind]:
    """The spec and head kind for a transformers task model (unwrapped: :func:`nxl_hooks.method.subject.unwrap`).

    A ``model_type`` with no registry entry asks the ``nxl_hooks.architectures`` plugin of that name, if one is
    installed (:func:`_from_plugin`). Raises :class:`UnknownArchitectureError` when nothing fits,
    :class:`RegistryError` when the registry entry for this model_type does not fit the model (see
    :func:`~nxl_hooks.arch.fit.check_fits`). A shipped entry whose ``blocks`` a variant lacks gives way to generic
    discovery; a user's entry is refused. A module graph with a cycle is a ValueError
    (:func:`~nxl_hooks.arch.fit.check_acyclic`)."""
    kind = head_kind(model)  # (refuses what is no model at all)
    check_acyclic(model)
    spec_kind = kind.spec_head
    model_type = model.config.model_type
    spec = _SPECS.get(model_type) or _from_plugin(model_type)
    if spec is not None and spec_kind in spec.heads and not is_shipped(spec) and not has_path(model, spec.blocks):
        spec._bad("blocks", f"names {spec.blocks!r}, which {type(model).__name__} does not have; expected the path "
                            "to the ModuleList of its blocks (e.g. 'model.layers')")
    if spec is not None and spec_kind in spec.heads and has_path(model, spec.blocks):
        check_fits(model, spec, spec_kind, shipped=is_shipped(spec))
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
    elif (plugin_failed := failure(ARCHITECTURES, model_type)) is not None:
        # the model's own plugin is installed: that it failed, said only in a log line, is what to fix
        reason = f"no registry entry names it, and its {plugin_failed}"
    else:
        reason = "no registry entry names it and generic discovery found no blocks/final norm/head"
    raise UnknownArchitectureError(
        f"model_type {model_type!r} ({type(model).__name__}) is not supported: {reason}. Register it with "
        f"{_template(model, kind)} (the paths its modules show: add a function its forward applies between "
        "them with no module, such as 'tanh'), or add a registry/*.toml entry (see docs/adding-an-architecture.md)."
    )


_load_builtin()
