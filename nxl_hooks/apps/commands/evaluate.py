"""``nxl evaluate MODEL DATA --out DIR``: faithfulness of NormXLogit and the baselines on a dataset; JSON + HTML.
Resumable, and sharded under ``accelerate launch --num_processes N -m nxl_hooks evaluate ...``.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping

from ..extras import require_extra
from ..options import (
    CliError,
    add_dataset_options,
    add_loading_options,
    loading_identity,
    loading_options,
    named,
    positive_int,
    say,
)

NAME = "evaluate"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        NAME,
        help="faithfulness of NormXLogit and baselines on a dataset (JSON + HTML report)",
        description="AOPC comprehensiveness / sufficiency and per-layer evidence alignment of every method "
        "(but integrated_gradients unless --methods names it) on DATA. Runs unchanged under `accelerate launch --num_processes N -m nxl_hooks evaluate ...`.",
    )
    parser.add_argument("model", metavar="MODEL", type=named, help="a local model folder, a hub id or a .gguf file")
    add_dataset_options(parser)
    add_loading_options(parser)
    parser.add_argument("--methods", default="default",
                        help="comma list of methods; default: every one but integrated_gradients (the slowest by far); "
                        "all: every one")
    parser.add_argument("--layer", type=int, default=-1, help="layer whose scores rank tokens for AOPC (default -1)")
    parser.add_argument("--perturbation", choices=("auto", "mask", "delete"), default="auto",
                        help="auto: mask token for encoders, deletion for decoders (default)")
    parser.add_argument("--ig-steps", type=positive_int, default=50, help="Integrated Gradients steps (default 50)")
    parser.add_argument("--gradient-aggregation", choices=("l1", "l2", "sum"), default="l1",
                        help="how gradient baselines reduce a token's vector: l1 (the paper's, default), l2, sum")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random baseline (default 0)")
    return parser


def run(args: argparse.Namespace) -> int:
    from ...arch.registry import HeadKind, head_kind
    from ...eval import faithfulness as ev
    from ...hooks.plan import made_by
    from ...method.subject import unwrap
    from ...records.tokens import chat_text
    from ..dataset import check_out, examples_from_args, place, run_dataset, scored, write_outputs
    from ..loading import check_explainable, load_model, model_files, tp_outputs
    from ..reports import evaluate_report, evaluate_summary

    everything = ev.available_methods()  # the built-in ones and every registered attribution method
    named = {"all": everything, "default": ev.DEFAULT_METHODS}
    methods = list(named.get(args.methods) or [m.strip() for m in args.methods.split(",") if m.strip()])
    unknown = sorted(set(methods) - set(everything))
    if unknown or not methods:
        what = f"names unknown {unknown}" if unknown else "names no method"
        raise CliError(f"--methods {args.methods!r} {what}; choose from {', '.join(everything)} (or 'all', "
                       "'default')")
    gradient = [m for m in methods if m in ev.GRADIENT_METHODS]
    if gradient:  # before the model loads: each example would fail on its own, one by one
        listed = ",".join(gradient)
        require_extra("eval", ["captum"], f"--methods {listed}" if args.methods not in named else
                      f"the {args.methods} --methods include {listed} (or name --methods without them)")
    check_out(args, args.model)
    tp_outputs(args, "out")  # --tp (registry): rank 0 alone prints and writes, each rank checked it first
    examples, settings = examples_from_args(args)
    loading = loading_options(args)
    settings.update(
        command=NAME,
        model=args.model,
        model_files=model_files(args.model, args.gguf_file),  # its content: replaced weights are another model
        loading={**loading_identity(loading), "chat": args.chat},
        methods=methods,
        layer=args.layer,
        seed=args.seed,
        perturbation=args.perturbation,
        ig_steps=args.ig_steps,
        gradient_aggregation=args.gradient_aggregation,
    )
    model, tokenizer = load_model(args.model, **loading)
    check_explainable(model, tokenizer, [args.layer])
    foiled = ev.foil_methods(methods)
    if foiled and head_kind(unwrap(model)) is HeadKind.REGRESSION:  # else dropped from every record, or all fail
        if args.methods not in named:  # the user's own list: refused; 'default' and 'all' leave them out, said once
            raise CliError(f"--methods names {', '.join(foiled)}, which contrasts the target with a foil, but "
                           f"{args.model} has a regression head (one output, no foil): drop it from --methods")
        methods = settings["methods"] = [method for method in methods if method not in foiled]
        say(f"nxl {NAME}: {', '.join(foiled)} left out of --methods {args.methods}: {args.model} has a regression "
            "head (one output, no foil to contrast with)")
    place(model)
    if args.chat:  # each text becomes the user's message; evidence words are looked for in the whole prompt
        examples = [{**example, "text": chat_text(tokenizer, example["text"])} for example in examples]

    def score(example: Mapping[str, Any]) -> Mapping[str, Any]:  # a text too long fails, recorded; the run goes on
        return ev.score_example(model, tokenizer, example, methods, layer=args.layer, seed=args.seed,
                                perturbation=args.perturbation, ig_steps=args.ig_steps,
                                aggregation=args.gradient_aggregation)

    records = run_dataset(examples, score, args.out, settings=settings, desc=NAME, tp=args.tp,
                          made_with={"model": made_by(model)})
    if records is not None:
        records, summary = scored(records, ev.aggregate)
        write_outputs(args.out, records, summary, evaluate_report(summary, title=f"Faithfulness of {args.model}"),
                      command=f"nxl {NAME}")
        print(evaluate_summary(summary))
    return 0
