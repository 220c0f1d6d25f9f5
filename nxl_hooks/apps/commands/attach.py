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
import contextlib
import os
import shutil
from pathlib import Path

from ..options import CliError, check_output_folder, one_line, positive_seconds, say, seconds
from ..serve.settings import add_run_options
from .run import _is_kind, prepare_run

NAME = "attach"


def add_pid(parser: argparse.ArgumentParser) -> None:
    """PID and --timeout: which process, how long its main thread may take to pick the request up."""
    parser.add_argument("pid", type=int, metavar="PID", help="the process (a server, a script, a notebook kernel)")
    parser.add_argument("--timeout", type=positive_seconds, metavar="SECONDS", default=30.0,
                        help="how long the process may take to run the injected request (its main thread must "
                             "reach Python code); past it the request is withdrawn (default 30). Also how long "
                             "to wait for another nxl attach or debugger tracing it to let go")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(NAME, help="record the models of a running Python process (no restart)",
                            description="Inject nxl_hooks into a running Python process (Python 3.14+: "
                                        "sys.remote_exec; older: gdb) and record every model it holds, as nxl run "
                                        "would. Live readout: nxl tail / nxl ctl. Undo: nxl detach PID.")
    add_pid(parser)
    parser.add_argument("--wait", type=seconds, metavar="SECONDS", default=0.0,
                        help="if no model is loaded yet, wait up to this long for one (default 0: refuse)")
    add_run_options(parser, where=lambda option: option.attach)  # not what only a program's start sets
    return parser


def run(args: argparse.Namespace) -> int:
    from ..serve.inject import inject, inspect_target
    from ..serve.runs import TOKEN

    target = inspect_target(args.pid)
    other = target.uid != os.geteuid()  # root, for another user's process: the run folder becomes theirs
    folder_given = bool(args.sink) and not _is_kind(args.sink)
    if other and not folder_given:
        raise CliError(f"process {args.pid} runs as uid {target.uid}: pass --sink DIR, a new folder (nxl attach "
                       "creates it and hands it to that user)")
    created = _create(args.sink, other, target.uid) if folder_given else []
    try:
        settings = prepare_run(args, {})
        folder = settings.run_dir
        if not folder_given:  # the private run folder prepare_run made
            created = [folder]
        elif other and folder != created[-1]:  # what is handed over is the very folder made, not another path
            raise CliError(f"--sink {args.sink} changed while nxl attach made it (it now leads to {folder}); "
                           "nothing was handed over")
        if other:  # only what nxl made in the folder it made, never through a link
            for path in (folder / TOKEN, folder):
                if os.path.lexists(path):
                    os.chown(path, target.uid, target.gid, follow_symlinks=False)
        outcome = inject(target, {"action": "attach", "env": settings.to_env(), "wait": args.wait},
                         timeout=args.timeout, wait=args.wait)
        if not outcome.get("ok"):
            raise CliError(f"process {args.pid}: {outcome.get('error')}")
        models = _attached(args.pid, outcome)
    except BaseException:
        _remove(created)
        raise
    # another user's run folder and socket are theirs: its endpoint answers them (and root's detach), not root's tail
    viewer = f" as uid {target.uid}" if other else ""
    say(one_line(f"nxl attach: process {args.pid} recorded ({models}); run folder {folder} (live view{viewer}: nxl "
                 f"tail --run {folder}; undo: nxl detach {args.pid})"))
    return 0


def _attached(pid: int, outcome: dict) -> str:
    """The models an attach answer names, in words; CliError for an answer of another shape (it comes from the
    target's side, which its user controls: only its shape is read, nothing of it is run)."""
    status = outcome.get("status")
    models = status.get("models") if isinstance(status, dict) else None
    if not isinstance(models, list) or not all(
            isinstance(m, dict) and isinstance(m.get("name"), str) and isinstance(m.get("attached"), bool)
            and isinstance(m.get("error"), (str, type(None))) for m in models):
        raise CliError(f"process {pid} answered the attach with a status of another shape: nothing was recorded "
                       "that nxl attach can vouch for; detach it (nxl detach) and check its nxl_hooks install")
    return ", ".join(m["name"] + ("" if m["attached"] else f" (not attached: {m['error'] or 'not selected'})")
                     for m in models)


def _create(sink: str, other: bool, uid: int) -> list[Path]:
    """Make the ``--sink`` folder (0700) and each folder missing above it, and return what was made, outermost
    first: what a failed attach removes. An existing folder is used as the run folder, as under nxl run, except
    for another user's process (``other``): its run folder is handed to that user, and nxl hands over only what
    it made, so the path must not exist yet (and name no link); the folders made above it are root's, 0711."""
    from ..serve.runs import check_parents

    path = Path(os.path.abspath(check_output_folder(sink, "--sink")))
    if other and os.path.lexists(path):
        raise CliError(f"--sink {sink} exists: for another user's process (uid {uid}) nxl attach creates the run "
                       f"folder itself and hands only that to its user; give a new path, such as {path / 'attach'}")
    if other and os.path.realpath(path) != str(path):
        raise CliError(f"--sink {sink} goes through a symbolic link: give the real path ({os.path.realpath(path)})")
    if other:  # a folder above it that another user may write could be swapped for a link while it is made
        try:
            check_parents(path)
        except PermissionError as error:
            raise CliError(f"--sink {sink}: {error}") from None
    made: list[Path] = []
    try:
        for missing in reversed([each for each in (path, *path.parents) if not os.path.lexists(each)]):
            os.mkdir(missing, 0o700)
            made.append(missing)
            if other and missing != path:
                os.chmod(missing, 0o711)  # the user reaches its run folder through it, and only that
    except FileExistsError as error:
        _remove(made)
        raise CliError(f"--sink {sink}: {error.filename} appeared while nxl attach created it; give a new path")
    return made


def _remove(made: list[Path]) -> None:
    """Take back what a refused attach made: the run folder with its contents, then each (empty) folder above."""
    if made:
        shutil.rmtree(made[-1], ignore_errors=True)  # never follows a link out of it
    for path in reversed(made[:-1]):
        with contextlib.suppress(OSError):
            os.rmdir(path)
