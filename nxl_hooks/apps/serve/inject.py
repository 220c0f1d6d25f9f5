"""Run a few lines of Python inside another, already running Python process: how ``nxl attach PID`` and ``nxl detach
PID`` reach it. Standard library only; the side of it that runs in the target is :mod:`.remote`.

    target = inspect_target(pid)                     # CliError, one line, for each refusal (module docstring)
    outcome = inject(target, {"action": "attach", "env": settings.to_env(), "wait": 0.0}, timeout=30)

The route. Python 3.14 and newer: ``sys.remote_exec(pid, script)`` (PEP 768), run by the target's own interpreter
(its version must match the target's). Python 3.10 to 3.13: ``gdb -p PID`` in batch mode, as memray and pyrasite
do, but it runs no Python itself: it maps one anonymous page in the target, writes the two-line bootstrap there,
queues ``PyRun_SimpleString(page)`` with ``Py_AddPendingCall`` and detaches (about 0.3 s with the process
stopped). The interpreter runs pending calls in its main thread, with the GIL, between two bytecodes, the way it
runs Python signal handlers; that is the same safe point ``sys.remote_exec`` uses. The page (4 KiB) stays mapped.

The bootstrap runs :func:`script_source`'s script in a fresh namespace (nothing lands in ``__main__``) and
swallows every exception, so nothing can raise into the target. The script claims the request (an atomic
rename: a request ``nxl attach`` withdrew after its timeout is never carried out), starts one short-lived daemon
thread, and returns; the thread imports nxl_hooks *from the target's own environment*, does the work
(:func:`nxl_hooks.apps.serve.remote.handle`) and writes the outcome to a 0600 result file that :func:`inject`
waits for. The request (the run's settings as ``NXL_*`` values) goes through a 0600 file in a 0700 folder, never
on a command line.

Refusals, each one line before anything is injected: no such process; another user's process (only its owner or
root); tracing not allowed (``kernel.yama.ptrace_scope``, no ``CAP_SYS_PTRACE``); another mount namespace (a
container: the files would not be where the target looks); not a Python process; a Python older than 3.10;
remote debugging disabled in the target (``PYTHON_DISABLE_REMOTE_DEBUG``, ``-X disable_remote_debug``); a process
under ``nxl run`` already; being traced by another debugger; nxl_hooks not importable by the target's interpreter
(the ``pip install`` line named); gdb missing (``apt-get install gdb``); a vLLM process (its model runs in
worker processes: ``nxl run`` records those).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ...records.files import read_regular
from ..options import CliError

__all__ = ["Target", "bootstrap_source", "inject", "injector_command", "inspect_target", "permission_refusal",
           "script_source"]

PAGE = 4096  #: the bytes gdb maps in the target for the bootstrap (it must fit, with its final NUL)
CAP_SYS_PTRACE = 19  #: its bit in /proc/PID/status CapEff
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?[a-z]*$")
#: Interpreter options that change what the interpreter imports (kept for the importability check).
_FLAG_WITH_VALUE = ("-X", "-W")


@dataclass(frozen=True)
class Target:
    """A running Python process, as ``nxl attach`` sees it from outside."""

    pid: int
    uid: int
    gid: int
    executable: str  #: the interpreter's file (/proc/PID/exe)
    interpreter: list[str]  #: how to start the same interpreter in the same environment: path + its options
    environ: dict[str, str]
    cwd: str
    version: tuple[int, int] = (0, 0)
    nxl_hooks: str | None = None  #: where the target's interpreter finds nxl_hooks, or None

    @property
    def route(self) -> str:
        """``"remote_exec"`` (Python 3.14+) or ``"gdb"``."""
        return "remote_exec" if self.version >= (3, 14) else "gdb"


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


def _interpreter(executable: str, argv: list[str], environ: dict[str, str], cwd: str) -> tuple[list[str], str]:
    """The target's interpreter as it was started (its argv[0], which decides its virtual environment, when that
    is the same file as its executable) with the options that change its imports, and the folder its
    ``sys.path[0]`` names (a script's own folder, else the working folder)."""
    first = argv[0] if argv else ""
    found = first if "/" in first else shutil.which(first, path=environ.get("PATH", os.defpath)) if first else None
    path = os.path.join(cwd, found) if found else None
    same = path is not None and os.path.exists(path) and os.path.realpath(path) == os.path.realpath(executable)
    flags: list[str] = []
    home, rest = cwd, iter(argv[1:])
    for arg in rest:
        if not arg.startswith("-") or arg in ("-", "-c", "-m") or arg.startswith(("-c", "-m")):
            if not arg.startswith("-"):
                home = os.path.dirname(os.path.realpath(os.path.join(cwd, arg)))
            break
        flags.append(arg)
        if arg in _FLAG_WITH_VALUE:
            flags.append(next(rest, ""))
    return [path if same else executable, *flags], home


_CHECK = ("import importlib.util, json, sys; spec = importlib.util.find_spec('nxl_hooks'); "
          "print(json.dumps({'version': sys.version_info[:2], 'executable': sys.executable, "
          "'nxl_hooks': spec and (spec.origin or list(spec.submodule_search_locations or []))}))")


def _is_vllm(argv: list[str], maps: str) -> bool:
    """Whether a process runs vLLM: its compiled ops are mapped (an engine or worker process), or it was started as
    vLLM's command line (its API server)."""
    return "/vllm/_C" in maps or any(os.path.basename(arg) in ("vllm", "vllm_main.py") or
                                     arg.startswith("vllm.entrypoints") for arg in argv[:3])


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
        cwd = os.readlink(f"{proc}/cwd")
        same_root = os.stat(f"{proc}/root") == os.stat("/")
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
    interpreter, home = _interpreter(executable, argv, environ, cwd)
    if environ.get("PYTHON_DISABLE_REMOTE_DEBUG") or "disable_remote_debug" in " ".join(interpreter[1:]):
        raise CliError(f"process {pid} disabled remote debugging (PYTHON_DISABLE_REMOTE_DEBUG or -X "
                       "disable_remote_debug): restart it without that to attach, or use nxl run")
    if environ.get("NXL_RUN_DIR"):
        raise CliError(f"process {pid} runs under nxl run already (run folder {environ['NXL_RUN_DIR']}): use "
                       f"nxl ctl --run {environ['NXL_RUN_DIR']}")
    tracer = int(status.get("TracerPid", "0") or 0)
    if tracer:
        raise CliError(f"process {pid} is being traced by process {tracer} (a debugger): detach that first")
    found = _check_interpreter(pid, interpreter, environ, home, uid, gid)
    version = tuple(found["version"])
    if version < (3, 10):
        raise CliError(f"process {pid} runs Python {version[0]}.{version[1]}: nxl_hooks needs 3.10 or newer")
    target = Target(pid, uid, gid, executable, interpreter, environ, cwd, version, found["nxl_hooks"])
    if not target.nxl_hooks:
        raise CliError(f"nxl_hooks is not importable by process {pid}'s interpreter {found['executable']}: install "
                       f"it there ({found['executable']} -m pip install nxl_hooks), then attach again")
    if target.route == "gdb" and shutil.which("gdb") is None:
        raise CliError(f"gdb is not installed (nxl attach needs it for Python {version[0]}.{version[1]}): "
                       "apt-get install gdb")
    if target.route == "remote_exec" and uid != os.geteuid():
        _check_trusted(pid, target.interpreter[0])
    return target


def _check_trusted(pid: int, interpreter: str) -> None:
    """On Python 3.14+ the injector is the target's own interpreter; for another user's process (nxl attach as
    root) it runs only if that file is root's and nobody else may change it."""
    try:
        info = os.stat(os.path.realpath(shutil.which(interpreter) or interpreter))
    except OSError:
        info = None
    if info is None or info.st_uid != 0 or info.st_mode & 0o022:
        raise CliError(f"process {pid}'s interpreter {interpreter} is not root's own file (owned by root, writable "
                       "by nobody else): root will not run it to inject; attach as the process's own user")


def _check_interpreter(pid: int, interpreter: list[str], environ: dict[str, str], home: str, uid: int,
                       gid: int) -> dict:
    """Run the target's interpreter, as its user, in its environment and from the folder of its ``sys.path[0]``,
    to ask its version and where it finds nxl_hooks (``find_spec``: importing nxl_hooks would import torch,
    seconds for nothing; the import inside the target is the final word)."""
    other = uid != os.geteuid()
    try:
        done = subprocess.run([*interpreter, "-c", _CHECK], env=environ, cwd=home, capture_output=True, text=True,
                              timeout=60, user=uid if other else None, group=gid if other else None,
                              extra_groups=[] if other else None)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError):
        raise CliError(f"process {pid}: its interpreter {interpreter[0]} could not be run to check it "
                       "(is it still installed?)") from None


def bootstrap_source(script: str) -> str:
    """What the target runs first, in its main thread: ``script`` in a fresh namespace, every exception
    swallowed (an exception out of a pending call would surface in the target's own code)."""
    return f'try:__import__("runpy").run_path({script!r},run_name="__nxl_attach__")\nexcept BaseException:pass\n'


def script_source(request: str) -> str:
    """The script the bootstrap runs: claim ``request`` (``<request>.taken``), hand the work to a daemon thread,
    return. The thread writes ``<request>.result`` (0600): :func:`nxl_hooks.apps.serve.remote.handle`'s outcome,
    or why nxl_hooks did not import."""
    return f'''import json, os, sys, threading
REQUEST = {request!r}
TAKEN, RESULT = REQUEST + ".taken", REQUEST + ".result"


def report(outcome):
    fd = os.open(RESULT + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(outcome, fh)
    os.replace(RESULT + ".tmp", RESULT)


def work():
    try:
        with open(TAKEN) as fh:
            request = json.load(fh)
        # Nothing is imported into a process that has nothing to detach or no model to attach.
        if request["action"] == "detach" and "nxl_hooks.apps.serve.remote" not in sys.modules:
            return report({{"ok": False, "code": "not-attached",
                            "error": "process %d is not attached by nxl attach" % os.getpid()}})
        if (request["action"] == "attach" and not request.get("wait")
                and "transformers.modeling_utils" not in sys.modules):
            return report({{"ok": False, "code": "no-model", "error": "transformers is not imported in process %d: "
                            "no model to attach yet; try again once it is, or with --wait SECONDS" % os.getpid()}})
        try:
            from nxl_hooks.apps.serve.remote import handle
        except BaseException as error:
            return report({{"ok": False, "code": "import", "executable": sys.executable,
                            "error": "nxl_hooks is not importable in process %d (%s: %s)"
                                     % (os.getpid(), type(error).__name__, error)}})
        report(handle(request))
    except BaseException as error:
        report({{"ok": False, "code": "failed", "error": "%s: %s" % (type(error).__name__, error)}})


os.rename(REQUEST, TAKEN)  # FileNotFoundError (swallowed by the bootstrap) when nxl attach withdrew it
threading.Thread(target=work, name="nxl-attach", daemon=True).start()
'''


def injector_command(target: Target, bootstrap: Path) -> list[str]:
    """The command that queues ``bootstrap`` (a file holding :func:`bootstrap_source`) in ``target``."""
    if target.route == "remote_exec":
        return [*target.interpreter[:1], "-I", "-S", "-c",
                f"import sys; sys.remote_exec({target.pid}, {str(bootstrap)!r})"]
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
    settings = ("auto-load off", "auto-solib-add off", "debuginfod enabled off", "confirm off", "pagination off",
                "unwindonsignal on")  # an unknown one (debuginfod on an older gdb) is reported, not fatal
    return ["gdb", "-p", str(target.pid), "--batch", "-nx", "-q",
            *(item for setting in settings for item in ("-iex", f"set {setting}")), "-x", str(commands)]


def _queue(target: Target, bootstrap: Path) -> None:
    """Run the injector; CliError saying what failed when the bootstrap was not queued."""
    command = injector_command(target, bootstrap)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # gdb detaches from its inferior when it quits
        output, _ = process.communicate()
        raise CliError(f"{command[0]} did not finish within 120 s (process {target.pid} stuck in the kernel?); "
                       "nothing was injected") from None
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
    detail = " ".join(line for line in output.splitlines() if "NXL_" in line or "rror" in line)[:300]
    raise CliError(f"gdb could not queue the script in process {target.pid} ({detail or 'no reason given'}); "
                   "nothing was injected, the process runs on")


def inject(target: Target, request: dict, *, timeout: float, wait: float = 0.0) -> dict:
    """Carry out ``request`` inside ``target`` (:mod:`.remote`) and return its outcome (``{"ok": ...}``).

    ``timeout``: how long the target's main thread may take to reach Python code and claim the request (a
    thread blocked in a system call does not); past it the request is withdrawn and CliError says so. ``wait``:
    how long the work itself may look for a model, on top of the import of nxl_hooks."""
    folder = Path(tempfile.mkdtemp(prefix="nxl-attach-"))  # 0700; the target's own when it is another user's
    private = Path(tempfile.mkdtemp(prefix="nxl-attach-"))  # 0700, never handed over: what gdb (root) reads
    try:
        request_file, script = folder / "request.json", folder / "script.py"
        # sys.remote_exec makes the target read the bootstrap itself; gdb reads it, so it stays out of the
        # target owner's reach (a file they could swap or link elsewhere would be read, or run, by root)
        bootstrap = (folder if target.route == "remote_exec" else private) / "bootstrap.py"
        for path, text in ((request_file, json.dumps(request)), (script, script_source(str(request_file))),
                           (bootstrap, bootstrap_source(str(script)))):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
        if len(bootstrap.read_bytes()) >= PAGE:
            raise CliError(f"the path {folder} is too long for the bootstrap; set TMPDIR to a shorter folder")
        if target.uid != os.geteuid():  # root attaching to another user's process: theirs to read
            for path in (folder, *folder.iterdir()):
                os.chown(path, target.uid, target.gid)
        _queue(target, bootstrap)
        deadline = time.monotonic() + timeout
        while request_file.exists():
            if time.monotonic() > deadline:
                try:
                    request_file.unlink()  # withdrawn: the script finds no request if it ever runs
                except FileNotFoundError:
                    break  # claimed just now
                raise CliError(f"process {target.pid} did not run the request within {timeout:g} s: its main thread "
                               "has not run Python code since (blocked in a system call or a C extension?); the "
                               "request was withdrawn, nothing changed. Try again with a longer --timeout")
            time.sleep(0.02)
        result, patience = folder / "request.json.result", wait + max(timeout, 120.0)
        deadline = time.monotonic() + patience
        while not result.exists():
            if time.monotonic() > deadline:
                raise CliError(f"process {target.pid} took the request but gave no answer within {patience:.0f} s; "
                               "check it with nxl ctl status, or its stderr")
            if not Path(f"/proc/{target.pid}").exists():
                raise CliError(f"process {target.pid} ended before it answered")
            time.sleep(0.02)
        return _answer(result)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def _answer(path: Path) -> dict:
    """The target's answer: a small regular file, not followed through a link (the folder may be the target
    owner's, and this may run as root)."""
    try:
        answer = json.loads(read_regular(path, follow_symlinks=False, max_bytes=1 << 20))
        if not isinstance(answer, dict):
            raise ValueError("not a JSON object")
        return answer
    except (OSError, ValueError) as error:
        raise CliError(f"the answer of the attached process could not be read ({error}); see nxl ctl status") from None
