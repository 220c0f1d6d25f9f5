"""Records as the control endpoint hands them out: JSON a person (or ``nxl tail``) can read.

    summary(watch, call)                       # {"request_id", "model", "kind", "steps", "complete", ...}
    step_view(watch.texts, call, step, k=5)    # {"step", "token", "top": {"30": [[position, "token", score], ...]}}
    forward_view(watch, forward, k=5)          # a classifier's forward: per explained row, the top-k per layer

Top-k follows :meth:`nxl_hooks.Attribution.top` (signed NormXLogit, or ``method=``: any method the probe
computes; padding, the prediction position, special
tokens and a chat template's own tokens do not rank). Token text is the readable text of the single id
(:mod:`nxl_hooks.records.tokens`), except that tokens which each hold part of one character (an emoji a byte-level
tokenizer splits) show that character (:func:`~nxl_hooks.records.tokens.whole_characters`, over the context and
the emitted token: a token whose character the next token completes reads ``…`` until then).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...records.steps import GenerationCall, Step
from ...records.tokens import whole_characters

__all__ = ["Context", "call_view", "ended", "forward_view", "step_view", "summary"]


def ended(call: GenerationCall) -> bool:
    """Whether the call has returned or stopped being recorded (no more steps will come)."""
    return call.complete or call.error is not None or call.sequences is not None


def summary(watch: Any, record: Any) -> dict:
    """One line of the request list: a generation call, or a forward of a model that does not generate."""
    common = {"request_id": record.request_id, "model": watch.name, "thread": record.thread}
    if not isinstance(record, GenerationCall):
        res = record.attribution
        return {**common, "kind": "forward", "rows": int(res.normxlogit.shape[1]), "complete": True, "ended": True,
                "error": None, "layers": res.layers}
    return {**common, "kind": "generate", "call": record.index, "steps": len(record.steps), "started": record.started,
            "complete": record.complete, "ended": ended(record), "error": record.error,
            "prompt_tokens": int(record.prompt_mask.shape[1]) if record.prompt_mask is not None else None,
            "layers": record.layers}


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def _top(res: Any, k: int, row: int, method: str) -> dict:
    """Per layer, the top-k ``[position, text, score]`` by ``method``: ``{}`` when the record has no such scores
    (:func:`unscored` says why)."""
    if method not in res.scores:
        return {}
    return {str(layer): [[position, name, _number(score)]
                         for position, name, score in res.top(k, layer=layer, row=row, method=method)]
            for layer in res.layers}


def unscored(record: Any, method: str) -> dict:
    """``{"method": method}``, and ``"unscored"``: why the view ranks nothing, when ``record`` (an Attribution or
    a Step) has no scores of ``method``."""
    if method in record.scores:
        return {"method": method}
    return {"method": method, "unscored": f"the probe does not compute {method!r} (it computes "
                                          f"{', '.join(record.scores)}; attach(..., methods=[{method!r}]))"}


class Context:
    """A call's known token ids for one row (prompt, then each step's token) as text, with special-token flags:
    computed once for every step of a call view."""

    def __init__(self, texts: Any, call: GenerationCall | None, row: int = 0) -> None:
        prompt = call.prompt_ids[row].tolist() if call is not None and call.prompt_ids is not None else []
        steps = list(call.steps) if call is not None else []
        self.ids = prompt + [int(step.token[row]) for step in steps]
        self.names = [texts.text(i) for i in self.ids]
        self.special = texts.special(self.ids)

    def upto(self, n: int) -> tuple[list[str], list[bool] | None]:
        """Names and flags of positions 0..n-1 (positions not known, say a call read from a trimmed sink, by
        number)."""
        missing = range(len(self.names), n)
        names = self.names[:n] + [f"@{i}" for i in missing]
        return names, None if self.special is None else self.special[:n] + [False] * len(missing)


def step_view(texts: Any, call: GenerationCall | None, step: Step, *, k: int = 5, row: int = 0,
              context: Context | None = None, method: str = "normxlogit") -> dict:
    """One step: the emitted token and, per layer, the ``k`` context tokens that drove it most."""
    names, special = (context or Context(texts, call, row)).upto(step.position)
    batch = step.token.shape[0]
    flags = torch.tensor([special] * batch, dtype=torch.bool) if special is not None else None
    template = call.context_template(step.position) if call is not None else None  # the chat template does not rank
    token = int(step.token[row])
    shown = whole_characters([*names, texts.text(token)])  # what was there when the token was made, never later
    res = step.to_attribution(tokens=[names] * batch, special=flags, template=template,
                              readable=[shown[:-1]] * batch)
    probability = None if step.probability is None else float(step.probability.reshape(batch, -1)[row, 0])
    return {"step": step.step, "position": step.position, "token_id": token, "token": shown[-1],
            "probability": probability,
            "active": bool(step.active[row]), "top": _top(res, k, row, method), **unscored(step, method)}


def call_view(watch: Any, call: GenerationCall, *, k: int = 5, row: int = 0, method: str = "normxlogit") -> dict:
    """One request: its summary, prompt tokens and every kept step."""
    texts, steps = watch.texts, list(call.steps)
    context = Context(texts, call, row)
    prompt = call.prompt_ids[row].tolist() if call.prompt_ids is not None else []
    return {**summary(watch, call), "prompt": [texts.text(i) for i in prompt],
            "steps": [step_view(texts, call, step, k=k, row=row, context=context, method=method) for step in steps]}


def forward_view(watch: Any, forward: Any, *, k: int = 5, method: str = "normxlogit") -> dict:
    """One forward: per explained row (an example, or a [MASK]), its target and the ``k`` tokens of each layer
    that drove it most (``Attribution.top``; token strings as the tokenizer names them)."""
    res = forward.attribution
    rows = [{"row": row, "example": int(res.example[row]), "position": int(res.position[row]),
             "target": res.target[row].reshape(-1).tolist(), "tokens": res.tokens[row] if res.tokens else None,
             "top": _top(res, k, row, method)} for row in range(res.normxlogit.shape[1])]
    return {**summary(watch, forward), **unscored(res, method), "explained": rows}
