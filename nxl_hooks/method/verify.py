"""The registry oracle: a user's registry entry is run once against the model it describes before anything is
recorded with it, so an entry that gives wrong numbers is refused rather than recorded.

    check_numbers(model, spec, kind, head, block_list)   # RegistryError naming the entry and key, else None

On a small random input (one row of 6 tokens, no pad token) the model runs once with a forward hook on every
block: each block must run exactly once; each module its ``layer_outputs`` names too, called with block l's output
as an argument and its output an argument of block l + 1's call (the data flow seen in the forward, not a shape);
and the head-on-top the entry describes (:class:`~.head.Head`, applied to h[L], the last block's raw output or what
the entry names in its place) must equal the model's own logits. The shipped ``registry/*.toml`` entries are tested
per family against a hand-written oracle (tests/oracle.py) on transformers' own classes and are not run here for
them, so attach stays cheap (:func:`~nxl_hooks.arch.registry.is_tested`); a shipped entry on any other class (a
subclass, remote code reusing the model type), a user's entry, and generic discovery's guess for a model no entry
names (a new family may scale its logits in a way no config value tells), are run at their first attach per model
class, head kind and config (a config value can change the head-on-top: Gemma 2's softcap).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping

import torch
from torch import nn

from ..arch.calls import SHORT
from ..arch.registry import (ArchSpec, HeadKind, RegistryError, UnknownArchitectureError, is_discovered, is_tested,
                             layer_modules, spec_head, split_post_steps, word_embedding)
from .head import Head
from .placement import module_device
from .select import pad_token_id

__all__ = ["check_numbers"]

_SEQ = 6  #: tokens of the random input
#: max |HoT - model logits| allowed, relative to (1 + max |logit|): float32 runs agree to ~1e-6. A wrong module or
#: config value misses by the logits' own scale, or (a softcap left out, its cap far above the logits) by a few of
#: their ulps.
_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
#: ... and in a 16-bit dtype, this many of its epsilons (2 to 4 of its ulps at the largest logit): the head runs the
#: model's own modules and steps in its dtype on the same hidden states, so the shipped entries reproduce bf16 / fp16
#: logits exactly; 5% (about 6 bf16 ulps) let a Gemma 2 entry without its softcap pass in bf16, 3 ulps off.
_EPSILONS_16BIT = 2

_POOLED = {"first": 0, "last_non_pad": -1}  # the random input has no pad token
_POOLED_AT = {"first": "first token (CLS)", "last_non_pad": "last non-pad token"}

#: (id of the spec, model class, head kind, digest of the config) -> the spec that passed: held, so that its id stays
#: its own. The config is in the key because the head-on-top depends on it (a softcap set on one model of a class and
#: not on another): a pass on one config says nothing of another.
_checked: dict[tuple[int, type, str, str], ArchSpec] = {}
_lock = threading.Lock()


def _block_output(output: object) -> torch.Tensor | None:
    """A block's hidden states: its output, or the first element of the tuple some blocks return (GPT-J, Falcon)."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    return output if isinstance(output, torch.Tensor) else None


def _config_digest(model: nn.Module) -> str:
    """A digest of the model's whole config (sorted JSON; a value JSON cannot hold by its repr)."""
    text = json.dumps(model.config.to_dict(), sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _random_input(model: nn.Module) -> torch.Tensor | None:
    """(1, _SEQ) token ids without the pad token, where the embedding computes; None when the weights are not
    there (meta tensors with no offload hook to bring them in: an empty-weights model cannot run). An offloaded
    model runs: accelerate brings its weights in for each forward."""
    embedding = word_embedding(model)  # (inside a PEFT wrapper of the input embeddings)
    if embedding is None or embedding.num_embeddings < 2:
        return None
    weight, rows = embedding.weight, embedding.num_embeddings
    if weight.is_meta and getattr(embedding, "_hf_hook", None) is None:
        return None
    ids = torch.randint(0, rows, (1, _SEQ), generator=torch.Generator().manual_seed(0))
    pad = pad_token_id(model)
    if isinstance(pad, int):
        ids[ids == pad] = (pad + 1) % rows
    return ids.to(module_device(embedding))


def check_numbers(model: nn.Module, spec: ArchSpec, kind: str, head: Head, block_list: nn.ModuleList) -> None:
    """Run a registry entry once against ``model`` (the task model), see the module docstring.

    Raises :class:`~nxl_hooks.RegistryError` (one line: entry, key, what was found, what was expected)."""
    if is_tested(spec, model):
        return
    key = (id(spec), type(model), kind, _config_digest(model))
    if _checked.get(key) is spec:
        return
    ids = _random_input(model)
    if ids is None:
        return
    # h[l] is read from block l, or from the module the entry's layer_outputs names: each runs once, gives what
    # block l gives, such a module is given block l's output and block l + 1 is given the module's (the data flow
    # itself, seen in the forward: a module that runs once with block-shaped output elsewhere gives no h[l]), and
    # the head applied to h[L] gives the model's logits
    final = len(block_list)
    outputs = {layer: module for layer, module in enumerate(layer_modules(model, spec), start=1)
               if module is not block_list[layer - 1]}
    # ("block", l) / ("layer_outputs", l) -> [times it ran, its output's shape, whether it was given block l's output,
    # whether block l + 1 was given its output] (the last two for layer_outputs only)
    ran: dict[tuple[str, int], list] = {}
    made: dict[tuple[str, int], torch.Tensor | None] = {}  # the same keys -> the output of its last run
    last: list[torch.Tensor | None] = [None]
    # the check's own forward only: at `nxl attach` to a live server, the server's threads run forwards through these
    # hooks meanwhile (they counted as runs of the blocks, and the entry was refused), and one of theirs may call a
    # hook the short way when it is removed (SHORT: TypeError raised into the server's request)
    checking = threading.get_ident()

    def counter(what: str, layer: int, module: nn.Module) -> torch.utils.hooks.RemovableHandle:
        tally = ran.setdefault((what, layer), [0, None, None, None])
        read = layer == final and (what == "layer_outputs" or final not in outputs)

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: object = SHORT) -> None:
            if output is SHORT or threading.get_ident() != checking:
                return
            hidden = _block_output(output)
            tally[0] += 1
            tally[1] = None if hidden is None else tuple(hidden.shape)
            if what == "layer_outputs":
                tally[2] = _given(args, kwargs, made.get(("block", layer)))
            made[(what, layer)] = hidden
            if read:
                last[0] = hidden
        return module.register_forward_hook(hook, with_kwargs=True)

    def taken(layer: int) -> torch.utils.hooks.RemovableHandle:  # block l + 1 takes what layer_outputs l gives
        tally = ran[("layer_outputs", layer)]

        def hook(module: nn.Module, args: tuple, kwargs: dict = SHORT) -> None:
            if kwargs is not SHORT and threading.get_ident() == checking:
                tally[3] = _given(args, kwargs, made.get(("layer_outputs", layer)))
        return block_list[layer].register_forward_pre_hook(hook, with_kwargs=True)

    handles = [counter("block", layer, block) for layer, block in enumerate(block_list, start=1)]
    handles += [counter("layer_outputs", layer, module) for layer, module in outputs.items()]
    handles += [taken(layer) for layer in outputs if layer < final]
    training = {module: module.training for module in model.modules()}
    model.eval()  # dropout would make the model's logits differ from a head applied by hand
    try:
        with torch.no_grad():
            output = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in training.items():
            module.training = mode
    try:
        _compare(model, spec, kind, head, ran, last[0], output)
    except RegistryError as error:
        if not is_discovered(spec):
            raise
        found = str(error).split(": ", 1)[-1]
        raise UnknownArchitectureError(
            f"model_type {model.config.model_type!r} ({type(model).__name__}) is not supported: generic discovery's "
            f"guess of its layout is not confirmed by its own numbers ({found}). Register it with "
            f"nxl.register_architecture({model.config.model_type!r}, blocks=..., heads=...) naming its head-on-top "
            "step by step, or add a registry/*.toml entry (see docs/adding-an-architecture.md)") from None
    with _lock:
        _checked[key] = spec


def _own_logits(output: object) -> torch.Tensor | None:
    """The model's own logits in what its forward returned: a ModelOutput's (or a dict's) ``logits``, or the first
    element of a tuple, where transformers' task models put them when no loss is computed (a config with
    ``return_dict=False``, remote code or an export wrapper returning ``to_tuple()``); None when there are none."""
    if isinstance(output, Mapping):  # (a ModelOutput is one)
        logits = output.get("logits")
    elif isinstance(output, (tuple, list)) and output:
        logits = output[0]
    else:
        logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def _given(args: tuple, kwargs: dict, tensor: torch.Tensor | None) -> bool:
    """Whether a module call's inputs hold ``tensor``: that object, or one equal to it (a wrapper may move it)."""
    return tensor is not None and any(
        value is tensor or (isinstance(value, torch.Tensor) and value.shape == tensor.shape
                            and value.dtype == tensor.dtype and torch.equal(value, tensor.to(value.device)))
        for value in (*args, *kwargs.values()))


def _differs(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> float | bool:
    """False when ``got`` equals ``expected`` within the tolerance of ``dtype``, the one the head computes in; else how
    far apart they are (inf for another shape or a value that is not finite)."""
    if got.shape != expected.shape or not torch.isfinite(got).all():
        return float("inf")
    tolerance = _TOLERANCE.get(dtype) or _EPSILONS_16BIT * torch.finfo(dtype).eps
    difference = float((got.to(expected.device) - expected).abs().max())
    return False if difference <= tolerance * (1.0 + float(expected.abs().max())) else difference


def _mean_pooled(head: Head, hidden: torch.Tensor, got: torch.Tensor, expected: torch.Tensor,
                 dtype: torch.dtype) -> bool:
    """Whether the model's logits are its head-on-top applied to the mean of the tokens' hidden states, or the mean
    of the head's logits at every token (the two differ where the head is not linear: a pooler's tanh): a pooling no
    entry can name, so that the refusal names the pooling rather than the head's steps."""
    with torch.no_grad(), head.reading() as readout:
        of_mean = readout.logits(head.features(hidden.mean(1, keepdim=True)))[:, 0]
    return any(_differs(pooled, expected, dtype) is False for pooled in (of_mean, got.mean(1)))


def _compare(model: nn.Module, spec: ArchSpec, kind: str, head: Head, ran: dict[tuple[str, int], list],
             hidden: torch.Tensor | None, output: object) -> None:
    where = f"registry entry [{spec.name}] in {spec.source}"
    name, heads_key = type(model).__name__, f"heads.{spec_head(kind)}"
    for (what, layer), (times, shape, given, passed) in ran.items():
        if what == "block" and times != 1:
            raise RegistryError(f"{where}: key 'blocks' names {spec.blocks!r}, whose block {layer - 1} ran {times} "
                                f"times in one forward of {name}; expected the ModuleList of blocks that each run once")
        if what != "layer_outputs":
            continue
        expected, following = ran[("block", layer)][1], ("block", layer + 1) in ran
        found = (f"ran {times} times" if times != 1 else f"gives outputs of shape {shape}" if shape != expected
                 else f"is not given block {layer}'s output" if not given
                 else f"gives an output block {layer + 1} is not given" if following and not passed else None)
        if found is not None:
            raise RegistryError(f"{where}: key 'layer_outputs.{layer}' names {spec.layer_outputs[layer]!r}, which "
                                f"{found} in one forward of {name}; expected a module the backbone runs once on "
                                f"block {layer}'s output, giving its shape {expected}"
                                f"{f', whose output block {layer + 1} takes' if following else ''}")
    # refused, not passed unchecked: a pass is cached per class and config, and an entry never compared with the
    # model's own numbers would be recorded with whatever they are off by (a tuple output once skipped the check)
    logits = _own_logits(output)
    if hidden is None or logits is None:
        found = ("no hidden states tensor at its last layer" if hidden is None
                 else f"its forward returns {type(output).__name__} with no logits tensor")
        raise RegistryError(f"{where}: cannot be checked against {name}'s own logits on a random input ({found}); "
                            "expected a forward that returns its logits (a ModelOutput's logits, or first in a tuple)")
    steps = list(spec.heads[spec_head(kind)])
    try:
        with torch.no_grad(), head.reading() as readout:
            got = readout.logits(head.features(hidden))
    except (RuntimeError, TypeError, ValueError) as error:  # shapes that do not chain: a step of another width
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise RegistryError(f"{where}: key {heads_key!r} ({steps}) cannot be applied to the output of the last block "
                            f"of {name} ({first}); expected the modules of its head-on-top, in order") from None
    expected = logits.float()
    dtype = next(head.readout.parameters(), hidden).dtype
    if not dtype.is_floating_point:  # a quantized readout (int8 weights) computes in the activations' dtype
        dtype = hidden.dtype
    if HeadKind(kind).pooled:
        other, pooled = ("last_non_pad" if spec.pooling == "first" else "first"), got[:, _POOLED[spec.pooling]]
        if (_differs(pooled, expected, dtype) is not False
                and _differs(got[:, _POOLED[other]], expected, dtype) is False):
            raise RegistryError(f"{where}: key 'pooling' is {spec.pooling!r}, but {name} reads its prediction at "
                                f"the {_POOLED_AT[other]}; expected {other!r}")
        if _differs(pooled, expected, dtype) is not False and _mean_pooled(head, hidden, got, expected, dtype):
            raise RegistryError(f"{where}: key 'pooling' is {spec.pooling!r}, but {name} pools the mean of its "
                                "tokens (the entry's head applied to it reproduces its logits), which no pooling "
                                f"reads; expected a classifier that reads one token ({' or '.join(map(repr, _POOLED))})"
                                ": a mean-pooled one has no token whose prediction the attributions explain")
        got = pooled
    if got.shape != expected.shape:
        raise RegistryError(f"{where}: key {heads_key!r} ({steps}) gives outputs of shape {tuple(got.shape)}; "
                            f"expected {name}'s own logits' shape {tuple(expected.shape)}")
    difference = _differs(got, expected, dtype)
    if difference is not False:
        scale = 1.0 + float(expected.abs().max())
        body, post = split_post_steps(steps)
        raise RegistryError(
            f"{where}: key {heads_key!r} ({steps}) gives logits that differ from {name}'s own by {difference:.3g} "
            f"(largest logit {scale - 1:.3g}) on a random input; expected the model's head-on-top: the blocks' "
            f"output through {' -> '.join(body)}{' then ' + ', '.join(post) if post else ''} must reproduce them "
            "(a wrong module, a wrong config value or a missing step)")
