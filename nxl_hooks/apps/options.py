"""What the ``nxl`` subcommands share: the error type that prints as one line, argument parsers, and the option
groups several commands take.

    parser.add_argument("--layers", type=parse_layers, default="all")
    add_attribution_options(parser); add_dataset_options(parser)
"""

from __future__ import annotations

import argparse

__all__ = [
    "HEADS",
    "CliError",
    "add_attribution_options",
    "add_dataset_options",
    "parse_layers",
    "parse_target",
    "positive_int",
]

HEADS = ("causal_lm", "sequence_classification", "masked_lm")  # --head: when config.architectures does not say


class CliError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


def parse_layers(value: str) -> str | list[int]:
    """``all`` | ``last`` | a comma list of ints (negative from the end): ``"0,2,-1"`` -> ``[0, 2, -1]``."""
    if value in ("all", "last"):
        return value
    try:
        return [int(part) for part in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: use 'all', 'last' or a comma list of ints like 0,2,-1") from None


def positive_int(value: str) -> int:
    """An int of at least 1 (``--top-k``, ``--limit``, ``--ig-steps``, ``--generate``)."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: give a whole number of at least 1")
    return number


def parse_target(value: str) -> str | int | list[str | int]:
    """``predicted`` | an int id | a token / label string | a comma list of those (one table per target)."""
    parts = value.split(",") if len(value) > 1 else [value]
    if len(parts) > 1:  # spaces after commas are separators; a single target keeps them (" Paris" is its own token)
        parts = [part.strip() for part in parts]
    items: list[str | int] = []
    for part in parts:
        if not part:
            raise argparse.ArgumentTypeError(f"{value!r}: empty item in the target list")
        items.append(int(part) if part.lstrip("-").isdigit() else part)
    if "predicted" in items and len(items) > 1:
        raise argparse.ArgumentTypeError("'predicted' cannot be mixed with other targets; pass it alone")
    return items[0] if len(items) == 1 else items


def add_attribution_options(parser: argparse.ArgumentParser) -> None:
    """What every command that attaches takes: --layers, --target, --embedding."""
    parser.add_argument(
        "--layers", type=parse_layers, default="all", help="all (default) | last | comma list like 0,2,-1"
    )
    parser.add_argument(
        "--target",
        type=parse_target,
        default="predicted",
        help="predicted (default) | an id | a token or label string | comma list (one table each)",
    )
    parser.add_argument(
        "--embedding",
        choices=("layer_input", "word"),
        default="layer_input",
        help="embedding norm: input of block 1 (default) or the raw word-embedding row",
    )


def add_dataset_options(parser: argparse.ArgumentParser) -> None:
    """What every dataset command shares: the data file, its columns, the output folder (resumable)."""
    parser.add_argument("data", metavar="DATA",
                        help=".jsonl or .csv with text, label, evidence; or a hub dataset hf:NAME[:CONFIG]:SPLIT")
    parser.add_argument("--out", metavar="DIR", required=True,
                        help="output folder: summary.json, records.jsonl, report.html; rerun with the same DIR to resume")
    parser.add_argument("--text-field", default="text", help="column with the text (default: text)")
    parser.add_argument("--label-field", default="label", help="column with the gold label (default: label)")
    parser.add_argument("--evidence-field", default="evidence", help="column with evidence words (default: evidence)")
    parser.add_argument("--limit", type=positive_int, help="only the first N examples")
    parser.add_argument("--head", choices=HEADS,
                        help="which head to load when config.architectures does not say")


