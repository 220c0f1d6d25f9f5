"""``nxl audit --reference MODEL (--candidate MODEL | --quantize 4bit|fp4|8bit) DATA --out DIR``: what a
candidate (a quantized copy, another checkpoint) changed in the attributions; JSON + HTML, resumable.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping

from ..options import add_dataset_options, parse_layers, positive_int

NAME = "audit"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        NAME,
        help="compare a candidate (e.g. quantized) model's attributions with a reference's on a dataset",
        description="Attribute REFERENCE and CANDIDATE on DATA and compare token by token and layer by layer: "
        "Spearman, Kendall, top-k overlap, prediction agreement, per-layer drift (JSON + HTML report).",
    )
    parser.add_argument("--reference", required=True, metavar="MODEL", help="the reference model (folder or hub id)")
    parser.add_argument("--candidate", metavar="MODEL", help="the model to compare (same tokenizer)")
    parser.add_argument("--quantize", choices=("4bit", "fp4", "8bit"),
                        help="instead of --candidate: the reference loaded with bitsandbytes (4bit = nf4)")
    add_dataset_options(parser)
    parser.add_argument("--layers", type=parse_layers, default="all", help="all (default) | last | comma list")
    parser.add_argument("--top-k", type=positive_int, default=5, help="k of the top-k overlap (default 5)")
    return parser


def quantization(mode: str) -> Any:
    """The bitsandbytes config of ``--quantize``: 4bit (nf4), fp4 or 8bit."""
    import torch
    from transformers import BitsAndBytesConfig

    if mode == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    if mode in ("4bit", "fp4"):
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="fp4" if mode == "fp4" else "nf4",
            bnb_4bit_compute_dtype=torch.float32,
        )
    raise ValueError(f"--quantize {mode!r}: use 4bit (nf4), fp4 or 8bit")


def run(args: argparse.Namespace) -> int:
    from ...eval.audit import aggregate, audit_example
    from ..dataset import examples_from_args, place, run_dataset, scored, write_outputs
    from ..loading import load_model
    from ..reports import audit_report

    if (args.candidate is None) == (args.quantize is None):
        raise ValueError(
            "give exactly one of --candidate MODEL or --quantize 4bit|8bit (the candidate built from --reference)"
        )
    examples, settings = examples_from_args(args)
    settings.update(
        command=NAME,
        reference=args.reference,
        candidate=args.candidate,
        quantize=args.quantize,
        layers=args.layers,
        top_k=args.top_k,
    )
    reference, tokenizer = load_model(args.reference, head=args.head)
    if args.candidate is not None:
        candidate, candidate_tokenizer = load_model(args.candidate, head=args.head)
        if candidate_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                "the candidate's tokenizer differs from the reference's: the audit compares token by token, "
                "so both models must share one tokenizer"
            )
    else:
        candidate, _ = load_model(args.reference, head=args.head, quantization_config=quantization(args.quantize))
    place(reference)
    place(candidate)

    def score(example: Mapping[str, Any]) -> Mapping[str, Any]:
        return audit_example(reference, candidate, tokenizer, example, layers=args.layers, top_k=args.top_k)

    records = run_dataset(examples, score, args.out, settings=settings, desc=NAME)
    if records is not None:
        records, summary = scored(records, aggregate)
        name = args.candidate or f"{args.reference} ({args.quantize})"
        write_outputs(
            args.out, records, summary, audit_report(summary, records, title=f"Audit: {name} vs {args.reference}")
        )
    return 0
