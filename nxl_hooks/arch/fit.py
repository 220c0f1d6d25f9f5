"""What only a model can tell about a spec: :func:`check_fits` (the entry fits the model's modules and config),
:func:`final_norm` and :func:`check_acyclic`. ``check_fits(model, spec, "causal_lm")`` raises RegistryError."""

from __future__ import annotations

import difflib
import inspect
import math

import torch
from torch import nn

from .spec import (FUNCTION_STEPS, POST_STEPS, ArchSpec, HeadKind, get_path, has_path, readout_outputs,
                   word_embedding)

__all__ = ["base_prefix", "check_acyclic", "check_fits", "final_norm", "takes_input_ids"]

#: The names a final norm goes by (``layer_norm``: the fairseq-derived decoders, XGLM, MBart, Pegasus, BioGPT)
_FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "final_norm", "layer_norm")


def base_prefix(model: nn.Module) -> str | None:
    """The attribute under which a task model holds its base model (``model``, ``bert``), or None when it holds none
    as a child. Where ``base_model_prefix`` names an attribute the model does not have (Llama4ForCausalLM names
    ``language_model`` but holds ``model``), transformers' ``base_model`` is the task model itself: then it is the
    one child that holds the ModuleList of num_hidden_layers blocks."""
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module):
        return None
    if base is not model:
        return next((n for n, m in model.named_children() if m is base), None)
    config = getattr(model, "config", None)
    n_layers = getattr(config.get_text_config(), "num_hidden_layers", None) if config is not None else None
    holders = [name for name, child in model.named_children()
               if any(isinstance(m, nn.ModuleList) and len(m) == n_layers and m is not child for m in child.modules())]
    return holders[0] if n_layers and len(holders) == 1 else None


def final_norm(model: nn.Module, blocks: str | None) -> tuple[str, nn.Module] | None:
    """(path, module) of the final norm a decoder keeps beside its ``blocks`` (a path), when it has one of the known
    names: in the module that holds the blocks (``model.norm``, ``transformer.ln_f``, OPT's
    ``model.decoder.final_layer_norm``, MBart's ``model.decoder.layer_norm``) or right under its base model."""
    prefix = base_prefix(model)
    holders = [blocks.rpartition(".")[0]] if blocks and "." in blocks else []
    for holder in dict.fromkeys(holders + ([prefix] if prefix is not None else [])):
        for name in _FINAL_NORM_NAMES:
            module = getattr(get_path(model, holder), name, None) if has_path(model, holder) else None
            if isinstance(module, nn.Module):
                return f"{holder}.{name}", module
    return None


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
    if spec_kind == HeadKind.SEQUENCE_CLASSIFICATION:
        labels = model.config.num_labels
        return {labels}, f"num_labels = {labels}"
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    embedding = word_embedding(model)
    rows = embedding.num_embeddings if embedding is not None else None
    widths = {n for n in (vocab, rows) if isinstance(n, int)}
    return widths, f"the vocabulary size {' or '.join(map(str, sorted(widths)))}"


def _check_post_value(spec: ArchSpec, key: str, step: str, value: object) -> None:
    """A post-processing step's config value: a finite scale / cap, not a token id, count or size. An int is a
    scale too (transformers types Granite's logits_scaling ``float | int``, and a config.json may store 8): what
    tells a token id, count or size apart is the attribute's name."""
    op, _, attribute = step.partition(":")
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        spec._bad(key, f"step {step!r}: config.{attribute} is {spec._short(value)}, not a number (or None to skip "
                       "the step)")
    if attribute.endswith(("_id", "_ids", "_size")) or attribute.startswith(("num_", "n_")):
        spec._bad(key, f"step {step!r}: config.{attribute} is {value!r}, by its name a token id, count or size; "
                       f"expected a {'cap' if op == 'softcap' else 'scale'} such as final_logit_softcapping, "
                       "logit_scale or logits_scaling")
    if not math.isfinite(value) or (value == 0 and op != "scale") or (op == "softcap" and value < 0):
        spec._bad(key, f"step {step!r}: config.{attribute} is {value!r}; expected a finite "
                       f"{'positive' if op == 'softcap' else 'non-zero'} number")


def takes_input_ids(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes input_ids or inputs_embeds, as a backbone's does."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    return bool({"input_ids", "inputs_embeds"} & set(parameters))


def _check_backbone(model: nn.Module, spec: ArchSpec, block_list: nn.Module) -> None:
    """``backbone`` names a module that takes input_ids (or inputs_embeds) and runs the blocks."""
    if spec.backbone is None:
        return
    expected = "expected the module that takes input_ids and runs the blocks (e.g. 'model.decoder')"
    if not has_path(model, spec.backbone):
        spec._bad("backbone", f"names {spec.backbone!r}, which {type(model).__name__} does not have; {expected}")
    found = get_path(model, spec.backbone)
    if not isinstance(found, nn.Module):
        spec._bad("backbone", f"names {spec.backbone!r}, {_found(found)}; {expected}")
    if not any(sub is block_list for sub in found.modules()):
        spec._bad("backbone", f"names {spec.backbone!r}, a {type(found).__name__} that does not contain the blocks "
                              f"{spec.blocks!r}; {expected}")
    if not takes_input_ids(found):
        spec._bad("backbone", f"names {spec.backbone!r}, a {type(found).__name__} whose forward takes no input_ids "
                              f"or inputs_embeds; {expected}")


def _check_layer_outputs(model: nn.Module, spec: ArchSpec, block_list: nn.ModuleList) -> None:
    """Each ``layer_outputs`` entry names a layer 1..L and a module (or None) outside the blocks, run by the backbone
    between two of them."""
    for layer, path in spec.layer_outputs.items():
        key, expected = f"layer_outputs.{layer}", ("expected the module whose output enters the next block "
                                                   "(e.g. 'deberta.encoder.conv')")
        if layer > len(block_list):
            spec._bad(key, f"names layer {layer}, but {spec.blocks!r} holds {len(block_list)} blocks; expected a "
                           f"layer 1..{len(block_list)}")
        if not has_path(model, path):
            spec._bad(key, f"names {path!r}, which {type(model).__name__} does not have; {expected}")
        found = get_path(model, path)
        if found is None:
            continue  # this model runs no such module: block's own output
        if not isinstance(found, nn.Module):
            spec._bad(key, f"names {path!r}, {_found(found)}; {expected}")
        if any(found is sub for sub in block_list.modules()) or any(sub is block_list for sub in found.modules()):
            spec._bad(key, f"names {path!r}, a {type(found).__name__} inside or around the blocks {spec.blocks!r}; "
                           f"{expected}")


def _check_blocks(model: nn.Module, spec: ArchSpec) -> nn.ModuleList:
    found = get_path(model, spec.blocks)
    if not isinstance(found, nn.ModuleList) or not len(found):
        what = "an empty ModuleList" if isinstance(found, nn.ModuleList) else _found(found)
        spec._bad("blocks", f"names {spec.blocks!r}, {what}; expected the ModuleList of the model's blocks (a "
                            "sequence of modules that each run once in the forward, e.g. 'model.layers')")
    return found


def check_fits(model: nn.Module, spec: ArchSpec, spec_kind: str, *, shipped: bool = False) -> None:
    """What only the model can tell about a registry entry (:class:`RegistryError`, one line naming entry, key, what
    was found and what was expected): ``blocks`` is a non-empty ModuleList; every head step names a module outside
    the blocks (or None, or a config value of the right kind: an activation name, a float scale / cap), a path the
    model lacks being a user's typo (a ``shipped`` entry's variant that lacks it is said by the head); the readout
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
        if step in FUNCTION_STEPS:
            continue
        if not has_path(model, step):
            if not shipped:
                _lacked(model, spec, key, step)
            readout = None  # a path a variant lacks: Head says so, naming the step; no earlier step is the readout
            continue
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
    _check_layer_outputs(model, spec, block_list)
    norm = final_norm(model, spec.blocks)
    if norm is None:
        return
    path, module = norm
    for step in steps:
        found = get_path(model, step) if step not in FUNCTION_STEPS and has_path(model, step) else None
        if isinstance(found, nn.Module) and any(sub is module for sub in found.modules()):
            return
    spec._bad(key, f"leaves out the model's final norm {path!r} ({type(module).__name__}): the head-on-top applies it "
                   f"before the readout; add {path!r} as the first step")


def _lacked(model: nn.Module, spec: ArchSpec, key: str, step: str) -> None:
    """A user's head step naming a path the model lacks (a typo, or a function no step is): one line with the closest
    module path and the steps that are no module."""
    close = difflib.get_close_matches(step, [name for name, _ in model.named_modules() if name], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    spec._bad(key, f"step {step!r}: {type(model).__name__} has no module {step!r}{hint}; expected a module path of "
                   f"the head-on-top, a function ({', '.join(map(repr, FUNCTION_STEPS))}) or 'act:<config attribute>'")


def _is_activation(name: str) -> bool:
    from transformers.activations import ACT2FN

    return name in ACT2FN

def check_acyclic(model: nn.Module) -> None:
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
