"""What ``nxl attribute`` and ``nxl demo`` do (their parsers are in :mod:`nxl_hooks.cli`)."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from rich.console import Console
from rich.text import Text

from .attribution import Attribution
from .capture import attach
from .cli import CliError
from .loading import load_model
from .terminal import render_table

_DEMO_HELD_OUT = 200  # sentences behind the demo's summary line; a batch of them takes milliseconds


def explain_text(model: Any, tokenizer: Any, text: str | list[str], **options: Any) -> Attribution:
    """Attribute one forward of ``model`` on ``text``; ``options`` go to :func:`nxl_hooks.attach`."""
    enc = tokenizer(text, return_tensors="pt", padding=True, return_token_type_ids=False).to(model.device)
    with torch.no_grad(), attach(model, tokenizer=tokenizer, **options) as probe:
        model(**enc)
    return probe.result()


def _label_name(model: Any, tokenizer: Any, kind: str, label: int) -> str:
    if kind in ("sequence_classification", "regression"):
        return str((getattr(model.config, "id2label", None) or {}).get(label, label))
    return tokenizer.convert_ids_to_tokens(label)


def _show(res: Attribution, model: Any, tokenizer: Any, console: Console) -> None:
    kind = res.meta["head_kind"]
    console.print(
        Text(f"{res.meta['model_class']}", style="bold")
        + Text(f"  head: {kind}  blocks: {res.meta['n_blocks']}  embedding norm: {res.meta['embedding']}")
    )
    special = set(tokenizer.all_special_tokens)
    for row in range(res.target.shape[0]):
        targets = res.target[row].reshape(-1).tolist()
        for label, target in enumerate(targets):
            position = int(res.position[row])
            at = res.tokens[row][position] if res.tokens else str(position)
            if kind == "regression":
                title = f"NormXLogit, regression: norm x |HoT(h) - prediction {res.meta['prediction'][row][0]:.4g}|"
            else:
                title = f"NormXLogit of {_label_name(model, tokenizer, kind, target)!r} (id {target})"
            title += f", read at {at!r} (position {position})"
            render_table(res, console, row=row, label=label, special=special, title=title)


def attribute(args: argparse.Namespace) -> int:
    """``nxl attribute MODEL TEXT``: the per-layer table, optionally saved (``--out``) or as HTML (``--html``)."""
    generate = getattr(args, "generate", None)
    if generate is not None and (args.target != "predicted" or args.html):
        raise CliError("--generate explains each emitted token: drop --target and --html (use --out for a record)")
    model, tokenizer = load_model(args.model, head=args.head)
    console = Console()
    if generate is not None:
        from .stream import print_generation

        print_generation(
            model, tokenizer, args.text, generate, layers=args.layers, embedding=args.embedding, console=console,
            sink=args.out,
        )
        return 0
    res = explain_text(model, tokenizer, args.text, layers=args.layers, target=args.target, embedding=args.embedding)
    _show(res, model, tokenizer, console)
    if args.out:
        console.print(f"saved {res.save(args.out)}")
    if args.html:
        res.to_html(args.html)
        console.print(f"wrote {args.html}")
    return 0


def evidence_ranks(res: Attribution, row: int, position: int, eligible: torch.Tensor) -> list[int]:
    """Per captured layer, the rank (1 = top, by signed NormXLogit) of ``position`` among the positions where
    ``eligible`` (bool, seq) is True, for ``res.target`` of that row."""
    scores = res.normxlogit[:, row].masked_fill(~eligible, float("-inf"))
    own = scores[:, position : position + 1]
    return (1 + (scores > own).sum(-1)).tolist()


def _words(enc: Any, row: int) -> tuple[list[int], torch.Tensor]:
    """The token position of each whitespace word of one encoded row (the demo tokenizer gives one token per
    word, unknown words included), and the same as a bool mask over the row."""
    word_ids = enc.word_ids(row)
    positions = [i for i, word in enumerate(word_ids) if word is not None]
    return positions, torch.tensor([word is not None for word in word_ids])


def demo(args: argparse.Namespace) -> int:
    """``nxl demo``: the shipped sentiment model on one sentence, and where its keyword ranks per layer."""
    from .demo import MODEL_DIR
    from .demo.task import HELD_OUT_SEED, NEGATIVE, POSITIVE, make_examples

    model, tokenizer = load_model(str(MODEL_DIR))
    keywords = set(POSITIVE) | set(NEGATIVE)
    if args.text:
        words = args.text.split()
        hits = [i for i, word in enumerate(words) if word in keywords]
        if len(hits) != 1:
            raise CliError(
                f"the demo sentence needs exactly one sentiment keyword (found {len(hits)}); keywords: "
                f"{', '.join(sorted(keywords))}"
            )
        text, index = args.text, hits[0]
        unknown = sorted({word for word in words if word not in tokenizer.get_vocab()})
        if unknown:
            print(f"note: words outside the demo vocabulary read as {tokenizer.unk_token}: {', '.join(unknown)}")
    else:
        example = make_examples(1, seed=HELD_OUT_SEED + args.seed)[0]
        text, index = example.text, example.evidence_index
    console = Console()
    console.print(Text("sentence: ", style="bold") + Text(text) + Text(f"   evidence: {text.split()[index]!r}"))
    res = explain_text(model, tokenizer, text, layers="all")
    _show(res, model, tokenizer, console)
    # Rank among the words only: [SEP] is where the classifier reads, not part of the sentence.
    positions, is_word = _words(tokenizer([text], return_token_type_ids=False), 0)
    ranks = evidence_ranks(res, 0, positions[index], is_word)
    n_words = len(positions)
    console.print(
        Text(f"evidence {text.split()[index]!r} ranks per layer: ", style="bold")
        + Text("  ".join(f"L{layer} {rank}/{n_words}" for layer, rank in zip(res.layers, ranks)))
        + Text("  (1 = top among the words)", style="dim")
    )
    held_out = make_examples(_DEMO_HELD_OUT, seed=HELD_OUT_SEED)
    batch = explain_text(model, tokenizer, [ex.text for ex in held_out], layers="last")
    enc = tokenizer([ex.text for ex in held_out], padding=True, return_token_type_ids=False)
    first = 0
    for row, ex in enumerate(held_out):
        positions, is_word = _words(enc, row)
        first += evidence_ranks(batch, row, positions[ex.evidence_index], is_word)[0] == 1
    console.print(
        f"on {len(held_out)} held-out sentences the keyword ranks first at the last layer in "
        f"{first / len(held_out):.1%} of them (examples/train_demo.py checks the same by hand)"
    )
    return 0
