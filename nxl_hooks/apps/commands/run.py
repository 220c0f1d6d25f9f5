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
import os
import shutil
import sys
from pathlib import Path

from ..extras import SERVE_MODULES, require_extra
from ..options import (
    CliError,
    add_attribution_options,
    add_loading_options,
    check_output_folder,
    loading_options,
    positive_int,
)
from ..serve.settings import whole_number

NAME = "run"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        NAME,
        help="run a program (a server, a script) with every model it loads recorded",
        description="Run COMMAND unchanged; every model it loads with from_pretrained is attached. Live readout: "
                    "nxl tail / nxl ctl.",
        usage="nxl run [options] -- COMMAND [ARGS ...]",
    )
    add_attribution_options(parser)
    parser.add_argument("--sink", metavar="DIR",
                        help="the run folder: records are written there (rotated files, one folder per process "
                             "and model) next to the control sockets; default: a private temporary folder, "
                             "records in memory only")
    parser.add_argument("--listen", metavar="ADDR",
                        help="also serve the control endpoint over HTTP on HOST:PORT (loopback only, bearer token "
                             "in RUN_FOLDER/token)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="let --listen use an address that is not loopback (the token is still required)")
    parser.add_argument("--models", metavar="PATTERN", default="*",
                        help="record only models whose name or path matches these globs (comma list; default *)")
    parser.add_argument("--keep-calls", type=whole_number, metavar="N", default=None,
                        help="requests kept in memory per model (default 16; older ones are in the sink)")
    parser.add_argument("--sink-file-mb", type=positive_int, metavar="MB", default=64,
                        help="start a new record file past this size (default 64)")
    parser.add_argument("--sink-files", type=positive_int, metavar="N", default=16,
                        help="record files kept per process and model; older ones are deleted (default 16)")
    add_loading_options(parser, program_loads=True)
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="-- COMMAND ARGS",
                        help="the program to run, after --")
    return parser


def bootstrap_dir() -> str:
    """The folder that holds the bootstrap's sitecustomize.py."""
    from ..serve import lazy

    return os.path.join(os.path.dirname(lazy.__file__), "bootstrap")


def run(args: argparse.Namespace) -> int:
    from ..serve.runs import make_run_dir, private_run_dir, remember, write_token
    from ..serve.settings import DEFAULT_KEEP_CALLS, Settings, parse_listen

    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        raise CliError("give the program to run after --, e.g. nxl run -- transformers serve ./model")
    if shutil.which(program[0]) is None:  # before any run folder is made or remembered
        raise CliError(f"{program[0]}: command not found (or not executable)")
    if Path(program[0]).name == "transformers" and program[1:2] == ["serve"]:
        require_extra("serve", SERVE_MODULES, "transformers serve")
    if args.listen:
        parse_listen(args.listen, allow_remote=args.allow_remote)
    load = {key: value for key, value in loading_options(args).items() if key != "head" and value is not None}
    if load.get("gguf_file") and load.get("quantize"):
        raise CliError("--gguf-file with --load-in-8bit/--load-in-4bit: transformers refuses that combination in "
                       "the program's own from_pretrained; load the GGUF, save it, and quantize the saved folder")
    if args.sink:
        check_output_folder(args.sink, "--sink")
        folder = make_run_dir(args.sink)
        remember(folder)
    else:
        folder = private_run_dir()
    settings = Settings(run_dir=folder, sink=bool(args.sink), layers=args.layers, target=args.target,
                        embedding=args.embedding, models=[g.strip() for g in args.models.split(",") if g.strip()],
                        keep_calls=DEFAULT_KEEP_CALLS if args.keep_calls is None else args.keep_calls,
                        listen=args.listen, allow_remote=args.allow_remote,
                        sink_max_bytes=args.sink_file_mb << 20, sink_max_files=args.sink_files, load=load)
    if args.listen:
        write_token(folder)
    env = {**os.environ, **settings.to_env()}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (bootstrap_dir(), os.environ.get("PYTHONPATH")) if p)
    print(f"nxl run: run folder {folder} (live view: nxl tail --run {folder})", file=sys.stderr, flush=True)
    try:
        os.execvpe(program[0], program, env)
    except FileNotFoundError:
        raise CliError(f"{program[0]}: command not found") from None
    return 0  # not reached: the program replaced this process
