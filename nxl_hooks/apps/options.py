"""What the ``nxl`` subcommands share: the error type that prints as one line, argument parsers, and the option
groups several commands take.

    parser.add_argument("--layers", type=parse_layers, default="all")
    add_attribution_options(parser); add_dataset_options(parser); add_loading_options(parser)
    model, tok = load_model(args.model, **loading_options(args))
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any, Callable

from ..method import select
from ..method.registry import get_method
from ..records.tokens import visible
from .loading import DTYPES

__all__ = [
    "HEADS",
    "CliError",
    "add_attribution_options",
    "add_dataset_options",
    "add_loading_options",
    "argument_type",
    "check_output_file",
    "check_output_folder",
    "loading_options",
    "one_line",
    "parse_layers",
    "parse_max_memory",
    "parse_target",
    "positive_int",
]

HEADS = ("causal_lm", "sequence_classification", "masked_lm")  # --head: when config.architectures does not say


class CliError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


def one_line(message: str) -> str:
    """``message`` on one line that any terminal can print: whitespace runs become one space, and control, format
    and bidi characters, and what cannot be encoded (a command-line byte that is not UTF-8, kept by Python as a
    lone surrogate), are shown escaped (:func:`~nxl_hooks.records.tokens.visible`): an error may quote a request
    id or a server's answer, a notice of ``nxl attach`` what another user's process said (its model's name)."""
    return visible(" ".join(message.split()))


def check_output_file(path: str | None, option: str) -> None:
    """A :class:`CliError` unless ``path`` (given with ``option``) can be written as a whole file: its folder
    exists and it is not itself a folder. Checked before any model loads, so a typo costs nothing."""
    if path is None:
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise CliError(f"{option} {path} is a folder, not a file: give a file name (a file in it, or elsewhere)")
    folder = target.parent
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise CliError(f"{option} {path}: the folder {folder} {what}; create the folder or pick another path")


def check_output_folder(path: str, option: str = "--out") -> None:
    """A :class:`CliError` when ``path`` cannot be an output folder: it, or a folder above it, is a file."""
    target = Path(path).expanduser()
    for where in (target, *target.parents):
        if where.exists():
            if not where.is_dir():
                raise CliError(f"{option} {path}: {where} is a file, not a folder; give a folder (it is created "
                               "when missing)")
            return


def positive_int(value: str) -> int:
    """An int of at least 1 (``--top-k``, ``--limit``, ``--ig-steps``, ``--generate``)."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: give a whole number of at least 1")
    return number


def argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` (a ValueError says what is wrong) as an argparse ``type``, its message kept as argparse's error:
    ``parser.add_argument("--layers", type=argument_type(select.parse_layers))``."""

    @functools.wraps(parse)
    def read(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return read


#: :func:`nxl_hooks.method.select.parse_layers` and ``parse_target`` as argparse types.
parse_layers = argument_type(select.parse_layers)
parse_target = argument_type(select.parse_target)
#: A registered attribution method's name (:func:`nxl_hooks.method.registry.get_method`) as an argparse type.
parse_method = argument_type(lambda value: get_method(value).name)


def add_method_option(parser: argparse.ArgumentParser) -> None:
    """--method: which attribution method ranks tokens (any registered one; the probe computes it)."""
    parser.add_argument("--method", type=parse_method, default="normxlogit", metavar="NAME",
                        help="the attribution method that scores and ranks tokens: normxlogit (default), logat, "
                        "contrastive, or one registered in code or through the nxl_hooks.methods entry points")


def parse_max_memory(value: str) -> dict[Any, str]:
    """``--max-memory 0=10GiB,cpu=30GiB`` -> ``{0: "10GiB", "cpu": "30GiB"}`` (accelerate's max_memory)."""
    limits: dict[Any, str] = {}
    for part in value.split(","):
        device, sep, size = part.strip().partition("=")
        if not sep or not device or not size:
            raise argparse.ArgumentTypeError(f"{value!r}: use DEVICE=SIZE pairs like 0=10GiB,cpu=30GiB")
        limits[int(device) if device.isdigit() else device] = size
    return limits


def _device_map(value: str) -> Any:
    if value.startswith("{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"--device-map {value!r} is not valid JSON: {error}") from None
    return value


def add_attribution_options(parser: argparse.ArgumentParser) -> None:
    """What every command that attaches takes: --layers, --target, --embedding."""
    parser.add_argument(
        "--layers", type=parse_layers, default="all", help="all (default) | last | comma list like 0,2,-1"
    )
    parser.add_argument(
        "--target",
        type=parse_target,
        default="predicted",
        help="predicted (default) | an id | a word (read after TEXT: 'Paris' is ' Paris'), a token or a label | "
        "comma list, spaces kept (one table each; two also show their contrast)",
    )
    parser.add_argument(
        "--embedding",
        choices=select.EMBEDDINGS,
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


def add_loading_options(parser: argparse.ArgumentParser, *, program_loads: bool = False) -> None:
    """How every command loads its models (:func:`nxl_hooks.apps.loading.load_model`): --head, --dtype,
    --device-map, --max-memory, --load-in-8bit / --load-in-4bit, --gguf-file, and --chat for the text.
    ``program_loads``: the models are the program's own (``nxl run``): no --head and no --chat."""
    group = parser.add_argument_group("loading the model" if not program_loads else
                                      "loading the program's models (defaults for its from_pretrained calls)")
    if not program_loads:
        group.add_argument("--head", choices=HEADS,
                           help="which head to load when config.architectures does not say (a .gguf file: causal_lm)")
    group.add_argument("--dtype", choices=DTYPES, help="load the weights in this dtype (auto: the checkpoint's)")
    group.add_argument("--device-map", type=_device_map, metavar="MAP",
                       help="accelerate placement: auto | balanced | sequential | cpu | cuda:0 | JSON {module: device}")
    group.add_argument("--max-memory", type=parse_max_memory, metavar="LIMITS",
                       help="with --device-map: what each device may hold, like 0=10GiB,cpu=30GiB")
    group.add_argument("--load-in-8bit", action="store_true", help="quantize with bitsandbytes, 8-bit")
    group.add_argument("--load-in-4bit", action="store_true", help="quantize with bitsandbytes, 4-bit nf4")
    group.add_argument("--gguf-file", metavar="NAME",
                       help="the .gguf file inside MODEL (a folder or hub id); or pass the .gguf file as MODEL")
    if not program_loads:  # --tp (registry): the program's own from_pretrained(tp_plan=...) decides under nxl run
        group.add_argument("--tp", action="store_true", help="tensor parallel: launched by torchrun, load with "
                           "tp_plan='auto' (one shard per process; rank 0 prints and writes)")
        group.add_argument("--chat", action="store_true",
                           help="wrap each text in the tokenizer's chat template as the user's message, with the "
                           "assistant's turn after it")


def loading_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`~nxl_hooks.apps.loading.load_model` that ``args`` ask for; a
    :class:`CliError` for combinations that cannot work."""
    if args.load_in_8bit and args.load_in_4bit:
        raise CliError("--load-in-8bit and --load-in-4bit exclude each other: pick one")
    if args.max_memory is not None and args.device_map is None:
        raise CliError("--max-memory needs --device-map (e.g. --device-map auto): it caps what each device holds")
    if args.gguf_file is not None and not args.gguf_file.lower().endswith(".gguf"):
        raise CliError(f"--gguf-file {args.gguf_file!r}: name the .gguf file inside MODEL")
    quantize = "8bit" if args.load_in_8bit else "4bit" if args.load_in_4bit else None
    return {"head": getattr(args, "head", None), "dtype": args.dtype, "device_map": args.device_map,
            "max_memory": args.max_memory, "quantize": quantize, "gguf_file": args.gguf_file,
            **({"tp": True} if getattr(args, "tp", False) else {}),
            **({"chat": True} if getattr(args, "chat", False) else {})}
