"""Records as the control endpoint hands them out: JSON a person (or ``nxl tail``) can read.

    summary(watch, call)                       # {"request_id", "model", "steps", "complete", ...}
    step_view(watch.texts, call, step, k=5)    # {"step", "token", "top": {"30": [[position, "token", score], ...]}}

Top-k follows :meth:`nxl_hooks.Attribution.top` (signed NormXLogit; padding, the prediction position and special
tokens do not rank). Token text is ``tokenizer.decode`` of the single id.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...records.steps import GenerationCall, Step

__all__ = ["Context", "call_view", "ended", "step_view", "summary"]


def ended(call: GenerationCall) -> bool:
    """Whether the call has returned or stopped being recorded (no more steps will come)."""
    return call.complete or call.error is not None or call.sequences is not None


def summary(watch: Any, call: GenerationCall) -> dict:
    """One line of the request list."""
    return {"request_id": call.request_id, "model": watch.name, "call": call.index, "thread": call.thread,
            "steps": len(call.steps), "complete": call.complete, "ended": ended(call), "error": call.error,
            "prompt_tokens": int(call.prompt_mask.shape[1]) if call.prompt_mask is not None else None,
            "layers": call.layers}


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


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
              context: Context | None = None) -> dict:
    """One step: the emitted token and, per layer, the ``k`` context tokens that drove it most."""
    names, special = (context or Context(texts, call, row)).upto(step.position)
    batch = step.token.shape[0]
    flags = torch.tensor([special] * batch, dtype=torch.bool) if special is not None else None
    res = step.to_attribution(tokens=[names] * batch, special=flags)
    top = {str(layer): [[position, name, _number(score)] for position, name, score in res.top(k, layer=layer, row=row)]
           for layer in step.layers}
    token = int(step.token[row])
    return {"step": step.step, "position": step.position, "token_id": token, "token": texts.text(token),
            "active": bool(step.active[row]), "top": top}


def call_view(watch: Any, call: GenerationCall, *, k: int = 5, row: int = 0) -> dict:
    """One request: its summary, prompt tokens and every kept step."""
    texts, steps = watch.texts, list(call.steps)
    context = Context(texts, call, row)
    prompt = call.prompt_ids[row].tolist() if call.prompt_ids is not None else []
    return {**summary(watch, call), "prompt": [texts.text(i) for i in prompt],
            "steps": [step_view(texts, call, step, k=k, row=row, context=context) for step in steps]}
