"""``nxl attach PID [options]``: record the models of a Python process that is already running, without a restart.

    nxl attach 4242 --layers all --sink runs/       # then nxl tail / nxl ctl / read_stream, as under nxl run
    nxl attach 4242 --wait 60                       # the process has not loaded its model yet
    nxl detach 4242                                 # every hook and patch off, the endpoint closed

The options are those of ``nxl run`` (what is explained, the run folder, the endpoint, which models). How the
process is reached, and every refusal: :mod:`nxl_hooks.apps.serve.inject`; what happens inside it:
:mod:`nxl_hooks.apps.serve.remote`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from ..options import CliError
from ..serve.settings import add_run_options
from .run import prepare_run

NAME = "attach"


def add_pid(parser: argparse.ArgumentParser) -> None:
    """PID and --timeout: which process, how long its main thread may take to pick the request up."""
    parser.add_argument("pid", type=int, metavar="PID", help="the process (a server, a script, a notebook kernel)")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", default=30.0,
                        help="how long the process may take to run the injected request (its main thread must "
                             "reach Python code); past it the request is withdrawn (default 30)")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(NAME, help="record the models of a running Python process (no restart)",
                            description="Inject nxl_hooks into a running Python process (Python 3.14+: "
                                        "sys.remote_exec; older: gdb) and record every model it holds, as nxl run "
                                        "would. Live readout: nxl tail / nxl ctl. Undo: nxl detach PID.")
    add_pid(parser)
    parser.add_argument("--wait", type=float, metavar="SECONDS", default=0.0,
                        help="if no model is loaded yet, wait up to this long for one (default 0: refuse)")
    add_run_options(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from ..serve.inject import inject, inspect_target

    target = inspect_target(args.pid)
    if target.uid != os.geteuid() and not args.sink:
        raise CliError(f"process {args.pid} runs as uid {target.uid}: pass --sink DIR, a run folder it will own")
    made = not args.sink or not Path(args.sink).expanduser().exists()
    settings = prepare_run(args, {})
    folder = settings.run_dir
    if target.uid != os.geteuid():
        for path in (folder, *folder.iterdir()):
            os.chown(path, target.uid, target.gid)
    try:
        outcome = inject(target, {"action": "attach", "env": settings.to_env(), "wait": args.wait},
                         timeout=args.timeout, wait=args.wait)
    except BaseException:
        _forget(folder, made)
        raise
    if not outcome.get("ok"):
        _forget(folder, made)
        raise CliError(f"process {args.pid}: {outcome.get('error')}")
    status = outcome["status"]
    models = ", ".join(m["name"] + ("" if m["attached"] else f" (not attached: {m['error'] or 'not selected'})")
                       for m in status["models"])
    print(f"nxl attach: process {args.pid} recorded ({models}); run folder {folder} (live view: nxl tail --run "
          f"{folder}; undo: nxl detach {args.pid})", file=sys.stderr, flush=True)
    return 0


def _forget(folder: Path, made: bool) -> None:
    """A refused attach leaves no run folder of its own behind (a --sink folder that held files stays)."""
    if made:
        shutil.rmtree(folder, ignore_errors=True)
