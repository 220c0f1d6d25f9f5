"""An :class:`~nxl_hooks.Attribution` as a rich table in the terminal: layers × tokens, top token highlighted.

    render_table(res, Console(), special=set(tokenizer.all_special_tokens))

Rows are layers and columns tokens while the tokens fit the console's width; otherwise the table is
transposed (rows = tokens), which stays readable for long texts. Scores are signed NormXLogit values; the
top token of each layer (by signed value, special tokens excluded) is highlighted.
"""

from __future__ import annotations

from typing import Collection

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .attribution import Attribution

__all__ = ["format_score", "render_table", "score_matrix"]

_TOP = "bold black on green"
_NEGATIVE = "red"
_SPECIAL = "dim"
_CELL = 9  # "-1.234e+05" needs 10; most scores print in 6 to 8


def format_score(value: float) -> str:
    """How a score is printed: 4 significant digits."""
    return f"{value:.4g}"


def score_matrix(res: Attribution, row: int = 0, label: int = 0, *, logat: bool = False) -> tuple[torch.Tensor, list[int]]:
    """(len(layers), n_real) scores of one row and label, and the real (non-pad) positions they belong to."""
    scores = (res.logat if logat else res.normxlogit)[:, row]
    if scores.dim() == 3:
        scores = scores[..., label]
    positions = res.mask[row].nonzero()[:, 0].tolist()
    return scores[:, positions], positions


def _top_per_layer(scores: torch.Tensor, names: list[str], special: Collection[str]) -> list[int | None]:
    eligible = torch.tensor([name not in special for name in names])
    if not eligible.any():
        eligible = torch.ones(len(names), dtype=torch.bool)
    masked = scores.masked_fill(~eligible, float("-inf"))
    return [int(i) for i in masked.argmax(-1)]


def _cell(value: float, top: bool, special: bool) -> Text:
    style = _TOP if top else (_SPECIAL if special else (_NEGATIVE if value < 0 else ""))
    return Text(format_score(value), style=style)


def render_table(
    res: Attribution,
    console: Console,
    *,
    row: int = 0,
    label: int = 0,
    special: Collection[str] = (),
    title: str | None = None,
    transpose: bool | None = None,
) -> None:
    """Print one row's per-layer NormXLogit as a table.

    ``special``: token strings shown dimmed and never highlighted ([CLS], <s>, ...). ``transpose``:
    None picks rows = layers when the tokens fit the console width, else rows = tokens.
    """
    scores, positions = score_matrix(res, row, label)
    names = [res.tokens[row][p] for p in positions] if res.tokens else [str(p) for p in positions]
    top = _top_per_layer(scores, names, special)
    layer_names = [f"L{layer}" for layer in res.layers]
    if transpose is None:
        widths = sum(max(_CELL, len(name)) + 3 for name in names)
        transpose = widths + 8 > console.width
    table = Table(title=title, caption="highlighted: top token per layer")
    if not transpose:
        table.add_column("layer", style="bold")
        for name in names:
            table.add_column(Text(name, style=_SPECIAL if name in special else "bold"), justify="right", no_wrap=True)
        for index, layer_name in enumerate(layer_names):
            cells = [_cell(float(v), j == top[index], names[j] in special) for j, v in enumerate(scores[index])]
            table.add_row(layer_name, *cells)
    else:
        table.add_column("pos", justify="right", style="dim")
        table.add_column("token", style="bold")
        for layer_name in layer_names:
            table.add_column(layer_name, justify="right", no_wrap=True)
        for j, (position, name) in enumerate(zip(positions, names)):
            cells = [_cell(float(scores[i, j]), j == top[i], name in special) for i in range(len(layer_names))]
            table.add_row(str(position), Text(name, style=_SPECIAL if name in special else ""), *cells)
    console.print(table)
