"""Records as the control endpoint hands them out: JSON a person (or ``nxl tail``) can read.

    summary(watch, call)                       # {"request_id", "model", "kind", "steps", "complete", ...}
    step_view(watch, call, step, k=5)          # a StepView: the token and, per method and layer, its top-k context
    forward_view(watch, forward, k=5)          # a classifier's forward: per explained row, the top-k per layer

A generated token is a :class:`~nxl_hooks.records.view.StepView` (ranked as :meth:`nxl_hooks.Attribution.top`),
named here by the watched model's tokenizer (:class:`~nxl_hooks.apps.serve.controller.Texts`), the same schema
``nxl tail`` and the HTML page read.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ...records.steps import GenerationCall, Step
from ...records.view import StepView, ranking, ranking_json

__all__ = ["Context", "Names", "Watched", "call_view", "ended", "forward_view", "step_view", "summary"]


class Names(Protocol):
    """How a watched model's tokens read (:class:`~nxl_hooks.apps.serve.controller.Texts`)."""

    def text(self, token_id: int) -> str: ...

    def special(self, ids: list[int]) -> list[bool] | None: ...


class Watched(Protocol):
    """What a live reader reads of a watched model (:class:`~nxl_hooks.apps.serve.controller.Watch`)."""

    name: str
    slug: str
    texts: Names


def ended(call: GenerationCall) -> bool:
    """Whether the call has returned or stopped being recorded (no more steps will come)."""
    return call.complete or call.error is not None or call.sequences is not None


def summary(watch: Watched, record: Any) -> dict:
    """One line of the request list: a generation call, or a forward of a model that does not generate."""
    common = {"request_id": record.request_id, "model": watch.name, "thread": record.thread}
    if not isinstance(record, GenerationCall):
        res = record.attribution
        return {**common, "kind": "forward", "rows": int(res.normxlogit.shape[1]), "complete": True, "ended": True,
                "error": None, "layers": res.layers}
    return {**common, "kind": "generate", "call": record.index, "steps": len(record.steps), "started": record.started,
            "choice": None if record.choice is None else record.choice.to_json(),
            "complete": record.complete, "ended": ended(record), "error": record.error,
            "prompt_tokens": int(record.prompt_mask.shape[1]) if record.prompt_mask is not None else None,
            "layers": record.layers}


class Context:
    """A call's known token ids for one row by position (prompt, then each kept step's token at its position) as
    text, with special-token flags: computed once for every step of a call view. A position whose token is not
    known (a step not kept: a call read from a trimmed sink; the prompt's, where its ids are not) reads ``@N``."""

    def __init__(self, texts: Names, call: GenerationCall | None, row: int = 0) -> None:
        steps = list(call.steps) if call is not None else []
        prompt = call.prompt_ids.shape[1] if call is not None and call.prompt_ids is not None else 0
        ids = call.context_ids(steps[-1].position + 1 if steps else prompt) if call is not None else None
        self.ids = ids[row].tolist() if ids is not None else []  # -1 where not known
        self.names = [texts.text(i) if i >= 0 else f"@{n}" for n, i in enumerate(self.ids)]
        self.special = texts.special(self.ids)

    def upto(self, n: int) -> tuple[list[str], list[bool] | None]:
        """Names and flags of positions 0..n-1 (positions past the known ones by number)."""
        missing = range(len(self.names), n)
        names = self.names[:n] + [f"@{i}" for i in missing]
        return names, None if self.special is None else self.special[:n] + [False] * len(missing)


def step_view(watch: Watched, call: GenerationCall | None, step: Step, *, k: int = 5, row: int = 0,
              context: Context | None = None) -> StepView:
    """One step of ``watch``'s model: the emitted token and, per layer, the ``k`` context tokens that drove it most,
    named by the model's tokenizer (``context``: the call's, computed once for a whole call view)."""
    texts = watch.texts
    names, special = (context or Context(texts, call, row)).upto(step.position)
    flags = torch.tensor([special] * step.token.shape[0], dtype=torch.bool) if special is not None else None
    explained = int(step.target.reshape(step.token.shape[0], -1)[row, 0])  # a fixed target: named by the tokenizer
    return step.view(call, k=k, row=row, names=[*names, texts.text(int(step.token[row]))], special=flags,
                     model=watch.name, target=texts.text(explained))


def call_view(watch: Watched, call: GenerationCall, *, k: int = 5, row: int = 0) -> dict:
    """One request: its summary, prompt tokens and every kept step."""
    texts, steps = watch.texts, list(call.steps)
    context = Context(texts, call, row)
    prompt = call.prompt_ids[row].tolist() if call.prompt_ids is not None else []
    return {**summary(watch, call), "prompt": [texts.text(i) for i in prompt],
            "steps": [step_view(watch, call, step, k=k, row=row, context=context).to_json() for step in steps]}


def forward_view(watch: Watched, forward: Any, *, k: int = 5) -> dict:
    """One forward: per explained row (an example, or a [MASK]), its target and the ``k`` tokens of each layer
    that drove it most (``Attribution.top``; token strings as the tokenizer names them)."""
    res = forward.attribution
    rows = [{"row": row, "example": int(res.example[row]), "position": int(res.position[row]),
             "target": res.target[row].reshape(-1).tolist(), "tokens": res.tokens[row] if res.tokens else None,
             "top": ranking_json(ranking(res, k, row))} for row in range(res.normxlogit.shape[1])]
    return {**summary(watch, forward), "explained": rows}
