"""How the installed transformers passes a forward its KV cache and positions, and which of its internals the
engines patch: the one place that knows the calling conventions, so the recorder asks instead of reading keywords.

    where = positions(arguments)       # a backbone forward's bound arguments
    where.past, where.new, where.source # positions past .. past + new - 1, and what said so

Conventions seen (checked on 5.16 to 5.25; the floor is 5.18.0): the cache arrives as ``past_key_values`` up to 5.23
and as ``cache`` from 5.24 (the old name a deprecated alias until 5.40); ``generate`` passes ``cache_position`` up
to 5.23 and only ``position_ids`` from 5.24. Nothing here is a list of versions: the cache is found by what it is
(an object with ``get_seq_length``, whatever its keyword), and positions come from the first source the forward
actually received, in this order: ``cache_position`` (where the model writes its cache), the cache's own length (a
state-space model's cache of recurrent states counts none before 5.25: the positions of the record its forwards
made), else none (a forward without a cache computes every position from 0). ``position_ids`` alone never say where
a sequence starts (a left-padded row starts at 0 wherever it sits), so they are only a check: a forward without a
recognisable cache whose every row starts past position 1 (older versions give pads 1) continues a sequence from
state nxl_hooks cannot see, and :func:`positions` says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CACHE_NAMES", "Positions", "UnfollowedForward", "cache_keyword", "cache_length", "find_cache", "positions",
           "prefix_cache", "seen_keys", "start", "token_mask"]

#: The keywords a KV cache has arrived under, newest first. Only an order to look in: :func:`find_cache` also finds
#: one under a name not listed here.
CACHE_NAMES = ("cache", "past_key_values")


class UnfollowedForward(RuntimeError):
    """A forward whose positions nxl_hooks cannot tell: the message says what it received and what it lacks."""


@dataclass(frozen=True)
class Positions:
    """Where a forward's tokens sit in their sequence: ``past`` positions already cached, ``new`` ones now."""

    past: int
    new: int
    source: str  #: what said so: "cache_position", "cache" (its own length) or "no cache"


def _is_cache(value: Any) -> bool:
    return callable(getattr(value, "get_seq_length", None)) and not isinstance(value, (torch.Tensor, type))


def find_cache(arguments: dict[str, Any]) -> Any | None:
    """The KV cache a forward received (None without one): under a known keyword first, else any argument that is
    a cache, so a renamed keyword in a transformers not seen yet is still found."""
    for name in CACHE_NAMES:
        value = arguments.get(name)
        if _is_cache(value):
            return value
    return next((value for value in arguments.values() if _is_cache(value)), None)


def cache_keyword(parameters: Any) -> str | None:
    """The keyword under which a model's forward (``parameters``: its signature's) takes a KV cache, of
    :data:`CACHE_NAMES`; None if none."""
    return next((name for name in CACHE_NAMES if name in parameters), None)


def prefix_cache(cache: Any, length: int, config: Any = None) -> Any | None:
    """A new ``DynamicCache`` holding what ``cache`` (a static cache, as ``generate`` left it) holds of positions
    0..length-1, in tensors of its own (a DynamicCache concatenates what it is given: ``cache`` may be let go);
    an empty one for ``length`` 0, of the layers the model ``config`` says (a state-space model's recurrent states,
    sliding windows) where given; None unless every layer of ``cache`` is a full static layer holding them on the
    device (a sliding window keeps other positions there, an offloading cache its layers on the host)."""
    from transformers.cache_utils import DynamicCache, StaticLayer

    if length == 0:
        return DynamicCache(config=config)
    layers = getattr(cache, "layers", None)
    if getattr(cache, "offloading", False):  # its layers wait on the host between uses
        return None
    if not layers or not all(isinstance(layer, StaticLayer) and not layer.is_sliding
                             and isinstance(getattr(layer, "keys", None), torch.Tensor)
                             and layer.keys.dim() == 4 and layer.keys.shape[-2] >= length for layer in layers):
        return None
    prefix = DynamicCache()
    for index, layer in enumerate(layers):
        prefix.update(layer.keys[..., :length, :], layer.values[..., :length, :], index)
    return prefix


def _new_tokens(arguments: dict[str, Any]) -> int:
    reference = arguments.get("input_ids")
    reference = reference if reference is not None else arguments.get("inputs_embeds")
    if not isinstance(reference, torch.Tensor) or reference.dim() < 2:
        raise UnfollowedForward("the forward received neither input_ids nor inputs_embeds of shape (batch, seq)")
    return reference.shape[1]


def _past(arguments: dict[str, Any], held: int | None) -> tuple[int | torch.Tensor | None, str]:
    """How many positions precede a forward's tokens, as the forward says it, unread (a device tensor stays one),
    and where that came from: ``cache_position``'s first entry, else the cache's own length (:func:`cache_length`,
    given ``held``); None without either."""
    cache_position = arguments.get("cache_position")
    if isinstance(cache_position, torch.Tensor) and cache_position.numel():
        return cache_position.reshape(-1)[0], "cache_position"
    cache = find_cache(arguments)
    return (cache_length(cache, held), "cache") if cache is not None else (None, "no cache")


def cache_length(cache: Any, held: int | None = None) -> int | torch.Tensor:
    """How many positions ``cache`` holds, as it says (an int, or a static cache's device tensor, or from
    transformers 5.25 a state-space model's). Before 5.25 a cache of recurrent states only (transformers' of a
    state-space model: Mamba, Mamba-2, FalconMamba) counts none: 0 before
    it has taken in any token, else ``held``, the positions of the record its forwards made (a ``generate`` call's,
    whose every forward was followed from its empty cache), read on the host without the device; without ``held``
    (None, or 0: no record followed what filled it), :class:`UnfollowedForward` (the tokens it took in are
    unknown)."""
    try:
        return cache.get_seq_length()
    except ValueError:  # transformers' "can only be called on Attention layers": recurrent states only
        if not cache.has_previous_state():
            return 0
        if not held:
            raise UnfollowedForward(
                f"its cache ({type(cache).__name__}) holds recurrent states (a state-space model's) that took in "
                "tokens of forwards nxl_hooks did not follow, and does not count them, so where the forward's "
                "tokens sit is unknown: run the whole sequence in one forward, or generate from the full prompt "
                "without a filled cache") from None
        return held


def positions(arguments: dict[str, Any], held: int | None = None) -> Positions:
    """Where the tokens of a forward called with ``arguments`` (a backbone's bound arguments) sit in their sequence;
    ``held``: the positions its record holds (:func:`cache_length`); :class:`UnfollowedForward` when the forward
    continues a sequence but says nowhere from which position."""
    new = _new_tokens(arguments)
    past, source = _past(arguments, held)
    if past is not None:
        return Positions(int(past), new, source)
    position_ids = arguments.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() >= 2 and position_ids.numel():
        first = int(position_ids[..., 0].min())  # a left-padded prompt row starts at 0 (or 1 in older versions)
        if first > 1:
            raise UnfollowedForward(
                f"the forward's position_ids start at {first} in every row, but it received no cache_position and "
                f"no KV cache nxl_hooks recognises (arguments: {', '.join(sorted(arguments))}), so the positions "
                "before it are unknown")
    return Positions(0, new, source)


def start(arguments: dict[str, Any], held: int | None = None) -> tuple[int | torch.Tensor | None, int]:
    """(past, new) of a forward as :func:`positions` finds them, without reading the device: ``past`` is
    ``cache_position``'s first entry, else the cache's own length as the cache gives it (an int for a dynamic cache,
    a device tensor for a static one, ``held`` for one that counts none: :func:`cache_length`), or None when the
    forward has neither; the recorder checks it on the device."""
    return _past(arguments, held)[0], _new_tokens(arguments)


def seen_keys(row: torch.Tensor) -> torch.Tensor:
    """Which keys a row of a 4-D attention mask (its last query's, at some keys) lets the query see, as bool:
    boolean masks as they are, additive ones (the dtype's minimum where masked) above half that minimum."""
    if row.dtype == torch.bool:
        return row
    return row > torch.finfo(row.dtype).min / 2 if row.is_floating_point() else row.bool()


def token_mask(attention_mask: torch.Tensor | dict[str, torch.Tensor] | None, past: int, new: int
               ) -> torch.Tensor | None:
    """Which of a forward's ``new`` tokens (at positions ``past`` ..) are real, not padding: (batch, new) bool on the
    mask's device, read from the mask in the shape it arrived in, never on the host. 2-D (batch, keys): as users
    and ``generate`` with a dynamic cache pass it. 4-D (batch, 1, queries, keys): what ``generate`` builds for a
    static cache, boolean or additive (the dtype's minimum where masked), its keys from position 0 on, or (a sliding
    window's static cache, once full) those of the window that ends at the forward's last token. A token is real
    where the last query sees it, or it sees itself: a padding token is seen by no query, itself included, and a
    real one may be out of the last query's window, or the last query padding. A dict of them by layer type (a
    model whose layers attend differently, e.g. Gemma 2: ``full_attention``, ``sliding_attention``): its
    full-attention mask. None: no mask (every token real). :class:`UnfollowedForward` for a mask that covers none of
    the forward's tokens."""
    if isinstance(attention_mask, dict):
        attention_mask = attention_mask.get("full_attention", next(iter(attention_mask.values()), None))
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return attention_mask[:, -new:].bool()
    keys = attention_mask.shape[-1] if attention_mask.dim() == 4 else 0
    if keys >= new:
        first = past if keys >= past + new else keys - new
        block = attention_mask[:, 0, :, first:first + new]  # (batch, queries, the forward's tokens as keys)
        seen = seen_keys(block[:, -1])
        return seen | seen_keys(block.diagonal(dim1=1, dim2=2)) if block.shape[1] == new else seen
    raise UnfollowedForward(f"the forward's attention mask of shape {tuple(attention_mask.shape)} does not cover "
                            f"positions {past}..{past + new - 1}, so its padding is unknown")


#: What the continuous-batching engine (:mod:`.engines.transformers_cb`) wraps: (module of
#: ``transformers.generation.continuous_batching``, class, method). Each is checked to exist where it is defined
#: before anything is wrapped; the layout of every eager packed forward is then checked against what it received.
CONTINUOUS_BATCHING = (("continuous_api", "ContinuousBatchProcessor", "_generation_step"),
                       ("requests", "RequestState", "update_and_check_completion"),
                       ("continuous_api", "ContinuousBatchingManager", "__init__"),
                       ("continuous_api", "ContinuousBatchProcessor", "warmup"),
                       ("continuous_api", "ContinuousBatchProcessor", "fail_all_requests"),
                       ("continuous_api", "ContinuousBatchProcessor", "prepare_next_batch"))
#: What ``transformers serve``'s ``GenerateManager`` (``transformers.cli.serving.utils``) must have for request ids
#: to reach ``generate``: the two handlers that know the id, and the two ways they hand work to the inference thread.
SERVE_HANDLERS, SERVE_SUBMITS = ("generate_streaming", "generate_non_streaming"), ("submit", "async_submit")
#: From transformers 5.25, ``transformers serve`` runs each model in a process of its own, which its API servers
#: number their requests to: the id reaches a request's ``generate`` call through these. In the API server, the
#: middleware that knows the id (``transformers.cli.serving.utils``) and the client's two ways of asking for
#: generated text (``EngineClient``, ``transformers.cli.serving.model_manager``); in the model's process, the
#: runners whose ``generate(request_id, inputs, generation_kwargs, stream)`` takes each request (``utils``).
SERVE_MIDDLEWARE, SERVE_CLIENT, SERVE_RUNNERS = "RequestIdMiddleware", "EngineClient", ("GenerateRunner",
                                                                                        "CBGenerateRunner")


def continuous_batching_classes() -> tuple[list[type], str | None]:
    """The classes of :data:`CONTINUOUS_BATCHING`, in its order, or ``[]`` and why continuous batching cannot be
    followed with the installed transformers (not importable, or a method moved or renamed)."""
    import importlib

    import transformers

    found, missing = [], []
    for module, name, method in CONTINUOUS_BATCHING:
        try:
            owner = getattr(importlib.import_module(f"transformers.generation.continuous_batching.{module}"), name)
        except (ImportError, AttributeError) as error:
            return [], f"transformers' continuous batching is not importable ({error})"
        found.append(owner)
        if not callable(vars(owner).get(method)):
            missing.append(f"{name}.{method}")
    if missing:
        return [], (f"transformers {transformers.__version__} has no {', '.join(missing)} (its continuous-batching "
                    "internals changed)")
    return found, None
