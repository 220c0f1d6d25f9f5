"""The ``nxl`` command line: ``nxl attribute MODEL TEXT``, ``nxl demo``.

A subcommand is a parser entry in :data:`_COMMANDS` plus one ``run(args) -> int`` function, named as
``"module:function"`` and imported only when that subcommand runs, so ``nxl --help`` stays fast and an
optional extra is needed only by the subcommand that uses it. Bad input raises :class:`CliError` (or a
``ValueError``/``LookupError``/``OSError`` from the library or transformers): :func:`main` prints one line
and returns exit code 2; ``--traceback`` shows the full trace instead.

    nxl attribute ./my-model "The movie was great" --layers all --target predicted --out a.safetensors
    nxl demo
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Sequence

__all__ = ["CliError", "build_parser", "main", "parse_layers", "parse_target", "positive_int"]

_HEADS = ("causal_lm", "sequence_classification", "masked_lm")  # --head: when config.architectures does not say


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


def _add_attribute(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "attribute",
        help="per-layer NormXLogit of one text, as a table in the terminal",
        description="Explain MODEL's prediction on TEXT: one NormXLogit score per layer and token.",
    )
    parser.add_argument("model", metavar="MODEL", help="a local model folder or a hub id (as from_pretrained takes)")
    parser.add_argument("text", metavar="TEXT", help="the input text (masked LMs: include the tokenizer's mask token)")
    _add_attribution_options(parser)
    parser.add_argument(
        "--head",
        choices=_HEADS,
        help="which head to load when config.architectures does not say (default: from the config)",
    )
    parser.add_argument("--out", metavar="FILE", help="also save the attribution (safetensors; nxl.Attribution.load)")
    parser.add_argument("--html", metavar="FILE", help="also write a tokens x layers heatmap page (self-contained HTML)")
    parser.add_argument(
        "--generate", type=positive_int, metavar="N", default=None,
        help="causal LMs: generate N tokens greedily and print each one's attribution as it appears "
        "(with --out, the records go to that file as a stream: nxl.read_stream)",
    )
    return parser


def _add_attribution_options(parser: argparse.ArgumentParser) -> None:
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


def _add_demo(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "demo",
        help="offline demo on the tiny sentiment model shipped in the package",
        description="Attribute a sentence of neutral filler words with one sentiment keyword (the evidence) "
        "with the tiny Llama classifier shipped in nxl_hooks/demo, and show where the keyword ranks per layer.",
    )
    parser.add_argument("text", metavar="TEXT", nargs="?", help="your own sentence (default: a held-out example)")
    parser.add_argument("--seed", type=int, default=0, help="which held-out example to show (default 0)")
    return parser


def _add_dataset_options(parser: argparse.ArgumentParser) -> None:
    """What every dataset command shares: the data file, its columns, the output folder (resumable)."""
    parser.add_argument("data", metavar="DATA",
                        help=".jsonl or .csv with text, label, evidence; or a hub dataset hf:NAME[:CONFIG]:SPLIT")
    parser.add_argument("--out", metavar="DIR", required=True,
                        help="output folder: summary.json, records.jsonl, report.html; rerun with the same DIR to resume")
    parser.add_argument("--text-field", default="text", help="column with the text (default: text)")
    parser.add_argument("--label-field", default="label", help="column with the gold label (default: label)")
    parser.add_argument("--evidence-field", default="evidence", help="column with evidence words (default: evidence)")
    parser.add_argument("--limit", type=positive_int, help="only the first N examples")
    parser.add_argument("--head", choices=_HEADS,
                        help="which head to load when config.architectures does not say")


def _add_evaluate(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "evaluate",
        help="faithfulness of NormXLogit and baselines on a dataset (JSON + HTML report)",
        description="AOPC comprehensiveness / sufficiency and per-layer evidence alignment of every method on "
        "DATA. Runs unchanged under `accelerate launch --num_processes N -m nxl_hooks.cli evaluate ...`.",
    )
    parser.add_argument("model", metavar="MODEL", help="a local model folder or a hub id")
    _add_dataset_options(parser)
    parser.add_argument("--methods", default="all", help="comma list of methods, or all (default)")
    parser.add_argument("--layer", type=int, default=-1, help="layer whose scores rank tokens for AOPC (default -1)")
    parser.add_argument("--perturbation", choices=("auto", "mask", "delete"), default="auto",
                        help="auto: mask token for encoders, deletion for decoders (default)")
    parser.add_argument("--ig-steps", type=positive_int, default=50, help="Integrated Gradients steps (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random baseline (default 0)")
    return parser


def _add_audit(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "audit",
        help="compare a candidate (e.g. quantized) model's attributions with a reference's on a dataset",
        description="Attribute REFERENCE and CANDIDATE on DATA and compare token by token and layer by layer: "
        "Spearman, Kendall, top-k overlap, prediction agreement, per-layer drift (JSON + HTML report).",
    )
    parser.add_argument("--reference", required=True, metavar="MODEL", help="the reference model (folder or hub id)")
    parser.add_argument("--candidate", metavar="MODEL", help="the model to compare (same tokenizer)")
    parser.add_argument("--quantize", choices=("4bit", "fp4", "8bit"),
                        help="instead of --candidate: the reference loaded with bitsandbytes (4bit = nf4)")
    _add_dataset_options(parser)
    parser.add_argument("--layers", type=parse_layers, default="all", help="all (default) | last | comma list")
    parser.add_argument("--top-k", type=positive_int, default=5, help="k of the top-k overlap (default 5)")
    return parser


#: name -> (parser entry, "module:function" run when the subcommand is chosen).
_COMMANDS: dict[str, tuple[Callable[[argparse._SubParsersAction], argparse.ArgumentParser], str]] = {
    "attribute": (_add_attribute, "nxl_hooks._cli_commands:attribute"),
    "demo": (_add_demo, "nxl_hooks._cli_commands:demo"),
    "evaluate": (_add_evaluate, "nxl_hooks.dataset:evaluate_command"),
    "audit": (_add_audit, "nxl_hooks.audit:audit_command"),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``nxl`` argument parser, one subparser per entry of :data:`_COMMANDS`."""
    parser = argparse.ArgumentParser(prog="nxl", description="Per-layer NormXLogit token attribution.")
    parser.add_argument("--traceback", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (add_parser, target) in _COMMANDS.items():
        add_parser(sub).set_defaults(_run=target)
    return parser


def _load(target: str) -> Callable[[argparse.Namespace], int]:
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nxl`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed usage and the error
        return int(exit_.code or 0)
    try:
        return int(_load(args._run)(args) or 0)
    except (CliError, ValueError, LookupError, OSError) as err:
        if args.traceback:
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"nxl {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # ``python -m nxl_hooks.cli`` runs this file as __main__, a second copy of the module: run the package's
    # copy, whose CliError is the one the subcommands raise.
    from nxl_hooks.cli import main as _package_main

    sys.exit(_package_main())
