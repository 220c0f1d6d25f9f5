"""What is explained and what ranks: one copy of each rule, used by attach, generate, evaluate, baselines, audit,
the terminal, HTML and :meth:`Attribution.top`.

    resolve_layers("all", 8)                      # [0, 1, ..., 8]
    prediction_rows("causal_lm", "last_non_pad", input_ids, attention_mask, pad_id=None, mask_id=None)
    resolve_target(model, "causal_lm", tok, "Paris", prompt="The capital of France is")   # ' Paris', the next token
    order(scores, rankable(mask, position, special))   # positions by signed score, best first

- Layers: 0 is the input of block 1, L the output of the last block; negative numbers count from the end.
- Prediction position: the last real token for causal LMs (``attention_mask``), the rightmost non-pad token for
  decoder classifiers (as transformers pools them), CLS for encoders that pool the first token, each mask token
  for masked LMs.
- Targets: an id, a label name, a vocabulary piece, or a word read after the prompt (:func:`resolve_target`); a
  masked LM's in place of each mask.
- Ranking: by signed score, descending (authors' code). Padding, the prediction position, special tokens and a
  chat template's own tokens (its markers and the system prompt) do not rank (the authors always drop CLS / [MASK]
  before ranking; a user asks about their message, not the template around it); NaN never ranks above a number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence, SupportsIndex, Union

import numpy as np
import torch
from torch import nn

from ..arch.registry import HeadKind
from ..arch.values import integer
from .scores import wide

__all__ = [
    "EMBEDDINGS",
    "NO_SPACE_AFTER",
    "VIRTUAL_ID",
    "ResolvedTarget",
    "Layers",
    "Target",
    "TargetOption",
    "check_length",
    "empty_row",
    "explained",
    "from_numpy",
    "is_predicted",
    "label_index",
    "int_text",
    "layer_index",
    "option_text",
    "order",
    "parse_embedding",
    "parse_layers",
    "pad_token_id",
    "parse_target",
    "position_limit",
    "prediction_rows",
    "prompt_targets",
    "rankable",
    "resolve_layers",
    "resolve_target",
    "resolve_target_id",
    "row_index",
    "special_flags",
    "special_ids",
    "special_mask",
    "target_ids",
]

#: What ``attach(target=...)`` takes: "predicted", an id, a token or label string, a list of them, or id tensors.
Target = Union[str, int, Sequence[Union[str, int]], torch.Tensor]
#: ``attach(target=...)`` as a user's code types it: a :data:`Target`, or a numpy integer or array of ids (numpy
#: integers are ints by ``__index__``; an array is read by :func:`from_numpy`)
TargetOption = Union[Target, SupportsIndex, Sequence[SupportsIndex], np.ndarray[Any, Any]]
#: What ``attach(layers=...)`` takes: "all", "last", an int or ints (numpy integers, or an array of them, too)
Layers = Union[str, SupportsIndex, Sequence[SupportsIndex], np.ndarray[Any, Any]]



def int_text(text: str) -> int | None:
    """``text`` as a whole number when it is ASCII digits alone (a leading minus allowed), else None: str.isdigit()
    holds for '²' too (int() refuses it) and for '٣' (Arabic-Indic three, a word of Arabic text), both words here.
    ``int_text("12") == 12``; the rule of every number read from text (an id, a device, a size in bytes)."""
    return int(text) if re.fullmatch(r"-?[0-9]+", text) else None


def layer_index(layer: int, n_blocks: int) -> int:
    """One layer number (negative from the end) as an index 0..L; ValueError when out of range."""
    index = integer(layer)
    if index is None:
        raise ValueError(f"layer {layer!r} is not an int: use 'all', 'last' or ints in 0..{n_blocks} (or negative)")
    wanted = index + n_blocks + 1 if index < 0 else index
    if not 0 <= wanted <= n_blocks:
        raise ValueError(
            f"layer {layer} is out of range: this model has {n_blocks} blocks, so layers are 0..{n_blocks} "
            f"(0 = input of block 1, {n_blocks} = output of the last block) or -{n_blocks + 1}..-1"
        )
    return wanted


def whole_number(value: Any, refusal: str, below: int | None = None, *, least: int = 0) -> int:
    """``value`` as an int of ``least`` or more, and under ``below`` when given (numpy integers too; bools are not
    numbers here); ValueError(``refusal``) otherwise. ``whole_number(np.int64(2), "...", below=3) == 2``."""
    number = integer(value)
    if number is None or number < least or (below is not None and number >= below):
        raise ValueError(refusal)
    return number


def label_index(label: Any, labels: int, what: str = "this attribution") -> int:
    """``label`` as the index of one of the ``labels`` targets explained per row (``what`` explains them);
    ValueError when it picks none."""
    return whole_number(label, f"label {label!r} is out of range: {what} explains {labels} target(s) per row", labels)


def row_index(row: Any, rows: int) -> int:
    """``row`` as the index of one of an attribution's ``rows`` rows (numpy integers too, as ``label``);
    ValueError when it picks none."""
    return whole_number(row, f"row {row!r} is out of range: this attribution has {rows} row(s)", rows)


def resolve_layers(layers: str | int | Sequence[int], n_blocks: int) -> list[int]:
    """``"all"`` -> 0..L, ``"last"`` -> [L], ints (negative from the end) -> sorted unique layer indices (a layer
    named twice, ``[0, 0]`` or ``[-1, L]``, is recorded once: a list computed for models of any depth, such as
    ``[0, L // 2, L]``, names one twice on a shallow one)."""
    if isinstance(layers, str):
        if layers == "all":
            return list(range(n_blocks + 1))
        if layers == "last":
            return [n_blocks]
        raise ValueError(f"layers={layers!r}: use 'all', 'last' or a list of ints in 0..{n_blocks}")
    if isinstance(layers, torch.Tensor):
        layers = layers.tolist()
    if integer(layers) is not None:
        layers = [layers]
    if isinstance(layers, (bool, bytes, bytearray)) or not isinstance(layers, Sequence):
        raise ValueError(f"layers={layers!r}: use 'all', 'last', an int or a list of ints in 0..{n_blocks}")
    if not layers:
        raise ValueError("layers is empty: use 'all', 'last' or a list of ints")
    return sorted({layer_index(layer, n_blocks) for layer in layers})


# -- options as text: the command line, the NXL_* variables, the control endpoint ---------------------------

#: How the embedding norm is read: the input of block 1 (authors' code), or the raw word-embedding row (paper).
EMBEDDINGS = ("layer_input", "word")


def parse_layers(value: str) -> str | list[int]:
    """``all`` | ``last`` | a comma list of ints (negative from the end): ``"0,2,-1"`` -> ``[0, 2, -1]``.
    ValueError otherwise."""
    if value in ("all", "last"):
        return value
    try:
        return [int(part) for part in value.split(",")]
    except ValueError:
        raise ValueError(f"{value!r}: use 'all', 'last' or a comma list of ints like 0,2,-1") from None


def parse_target(value: str) -> str | int | list[str | int]:
    """``predicted`` | an int id | a token / label / word | a comma list of those (one table per target).

    Spaces are kept: a leading space is part of a token (``" are, is"`` -> ``[" are", " is"]``; a word is read
    after the text in any case, so ``"are,is"`` explains the same tokens); an item of ASCII digits alone is an id
    (``" 4"`` is the token ' 4'; label names match with surrounding spaces ignored). ValueError on an empty item.
    """
    parts = value.split(",") if len(value) > 1 else [value]
    items: list[str | int] = []
    for part in parts:
        if not part.strip():
            raise ValueError(f"{value!r}: empty item in the target list")
        number = int_text(part)
        items.append(part if number is None else number)
    if "predicted" in [item.strip() if isinstance(item, str) else item for item in items] and len(items) > 1:
        raise ValueError("'predicted' cannot be mixed with other targets; pass it alone")
    # an item written twice names one output twice whatever model reads it: refused here, before a model loads or
    # nxl run starts its program (the same rule as after resolving, which also sees ' Paris' and 'Paris' agree)
    _check_distinct([items], [items])
    return items[0] if len(items) == 1 else items


def parse_embedding(value: str) -> str:
    """One of :data:`EMBEDDINGS` (ValueError otherwise): ``parse_embedding("word") == "word"``."""
    if value not in EMBEDDINGS:
        raise ValueError(f"embedding={value!r}: use 'layer_input' (default) or 'word'")
    return value


def option_text(value: str | int | Sequence[str | int]) -> str:
    """Layers or targets as :func:`parse_layers` / :func:`parse_target` read them back:
    ``option_text([0, -1]) == "0,-1"``, ``option_text("last") == "last"``."""
    return value if isinstance(value, str) else str(value) if integer(value) is not None else ",".join(map(str, value))


def from_numpy(value: Any) -> Any:
    """A numpy array of layers or target ids as the tensor it stands for (strings as a list); anything else (numpy
    scalars included, which are ints already) as is: ``attach(target=np.array([5, 7]))``."""
    if type(value).__module__ != "numpy" or not getattr(value, "ndim", 0):
        return value
    return value.tolist() if value.dtype.kind in "USO" else torch.as_tensor(value)


# -- targets ---------------------------------------------------------------------------------------------


def is_predicted(target: Target) -> bool:
    """Whether ``target`` asks for the model's own prediction (the default)."""
    return isinstance(target, str) and target == "predicted"


def _check_range(ids: Sequence[int] | torch.Tensor, n_outputs: int, kind: HeadKind | str | None = None) -> None:
    """Checked as Python ints: an id of any size is told out of range (a tensor of it would overflow first). A
    classifier's (``kind``) is a label, told as one: its labels are what its user counts, not a head's outputs."""
    values = ids.flatten().tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]
    bad = [i for i in values if not 0 <= i < n_outputs]
    if bad and kind is not None and HeadKind(kind) is HeadKind.SEQUENCE_CLASSIFICATION:
        raise ValueError(f"label {bad[0]} is out of range: this classifier has {n_outputs} labels, ids "
                         f"0..{n_outputs - 1}; give one of them or a label name (config.id2label)")
    if bad:
        raise ValueError(f"target {bad[0]} is out of range: the head has {n_outputs} outputs (0..{n_outputs - 1})")


def _check_distinct(requests: Sequence[Sequence[Any]], ids: Sequence[Sequence[int | str]],
                    what: str = "target list") -> None:
    """Each row's explained ids differ: a list naming one output twice is refused for every method (a second,
    identical label column, and the target − foil of the two 0 at every token: a silent wrong answer). ``requests``:
    the targets as people wrote them, row by row as ``ids``; the duplicate is named by them and by its id."""
    twice = [next((j for j, id_ in enumerate(row) if id_ in row[:j]), None) for row in ids]
    row = next((r for r, j in enumerate(twice) if j is not None), None)
    if row is None:
        return
    j = twice[row]
    id_ = ids[row][j]
    where = f" in row {row}" if len(ids) > 1 else ""  # which text, mask or tensor row, where there are several
    first = requests[row][list(ids[row]).index(id_)]
    # an output id is named by the two items that name it; an item as written (parse_target's) by itself
    named = f"output {id_} twice{where} ({first!r} and {requests[row][j]!r})" if isinstance(id_, int) else \
        f"{id_!r} twice{where}"
    raise ValueError(f"{what} names {named}: give different targets (a target and its foil)")


#: After one of these a word follows without a space (an opening bracket or quote); after any other character but
#: whitespace a target word (one that starts with a letter or digit) is a new word: "Paris" after "The capital of
#: France is" is " Paris", while "." or "," follow the text directly.
NO_SPACE_AFTER = "([{\"'“‘«¿¡/-"


@dataclass(frozen=True)
class ResolvedTarget:
    """What one requested target explains. ``tokens``: every token the request stands for, the explained ``id``
    first; a request of several tokens (a word the tokenizer splits) explains its first token only."""

    request: str | int  #: as the user wrote it
    id: int  #: the output id explained
    tokens: tuple[int, ...]  #: the request's tokens (one, or a word's tokens after the prompt)
    how: str  #: "id", "label" (a classifier's label name), "token" (a vocabulary entry), "word" (text, tokenized)
    #: a label name that is also another output's id ("1" naming id 0 of {0: "1", 1: "2"}): that id, the reading
    #: not taken (a CSV cell is always text, so a column of ids would be read as names unnoticed); else None
    other: int | None = None

    @property
    def partial(self) -> bool:
        """True when the request is several tokens and only the first is explained."""
        return len(self.tokens) > 1


def _is_piece(tokenizer: Any, item: str, token: int) -> bool:
    """A vocabulary entry that is not plain text: a special or added token, a piece whose text differs ('Ġis',
    '▁is', '<0x0A>'), a word's continuation (WordPiece's '##ians', what ``tokenize`` shows, though it decodes to
    itself), or one whose text the tokenizer cannot write (unknown tokens as a word); 'Paris' (a piece that reads as
    itself) is a word."""
    if item in (getattr(tokenizer, "all_special_tokens", None) or ()) or item in tokenizer.get_added_vocab():
        return True
    # by the tokenizer's own continuation prefix: as text, '##ians' is '#', '#', 'ians' where '#' is a word too
    prefix = getattr(getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None),
                     "continuing_subword_prefix", None)
    if isinstance(prefix, str) and prefix and item.startswith(prefix) and len(item) > len(prefix):
        return True
    unknown = tokenizer.unk_token_id
    return tokenizer.decode([token]) != item or (
        unknown is not None and unknown in tokenizer.encode(item, add_special_tokens=False))


def _after_prompt(tokenizer: Any, prompt: str, word: str) -> list[int]:
    """The tokens of ``word`` as the tokenizer makes them right after ``prompt``, with a separating space when the word
    starts with a letter or digit and the prompt ends with neither whitespace nor an opening bracket or quote."""
    space = word[:1].isalnum() and prompt and not prompt[-1].isspace() and prompt[-1] not in NO_SPACE_AFTER
    addition = (" " if space else "") + word
    before = tokenizer.encode(prompt, add_special_tokens=False)
    after = tokenizer.encode(prompt + addition, add_special_tokens=False)
    if after[: len(before)] == before:
        return after[len(before):]
    return tokenizer.encode(addition, add_special_tokens=False)  # the word merged into the prompt's last token


def _before_mask(tokenizer: Any, prompt: str) -> tuple[str, str] | None:
    """The text of ``prompt`` before its last mask token (:func:`_mask_prompts` ends each row's text with its own
    mask) and the space a word in its place starts with: ' ' where the mask token strips whitespace on its left
    (RoBERTa's '<mask>' has ``lstrip``: ' <mask>' is one token, so a word in its place is ' Paris', after '(' too),
    the text then without it; None when the prompt holds no mask token."""
    mask = getattr(tokenizer, "mask_token", None)
    start = prompt.rfind(mask) if mask else -1
    if start < 0:
        return None
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    before = prompt[:start]
    if not getattr(added.get(tokenizer.mask_token_id), "lstrip", False) or before == before.rstrip():
        return before, ""
    return before.rstrip(), " "


def _mask_prompts(tokenizer: Any, prompts: Sequence[str]) -> list[str | None]:
    """Each prompt cut at the end of each of its mask tokens, prompt by prompt and left to right, as
    :func:`prediction_rows` orders a masked LM's rows (one per mask token); ``[None]`` (one row for all, words read
    alone) when no prompt holds one: the forward refuses such an input with its own message."""
    mask = getattr(tokenizer, "mask_token", None)
    cut = [prompt[: m.end()] for prompt in prompts for m in re.finditer(re.escape(mask), prompt)] if mask else []
    return cut or [None]


def _label_ids(config: Any) -> dict[str, tuple[int, ...]]:
    """Each label name of a classifier -> the output ids it names, in id order: ``config.id2label``'s, the names its
    outputs are shown by (transformers', pipelines', records'); ``label2id`` only where ``id2label`` says nothing (a
    model loaded with ``id2label=...`` keeps the checkpoint's ``label2id``, stale)."""
    id2label = getattr(config, "id2label", None) or {}
    pairs = sorted((int(i), str(name)) for i, name in id2label.items()) or sorted(
        (int(i), str(name)) for name, i in (getattr(config, "label2id", None) or {}).items())
    labels: dict[str, tuple[int, ...]] = {}
    for index, name in pairs:
        labels[name] = (*labels.get(name, ()), index)
    return labels


def resolve_target(model: nn.Module, kind: HeadKind | str, tokenizer: Any, item: str | int,
                   n_outputs: int | None = None, *, prompt: str | None = None) -> ResolvedTarget:
    """One requested target or label -> what it explains (the rules in order):

    1. an int: that output id (range-checked against ``n_outputs`` when given);
    2. classifiers: a label name, as ``config.id2label`` names the outputs (surrounding spaces ignored), or a number
       as an id (a name that is also another output's id is the name: :attr:`ResolvedTarget.other` keeps that id);
    3. LMs (a tokenizer is needed): a vocabulary entry that is not plain text ('Ġis', '▁is', WordPiece's '##ians', a
       special token) is that token; without a ``prompt`` any vocabulary entry is;
    4. other text is a word: after the ``prompt`` (causal LMs), the first token the tokenizer makes of it there
       (``prompt + " " + word``: 'Paris' after 'The capital of France is' is ' Paris'; a word that starts with
       anything but a letter or digit (a space, '.', ','), or a prompt that ends with whitespace or an opening
       bracket or quote, takes no added space); a masked LM reads it in place of the prompt's last mask token, so
       after the text before that mask (the token the mask would be filled with: ' Paris' in 'is <mask>.' and in
       '( <mask>' (a mask that strips the space before it stands for a word with it), 'Paris' in '(<mask>');
       without a prompt (or a masked LM's prompt without a mask token), the tokens of the text alone. A word of
       several tokens explains its first (:attr:`ResolvedTarget.partial`).

    ``resolve_target(model, "causal_lm", tok, "Paris", prompt="The capital of France is").id``; ValueError if bad.
    """
    number = integer(item)
    if number is not None:
        if n_outputs is not None:
            _check_range([number], n_outputs, kind)
        elif not -(1 << 63) <= number < 1 << 63:  # (checked against the head later; no tensor can hold it)
            raise ValueError(f"target {number} is out of range: no head has that many outputs")
        # the plain int: a numpy integer as the request made the record's meta unsavable (JSON has none)
        return ResolvedTarget(number, number, (number,), "id")
    if not isinstance(item, str):
        raise ValueError(f"target/label {item!r} must be an int id or a string, got {type(item).__name__}")
    kind = HeadKind(kind)
    if kind.pooled:
        labels = _label_ids(model.config)
        ids = labels.get(item.strip(), ())  # " LABEL_0" from a comma list is the label too
        if len(ids) == 1:
            number = int_text(item.strip())
            named = {i for same in labels.values() for i in same}
            other = number if number is not None and number != ids[0] and number in named else None
            return ResolvedTarget(item, ids[0], ids, "label", other)
        if ids:
            raise ValueError(f"label {item!r} names outputs {list(ids)} of the model: pass one of them as an int id")
        if (number := int_text(item.strip())) is not None:
            return resolve_target(model, kind, tokenizer, number, n_outputs)
        raise ValueError(f"label {item!r} is not one of the model's labels {list(labels)}; or pass an int id")
    if tokenizer is None:
        raise ValueError(f"target {item!r} is a string: pass attach(..., tokenizer=tok) to resolve it, or an int id")
    if not item:
        raise ValueError("target '' is empty: give a word, a token or an id")
    word = item
    if prompt is not None and kind is HeadKind.MASKED_LM:  # the word stands where the mask is, not after the text
        prompt, space = _before_mask(tokenizer, prompt) or (None, "")
        word = item if item[:1].isspace() else space + item  # (a word given with its own space keeps that one)
    after = prompt is not None and kind.vocabulary
    vocab = tokenizer.get_vocab()
    if item in vocab and (not after or _is_piece(tokenizer, item, vocab[item])):
        return ResolvedTarget(item, int(vocab[item]), (int(vocab[item]),), "token")
    ids = _after_prompt(tokenizer, prompt, word) if after else tokenizer.encode(item, add_special_tokens=False)
    if not ids or ids[0] == tokenizer.unk_token_id:
        raise ValueError(f"target {item!r} is not a single token in the vocabulary (it encodes to {ids}, "
                         f"{'the unknown token' if ids else 'nothing'}); pass a token (see tokenizer.tokenize(text)) "
                         "or its int id")
    if n_outputs is not None:
        _check_range(ids[:1], n_outputs)
    return ResolvedTarget(item, int(ids[0]), tuple(int(i) for i in ids), "word")


def resolve_target_id(model: nn.Module, kind: HeadKind | str, tokenizer: Any, item: str | int, n_outputs: int,
                      texts: Callable[[list[int]], list[str]] | None = None) -> int:
    """One target or label -> the output id ``attach`` explains, by :func:`resolve_target`'s rules without a prompt;
    a word of several tokens is an error here (attach has no prompt to say which token comes next), naming them by
    ``texts`` (ids -> readable texts, '␣Paris': :func:`~nxl_hooks.records.tokens.readable_ids`, a layer above this
    one), else by their vocabulary pieces. ``resolve_target_id(model, "causal_lm", tok, "Ġis", len(tok))``"""
    resolved = resolve_target(model, kind, tokenizer, item, n_outputs)
    if resolved.partial:
        ids = list(resolved.tokens)
        shown = (texts or tokenizer.convert_ids_to_tokens)(ids)
        # (the piece is what a target string may name; its readable text is not)
        piece = tokenizer.convert_ids_to_tokens(ids[0])
        raise ValueError(
            f"target {item!r} is {len(ids)} tokens ({' '.join(shown)}): attach explains one token; pass one (here "
            f"the first, {shown[0]}: id {resolved.id} or its piece {piece!r}), or use nxl.explain(model, tok, text, "
            "target=...), which reads a word after the prompt and explains its first token"
        )
    return resolved.id


def _items(target: Target) -> list[str | int]:
    """A non-tensor target as its list of requests; ValueError when it is none of the accepted forms."""
    items = [target] if isinstance(target, str) or integer(target) is not None else target
    if isinstance(items, (bool, float, bytes, bytearray)) or not isinstance(items, Sequence):
        raise ValueError(f"target={target!r}: use 'predicted', an int id, a token or label string, a list of "
                         "them, or a tensor of ids")
    if not items:
        raise ValueError("target list is empty: give at least one label or token")
    return list(items)


def prompt_targets(model: nn.Module, kind: HeadKind | str, tokenizer: Any, target: Target,
                   prompts: Sequence[str]) -> tuple[torch.Tensor, list[list[ResolvedTarget]]]:
    """Targets as people write them, read after each prompt (:func:`resolve_target`): the id tensor to pass as
    ``attach(target=...)`` and each row's resolutions. One row per prompt for causal LMs, one per mask token for
    masked LMs (each word read in place of that mask, :func:`_mask_prompts`), one row for all for classifiers (whose
    labels do not depend on the text); (rows,) ids for one target, (rows, k) for a list, so the label axis is as
    ``target`` asks. ``prompt_targets(model, "causal_lm", tok, ["are", "is"], [text])``
    """
    items, kind = _items(target), HeadKind(kind)
    rows = list(prompts) if kind is HeadKind.CAUSAL_LM else (
        _mask_prompts(tokenizer, prompts) if kind is HeadKind.MASKED_LM else [None])
    resolved = [[resolve_target(model, kind, tokenizer, item, prompt=prompt) for item in items] for prompt in rows]
    id_rows = [[r.id for r in row] for row in resolved]
    _check_distinct([items] * len(rows), id_rows)  # named as written, and before the forward
    ids = torch.tensor(id_rows, dtype=torch.long)
    return (ids if isinstance(target, (list, tuple)) else ids[:, 0]), resolved


def target_ids(model: nn.Module, kind: HeadKind | str, tokenizer: Any, target: Target, n_outputs: int,
               texts: Callable[[list[int]], list[str]] | None = None) -> torch.Tensor:
    """Explicit targets as a (1, k) or (rows, k) id tensor, checked against the head's outputs, each row's distinct;
    ``texts``: as :func:`resolve_target_id` names a word's tokens."""
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
        requests = None
    else:
        requests = [_items(target)]
        ids = torch.tensor([[resolve_target_id(model, kind, tokenizer, item, n_outputs, texts)
                             for item in requests[0]]])
    _check_range(ids, n_outputs, kind)
    _check_distinct(requests or ids.tolist(), ids.tolist(), "target list" if requests else "target tensor")
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


def position_limit(model: nn.Module) -> int | None:
    """The most tokens one input of ``model`` may have: ``config.max_position_embeddings``, less the positions a
    padding-offset position table (RoBERTa's: positions start after ``padding_idx``) never uses; None if unknown."""
    for name, module in model.named_modules():
        if (name.endswith("position_embeddings") and isinstance(module, nn.Embedding)
                and module.padding_idx is not None):
            return module.num_embeddings - module.padding_idx - 1
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_length(tokenizer: Any, text: str, limit: int | None, *, more: int = 0, pair: str | None = None,
                 what: str = "the text") -> None:
    """A ValueError when ``text`` (as the tokenizer encodes it, special tokens included; with its sentence ``pair``)
    plus ``more`` tokens to generate exceeds ``limit`` (:func:`position_limit`): the model has no position for the rest.

    ``check_length(tok, text, position_limit(model), more=16)``
    """
    if limit is None:
        return
    count = len(tokenizer(text, pair)["input_ids"])
    if count + more > limit:
        extra = f" plus {more} to generate" if more else ""
        raise ValueError(f"{what} is {count} tokens{extra}, but the model reads at most {limit} "
                         "(config.max_position_embeddings): shorten it")


def pad_token_id(model: nn.Module) -> int | None:
    """``config.pad_token_id`` as transformers pools decoder classifiers by it (the text config's), None where the
    config has no such attribute at all, as transformers reads it (CodeGen's in transformers 5, RWKV's)."""
    return getattr(model.config.get_text_config(), "pad_token_id", None)


def prediction_rows(
    kind: HeadKind | str,
    pooling: str,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    *,
    shape: tuple[int, int],
    pad_id: int | None,
    mask_id: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(example, position) of every explained row, on the CPU, for a (batch, seq) input of ``shape``.

    ``mask_id``: the tokenizer's mask token, for masked LMs; ``pad_id``: :func:`pad_token_id`, for decoder
    classifiers. ValueError when a masked-LM input has no mask token or a causal-LM row has no real token.
    """
    batch, seq, kind = *shape, HeadKind(kind)
    examples = torch.arange(batch)
    if attention_mask is not None and attention_mask.dim() == 2:
        _no_empty_rows(attention_mask.cpu().bool())  # any head: nothing real to explain, whatever it pools
    if kind is HeadKind.MASKED_LM:
        if mask_id is None or input_ids is None:
            raise ValueError("masked-LM attribution needs input_ids and attach(..., tokenizer=tok) with a mask token")
        examples, positions = (input_ids.cpu() == mask_id).nonzero(as_tuple=True)
        if examples.numel() == 0:
            raise ValueError("no mask token in the input: nothing to explain")
        return examples, positions
    if kind is HeadKind.CAUSAL_LM or pooling == "last_non_pad":
        if kind is HeadKind.CAUSAL_LM and attention_mask is not None and attention_mask.dim() == 2:
            real = attention_mask.cpu().bool()
        elif kind is not HeadKind.CAUSAL_LM and pad_id is not None and input_ids is not None:
            real = input_ids.cpu() != pad_id  # as transformers pools decoder classifiers
        else:
            return examples, torch.full((batch,), seq - 1)
        _no_empty_rows(real)
        return examples, (torch.arange(seq) * real).argmax(-1)
    return examples, torch.zeros(batch, dtype=torch.long)


def empty_row(real: torch.Tensor) -> str | None:
    """The rows of ``real`` (bool (batch, seq): which tokens are real) that have none, said as the start of one
    line (five named, the rest counted); None when every row has one. A forward's result refuses such a row, a
    generate call's record notes it: ``said = empty_row(mask)``."""
    rows = [row for row, any_real in enumerate(real.any(-1).tolist()) if not any_real]  # (one read back)
    if not rows:
        return None
    if len(rows) == 1:
        return f"row {rows[0]} has no real token (its attention mask is all zeros, or it is all padding)"
    named = ", ".join(map(str, rows[:5])) + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")
    return f"rows {named} have no real token (their attention mask is all zeros, or they are all padding)"


def _no_empty_rows(real: torch.Tensor) -> None:
    said = empty_row(real)
    if said is not None:
        raise ValueError(f"{said}: there is no prediction to explain; drop empty rows")


# -- what ranks ------------------------------------------------------------------------------------------

#: The id a record gives a position that is no input token: a virtual token PEFT prompt tuning prepends
#: (:attr:`~nxl_hooks.method.subject.Subject.prompt_tokens`), which has an embedding of its own but no token id.
#: Such positions keep their scores, are named :func:`~nxl_hooks.hooks.plan.virtual_name`, flagged special
#: (:meth:`~nxl_hooks.hooks.plan.Plan.special`) and never rank (:func:`rankable`).
VIRTUAL_ID = -1


def special_ids(tokenizer: Any) -> list[int] | None:
    """The tokenizer's special token ids ([CLS], <s>, chat-template markers), sorted; None when it has none."""
    special = getattr(tokenizer, "all_special_ids", None)
    return sorted({int(i) for i in special}) if special else None


def special_flags(input_ids: torch.Tensor, ids: Sequence[int] | None) -> torch.Tensor | None:
    """True where ``input_ids`` holds one of the special token ``ids`` (:func:`special_ids`); None without any.
    ``special_flags(call_ids, call.special_ids)``"""
    if not ids:
        return None
    return torch.isin(input_ids.cpu(), torch.tensor(sorted(set(ids)), dtype=input_ids.dtype))


def special_mask(input_ids: torch.Tensor, tokenizer: Any) -> torch.Tensor | None:
    """True where ``input_ids`` holds one of the tokenizer's special tokens ([CLS], <s>, chat-template markers)."""
    return special_flags(input_ids, special_ids(tokenizer))


def rankable(mask: torch.Tensor, position: torch.Tensor | int, special: torch.Tensor | None = None,
             template: torch.Tensor | None = None, *, fallback: bool = True,
             input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Which positions take part in a ranking: real tokens (``mask``), but not the prediction ``position``, not
    ``special`` tokens and not a chat ``template``'s tokens (its markers and the system prompt,
    :mod:`nxl_hooks.method.chat`): what ranks is the user's text and the generated text. Shapes: (seq,) with an
    int position, or (rows, seq) with (rows,) positions.

    When nothing would be left (a text of special tokens only), the real tokens but the prediction rank instead;
    ``fallback=False`` leaves nothing then (perturbation must never touch a [CLS], <s> or [SEP]). ``input_ids``, where
    known (shaped as ``mask``): virtual tokens (:data:`VIRTUAL_ID`) never rank, not even then: no input token at all.
    """
    eligible = mask.bool().clone()
    if input_ids is not None:
        eligible &= input_ids.to(eligible.device) != VIRTUAL_ID
    position = torch.as_tensor(position)
    if eligible.dim() == 1:
        eligible[int(position)] = False
    else:
        eligible[torch.arange(eligible.shape[0]), position] = False
    left_out = [flags.bool() for flags in (special, template) if flags is not None]
    if not left_out:
        return eligible
    kept = eligible & ~torch.stack(left_out).any(0)
    if not fallback:
        return kept
    nothing = ~kept.any(-1, keepdim=True)  # only special or template tokens besides the prediction: rank them
    return torch.where(nothing, eligible, kept)


def order(scores: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Positions where ``eligible`` (1-D), best first by signed score; ties keep token order; NaN comes last."""
    positions = eligible.nonzero().flatten()
    values = scores[positions].to(wide(scores.dtype)).nan_to_num(nan=float("-inf"))
    return positions[torch.argsort(values, descending=True, stable=True)]
