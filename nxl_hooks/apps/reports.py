"""The report pages of ``nxl evaluate`` and ``nxl audit``, from their JSON summaries and records.

    page = evaluate_report(summary)         # AOPC curves per method, per-layer alignment heatmaps
    print(evaluate_summary(summary))        # the methods' table, as nxl evaluate prints it
    page = audit_report(summary, records)   # the examples that changed most first, then per-layer drift

Both pages end with the table of what made the numbers (``summary["made_with"]``): each model, its dtype and
quantization, and the packages' versions.
"""

from __future__ import annotations

import html
from typing import Any, Mapping, Sequence

from ..eval.faithfulness import BASELINES, k_as_written
from ..method.scores import FLAT_NORM_CV
from ..records.html import fmt, heatmap, line_chart, page
from .dataset import NOTES_SHOWN

__all__ = ["audit_report", "evaluate_report", "evaluate_summary"]


def _stats_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                 best: Mapping[int, set[int]] | None = None) -> str:
    """``best`` maps a column to the row indices to emphasise."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        tds = "".join(
            f"<td{' class=best' if best and i in best.get(j, ()) else ''}>{cell}</td>" for j, cell in enumerate(row)
        )
        body.append(f"<tr>{tds}</tr>")
    return f'<table class="nxl-stats"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _argbest(values: Sequence[float | None], high: bool) -> set[int]:
    """The indices of every value equal to the best one: a tie is no win for whichever method comes first or last."""
    scored = [v for v in values if v is not None]
    if not scored:
        return set()
    top = (max if high else min)(scored)
    return {i for i, v in enumerate(values) if v == top}


#: The summary table's columns: (summary key, heading, higher is better).
_COLUMNS = (
    ("aopc_comprehensiveness", "AOPC comp. ↑", True),
    ("aopc_sufficiency", "AOPC suff. ↓", False),
    ("ap_eval", "AP ↑", True),
    ("dot_eval", "dot ↑", True),
    ("seconds", "s / example", False),
)
_BEST_NOTE = "best among the methods; a baseline (random) is a floor to beat, never best"


def _summary_table(summary: Mapping[str, Any]) -> tuple[list[str], list[list[str]], dict[int, set[int]]]:
    """(header, rows of formatted cells, column -> the rows that are best, every one tied for it) of the methods:
    each method's own numbers (``seconds``: its own time per example); a baseline is labelled so and never best."""
    methods: Mapping[str, Mapping[str, Any]] = summary["methods"]
    names = list(methods)
    rows = [[f"{n} (baseline)" if n in BASELINES else n] + [fmt(methods[n].get(key)) for key, _, _ in _COLUMNS]
            for n in names]
    best = {j + 1: _argbest([None if n in BASELINES else methods[n].get(key) for n in names], high)
            for j, (key, _, high) in enumerate(_COLUMNS)}
    return ["method"] + [heading for _, heading, _ in _COLUMNS], rows, best


def evaluate_summary(summary: Mapping[str, Any]) -> str:
    """The summary table ``nxl evaluate`` prints in the terminal (plain text, best marked ``*``)."""
    header, rows, best = _summary_table(summary)
    cells = [header] + [[cell + ("*" if i in best.get(j, ()) else "") for j, cell in enumerate(row)]
                        for i, row in enumerate(rows)]
    widths = [max(len(row[j]) for row in cells) for j in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    return "\n".join([f"{summary['n']} examples, ranking layer {summary['eval_layer']}:", *lines,
                      f"* {_BEST_NOTE}"])


def evaluate_report(summary: Mapping[str, Any], title: str = "nxl_hooks faithfulness report") -> str:
    """The page ``nxl evaluate`` writes, from :func:`nxl_hooks.eval.faithfulness.aggregate`'s summary."""
    methods: Mapping[str, Mapping[str, Any]] = summary["methods"]
    names = list(methods)
    ks = [float(100 * k_as_written(k)) for k in summary["ks"]]  # (K of 12.5% was plotted at 12, 2.5% at 2)
    header, cells, best = _summary_table(summary)
    rows = [[html.escape(cell) for cell in row] for row in cells]
    accuracy = summary.get("accuracy")
    facts = (
        f"{summary['n']} examples · head {summary['kind']} · perturbation: {summary['perturbation']} · "
        f"ranking layer {summary['eval_layer']}"
        + (f" · accuracy {accuracy:.3f}" if accuracy is not None else "")
        + (f" · Pearson {summary['pearson']:.3f}" if summary.get("pearson") is not None else "")
    )
    body = [
        f'<h1>{html.escape(title)}</h1><p class="note">{html.escape(facts)}</p>',
        _flat_note(summary),
        _failed_note(summary),
        _notes_note(summary),
        "<h2>Summary</h2>",
        _stats_table(header, rows, best),
        f'<p class="note">Bold: {_BEST_NOTE}. s / example: each method\'s own time. AP and dot at the ranking '
        f'layer; {html.escape(summary.get("normalization", ""))}.</p>',
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
    body.append(_made_with_table(summary))
    return page(title, "".join(body))


def _flat_note(summary: Mapping[str, Any]) -> str:
    """The one note a report gives when some examples' embedding norms were flat (NormXLogit ranked as LogAt)."""
    flat = summary.get("flat_norms")
    if not flat:
        return ""
    return (f'<p class="note warn">note: on {flat} of {summary["n"]} examples the input-embedding norms are nearly '
            f"equal on the ranked tokens (coefficient of variation below {FLAT_NORM_CV:g}; the model may normalize "
            "its embeddings): there NormXLogit ranks tokens exactly as LogAt does.</p>")


def _failed_note(summary: Mapping[str, Any], show: int = 5) -> str:
    """The examples that failed (``summary["failed"]``: :func:`~nxl_hooks.apps.dataset.scored`'s), which no figure
    of the page counts: named on the page too, not only in summary.json and on stderr."""
    failed = summary.get("failed") or []
    if not failed:
        return ""
    named = "; ".join(f"example {f['index']}" + (f" ({f['id']})" if f.get("id") is not None else "")
                      + f": {f['error']}" for f in failed[:show])
    more = f"; and {len(failed) - show} more" if len(failed) > show else ""
    return (f'<p class="note warn">{len(failed)} example(s) failed and are in none of these figures (summary.json\'s '
            f"failed lists each with its reason): {html.escape(named + more)}</p>")


def _left_out_note(summary: Mapping[str, Any], shown: str) -> str:
    """The examples an audit's means at ``shown`` leave out, per metric and why (``summary["left_out"]``, which
    summaries of 0.3 lack): a mean over fewer examples than the page counts says so."""
    names = {"spearman": "Spearman", "kendall": "Kendall", "topk": f"top-{summary.get('top_k')} overlap",
             "drift": "drift"}
    items = "".join(
        f"<li>{names[name]}: {sum(why.values())} of {summary['n']} examples left out ("
        + html.escape("; ".join(f"{count}: {reason}" for reason, count in why.items())) + ")</li>"
        for name, why in (summary.get("left_out") or {}).items() if why)
    return f'<div class="note">the means at {html.escape(shown)} leave out:<ul>{items}</ul></div>' if items else ""


def _notes_note(summary: Mapping[str, Any], show: int = NOTES_SHOWN) -> str:
    """The records' notes (``summary["notes"]``: :func:`~nxl_hooks.apps.dataset.scored`'s), each once with how many
    examples it concerns: they change what those examples' numbers mean (a target read otherwise than written)."""
    notes = summary.get("notes") or []
    if not notes:
        return ""
    items = "".join(f"<li>{entry['examples']} example(s): {html.escape(entry['note'])}</li>" for entry in notes[:show])
    more = (f"<li>and {len(notes) - show} other notes (summary.json's notes lists each)</li>"
            if len(notes) > show else "")
    return f'<div class="note warn">notes on the examples:<ul>{items}{more}</ul></div>'


def _quantization_text(quantization: Mapping[str, Any] | None) -> str:
    """A model's quantization as the table shows it: ``bitsandbytes: load_in_4bit=True, bnb_4bit_quant_type=nf4, ...``
    (every setting its config records), or ``none``."""
    if not quantization:
        return "none"
    settings = ", ".join(f"{key}={value}" for key, value in quantization.items() if key != "quant_method")
    return f"{quantization.get('quant_method', '?')}: {settings}" if settings else str(quantization.get("quant_method"))


def _made_with_table(summary: Mapping[str, Any]) -> str:
    """What made the numbers (``summary["made_with"]``: :func:`~nxl_hooks.apps.dataset.scored`'s): one row per model
    (its role: model, reference or candidate) of each set of models and versions, with how many examples the set
    made. Several sets (a run resumed after a package changed) are each shown, and said. A summary without it (of an
    earlier build) shows nothing."""
    made_with = summary.get("made_with") or []
    if not made_with:
        return ""
    rows = []
    for entry in made_with:
        models = entry["models"]  # (records that do not say: written by an earlier build)
        for role, made in (models.items() if isinstance(models, Mapping) and models else [("–", None)]):
            # (a library caller's run_dataset may name its models otherwise than made_by does: shown as it can be)
            versions = made.get("versions") if isinstance(made, Mapping) else None
            cells = (["not recorded", "", "", ""] if not isinstance(made, Mapping) else
                     [made.get("model", "?"), str(made.get("dtype")),
                      _quantization_text(made.get("quantization") if isinstance(made.get("quantization"), Mapping)
                                         else None),
                      ", ".join(f"{name} {version}" for name, version in versions.items())
                      if isinstance(versions, Mapping) else ""])
            rows.append([html.escape(str(cell)) for cell in [entry["examples"], role, *cells]])
    several = (f'<p class="note warn">{len(made_with)} different sets made these records (a run resumed after a '
               "change): each row says how many examples its set made, and each record's made_with in records.jsonl "
               "names its own.</p>" if len(made_with) > 1 else "")
    table = _stats_table(["examples", "role", "model", "dtype", "quantization", "versions"], rows)
    return f"<h2>Made with</h2>{several}{table}"


def _named(record: Mapping[str, Any], key: str) -> str:
    """A prediction as ``'␣Paris' (7042)`` when the record has its text, else its id."""
    text = record.get(f"{key}_text")
    return f"{text!r} ({record.get(key)})" if text is not None else str(record.get(key))


def _explained(record: Mapping[str, Any]) -> str:
    """What both models explained in one example, and whose it is: ``the dataset's target '␣Madrid' (42)``."""
    named = _named(record, "target")
    if record.get("explained") == "target":
        return f"the dataset's target {named}"
    if record.get("explained") == "reference prediction":
        given = record.get("dataset_target")
        return f"the reference's prediction {named}" + (f" (the dataset's target: {given!r})" if given is not None
                                                          else "")
    return named


def _what_is_explained(summary: Mapping[str, Any]) -> str:
    """The report's one sentence on what both models explain, from the records' counts."""
    counts = summary.get("explained") or {}
    target, own = counts.get("target", 0), counts.get("reference prediction", 0)
    if target and own:
        return (f"the dataset's target in {target} examples, the reference's prediction in {own} (examples without a "
                "target)")
    if target:
        return "the dataset's target"
    return "the reference's prediction" if own else "the same token"


def _shown_layer(summary: Mapping[str, Any]) -> str:
    """The layer an audit's ``last_layer`` numbers are of, named: the last of those audited, which is the model's
    last only where ``--layers`` reached it (``--layers 0`` audits layer 0 alone). A summary.json written before
    summaries named the index means ``layers[-1]``."""
    index = summary.get("last_layer_index", summary["layers"][-1])
    if index == summary.get("model_last_layer"):
        return f"layer {index}, the model's last"
    return f"layer {index}, the last of the layers audited"


def _example_block(record: Mapping[str, Any], rank: int) -> str:
    """One audited example; every text from the data or the models (id, text, tokens, predictions) escaped. A
    regression (``agree`` None) has no prediction to compare, only its one output: "prediction None → None" said
    nothing."""
    agree = record.get("agree")
    verdict = '<span class="flip">prediction flipped</span>' if agree is False else "same prediction"
    predictions = "" if agree is None else " · " + verdict + html.escape(
        f" · reference → candidate "
        f"prediction {_named(record, 'reference_prediction')} → {_named(record, 'candidate_prediction')}")
    explained = "the one output (regression)" if agree is None else _explained(record)
    facts = html.escape(
        f"#{rank} · example {record.get('index', '?')} (id {record.get('id')!r})"
    ) + predictions + html.escape(
        f" · explained: {explained}, output "
        f"{fmt(record['reference_output'])} → {fmt(record['candidate_output'])} · layer {record['layers'][-1]}: "
        f"Spearman {fmt(record['spearman'][-1])}, Kendall {fmt(record['kendall'][-1])}, top-{record['top_k']} "
        f"{fmt(record['topk'][-1])}, drift {fmt(record['drift'][-1])}"
    )
    table = heatmap(
        ["reference", "candidate"],
        record.get("readable") or record["tokens"],
        [record["reference_scores"], record["candidate_scores"]],
        scale="all",
        corner="model \\ token",
    )
    return (
        f'<div class="example" data-index="{html.escape(str(record.get("index", "")), quote=True)}"><p>{facts}</p>'
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
    last, shown = summary["last_layer"], _shown_layer(summary)
    agreement = summary.get("agreement")
    facts = (
        f"{summary['n']} examples · prediction agreement "
        f"{'–' if agreement is None else f'{agreement:.3f}'} ({summary['flipped']} flipped) · "
        f"mean change of the explained output {fmt(summary['output_change'])} · {shown}: Spearman "
        f"{fmt(last['spearman'])}, Kendall {fmt(last['kendall'])}, top-{summary['top_k']} overlap "
        f"{fmt(last['topk'])}, drift {fmt(last['drift'])}"
    )
    body = [
        f"<h1>{html.escape(title)}</h1><p>{html.escape(facts)}</p>",
        _flat_note(summary),
        _failed_note(summary),
        _notes_note(summary),
        _left_out_note(summary, shown),
        f"<h2>The {min(show, summary['n'])} examples that changed most</h2>",
        f'<p class="note">Flipped predictions first, then the lowest Spearman at {html.escape(shown)}. Rows: '
        f"NormXLogit at that layer, both models explaining {html.escape(_what_is_explained(summary))} (nxl audit "
        "--explain); one colour scale per example.</p>",
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
    body.append(_made_with_table(summary))
    return page(title, "".join(body))
