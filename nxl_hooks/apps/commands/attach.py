"""``nxl attach PID [options]``: record the models of a Python process that is already running, without a restart.

    nxl attach 4242 --layers all --sink runs/       # then nxl tail / nxl ctl / read_stream, as under nxl run
    nxl attach 4242 --wait 60                       # the process has not loaded its model yet
    nxl detach 4242                                 # every hook and patch off, the endpoint closed

The options are those of ``nxl run`` (what is explained, the run folder, the endpoint, which models). How the
process is reached, and every refusal: :mod:`nxl_hooks.apps.serve.inject`; what happens inside it:
:mod:`nxl_hooks.apps.serve.remote`. A server whose models run in processes it spawned (``transformers serve``
from 5.25) is attached with them: each model process records into the same run folder, and the server sends
them its requests' ids; ``nxl detach`` of the server detaches them too. A model process it starts later (another
model, or one again after ``--model-timeout``) takes the attach's settings and ``nxl run``'s patches before its
model loads, and records into the same run folder (:mod:`~nxl_hooks.apps.serve.remote`). (``--api-server-count``
above 1:
its model process is not its API servers' child, and is not followed.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
from pathlib import Path
from typing import Any

from ..extras import extra_hint
from ..options import CliError, check_output_folder, one_line, positive_seconds, say, seconds
from ..serve.settings import add_run_options
from .run import prepare_run, sink_kind

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
    from ..serve.inject import inject, inspect_target, model_processes
    from ..serve.runs import TOKEN

    folder_given = bool(args.sink) and sink_kind(args.sink, target=True) is None  # a bad or unusable one: refused first
    target = inspect_target(args.pid)
    other = target.uid != os.geteuid()  # root, for another user's process: the run folder becomes theirs
    if other and not folder_given:
        raise CliError(f"process {args.pid} runs as uid {target.uid}: pass --sink DIR, a new folder (nxl attach "
                       "creates it and hands it to that user)")
    made = _create(args.sink, other, target.uid) if folder_given else _Made()
    try:
        settings = prepare_run(args, {}, target=True)
        folder = settings.run_dir
        if not folder_given:  # the private run folder prepare_run made
            made.adopt(folder)
        elif other and not made.is_run(folder):  # what is handed over is the very folder made, not another path
            raise CliError(f"--sink {args.sink} changed while nxl attach made it (it now leads to {folder}); "
                           "nothing was handed over")
        if other:
            made.hand_over(TOKEN, target.uid, target.gid)
        spawned = model_processes(args.pid)
        request = {"action": "attach", "env": settings.to_env(), "wait": args.wait}
        outcome = _checked(target, inject(target, {**request, "front": bool(spawned)}, timeout=args.timeout,
                                          wait=args.wait), other)
        models = _attached(args.pid, outcome)
        if outcome.get("front") is True:  # a server front: its models are in the processes it spawned
            models = _attach_spawned(args, target, spawned, request, other)
            if outcome.get("follows") is True:
                models += "; and the model processes it starts from now on"
    except BaseException:
        made.remove()
        raise
    finally:
        made.close()
    # another user's run folder and socket are theirs: its endpoint answers them (and root's detach), not root's tail
    viewer = f" as uid {target.uid}" if other else ""
    say(one_line(f"nxl attach: process {args.pid} recorded ({models}); run folder {folder} (live view{viewer}: nxl "
                 f"tail --run {folder}; undo: nxl detach {args.pid})"))
    return 0


def _checked(target: Any, outcome: dict, other: bool) -> dict:
    """``outcome`` of an attach injected into ``target``, if it attached; CliError with what to do otherwise."""
    from ..serve.installed import install_line

    if outcome.get("code") == "not-installed":  # said here, where nxl knows what it was installed from
        python = outcome.get("executable")  # the target's sys.executable: its venv's, not the file it links to
        remedy = install_line(python if isinstance(python, str) and python else target.executable)
        if other:  # run by root, that interpreter runs its environment's code (its .pth files, its pip) as root
            remedy = f"as uid {target.uid}, never as root: sudo -u '#{target.uid}' {remedy}"
        raise CliError(f"process {target.pid}: {outcome.get('error')}: install it there ({remedy}), then attach "
                       "again")
    if outcome.get("code") == "missing-extra":  # the sink kind's extra, missing in the target's environment
        hint = extra_hint(ImportError(name=outcome.get("module") if isinstance(outcome.get("module"), str) else ""))
        raise CliError(f"process {target.pid}: {hint or outcome.get('error')}")
    if not outcome.get("ok"):
        raise CliError(f"process {target.pid}: {outcome.get('error')}")
    return outcome


def _attach_spawned(args: argparse.Namespace, front: Any, spawned: list[int], request: dict, other: bool) -> str:
    """Attach the model processes ``spawned`` by the server ``front`` (attached with its patches only) and return
    the models recorded, in words; when none could be, the server is detached again and CliError says why."""
    from ..serve.inject import inject, inspect_target

    recorded, refused, attached = [], [], []
    try:
        for pid in spawned:
            try:
                target = inspect_target(pid)
                if target.uid != front.uid:  # (a child that changed its user: not the server's to hand a run folder)
                    raise CliError(f"process {pid} runs as uid {target.uid}, not as its server")
                outcome = _checked(target, inject(target, request, timeout=args.timeout, wait=args.wait), other)
                attached.append(target)
                recorded.append(f"{_attached(pid, outcome)}, in its model process {pid}")
            except CliError as error:
                refused.append(str(error))
        if not recorded:
            raise CliError(f"process {args.pid} is a server whose models run in processes of their own, and none of "
                           f"them could be attached ({'; '.join(refused)}); a model process takes the request only "
                           "when the server hands it one: attach while it serves")
    except BaseException:  # (an interrupt too) all or nothing: none of them, nor the server, stays attached
        for each in [*attached, front]:
            with contextlib.suppress(Exception):
                inject(each, {"action": "detach"}, timeout=args.timeout)
        raise
    return "; ".join(recorded + [f"not {error}" for error in refused])


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


class _Made:
    """The folders nxl attach made for a run, outermost first, each held open with the folder it was made in.
    They are reached through those descriptors only, never their paths again: a folder above them that another
    user made first (in sticky ``/tmp``) may be swapped for a link, and root would make, hand over or remove through
    it whatever that user chooses."""

    def __init__(self) -> None:
        self.made: list[tuple[int, str, int]] = []  # (the folder it was made in, its name, itself)
        self._open: list[int] = []
        self.owner = os.geteuid()  #: whose the run folder is: the target's user once handed over

    def hold(self, name: str | Path, dir_fd: int | None = None, *, follow: bool = False) -> int:
        """Folder ``name`` (in the folder open as ``dir_fd``) open until :meth:`close`; a link is refused unless
        ``follow``."""
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW),
                     dir_fd=dir_fd)
        self._open.append(fd)
        return fd

    def make(self, parent: int, name: str) -> int:
        """Make folder ``name`` (0700) in the folder open as ``parent`` and return it, open; FileExistsError when
        something (a link) is there already, CliError when what is there then is not the folder root just made."""
        os.mkdir(name, 0o700, dir_fd=parent)
        fd = self.hold(name, parent)
        info = os.fstat(fd)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():  # not ours to remove either
            raise CliError(f"{name} was replaced while nxl attach made it; give a new path")
        self.made.append((parent, name, fd))
        return fd

    def adopt(self, folder: Path) -> None:
        """The run folder prepare_run made (this user's private one), to be taken back the same way."""
        parent = self.hold(folder.parent, follow=True)
        self.made.append((parent, folder.name, self.hold(folder.name, parent)))

    def is_run(self, folder: Path) -> bool:
        """Whether ``folder`` is the innermost folder made (the run folder), not another one its path leads to."""
        return bool(self.made) and os.path.samestat(os.stat(folder), os.fstat(self.made[-1][2]))

    def hand_over(self, token: str, uid: int, gid: int) -> None:
        """The run folder, and the token nxl wrote in it, to ``uid``: nothing else, never through a link."""
        run = self.made[-1][2]
        with contextlib.suppress(FileNotFoundError):
            os.chown(token, uid, gid, dir_fd=run, follow_symlinks=False)
        os.fchown(run, uid, gid)
        self.owner = uid

    def remove(self) -> None:
        """Take back what a refused attach made: the run folder with its contents (once handed over, only what
        its new owner could remove: :func:`~nxl_hooks.apps.serve.inject.remove_as`), then each (empty) folder
        above, each in the folder it was made in."""
        from ..serve.inject import remove_as

        if not self.made:
            return
        parent, name, _ = self.made[-1]
        remove_as(parent, name, self.owner)
        for parent, name, _ in reversed(self.made[:-1]):
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=parent)

    def close(self) -> None:
        for fd in self._open:
            os.close(fd)
        self._open.clear()


def _create(sink: str, other: bool, uid: int) -> _Made:
    """Make the ``--sink`` folder (0700) and each folder missing above it, and return what was made: what a
    failed attach removes. An existing folder is used as the run folder, as under nxl run, except for another
    user's process (``other``): its run folder is handed to that user, and nxl hands over only what it made, so
    the path must not exist yet (and name no link); the folders made above it are root's, 0711.

    The missing folders are listed first, then each is made in the one above, held open (:class:`_Made`): one
    that appears meanwhile (a link another user plants in sticky ``/tmp``) makes mkdir fail, never followed."""
    from ..serve.runs import check_parents

    path = Path(os.path.abspath(check_output_folder(sink, "--sink")))
    if other and os.path.lexists(path):
        raise CliError(f"--sink {sink} exists: for another user's process (uid {uid}) nxl attach creates the run "
                       f"folder itself and hands only that to its user; give a new path, such as {path / 'attach'}")
    if other and os.path.realpath(path) != str(path):
        raise CliError(f"--sink {sink} goes through a symbolic link: give the real path ({os.path.realpath(path)})")
    missing = [each for each in (path, *path.parents) if not os.path.lexists(each)][::-1]
    if other:  # a folder above it that another user may write could be swapped for a link while it is made
        try:
            check_parents(path)
        except PermissionError as error:
            raise CliError(f"--sink {sink}: {error}") from None
    made = _Made()
    if not missing:
        return made
    try:
        folder = made.hold(missing[0].parent, follow=not other)
        for each in missing:
            folder = made.make(folder, each.name)
            if other and each != path:
                os.fchmod(folder, 0o711)  # the user reaches its run folder through it, and only that
    except FileExistsError:
        made.remove()
        made.close()
        raise CliError(f"--sink {sink}: {each} appeared while nxl attach created it; give a new path") from None
    except BaseException:
        made.remove()
        made.close()
        raise
    return made
