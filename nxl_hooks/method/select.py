"""What is explained and what ranks: one copy of each rule, used by attach, generate, evaluate, baselines, audit,
the terminal, HTML and :meth:`Attribution.top`.

    resolve_layers("all", 8)                      # [0, 1, ..., 8]
    prediction_rows("causal_lm", "last_non_pad", input_ids, attention_mask, pad_id=None, mask_id=None)
    resolve_target_id(model, "causal_lm", tok, " Paris", len(tok))
    order(scores, rankable(mask, position, special))   # positions by signed score, best first

- Layers: 0 is the input of block 1, L the output of the last block; negative numbers count from the end.
- Prediction position: the last real token for causal LMs (``attention_mask``), the rightmost non-pad token for
  decoder classifiers (as transformers pools them), CLS for encoders that pool the first token, each mask token
  for masked LMs.
- Ranking: by signed score, descending (authors' code). Padding, the prediction position and special tokens do
  not rank (the authors always drop CLS / [MASK] before ranking); NaN never ranks above a number.
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence, Union

import torch
from torch import nn

__all__ = [
    "Target",
    "explained",
    "is_predicted",
    "layer_index",
    "order",
    "prediction_rows",
    "rankable",
    "resolve_layers",
    "resolve_target_id",
    "special_mask",
    "target_ids",
]

#: What ``attach(target=...)`` takes: "predicted", an id, a token or label string, a list of them, or id tensors.
Target = Union[str, int, Sequence[Union[str, int]], torch.Tensor]

_CLASSIFIERS = ("sequence_classification", "regression")


def _integer(value: Any) -> int | None:
    """``value`` as an int when it is an integer (numpy integers included), else None; bools are not integers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def layer_index(layer: int, n_blocks: int) -> int:
    """One layer number (negative from the end) as an index 0..L; ValueError when out of range."""
    index = _integer(layer)
    if index is None:
        raise ValueError(f"layer {layer!r} is not an int: use 'all', 'last' or ints in 0..{n_blocks} (or negative)")
    wanted = index + n_blocks + 1 if index < 0 else index
    if not 0 <= wanted <= n_blocks:
        raise ValueError(
            f"layer {layer} is out of range: this model has {n_blocks} blocks, so layers are 0..{n_blocks} "
            f"(0 = input of block 1, {n_blocks} = output of the last block) or -{n_blocks + 1}..-1"
        )
    return wanted


def resolve_layers(layers: str | int | Sequence[int], n_blocks: int) -> list[int]:
    """``"all"`` -> 0..L, ``"last"`` -> [L], ints (negative from the end) -> sorted unique layer indices."""
    if isinstance(layers, str):
        if layers == "all":
            return list(range(n_blocks + 1))
        if layers == "last":
            return [n_blocks]
        raise ValueError(f"layers={layers!r}: use 'all', 'last' or a list of ints in 0..{n_blocks}")
    if isinstance(layers, torch.Tensor):
        layers = layers.tolist()
    if _integer(layers) is not None:
        layers = [layers]
    if isinstance(layers, (bool, bytes, bytearray)) or not isinstance(layers, Sequence):
        raise ValueError(f"layers={layers!r}: use 'all', 'last', an int or a list of ints in 0..{n_blocks}")
    if not layers:
        raise ValueError("layers is empty: use 'all', 'last' or a list of ints")
    return sorted({layer_index(layer, n_blocks) for layer in layers})


# -- targets ---------------------------------------------------------------------------------------------


def is_predicted(target: Target) -> bool:
    """Whether ``target`` asks for the model's own prediction (the default)."""
    return isinstance(target, str) and target == "predicted"


def _check_range(ids: torch.Tensor, n_outputs: int) -> None:
    bad = ids[(ids < 0) | (ids >= n_outputs)]
    if bad.numel():
        raise ValueError(f"target {int(bad[0])} is out of range: the head has {n_outputs} outputs (0..{n_outputs - 1})")


def resolve_target_id(model: nn.Module, kind: str, tokenizer: Any, item: str | int, n_outputs: int) -> int:
    """One target or label -> an output id of the head: an int id (range-checked), a label name
    (classification), or one token (LM; a vocabulary entry like "Ġis" first, else text that encodes to
    one known token). ``resolve_target_id(model, "causal_lm", tok, " Paris", len(tok))``; ValueError if bad.
    """
    number = _integer(item)
    if number is not None:
        _check_range(torch.tensor([number]), n_outputs)
        return number
    if not isinstance(item, str):
        raise ValueError(f"target/label {item!r} must be an int id or a string, got {type(item).__name__}")
    label2id = getattr(model.config, "label2id", None) or {}
    if kind in _CLASSIFIERS and item in label2id:
        return int(label2id[item])
    if kind in _CLASSIFIERS:
        raise ValueError(f"label {item!r} is not one of the model's labels {sorted(label2id)}; or pass an int id")
    if tokenizer is None:
        raise ValueError(f"target {item!r} is a string: pass attach(..., tokenizer=tok) to resolve it, or an int id")
    vocab = tokenizer.get_vocab()
    if item in vocab:
        return int(vocab[item])
    ids = tokenizer.encode(item, add_special_tokens=False)
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        raise ValueError(
            f"target {item!r} is not a single token in the vocabulary (it encodes to {len(ids)} id(s) {ids}); "
            "pass one token (see tokenizer.tokenize(text)) or its int id"
        )
    return int(ids[0])


def target_ids(model: nn.Module, kind: str, tokenizer: Any, target: Target, n_outputs: int) -> torch.Tensor:
    """Explicit targets as a (1, k) or (rows, k) id tensor, checked against the head's outputs."""
    if isinstance(target, torch.Tensor):
        if target.dim() > 2:
            raise ValueError(f"a target tensor is (rows,) or (rows, k) label ids, got shape {tuple(target.shape)}")
        if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
            raise ValueError(f"a target tensor holds integer label ids, got dtype {target.dtype}: use .long() on "
                             "ids you meant as integers")
        ids = target.long().reshape(1, 1) if target.dim() == 0 else target.long()
        ids = ids[:, None] if ids.dim() == 1 else ids
        if ids.numel() == 0:
            raise ValueError("the target tensor is empty: give at least one label id per row")
    else:
        items = [target] if isinstance(target, str) or _integer(target) is not None else target
        if isinstance(items, (bool, float, bytes, bytearray)) or not isinstance(items, Sequence):
            raise ValueError(f"target={target!r}: use 'predicted', an int id, a token or label string, a list of "
                             "them, or a tensor of ids")
        if not items:
            raise ValueError("target list is empty: give at least one label or token")
        ids = torch.tensor([[resolve_target_id(model, kind, tokenizer, item, n_outputs) for item in items]])
    _check_range(ids, n_outputs)
    return ids


def explained(fixed: torch.Tensor | None, predicted: torch.Tensor) -> torch.Tensor:
    """The (rows, k) ids a forward or generation step explains: the ``fixed`` targets, else ``predicted`` (rows, 1)."""
    if fixed is None:
        return predicted
    rows = predicted.shape[0]
    if fixed.shape[0] not in (1, rows):
        raise ValueError(
            f"the target tensor has {fixed.shape[0]} rows but this forward explains {rows} rows "
            "(one per example, per [MASK], or per generate row including num_return_sequences)"
        )
    return fixed.to(predicted.device).expand(rows, -1)


# -- where predictions are read --------------------------------------------------------------------------


def prediction_rows(
    kind: str,
    pooling: str,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    *,
    shape: tuple[int, int],
    pad_id: int | None,
    mask_id: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(example, position) of every explained row, on the CPU, for a (batch, seq) input of ``shape``.

    ``mask_id``: the tokenizer's mask token, for masked LMs; ``pad_id``: ``config.pad_token_id``, for decoder
    classifiers. ValueError when a masked-LM input has no mask token or a causal-LM row has no real token.
    """
    batch, seq = shape
    examples = torch.arange(batch)
    if attention_mask is not None and attention_mask.dim() == 2:
        _no_empty_rows(attention_mask.cpu().bool())  # any head: nothing real to explain, whatever it pools
    if kind == "masked_lm":
        if mask_id is None or input_ids is None:
            raise ValueError("masked-LM attribution needs input_ids and attach(..., tokenizer=tok) with a mask token")
        examples, positions = (input_ids.cpu() == mask_id).nonzero(as_tuple=True)
        if examples.numel() == 0:
            raise ValueError("no mask token in the input: nothing to explain")
        return examples, positions
    if kind == "causal_lm" or pooling == "last_non_pad":
        if kind == "causal_lm" and attention_mask is not None and attention_mask.dim() == 2:
            real = attention_mask.cpu().bool()
        elif kind != "causal_lm" and pad_id is not None and input_ids is not None:
            real = input_ids.cpu() != pad_id  # as transformers pools decoder classifiers
        else:
            return examples, torch.full((batch,), seq - 1)
        _no_empty_rows(real)
        return examples, (torch.arange(seq) * real).argmax(-1)
    return examples, torch.zeros(batch, dtype=torch.long)


def _no_empty_rows(real: torch.Tensor) -> None:
    empty = (~real.any(-1)).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"row {int(empty[0])} has no real token (its attention mask is all zeros, or it is all "
                         "padding): there is no prediction to explain; drop empty rows")


# -- what ranks ------------------------------------------------------------------------------------------


def special_mask(input_ids: torch.Tensor, tokenizer: Any) -> torch.Tensor | None:
    """True where ``input_ids`` holds one of the tokenizer's special tokens ([CLS], <s>, chat-template markers)."""
    special = getattr(tokenizer, "all_special_ids", None)
    if not special:
        return None
    return torch.isin(input_ids.cpu(), torch.tensor(sorted(set(special)), dtype=input_ids.dtype))


def rankable(mask: torch.Tensor, position: torch.Tensor | int, special: torch.Tensor | None = None) -> torch.Tensor:
    """Which positions take part in a ranking: real tokens (``mask``), but not the prediction ``position`` and not
    ``special`` tokens. Shapes: (seq,) with an int position, or (rows, seq) with (rows,) positions.

    When nothing would be left (a text of special tokens only), the real tokens but the prediction rank instead.
    """
    eligible = mask.bool().clone()
    position = torch.as_tensor(position)
    if eligible.dim() == 1:
        eligible[int(position)] = False
    else:
        eligible[torch.arange(eligible.shape[0]), position] = False
    if special is None:
        return eligible
    kept = eligible & ~special.bool()
    fallback = ~kept.any(-1, keepdim=True)  # only special tokens besides the prediction: rank them after all
    return torch.where(fallback, eligible, kept)


def order(scores: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Positions where ``eligible`` (1-D), best first by signed score; ties keep token order; NaN comes last."""
    positions = eligible.nonzero().flatten()
    values = scores[positions].float().nan_to_num(nan=float("-inf"))
    return positions[torch.argsort(values, descending=True, stable=True)]
