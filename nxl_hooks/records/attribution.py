"""The result of one explained forward, and its safetensors + JSON file format.

Layout. Rows are what is explained: one per input example for causal LMs and classifiers, one per
``[MASK]`` position for masked LMs (``example`` says which input row a row came from, ``position``
where its prediction is read). With ``target`` a list of k labels, ``normxlogit`` and ``logat`` get a
trailing axis of size k, in the order given.

Files. :meth:`Attribution.save` writes one safetensors file (tensors + a JSON ``nxl_hooks`` metadata entry)
under a temporary name and renames it over the target, so a failed save never destroys an existing file.
:meth:`Attribution.load` checks the header, the metadata, the dtypes and the shapes against each other
(:meth:`Attribution.check`) and raises :class:`RecordError` (a ValueError) naming the file and the field for
anything that does not fit: what it accepts works in ``top()``, ``layer()``, ``to_html()`` and the terminal.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load as _load_blob
from safetensors.torch import save as _save_blob

from ..method.methods.contrastive import no_foil
from ..method.protocol import NAME, check_name
from ..method.registry import DEFAULT
from ..method.scores import norm_spread
from ..method.select import label_index, layer_index, order, rankable, row_index, whole_number
from .files import STREAM_MAGIC, too_large, read_regular, write_bytes, write_text
from .tokens import is_readable, printable, visible

__all__ = ["Attribution", "FORMAT_VERSION", "RecordError", "SCORE_PREFIX", "by_method"]

FORMAT_VERSION = 1
_FORMAT = "nxl_hooks.attribution"
_TENSORS = (*DEFAULT, "embed_norm", "target", "mask", "position", "example")  # DEFAULT: "normxlogit", "logat"
_FIELD_TENSORS = _TENSORS[len(DEFAULT):]  # the tensors that are fields of their own, not scores
_OPTIONAL_TENSORS = ("special", "input_ids", "probability", "template")  # absent from files written before they existed
_OPTIONAL_HEADER = ("readable", "target_text")  # the same; a reader that predates them ignores them
#: Files name the scores of methods beyond DEFAULT (whose tensors keep their names) ``scores.<method>``: a reader
#: that predates them ignores them.
SCORE_PREFIX = "scores."
#: Types of the metadata entries something reads back (the CLI, the HTML page); other entries are free JSON.
_META_TYPES: dict[str, type] = {
    "model_type": str, "model_class": str, "head_kind": str, "embedding": str, "spec": str, "n_blocks": int,
    "call": int, "step": int,
}


class RecordError(ValueError):
    """A record that does not hold together: a file nxl_hooks did not write (or a damaged one), or fields that
    contradict each other. The message names the file (when there is one), the field and what is wrong.
    ``try: nxl.Attribution.load(path) except nxl.RecordError as error: print(error)``"""


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer_dtype(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


def _strings(value: Any, rows: int, width: int) -> bool:
    """``value`` is ``rows`` lists of ``width`` strings."""
    return isinstance(value, list) and len(value) == rows and all(
        isinstance(items, list) and len(items) == width and all(isinstance(item, str) for item in items)
        for items in value)


# meta["targets"] entries (records.tokens.describe_target): each key and the types its value may have.
_TARGET_NOTE: dict[str, tuple[type, ...]] = {
    "request": (str, int), "id": (int,), "text": (str,), "how": (str,), "tokens": (list,), "texts": (list,),
    "note": (str, type(None)),
}


def _target_notes(value: Any, rows: int, k: int) -> bool:
    """``value`` is one list of ``k`` target notes per row (or one list for every row, as masked LMs write it)."""
    return isinstance(value, list) and len(value) in (1, rows) and all(
        isinstance(labels, list) and len(labels) == k and all(
            isinstance(note, dict) and all(isinstance(note.get(key), kinds) and not isinstance(note.get(key), bool)
                                           for key, kinds in _TARGET_NOTE.items())
            for note in labels)
        for labels in value)


def by_method(scores: dict[str, torch.Tensor] | None, **given: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """A record's ``scores`` mapping: a copy of ``scores`` with ``given`` (``normxlogit=``, ``logat=``) over its
    entries, :data:`~nxl_hooks.method.registry.DEFAULT`'s methods first."""
    merged = {**(scores or {}), **{name: value for name, value in given.items() if value is not None}}
    return {**{name: merged.pop(name) for name in DEFAULT if name in merged}, **merged}


def stored_scores(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``scores`` of a file's tensors: DEFAULT's under their own names, the others' as ``scores.<method>``."""
    return by_method({name[len(SCORE_PREFIX):]: value for name, value in tensors.items()
                      if name.startswith(SCORE_PREFIX)}, **{name: tensors.get(name) for name in DEFAULT})


def scores_to_store(scores: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What :func:`stored_scores` reads back: DEFAULT's scores under their own names, the others prefixed."""
    return {(name if name in DEFAULT else SCORE_PREFIX + check_name(name)): value for name, value in scores.items()}


class _Scored(Protocol):
    """A record with scores per method: :class:`Attribution`, :class:`~.steps.Step`."""

    scores: dict[str, torch.Tensor]


_LENGTH = struct.Struct("<Q")
_LITTLE = sys.byteorder == "little"  # safetensors stores little-endian: elsewhere, its own encoder


#: safetensors dtype names of the tensors :func:`_blob` writes (a stream frame's, an attribution file's).
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.bool: "BOOL",
           torch.uint8: "U8", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}


def _sized(text: bytes) -> bytes:
    """A safetensors header of JSON ``text``: its 8-byte length, then it, padded with spaces to 8 bytes (the
    alignment safetensors writes, and checks)."""
    text += b" " * (-len(text) % 8)
    return _LENGTH.pack(len(text)) + text


def _blob(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors blob of small CPU tensors, as ``safetensors.torch.save`` writes it (8-byte header length, the
    JSON header, 8-byte aligned, then the raw little-endian data), without its checks for shared and sparse
    storage: each tensor's own elements are written (records scored together share storage: their tensors can be
    views of one copy), and the checks cost five times the encoding (one frame per step). Read back with
    safetensors' own ``load``. ``tensors``' names are nxl_hooks' own (plain identifiers), so the header is written
    directly; only the metadata goes through ``json``."""
    entries, parts, offset = [json.dumps({"__metadata__": metadata})[1:-1]], [], 0
    for name, value in tensors.items():
        array = (value.view(torch.int16) if value.dtype == torch.bfloat16 else value).numpy()
        end = offset + array.nbytes
        entries.append(f'"{name}":{{"dtype":"{_DTYPES[value.dtype]}","shape":{list(array.shape)},'
                       f'"data_offsets":[{offset},{end}]}}')
        parts.append(array.tobytes())  # C order, whatever the strides
        offset = end
    text = ",".join(entries).join("{}").encode()
    return b"".join([_sized(text), *parts])


def write_blob(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors blob of CPU ``tensors`` and ``metadata``, whatever their layout and the metadata's size
    (safetensors' own save refuses a header over 100 MB, which a long context's readable texts pass; it still
    writes a dtype numpy has not, float8's, with that bound); read back by :func:`read_blob`."""
    if _LITTLE and all(value.dtype in _DTYPES for value in tensors.values()):
        return _blob(tensors, metadata)
    # copies: safetensors refuses tensors that share storage (a step's target is a view of its token, a method may
    # return another's scores as they are)
    return _save_blob({name: value.clone().contiguous() for name, value in tensors.items()}, metadata=metadata)


def read_blob(data: bytes | bytearray | memoryview) -> tuple[Any, dict[str, torch.Tensor]]:
    """A safetensors blob's metadata (``{}`` when it has none) and tensors; ValueError when ``data`` is not one.

    safetensors' own load refuses a header over 100 MB, which the readable texts in the metadata pass in a long
    context (about 17 bytes a token and row: 48 rows of 128k tokens): it gets the blob without its metadata."""
    (size,) = struct.unpack_from("<Q", data, 0) if len(data) >= 8 else (None,)
    if size is None or size > len(data) - 8:
        raise ValueError("shorter than its header says: truncated, or not a safetensors blob")
    entries = json.loads(bytes(data[8: 8 + size]))
    if not isinstance(entries, dict):
        raise ValueError("not a safetensors blob: its header is not a JSON object")
    metadata = entries.pop("__metadata__", None) or {}
    if not (isinstance(metadata, dict) and all(isinstance(value, str) for value in metadata.values())):
        raise ValueError("not a safetensors blob: its __metadata__ is not a map of strings")  # (as safetensors says)
    text = json.dumps(entries).encode()
    return metadata, _load_blob(b"".join([_sized(text), data[8 + size:]]))


def _require(condition: bool, problem: str) -> None:
    if not condition:
        raise RecordError(problem)


@dataclass(init=False)
class Attribution:
    """Per-layer scores of one forward, one tensor per attribution method.

    ``res.scores["normxlogit"][res.layers.index(L), row, i]`` is the NormXLogit of token i at layer L;
    ``res.normxlogit`` and ``res.logat`` read the same mapping (kept for code written before ``scores``).
    """

    #: method name -> float32 (len(layers), rows, seq[, k]): "normxlogit" and "logat" always, then every other
    #: method the probe computed (``attach(methods=[...])``)
    scores: dict[str, torch.Tensor]
    embed_norm: torch.Tensor  #: float32 (rows, seq)
    layers: list[int]  #: 0 = input of block 1, L = output of the last block
    target: torch.Tensor  #: int64 (rows,) or (rows, k): the label / token ids explained
    mask: torch.Tensor  #: bool (rows, seq), True on real tokens
    position: torch.Tensor  #: int64 (rows,): the prediction position
    example: torch.Tensor  #: int64 (rows,): the input row each row explains
    # Each ``| None`` below is None in a result of a forward too (nxl.explain's included), not only in an older file:
    # the ids-based fields where the backbone got no ids (a model that embeds its ids itself, Fuyu's).
    tokens: list[list[str]] | None  #: token strings per row; None without a tokenizer or ids (``input_ids``)
    meta: dict[str, Any]  #: model_type, head kind, embedding, ...
    special: torch.Tensor | None  #: bool (rows, seq), True on the tokenizer's special tokens; None without ids,
    #: or with none to flag (no tokenizer, or one without special tokens, and no PEFT virtual token)
    input_ids: torch.Tensor | None  #: int64 (rows, seq): the token ids of each row (-1 at PEFT prompt tuning's
    #: virtual tokens); None where the backbone got no ids (inputs_embeds, built by the model or given)
    readable: list[list[str]] | None  #: each token's text as people read it ('␣Paris', '↵'; records.tokens); None
    #: without a tokenizer or ids, as ``tokens``
    probability: torch.Tensor | None  #: float32, shaped like ``target``: the model's own probability of each
    #: explained target at the prediction position (its softmax; a multi-label classifier's sigmoid; None for
    #: regression)
    target_text: list[list[str]] | None  #: (rows, k): each explained target as people read it; None for regression
    #: and for a LM's targets without a tokenizer
    template: torch.Tensor | None  #: bool (rows, seq), True on a chat template's own tokens (its markers and
    #: the system prompt; :mod:`nxl_hooks.method.chat`), which do not rank; None for a prompt without a template
    #: (or one whose template could not be located: ``meta["template"]`` then says why)

    def __init__(self, normxlogit: torch.Tensor | None = None, logat: torch.Tensor | None = None,
                 embed_norm: torch.Tensor | None = None, layers: list[int] | None = None,
                 target: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                 position: torch.Tensor | None = None, example: torch.Tensor | None = None,
                 tokens: list[list[str]] | None = None, meta: dict[str, Any] | None = None,
                 special: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                 readable: list[list[str]] | None = None, probability: torch.Tensor | None = None,
                 target_text: list[list[str]] | None = None, template: torch.Tensor | None = None, *,
                 scores: dict[str, torch.Tensor] | None = None) -> None:
        """``Attribution(scores={"normxlogit": ..., "logat": ..., ...}, embed_norm=..., ...)``; ``normxlogit`` /
        ``logat`` given on their own (as before ``scores``) go into the mapping, over an entry of the same name.
        Every tensor field is needed; :meth:`check` says what does not fit."""
        self.scores = by_method(scores, normxlogit=normxlogit, logat=logat)
        self.embed_norm, self.layers, self.target, self.mask = embed_norm, layers, target, mask
        self.position, self.example, self.tokens, self.meta = position, example, tokens, {} if meta is None else meta
        self.special, self.input_ids, self.readable, self.probability = special, input_ids, readable, probability
        self.target_text, self.template = target_text, template

    # (self is any record with scores, typed so: Step shares these properties, and a type checker reads them there)
    @property
    def normxlogit(self: _Scored) -> torch.Tensor:
        """``scores['normxlogit']``: float32 (len(layers), rows, seq[, k])"""
        return self.scores["normxlogit"]

    @normxlogit.setter
    def normxlogit(self: _Scored, value: torch.Tensor) -> None:
        self.scores["normxlogit"] = value

    @property
    def logat(self: _Scored) -> torch.Tensor:
        """``scores['logat']``: HoT(h_i^l)[y] (regression: |HoT(h_i^l) - HoT(h_p^L)|)"""
        return self.scores["logat"]

    @logat.setter
    def logat(self: _Scored, value: torch.Tensor) -> None:
        self.scores["logat"] = value

    @property
    def methods(self: _Scored) -> list[str]:
        """The names of the methods whose scores this record holds: ``["normxlogit", "logat", ...]``."""
        return list(self.scores)

    def method_scores(self, method: str = "normxlogit") -> torch.Tensor:
        """``scores[method]``, or ValueError naming the methods this record holds."""
        found = self.scores.get(method)
        if found is None:
            held = [repr(name) for name in self.scores]
            raise ValueError(f"method={method!r}: use {', '.join(held[:-1])} or {held[-1]}, the methods this record "
                             f"holds (compute others with nxl.attach(..., methods=[{method!r}]))")
        return found

    def __repr__(self) -> str:
        """A summary, never the tensors: shape, layers, and per row (the first three) each target (the first three)
        with its text, id and probability and its top tokens at the last layer; a note naming the rows a contrastive
        method had no foil for (:func:`~nxl_hooks.method.methods.contrastive.no_foil`). ``print(res)``"""
        n_layers, rows, seq = self.normxlogit.shape[:3]
        k = self.target.shape[1] if self.target.dim() == 2 else 1
        head = (f"<Attribution {self.meta.get('model_class') or ''} {self.meta.get('head_kind') or ''}: {rows} row(s) x "
                f"{seq} tokens, layers {layers_text(self.layers)}" + (f", {k} targets per row" if k > 1 else "")
                + (", chat template left out of rankings" if self.template is not None else ""))
        lines = [" ".join(head.split()).replace("<Attribution :", "<Attribution:")]
        for row in range(min(rows, 3)):  # readable texts are escaped already: quoted as they are, not repr'd
            lead = f"  row {row}:"
            for label in range(min(k, 3)):  # each target ranks its own tokens: one line each, under its row
                top = ", ".join(f"{p}:'{text}' {score:.4g}"
                                for p, text, score in self.top(3, layer=self.layers[-1], row=row, label=label))
                lines.append(f"{lead if label == 0 else ' ' * len(lead)} target {self.target_label(row, label)}; "
                             f"top at L{self.layers[-1]}: {top}")
            if k > 3:
                lines.append(f"{' ' * len(lead)} ... {k - 3} more target(s)")
        if rows > 3:
            lines.append(f"  ... {rows - 3} more row(s)")
        lines += [f"  note: {note}" for note in map(no_foil, self.scores, self.scores.values()) if note]
        return "\n".join(lines) + ">"

    def check(self) -> None:
        """Raise :class:`RecordError` when the fields do not fit each other (dtypes, shapes, ranges, tokens, meta);
        :meth:`load` runs it on every file. ``res.check()``"""
        _require(isinstance(self.scores, dict) and all(name in self.scores for name in DEFAULT),
                 f"scores must be a dict holding at least {', '.join(DEFAULT)}")
        tensors = {**self.scores, **{name: getattr(self, name) for name in _FIELD_TENSORS}}
        for name, value in tensors.items():
            _require(isinstance(value, torch.Tensor), f"{name} is a {type(value).__name__}, not a tensor")
        scores = self.normxlogit
        _require(scores.dim() in (3, 4) and scores.numel() > 0,
                 f"normxlogit has shape {tuple(scores.shape)}: expected (layers, rows, seq) or (layers, rows, seq, k), "
                 "none of them 0")
        for name in (*self.scores, "embed_norm"):
            _require(tensors[name].is_floating_point(), f"{name} has dtype {tensors[name].dtype}, not a float dtype")
        n_layers, rows, seq = scores.shape[:3]
        for name, value in self.scores.items():
            _require(isinstance(name, str) and NAME.fullmatch(name) is not None, f"method name {name!r} is not one")
            _require(value.shape == scores.shape,
                     f"{name} has shape {tuple(value.shape)} but normxlogit {tuple(scores.shape)}")
        target_shape = (rows,) if scores.dim() == 3 else (rows, scores.shape[3])
        expected = {"embed_norm": (rows, seq), "mask": (rows, seq), "target": target_shape, "position": (rows,),
                    "example": (rows,)}
        for name, shape in expected.items():
            _require(tuple(tensors[name].shape) == shape, f"{name} has shape {tuple(tensors[name].shape)}, expected "
                     f"{shape} for normxlogit of shape {tuple(scores.shape)}")
        for name in ("target", "position", "example"):
            _require(_integer_dtype(tensors[name]), f"{name} has dtype {tensors[name].dtype}, not an integer dtype")
        _require(self.mask.dtype == torch.bool, f"mask has dtype {self.mask.dtype}, not torch.bool")
        _require(bool((self.target >= 0).all()), "target holds negative label ids")
        _require(bool(((self.position >= 0) & (self.position < seq)).all()), f"position is outside 0..{seq - 1}")
        _require(bool((self.example >= 0).all()), "example holds negative row numbers")
        for name in ("special", "template"):
            flags = getattr(self, name)
            _require(flags is None or (isinstance(flags, torch.Tensor) and flags.dtype == torch.bool
                                       and tuple(flags.shape) == (rows, seq)),
                     f"{name} must be a bool tensor of shape {(rows, seq)}")
        _require(isinstance(self.meta, dict), f"meta is a {type(self.meta).__name__}, not a JSON object")
        for key, kind in _META_TYPES.items():
            value = self.meta.get(key)
            _require(value is None or (isinstance(value, kind) and not isinstance(value, bool)),
                     f"meta[{key!r}] is {value!r}, not a {kind.__name__}")
        n_blocks = self.meta.get("n_blocks")
        _require(n_blocks is None or n_blocks >= 0, f"meta['n_blocks'] is {n_blocks}, a negative block count")
        _require(isinstance(self.layers, list) and len(self.layers) == n_layers and all(map(_int, self.layers)),
                 f"layers is {self.layers!r}: expected a list of {n_layers} ints, one per normxlogit layer")
        _require(self.layers == sorted(set(self.layers)) and self.layers[0] >= 0
                 and (n_blocks is None or self.layers[-1] <= n_blocks),
                 f"layers {self.layers} must be distinct, increasing and in 0..{'L' if n_blocks is None else n_blocks}")
        prediction = self.meta.get("prediction")
        _require(prediction is None or (isinstance(prediction, list) and len(prediction) == rows and all(
            isinstance(p, list) and p and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in p)
            for p in prediction)), f"meta['prediction'] must be one list of numbers per row ({rows} rows)")
        for name in ("tokens", "readable"):
            rows_of = getattr(self, name)
            _require(rows_of is None or _strings(rows_of, rows, seq),
                     f"{name} must be {rows} list(s) of {seq} token strings, one per position")
        k = 1 if self.target.dim() == 1 else self.target.shape[1]
        _require(self.target_text is None or _strings(self.target_text, rows, k),
                 f"target_text must be {rows} list(s) of {k} strings, one per explained target")
        targets = self.meta.get("targets")
        _require(targets is None or _target_notes(targets, rows, k),
                 f"meta['targets'] must be {rows} list(s) (or one) of {k} objects with the keys "
                 f"{', '.join(_TARGET_NOTE)}, one per explained target")
        # texts the terminal and pages print as they are: a raw escape sequence or lone surrogate is no readable text
        notes = [text for labels in targets or [] for note in labels
                 for text in (note["text"], note["note"], *note["texts"])]
        for name, texts in (("readable", [t for row in self.readable or [] for t in row]),
                            ("target_text", [t for row in self.target_text or [] for t in row]),
                            ("meta", [self.meta.get(key) for key in _META_TYPES]), ("meta['targets']", notes)):
            bad = next((t for t in texts if isinstance(t, str) and not is_readable(t)), None)
            _require(bad is None, f"{name} holds {bad!r}: a control or format character or a lone surrogate, which "
                     "readable texts show escaped")
        if self.input_ids is not None:
            _require(isinstance(self.input_ids, torch.Tensor) and _integer_dtype(self.input_ids)
                     and tuple(self.input_ids.shape) == (rows, seq),
                     f"input_ids must be an integer tensor of shape {(rows, seq)}")
        if self.probability is not None:
            _require(isinstance(self.probability, torch.Tensor) and self.probability.is_floating_point()
                     and self.probability.shape == self.target.shape,
                     f"probability must be a float tensor shaped like target {tuple(self.target.shape)}")

    def layer(self, layer: int, *, method: str = "normxlogit") -> torch.Tensor:
        """One method's scores (NormXLogit by default) at one layer (negative counts from the end):
        ``res.layer(-1)`` -> (rows, seq[, k]); ``res.layer(-1, method="logat")``."""
        scores = self.method_scores(method)
        n_blocks = self.meta.get("n_blocks")
        if n_blocks is None and not (_int(layer) and layer >= 0):
            raise ValueError(f"layer {layer!r}: this result does not record the model's block count; use one of "
                             f"{self.layers}")
        wanted = layer_index(layer, n_blocks) if n_blocks is not None else layer
        if wanted not in self.layers:
            raise ValueError(f"layer {layer} was not captured; captured layers: {self.layers}")
        return scores[self.layers.index(wanted)]

    def rankable(self, row: int = 0, *, all_positions: bool = False) -> torch.Tensor:
        """bool (seq,): the positions of one row that rank (see :func:`nxl_hooks.method.select.rankable`): not the
        prediction position, special tokens or a chat template's tokens; with ``all_positions`` every real token."""
        row = row_index(row, self.mask.shape[0])  # (a negative row would read another row's tokens silently)
        if all_positions:
            return self.mask[row].bool()
        special, template, ids = (None if flags is None else flags[row]
                                  for flags in (self.special, self.template, self.input_ids))
        return rankable(self.mask[row], int(self.position[row]), special, template, input_ids=ids)

    def top(
        self, k: int = 5, layer: int = -1, row: int = 0, label: int = 0, *, all_positions: bool = False,
        method: str = "normxlogit",
    ) -> list[tuple[int, str, float]]:
        """The k highest-scoring tokens of one row by signed NormXLogit (or ``method``, any in :attr:`methods`):
        [(position, text, score)], the text as :meth:`token_labels` shows it ('␣Paris').

        Padding, the prediction position, special tokens and a chat template's tokens (markers, system prompt) are
        left out unless ``all_positions``; NaN ranks last.
        """
        rows, labels = self.normxlogit.shape[1], (self.normxlogit.shape[3] if self.normxlogit.dim() == 4 else 1)
        # (a negative slice would drop the last tokens silently)
        k = whole_number(k, f"k={k!r}: give how many tokens top() returns, an int of 0 or more")
        row = row_index(row, rows)
        label = label_index(label, labels)
        scores = self.layer(layer, method=method)[row]
        if scores.dim() == 2:
            scores = scores[:, label]
        best = order(scores, self.rankable(row, all_positions=all_positions))[:k]
        names = self.token_labels(row)
        return [(int(i), names[int(i)], float(scores[i])) for i in best]

    def token_labels(self, row: int = 0) -> list[str]:
        """How each token of a row is shown: its readable text ('␣Paris'), else its piece made visible (files
        written before readable texts existed), else its position."""
        row = row_index(row, self.mask.shape[0])
        if self.readable:
            return list(self.readable[row])
        if self.tokens:
            return [visible(piece) for piece in self.tokens[row]]
        return [str(i) for i in range(self.mask.shape[-1])]

    def target_info(self, row: int = 0) -> list[dict[str, Any]]:
        """Each explained target of a row: ``[{"id", "text", "probability"}, ...]`` (text and probability None
        where unknown); notes on how a request was resolved are in ``meta["targets"]``."""
        row = row_index(row, self.mask.shape[0])
        ids = self.target[row].reshape(-1).tolist()
        probs = self.probability[row].reshape(-1).tolist() if self.probability is not None else [None] * len(ids)
        texts = self.target_text[row] if self.target_text else [None] * len(ids)
        return [{"id": int(i), "text": t, "probability": p} for i, t, p in zip(ids, texts, probs)]

    def resolution(self, row: int = 0, label: int = 0) -> dict[str, Any] | None:
        """How the request behind a target was read (``meta["targets"]``, set by :func:`nxl_hooks.explain`): request,
        id, text, how, tokens, note; None when the targets were ids or the model's own prediction."""
        row = row_index(row, self.mask.shape[0])  # (a negative row or label would read another's silently)
        label = label_index(label, self.target.reshape(self.target.shape[0], -1).shape[1])
        rows = self.meta.get("targets") or []
        if not rows:
            return None
        labels = rows[min(row, len(rows) - 1)]  # classifiers read a request once for every row; masked LMs per mask
        return labels[label] if label < len(labels) else None

    def target_label(self, row: int = 0, label: int = 0) -> str:
        """One explained target as every output names it: ``'Paris' -> '␣Paris' (id 7042, p 0.773)`` (the request
        is shown when it was read as another text; a word of several tokens: ``(id 7042, p 0.773, the first of its 4
        tokens)``)."""
        infos = self.target_info(row)
        info = infos[label_index(label, len(infos))]
        text = info["text"] if info["text"] is not None else str(info["id"])
        how = self.resolution(row, label)
        request = how["request"] if how and isinstance(how["request"], str) and how["request"] != text else None
        prob = "" if info["probability"] is None else f", p {info['probability']:.3g}"
        # a word of several tokens explains its first: said where the target is named, not only in meta's note
        # ('Berlin' -> '␣' read as if '␣' were the word)
        tokens = len(how.get("tokens") or ()) if how else 0
        first = f", the first of its {tokens} tokens" if tokens > 1 and how["how"] == "word" else ""
        # quoted as they are: readable texts are escaped already (repr would double their backslashes)
        return ((f"'{printable(request)}' -> " if request is not None else "")
                + f"'{text}' (id {info['id']}{prob}{first})")

    def norm_spread(self, row: int = 0) -> float:
        """Coefficient of variation of the embedding norms over the tokens of a row that rank; see
        :func:`nxl_hooks.method.scores.flat_norms` for what a tiny value means."""
        return norm_spread(self.embed_norm[row_index(row, self.mask.shape[0])], self.rankable(row))

    def overflowed(self) -> bool:
        """Whether the model's own outputs at a prediction position were NaN or infinite (a float16 overflow): its
        probability there is NaN, or a regression head's prediction is not a finite number."""
        if self.probability is not None:
            return bool(self.probability.isnan().any())
        prediction = self.meta.get("prediction")
        values = [value for row in prediction for value in row] if isinstance(prediction, list) else []
        return any(isinstance(value, float) and not math.isfinite(value) for value in values)

    def to_html(self, path: str | Path | None = None, **options: Any) -> str:
        """Self-contained tokens x layers heatmap page; also written to ``path`` when given.

        ``res.to_html("a.html")``; ``options`` go to :func:`nxl_hooks.records.html.attribution_html` (rows, label, method,
        all_positions).
        """
        from .html import attribution_html

        text = attribution_html(self, **options)
        if path is not None:
            write_text(path, text)
        return text

    def _repr_html_(self) -> str:
        from .html import attribution_html

        # A notebook cell stays readable: the first rows only (to_html(rows=...) shows any).
        return attribution_html(self, rows=range(min(8, self.normxlogit.shape[1])), full_page=False)

    def save(self, path: str | Path) -> Path:
        """Write one safetensors file; layers, tokens and meta go in its JSON metadata. ``res.save("a.safetensors")``

        Written under a temporary name and renamed: a failed save leaves an existing file as it was."""
        tensors = {name: value.detach().cpu().contiguous()
                   for name, value in {**scores_to_store(self.scores),
                                       **{name: getattr(self, name) for name in _FIELD_TENSORS}}.items()}
        tensors.update({name: getattr(self, name).detach().cpu().contiguous() for name in _OPTIONAL_TENSORS
                        if getattr(self, name) is not None})
        header = {"format": _FORMAT, "version": FORMAT_VERSION, "layers": self.layers, "tokens": self.tokens,
                  "meta": self.meta,
                  **{name: getattr(self, name) for name in _OPTIONAL_HEADER if getattr(self, name) is not None}}
        return write_bytes(path, write_blob(tensors, {"nxl_hooks": json.dumps(header)}))

    @classmethod
    def load(cls, path: str | Path) -> "Attribution":
        """Read a file written by :meth:`save` (no pickle involved). ``nxl.Attribution.load("a.safetensors")``

        Raises :class:`RecordError` (a ValueError) naming the file and what does not fit, OSError when it cannot be read.
        """
        data = read_regular(path, RecordError)  # a FIFO or device refused; no more than the file's size read
        if data.startswith(STREAM_MAGIC):  # generate's records (--generate --out a.safetensors): not a broken file
            raise RecordError(f"{path} is a stream file of generate step records (attach(..., sink=...), nxl attribute "
                              "--generate --out), not an attribution: read it with nxl.read_stream(path)")
        try:
            metadata, stored = read_blob(data)
            header = _header(metadata)
            missing = [name for name in _TENSORS if name not in stored]
            if missing:
                raise RecordError(f"tensor {missing[0]!r} is missing (an attribution file holds {_TENSORS})")
            tensors = {name: stored[name] for name in (*_FIELD_TENSORS, *_OPTIONAL_TENSORS) if name in stored}
            res = cls(scores=stored_scores(stored), **tensors, layers=header.get("layers"), tokens=header.get("tokens"), meta=header.get("meta", {}),
                      **{name: header[name] for name in _OPTIONAL_HEADER if name in header})
            res.check()
        except RecordError as err:
            raise RecordError(f"{path}: {err}") from None
        except OSError:
            raise
        except MemoryError:  # the copies the tensors are made of, beyond the file's content read
            raise RecordError(too_large(path, len(data))) from None
        except Exception as err:  # noqa: BLE001 - safetensors' own parse errors, unsupported dtypes...
            raise RecordError(f"{path} is not a safetensors file nxl_hooks can read ({type(err).__name__}: {err})") from None
        return res


def layers_text(layers: list[int]) -> str:
    """Layer indices in a few characters: ``0..30 (31)`` when consecutive, else the list."""
    if len(layers) > 2 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}..{layers[-1]} ({len(layers)})"
    return str(layers)


def _header(metadata: dict[str, str]) -> dict[str, Any]:
    """The ``nxl_hooks`` JSON entry of an attribution file's metadata, checked for format and version."""
    _require("nxl_hooks" in metadata, "not an nxl_hooks attribution file (no 'nxl_hooks' metadata); "
             "nxl.Attribution.save writes one")
    try:
        header = json.loads(metadata["nxl_hooks"])
    except (ValueError, RecursionError) as err:
        raise RecordError(f"its 'nxl_hooks' metadata is not valid JSON ({type(err).__name__})") from None
    _require(isinstance(header, dict) and header.get("format", _FORMAT) == _FORMAT,
             "its 'nxl_hooks' metadata is not an attribution header (written by something else?)")
    version = header.get("version", 0)
    _require(_int(version), f"format version {version!r} is not an int")
    _require(version <= FORMAT_VERSION, f"format version {version}; upgrade nxl_hooks to read it")
    return header
