"""``nxl demo [TEXT]``: the tiny sentiment classifier shipped in :mod:`nxl_hooks.demo` on one sentence, where its
keyword ranks per layer, and how that rank spreads over held-out sentences; offline.

    nxl demo                          # a typical held-out sentence
    nxl demo "the plot was superb"    # your own (one keyword, words of the demo vocabulary)
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from ..options import CliError, stdout_console

NAME = "demo"
#: Held-out sentences behind the summary: one padded batch through the 2-block model, well under a second.
HELD_OUT = 1000


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        NAME,
        help="offline demo on the tiny sentiment model shipped in the package",
        description="Attribute a sentence of neutral filler words with one sentiment keyword (the evidence) "
        "with the tiny Llama classifier shipped in nxl_hooks/demo, show where the keyword ranks per layer, and "
        f"how that rank spreads over {HELD_OUT} held-out sentences.",
    )
    parser.add_argument("text", metavar="TEXT", nargs="?",
                        help="your own sentence (default: a typical held-out sentence)")
    parser.add_argument("--example", type=int, metavar="N",
                        help=f"show held-out sentence N (0..{HELD_OUT - 1}) instead of a typical one")
    return parser


def evidence_ranks(res: Any, row: int, position: int) -> list[int]:
    """Per captured layer, the rank (1 = top, by signed NormXLogit) of ``position`` among the tokens of that row
    that rank (:meth:`Attribution.rankable`), for ``res.target`` of that row."""
    eligible = res.rankable(row)
    scores = res.normxlogit[:, row].masked_fill(~eligible, float("-inf"))
    own = scores[:, position : position + 1]
    return (1 + (scores > own).sum(-1)).tolist()


def split_words(text: str) -> list[str]:
    """The words of ``text`` as the shipped demo tokenizer splits it (its own pre-tokenizer, at Unicode whitespace):
    ``str.split()`` splits at more (\\x1c-\\x1f), which would name words the model never reads.
    ``split_words("the\\x1fplot good") == ["the\\x1fplot", "good"]``"""
    from tokenizers import Tokenizer

    from ...demo import MODEL_DIR

    splitter = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).pre_tokenizer
    return [word for word, _ in splitter.pre_tokenize_str(text)]


def outside_training(text: str) -> list[str]:
    """How ``text`` differs from every sentence :func:`~nxl_hooks.demo.task.make_examples` draws with its defaults
    (the shipped model's training data): one line per difference, none when it could have been drawn. Word order is
    no difference: fillers and the keyword are drawn in any order. ``outside_training("The plot was superb")`` ->
    ["words outside the demo vocabulary, read as [UNK]: The"]
    """
    from ...demo.task import MAX_WORDS, MIN_WORDS, SPECIAL_TOKENS, vocabulary
    from ...records.tokens import visible

    words = split_words(text)
    notes = []
    if not MIN_WORDS <= len(words) <= MAX_WORDS:
        plural = "s" * (len(words) != 1)
        notes.append(f"{len(words)} word{plural}; the training sentences have {MIN_WORDS} to {MAX_WORDS}")
    known = set(vocabulary()) - set(SPECIAL_TOKENS)
    unknown = sorted({word for word in words if word not in known})
    if unknown:
        shown = ", ".join(visible(word) for word in unknown)  # a control character escaped, as every output shows it
        notes.append(f"words outside the demo vocabulary, read as {SPECIAL_TOKENS[1]}: {shown}")
    return notes


def near_misses(words: Sequence[str], keywords: set[str]) -> list[str]:
    """One line per word the demo tokenizer reads as [UNK] that would be a keyword lower-cased and without the
    punctuation at its edges (its vocabulary has neither capitals nor punctuation): a sentence whose only keyword is
    written so has none the model reads. ``near_misses(["the", "Superb!"], {"superb"})`` ->
    ["'Superb!' is read as [UNK]: write 'superb'"]"""
    import re

    from ...demo.task import SPECIAL_TOKENS
    from ...records.tokens import visible

    bare = {word: re.sub(r"^\W+|\W+$", "", word).lower() for word in words if word not in keywords}
    return [f"'{visible(word)}' is read as {SPECIAL_TOKENS[1]}: write '{keyword}'"
            for word, keyword in bare.items() if keyword in keywords]


def _word_positions(enc: Any, row: int) -> list[int]:
    """The token position of each word of one encoded row, as the tokenizer split them
    (:func:`split_words`: the demo tokenizer gives one token per word, unknown words
    included)."""
    return [i for i, word in enumerate(enc.word_ids(row)) if word is not None]


def ranked_among(res: Any, text: str, positions: list[int]) -> str:
    """What the ranks of ``text``'s one row are out of: its words, or those that rank when some do not (a word
    read as [UNK], a special token, is no candidate: "L2 3/3" of a 4-word sentence must say which one is left out).
    ``positions``: each word's token position (:func:`_word_positions`)."""
    from ...records.tokens import visible

    rankable = res.rankable(0)
    left_out = [visible(word) + ("" if res.tokens[0][position] == word else f" (read as {res.tokens[0][position]})")
                for word, position in zip(split_words(text), positions) if not rankable[position]]
    if not left_out:
        return "1 = top among the words"
    return (f"1 = top among the {len(positions) - len(left_out)} words that rank; {', '.join(left_out)} "
            f"{'does' if len(left_out) == 1 else 'do'} not")


def held_out_ranks(model: Any, tokenizer: Any, examples: Sequence[Any]) -> Any:
    """int64 (len(examples), layers): the keyword's rank among its sentence's words at each layer 0..L."""
    import torch

    from ...hooks.explain import explain

    texts = [example.text for example in examples]
    res = explain(model, tokenizer, texts, layers="all")
    enc = tokenizer(texts, padding=True, return_token_type_ids=False)
    return torch.tensor([evidence_ranks(res, row, _word_positions(enc, row)[example.evidence_index])
                         for row, example in enumerate(examples)])


def spread(ranks: Any) -> list[dict[str, float]]:
    """Per layer: the share of sentences whose keyword ranks first and in the top 2, and the rank's quartiles
    (``q1``, ``median``, ``q3``; linear interpolation between ranks)."""
    import torch

    quartiles = torch.quantile(ranks.double(), torch.tensor([0.25, 0.5, 0.75], dtype=torch.double), dim=0)
    return [{"first": float((column == 1).double().mean()), "top2": float((column <= 2).double().mean()),
             "q1": float(q1), "median": float(median), "q3": float(q3)}
            for column, (q1, median, q3) in zip(ranks.T, quartiles.T)]


def typical(ranks: Any) -> int:
    """The first sentence whose keyword ranks closest to the median rank at every layer (sum of distances)."""
    medians = ranks.double().median(dim=0).values
    return int((ranks.double() - medians).abs().sum(-1).argmin())


def run(args: argparse.Namespace) -> int:
    from rich.text import Text

    from ...demo import MODEL_DIR
    from ...demo.task import HELD_OUT_SEED, MAX_WORDS, MIN_WORDS, NEGATIVE, POSITIVE, make_examples
    from ...hooks.explain import explain
    from ...records.tokens import printable
    from ..loading import load_model
    from ..terminal import show_attribution

    if args.text is not None and not args.text.strip():  # (not a held-out sentence in its place, unasked)
        raise CliError("the demo sentence is empty: give one with a sentiment keyword, or none to see a held-out one")
    keywords = set(POSITIVE) | set(NEGATIVE)
    words = split_words(args.text) if args.text else []  # as the model reads them: word i is its token i
    hits = [i for i, word in enumerate(words) if word in keywords]
    missed = near_misses(words, keywords) if not hits else []
    if missed:  # the user meant a keyword the model cannot read: name it, not the whole list
        raise CliError(f"the demo sentence has no sentiment keyword the model reads: {'; '.join(missed)}")
    if args.text and len(hits) != 1:  # the arguments are checked before the model loads
        raise CliError(
            f"the demo sentence needs exactly one sentiment keyword (found {len(hits)}), as the training "
            f"sentences that have one; keywords: {', '.join(sorted(keywords))}"
        )
    if args.text and args.example is not None:
        raise CliError("give either a sentence or --example N (a held-out sentence), not both")
    if args.example is not None and not 0 <= args.example < HELD_OUT:
        raise CliError(f"--example {args.example}: choose 0..{HELD_OUT - 1}")
    model, tokenizer = load_model(str(MODEL_DIR))
    held_out = make_examples(HELD_OUT, seed=HELD_OUT_SEED)
    ranks = held_out_ranks(model, tokenizer, held_out)
    notes: list[str] = []
    if args.text:
        text, index, keyword = args.text, hits[0], words[hits[0]]
        notes = outside_training(text)
        intro = "your sentence"
    else:
        chosen = typical(ranks) if args.example is None else args.example
        text, index, keyword = held_out[chosen].text, held_out[chosen].evidence_index, held_out[chosen].evidence
        intro = f"held-out sentence {chosen}" + ("" if args.example is not None else " (typical: its keyword's "
                                                 "ranks are the closest to the median ranks)")
    console = stdout_console()
    console.print(Text(f"{intro}: ", style="bold") + Text(printable(text)) + Text(f"   evidence: {keyword!r}"))
    for note in notes:
        console.print(Text("outside the training data: ", style="yellow") + Text(note))
    res = explain(model, tokenizer, text, layers="all")
    show_attribution(res, console)
    positions = _word_positions(tokenizer([text], return_token_type_ids=False), 0)
    mine = evidence_ranks(res, 0, positions[index])
    n_ranked = int(res.rankable(0).sum())
    console.print(
        Text(f"evidence {keyword!r} ranks per layer: ", style="bold")
        + Text("  ".join(f"L{layer} {rank}/{n_ranked}" for layer, rank in zip(res.layers, mine)))
        + Text(f"  ({ranked_among(res, text, positions)})", style="dim")
    )
    console.print(Text(f"the keyword's rank in {HELD_OUT} held-out sentences ({MIN_WORDS}-{MAX_WORDS} words, one "
                       "keyword), per layer:", style="bold"))
    for layer, row in zip(res.layers, spread(ranks)):
        console.print(f"  L{layer}  first {row['first']:6.1%}  top-2 {row['top2']:6.1%}  median rank {row['median']:g}"
                      f"  quartiles {row['q1']:g}-{row['q3']:g}")
    same = [row for row, example in enumerate(held_out) if example.evidence == keyword]
    if same:
        first = float((ranks[same, -1] == 1).double().mean())
        console.print(f"'{keyword}' alone: first at the last layer in {first:.1%} of the {len(same)} held-out "
                      "sentences that have it")
    return 0
