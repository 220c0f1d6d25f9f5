"""The ``nxl`` command line: one subcommand per module of :mod:`nxl_hooks.apps.commands`.

Bad input raises :class:`~nxl_hooks.apps.options.CliError` (or a ``ValueError``/``LookupError``/``OSError`` from
the library or transformers): :func:`main` prints one line and returns exit code 2; ``--traceback`` shows the
full trace instead. A missing optional package (an ImportError, or transformers' "please install ...") is that one
line naming the ``pip install "nxl_hooks[EXTRA]"`` to run (:mod:`nxl_hooks.apps.extras`). Output whose reader went
away (``nxl tail | head -1``) ends the command without a word, exit code 141 (as SIGPIPE would); Ctrl-C is 130.

    nxl attribute ./my-model "The movie was great" --layers all --target predicted --out a.safetensors
    nxl demo
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any, NoReturn, Sequence

from ..arch.version import VERSION
from ..method.scores import MethodError
from .commands import COMMANDS
from .extras import extra_hint, quiet_library_noise
from .options import (CliError, one_line, parse_layers, parse_target, positive_int, reader_gone, say,
                      stdout_gone)

__all__ = ["CliError", "build_parser", "main", "one_line", "parse_layers", "parse_target", "positive_int"]


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (the usage is one ``--help`` away) like every other ``nxl`` error, and
    no abbreviations (``--layer`` is not ``--layers``): every subcommand's parser is one of these."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})
        self.commands: dict[str, argparse.ArgumentParser] = {}  #: the top parser's: each command's, by name
        self.own: set[str] = set()  #: the top parser's: its own options (nxl --traceback COMMAND ...)

    def error(self, message: str) -> NoReturn:
        self.exit(2, one_line(f"{self.prog}: error: {message} (see {self.prog} --help)") + "\n")


def _not_utf8(argv: Sequence[str]) -> str | None:
    """The first argument that is not UTF-8 text (Python decodes such bytes to lone surrogates), shown as bytes."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as err:
            raw = arg.encode("utf-8", "surrogateescape")
            return (f"argument {raw!r} is not UTF-8 text (byte {raw[err.start:err.start + 1]!r}): pass UTF-8 "
                    "(check the terminal's encoding and LANG / LC_ALL)")
    return None


def build_parser() -> argparse.ArgumentParser:
    """The ``nxl`` argument parser, one subparser per command module."""
    parser = _Parser(prog="nxl", description="Per-layer NormXLogit token attribution.")
    own = [parser.add_argument("--traceback", action="store_true", help="show the full traceback on errors"),
           parser.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")]
    parser.own = {flag for action in own for flag in action.option_strings}
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(sub).set_defaults(_run=command.run)
    parser.commands = dict(sub.choices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nxl`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    quiet_library_noise()
    # An ASCII or Latin-1 stdout (a legacy locale, a file on Windows) cannot take every character a token's text or
    # the views hold ('␣', '│'): escaped, as stderr does, rather than a UnicodeEncodeError after all the work.
    errors = getattr(sys.stdout, "errors", None)
    with contextlib.suppress(AttributeError, ValueError):  # a stream that is no text file (None under pythonw)
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        return _main(argv)
    finally:  # (main called in a program of the user's: its stdout as it was)
        with contextlib.suppress(AttributeError, ValueError, TypeError, OSError):  # (OSError: a broken pipe's flush)
            sys.stdout.reconfigure(errors=errors)


def _unknown(parser: _Parser, command: str, given: list[str], unknown: list[str]) -> NoReturn:
    """Say arguments no parser took (``unknown``, in the order of ``given``) by the parser whose help lists what
    to give instead: nxl's, for those before the command and its own options put after it (``nxl --traceback
    attribute``), else the command's, which names it (nxl's said "see nxl --help", which lists no command's)."""
    at = given.index(command) if command in given else len(given)
    where, start = [], 0
    for arg in unknown:  # (each one's place, in order: a value may stand both before and after the command)
        start = given.index(arg, start) if arg in given[start:] else start
        where.append(start)
        start += 1
    before = [arg for arg, place in zip(unknown, where) if place < at]
    if before:
        parser.error(f"unrecognized arguments: {' '.join(before)}")
    own = [arg for arg in unknown if arg.split("=", 1)[0] in parser.own]
    if own:
        parser.error(f"{own[0]} is nxl's own option: give it before the command (nxl {own[0]} {command} ...)")
    parser.commands[command].error(f"unrecognized arguments: {' '.join(unknown)}")


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            _unknown(parser, args.command, list(sys.argv[1:] if argv is None else argv), unknown)
    except SystemExit as exit_:  # argparse already printed usage and the error
        return int(exit_.code or 0)
    try:
        bad = _not_utf8(sys.argv[1:] if argv is None else argv)
        if bad is not None:
            raise CliError(bad)
        return int(args._run(args) or 0)
    except (CliError, ValueError, LookupError, OSError, ImportError, MethodError) as err:
        if isinstance(err, BrokenPipeError) and stdout_gone():  # its reader has what it wanted (| head -1): no
            return reader_gone()  # error of the command's, nor bad input
        hint = None if isinstance(err, CliError) else extra_hint(err)  # a missing optional package: its extra
        if args.traceback or (isinstance(err, ImportError) and hint is None):
            raise  # an ImportError of no extra's package is a bug or a broken install: show where
        say(one_line(f"nxl {args.command}: error: {hint or str(err) or type(err).__name__}"))
        return 2
    except KeyboardInterrupt as interrupted:
        if str(interrupted):  # what the command kept, and how to go on (a dataset run): one line
            say(one_line(f"nxl {args.command}: interrupted: {interrupted}"))
        return 130


if __name__ == "__main__":
    sys.exit(main())
