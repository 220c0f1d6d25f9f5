"""The ``nxl`` command line: one subcommand per module of :mod:`nxl_hooks.apps.commands`.

Bad input raises :class:`~nxl_hooks.apps.options.CliError` (or a ``ValueError``/``LookupError``/``OSError`` from
the library or transformers): :func:`main` prints one line and returns exit code 2; ``--traceback`` shows the
full trace instead.

    nxl attribute ./my-model "The movie was great" --layers all --target predicted --out a.safetensors
    nxl demo
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .commands import COMMANDS
from .options import CliError, parse_layers, parse_target, positive_int

__all__ = ["CliError", "build_parser", "main", "parse_layers", "parse_target", "positive_int"]


def build_parser() -> argparse.ArgumentParser:
    """The ``nxl`` argument parser, one subparser per command module."""
    parser = argparse.ArgumentParser(prog="nxl", description="Per-layer NormXLogit token attribution.")
    parser.add_argument("--traceback", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(sub).set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nxl`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed usage and the error
        return int(exit_.code or 0)
    try:
        return int(args._run(args) or 0)
    except (CliError, ValueError, LookupError, OSError) as err:
        if args.traceback:
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"nxl {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
