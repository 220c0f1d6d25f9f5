"""Run a few lines of Python inside another, already running Python process: how ``nxl attach PID`` and ``nxl detach
PID`` reach it. Standard library only; the side of it that runs in the target is :mod:`.remote`.

    target = inspect_target(pid)                     # CliError, one line, for each refusal (module docstring)
    outcome = inject(target, {"action": "attach", "env": settings.to_env(), "wait": 0.0}, timeout=30)

What root trusts. ``nxl attach`` may run as root against another user's process; it then runs, imports and
believes nothing that user controls. Everything about the target is read once from ``/proc`` (the kernel's
word). Root never runs another user's process's interpreter: even a file of root's loads its standard library and
libpython from folders beside it that its owner and folders do not vouch for (a root-installed Python whose
``lib/`` a user can write). Attaching to one's own process (root's own, or a user's), the interpreter file the
kernel resolved (``/proc/PID/exe``) is run, to learn its version and to inject on 3.14+, only when it is a Python
interpreter's (``python3.12``, not a program embedding Python) and nobody but its user or root can change it (a
regular file that group and others cannot write, in folders they cannot write either, or sticky ones), and then
exactly that file, opened once and run through its descriptor, with ``-I -S``, an empty environment and ``/`` as
working folder: nothing of the target's environment (``PYTHONPATH``, ``PYTHONHOME``, ``LD_PRELOAD``...), folders or
symlinks. Any other interpreter is not run at all:
its version is read from the file names the kernel maps (``libpython3.12``: only to refuse one below 3.10) and
its process goes through gdb, which runs nothing of it (``-nx``, auto-load off). Whether nxl_hooks imports is
answered by the target itself, after the injection. (Attaching to one's own process, the same holds with "root's
or your own" for "root's".)

The route. Python 3.14 and newer, with an interpreter the caller may run (above): ``sys.remote_exec(pid,
script)`` (PEP 768), run by that interpreter (its version must match the target's). Otherwise (3.10 to 3.13, or
any other interpreter): ``gdb -p PID`` in batch mode, as memray and pyrasite do, but it runs no Python
itself: it maps one anonymous page in the target, writes the two-line bootstrap there, queues
``PyRun_SimpleString(page)`` with ``Py_AddPendingCall`` and detaches (about 0.3 s with the process stopped). The
interpreter runs pending calls in its main thread, with the GIL, between two bytecodes, the way it runs Python
signal handlers; that is the same safe point ``sys.remote_exec`` uses. The page (4 KiB) stays mapped.

The bootstrap runs :func:`script_source`'s script in a fresh namespace (nothing lands in ``__main__``) and
swallows every exception, so nothing can raise into the target. The script claims the request (an atomic
rename: a request ``nxl attach`` withdrew after its timeout is never carried out), sets the control socket's
SIGTERM/SIGHUP handler (:func:`script_source`: only the main thread may), starts one short-lived daemon thread, and
returns; the thread imports nxl_hooks *from the target's own environment*, does the work
(:func:`nxl_hooks.apps.serve.remote.handle`) and writes the outcome to a 0600 result file that :func:`inject`
waits for. The request (the run's settings as ``NXL_*`` values) goes through a 0600 file in a 0700 folder, never
on a command line.

Refusals, each one line before anything is injected: no such process; another user's process (only its owner or
root); tracing not allowed (``kernel.yama.ptrace_scope``, no ``CAP_SYS_PTRACE``); another mount namespace (a
container: the files would not be where the target looks); not a Python process; a Python older than 3.10;
remote debugging disabled in the target (``PYTHON_DISABLE_REMOTE_DEBUG``, ``-X disable_remote_debug``); a process
under ``nxl run`` already; a vLLM process (its model runs in worker processes: ``nxl run`` records those); gdb
missing (``apt-get install gdb``), or one that cannot call a function in a process on this machine (asked of
a child first: a call it fails half way leaves the process broken); traced by another debugger, or by a
concurrent ``nxl attach`` / ``nxl detach`` (named, after waiting up to ``timeout`` for it to let go). After the
injection, from the target: nxl_hooks not importable by its interpreter (``nxl attach`` names the ``pip install``
of the source nxl was installed from).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ...records.files import json_value, read_regular
from ..options import CliError

__all__ = ["Target", "bootstrap_source", "inject", "injector_command", "inspect_target", "model_processes",
           "permission_refusal", "remove_as", "script_source", "trusted_file"]

PAGE = 4096  #: the bytes gdb maps in the target for the bootstrap (it must fit, with its final NUL)
CAP_SYS_PTRACE = 19  #: its bit in /proc/PID/status CapEff
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?[a-z]*$")
_VERSION = re.compile(r"(?:^|/)(?:lib)?python3\.(\d+)")  #: in the executable's or a mapped libpython's name
_PROBE = "import sys; print('%d.%d' % sys.version_info[:2])"
#: How deep :func:`remove_as` goes: a run folder holds one level of folders (a sink's, per process and model); a
#: deeper tree is another user's doing, left as it is rather than held open level by level.
_DEPTH = 8


@dataclass(frozen=True)
class Target:
    """A running Python process, as ``nxl attach`` sees it from outside (its ``/proc`` entries, read once)."""

    pid: int
    uid: int
    gid: int
    executable: str  #: the interpreter's file, as the kernel resolved it (/proc/PID/exe)
    version: tuple[int, int] | None = None  #: its Python version, from root-owned facts only (module docstring)
    trusted: tuple[int, int] | None = None  #: (st_dev, st_ino) of ``executable`` when this process may run it
    started: str | None = None  #: when it started (:func:`_start_time`): a pid used again is another process

    @property
    def route(self) -> str:
        """``"remote_exec"`` (Python 3.14+, an interpreter this process may run) or ``"gdb"``."""
        return "remote_exec" if self.trusted and self.version and self.version >= (3, 14) else "gdb"


def _start_time(pid: int) -> str:
    """When process ``pid`` started, in clock ticks after boot (``/proc/PID/stat`` field 22): a pid the system
    gives again names a process with another start time."""
    return _read(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()[19].decode()


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _status(pid: int) -> dict[str, str]:
    lines = _read(f"/proc/{pid}/status").decode(errors="replace").splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def _capable(status: dict[str, str], capability: int) -> bool:
    return bool(int(status.get("CapEff", "0"), 16) >> capability & 1)


def _ptrace_scope() -> int | None:
    try:
        return int(_read("/proc/sys/kernel/yama/ptrace_scope"))
    except (OSError, ValueError):  # no Yama in this kernel: only the classic rules apply
        return None


def permission_refusal(pid: int, target_uid: int, *, euid: int, ptrace_cap: bool, scope: int | None) -> str | None:
    """Why this process may not trace ``pid`` (owned by ``target_uid``), or None: the owner-or-root rule, then the
    kernel's (Yama's ``ptrace_scope``; ``CAP_SYS_PTRACE``, which a container may lack)."""
    if euid != 0 and euid != target_uid:
        return (f"process {pid} belongs to uid {target_uid}, not to you (uid {euid}): only its owner or root can "
                "attach")
    if scope == 3:
        return "kernel.yama.ptrace_scope is 3: no process may be traced until the next boot"
    if scope == 2 and not ptrace_cap:
        return ("kernel.yama.ptrace_scope is 2: only a process with CAP_SYS_PTRACE may trace; run nxl attach as "
                "root (with that capability)")
    if scope == 1 and not ptrace_cap:
        return ("kernel.yama.ptrace_scope is 1: a process may trace only its own children; run nxl attach as root, "
                "or set it to 0 (sysctl kernel.yama.ptrace_scope=0)")
    if euid != target_uid and not ptrace_cap:
        return (f"process {pid} runs as uid {target_uid} and this process lacks CAP_SYS_PTRACE (a container "
                "started without it?): add the capability (docker run --cap-add=SYS_PTRACE) or attach as that user")
    return None


def trusted_file(path: str, owners: frozenset[int]) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the file at ``path`` when only ``owners`` can change it or what ``path`` names: a regular
    file of theirs that group and others cannot write, every folder above it theirs and not writable by group or
    others (unless sticky, as /tmp); None otherwise. ``path`` must be resolved: a link anywhere is untrusted.

        trusted_file("/usr/bin/python3.12", frozenset({0}))   # (2049, 131077)
    """
    if not os.path.isabs(path):
        return None
    try:
        info = os.lstat(path)
        folders = [os.lstat(folder) for folder in Path(path).parents]
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_uid not in owners or info.st_mode & 0o022:
        return None
    for folder in folders:
        if (not stat.S_ISDIR(folder.st_mode) or folder.st_uid not in owners
                or folder.st_mode & 0o022 and not folder.st_mode & stat.S_ISVTX):
            return None
    return info.st_dev, info.st_ino


def _run_checked(path: str, identity: tuple[int, int], args: list[str], **popen: object) -> subprocess.Popen:
    """Start the file ``path`` that :func:`trusted_file` checked, and only that: opened without following a link,
    compared with ``identity``, run through its descriptor, with an empty environment, from ``/``, stdin closed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise CliError(f"the interpreter {path} could not be opened ({error.strerror}); nothing was run") from None
    try:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) != identity:
            raise CliError(f"the interpreter {path} was replaced since nxl attach checked it: nothing was run; "
                           "attach again")
        return subprocess.Popen([path, *args], executable=f"/proc/self/fd/{fd}", pass_fds=(fd,), env={}, cwd="/",
                                stdin=subprocess.DEVNULL, start_new_session=True, **popen)
    finally:
        os.close(fd)


def _probe(pid: int, executable: str, identity: tuple[int, int]) -> tuple[int, int] | None:
    """The Python version of the interpreter file this process may run (:func:`trusted_file`), asked of that file
    with ``-I -S`` and nothing of the target's; None if it does not say."""
    process = _run_checked(executable, identity, ["-I", "-S", "-c", _PROBE], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    try:
        output, _ = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise CliError(f"process {pid}'s interpreter {executable} did not say its version within 30 s") from None
    major, _, minor = output.strip().partition(".")
    return (3, int(minor)) if process.returncode == 0 and major == "3" and minor.isdigit() else None


def _options(argv: list[str]) -> list[str]:
    """The interpreter options in ``argv`` (before the script, ``-c`` or ``-m``), with the values of ``-X``/``-W``."""
    options, rest = [], iter(argv[1:])
    for arg in rest:
        if not arg.startswith("-") or arg == "-" or arg.startswith(("-c", "-m")):
            break
        options.append(arg)
        if arg in ("-X", "-W"):
            options.append(next(rest, ""))
    return options


def _is_vllm(argv: list[str], maps: str) -> bool:
    """Whether a process runs vLLM: its compiled ops are mapped (an engine or worker process), or it was started as
    vLLM's command line (its API server)."""
    return "/vllm/_C" in maps or any(os.path.basename(arg) in ("vllm", "vllm_main.py") or
                                     arg.startswith("vllm.entrypoints") for arg in argv[:3])


def model_processes(pid: int) -> list[int]:
    """The children of process ``pid`` that Python's multiprocessing started by spawning (``transformers serve`` from
    5.25 runs each model in one: its API server holds none), oldest pid first, as the kernel lists them (their
    parent, ``/proc/N/stat``; the command line multiprocessing gives them); each is then checked as a target of its
    own (:func:`inspect_target`)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = int(_read(f"/proc/{entry}/stat").rsplit(b")", 1)[1].split()[1])
            spawned = parent == pid and b"spawn_main" in _read(f"/proc/{entry}/cmdline")
        except (OSError, IndexError, ValueError):  # ended meanwhile, or not ours to read
            continue
        if spawned:
            found.append(int(entry))
    return sorted(found)


def inspect_target(pid: int) -> Target:
    """The process ``pid`` if ``nxl attach`` may and can inject into it; CliError with the reason otherwise."""
    proc = f"/proc/{pid}"
    try:
        status = _status(pid)
    except (FileNotFoundError, ProcessLookupError):
        raise CliError(f"no process {pid} (has it ended? see ps -p {pid})") from None
    uid, gid = int(status["Uid"].split()[1]), int(status["Gid"].split()[1])
    refusal = permission_refusal(pid, uid, euid=os.geteuid(), ptrace_cap=_capable(_status(os.getpid()),
                                 CAP_SYS_PTRACE), scope=_ptrace_scope())
    if refusal:
        raise CliError(refusal)
    if pid == os.getpid():
        raise CliError("nxl attach cannot attach to itself")
    try:
        executable = os.readlink(f"{proc}/exe").removesuffix(" (deleted)")
        argv = [arg.decode(errors="surrogateescape") for arg in _read(f"{proc}/cmdline").split(b"\0")[:-1]]
        environ = dict(item.decode(errors="surrogateescape").partition("=")[::2]
                       for item in _read(f"{proc}/environ").split(b"\0") if b"=" in item)
        same_root = (os.stat(f"{proc}/root") == os.stat("/")
                     and os.readlink(f"{proc}/ns/mnt") == os.readlink("/proc/self/ns/mnt"))
        started = _start_time(pid)
        maps = _read(f"{proc}/maps").decode(errors="replace")
    except FileNotFoundError:
        raise CliError(f"process {pid} ended while nxl attach looked at it") from None
    except PermissionError as error:
        raise CliError(f"process {pid}: {error.strerror} reading {error.filename} (tracing it is not allowed "
                       "here)") from None
    if not same_root:
        raise CliError(f"process {pid} runs in another mount namespace (a container): run nxl attach inside it")
    if not (_PYTHON.search(os.path.basename(executable)) or "/libpython3" in maps):
        raise CliError(f"process {pid} ({os.path.basename(executable)}) is not a Python process")
    if _is_vllm(argv, maps):
        raise CliError(f"process {pid} runs vLLM, whose model runs in worker processes that nxl attach cannot reach "
                       "or follow: restart it under nxl run (nxl run -- vllm serve MODEL ...)")
    if environ.get("PYTHON_DISABLE_REMOTE_DEBUG") or any("disable_remote_debug" in arg for arg in _options(argv)):
        raise CliError(f"process {pid} disabled remote debugging (PYTHON_DISABLE_REMOTE_DEBUG or -X "
                       "disable_remote_debug): restart it without that to attach, or use nxl run")
    if environ.get("NXL_RUN_DIR"):
        raise CliError(f"process {pid} runs under nxl run already (run folder {environ['NXL_RUN_DIR']}): use "
                       f"nxl ctl --run {environ['NXL_RUN_DIR']}")
    # run only a Python interpreter's file (not a program embedding Python), only one nobody else can change, and
    # only the caller's own process's: root never runs another user's, whose standard library (and libpython) it
    # loads from folders beside it that the file's owner and folders do not vouch for (gdb reads it instead)
    trusted = (trusted_file(executable, frozenset({0, os.geteuid()}))
               if uid == os.geteuid() and _PYTHON.search(os.path.basename(executable)) else None)
    version = _probe(pid, executable, trusted) if trusted else None
    if version is None:  # not run, or it did not answer: gdb takes it, the file names tell the version if any
        trusted, named = None, _VERSION.search(executable) or _VERSION.search(maps)
        version = (3, int(named.group(1))) if named else None
    if version is not None and version < (3, 10):
        raise CliError(f"process {pid} runs Python {version[0]}.{version[1]}: nxl_hooks needs 3.10 or newer")
    target = Target(pid, uid, gid, executable, version, trusted, started)
    if target.route == "gdb" and shutil.which("gdb") is None:
        where = f"Python {version[0]}.{version[1]}" if version else "this process"
        raise CliError(f"gdb is not installed (nxl attach needs it for {where}): apt-get install gdb")
    if target.route == "gdb" and (refusal := gdb_refusal()):
        raise CliError(f"{refusal}; nothing was injected into process {pid}: start the program under nxl run "
                       "instead")
    return target


@functools.lru_cache(maxsize=None)
def gdb_refusal() -> str | None:
    """Why gdb cannot call a function in a process on this machine, or None where it can: asked once per process,
    of a sleeping child of this interpreter, before any target is touched. Where gdb fails such a call half way
    (a kernel that refuses its register writes, as some VMs': "Couldn't write extended state status: Bad
    address"), the process it called into is left broken: its interrupted system call fails (time.sleep raised
    OSError 514 in the program)."""
    child = subprocess.Popen([sys.executable, "-I", "-S", "-c", "import time; time.sleep(120)"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.2)  # (in its sleep by then: the call interrupts it, as it would the target's)
        done = subprocess.run(["gdb", "-p", str(child.pid), "--batch", "-nx", "-q", "-iex", "set auto-load off",
                               "-iex", "set auto-solib-add off", "-ex", "sharedlibrary libc\\.", "-ex",
                               "echo NXL_PROBE\\n", "-ex", "call (int) getpid()"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"gdb could not be asked to call into a process ({error})"
    finally:
        child.kill()
        child.wait()
    said = done.stdout.split("NXL_PROBE", 1)[-1]
    if f"= {child.pid}" in said:
        return None
    reason = " ".join(line.strip() for line in said.splitlines() if line.strip() and "detached]" not in line)
    return f"gdb cannot call a function in a process on this machine ({reason[:300] or 'no output'})"


def bootstrap_source(script: str, target: Target | None = None) -> str:
    """What the target runs first, in its main thread: ``script`` in a fresh namespace, every exception
    swallowed (an exception out of a pending call would surface in the target's own code), and only in ``target``
    itself: the process with its pid, uid and start time (the pid may name another process by the time the
    injector reaches it; then nothing runs)."""
    guard = ""
    if target is not None and target.started is not None:
        guard = (f'if __import__("os").getpid()!={target.pid} or __import__("os").getuid()!={target.uid} or '
                 f'open("/proc/self/stat","rb").read().rsplit(b")",1)[1].split()[19]!=b"{target.started}":'
                 'raise SystemExit\n ')
    return (f'try:\n {guard}__import__("runpy").run_path({script!r},run_name="__nxl_attach__")\n'
            'except BaseException:pass\n')


def script_source(request: str) -> str:
    """The script the bootstrap runs: claim ``request`` (``<request>.taken``), answer at once a refusal that needs
    no import (nothing to detach, no nxl_hooks, no model yet), else hand the work to a daemon thread and return.
    Either writes ``<request>.result`` (0600): :func:`nxl_hooks.apps.serve.remote.handle`'s outcome, or why not.
    In the main thread, where alone Python sets signal handlers, an attach not refused at once puts the control
    endpoint's SIGTERM/SIGHUP handler where the process left their default action (it removes the socket, then dies
    of the signal: docs/security.md; a refusal after the import gives the default back, :mod:`.remote`), and a
    detach gives the default back."""
    return f'''import importlib.util, json, os, signal, sys, threading
REQUEST = {request!r}
TAKEN, RESULT = REQUEST + ".taken", REQUEST + ".result"


def die(signum, frame):
    # the endpoint's own handler once nxl_hooks is imported (before that there is no socket to remove; while the
    # worker thread imports the module, it is in sys.modules before its handler is defined)
    own = getattr(sys.modules.get("nxl_hooks.apps.serve.endpoint"), "_die", None)
    if own is not None:
        return own(signum, frame)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


die.__nxl_attach__ = True  # how a detach tells it from the program's own handler


def report(outcome):
    try:
        fd = os.open(RESULT + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(outcome, fh)
        os.replace(RESULT + ".tmp", RESULT)
    except OSError:  # nxl attach gave up and removed its folder: no one reads it, and the process must not hear of it
        pass


def refusal(request):
    # Nothing is imported into a process that has nothing to detach or no model to attach; these answers are given
    # in the main thread, before an attach sets its signal handler, so a refused attach leaves the process as it was.
    if request["action"] == "detach" and "nxl_hooks.apps.serve.remote" not in sys.modules:
        return {{"ok": False, "code": "not-attached", "error": "not attached by nxl attach (nothing to detach)"}}
    if importlib.util.find_spec("nxl_hooks") is None:  # a path search: nothing imported
        return {{"ok": False, "code": "not-installed", "executable": sys.executable,
                "error": "nxl_hooks is not importable there"}}
    if request["action"] == "attach" and not request.get("wait") and "transformers.modeling_utils" not in sys.modules:
        return {{"ok": False, "code": "no-model", "error": "transformers is not imported: no model to attach yet; "
                "try again once it is, or with --wait SECONDS"}}
    return None


def work(request):
    try:
        try:
            from nxl_hooks.apps.serve.remote import handle
        except BaseException as error:
            return report({{"ok": False, "code": "import", "executable": sys.executable,
                            "error": "nxl_hooks is not importable there (%s: %s)" % (type(error).__name__, error)}})
        report(handle(request, lambda: os.path.exists(TAKEN)))  # gone: nxl attach gave up, removing its folder
    except BaseException as error:
        report({{"ok": False, "code": "failed", "error": "%s: %s" % (type(error).__name__, error)}})


os.rename(REQUEST, TAKEN)  # FileNotFoundError (swallowed by the bootstrap) when nxl attach withdrew it
try:
    with open(TAKEN) as fh:
        REQUEST_BODY = json.load(fh)
    ACTION, REFUSED = REQUEST_BODY["action"], refusal(REQUEST_BODY)
except Exception as error:
    ACTION, REFUSED = None, {{"ok": False, "code": "failed", "error": "%s: %s" % (type(error).__name__, error)}}
for signum in (signal.SIGTERM, signal.SIGHUP):
    if ACTION == "attach" and REFUSED is None and signal.getsignal(signum) == signal.SIG_DFL:
        signal.signal(signum, die)
    elif ACTION == "detach" and getattr(signal.getsignal(signum), "__nxl_attach__", False):
        signal.signal(signum, signal.SIG_DFL)  # also where nothing is attached: an attach refused after its import
if REFUSED is not None:
    report(REFUSED)
else:
    threading.Thread(target=work, args=(REQUEST_BODY,), name="nxl-attach", daemon=True).start()
'''


def injector_command(target: Target, bootstrap: Path) -> list[str]:
    """The command that queues ``bootstrap`` (a file holding :func:`bootstrap_source`) in ``target``: its
    interpreter file (run through :func:`_run_checked`) with ``-I -S``, or gdb."""
    if target.route == "remote_exec":
        return [target.executable, "-I", "-S", "-c", f"import sys; sys.remote_exec({target.pid}, {str(bootstrap)!r})"]
    commands = bootstrap.with_suffix(".gdb")
    commands.write_text(  # symbols of libc and libpython only: libtorch's alone take gdb half a minute
        "sharedlibrary libc\\.\n"
        "sharedlibrary libpython\n"
        "set $nxl_page = (void *) mmap((void *) 0, (unsigned long) %d, 3, 34, -1, (long) 0)\n"
        "if $nxl_page == (void *) -1\n"
        "  printf \"NXL_FAILED mmap\\n\"\n"
        "else\n"
        "  restore %s binary $nxl_page\n"
        "  set $nxl_rc = (int) Py_AddPendingCall((void *) PyRun_SimpleString, $nxl_page)\n"
        "  printf \"NXL_QUEUED %%d\\n\", $nxl_rc\n"
        "end\n"
        "detach\n" % (PAGE, bootstrap))
    # auto-load off and libthread_db from the system's folders only: nothing of the target's files is run by gdb
    settings = ("auto-load off", "libthread-db-search-path $sdir", "auto-solib-add off", "debuginfod enabled off",
                "confirm off", "pagination off", "unwindonsignal on")  # an unknown one is reported, not fatal
    return ["gdb", "-p", str(target.pid), "--batch", "-nx", "-q",
            *(item for setting in settings for item in ("-iex", f"set {setting}")), "-x", str(commands)]


def _tracer(pid: int) -> int:
    """The pid tracing ``pid`` (0: none)."""
    try:
        return int(_status(pid).get("TracerPid", "0") or 0)
    except FileNotFoundError:
        raise CliError(f"process {pid} ended before anything was injected") from None


def _untraced(pid: int, patience: float) -> None:
    """Wait up to ``patience`` s for whatever traces ``pid`` (a concurrent nxl attach or nxl detach, whose gdb
    holds it for about a second; a debugger) to let go; CliError naming it past that."""
    deadline = time.monotonic() + patience
    while tracer := _tracer(pid):
        if time.monotonic() >= deadline:
            try:
                name = _read(f"/proc/{tracer}/comm").decode(errors="replace").strip()
            except OSError:
                name = "gone now"
            raise CliError(f"process {pid} is being traced by process {tracer} ({name}): another nxl attach or "
                           f"nxl detach in progress, or a debugger; try again once it has finished or detached")
        time.sleep(0.05)


def _same(target: Target) -> None:
    """CliError unless ``target.pid`` still names the process inspected (its start time and owner): one that ended
    and whose pid the system gave again is never injected into."""
    if target.started is None:
        return
    try:
        same = _start_time(target.pid) == target.started and int(_status(target.pid)["Uid"].split()[1]) == target.uid
    except (OSError, KeyError, IndexError, ValueError):
        same = False
    if not same:
        raise CliError(f"process {target.pid} ended while nxl attach waited (its pid may name another process now); "
                       "nothing was injected")


def _queue(target: Target, bootstrap: Path, patience: float) -> None:
    """Run the injector once nothing else traces the target (waiting up to ``patience`` s for that); CliError
    saying what failed when the bootstrap was not queued."""
    command = injector_command(target, bootstrap)
    deadline = time.monotonic() + patience
    for attempt in range(3):
        _untraced(target.pid, deadline - time.monotonic())
        _same(target)
        if target.route == "remote_exec":
            process = _run_checked(command[0], target.trusted, command[1:], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        else:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)  # gdb detaches from its inferior when it quits
            output, _ = process.communicate()
            raise CliError(f"{os.path.basename(command[0])} did not finish within 120 s (process {target.pid} "
                           "stuck in the kernel?); nothing was injected") from None
        # another tracer got in between the wait and gdb's attach (a concurrent nxl attach): wait, try again
        if target.route == "remote_exec" or "Operation not permitted" not in output or attempt == 2:
            break
    if target.route == "remote_exec":
        if process.returncode != 0:
            last = (output.strip().splitlines() or ["no output"])[-1]
            raise CliError(f"sys.remote_exec into process {target.pid} failed: {last}")
        return
    if "NXL_QUEUED 0" in output:
        return
    if "Operation not permitted" in output:
        raise CliError(f"gdb may not trace process {target.pid} (ptrace: Operation not permitted): run nxl attach "
                       "as its owner or root, with CAP_SYS_PTRACE, and kernel.yama.ptrace_scope 0 or 1")
    if "No symbol" in output:
        raise CliError(f"process {target.pid}'s Python exports no Py_AddPendingCall / PyRun_SimpleString for gdb "
                       "to call (a static build without its symbols?): use nxl run")
    raise CliError(f"gdb could not queue the script in process {target.pid} ({_gdb_reason(output)}); "
                   "nothing was injected, the process runs on")


def _gdb_reason(output: str) -> str:
    """What gdb said went wrong: its error lines, and the line after "Error in sourced command file:", where gdb
    puts the reason itself (e.g. "Couldn't write extended state status: Bad address." from a kernel that refuses
    its register writes)."""
    lines = output.splitlines()
    said = [line for n, line in enumerate(lines) if "NXL_" in line or "rror" in line
            or (n and lines[n - 1].endswith("Error in sourced command file:"))]
    return " ".join(said)[:300] or "no reason given"


def inject(target: Target, request: dict, *, timeout: float, wait: float = 0.0) -> dict:
    """Carry out ``request`` inside ``target`` (:mod:`.remote`) and return its outcome (``{"ok": ...}``).

    ``timeout``: how long the target's main thread may take to reach Python code and claim the request (a
    thread blocked in a system call does not); past it the request is withdrawn and CliError says so. It also
    bounds the wait for another tracer (a concurrent nxl attach's gdb) to let go first. ``wait``: how long the
    work itself may look for a model, on top of the import of nxl_hooks.

    Both folders are made where only root (or the caller) can replace them (:func:`_private_parent`); the one the
    target's owner gets is then reached through a descriptor only, never its path again (its owner may put a link
    in its place)."""
    parent = _private_parent()
    folder = Path(tempfile.mkdtemp(prefix="nxl-attach-", dir=parent))  # 0700; the target owner's when another's
    private = Path(tempfile.mkdtemp(prefix="nxl-attach-", dir=parent))  # 0700, never handed over: the bootstrap
    above = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    held = os.open(folder.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=above)
    owner = os.geteuid()  # whose the folder is: the target owner's once handed over
    try:
        request_name, result_name = "request.json", "request.json.result"
        request_file, script = folder / request_name, folder / "script.py"
        # root's file, that no one else can change: gdb reads it; sys.remote_exec makes the target read it (so
        # then readable, in a folder it may pass through)
        bootstrap = private / "bootstrap.py"
        for name, text in ((request_name, json.dumps(request)), ("script.py", script_source(str(request_file)))):
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=held)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
        fd = os.open(bootstrap, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(bootstrap_source(str(script), target))
        if len(bootstrap.read_bytes()) >= PAGE:
            raise CliError(f"the path {folder} is too long for the bootstrap; set TMPDIR to a shorter folder")
        if target.route == "remote_exec":
            os.chmod(private, 0o711)
            os.chmod(bootstrap, 0o644)
        if target.uid != os.geteuid():  # root attaching to another user's process: theirs to read
            # the files first, the folder last: once it is theirs they could put a link where a file was
            for name in (request_name, "script.py"):
                os.chown(name, target.uid, target.gid, dir_fd=held, follow_symlinks=False)
            os.fchown(held, target.uid, target.gid)
            owner = target.uid
        _queue(target, bootstrap, timeout)
        deadline = time.monotonic() + timeout
        while _there(held, request_name):
            if time.monotonic() > deadline:
                try:
                    os.unlink(request_name, dir_fd=held)  # withdrawn: the script finds no request if it ever runs
                except FileNotFoundError:
                    break  # claimed just now
                raise CliError(f"process {target.pid} did not run the request within {timeout:g} s: its main thread "
                               "has not run Python code since (blocked in a system call or a C extension?); the "
                               "request was withdrawn, nothing changed. Try again with a longer --timeout")
            time.sleep(0.02)
        patience = wait + max(timeout, 120.0)
        deadline = time.monotonic() + patience
        while not _there(held, result_name):
            if time.monotonic() > deadline:
                raise CliError(f"process {target.pid} took the request but gave no answer within {patience:.0f} s; "
                               "check it with nxl ctl status, or its stderr")
            if not Path(f"/proc/{target.pid}").exists():
                raise CliError(f"process {target.pid} ended before it answered")
            time.sleep(0.02)
        return _answer(held, result_name)
    finally:
        os.close(held)
        remove_as(above, folder.name, owner)  # its path may lead to a folder its owner put there meanwhile
        os.close(above)
        shutil.rmtree(private, ignore_errors=True)


def remove_as(parent: int, name: str, uid: int) -> None:
    """Remove folder ``name`` of the folder open as ``parent``, with what it holds, as far as user ``uid`` could
    remove it: how root takes back a folder it handed to ``uid``. That user may have moved anything there meanwhile
    (a folder of theirs holding root's files, or another folder at ``name`` itself, in sticky ``/tmp``); a removal
    by path (rmtree) would take it all. Here a folder is emptied only when ``uid`` owns it (opened without
    following a link, which it cannot then change: only root gives files away), what else a folder of theirs holds
    is unlinked (never followed), and anything that stays is left as it is, silently: it is the user's."""
    _remove_as(parent, name, uid, _DEPTH)


def _remove_as(parent: int, name: str, uid: int, depth: int) -> None:
    try:  # O_NONBLOCK: a FIFO is not waited on (O_DIRECTORY refuses it anyway)
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=parent)
    except OSError as error:
        if error.errno not in (errno.ENOTDIR, errno.ELOOP) or depth == _DEPTH:
            return  # (a file where the folder was: not root's to judge, in a folder that is not the user's)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=parent)  # a file or link in a folder of uid's: they could remove it too
        return
    try:
        if os.fstat(fd).st_uid != uid or not depth:
            return
        for each in os.listdir(fd):
            _remove_as(fd, each, uid, depth - 1)
    except OSError:
        return
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):  # not empty: what stays is the user's
        os.rmdir(name, dir_fd=parent)


def _private_parent() -> str:
    """Where nxl attach makes its folders: the temporary folder, when it and every folder above it are root's (or
    the caller's) and nobody else can replace what they hold (or they are sticky), else ``/tmp`` if that is so; a
    folder another user could rename would let them swap the bootstrap root's gdb runs."""
    from .runs import check_parents

    for candidate in dict.fromkeys((tempfile.gettempdir(), "/tmp")):
        try:
            check_parents(Path(candidate) / "nxl-attach")
            return candidate
        except OSError:
            continue
    raise CliError("no temporary folder that only root and you can change (TMPDIR and /tmp are writable by "
                   "others without a sticky bit, or belong to another user): set TMPDIR to a private folder")


def _there(folder: int, name: str) -> bool:
    """Whether ``name`` is in the folder open as ``folder`` (not followed through a link)."""
    try:
        os.stat(name, dir_fd=folder, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _answer(folder: int, name: str) -> dict:
    """The target's answer: a small regular file of the folder open as ``folder``, not followed through a link
    (the folder may be the target owner's, and this may run as root)."""
    try:
        answer = json_value(read_regular(name, follow_symlinks=False, max_bytes=1 << 20, dir_fd=folder))
        if not isinstance(answer, dict):
            raise ValueError("not a JSON object")
        return answer
    except (OSError, ValueError) as error:
        raise CliError(f"the answer of the attached process could not be read ({error}); see nxl ctl status") from None
