"""Attributions in the terminal, always fitted to the console's width.

    show_attribution(res, Console())                     # header, targets, one view per row and target
    render_table(res, Console(), row=0)                  # one view; returns which one it picked
    print_generation(model, tok, "The capital of France is", 8)   # one short line per generated token

Views, the first that fits the console's width without truncating a cell:

- ``layers``: rows = layers, columns = tokens (short texts);
- ``tokens``: rows = tokens, columns = layers (long texts, few layers);
- ``top``: one line per layer with its top tokens by signed score, as many as fit (any number of layers and tokens;
  the full numbers are in ``--out`` / ``--html``).

Tokens read as :mod:`nxl_hooks.records.tokens` shows them ('␣Paris', '↵'). Scores are signed NormXLogit values; the
top token of each layer (by :meth:`Attribution.top`'s rule) is highlighted, special tokens are dimmed.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ..arch.registry import HeadKind
from ..hooks.probe import attach
from ..method.methods.contrastive import no_foil
from ..method.placement import input_device
from ..method.chat import chat_prompt, template_rows
from ..method.scores import OVERFLOW_NOTE, flat_norms, flat_note
from ..method.select import order, special_mask
from ..records.attribution import Attribution
from ..records.html import fmt
from ..records.steps import GenerationCall, Step
from ..records.tokens import printable, readable_ids

__all__ = ["VIEWS", "format_score", "print_generation", "ranking_note", "records_lost", "render_table", "score_matrix",
           "show_attribution", "stop_reason"]

VIEWS = ("layers", "tokens", "top")
_TOP = "bold black on green"
_NEGATIVE = "red"
_SPECIAL = "dim"
_NAME = 16  # a compact line shows a token's text up to this many characters


def format_score(value: float) -> str:
    """How a score is printed: 4 significant digits."""
    return f"{value:.4g}"


def _short(name: str) -> str:
    return name if len(name) <= _NAME else name[: _NAME - 1] + "…"


def score_matrix(res: Attribution, row: int = 0, label: int = 0, *, logat: bool = False,
                 method: str = "normxlogit") -> tuple[torch.Tensor, list[int]]:
    """(len(layers), n_real) scores of one row and label by ``method`` (``logat=True``: LogAt), and the real
    (non-pad) positions they belong to."""
    scores = res.method_scores("logat" if logat else method)[:, row]
    if scores.dim() == 3:
        scores = scores[..., label]
    positions = res.mask[row].nonzero()[:, 0].tolist()
    return scores[:, positions], positions


def _cell(value: float, top: bool, special: bool) -> Text:
    style = _TOP if top else (_SPECIAL if special else (_NEGATIVE if value < 0 else ""))
    return Text(format_score(value), style=style)


def _fits(console: Console, table: Table) -> bool:
    return Measurement.get(console, console.options.update_width(1 << 20), table).maximum <= console.width


def _top_lines(scores: torch.Tensor, names: Sequence[str], positions: Sequence[int], eligible: torch.Tensor,
               layer_names: Sequence[str], width: int) -> list[Text]:
    """One line per layer: its best tokens by signed score (``position:text score``), as many as fit in ``width``
    columns (at least one)."""
    pad = max(len(name) for name in layer_names)
    lines = []
    for layer_name, layer_scores in zip(layer_names, scores):
        line = Text(layer_name.ljust(pad), style="bold")
        for rank, j in enumerate(order(layer_scores, eligible).tolist()):
            value = float(layer_scores[j])
            entry = (Text(f"  {positions[j]}:", style="dim") + Text(_short(names[j]), style=_TOP if rank == 0 else "")
                     + Text(" " + format_score(value), style=_NEGATIVE if value < 0 else ""))
            if rank and line.cell_len + entry.cell_len > width:
                break
            line += entry
        lines.append(line)
    return lines


def render_table(
    res: Attribution,
    console: Console,
    *,
    row: int = 0,
    label: int = 0,
    title: str | None = None,
    view: str | None = None,
    scores: torch.Tensor | None = None,
    all_positions: bool = False,
    method: str = "normxlogit",
) -> str:
    """Print one row's per-layer scores (``method``'s of ``label``, or ``scores``: (len(layers), n_real)) in the first
    view of :data:`VIEWS` that fits the console (or ``view``); returns the view's name. What ranks (the highlighted
    top tokens): :meth:`Attribution.rankable`, every real token with ``all_positions``; special and chat-template
    tokens are dimmed."""
    if view is not None and view not in VIEWS:
        raise ValueError(f"view={view!r}: use one of {', '.join(VIEWS)}")
    matrix, positions = score_matrix(res, row, label, method=method)
    scores = matrix if scores is None else scores
    labels = res.token_labels(row)
    names = [labels[p] for p in positions]
    dimmed = [flags[row, positions] for flags in (res.special, res.template) if flags is not None]
    special = torch.stack(dimmed).any(0).tolist() if dimmed else [False] * len(positions)
    eligible = res.rankable(row, all_positions=all_positions)[positions]
    top = [int(best[0]) if len(best := order(layer_scores, eligible)) else None for layer_scores in scores]
    layer_names = [f"L{layer}" for layer in res.layers]
    caption = "highlighted: top token per layer"
    for candidate in ([view] if view else VIEWS):
        if candidate == "top":
            if title:
                console.print(Text(title, style="bold"))
            console.print(Text(f"top tokens per layer by signed score, as position:token score ({len(names)} tokens "
                               f"x {len(layer_names)} layers do not fit a table here; --out / --html keep every "
                               "number)", style="dim"))
            for line in _top_lines(scores, names, positions, eligible, layer_names, console.width):
                console.print(line, no_wrap=True, overflow="ignore", crop=False)
            return "top"
        # a Text title: a str would be read as rich markup and emoji codes, and labels and token texts are the
        # model's and tokenizer's ('[/INST]' raised MarkupError, '[link=...]' printed a hyperlink escape)
        table = Table(title=Text(title, style="table.title") if title else None, caption=caption)
        if candidate == "layers":
            table.add_column("layer", style="bold", no_wrap=True)
            for name, dim in zip(names, special):
                table.add_column(Text(name, style=_SPECIAL if dim else "bold"), justify="right", no_wrap=True)
            for index, layer_name in enumerate(layer_names):
                table.add_row(layer_name, *[_cell(float(v), j == top[index], special[j])
                                            for j, v in enumerate(scores[index])])
        else:
            table.add_column("pos", justify="right", style="dim", no_wrap=True)
            table.add_column("token", style="bold", no_wrap=True)
            for layer_name in layer_names:
                table.add_column(layer_name, justify="right", no_wrap=True)
            for j, (position, name) in enumerate(zip(positions, names)):
                cells = [_cell(float(scores[i, j]), j == top[i], special[j]) for i in range(len(layer_names))]
                table.add_row(str(position), Text(name, style=_SPECIAL if special[j] else ""), *cells)
        if view or _fits(console, table):
            console.print(table)
            return candidate
    raise AssertionError("unreachable: the top view always fits")


def method_title(method: str) -> str:
    """How outputs name a method: ``NormXLogit``, ``LogAt``, else its registered name."""
    return {"normxlogit": "NormXLogit", "logat": "LogAt"}.get(method, method)


def show_attribution(res: Attribution, console: Console, *, all_positions: bool = False,
                     method: str = "normxlogit") -> None:
    """Print a header line, then per explained row and target one view (:func:`render_table`) with the target's
    text, id and probability; two targets add their contrast (target − foil). Notes (a word of several tokens,
    flat embedding norms, what ranks in a chat prompt) are said once, above the tables they are about.
    ``all_positions``: every real token ranks (template, system prompt, special tokens, the prediction);
    ``method``: the attribution method shown (any in ``res.scores``)."""
    res.method_scores(method)  # ValueError naming the methods it has, before anything is printed
    name = method_title(method)
    kind = res.meta.get("head_kind", "?")
    console.print(Text(f"{res.meta.get('model_class', '')}", style="bold")
                  + Text(f"  head: {kind}  blocks: {res.meta.get('n_blocks')}  "
                         f"embedding norm: {res.meta.get('embedding')}"))
    if res.overflowed():
        console.print(Text("note: " + OVERFLOW_NOTE, style="yellow"))
    spreads = [res.norm_spread(row) for row in range(res.target.shape[0])]
    flat = [s for s in spreads if flat_norms(s)]
    if flat and method == "normxlogit":
        console.print(Text("note: " + flat_note(max(flat)), style="yellow"))
    if foil := no_foil(method, res.method_scores(method)):
        console.print(Text("note: " + foil, style="yellow"))
    template = ranking_note(res, all_positions)
    if template:
        console.print(Text(template, style="dim"))
    noted: set[str] = set()
    for row in range(res.target.shape[0]):
        position = int(res.position[row])
        at = f"read at '{res.token_labels(row)[position]}' (position {position})"  # readable: escaped
        labels = res.target_info(row)
        for label in range(len(labels)):
            if kind == HeadKind.REGRESSION:
                prediction = res.meta.get("prediction")  # a file may not hold it: the title does without
                output = labels[label]["id"]  # the explained output's prediction: a head may have several
                value = f" {prediction[row][output]:.4g}" if prediction and output < len(prediction[row]) else ""
                # what LogAt is for a regression head; another method's scores are its own
                what = {"normxlogit": "norm x |HoT(h) - prediction{}|", "logat": "|HoT(h) - prediction{}|"}.get(
                    method, "prediction{}")
                title = f"{name}, regression: {what.format(value)}"
            else:
                title = f"{name} of {res.target_label(row, label)}"
            how = res.resolution(row, label)
            if how and how.get("note") and how["note"] not in noted:  # above the table: it changes what it means
                noted.add(how["note"])
                console.print(Text("warning: " + how["note"], style="bold yellow"))
            render_table(res, console, row=row, label=label, title=f"{title}, {at}", all_positions=all_positions,
                         method=method)
        if len(labels) == 2:
            first, second = res.target_label(row, 0), res.target_label(row, 1)
            contrast, _ = score_matrix(res, row, 0, method=method)
            contrast = contrast - score_matrix(res, row, 1, method=method)[0]
            render_table(res, console, row=row, scores=contrast, all_positions=all_positions,
                         title=f"Contrast: {name} of {first} minus {second}, {at}")


def ranking_note(res: Attribution, all_positions: bool = False) -> str | None:
    """One line on what ranks in a chat-templated prompt (None for other prompts): the user's text, or why every
    token does."""
    if all_positions or not res.meta.get("chat"):
        return None
    if res.template is None:
        return f"note: chat template {res.meta.get('template', 'not located: every token ranks')}"
    return ("ranked: the user's message (chat template markers and the system prompt are dimmed and left out; "
            "--all-positions ranks them too)")


def _generation_line(res: Attribution, step: Step, layer: int, top: int, width: int, all_positions: bool,
                     method: str) -> Text:
    """One generated token in one line of at most ``width`` columns: step, token, its probability, the ``top``
    context tokens at ``layer`` (fewer when they do not fit)."""
    line = Text(f"{step.step:>4} ", style="dim") + Text(_short(step.readable[0]).ljust(12), style="bold green")
    if step.probability is not None:
        line += Text(f" p {fmt(float(step.probability.reshape(-1)[0])):<7}", style="dim")
    line += Text(f" L{layer}:", style="bold")
    for rank, (position, name, score) in enumerate(res.top(top, layer=layer, all_positions=all_positions,
                                                                     method=method)):
        entry = (Text(f" {position}:", style="dim") + Text(_short(name))
                 + Text(" " + format_score(score), style=_NEGATIVE if score < 0 else ""))
        if rank and line.cell_len + entry.cell_len > width:
            break
        line += entry
    return line


def fitted(console: Console) -> Console:
    """``console``, at the terminal's width where rich read ``COLUMNS=0`` (a container's terminal of unknown size)
    as 0 columns, which prints nothing at all: as unset then, as :func:`shutil.get_terminal_size` reads it (the
    terminal's width, else 80). ``console = fitted(Console())``"""
    if console.width < 1:
        console.width = shutil.get_terminal_size().columns
    return console


def print_generation(model: Any, tokenizer: Any, text: str, new_tokens: int, *, top: int = 3, console: Any = None,
                     sink: str | Path | None = None, chat: bool = False, all_positions: bool = False,
                     method: str = "normxlogit", **options: Any) -> GenerationCall:
    """Generate greedily after ``text`` and print each token's attribution as soon as it is emitted: the view of
    ``nxl attribute MODEL TEXT --generate N``. One line per token, fitted to the console: the step, the token, the
    model's probability of it, and the ``top`` context tokens by signed NormXLogit at the last selected layer
    (all selected layers are recorded: ``sink`` / the returned call). ``options`` (``layers``, ``embedding``, ...) go
    to :func:`nxl_hooks.attach`; ``chat`` wraps ``text`` in the tokenizer's chat template, whose markers and system
    prompt then do not rank unless ``all_positions``; ``method``: the attribution method that ranks (computed beside
    NormXLogit and LogAt). The last line says why generation stopped.

    ``print_generation(model, tok, "The capital of France is", 8, layers=[-1])``
    """
    console = console or fitted(Console())
    prompt = chat_prompt(tokenizer, text) if chat else None
    enc = tokenizer(prompt.text if prompt else text, return_tensors="pt").to(input_device(model))
    ids = enc["input_ids"][0].tolist()
    template = template_rows(tokenizer, [prompt], enc["input_ids"], enc.get("attention_mask")) if prompt else None
    if prompt and not all_positions:
        console.print(Text("ranked: the user's message and the generated text (chat template markers and the system "
                           "prompt are left out; --all-positions ranks them too)" if template is not None else
                           "note: the chat template could not be located in the prompt: every token ranks",
                           style="dim"))
    names = readable_ids(tokenizer, ids)
    console.print(Text(f"prompt ({len(ids)} tokens): ", style="bold") + Text("│", style="dim").join(map(Text, names)))
    said = {"legend": False, "overflow": False}

    def show(step: Step) -> None:
        special = special_mask(torch.tensor([ids]), tokenizer)
        flags = None if template is None else torch.cat([template, template.new_zeros(1, len(ids) - template.shape[1])], 1)
        res = step.to_attribution(special=special, readable=[list(names)], template=flags)
        layer = step.layers[-1]
        if not said["legend"]:
            said["legend"] = True
            console.print(Text(f"step, token, p, top {method_title(method)} context (position:token score) at L{layer}",
                               style="dim"))
        if step.step == 0:  # the call's one number, as its HTML page says it (GenerationCall.norm_spread)
            call = probe.calls[-1]
            call.prompt_template = template  # what the terminal ranks with, the page too
            # of this first step itself: the record pipeline may not have kept it in call.steps yet
            if flat_norms(spread := call.attribution(step).norm_spread(0)):
                console.print(Text("note: " + flat_note(spread), style="yellow"))
        if not said["overflow"] and res.overflowed():  # (once: a model that overflows does so at most steps)
            said["overflow"] = True
            console.print(Text("note: " + OVERFLOW_NOTE, style="yellow"))
        console.print(_generation_line(res, step, layer, top, console.width, all_positions, method), no_wrap=True,
                      crop=False)
        ids.append(int(step.token[0]))
        names.append(step.readable[0])  # attached with the tokenizer: every step has its text

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with attach(model, tokenizer=tokenizer, on_step=show, sink=sink, methods=[method], **options) as probe:
        if probe.kind is not HeadKind.CAUSAL_LM:
            raise ValueError(f"generating needs a causal LM; {type(probe.model).__name__} is a {probe.kind} model")
        model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    call = probe.calls[-1]
    console.print(Text(stop_reason(model, tokenizer, call, new_tokens), style="dim" if call.error is None else "red"))
    if call.notes:  # its records are not whole past its error (a sink that stopped, a record lost): said last
        console.print(Text(records_lost(call, sink if probe.sink_fault is not None else None, probe.unwritten),
                           style="red"))
    return call


def records_lost(call: GenerationCall, sink: str | Path | None, unwritten: int) -> str:
    """What else went wrong with ``call``'s records (its notes), on one line; with the ``sink`` that stopped, how
    many of its step records the sink holds (``unwritten`` are in memory only): the line ``nxl attribute
    --generate N --out FILE`` ends on when it exits 1. ``records_lost(call, "run.nxl", probe.unwritten)``"""
    made, only = len(call.steps), " only" if unwritten else ""  # (all of them: its end frame is what is missing)
    what = "records lost" if sink is None else f"{sink} holds{only} {max(made - unwritten, 0)} of {made} step record(s)"
    return f"{what}: {printable('; '.join(call.notes))}"


def stop_reason(model: Any, tokenizer: Any, call: GenerationCall, new_tokens: int) -> str:
    """Why a one-row generation ended: at an end-of-sequence / end-of-turn token (which one), or after the tokens
    asked for. ``stop_reason(model, tok, probe.calls[-1], 8)``"""
    steps = call.steps
    if call.error is not None:  # the library's own reason, not a guess about the generation config
        why = printable(call.error.removeprefix("not recorded: "))  # (a host's exception may hold an escape code)
        return f"not recorded after {len(steps)} of {new_tokens} token(s): {why}"
    last = int(steps[-1].token[0]) if steps else None
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = {int(i) for i in torch.as_tensor(eos).reshape(-1).tolist()} if eos is not None else set()
    if last is not None and last in eos:
        return (f"stopped: the model emitted '{readable_ids(tokenizer, [last])[0]}' (id {last}), an end token of its "
                f"generation config (end of turn / EOS), after {len(steps)} token(s)")
    if len(steps) >= new_tokens:
        return f"stopped: {new_tokens} token(s) generated, as many as asked for (--generate {new_tokens})"
    return f"stopped after {len(steps)} of {new_tokens} token(s) (a stopping criterion of the model's generation config)"
