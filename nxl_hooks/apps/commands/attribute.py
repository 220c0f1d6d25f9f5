"""``nxl attribute MODEL TEXT``: per-layer NormXLogit of one text in the terminal, optionally saved or as HTML;
``--generate N`` explains each generated token as it appears.

    nxl attribute ./my-model "The movie was great" --layers all --out a.safetensors --html a.html
"""

from __future__ import annotations

import argparse
from typing import Any

from ..options import HEADS, CliError, add_attribution_options, positive_int

NAME = "attribute"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        NAME,
        help="per-layer NormXLogit of one text, as a table in the terminal",
        description="Explain MODEL's prediction on TEXT: one NormXLogit score per layer and token.",
    )
    parser.add_argument("model", metavar="MODEL", help="a local model folder or a hub id (as from_pretrained takes)")
    parser.add_argument("text", metavar="TEXT", help="the input text (masked LMs: include the tokenizer's mask token)")
    add_attribution_options(parser)
    parser.add_argument(
        "--head",
        choices=HEADS,
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


def show(res: Any, model: Any, tokenizer: Any, console: Any) -> None:
    """Print a header line and one table per explained row and target."""
    from rich.text import Text

    from ..terminal import label_name, render_table

    kind = res.meta["head_kind"]
    console.print(
        Text(f"{res.meta['model_class']}", style="bold")
        + Text(f"  head: {kind}  blocks: {res.meta['n_blocks']}  embedding norm: {res.meta['embedding']}")
    )
    for row in range(res.target.shape[0]):
        targets = res.target[row].reshape(-1).tolist()
        for label, target in enumerate(targets):
            position = int(res.position[row])
            at = res.tokens[row][position] if res.tokens else str(position)
            if kind == "regression":
                title = f"NormXLogit, regression: norm x |HoT(h) - prediction {res.meta['prediction'][row][0]:.4g}|"
            else:
                title = f"NormXLogit of {label_name(model, tokenizer, kind, target)!r} (id {target})"
            title += f", read at {at!r} (position {position})"
            render_table(res, console, row=row, label=label, title=title)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ...hooks.probe import explain
    from ..loading import load_model
    from ..terminal import print_generation

    generate = args.generate
    if generate is not None and (args.target != "predicted" or args.html):
        raise CliError("--generate explains each emitted token: drop --target and --html (use --out for a record)")
    model, tokenizer = load_model(args.model, head=args.head)
    console = Console()
    if generate is not None:
        print_generation(model, tokenizer, args.text, generate, layers=args.layers, embedding=args.embedding,
                         console=console, sink=args.out)
        return 0
    res = explain(model, tokenizer, args.text, layers=args.layers, target=args.target, embedding=args.embedding)
    show(res, model, tokenizer, console)
    if args.out:
        console.print(f"saved {res.save(args.out)}")
    if args.html:
        res.to_html(args.html)
        console.print(f"wrote {args.html}")
    return 0
