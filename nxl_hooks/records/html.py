"""Self-contained HTML: the page parts (heatmap tables, SVG line charts, a page), an attribution's heatmap and a
generation's heatmap.

    html = attribution_html(res)            # what res.to_html() returns; res._repr_html_() in notebooks
    html = generation_html(probe.calls[-1]) # generated tokens x context, a layer selector (nxl attribute --generate --html)
    page("title", heatmap(rows, cols, values) + line_chart(xs, series, title=..., x_label=..., y_label=...))

No external assets: styles are inline, plots are inline SVG and the generation page's layer selector is a few
lines of plain inline JavaScript, so a page opens offline and can be mailed as one file. Heatmap cells carry
``data-value`` (the score: exact on the attribution page, to 6 significant digits on the generation page, as
its data block carries it) and a ``title`` tooltip; plot points carry ``data-series``, ``data-x`` and
``data-y``. Tokens read as :mod:`nxl_hooks.records.tokens` shows them ('␣Paris', '↵').
"""

from __future__ import annotations

import html
import json
import math
from typing import Any, Mapping, Sequence

from ..method.methods.contrastive import no_foil
from ..method.scores import OVERFLOW_NOTE, flat_norms, flat_note
from ..method.select import label_index
from .tokens import printable, unseen, whole_characters

__all__ = ["attribution_html", "fmt", "generation_html", "heatmap", "line_chart", "page"]

_PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#9467bd",
    "#ff7f0e",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#7f7f7f",
    "#bcbd22",
)
_POSITIVE = (214, 39, 40)
_NEGATIVE = (31, 119, 180)

_STYLE = """
.nxl{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;color:#222;font-size:14px;line-height:1.4}
.nxl h1{font-size:22px;margin:8px 0}.nxl h2{font-size:18px;margin:22px 0 6px}.nxl h3{font-size:15px;margin:14px 0 4px}
.nxl .note{color:#555;font-size:12.5px;margin:2px 0 8px}
.nxl .nxl-scroll{max-width:100%;overflow-x:auto}
.nxl table.nxl-heatmap{border-collapse:collapse;font-size:12px;margin:4px 0 12px}
.nxl table.nxl-heatmap th{font-weight:600;padding:2px 6px;text-align:right;white-space:nowrap;background:#f4f4f4}
.nxl table.nxl-heatmap tbody th{position:sticky;left:0;z-index:1}
.nxl table.nxl-compact{font-size:11px}.nxl table.nxl-compact td.nxl-cell{padding:1px 3px;min-width:0}
.nxl table.nxl-compact th{padding:1px 3px}
.nxl table.nxl-heatmap thead th{text-align:center}
.nxl td.nxl-cell{padding:2px 6px;text-align:right;font-variant-numeric:tabular-nums;min-width:38px;border:1px solid #fff}
.nxl table.nxl-stats{border-collapse:collapse;margin:6px 0 12px}
.nxl table.nxl-stats td,.nxl table.nxl-stats th{border-bottom:1px solid #ddd;padding:3px 10px;text-align:right}
.nxl table.nxl-stats td:first-child,.nxl table.nxl-stats th:first-child{text-align:left}
.nxl .best{font-weight:700}.nxl .flip{color:#b00;font-weight:700}
.nxl .charts{display:flex;flex-wrap:wrap;gap:18px}.nxl svg text{font-family:inherit}
.nxl .example{border-left:3px solid #ccc;padding:2px 10px;margin:10px 0}
.nxl .warn{color:#8a5a00;background:#fff6e0;padding:3px 8px;border-left:3px solid #e0a000}
.nxl .prompt{font-family:ui-monospace,monospace;white-space:pre-wrap;background:#f6f6f6;padding:4px 8px}
.nxl .prompt .nxl-template{color:#999}.nxl .nxl-folded .nxl-template{display:none}
"""


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"


def _colour(scaled: float) -> tuple[str, str]:
    """(background, text colour) on a white-centred diverging scale: +1 red, -1 blue."""
    t = max(-1.0, min(1.0, scaled)) if math.isfinite(scaled) else 0.0  # NaN would clip to +1: full red
    base = _POSITIVE if t >= 0 else _NEGATIVE
    rgb = [round(255 + (c - 255) * abs(t)) for c in base]
    return f"rgb({rgb[0]},{rgb[1]},{rgb[2]})", "#fff" if abs(t) > 0.6 else "#222"


#: Above this many columns a heatmap's cells are compact (smaller type, less padding).
_COMPACT_COLUMNS = 16


def heatmap(
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    values: Sequence[Sequence[float | None]],
    *,
    scale: str = "column",
    caption: str = "",
    corner: str = "",
    scaled: Sequence[Sequence[bool]] | None = None,
    column_class: Sequence[str] | None = None,
    col_ids: Sequence[int] | None = None,
) -> str:
    """A coloured ``<table>``: one ``td.nxl-cell`` per value, with ``data-row``/``data-col``/``data-value``.

    ``scale``: "column" colours each column by its own max |value| (layers differ in scale), "row" each
    row, "all" the whole table, all on a diverging scale around 0; "range" spreads the table's min..max
    over white..red (for same-sign metrics such as average precision). ``None`` cells stay blank, and NaN and ±inf
    ones too (their value in the tooltip), setting no scale. ``scaled``
    (with ``scale="row"`` or ``"column"``): which cells set the scale of their row or column (the others are
    coloured on it, clipped);
    ``column_class``: a CSS class for each column's cells (its header included), "" for none; ``col_ids``: each
    column's ``data-col`` (default its index: the generation page gives positions, a padded row's padding left out).
    ``heatmap(["a", "b"], ["L0"], [[1.0], [-0.5]])``
    """
    if scale not in ("column", "row", "all", "range"):
        raise ValueError(f"scale={scale!r}: use 'column', 'row', 'all' or 'range'")
    cells = [list(row) for row in values]

    def kept(items: Sequence[float | None]) -> list[float]:
        # finite only: one ±inf peak would whiten its whole column (and -inf / inf is NaN)
        return [v for v in items if v is not None and math.isfinite(v)]

    def peak(items: Sequence[float | None]) -> float:
        return max((abs(v) for v in kept(items)), default=0.0) or 1.0

    everything = kept([v for row in cells for v in row])
    low, high = min(everything, default=0.0), max(everything, default=0.0)
    overall = peak(everything)  # once: per cell it made a table of n cells cost n passes over it
    def scales(i: int, j: int) -> bool:
        return scaled is None or scaled[i][j]

    columns = [peak([row[j] for i, row in enumerate(cells) if scales(i, j)]) for j in range(len(col_labels))]
    rows = [peak([v for j, v in enumerate(row) if scales(i, j)]) for i, row in enumerate(cells)]
    classes = [f" {name}" if name else "" for name in column_class] if column_class else [""] * len(col_labels)
    ids = list(col_ids) if col_ids is not None else list(range(len(col_labels)))

    def shade(i: int, j: int, value: float) -> float:
        if scale == "range":
            return (value - low) / (high - low) if high > low else 0.5
        return value / (columns[j] if scale == "column" else rows[i] if scale == "row" else overall)

    head = "".join(f'<th class="{extra.strip()}">{html.escape(str(c))}</th>' if extra else
                   f"<th>{html.escape(str(c))}</th>" for c, extra in zip(col_labels, classes))
    body = []
    for i, (label, row) in enumerate(zip(row_labels, cells)):
        tds = []
        for j, value in enumerate(row):
            if value is None:
                tds.append(f'<td class="nxl-cell{classes[j]}" data-row="{i}" data-col="{ids[j]}"></td>')
                continue
            tip = html.escape(f"{label} · {col_labels[j]}: {value:.6g}", quote=True)
            if not math.isfinite(value):  # blank like None, its NaN or ±inf said in the tooltip
                tds.append(f'<td class="nxl-cell{classes[j]}" data-row="{i}" data-col="{ids[j]}" title="{tip}"></td>')
                continue
            background, ink = _colour(shade(i, j, value))
            tds.append(
                f'<td class="nxl-cell{classes[j]}" data-row="{i}" data-col="{ids[j]}" data-value="{value!r}" '
                f'title="{tip}" style="background:{background};color:{ink}">{fmt(value)}</td>'
            )
        body.append(f"<tr><th>{html.escape(str(label))}</th>{''.join(tds)}</tr>")
    cap = f'<caption class="note">{html.escape(caption)}</caption>' if caption else ""
    # Never wider than the page: many columns (31 layers) get compact cells, and what still does not fit scrolls
    # inside its own box, the row labels staying in view, while the page itself never scrolls sideways.
    compact = " nxl-compact" if len(col_labels) > _COMPACT_COLUMNS else ""
    return (
        f'<div class="nxl-scroll"><table class="nxl-heatmap{compact}">{cap}<thead><tr><th>{html.escape(corner)}</th>'
        f"{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"
    )


def line_chart(
    xs: Sequence[float],
    series: Mapping[str, Sequence[float | None]],
    *,
    title: str,
    x_label: str,
    y_label: str,
    plot_width: int = 270,
    height: int = 290,
) -> str:
    """An inline SVG line chart, one polyline per series (``None``, NaN and ±inf values break the line).

    ``line_chart([10, 20], {"random": [0.1, 0.2]}, title="AOPC", x_label="K (%)", y_label="Δp")``
    """
    longest = max((len(name) for name in series), default=0)
    left, right, top, bottom = 72, max(90, 40 + int(6.5 * longest)), 28, 42  # the legend sits on the right
    plot_w, plot_h = plot_width, height - top - bottom
    width = left + plot_w + right
    ys = [y for values in series.values() for y in values if y is not None and math.isfinite(y)]
    low, high = (min(ys), max(ys)) if ys else (0.0, 1.0)
    if low == high:
        low, high = low - 0.5, high + 0.5
    pad = (high - low) * 0.06
    low, high = low - pad, high + pad
    x_low, x_high = min(xs), max(xs)
    x_span = (x_high - x_low) or 1.0

    def px(x: float) -> float:
        return left + (x - x_low) / x_span * plot_w

    def py(y: float) -> float:
        return top + (high - y) / (high - low) * plot_h

    parts = [
        f'<svg class="nxl-chart" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(title, quote=True)}">',
        f'<text x="{left}" y="16" font-size="13" font-weight="600">{html.escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#bbb"/>',
    ]
    for i in range(5):
        y = low + (high - low) * i / 4
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#e3e3e3"/>')
        parts.append(f'<text x="{left - 5}" y="{py(y) + 4:.1f}" font-size="10" text-anchor="end">{fmt(y, 3)}</text>')
    step = max(1, math.ceil(len(xs) / 12))
    for x in xs[::step]:
        parts.append(
            f'<text x="{px(x):.1f}" y="{top + plot_h + 14}" font-size="10" text-anchor="middle">{fmt(x, 3)}</text>'
        )
    parts.append(
        f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" font-size="11" text-anchor="middle">{html.escape(x_label)}</text>'
    )
    parts.append(
        f'<text transform="translate(13 {top + plot_h / 2:.1f}) rotate(-90)" font-size="11" '
        f'text-anchor="middle">{html.escape(y_label)}</text>'
    )
    for n, (name, values) in enumerate(series.items()):
        colour = _PALETTE[n % len(_PALETTE)]
        segment: list[str] = []
        segments = [segment]
        for x, y in zip(xs, values):
            if y is None or not math.isfinite(y):  # a gap, like None: an inf would stretch the axis away
                segment = []
                segments.append(segment)
                continue
            segment.append(f"{px(x):.1f},{py(y):.1f}")
            tip = html.escape(f"{name} at {x:g}: {y:.6g}", quote=True)
            parts.append(
                f'<circle class="nxl-point" cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}" '
                f'data-series="{html.escape(name, quote=True)}" data-x="{x!r}" data-y="{y!r}"><title>{tip}</title></circle>'
            )
        for seg in segments:
            if len(seg) > 1:
                parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{" ".join(seg)}"/>')
        ly = top + 12 + 16 * n
        parts.append(
            f'<line x1="{left + plot_w + 10}" x2="{left + plot_w + 28}" y1="{ly - 4}" y2="{ly - 4}" stroke="{colour}" stroke-width="3"/>'
        )
        parts.append(f'<text x="{left + plot_w + 32}" y="{ly}" font-size="11">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def page(title: str, body: str) -> str:
    """A complete HTML document around ``body``, styles inline, no external resources."""
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_STYLE}</style></head>'
        f'<body><div class="nxl">{body}</div></body></html>'
    )


# -- one attribution -------------------------------------------------------------------------------------


def _notes(notes: Sequence[str]) -> str:
    return "".join(f'<p class="note warn">note: {html.escape(note)}</p>' for note in dict.fromkeys(notes))


def _row_section(res: Any, row: int, label: int, method: str, all_positions: bool) -> str:
    """One row's tables, each layer's colours scaled by the tokens that rank (as on the generation page)."""
    scores = res.scores[method][:, row]
    if scores.dim() == 3:
        scores = scores[..., label]
    keep = [i for i, real in enumerate(res.mask[row].tolist()) if real]
    names = res.token_labels(row)
    position = int(res.position[row])
    template = res.template[row].tolist() if res.template is not None else [False] * len(names)
    rows = [("▫ " if template[i] else "") + f"{i}: {names[i]}" + (" ◀" if i == position else "") for i in keep]
    values = [[float(scores[layer, i]) for layer in range(len(res.layers))] for i in keep]
    ranks = res.rankable(row, all_positions=all_positions).tolist()
    scaled = [[ranks[i]] * len(res.layers) for i in keep]  # the template, specials and ◀ would set the scale
    heading = (f"Row {row} (example {int(res.example[row])}) — target {res.target_label(row, label)}, prediction read "
               f"at position {position} (◀)")
    how = res.resolution(row, label)
    section = f"<h3>{html.escape(heading)}</h3>" + _notes([how["note"]] if how and how.get("note") else [])
    if any(template):
        section += ('<p class="note">▫ the chat template\'s own tokens (its markers and the system prompt): '
                    + ("they rank too (all_positions)." if all_positions else
                       "they do not rank (Attribution.top(all_positions=True) ranks them too).") + "</p>")
    section += heatmap(rows, [f"L{layer}" for layer in res.layers], values, corner="token \\ layer", scaled=scaled)
    if res.scores[method].dim() == 4 and res.scores[method].shape[-1] == 2 and label == 0:
        contrast = res.scores[method][:, row, :, 0] - res.scores[method][:, row, :, 1]
        section += (f"<h3>{html.escape(f'Row {row} — contrast: {method} of {res.target_label(row, 0)} minus ')}"
                    f"{html.escape(res.target_label(row, 1))}</h3>")
        section += heatmap(rows, [f"L{layer}" for layer in res.layers],
                           [[float(contrast[layer, i]) for layer in range(len(res.layers))] for i in keep],
                           corner="token \\ layer", scaled=scaled)
    return section


def attribution_html(
    res: Any, *, rows: Sequence[int] | None = None, label: int = 0, method: str = "normxlogit", full_page: bool = True,
    all_positions: bool = False,
) -> str:
    """Tokens x layers heatmap of an :class:`~nxl_hooks.Attribution`, one table per explained row.

    ``attribution_html(res, rows=[0], method="logat")`` (``method``: any in ``res.scores``); ``label`` picks the
    target when several were
    explained (with two, label 0 also shows the contrast label 0 minus label 1); ``full_page=False`` gives a
    fragment (with its style) for notebooks; ``all_positions``: every real token ranks, as in
    :meth:`~nxl_hooks.Attribution.top`.
    """
    total = res.method_scores(method).shape[1]  # ValueError naming the methods it has
    chosen = list(range(total)) if rows is None else list(rows)
    bad = [r for r in chosen if not 0 <= r < total]
    if bad:
        raise ValueError(f"rows {bad} out of range: this attribution has {total} row(s)")
    label_index(label, res.target.reshape(total, -1).shape[1])  # as top() checks it
    kind = res.meta.get("head_kind", "?")
    intro = (
        f'<h2>{html.escape(method)} per token and layer</h2><p class="note">{html.escape(str(res.meta.get("model_class", "")))}'
        f" ({html.escape(str(kind))}). Colour is scaled per layer (column) by the largest |score| of the tokens that "
        "rank: red positive, "
        "blue negative; the number is the score, hover for more digits. Tokens: ␣ a space, ↵ a newline.</p>"
    )
    if res.overflowed():
        intro += _notes([OVERFLOW_NOTE])
    spreads = [res.norm_spread(r) for r in chosen]
    if method == "normxlogit" and any(flat_norms(s) for s in spreads):
        intro += _notes([flat_note(max(s for s in spreads if flat_norms(s)))])
    if foil := no_foil(method, res.method_scores(method)):  # its cells (or some rows') are blank
        intro += _notes([foil])
    if len(chosen) < total:
        intro += f'<p class="note">Showing {len(chosen)} of {total} rows; pick others with rows=[...].</p>'
    body = intro + "".join(_row_section(res, r, label, method, all_positions) for r in chosen)
    if not full_page:
        return f'<style>{_STYLE}</style><div class="nxl">{body}</div>'
    return page(f"nxl_hooks {method}", body)


# -- one generation --------------------------------------------------------------------------------------

# Recolours the table when another layer is picked (or named in the address: page.html#layer=12).
_GENERATION_SCRIPT = """
(function () {
  var data = JSON.parse(document.getElementById("nxl-data").textContent);
  var select = document.getElementById("nxl-layer");
  var cells = document.querySelectorAll("#nxl-generation td.nxl-cell");
  // the last layer's texts as Python wrote them, shown again for that layer: the script's own formatting below
  // rounds an exact tie (1.125) up where Python rounds it to even
  var written = Array.prototype.map.call(cells, function (td) { return [td.textContent, td.title]; });
  var last = data.layers.length - 1;
  // numbers as Python writes them (fmt() and the tooltips' %.6g), so a cell reads the same before and after this
  // script runs: exponents of two digits at least
  function exponent(s) {
    return s.replace(/e([+-])(\\d)$/, function (m, sign, digit) { return "e" + sign + "0" + digit; });
  }
  function g(v, p) {  // "%.{p}g": fixed unless the rounded exponent is < -4 or >= p, trailing zeros dropped
    var x = +v.toExponential(p - 1).split("e")[1];
    var s = x < -4 || x >= p ? v.toExponential(p - 1) : v.toFixed(p - 1 - x);
    return exponent(s.replace(/\\.0*(?=e|$)|(\\.\\d*?)0+(?=e|$)/, "$1"));
  }
  function fmt(v) {
    return v === 0 || Math.abs(v) >= 1e-3 ? g(v, 3) : exponent(v.toExponential(1));
  }
  function colour(t) {
    t = Math.max(-1, Math.min(1, t));
    var base = t >= 0 ? [214, 39, 40] : [31, 119, 180];
    var rgb = base.map(function (c) { return Math.round(255 + (c - 255) * Math.abs(t)); });
    return ["rgb(" + rgb.join(",") + ")", Math.abs(t) > 0.6 ? "#fff" : "#222"];
  }
  function show(index) {
    var peaks = data.values.map(function (row, i) {
      return row[index].reduce(function (m, v, j) {
        return v === null || !data.ranked[i][j] ? m : Math.max(m, Math.abs(v));
      }, 0) || 1;
    });
    cells.forEach(function (td, n) {
      var i = +td.dataset.row, j = +td.dataset.col, v = data.values[i][index][j];
      if (v === null || v === undefined) {  // blank: masked, after the token, or a NaN / ±inf score at this layer
        td.textContent = ""; td.removeAttribute("title"); td.removeAttribute("style"); delete td.dataset.value;
        return;
      }
      var c = colour(v / peaks[i]);
      td.dataset.value = String(v);
      td.textContent = index === last ? written[n][0] : fmt(v);
      td.style.background = c[0];
      td.style.color = c[1];
      td.title = index === last ? written[n][1] : data.rows[i] + " · " + data.columns[j] + ": " + g(v, 6);
    });
    // each row's step view: its k best context tokens at this layer are bold, as nxl tail lists them
    cells.forEach(function (td) {
      var ranked = (data.steps[+td.dataset.row].scores[data.method] || {})[String(data.layers[index])] || [];
      td.classList.toggle("best", ranked.some(function (entry) { return entry[0] === +td.dataset.col; }));
    });
    select.value = String(index);
  }
  select.addEventListener("change", function () { show(+select.value); });
  var fold = document.getElementById("nxl-template");
  if (fold) {
    fold.addEventListener("change", function () {
      document.getElementById("nxl-generation").classList.toggle("nxl-folded", !fold.checked);
    });
  }
  var wanted = /layer=(-?\\d+)/.exec(window.location.hash);
  var layer = wanted ? +wanted[1] : data.layers[last];
  var index = data.layers.indexOf(layer < 0 ? data.layers[data.layers.length + layer] : layer);
  show(index >= 0 ? index : last);
})();
"""


def _unfinished(call: Any) -> str:
    """What of ``call`` its record lacks, and why; "" when it holds every step."""
    if call.complete:
        return ""
    after = f" after step {call.steps[-1].step}" if call.steps else ""
    if call.error:
        return f"not recorded{after}: {printable(call.error.removeprefix('not recorded: '))}"
    return f"incomplete: the record ends{after} (its stream was cut, or the call is still running)"


def _missing(steps: Sequence[Any]) -> str:
    """What of a call's first steps its record lacks, and why; "" when it starts at step 0."""
    first = steps[0].step
    return (f"the record starts at step {first}: a rotating sink deleted the files of the steps before it, whose "
            f"tokens read @position ({unseen(steps[0].position - first)} is step 0's)") if first else ""


def generation_html(call: Any, *, row: int = 0, label: int = 0, method: str = "normxlogit",
                    title: str = "nxl_hooks generation", k: int = 3, all_positions: bool = False) -> str:
    """Self-contained page of one ``generate`` call (a :class:`~nxl_hooks.GenerationCall`): generated tokens (rows) x context tokens (columns), one layer at
    a time, picked in a selector (the last layer first; ``page.html#layer=N`` opens layer N). Each row is the
    attribution of that token over everything before it, coloured by the largest |score| of the row's tokens that
    rank (:meth:`~nxl_hooks.GenerationCall.attribution`); blank cells are positions after the token. A padded row
    (a batch generated with ``padding_side="left"``) shows its own tokens: its padding is left out of the prompt, its
    count and the table, whose columns keep their positions in the batch (as step views, ``nxl tail`` and the data
    block, indexed by position, number tokens), and a note says how many positions it leaves out. A chat template's
    columns (markers, system prompt) are marked ``▫`` and folded away until asked for, so the table starts at the
    user's message (``all_positions``: every real token ranks, the template's too, and nothing is folded). Each
    row is labelled by its step view
    (:class:`~nxl_hooks.records.view.StepView`, what ``nxl tail`` and the endpoint show; the page carries them in
    its data block) and its ``k`` best context tokens at the shown layer are bold. A call whose record stopped
    early (``call.error``), ends without its end (a cut stream) or starts after its first steps (a rotating sink
    deleted them: their tokens read ``@position``) says so at the top, as do its notes (``call.notes``); one
    without steps is a page saying why. A row that ended before the batch did has no rows for generate's padding
    after its end (``step.active`` False).

    ``generation_html(probe.calls[-1])``; ``row``: which sequence of the batch; ``label``: which fixed target;
    ``method``: any in the steps' ``scores``.
    """
    unfinished = _unfinished(call)
    if call.prompt_mask is None or not call.steps:  # still a page: `nxl attribute --html` promised a file
        why = unfinished or "no steps recorded (attach(keep_steps=False) keeps none)"
        return page(title, f"<h1>{html.escape(title)}</h1>" + _notes([f"{why}: nothing to show"]))
    for step in call.steps:
        step.method_scores(method)  # ValueError naming the methods it has
    steps = call.steps
    if not 0 <= row < steps[0].token.shape[0]:
        raise ValueError(f"row {row} out of range: this call generated {steps[0].token.shape[0]} sequence(s)")
    label_index(label, steps[0].target.reshape(steps[0].token.shape[0], -1).shape[1], "this call")
    made = call.made(row)  # generate's padding after the row's end left out, as the call's texts leave it out
    padded, steps = len(steps) - len(made), made
    if not steps:
        return page(title, f"<h1>{html.escape(title)}</h1>" + _notes(
            [f"row {row} had ended before the record's first step: nothing to show"]))
    ended = (f"row {row} ended at step {steps[-1].step}; the {padded} step(s) after it, generate's padding until "
             "the whole batch stopped, are not shown") if padded else ""
    layers = list(steps[0].layers)
    prompt_len = call.prompt_mask.shape[1]
    # without texts, tokens are named as the step views name them: #ID, or @position where not even the id is known
    # (a prompt given as inputs_embeds)
    context = list(call.readable[row]) if call.readable else steps[0].names(call, row)[:prompt_len]
    for step in steps:  # each at its position: the tokens of steps a rotated file deleted are not known
        context += map(unseen, range(len(context), step.position))
        context.append(step.token_name(row))
    # a character split over byte tokens reads whole on every token of it, in the prompt, columns and rows alike
    # (the call is over: the step views' "…" of a character still arriving is not the page's)
    whole = whole_characters(context)
    flags = call.context_template(len(context))
    template = flags[row].tolist() if flags is not None else [False] * len(context)
    columns = [("▫ " if template[j] else "") + f"{j}: {name}" for j, name in enumerate(whole)]
    row_names, values, ranked, views, overflowed = [], [], [], [], False
    for step in steps:
        scores = step.scores[method][:, row]
        scores = scores[..., label] if scores.dim() == 3 else scores
        mask = step.mask[row].tolist()
        # NaN and ±inf as null (blank cells): JSON has neither, and JSON.parse refuses the whole block for one
        per_layer = [[float(f"{v:.6g}") if mask[j] and math.isfinite(v) else None
                      for j, v in enumerate(layer_scores.tolist())]
                     + [None] * (len(context) - len(mask)) for layer_scores in scores]
        values.append(per_layer)
        # what ranks (not the template, special tokens or the prediction) sets the row's colour scale
        record = call.attribution(step)
        overflowed = overflowed or record.overflowed()
        ranked.append(record.rankable(row, all_positions=all_positions).tolist() + [False] * (len(context) - len(mask)))
        view = step.view(call, k=k, row=row, label=label, names=context[: step.position + 1],
                         all_positions=all_positions)
        views.append(view.to_json())
        p = "" if view.probability is None else f" · p {fmt(view.probability)}"
        if view.target is not None:  # a fixed target: the scores explain it, not the token
            p += f" · explains {view.target}" + ("" if view.target_probability is None else
                                                 f" (p {fmt(view.target_probability)})")
        row_names.append(f"{view.step}: {whole[step.position]}{p}")
    spread = call.norm_spread(row)
    last = len(layers) - 1
    options = "".join(f'<option value="{i}"{" selected" if i == last else ""}>L{layer}</option>'
                      for i, layer in enumerate(layers))
    # "<" escaped: a token reading "</script>" must not end the data block
    data = json.dumps({"layers": layers, "rows": row_names, "columns": columns, "values": values, "ranked": ranked,
                       "method": method, "steps": views}, allow_nan=False)
    data = data.replace("<", "\\u003c")
    # the row's own tokens: its padding (a batch padded on the left, as chat tokenizers pad) is left out of the prompt
    # and the table, as the attribution page and the Parquet rows leave it out; columns keep their positions in the
    # batch, which the step views (nxl tail, the data block) and the records number tokens by
    real = call.prompt_mask[row].tolist() + [True] * (len(context) - prompt_len)
    kept = [j for j in range(len(context)) if real[j]]
    pads = len(context) - len(kept)
    shown = [f'<span class="nxl-template">{html.escape(whole[j])}</span>' if template[j] else html.escape(whole[j])
             for j in kept if j < prompt_len]
    folded = any(template) and not all_positions  # ranked tokens are never hidden
    first = next((j for j in kept if not template[j]), kept[0])  # the user's message: past padding and template
    marked = ('<p class="note">▫ the chat template\'s own tokens (its markers and the system prompt, greyed in the '
              "prompt above): ")
    toggle = (marked + f"they do not rank and do not set the colour scale. Their {sum(template)} columns are "
              f'folded away, so the table starts at your message (column {first}): <label><input type="checkbox" '
              'id="nxl-template"> show them</label></p>') if folded else (
        marked + "they rank too (all_positions).</p>" if any(template) else "")
    body = (
        f"<h1>{html.escape(title)}</h1>"
        + _notes([note for note in (_missing(steps), unfinished, ended, *call.notes) if note])
        + f'<p class="note">Prompt ({len(shown)} tokens; ␣ a space, ↵ a newline'
        + (f"; this row's {pads} position(s) of padding are left out, here and in the table, whose columns keep "
           f"their positions in the batch (as nxl tail and the step views number tokens): its prompt starts at column "
           f"{kept[0]}" if pads else "") + "):</p>"
        f'<p class="prompt">{" ".join(shown)}</p>'
        + (_notes([OVERFLOW_NOTE]) if overflowed else "")
        + (_notes([flat_note(spread)]) if method == "normxlogit" and flat_norms(spread) else "")
        + toggle
        + f'<p><label>layer <select id="nxl-layer">{options}</select></label> '
        f'<span class="note">{html.escape(method)} of each generated token (row) over its context (columns); '
        "colour scaled per row by the largest |score| of the tokens that rank: red positive, blue negative; hover "
        "for the value.</span></p>"
        f'<div id="nxl-generation" class="{"nxl-folded" if folded else ""}" style="overflow-x:auto">'
        + heatmap(row_names, [columns[j] for j in kept], [[v[last][j] for j in kept] for v in values], scale="row",
                  corner="generated \\ context", scaled=[[r[j] for j in kept] for r in ranked],
                  column_class=["nxl-template" if template[j] else "" for j in kept], col_ids=kept)
        + "</div>"
        + f'<script type="application/json" id="nxl-data">{data}</script>'
        + f"<script>{_GENERATION_SCRIPT}</script>"
    )
    return page(title, body)
