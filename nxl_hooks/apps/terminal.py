"""Attributions in the terminal: a rich table of layers × tokens, and one line per generated token.

    render_table(res, Console())
    print_generation(model, tok, "The capital of France is", 8, layers=[-1])

Rows are layers and columns tokens while the tokens fit the console's width; otherwise the table is
transposed (rows = tokens), which stays readable for long texts. Scores are signed NormXLogit values; the
top token of each layer (by :meth:`Attribution.top`'s rule) is highlighted, special tokens are dimmed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..hooks.probe import attach
from ..method.placement import input_device
from ..method.select import order, special_mask
from ..records.attribution import Attribution
from ..records.steps import GenerationCall, Step

__all__ = ["format_score", "label_name", "print_generation", "render_table", "score_matrix"]

_TOP = "bold black on green"
_NEGATIVE = "red"
_SPECIAL = "dim"
_CELL = 9  # "-1.234e+05" needs 10; most scores print in 6 to 8


def format_score(value: float) -> str:
    """How a score is printed: 4 significant digits."""
    return f"{value:.4g}"


def label_name(model: Any, tokenizer: Any, kind: str, label: int) -> str:
    """A target id as people read it: the label name of a classifier, the token of an LM."""
    if kind in ("sequence_classification", "regression"):
        return str((getattr(model.config, "id2label", None) or {}).get(label, label))
    return tokenizer.convert_ids_to_tokens(label)


def score_matrix(res: Attribution, row: int = 0, label: int = 0, *, logat: bool = False) -> tuple[torch.Tensor, list[int]]:
    """(len(layers), n_real) scores of one row and label, and the real (non-pad) positions they belong to."""
    scores = (res.logat if logat else res.normxlogit)[:, row]
    if scores.dim() == 3:
        scores = scores[..., label]
    positions = res.mask[row].nonzero()[:, 0].tolist()
    return scores[:, positions], positions


def _cell(value: float, top: bool, special: bool) -> Text:
    style = _TOP if top else (_SPECIAL if special else (_NEGATIVE if value < 0 else ""))
    return Text(format_score(value), style=style)


def render_table(
    res: Attribution,
    console: Console,
    *,
    row: int = 0,
    label: int = 0,
    title: str | None = None,
    transpose: bool | None = None,
) -> None:
    """Print one row's per-layer NormXLogit as a table.

    ``transpose``: None picks rows = layers when the tokens fit the console width, else rows = tokens.
    """
    scores, positions = score_matrix(res, row, label)
    names = [res.tokens[row][p] for p in positions] if res.tokens else [str(p) for p in positions]
    special = res.special[row, positions].tolist() if res.special is not None else [False] * len(positions)
    eligible = res.rankable(row)[positions]
    top = [int(best[0]) if len(best := order(layer_scores, eligible)) else None for layer_scores in scores]
    layer_names = [f"L{layer}" for layer in res.layers]
    if transpose is None:
        widths = sum(max(_CELL, len(name)) + 3 for name in names)
        transpose = widths + 8 > console.width
    table = Table(title=title, caption="highlighted: top token per layer")
    if not transpose:
        table.add_column("layer", style="bold")
        for name, dim in zip(names, special):
            table.add_column(Text(name, style=_SPECIAL if dim else "bold"), justify="right", no_wrap=True)
        for index, layer_name in enumerate(layer_names):
            cells = [_cell(float(v), j == top[index], special[j]) for j, v in enumerate(scores[index])]
            table.add_row(layer_name, *cells)
    else:
        table.add_column("pos", justify="right", style="dim")
        table.add_column("token", style="bold")
        for layer_name in layer_names:
            table.add_column(layer_name, justify="right", no_wrap=True)
        for j, (position, name) in enumerate(zip(positions, names)):
            cells = [_cell(float(scores[i, j]), j == top[i], special[j]) for i in range(len(layer_names))]
            table.add_row(str(position), Text(name, style=_SPECIAL if special[j] else ""), *cells)
    console.print(table)


def print_generation(model: Any, tokenizer: Any, text: str, new_tokens: int, *, layers: Any = "all", top: int = 3,
                     embedding: str = "layer_input", console: Any = None,
                     sink: str | Path | None = None) -> GenerationCall:
    """Generate greedily after ``text`` and print each token's attribution as soon as it is emitted: the view of
    ``nxl attribute MODEL TEXT --generate N``. One line per token: the token, then per selected layer the ``top``
    context tokens by signed NormXLogit; ``embedding`` goes to :func:`nxl_hooks.attach`. Returns the call's records.

    ``print_generation(model, tok, "The capital of France is", 8, layers=[-1])``
    """
    console = console or Console()
    enc = tokenizer(text, return_tensors="pt").to(input_device(model))
    ids = enc["input_ids"][0].tolist()
    names = tokenizer.convert_ids_to_tokens(ids)
    console.print(Text(f"prompt ({len(names)} tokens): ", style="bold") + Text(" ".join(names)))

    def show(step: Step) -> None:
        token = tokenizer.convert_ids_to_tokens(int(step.token[0]))
        special = special_mask(torch.tensor([ids]), tokenizer)
        res = step.to_attribution(tokens=[list(names)], special=special)
        line = Text(f"{step.step:>4} ", style="dim") + Text(f"{token!r:>14}", style="bold green") + Text("  ")
        for layer in step.layers[::-1]:
            best = " ".join(f"{name!r}:{score:.3g}" for _, name, score in res.top(top, layer=layer))
            line += Text(f"L{layer} ", style="bold") + Text(best + "  ")
        console.print(line, overflow="fold")
        names.append(token)
        ids.append(int(step.token[0]))

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with attach(model, layers=layers, tokenizer=tokenizer, embedding=embedding, on_step=show, sink=sink) as probe:
        if probe.kind != "causal_lm":
            raise ValueError(f"generating needs a causal LM; {type(probe.model).__name__} is a {probe.kind} model")
        model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    return probe.calls[-1]
