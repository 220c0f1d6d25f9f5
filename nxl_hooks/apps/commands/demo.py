"""``nxl demo [TEXT]``: the tiny sentiment classifier shipped in :mod:`nxl_hooks.demo` on one sentence, and
where its keyword ranks per layer; offline.

    nxl demo "the plot was superb"
"""

from __future__ import annotations

import argparse
from typing import Any

from ..options import CliError

NAME = "demo"
_HELD_OUT = 200  # sentences behind the demo's summary line; a batch of them takes milliseconds


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        NAME,
        help="offline demo on the tiny sentiment model shipped in the package",
        description="Attribute a sentence of neutral filler words with one sentiment keyword (the evidence) "
        "with the tiny Llama classifier shipped in nxl_hooks/demo, and show where the keyword ranks per layer.",
    )
    parser.add_argument("text", metavar="TEXT", nargs="?", help="your own sentence (default: a held-out example)")
    parser.add_argument("--seed", type=int, default=0, help="which held-out example to show (default 0)")
    return parser


def evidence_ranks(res: Any, row: int, position: int) -> list[int]:
    """Per captured layer, the rank (1 = top, by signed NormXLogit) of ``position`` among the tokens of that row
    that rank (:meth:`Attribution.rankable`), for ``res.target`` of that row."""
    eligible = res.rankable(row)
    scores = res.normxlogit[:, row].masked_fill(~eligible, float("-inf"))
    own = scores[:, position : position + 1]
    return (1 + (scores > own).sum(-1)).tolist()


def _word_positions(enc: Any, row: int) -> list[int]:
    """The token position of each whitespace word of one encoded row (the demo tokenizer gives one token per
    word, unknown words included)."""
    return [i for i, word in enumerate(enc.word_ids(row)) if word is not None]


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.text import Text

    from ...demo import MODEL_DIR
    from ...demo.task import HELD_OUT_SEED, NEGATIVE, POSITIVE, make_examples
    from ...hooks.probe import explain
    from ..loading import load_model
    from ..terminal import show_attribution

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
    res = explain(model, tokenizer, text, layers="all")
    show_attribution(res, console)
    positions = _word_positions(tokenizer([text], return_token_type_ids=False), 0)
    ranks = evidence_ranks(res, 0, positions[index])
    n_ranked = int(res.rankable(0).sum())
    console.print(
        Text(f"evidence {text.split()[index]!r} ranks per layer: ", style="bold")
        + Text("  ".join(f"L{layer} {rank}/{n_ranked}" for layer, rank in zip(res.layers, ranks)))
        + Text("  (1 = top among the words)", style="dim")
    )
    held_out = make_examples(_HELD_OUT, seed=HELD_OUT_SEED)
    batch = explain(model, tokenizer, [ex.text for ex in held_out], layers="last")
    enc = tokenizer([ex.text for ex in held_out], padding=True, return_token_type_ids=False)
    first = sum(evidence_ranks(batch, row, _word_positions(enc, row)[ex.evidence_index])[0] == 1
                for row, ex in enumerate(held_out))
    console.print(
        f"on {len(held_out)} held-out sentences the keyword ranks first at the last layer in "
        f"{first / len(held_out):.1%} of them (examples/train_demo.py checks the same by hand)"
    )
    return 0
