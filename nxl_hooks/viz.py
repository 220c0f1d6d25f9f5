"""Self-contained HTML: attribution heatmaps (tokens x layers) and the evaluate / audit report pages.

    html = attribution_html(res)            # what res.to_html() returns; res._repr_html_() in notebooks
    page = evaluate_report(summary)         # AOPC curves per method, per-layer alignment heatmaps
    page = audit_report(summary, records)   # the examples that changed most first, then per-layer drift

No external assets: styles are inline and plots are inline SVG, so a page opens offline and can be
mailed as one file. Heatmap cells carry ``data-value`` (the exact score) and a ``title`` tooltip; plot
points carry ``data-series``, ``data-x`` and ``data-y``.
"""

from __future__ import annotations

import html
import math
from typing import Any, Mapping, Sequence

__all__ = ["attribution_html", "audit_report", "evaluate_report", "heatmap", "line_chart", "page"]

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
.nxl table.nxl-heatmap{border-collapse:collapse;font-size:12px;margin:4px 0 12px}
.nxl table.nxl-heatmap th{font-weight:600;padding:2px 6px;text-align:right;white-space:nowrap;background:#f4f4f4}
.nxl table.nxl-heatmap thead th{text-align:center}
.nxl td.nxl-cell{padding:2px 6px;text-align:right;font-variant-numeric:tabular-nums;min-width:38px;border:1px solid #fff}
.nxl table.nxl-stats{border-collapse:collapse;margin:6px 0 12px}
.nxl table.nxl-stats td,.nxl table.nxl-stats th{border-bottom:1px solid #ddd;padding:3px 10px;text-align:right}
.nxl table.nxl-stats td:first-child,.nxl table.nxl-stats th:first-child{text-align:left}
.nxl .best{font-weight:700}.nxl .flip{color:#b00;font-weight:700}
.nxl .charts{display:flex;flex-wrap:wrap;gap:18px}.nxl svg text{font-family:inherit}
.nxl .example{border-left:3px solid #ccc;padding:2px 10px;margin:10px 0}
"""


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"


def _colour(scaled: float) -> tuple[str, str]:
    """(background, text colour) on a white-centred diverging scale: +1 red, -1 blue."""
    t = max(-1.0, min(1.0, scaled))
    base = _POSITIVE if t >= 0 else _NEGATIVE
    rgb = [round(255 + (c - 255) * abs(t)) for c in base]
    return f"rgb({rgb[0]},{rgb[1]},{rgb[2]})", "#fff" if abs(t) > 0.6 else "#222"


def heatmap(
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    values: Sequence[Sequence[float | None]],
    *,
    scale: str = "column",
    caption: str = "",
    corner: str = "",
) -> str:
    """A coloured ``<table>``: one ``td.nxl-cell`` per value, with ``data-row``/``data-col``/``data-value``.

    ``scale``: "column" colours each column by its own max |value| (layers differ in scale), "row" each
    row, "all" the whole table, all on a diverging scale around 0; "range" spreads the table's min..max
    over white..red (for same-sign metrics such as average precision). ``None`` cells stay blank.
    ``heatmap(["a", "b"], ["L0"], [[1.0], [-0.5]])``
    """
    if scale not in ("column", "row", "all", "range"):
        raise ValueError(f"scale={scale!r}: use 'column', 'row', 'all' or 'range'")
    cells = [list(row) for row in values]

    def kept(items: Sequence[float | None]) -> list[float]:
        return [v for v in items if v is not None and not math.isnan(v)]

    def peak(items: Sequence[float | None]) -> float:
        return max((abs(v) for v in kept(items)), default=0.0) or 1.0

    everything = kept([v for row in cells for v in row])
    low, high = min(everything, default=0.0), max(everything, default=0.0)
    columns = [peak([row[j] for row in cells]) for j in range(len(col_labels))]
    rows = [peak(row) for row in cells]

    def shade(i: int, j: int, value: float) -> float:
        if scale == "range":
            return (value - low) / (high - low) if high > low else 0.5
        return value / {"column": columns[j], "row": rows[i], "all": peak(everything)}[scale]

    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in col_labels)
    body = []
    for i, (label, row) in enumerate(zip(row_labels, cells)):
        tds = []
        for j, value in enumerate(row):
            if value is None or math.isnan(value):
                tds.append(f'<td class="nxl-cell" data-row="{i}" data-col="{j}"></td>')
                continue
            background, ink = _colour(shade(i, j, value))
            tip = html.escape(f"{label} · {col_labels[j]}: {value:.6g}", quote=True)
            tds.append(
                f'<td class="nxl-cell" data-row="{i}" data-col="{j}" data-value="{value!r}" title="{tip}" '
                f'style="background:{background};color:{ink}">{_fmt(value)}</td>'
            )
        body.append(f"<tr><th>{html.escape(str(label))}</th>{''.join(tds)}</tr>")
    cap = f'<caption class="note">{html.escape(caption)}</caption>' if caption else ""
    return (
        f'<table class="nxl-heatmap">{cap}<thead><tr><th>{html.escape(corner)}</th>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>"
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
    """An inline SVG line chart, one polyline per series (``None`` values break the line).

    ``line_chart([10, 20], {"random": [0.1, 0.2]}, title="AOPC", x_label="K (%)", y_label="Δp")``
    """
    longest = max((len(name) for name in series), default=0)
    left, right, top, bottom = 72, max(90, 40 + int(6.5 * longest)), 28, 42  # the legend sits on the right
    plot_w, plot_h = plot_width, height - top - bottom
    width = left + plot_w + right
    ys = [y for values in series.values() for y in values if y is not None and not math.isnan(y)]
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
        parts.append(f'<text x="{left - 5}" y="{py(y) + 4:.1f}" font-size="10" text-anchor="end">{_fmt(y, 3)}</text>')
    step = max(1, math.ceil(len(xs) / 12))
    for x in xs[::step]:
        parts.append(
            f'<text x="{px(x):.1f}" y="{top + plot_h + 14}" font-size="10" text-anchor="middle">{_fmt(x, 3)}</text>'
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
            if y is None or math.isnan(y):
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


def _row_section(res: Any, row: int, label: int, method: str) -> str:
    scores = getattr(res, method)[:, row]
    if scores.dim() == 3:
        scores = scores[..., label]
    target = res.target[row]
    target = int(target[label] if target.dim() else target)
    keep = [i for i, real in enumerate(res.mask[row].tolist()) if real]
    names = res.tokens[row] if res.tokens else [str(i) for i in range(scores.shape[-1])]
    position = int(res.position[row])
    rows = [f"{i}: {names[i]}" + (" ◀" if i == position else "") for i in keep]
    values = [[float(scores[layer, i]) for layer in range(len(res.layers))] for i in keep]
    heading = (
        f"Row {row} (example {int(res.example[row])}) — target {target}, prediction read at position {position} (◀)"
    )
    return f"<h3>{html.escape(heading)}</h3>" + heatmap(
        rows, [f"L{layer}" for layer in res.layers], values, corner="token \\ layer"
    )


def attribution_html(
    res: Any, *, rows: Sequence[int] | None = None, label: int = 0, method: str = "normxlogit", full_page: bool = True
) -> str:
    """Tokens x layers heatmap of an :class:`~nxl_hooks.Attribution`, one table per explained row.

    ``attribution_html(res, rows=[0], method="logat")``; ``label`` picks the target when several were
    explained; ``full_page=False`` gives a fragment (with its style) for notebooks.
    """
    if method not in ("normxlogit", "logat"):
        raise ValueError(f"method={method!r}: use 'normxlogit' or 'logat'")
    total = res.normxlogit.shape[1]
    chosen = list(range(total)) if rows is None else list(rows)
    bad = [r for r in chosen if not 0 <= r < total]
    if bad:
        raise ValueError(f"rows {bad} out of range: this attribution has {total} row(s)")
    kind = res.meta.get("head_kind", "?")
    intro = (
        f'<h2>{html.escape(method)} per token and layer</h2><p class="note">{html.escape(str(res.meta.get("model_class", "")))}'
        f" ({html.escape(kind)}). Colour is scaled per layer (column) by its largest |score|: red positive, "
        "blue negative; the number is the score, hover for more digits.</p>"
    )
    if len(chosen) < total:
        intro += f'<p class="note">Showing {len(chosen)} of {total} rows; pick others with rows=[...].</p>'
    body = intro + "".join(_row_section(res, r, label, method) for r in chosen)
    if not full_page:
        return f'<style>{_STYLE}</style><div class="nxl">{body}</div>'
    return page(f"nxl_hooks {method}", body)


# -- report pages ----------------------------------------------------------------------------------------


def _stats_table(header: Sequence[str], rows: Sequence[Sequence[str]], best: Mapping[int, int] | None = None) -> str:
    """``best`` maps a column to the row index to emphasise."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        tds = "".join(
            f"<td{' class=best' if best and best.get(j) == i else ''}>{cell}</td>" for j, cell in enumerate(row)
        )
        body.append(f"<tr>{tds}</tr>")
    return f'<table class="nxl-stats"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _argbest(values: Sequence[float | None], high: bool) -> int | None:
    scored = [(v, i) for i, v in enumerate(values) if v is not None]
    if not scored:
        return None
    return (max if high else min)(scored)[1]


def evaluate_report(summary: Mapping[str, Any], title: str = "nxl_hooks faithfulness report") -> str:
    """The page ``nxl evaluate`` writes, from :func:`nxl_hooks.evaluate.aggregate`'s summary."""
    methods: Mapping[str, Mapping[str, Any]] = summary["methods"]
    names = list(methods)
    ks = [round(100 * k) for k in summary["ks"]]
    columns = [
        ("aopc_comprehensiveness", "AOPC comp. ↑", True),
        ("aopc_sufficiency", "AOPC suff. ↓", False),
        ("ap_eval", "AP ↑", True),
        ("dot_eval", "dot ↑", True),
        ("seconds", "s / example", False),
    ]
    rows = [[html.escape(n)] + [_fmt(methods[n].get(key)) for key, _, _ in columns] for n in names]
    best = {j + 1: _argbest([methods[n].get(key) for n in names], high) for j, (key, _, high) in enumerate(columns)}
    accuracy = summary.get("accuracy")
    facts = (
        f"{summary['n']} examples · head {summary['kind']} · perturbation: {summary['perturbation']} · "
        f"ranking layer {summary['eval_layer']}"
        + (f" · accuracy {accuracy:.3f}" if accuracy is not None else "")
        + (f" · Pearson {summary['pearson']:.3f}" if summary.get("pearson") is not None else "")
    )
    body = [
        f'<h1>{html.escape(title)}</h1><p class="note">{html.escape(facts)}</p>',
        "<h2>Summary</h2>",
        _stats_table(["method"] + [c[1] for c in columns], rows, best),
        f'<p class="note">AP and dot at the ranking layer; {html.escape(summary.get("normalization", ""))}.</p>',
        '<h2>AOPC curves</h2><div class="charts">',
    ]
    for key, name, ylabel in (
        ("comprehensiveness_curve", "Comprehensiveness (higher is more faithful)", "p_orig − p_new"),
        ("sufficiency_curve", "Sufficiency (lower is more faithful)", "p_orig − p_new"),
        ("accuracy_comprehensiveness", "Accuracy, top-K perturbed (lower is better)", "accuracy"),
        ("pearson_comprehensiveness", "Pearson, top-K perturbed (lower is better)", "Pearson r"),
    ):
        series = {n: methods[n][key] for n in names if methods[n].get(key)}
        if series:
            body.append(line_chart(ks, series, title=name, x_label="K (% of tokens)", y_label=ylabel))
    body.append("</div>")
    layers = summary["layers"]
    for key, name in (("ap", "Average precision of the evidence"), ("dot", "Normalized dot product with the evidence")):
        rows_ = [n for n in names if methods[n].get(key)]
        if not rows_:
            continue
        values = [methods[n][key] if methods[n]["layered"] else methods[n][key] * len(layers) for n in rows_]
        labels = [n if methods[n]["layered"] else f"{n} (no layers)" for n in rows_]
        body.append(f"<h2>Per-layer alignment: {html.escape(name)}</h2>")
        body.append(
            heatmap(
                labels,
                [f"L{layer}" for layer in layers],
                values,
                scale="range",
                corner="method \\ layer",
                caption="White = the table's lowest value, red = its highest; methods without layers "
                "repeat their one value.",
            )
        )
    return page(title, "".join(body))


def _example_block(record: Mapping[str, Any], rank: int) -> str:
    agree = record.get("agree")
    verdict = '<span class="flip">prediction flipped</span>' if agree is False else "same prediction" if agree else ""
    facts = (
        f"#{rank} · example {record.get('index', '?')} (id {record.get('id')!r}) · {verdict} · reference → candidate "
        f"prediction {record.get('reference_prediction')} → {record.get('candidate_prediction')} · explained output "
        f"{_fmt(record['reference_output'])} → {_fmt(record['candidate_output'])} · last layer Spearman "
        f"{_fmt(record['spearman'][-1])}, Kendall {_fmt(record['kendall'][-1])}, top-{record['top_k']} "
        f"{_fmt(record['topk'][-1])}, drift {_fmt(record['drift'][-1])}"
    )
    table = heatmap(
        ["reference", "candidate"],
        record["tokens"],
        [record["reference_scores"], record["candidate_scores"]],
        scale="all",
        corner="model \\ token",
    )
    return (
        f'<div class="example" data-index="{record.get("index", "")}"><p>{facts}</p>'
        f'<p class="note">{html.escape(record["text"])}</p>{table}</div>'
    )


def audit_report(
    summary: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    *,
    show: int = 10,
    title: str = "nxl_hooks quantization audit",
) -> str:
    """The page ``nxl audit`` writes: most-changed examples first, then per-layer agreement and drift."""
    by_index = {r.get("index", i): r for i, r in enumerate(records)}
    last = summary["last_layer"]
    agreement = summary.get("agreement")
    facts = (
        f"{summary['n']} examples · prediction agreement "
        f"{'–' if agreement is None else f'{agreement:.3f}'} ({summary['flipped']} flipped) · "
        f"mean change of the explained output {_fmt(summary['output_change'])} · last layer: Spearman "
        f"{_fmt(last['spearman'])}, Kendall {_fmt(last['kendall'])}, top-{summary['top_k']} overlap "
        f"{_fmt(last['topk'])}, drift {_fmt(last['drift'])}"
    )
    body = [
        f"<h1>{html.escape(title)}</h1><p>{html.escape(facts)}</p>",
        f"<h2>The {min(show, summary['n'])} examples that changed most</h2>",
        '<p class="note">Flipped predictions first, then the lowest last-layer Spearman. Rows: NormXLogit at the '
        "last layer, both models explaining the reference's prediction; one colour scale per example.</p>",
    ]
    body += [_example_block(by_index[index], rank + 1) for rank, index in enumerate(summary["most_changed"][:show])]
    layers = summary["layers"]
    per_layer = summary["per_layer"]
    body.append('<h2>Per layer</h2><div class="charts">')
    body.append(
        line_chart(
            layers,
            {k: per_layer[k] for k in ("spearman", "kendall", "topk")},
            title="Agreement of the rankings (1 = unchanged)",
            x_label="layer",
            y_label="mean over examples",
        )
    )
    body.append(
        line_chart(
            layers,
            {"drift": per_layer["drift"]},
            title="Drift ‖cand − ref‖ / ‖ref‖ (0 = unchanged)",
            x_label="layer",
            y_label="mean over examples",
        )
    )
    body.append("</div>")
    body.append(
        heatmap(
            ["spearman", "kendall", f"top-{summary['top_k']}", "drift"],
            [f"L{layer}" for layer in layers],
            [per_layer["spearman"], per_layer["kendall"], per_layer["topk"], per_layer["drift"]],
            scale="row",
            corner="metric \\ layer",
            caption="Means over examples; colour scaled per row.",
        )
    )
    return page(title, "".join(body))
