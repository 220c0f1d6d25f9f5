"""Child programs of the tests that would each start a Python and import torch first: run instead, each in a fresh
fork of one interpreter that imported what they all import once (torch: seconds of CPU per start saved).

    with Programs("import torch") as programs:
        done = programs.run(CODE, ["arg"], out=tmp_path / "prog")   # CompletedProcess: returncode, stdout, stderr

Each program runs as ``python -c CODE ARGS`` would, in its own process (a fork made for it alone, nothing of an
earlier program in it): ``sys.argv`` is ``["-c", *ARGS]``, ``__name__`` is ``"__main__"``, an uncaught exception
is printed by Python and exits 1, ``sys.exit`` and interpreter exit (atexit, threads joined) are Python's own.
``hidden`` modules are made absent the way Python knows a module to be (``sys.modules[name] = None``) before the
program runs; the prelude must not import them (the caller checks what it needs)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

_SERVER = """
import json, os, sys
exec(sys.argv[1])  # the prelude: what every program imports
for line in sys.stdin:
    code, argv, hidden, out = json.loads(line)
    pid = os.fork()
    if pid == 0:
        break  # the child: runs the program below, as python -c would
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
else:
    sys.exit(0)  # the caller is done
for fd, name in ((1, "out"), (2, "err")):
    os.dup2(os.open(f"{out}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
for name in hidden:
    sys.modules[name] = None
sys.argv = ["-c", *argv]
exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


class Programs:
    """The interpreter that forks a process per program; ``env`` is every program's environment."""

    def __init__(self, prelude: str, *, env: dict | None = None) -> None:
        self.server = subprocess.Popen([sys.executable, "-c", _SERVER, prelude], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)

    def run(self, code: str, argv: list[str], *, out: Path, hidden: list[str] = (), timeout: float = 300
            ) -> subprocess.CompletedProcess:
        """``python -c code *argv`` (``hidden`` modules absent): its exit code, stdout and stderr (kept in
        ``out``.out / ``out``.err). Past ``timeout`` the interpreter and the program are killed, TimeoutError."""
        self.server.stdin.write(json.dumps([code, [str(a) for a in argv], list(hidden), str(out)]) + "\n")
        self.server.stdin.flush()
        if not select.select([self.server.stdout], [], [], timeout)[0]:
            self.close(kill=True)
            raise TimeoutError(f"a program did not end within {timeout} s")
        status = self.server.stdout.readline()
        assert status, f"the programs' interpreter exited with {self.server.poll()}"
        out_text, err_text = (Path(f"{out}.{name}").read_text(errors="replace") for name in ("out", "err"))
        return subprocess.CompletedProcess(["python", "-c", code, *argv], int(status), out_text, err_text)

    def close(self, kill: bool = False) -> None:
        if self.server.poll() is None and not kill:
            self.server.stdin.close()
            try:
                self.server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill = True
        if kill and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGKILL)  # (its session: a program still running too)
            self.server.wait()

    def __enter__(self) -> "Programs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
