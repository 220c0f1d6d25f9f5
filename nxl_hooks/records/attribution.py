"""The result of one explained forward, and its safetensors + JSON file format.

Layout. Rows are what is explained: one per input example for causal LMs and classifiers, one per
``[MASK]`` position for masked LMs (``example`` says which input row a row came from, ``position``
where its prediction is read). With ``target`` a list of k labels, ``normxlogit`` and ``logat`` get a
trailing axis of size k, in the order given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..method.scores import norm_spread
from ..method.select import layer_index, order, rankable
from .tokens import visible

__all__ = ["Attribution", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_TENSORS = ("normxlogit", "logat", "embed_norm", "target", "mask", "position", "example")
_OPTIONAL_TENSORS = ("special", "input_ids", "probability")  # absent from files written before they existed
_OPTIONAL_HEADER = ("readable", "target_text")  # the same; a reader that predates them ignores them


@dataclass
class Attribution:
    """Per-layer NormXLogit of one forward.

    ``res.normxlogit[res.layers.index(L), row, i]`` is the attribution of token i at layer L.
    """

    normxlogit: torch.Tensor  #: float32 (len(layers), rows, seq[, k])
    logat: torch.Tensor  #: float32, same shape: HoT(h_i^l)[y] (regression: |HoT(h_i^l) - HoT(h_p^L)|)
    embed_norm: torch.Tensor  #: float32 (rows, seq)
    layers: list[int]  #: 0 = input of block 1, L = output of the last block
    target: torch.Tensor  #: int64 (rows,) or (rows, k): the label / token ids explained
    mask: torch.Tensor  #: bool (rows, seq), True on real tokens
    position: torch.Tensor  #: int64 (rows,): the prediction position
    example: torch.Tensor  #: int64 (rows,): the input row each row explains
    tokens: list[list[str]] | None = None  #: token strings per row, when a tokenizer was given
    meta: dict[str, Any] = field(default_factory=dict)  #: model_type, head kind, embedding, ...
    special: torch.Tensor | None = None  #: bool (rows, seq), True on the tokenizer's special tokens (when known)
    input_ids: torch.Tensor | None = None  #: int64 (rows, seq): the token ids of each row (when the forward had ids)
    readable: list[list[str]] | None = None  #: each token's text as people read it ('␣Paris', '↵'; records.tokens)
    probability: torch.Tensor | None = None  #: float32, shaped like ``target``: the model's softmax probability of
    #: each explained target at the prediction position (None for regression)
    target_text: list[list[str]] | None = None  #: (rows, k): each explained target as people read it

    def layer(self, layer: int) -> torch.Tensor:
        """NormXLogit at one layer (negative counts from the end): ``res.layer(-1)`` -> (rows, seq[, k])."""
        n_blocks = self.meta.get("n_blocks")
        if layer < 0 and n_blocks is None:
            raise ValueError(f"layer {layer}: this result does not record the model's block count; use one of {self.layers}")
        wanted = layer_index(layer, n_blocks) if n_blocks is not None else layer
        if wanted not in self.layers:
            raise ValueError(f"layer {layer} was not captured; captured layers: {self.layers}")
        return self.normxlogit[self.layers.index(wanted)]

    def rankable(self, row: int = 0, *, all_positions: bool = False) -> torch.Tensor:
        """bool (seq,): the positions of one row that rank (see :func:`nxl_hooks.method.select.rankable`); with
        ``all_positions`` every real token, the prediction position and special tokens included."""
        if all_positions:
            return self.mask[row].bool()
        special = None if self.special is None else self.special[row]
        return rankable(self.mask[row], int(self.position[row]), special)

    def top(
        self, k: int = 5, layer: int = -1, row: int = 0, label: int = 0, *, all_positions: bool = False
    ) -> list[tuple[int, str, float]]:
        """The k highest-scoring tokens of one row by signed NormXLogit: [(position, text, score)], the text as
        :meth:`token_labels` shows it ('␣Paris').

        Padding, the prediction position and special tokens are left out unless ``all_positions``; NaN ranks last.
        """
        scores = self.layer(layer)[row]
        if scores.dim() == 2:
            scores = scores[:, label]
        best = order(scores, self.rankable(row, all_positions=all_positions))[:k]
        names = self.token_labels(row)
        return [(int(i), names[int(i)], float(scores[i])) for i in best]

    def token_labels(self, row: int = 0) -> list[str]:
        """How each token of a row is shown: its readable text ('␣Paris'), else its piece made visible (files
        written before readable texts existed), else its position."""
        if self.readable:
            return list(self.readable[row])
        if self.tokens:
            return [visible(piece) for piece in self.tokens[row]]
        return [str(i) for i in range(self.mask.shape[-1])]

    def target_info(self, row: int = 0) -> list[dict[str, Any]]:
        """Each explained target of a row: ``[{"id", "text", "probability"}, ...]`` (text and probability None
        where unknown); notes on how a request was resolved are in ``meta["targets"]``."""
        ids = self.target[row].reshape(-1).tolist()
        probs = self.probability[row].reshape(-1).tolist() if self.probability is not None else [None] * len(ids)
        texts = self.target_text[row] if self.target_text else [None] * len(ids)
        return [{"id": int(i), "text": t, "probability": p} for i, t, p in zip(ids, texts, probs)]

    def resolution(self, row: int = 0, label: int = 0) -> dict[str, Any] | None:
        """How the request behind a target was read (``meta["targets"]``, set by :func:`nxl_hooks.explain`): request,
        id, text, how, tokens, note; None when the targets were ids or the model's own prediction."""
        rows = self.meta.get("targets") or []
        if not rows:
            return None
        labels = rows[min(row, len(rows) - 1)]  # masked LMs read a request once for every row
        return labels[label] if label < len(labels) else None

    def target_label(self, row: int = 0, label: int = 0) -> str:
        """One explained target as every output names it: ``'Paris' -> '␣Paris' (id 7042, p 0.773)`` (the request
        is shown when it was read as another text)."""
        info = self.target_info(row)[label]
        text = info["text"] if info["text"] is not None else str(info["id"])
        how = self.resolution(row, label)
        request = how["request"] if how and isinstance(how["request"], str) and how["request"] != text else None
        prob = "" if info["probability"] is None else f", p {info['probability']:.3g}"
        return (f"{request!r} -> " if request is not None else "") + f"{text!r} (id {info['id']}{prob})"

    def norm_spread(self, row: int = 0) -> float:
        """Coefficient of variation of the embedding norms over the tokens of a row that rank; see
        :func:`nxl_hooks.method.scores.flat_norms` for what a tiny value means."""
        return norm_spread(self.embed_norm[row], self.rankable(row))

    def to_html(self, path: str | Path | None = None, **options: Any) -> str:
        """Self-contained tokens x layers heatmap page; also written to ``path`` when given.

        ``res.to_html("a.html")``; ``options`` go to :func:`nxl_hooks.records.html.attribution_html` (rows, label, method).
        """
        from .html import attribution_html

        text = attribution_html(self, **options)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    def _repr_html_(self) -> str:
        from .html import attribution_html

        # A notebook cell stays readable: the first rows only (to_html(rows=...) shows any).
        return attribution_html(self, rows=range(min(8, self.normxlogit.shape[1])), full_page=False)

    def save(self, path: str | Path) -> Path:
        """Write one safetensors file; layers, tokens and meta go in its JSON metadata. ``res.save("a.safetensors")``"""
        path = Path(path)
        tensors = {name: getattr(self, name).detach().cpu().contiguous() for name in _TENSORS}
        tensors.update({name: getattr(self, name).cpu().contiguous() for name in _OPTIONAL_TENSORS
                        if getattr(self, name) is not None})
        header = {"format": "nxl_hooks.attribution", "version": FORMAT_VERSION, "layers": self.layers,
                  "tokens": self.tokens, "meta": self.meta,
                  **{name: getattr(self, name) for name in _OPTIONAL_HEADER if getattr(self, name) is not None}}
        save_file(tensors, str(path), metadata={"nxl_hooks": json.dumps(header)})
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Attribution":
        """Read a file written by :meth:`save` (no pickle involved). ``nxl.Attribution.load("a.safetensors")``"""
        with safe_open(str(path), framework="pt") as fh:
            metadata = fh.metadata() or {}
            if "nxl_hooks" not in metadata:
                raise ValueError(f"{path} is not an nxl_hooks attribution file (no 'nxl_hooks' metadata)")
            header = json.loads(metadata["nxl_hooks"])
            if header.get("version", 0) > FORMAT_VERSION:
                raise ValueError(f"{path} has format version {header['version']}; upgrade nxl_hooks to read it")
            tensors = {name: fh.get_tensor(name) for name in _TENSORS}
            tensors.update({name: fh.get_tensor(name) for name in _OPTIONAL_TENSORS if name in fh.keys()})
        return cls(**tensors, layers=header["layers"], tokens=header["tokens"], meta=header["meta"],
                   **{name: header[name] for name in _OPTIONAL_HEADER if name in header})
