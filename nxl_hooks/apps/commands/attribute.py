"""``nxl attribute MODEL TEXT``: per-layer NormXLogit of one text in the terminal, optionally saved or as HTML;
``--generate N`` explains each generated token as it appears.

    nxl attribute ./my-model "The movie was great" --layers all --out a.safetensors --html a.html
    nxl attribute ./smollm2.gguf "The capital of France is" --target "Paris,London"
    nxl attribute ./my-instruct "What is the capital of France?" --chat --generate 8 --html gen.html
    nxl attribute ./my-model "The movie was great" --method contrastive   # any registered attribution method
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..options import (
    READER_GONE,
    CliError,
    add_attribution_options,
    add_method_option,
    add_loading_options,
    check_apart,
    check_output_file,
    loading_options,
    named,
    positive_int,
    stdout_console,
)
from ..serve.settings import attach_options

NAME = "attribute"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        NAME,
        help="per-layer NormXLogit of one text, as a table in the terminal",
        description="Explain MODEL's prediction on TEXT: one NormXLogit score per layer and token.",
    )
    parser.add_argument("model", metavar="MODEL", type=named,
                        help="a local model folder, a hub id (as from_pretrained takes) or a .gguf file")
    parser.add_argument("text", metavar="TEXT", help="the input text (masked LMs: include the tokenizer's mask token)")
    parser.add_argument("--text-pair", metavar="TEXT2",
                        help="classifiers: a second text, encoded with TEXT as a sentence pair (NLI's hypothesis)")
    add_attribution_options(parser)
    add_method_option(parser)
    add_loading_options(parser)
    parser.add_argument("--out", metavar="FILE", help="also save the attribution (safetensors; nxl.Attribution.load)")
    parser.add_argument("--html", metavar="FILE",
                        help="also write a heatmap page (self-contained HTML): tokens x layers, or with --generate "
                        "generated tokens x context with a layer selector")
    parser.add_argument(
        "--generate", type=positive_int, metavar="N", default=None,
        help="causal LMs: generate N tokens greedily and print one line per token as it appears "
        "(with --out, the records go to that file as a stream: nxl.read_stream)",
    )
    parser.add_argument("--all-positions", action="store_true",
                        help="rank every token: with --chat also the chat template's markers and the system prompt "
                        "(by default only the user's message and the generated text rank), special tokens and the "
                        "prediction position")
    return parser


def run(args: argparse.Namespace) -> int:
    from rich.text import Text

    from ...arch.registry import HeadKind, head_kind
    from ...hooks.explain import explain
    from ...method.select import check_length, position_limit
    from ...method.subject import unwrap
    from ...records.files import write_text
    from ...records.html import generation_html
    from ...records.tokens import chat_text
    from ..loading import load_model, tp_outputs
    from ..terminal import print_generation, show_attribution

    generate = args.generate
    if generate is not None and args.target != "predicted":
        raise CliError("--generate explains each emitted token: drop --target")
    args.out = check_output_file(args.out, "--out")  # before the model loads, and before the sink opens (it truncates)
    args.html = check_output_file(args.html, "--html")
    if args.out and args.html and Path(args.out).resolve() == Path(args.html).resolve():
        raise CliError(f"--out and --html both name {args.out}: the page would replace the scores; give two paths")
    check_apart("--out", args.out, [args.model])
    check_apart("--html", args.html, [args.model])
    if not args.text.strip():  # before the model loads: it would explain its special tokens alone
        raise CliError("TEXT is empty: give the text to explain")
    if args.text_pair is not None and not args.text_pair.strip():  # (as an empty TEXT)
        raise CliError("TEXT2 is empty: give the second text of the pair, or leave --text-pair out")
    if args.text_pair is not None and (generate is not None or args.chat):
        raise CliError(f"--text-pair with {'--generate' if generate else '--chat'}: a sentence pair is a classifier's "
                       "input, as it is, never generated from nor put in a chat template; drop one of them")
    tp_outputs(args, "out", "html")  # --tp (registry): rank 0 alone prints and writes, each rank checked them first
    model, tokenizer = load_model(args.model, **loading_options(args))
    text = chat_text(tokenizer, args.text) if args.chat else args.text
    check_length(tokenizer, text, position_limit(model), more=generate or 0, pair=args.text_pair,
                 what="TEXT with TEXT2" if args.text_pair is not None else "TEXT")
    kind = head_kind(unwrap(model))
    if args.text_pair is not None and not kind.pooled:
        raise CliError(f"--text-pair is a classifier's second text, and {args.model} is a "
                       f"{kind.value.replace('_', ' ')} model, which reads one text: join the two into TEXT")
    if generate is not None and kind is not HeadKind.CAUSAL_LM:
        raise CliError(f"--generate needs a causal LM, and {args.model} is a {kind.value.replace('_', ' ')} model "
                       "(it generates nothing): drop --generate to explain its prediction for TEXT")
    if kind is HeadKind.MASKED_LM:  # (before the forward, which the hook and explain would
        mask = getattr(tokenizer, "mask_token_id", None)  # each leave unrecorded with a line of their own)
        if mask is None:
            raise CliError(f"{args.model}'s tokenizer has no mask token: a masked LM explains what it predicts at its "
                           "mask token; save the model with the tokenizer it was trained with")
        if mask not in tokenizer(text)["input_ids"]:
            raise CliError(f"TEXT has no {tokenizer.mask_token} token: a masked LM explains what it predicts at its "
                           f"mask token; put {tokenizer.mask_token} where the word to explain goes")
    console = stdout_console(finish=bool(args.out or args.html))
    if generate is not None:
        sink = Path(args.out) if args.out else None  # --out is a file path, whatever its name: never a sink kind
        call = print_generation(model, tokenizer, args.text, generate, console=console, sink=sink, chat=args.chat,
                                all_positions=args.all_positions, method=args.method, **attach_options(args))
        if sink is not None and call.error is None and not call.notes:  # as the attribution's "saved" line; what
            # the file is, whatever its name (--out a.safetensors): Attribution.load does not read it
            console.print(Text(f"saved {sink} (a stream of step records: nxl.read_stream, nxl export)"))
        if args.html:
            write_text(args.html, generation_html(call, title=f"{args.model}: {args.text}", method=args.method,
                                                       all_positions=args.all_positions))
            console.print(Text(f"wrote {args.html}"))  # Text: a path is not rich markup ('x[/b].html')
        # 1: the records are not whole (not recorded, or --out holds only some: a full disk); the last line said why
        return 1 if call.error is not None or call.notes else READER_GONE if console.gone else 0
    res = explain(model, tokenizer, args.text, text_pair=args.text_pair, chat=args.chat, methods=[args.method],
                  **attach_options(args))
    for note in _id_notes(unwrap(model), kind, tokenizer, args.target):  # above the tables: it changes their meaning
        console.print(Text("note: " + note, style="yellow"))
    show_attribution(res, console, all_positions=args.all_positions, method=args.method)
    if args.out:
        console.print(Text(f"saved {res.save(args.out)}"))
    if args.html:
        res.to_html(args.html, method=args.method, all_positions=args.all_positions)
        console.print(Text(f"wrote {args.html}"))
    return READER_GONE if console.gone else 0


def _id_notes(model: Any, kind: Any, tokenizer: Any, target: Any) -> list[str]:
    """One line for each --target item of digits alone (read as an id) that is also the name of another output's
    label ("1" where ``config.id2label`` is ``{0: "1", 1: "2"}``): which reading was taken and how to give the other.
    The command line's alone: a digit string is text people typed, while a Python int is an id by choice."""
    from ...method.select import resolve_target
    from ...records.tokens import label_text

    if not kind.pooled:
        return []
    notes = []
    for item in target if isinstance(target, list) else [target]:
        if not isinstance(item, int):
            continue
        try:
            named = resolve_target(model, kind, tokenizer, str(item))
        except ValueError:  # a name of several outputs (refused as a name): no single other reading to point to
            continue
        if named.how == "label" and named.id != item:
            id2label = getattr(model.config, "id2label", None)
            notes.append(f"--target {item} is read as id {item} ({label_text(tokenizer, id2label, kind, item)!r}), "
                         f"not as the label named {named.request!r} (id {named.id}): to mean that label, give "
                         f"' {item}' (the name with a space before it: an item of digits alone is an id)")
    return notes
