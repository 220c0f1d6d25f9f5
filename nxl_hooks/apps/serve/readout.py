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

__all__ = ["call_view", "ended", "step_view", "summary"]


def ended(call: GenerationCall) -> bool:
    """Whether the call has returned or stopped being recorded (no more steps will come)."""
    return call.complete or call.error is not None or call.sequences is not None


def summary(watch: Any, call: GenerationCall) -> dict:
    """One line of the request list."""
    return {"request_id": call.request_id, "model": watch.name, "call": call.index, "thread": call.thread,
            "steps": len(call.steps), "complete": call.complete, "ended": ended(call), "error": call.error,
            "prompt_tokens": int(call.prompt_mask.shape[1]) if call.prompt_mask is not None else None,
            "layers": call.layers}


def _context(call: GenerationCall, row: int) -> list[int]:
    prompt = call.prompt_ids[row].tolist() if call.prompt_ids is not None else []
    return prompt + [int(step.token[row]) for step in list(call.steps)]


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def step_view(texts: Any, call: GenerationCall | None, step: Step, *, k: int = 5, row: int = 0,
              layers: list[int] | None = None) -> dict:
    """One step: the emitted token and, per layer, the ``k`` context tokens that drove it most."""
    ids = _context(call, row)[: step.position] if call is not None else []
    names = [texts.text(i) for i in ids] + [f"@{i}" for i in range(len(ids), step.position)]
    special = texts.special(ids)
    batch = step.token.shape[0]
    flags = None
    if special is not None:
        flags = torch.tensor([special + [False] * (step.position - len(special))] * batch, dtype=torch.bool)
    res = step.to_attribution(tokens=[names] * batch, special=flags)
    top = {str(layer): [[position, name, _number(score)] for position, name, score in res.top(k, layer=layer, row=row)]
           for layer in (layers if layers is not None else step.layers)}
    token = int(step.token[row])
    return {"step": step.step, "position": step.position, "token_id": token, "token": texts.text(token),
            "active": bool(step.active[row]), "top": top}


def call_view(watch: Any, call: GenerationCall, *, k: int = 5, row: int = 0) -> dict:
    """One request: its summary, prompt tokens and every kept step."""
    texts = watch.texts
    prompt = call.prompt_ids[row].tolist() if call.prompt_ids is not None else []
    steps = list(call.steps)
    return {**summary(watch, call), "prompt": [texts.text(i) for i in prompt],
            "steps": [step_view(texts, call, step, k=k, row=row) for step in steps]}
