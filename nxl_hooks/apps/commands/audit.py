"""``nxl audit --reference MODEL (--candidate MODEL | --quantize 4bit|fp4|8bit) DATA --out DIR``: what a
candidate (a quantized copy, another checkpoint) changed in the attributions; JSON + HTML, resumable.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping

from ...eval.audit import EXPLAIN
from ..extras import require_extra
from ..loading import QUANTIZE
from ..options import (
    add_dataset_options,
    add_loading_options,
    loading_identity,
    loading_options,
    named,
    parse_layers,
    positive_int,
)

NAME = "audit"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        NAME,
        help="compare a candidate (e.g. quantized) model's attributions with a reference's on a dataset",
        description="Attribute REFERENCE and CANDIDATE on DATA and compare token by token and layer by layer: "
        "Spearman, Kendall, top-k overlap, prediction agreement, per-layer drift (JSON + HTML report).",
    )
    parser.add_argument("--reference", required=True, metavar="MODEL", type=named,
                        help="the reference model (folder, hub id or .gguf file; --gguf-file names a file inside it)")
    parser.add_argument("--candidate", metavar="MODEL", type=named,
                        help="the model to compare (same tokenizer): a folder, hub id or .gguf file")
    parser.add_argument("--quantize", choices=QUANTIZE,
                        help="instead of --candidate: the reference loaded with bitsandbytes (4bit = nf4)")
    add_dataset_options(parser)
    add_loading_options(parser)
    parser.add_argument("--layers", type=parse_layers, default="all", help="all (default) | last | comma list")
    parser.add_argument("--top-k", type=positive_int, default=5, help="k of the top-k overlap (default 5)")
    parser.add_argument("--explain", choices=EXPLAIN, default=EXPLAIN[0],
                        help="what both models explain: target (default) = each example's target where the data "
                        "has one, else the reference's prediction; reference = the reference's prediction always")
    return parser


def run(args: argparse.Namespace) -> int:
    from ...eval.audit import aggregate, audit_example, check_auditable, check_same_head, check_same_tokens
    from ...hooks.plan import made_by
    from ...records.attribution import layers_text
    from ...records.tokens import chat_text
    from ..dataset import check_out, examples_from_args, place, run_dataset, scored, write_outputs
    from ..loading import Loading, check_explainable, load_model, model_files, tp_outputs
    from ..reports import audit_report

    if (args.candidate is None) == (args.quantize is None):
        raise ValueError(f"give exactly one of --candidate MODEL or --quantize {'|'.join(QUANTIZE)} (the candidate "
                         "built from --reference)")
    require_extra("eval", ["scipy"], "its rank correlations")  # before the models load
    loading = loading_options(args)
    if args.quantize is not None and loading["quantize"] is not None:
        raise ValueError("--quantize builds the candidate from an unquantized reference: drop --load-in-8bit / "
                         "--load-in-4bit (or compare two saved models with --candidate)")
    if args.quantize is not None:  # the candidate's options (--tp excludes bitsandbytes): now, not once the reference
        Loading(**{**loading, "quantize": args.quantize})  # has loaded on every rank
    check_out(args, args.reference, args.candidate)
    tp_outputs(args, "out")  # --tp (registry): rank 0 alone prints and writes, each rank checked it first
    examples, settings = examples_from_args(args)
    settings.update(
        command=NAME,
        reference=args.reference,
        candidate=args.candidate,
        # their content: replaced weights are another model (the candidate never reads --gguf-file)
        reference_files=model_files(args.reference, args.gguf_file),
        candidate_files=None if args.candidate is None else model_files(args.candidate),
        quantize=args.quantize,
        layers=args.layers,
        top_k=args.top_k,
        explain=args.explain,
        loading={**loading_identity(loading), "chat": args.chat},
    )
    reference, tokenizer = load_model(args.reference, **loading)
    try:  # once, before the candidate loads: every example would fail alike
        check_auditable(reference)
    except ValueError as err:
        raise ValueError(f"--reference {args.reference}: {err}") from None
    if args.chat:  # each text becomes the user's message; evidence words are looked for in the whole prompt
        examples = [{**example, "text": chat_text(tokenizer, example["text"])} for example in examples]
    if args.candidate is not None:
        candidate, candidate_tokenizer = load_model(args.candidate, **{**loading, "gguf_file": None})
        # on the texts as scored (a chat template's too): a candidate reading them otherwise is refused
        check_same_tokens(tokenizer, candidate_tokenizer, [example["text"] for example in examples])
        check_same_head(reference, candidate)
    elif getattr(reference, "is_quantized", False):  # transformers would load the candidate as it: the same model
        raise ValueError(f"--reference {args.reference} is saved quantized, so --quantize would build the candidate "
                         "as the reference itself: give the unquantized model, or compare two saved models with "
                         "--candidate")
    else:
        candidate, _ = load_model(args.reference, **{**loading, "quantize": args.quantize})
    name = args.candidate or f"{args.reference} ({args.quantize})"
    ours, our_blocks = check_explainable(reference, tokenizer, args.layers)
    try:  # once here, not in each example: a candidate of another depth or architecture fails every one of them
        theirs, their_blocks = check_explainable(candidate, tokenizer, args.layers)
    except (ValueError, LookupError) as err:
        raise ValueError(f"the candidate {name}: {err}") from None
    if theirs != ours:
        raise ValueError(f"the candidate {name} has {their_blocks} blocks but the reference {our_blocks}, so "
                         f"--layers reads layers {layers_text(ours)} of the reference and "
                         f"{layers_text(theirs)} of the candidate; an audit compares each layer of the "
                         "reference with the same layer of the candidate: give a candidate of the reference's depth "
                         "(a quantized or fine-tuned copy)")
    place(reference)
    place(candidate)

    def score(example: Mapping[str, Any]) -> Mapping[str, Any]:  # a text too long: this example's failure
        return audit_example(reference, candidate, tokenizer, example, layers=args.layers, top_k=args.top_k,
                             explain=args.explain)

    made_with = {"reference": made_by(reference), "candidate": made_by(candidate)}  # what makes the records
    records = run_dataset(examples, score, args.out, settings=settings, desc=NAME, tp=args.tp, made_with=made_with)
    if records is not None:
        records, summary = scored(records, aggregate)
        write_outputs(
            args.out, records, summary, audit_report(summary, records, title=f"Audit: {name} vs {args.reference}"),
            command=f"nxl {NAME}",
        )
    return 0
