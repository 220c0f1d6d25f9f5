"""One generated token as every reader shows it: the step view. The control endpoint's live stream (SSE) and its
``/v1/requests`` readout, ``nxl tail`` and the generation HTML page (:func:`~nxl_hooks.records.html.generation_html`)
all read this one schema, a dataclass with its JSON form, so a token reaches each of them through typed calls.

    view = step.view(call, k=5)              # from a record (Step.view); texts: the record's readable texts
    layer, best = view.ranked()              # the last layer's k context tokens that drove the token most
    StepView.from_json(view.to_json()) == view

Scores are a mapping ``method -> layer -> ranked context tokens``: an attribution method beside NormXLogit is one
more key of :attr:`StepView.scores`, not a new field. Ranking follows :meth:`nxl_hooks.Attribution.top` (padding,
the prediction position, special tokens and a chat template's own tokens do not rank). Texts are readable texts
(:mod:`nxl_hooks.records.tokens`); tokens that each hold part of one character (an emoji a byte-level tokenizer
splits) show that character (:func:`~nxl_hooks.records.tokens.whole_characters`, over the context and the emitted
token: a token whose character the next token completes reads ``…`` until then).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

from .attribution import Attribution

__all__ = ["Choice", "METHOD", "Ranked", "StepView", "ranking", "ranking_json"]

#: The method every view carries (the one :meth:`~nxl_hooks.Attribution.top` ranks by).
METHOD = "normxlogit"


class Ranked(NamedTuple):
    """One context token among those that drove a generated token most."""

    position: int  #: its position in the sequence
    text: str  #: its readable text ('␣Paris')
    score: float | None  #: its score (None: NaN or ±inf, which JSON cannot carry)


class Choice(NamedTuple):
    """Where a server's reply puts what a call generated, for a request that generates several things at once (vLLM's
    ``n`` samples, a completion request's prompts): ``choices[sample]`` of a chat reply, ``choices[prompt * n +
    sample]`` of a completion's (``n``: the request's). ``call.choice.sample``"""

    prompt: int | None  #: which of a completion request's prompts; None where the request has one (a chat)
    sample: int  #: which of the request's ``n`` samples (0 with ``n`` = 1)

    def label(self) -> str:
        """How readers show it after the request id: ``Choice(None, 1).label() == "#1"`` (a chat's sample 1),
        ``Choice(2, 0).label() == "#2.0"`` (a completion's prompt 2); "" for a request's first choice (sample 0 of
        its first prompt), so that a request of one choice, by far the most, reads as its id alone."""
        if not (self.prompt or self.sample):
            return ""
        return f"#{self.sample}" if self.prompt is None else f"#{self.prompt}.{self.sample}"

    def to_json(self) -> dict[str, int | None]:
        """``{"prompt": 2, "sample": 0}``: the one JSON form of a choice, in a stream's call frames, a Parquet file's
        calls, the step view and the endpoint's request list (:meth:`from_json` reads it back)."""
        return self._asdict()

    @classmethod
    def from_json(cls, data: Any) -> "Choice":
        """The choice :meth:`to_json` made; ValueError when ``data`` is not one (its ``sample`` and a ``prompt``
        given are indices: ints from 0 that fit int32, not bools). ``Choice.from_json({"prompt": 2, "sample": 0})``
        """
        if isinstance(data, dict) and _index(data.get("sample")) and (data.get("prompt") is None
                                                                     or _index(data.get("prompt"))):
            return cls(data.get("prompt"), data["sample"])
        raise ValueError(f"not a choice: {data!r:.80} (expected {{\"prompt\": an index or null, \"sample\": "
                         f"an index}})")


def _index(value: Any) -> bool:
    """Whether ``value`` is an index as records keep one: an int (not a bool) from 0 that fits int32 (the Parquet
    columns' type, and the stream reader's bound on every index)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31


@dataclass(frozen=True)
class StepView:
    """One generated token: its text and probability and, per method and layer, the context tokens that drove it
    most. ``step.view(call, k=3).ranked(layer=2)`` (:meth:`~nxl_hooks.Step.view` makes one from a record)"""

    step: int  #: 0 for the first generated token
    position: int  #: the token's position in the sequence
    token_id: int
    token: str  #: its readable text, a character split over tokens shown whole
    #: the model's own probability of the token (None where not recorded: with a fixed target, unless the token is
    #: one of the explained ids)
    probability: float | None
    active: bool  #: False on a row that had finished before this step (its pad token)
    #: method -> layer -> the k context tokens that drove the token (or ``target_id``) most, best first
    scores: Mapping[str, Mapping[int, tuple[Ranked, ...]]] = field(default_factory=dict)
    request_id: str | None = None  #: the request the token belongs to, where known
    model: str | None = None  #: the model's name, where known
    #: the id the scores explain where it is not the token (``attach(target=...)``, ``nxl run --target``), else None
    target_id: int | None = None
    target: str | None = None  #: its readable text ('#ID' where not known), None where the token is explained
    target_probability: float | None = None  #: the model's probability of ``target_id`` (None where not known)
    choice: Choice | None = None  #: which of its request's choices the token's call generates, where known

    def ranked(self, layer: int | None = None, method: str = METHOD) -> tuple[int, tuple[Ranked, ...]]:
        """(layer, its ranked context tokens) by ``method`` at ``layer``: one the view has, a negative one counted
        from its last (-1: the last), None for the last; ValueError naming the layers it has for any other."""
        if method not in self.scores:
            raise ValueError(f"method {method!r} is not in this step view: it has {', '.join(self.scores) or 'none'}")
        by_layer = self.scores[method]
        layers = sorted(by_layer)
        if layer is None or -len(layers) <= layer < 0:
            layer = layers[-1 if layer is None else layer]
        elif layer not in by_layer:
            raise ValueError(f"layer {layer} was not recorded: this step view has layers "
                             f"{', '.join(map(str, layers))} (or -{len(layers)}..-1, counted from the last)")
        return layer, by_layer[layer]

    def to_json(self) -> dict:
        """The view as JSON (the endpoint's ``step`` event and each step of ``/v1/requests/ID``). ``top`` repeats
        ``scores["normxlogit"]``: what endpoints sent before the step view, for readers that know only it."""
        scores = {method: ranking_json(by_layer) for method, by_layer in self.scores.items()}
        return {"request_id": self.request_id, "model": self.model, "step": self.step, "position": self.position,
                "token_id": self.token_id, "token": self.token, "probability": self.probability,
                "active": self.active, "scores": scores, "top": scores.get(METHOD, {}), "target_id": self.target_id,
                "target": self.target, "target_probability": self.target_probability,
                "choice": None if self.choice is None else self.choice.to_json()}

    @classmethod
    def from_json(cls, data: Any) -> "StepView":
        """The view :meth:`to_json` made (or an older endpoint's step, ``top`` alone); ValueError when ``data`` is
        not one."""
        try:
            scores = data["scores"] if "scores" in data else {METHOD: data["top"]}
            return cls(step=int(data["step"]), position=int(data["position"]), token_id=int(data["token_id"]),
                       token=str(data["token"]), probability=_optional(float, data.get("probability")),
                       active=bool(data.get("active", True)),
                       scores={str(method): {int(layer): tuple(Ranked(int(p), str(text), _optional(float, score))
                                                                for p, text, score in ranked)
                                             for layer, ranked in by_layer.items()}
                               for method, by_layer in scores.items()},
                       request_id=data.get("request_id"), model=data.get("model"),
                       target_id=_optional(int, data.get("target_id")),
                       target=_optional(str, data.get("target")),
                       target_probability=_optional(float, data.get("target_probability")),
                       choice=_optional(Choice.from_json, data.get("choice")))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"not a step view ({type(error).__name__}: {error}); is the endpoint an nxl_hooks "
                             "one?") from None


def ranking(res: Attribution, k: int, row: int = 0, label: int = 0,
            method: str = METHOD, *, all_positions: bool = False) -> dict[int, tuple[Ranked, ...]]:
    """Per layer of ``res``, the ``k`` context tokens of ``row`` that drove its target ``label`` most by ``method``
    (:meth:`~nxl_hooks.Attribution.top`, ``all_positions`` as there; NaN and ±inf scores as None).
    ``ranking(res, 3)[-1]``"""
    return {layer: tuple(Ranked(p, text, _number(score))
                         for p, text, score in res.top(k, layer=layer, row=row, label=label, method=method,
                                                       all_positions=all_positions))
            for layer in res.layers}


def ranking_json(ranked: Mapping[int, tuple[Ranked, ...]]) -> dict[str, list[list]]:
    """A :func:`ranking` as JSON: ``{"layer": [[position, text, score], ...]}``."""
    return {str(layer): [list(entry) for entry in entries] for layer, entries in ranked.items()}


def _number(value: float) -> float | None:
    """``value``, or None for NaN and ±inf (JSON has neither)."""
    return value if math.isfinite(value) else None


def _optional(convert: Any, value: Any) -> Any:
    return None if value is None else convert(value)
