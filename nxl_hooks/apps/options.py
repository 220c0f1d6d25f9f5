"""What the ``nxl`` subcommands share: the error type that prints as one line, argument parsers, and the option
groups several commands take.

    parser.add_argument("--layers", type=parse_layers, default="all")
    add_attribution_options(parser); add_dataset_options(parser); add_loading_options(parser)
    model, tok = load_model(args.model, **loading_options(args))
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import select as _select  # (``select`` is nxl_hooks.method.select here)
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..method import select
from ..method.registry import builtin_names, get_method
from ..records.files import cannot_write_in, not_a_folder, unwritable, user_path
from ..records.tokens import printable
from .loading_options import HEAD_CLASSES, Loading, read_max_memory
from .schema import add_options, options
from .serve.settings import ATTACH, Settings, positive_number

__all__ = [
    "HEADS",
    "CliError",
    "READER_GONE",
    "add_attribution_options",
    "add_dataset_options",
    "add_loading_options",
    "argument_type",
    "check_apart",
    "check_output_file",
    "check_output_folder",
    "loading_identity",
    "loading_options",
    "one_line",
    "parse_layers",
    "parse_max_memory",
    "parse_target",
    "positive_int",
    "positive_seconds",
    "reader_gone",
    "say",
    "seconds",
    "stdout_console",
    "stdout_gone",
]

HEADS = tuple(HEAD_CLASSES)  #: --head: when config.architectures does not say


class CliError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


def say(line: str) -> None:
    """Print ``line`` on stderr in one write, newline included: ``say("nxl run: run folder out")``. The ranks of
    ``torchrun`` (run with ``python -u``: stderr unbuffered) share one stderr, and ``print``'s separate write of
    the newline let two ranks' lines run into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


#: The exit code of a command whose output's reader went away (``nxl tail | head -1`` once head has its line): what
#: a shell reports for a program that SIGPIPE ended (``yes | head -1``), so a script tells it from bad input (2).
READER_GONE = 128 + signal.SIGPIPE


def stdout_gone() -> bool:
    """Whether nothing reads stdout any more (a pipe whose reader closed it): a broken pipe that is not stdout's (a
    socket's) is an error of its own."""
    try:
        poller = _select.poll()
        poller.register(sys.stdout.fileno(), _select.POLLOUT)
        return any(events & (_select.POLLERR | _select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no stdout, or one with no file (a test's capture)
        return False


def reader_gone() -> int:
    """Point stdout at /dev/null and return :data:`READER_GONE`: the output nobody reads is dropped, without a word
    (Python's flush of what stdout still holds, at exit, would print "Exception ignored ... BrokenPipeError")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return READER_GONE


def stdout_console(*, finish: bool = False) -> Any:
    """A rich ``Console`` on stdout for a command's output (:func:`~nxl_hooks.apps.terminal.fitted`), that ends the
    command as :func:`reader_gone` says once its reader goes away (rich's own ends it with exit code 1, the code of
    records that are not whole). ``finish``: the command has files to write (``--out``, ``--html``), which it then
    goes on to write whole, quietly; the console's ``gone`` says so at its end."""
    from rich.console import Console

    from .terminal import fitted

    class _Console(Console):
        gone = False

        def on_broken_pipe(self) -> None:
            self.quiet = True
            code = reader_gone()
            if not finish:
                raise SystemExit(code)  # (not an Exception: an on_step callback's would only stop its records)
            self.gone = True

    return fitted(_Console())


def one_line(message: str) -> str:
    """``message`` on one line that any terminal can print: whitespace runs become one space, and control, format
    and bidi characters, and what cannot be encoded (a command-line byte that is not UTF-8, kept by Python as a
    lone surrogate), are shown escaped (:func:`~nxl_hooks.records.tokens.printable`): an error may quote a request
    id or a server's answer, a notice of ``nxl attach`` what another user's process said (its model's name)."""
    return printable(" ".join(message.split()))


def check_output_file(path: str | None, option: str) -> str | None:
    """``path`` (given with ``option``) with ``~`` expanded: the one path to write, checked (a :class:`CliError`
    unless it can be written as a whole file: it is not blank, its folder exists and it is not itself a folder).
    Checked before any model loads, so a typo costs nothing; so is that a file can be made in the folder
    (:func:`~nxl_hooks.records.files.cannot_write_in`). ``args.out = check_output_file(args.out, "--out")``"""
    if path is None:
        return None
    if not path.strip():  # '' is the current folder to pathlib, ' ' a file named so: both a variable left unset
        raise CliError(f"{option} is empty: give a file name")
    target = user_path(path)
    if target.is_dir():
        raise CliError(f"{option} {path} is a folder, not a file: give a file name (a file in it, or elsewhere)")
    why = unwritable(target)
    if why is not None:
        raise CliError(f"{option} {why}")
    check_file_folder(target.parent, path, option)
    return str(target)


def check_file_folder(folder: str | Path, path: str, option: str, *, makes: str = "") -> None:
    """A :class:`CliError` unless ``folder``, where ``path`` (given with ``option``) is to be written, exists as a
    folder a file can be made in (:func:`~nxl_hooks.records.files.cannot_write_in`); ``makes`` says, in the line,
    who does not make it. ``check_file_folder(out.parent, args.out, "--out")``"""
    folder = Path(folder)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise CliError(f"{option} {path}: the folder {folder} {what}{makes}; create the folder or pick another path")
    why = cannot_write_in(folder, path)
    if why is not None:
        raise CliError(f"{option} {why}")


def check_output_folder(path: str, option: str = "--out") -> str:
    """``path`` (given with ``option``) with ``~`` expanded: the one folder to write, checked (a :class:`CliError`
    when it is empty, it or a folder above it is a file, or it cannot be made or written in).
    ``args.out = check_output_folder(args.out)``"""
    if not path.strip():
        raise CliError(f"{option} is empty: give a folder (it is created when missing)")
    why = not_a_folder(path)
    if why is not None:
        raise CliError(f"{option} {why}")
    return str(user_path(path))


def check_apart(option: str, path: str | None, inputs: Iterable[str | Path | None], *,
                writes: Sequence[str | Path] | None = None) -> None:
    """A :class:`CliError` when what ``option`` (given as ``path``) writes, ``writes`` (files, and folders it fills;
    default: ``path``), is one of the command's ``inputs`` (the same file, also through a link or another name),
    lies inside an input folder (a model's: a file written there would be loaded with the model), or holds an
    input. ``--force`` does not lift it; an input that is no local path (a hub id) is passed over.
    ``check_apart("--out", args.out, [args.model])``"""
    if path is None:
        return
    for source in inputs:
        if source is None or not user_path(source).exists():
            continue
        real = os.path.realpath(user_path(source))
        for output in [path] if writes is None else writes:
            target = os.path.realpath(output)
            if target == real or _inside(real, target) or os.path.exists(target) and os.path.samefile(target, real):
                how = "over"
            elif _inside(target, real):
                how = "into"
            else:
                continue
            raise CliError(f"{option} {path} would write {how} {source}, an input of this command: write the output "
                           "elsewhere")


def _inside(path: str, folder: str) -> bool:
    """Whether the real path ``path`` lies below the real path ``folder``."""
    return path != folder and os.path.commonpath([path, folder]) == folder


def seconds(value: str, *, least: float = 0.0) -> float:
    """A finite number of seconds of at least ``least`` (``--timeout``, ``--wait``)."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < least:
        at_least = "more than 0" if least > 0 else "0 or more"
        raise argparse.ArgumentTypeError(f"{value!r}: give a number of seconds, {at_least}")
    return number


def positive_seconds(value: str) -> float:
    """:func:`seconds` of more than 0."""
    return seconds(value, least=math.ulp(0.0))


def named(value: str) -> str:
    """A path or name to read (MODEL, DATA, a stream) as given, as an argparse ``type`` refusing a blank one: a
    variable left unset, which pathlib reads as the current folder, so that the line said nothing of it (``--out
    DIR would write into , an input``)."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"{value!r} is empty: give a path or a name")
    return value


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


#: An int of at least 1 (``--top-k``, ``--limit``, ``--ig-steps``, ``--generate``): the NXL_SINK_MAX_* rule, as an
#: argparse type.
positive_int = argument_type(positive_number)

#: :func:`nxl_hooks.method.select.parse_layers` and ``parse_target`` as argparse types.
parse_layers = argument_type(select.parse_layers)
parse_target = argument_type(select.parse_target)
#: A registered attribution method's name (:func:`nxl_hooks.method.registry.get_method`) as an argparse type.
parse_method = argument_type(lambda value: get_method(value).name)


def add_method_option(parser: argparse.ArgumentParser) -> None:
    """--method: which attribution method ranks tokens (any registered one; the probe computes it)."""
    parser.add_argument("--method", type=parse_method, default="normxlogit", metavar="NAME",
                        help="the attribution method that scores and ranks tokens (default normxlogit): "
                        + "; ".join(f"{name} ({get_method(name).description})".replace("%", "%%")
                                    for name in builtin_names())
                        + "; or one registered in code or through the nxl_hooks.methods entry points")


#: ``--max-memory 0=10GiB,cpu=30GiB`` -> ``{0: "10GiB", "cpu": "30GiB"}`` (accelerate's max_memory): argparse type.
parse_max_memory = argument_type(read_max_memory)


def add_attribution_options(parser: argparse.ArgumentParser) -> None:
    """What every command that attaches takes: --layers, --target, --embedding, declared once as the
    :data:`~nxl_hooks.apps.serve.settings.ATTACH` fields of ``nxl run``'s settings (the parsed arguments hold
    their defaults where left out)."""
    add_options(parser, Settings, where=lambda option: option.name in ATTACH, set_defaults=True)


def add_dataset_options(parser: argparse.ArgumentParser) -> None:
    """What every dataset command shares: the data file, its columns, the output folder (resumable)."""
    parser.add_argument("data", metavar="DATA", type=named,
                        help=".jsonl or .csv with text, label, evidence; or a hub dataset hf:NAME[:CONFIG]:SPLIT")
    parser.add_argument("--out", metavar="DIR", required=True,
                        help="output folder: summary.json, records.jsonl, report.html; rerun with the same DIR to resume")
    parser.add_argument("--text-field", default="text", help="column with the text (default: text)")
    parser.add_argument("--label-field", default="label", help="column with the gold label (default: label)")
    parser.add_argument("--evidence-field", default="evidence", help="column with evidence words (default: evidence)")
    parser.add_argument("--limit", type=positive_int, help="only the first N examples")


def add_loading_options(parser: argparse.ArgumentParser, *, program_loads: bool = False) -> None:
    """How every command loads its models (:class:`~nxl_hooks.apps.loading.Loading`, read back by
    :func:`loading_options`): --head, --dtype, --device-map, --max-memory, --load-in-8bit / --load-in-4bit,
    --gguf-file, --tp and --chat. ``program_loads``: the models are the program's own (``nxl run``): only the
    options it hands to the program's loads (no --head, --tp or --chat)."""
    group = parser.add_argument_group("loading the model" if not program_loads else
                                      "loading the program's models (defaults for its from_pretrained calls)")
    add_options(group, Loading, where=(lambda option: option.program) if program_loads else None)


def loading_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`~nxl_hooks.apps.loading.load_model` that ``args`` ask for: head, dtype,
    device_map, max_memory, offload_folder, quantize and gguf_file (None when not given), tp and chat when given; a
    :class:`CliError` for combinations that cannot work. (``Loading.from_args(args)`` is the same options as one
    object.)"""
    try:
        loading = Loading.from_args(args)
    except ValueError as error:
        raise CliError(str(error)) from None
    return {**{option.name: None for option in options(Loading) if option.default is None}, **loading}


def loading_identity(loading: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`loading_options` as they make a run's identity (``nxl evaluate``'s, ``nxl audit``'s), without
    ``offload_folder``: where offloaded weights wait changes no number, so a run resumes with another one (and a
    run from before the option resumes)."""
    return {key: value for key, value in loading.items() if key != "offload_folder"}
