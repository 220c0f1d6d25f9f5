"""``nxl convert MODEL.gguf OUT``: a GGUF file as a plain transformers folder (weights dequantized, config,
tokenizer, chat template) that ``from_pretrained`` and ``transformers serve`` load.

    nxl convert ./SmolLM2-135M-Instruct.Q4_1.gguf ./smollm2                 # float32
    nxl convert ./model.gguf ./model-bf16 --dtype bfloat16
    nxl run --sink runs/ -- transformers serve ./smollm2                     # then serve the folder, recorded
"""

from __future__ import annotations

import argparse

from ...arch.text import install_command
from ..options import CliError, named, say

NAME = "convert"
#: What the weights can be dequantized to ("auto" has no meaning for quantized weights).
CONVERT_DTYPES = ("float32", "float16", "bfloat16")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        NAME,
        help="write a .gguf model as a transformers folder (for from_pretrained and transformers serve)",
        description="Dequantize the model of a GGUF file and save it with its config, tokenizer and chat template "
                    "as a folder that from_pretrained and transformers serve load (needs gguf and accelerate: "
                    f"{install_command('gguf')}).",
    )
    parser.add_argument("model", metavar="MODEL", type=named,
                        help="the .gguf file (or a folder or hub id with --gguf-file)")
    parser.add_argument("out", metavar="OUT", help="the folder to write (new, or empty)")
    parser.add_argument("--gguf-file", metavar="NAME", help="the .gguf file inside MODEL, when MODEL is a folder")
    parser.add_argument("--dtype", choices=CONVERT_DTYPES, default="float32",
                        help="dtype of the dequantized weights (default float32)")
    return parser


def run(args: argparse.Namespace) -> int:
    from ..loading import convert_gguf

    if args.gguf_file is None and not args.model.lower().endswith(".gguf"):
        raise CliError(f"{args.model} is not a .gguf file: pass the file, or its folder plus --gguf-file NAME")
    out = convert_gguf(args.model, args.out, gguf_file=args.gguf_file, dtype=args.dtype)
    say(f"wrote {out} (serve it: nxl run -- transformers serve {out})")
    return 0
