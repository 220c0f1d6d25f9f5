"""The control endpoint under abuse (issue 19, items 5-7) and the run that ``nxl tail`` / ``nxl ctl`` choose
without ``--run`` (issue 18, item 5).

Each test starts real ``nxl run`` programs (a script that loads a tiny model, records one generate, then waits)
on 127.0.0.1, with their own temporary folder (TMPDIR), and stops them by PID. Run folder and token rules need
a second uid: they run as root (as CI does) and use uid 65534 (nobody); as another user they are skipped.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from nxl_hooks.apps.cli import main as cli_main
from nxl_hooks.apps.serve.client import Endpoint, connect_unix
from nxl_hooks.apps.serve.endpoint import MAX_BODY, MAX_CONNECTIONS, REQUEST_SECONDS
from nxl_hooks.apps.serve.runs import read_token
from serving import free_port, save_chat_model
from test_serve import _refused_in_process

NXL = [sys.executable, "-m", "nxl_hooks"]
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make files of another uid (65534)")

PROGRAM = """
import os, signal, sys, time
import torch
from transformers import AutoModelForCausalLM
if os.environ.get("OWN_SIGTERM"):  # the program's own handler: nxl must leave it in charge
    signal.signal(signal.SIGTERM, lambda *_: (print("OWN HANDLER", flush=True), sys.exit(3)))
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
with torch.no_grad():
    model.generate(input_ids=torch.tensor([[1, 64, 67]]), max_new_tokens=2, do_sample=False)
print("READY", flush=True)
while True:
    time.sleep(0.1)
"""


class Held:
    """``nxl run [--listen] --sink RUN -- python PROGRAM MODEL``: a program holding a recorded model until
    stopped; ready once its Unix socket answers."""

    def __init__(self, model: Path, run: Path, tmpdir: Path, *, listen: bool = False, env: dict | None = None):
        self.run, self.listen = run, f"127.0.0.1:{free_port()}" if listen else None
        script = tmpdir / "program.py"
        script.write_text(PROGRAM)
        command = [*NXL, "run", "--sink", str(run), *(["--listen", self.listen] if listen else []), "--",
                   sys.executable, str(script), str(model)]
        self.log = run.parent / f"{run.name}.log"
        self.process = subprocess.Popen(
            command, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})})

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def socket(self) -> Path:
        return self.run.resolve() / f"{self.pid}.sock"

    def wait_ready(self, timeout: float = 240) -> "Held":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text(errors="replace")[-3000:]
            if "READY" in self.log.read_text(errors="replace") and self.socket.is_socket():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(self.log.read_text(errors="replace")[-3000:])

    def status(self) -> dict:
        return Endpoint(socket_path=self.socket).json("GET", "/v1/status", timeout=10)

    def token(self) -> str:
        return (self.run / "token").read_text().strip()

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.process.poll() is None:
            os.kill(self.pid, sig)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        return self.process.returncode


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def held(model, tmp_path_factory):
    """One program under ``nxl run --listen`` for the module's endpoint tests."""
    base = tmp_path_factory.mktemp("held")
    (base / "tmp").mkdir()
    program = Held(model, base / "run", base / "tmp", listen=True)
    try:
        yield program.wait_ready()
    finally:
        program.stop()


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli_main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _connect(address: str | Path, timeout: float) -> socket.socket:
    """A connection to the endpoint at ``address``: TCP ``host:port`` or a Unix socket path."""
    if isinstance(address, Path):
        return connect_unix(address, timeout)
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def _raw(address: str | Path, data: bytes, *, half_close: bool = True, timeout: float = 20) -> tuple[int, dict, bytes]:
    """One raw exchange (TCP ``host:port`` or a Unix socket path): (status, headers, body) of the answer."""
    sock = _connect(address, timeout)
    with sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


def _request(method: str, path: str, token: str | None, *, body: bytes | None = None, headers: str = "") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    length = f"Content-Length: {len(body)}\r\n" if body is not None and "Content-Length" not in headers else ""
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}{length}{headers}\r\n".encode() + (body or b"")


INTERNALS = ("Traceback", "Error:", "IndexError", "AttributeError", "RecursionError", "KeyError", "TypeError",
             'File "', "line ")


def _assert_json_error(status: int, headers: dict, body: bytes, expected: int, case: str = "") -> str:
    assert status == expected, (case, body)
    assert headers.get("Content-Type") == "application/json"
    value = json.loads(body)
    assert set(value) == {"error"} and isinstance(value["error"], str) and value["error"]
    assert not any(word in value["error"] for word in INTERNALS), value["error"]
    return value["error"]


def _wait_closed(sock: socket.socket, timeout: float) -> float | None:
    """Seconds until the endpoint closed ``sock`` (EOF or reset), None if it was still open after ``timeout``."""
    start = time.monotonic()
    while (left := timeout - (time.monotonic() - start)) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if readable:
            try:
                if not sock.recv(4096):
                    return time.monotonic() - start
            except OSError:
                return time.monotonic() - start
    return None


# -- A: bounded connections, timeouts, JSON errors ---------------------------------------------------------------

def test_idle_connections_are_bounded_closed_and_never_starve_the_owner(held):
    process, port = psutil.Process(held.pid), int(held.listen.rsplit(":", 1)[1])
    threads, files = process.num_threads(), process.num_fds()
    flood = []
    try:
        for index in range(300):  # another local user without the token, sending nothing
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            flood.append(sock)
            if index % 25 == 24:
                time.sleep(0.05)  # paced within the kernel's accept backlog: beyond it, connections hang unaccepted
        time.sleep(1.5)
        assert process.num_threads() <= threads + MAX_CONNECTIONS
        assert process.num_fds() <= files + MAX_CONNECTIONS + 2
        served = [c for c in process.net_connections("tcp") if c.laddr.port == port and c.status == "ESTABLISHED"]
        assert len(served) <= MAX_CONNECTIONS
        start = time.monotonic()  # the owner's Unix socket answers at once, whatever the TCP port carries
        assert held.status()["pid"] == held.pid and time.monotonic() - start < 3
        status, headers, body = _raw(held.listen, b"", half_close=False)  # over the bound: refused, not queued
        assert "already" in _assert_json_error(status, headers, body, 503)
        deadline = time.monotonic() + 60
        for sock in flood:  # every connection that sent nothing is closed by the endpoint, sooner or later
            sock.setblocking(True)
            assert _wait_closed(sock, max(deadline - time.monotonic(), 0.1)) is not None
    finally:
        for sock in flood:
            sock.close()
    deadline = time.monotonic() + 10
    while process.num_threads() > threads and time.monotonic() < deadline:
        time.sleep(0.2)
    assert process.num_threads() <= threads
    status, _, body = _raw(held.listen, _request("GET", "/v1/status", held.token()))
    assert status == 200 and json.loads(body)["pid"] == held.pid

    with socket.create_connection(("127.0.0.1", port)) as quiet:  # one idle connection alone: closed in time
        waited = _wait_closed(quiet, REQUEST_SECONDS + 5)
        assert waited is not None and REQUEST_SECONDS - 0.5 <= waited <= REQUEST_SECONDS + 3
    with socket.create_connection(("127.0.0.1", port)) as drip:
        start = time.monotonic()  # a byte a second keeps no connection past the request's deadline
        for byte in b"GET /v1/status HTTP/1.1\r\nX-Slow: " + b"a" * 100:
            try:
                drip.send(bytes([byte]))
            except OSError:
                break
            if _wait_closed(drip, 1.0) is not None:
                break
        assert time.monotonic() - start <= REQUEST_SECONDS + 3
    assert held.process.poll() is None


@pytest.fixture(params=["unix", "tcp"])
def in_process(request, tmp_path):
    """This process's own endpoint, as a model's adoption starts it: (endpoint, the listener a test talks to, its
    address, its token: None on the Unix socket)."""
    from nxl_hooks.apps.serve.controller import Controller
    from nxl_hooks.apps.serve.runs import make_run_dir, write_token
    from nxl_hooks.apps.serve.settings import Settings

    run = make_run_dir(tmp_path / "run")
    token = write_token(run)
    controller = Controller(Settings(run_dir=run, listen="127.0.0.1:0"))
    controller._ensure_endpoint()
    server = controller.endpoint
    try:
        if request.param == "unix":
            yield server, server._servers[0], server.socket, None
        else:
            yield server, server._servers[1], "127.0.0.1:%d" % server.address[1], token
    finally:
        controller.close()


def test_a_listen_port_the_system_picks_is_said_in_one_line(tmp_path, caplog):
    """``--listen 127.0.0.1:0`` served on a port that only nxl ctl status named, which needs the address to ask."""
    from nxl_hooks.apps.serve.controller import Controller
    from nxl_hooks.apps.serve.runs import make_run_dir, write_token
    from nxl_hooks.apps.serve.settings import Settings

    run = make_run_dir(tmp_path / "run")
    write_token(run)
    controller = Controller(Settings(run_dir=run, listen="127.0.0.1:0"))
    try:
        with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
            controller._ensure_endpoint()
        port = controller.endpoint.address[1]
        said = [r.getMessage() for r in caplog.records if "serves HTTP control" in r.getMessage()]
        assert port != 0 and said == [f"nxl_hooks: process {os.getpid()} serves HTTP control on "
                                      f"http://127.0.0.1:{port} (--listen 127.0.0.1:0)"]
        with socket.create_connection(("127.0.0.1", port), timeout=10):  # the port said is the one served
            pass
    finally:
        controller.close()


@pytest.mark.parametrize("below", [False, True])
def test_a_run_folder_that_is_or_is_below_a_file_is_named_in_the_endpoints_line(tmp_path, caplog, below):
    """NXL_RUN_DIR naming a file: the line said only "FileExistsError: [Errno 17] File exists: ..."; below a file,
    "NotADirectoryError: [Errno 20] Not a directory: ...". Each names the file in the way, which stays as it was."""
    from nxl_hooks.apps.serve.controller import Controller
    from nxl_hooks.apps.serve.settings import Settings

    (tmp_path / "file").write_text("")
    run = tmp_path / "file" / "run" if below else tmp_path / "file"
    controller = Controller(Settings(run_dir=run))
    try:
        with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
            controller._ensure_endpoint()
    finally:
        controller.close()
    why = f"is below {tmp_path / 'file'}, a file, not a folder" if below else "is a file"
    assert controller.endpoint is None and [r.getMessage() for r in caplog.records] == [
        f"nxl_hooks: no control endpoint in process {os.getpid()} (NotADirectoryError: the run folder "
        f"{run} (NXL_RUN_DIR) {why}: give a folder, or leave NXL_RUN_DIR unset); records are kept all the same"]
    assert (tmp_path / "file").read_text() == ""


def _open_stream(address: str | Path, token: str | None) -> tuple[socket.socket, int, bytes]:
    """A reader of /v1/stream that stays connected: its connection, the answer's status and (when refused) its
    body."""
    sock = _connect(address, 10)
    sock.sendall(_request("GET", "/v1/stream", token).replace(b"HTTP/1.1", b"HTTP/1.0"))
    answer = b""
    while b"\r\n\r\n" not in answer and (chunk := sock.recv(4096)):
        answer += chunk
    status = int(answer.split()[1])
    if status != 200:  # a refusal ends with the connection
        while chunk := sock.recv(4096):
            answer += chunk
    return sock, status, answer.partition(b"\r\n\r\n")[2]


def test_stream_readers_never_take_the_connections_status_and_ctl_need(in_process):
    """Each open /v1/stream held one of the listener's MAX_CONNECTIONS connections: sixteen readers (a dashboard
    reconnecting, sixteen nxl tail) locked status and nxl ctl pause/detach out with a 503. Streams now stop short
    of the bound, the one over it refused in a line that says how many readers are connected."""
    server, _, address, token = in_process
    readers: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock, status, body = _open_stream(address, token)
            readers.append(sock)
            if status != 200:
                break
        for _ in range(MAX_CONNECTIONS):  # status and a control action get in, however many readers stay
            status, _, body = _raw(address, _request("GET", "/v1/status", token))
            assert status == 200 and json.loads(body)["pid"] == os.getpid(), body
        status, _, body = _raw(address, _request("POST", "/v1/control", token, body=b'{"action": "pause"}'))
        assert status == 200 and json.loads(body)["paused"] is True, body
        served = len(readers) - 1
        refused, _, body = _open_stream(address, token)
        refused.close()
        error = json.loads(body)["error"]
        assert served < MAX_CONNECTIONS and f"{served} readers are connected to /v1/stream already" in error, error
        assert "close one, or try again shortly" in error
    finally:
        for sock in readers:
            sock.close()


def test_a_stream_whose_reader_left_frees_its_connection_at_once(in_process):
    """A reader that closed its stream held its connection until a write to it failed: the keepalive, KEEPALIVE
    (10 s) later on an idle process, so readers reconnecting more than 1.6 times a second kept every connection
    taken. The end of its input is noticed within a poll of the stream's feed now."""
    from nxl_hooks.apps.serve.endpoint import KEEPALIVE

    _, listener, address, token = in_process
    for _ in range(MAX_CONNECTIONS + 4):
        sock, status, _ = _open_stream(address, token)
        sock.close()
        assert status == 200
        with listener.streams_changed:  # well before a keepalive would find it gone
            assert listener.streams_changed.wait_for(lambda: listener.streams == 0, timeout=KEEPALIVE / 2)
    status, _, body = _raw(address, _request("GET", "/v1/status", token))
    assert status == 200 and json.loads(body)["pid"] == os.getpid()


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_listen_on_the_ipv6_loopback_serves_http(tmp_path, caplog):
    """--listen [::1]:PORT is a loopback address docs/security.md allows: it was accepted, its token written, but
    the HTTP server was AF_INET only, so nothing was ever served (a warning in the program's log the only sign)."""
    from nxl_hooks.apps.serve.controller import Controller
    from nxl_hooks.apps.serve.runs import make_run_dir, write_token
    from nxl_hooks.apps.serve.settings import Settings

    run = make_run_dir(tmp_path / "run")
    token = write_token(run)
    controller = Controller(Settings(run_dir=run, listen="[::1]:0"))
    controller._ensure_endpoint()  # as a model's adoption does
    server = controller.endpoint
    try:
        assert server.address is not None and server.address[0] == "::1", caplog.text
        address = f"[::1]:{server.address[1]}"
        status = Endpoint(url=f"http://{address}", token=token).json("GET", "/v1/status", timeout=10)
        assert status["pid"] == os.getpid() and status["endpoint"]["http"] == address
        assert _raw(f"::1:{server.address[1]}", _request("GET", "/v1/status", None))[0] == 401  # the token, as on IPv4
    finally:
        controller.close()


def test_the_bearer_scheme_is_read_in_any_case_and_the_token_exactly(held):
    """RFC 7235: an auth scheme is case-insensitive (`bearer`, `BEARER` were refused); the token is not."""
    token = held.token()
    for header, expected in ((f"bearer {token}", 200), (f"BEARER {token}", 200), (f"Bearer {token}", 200),
                             (f"bearer {token.swapcase()}", 401), (f"bearer{token}", 401), (f"Basic {token}", 401),
                             (f"bearer {token}x", 401), ("bearer", 401)):
        request = f"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: {header}\r\n\r\n".encode()
        status, _, _ = _raw(held.listen, request)
        assert status == expected, header


def test_malformed_requests_get_a_json_4xx_without_python_internals(held):
    token = held.token()
    (request,) = Endpoint(socket_path=held.socket).json("GET", "/v1/requests")["requests"]
    rid = request["request_id"]
    control = "/v1/control"
    cases = {
        "row out of range": (_request("GET", f"/v1/requests/{rid}?row=1", token), 400),
        "row not a number": (_request("GET", f"/v1/requests/{rid}?row=x", token), 400),
        "k huge": (_request("GET", f"/v1/requests/{rid}?k={'9' * 5000}", token), 400),
        "models not text": (_request("POST", control, token, body=b'{"action":"detach","models":5}'), 400),
        "layers a list": (_request("POST", control, token, body=b'{"action":"attach","layers":[[1]]}'), 400),
        "action a list": (_request("POST", control, token, body=b'{"action":["pause"]}'), 400),
        "200k nested [": (_request("POST", control, token, body=b"[" * 200_000), 413),
        "50k nested [": (_request("POST", control, token, body=b"[" * 50_000), 400),
        "not UTF-8": (_request("POST", control, token, body=b'{"action": "\xff"}'), 400),
        "not an object": (_request("POST", control, token, body=b"[1]"), 400),
        "Content-Length abc": (_request("POST", control, token, headers="Content-Length: abc\r\n"), 400),
        "Content-Length -1": (_request("POST", control, token, headers="Content-Length: -1\r\n"), 400),
        "Content-Length huge": (_request("POST", control, token, headers=f"Content-Length: {10 ** 12}\r\n"), 413),
        "Content-Length twice": (_request("POST", control, token, headers="Content-Length: 2\r\nContent-Length: 3"
                                          "\r\n", body=b"{}"), 400),
        "GET Content-Length abc": (_request("GET", "/v1/status", token, headers="Content-Length: abc\r\n"), 400),
        "chunked": (_request("POST", control, token, headers="Transfer-Encoding: chunked\r\n"), 411),
        "body cut short (closed)": (_request("POST", control, token, headers="Content-Length: 100\r\n")
                                    + b'{"action"', 400),
        "garbage request line": (b"HELLO\r\n\r\n", 400),
        "header line too long": (b"GET /v1/status HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        "unknown path": (_request("GET", "/etc/passwd", token), 404),
        "no token": (_request("GET", "/v1/status", None), 401),
    }
    for name, (data, expected) in cases.items():
        _assert_json_error(*_raw(held.listen, data), expected, name)
    for name in ("Content-Length abc", "row out of range", "200k nested ["):  # the Unix socket answers alike
        data, expected = cases[name]
        _assert_json_error(*_raw(held.socket, data.replace(f"Bearer {token}".encode(), b"Bearer -")), expected)

    start = time.monotonic()  # a body shorter than declared, the connection left open: answered, not held
    status, headers, body = _raw(held.listen, _request("POST", control, token, headers="Content-Length: 100\r\n")
                                 + b"{", half_close=False)
    assert "shorter" in _assert_json_error(status, headers, body, 400)
    assert REQUEST_SECONDS - 0.5 <= time.monotonic() - start <= REQUEST_SECONDS + 3
    status, _, body = _raw(held.listen, _request("PUT", "/v1/status", token))
    assert status == 501 and "PUT" in json.loads(body)["error"]
    assert MAX_BODY < 200_000
    (model,) = held.status()["models"]  # none of it changed what is recorded
    assert model["attached"] and not model["excluded"] and held.process.poll() is None


# -- B: run folders, tokens, sockets -----------------------------------------------------------------------------

def _nxl_run(*args: str, tmpdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*NXL, "run", *args, "--", sys.executable, "-c", "print('ran')"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmpdir)})


def _nxl_run_refused(*args: str, tmpdir: Path, capsys, monkeypatch) -> subprocess.CompletedProcess:
    """``_nxl_run`` for a run that must be refused before its program starts, in this process
    (test_serve's ``_refused_in_process``)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))  # (what TMPDIR is to _nxl_run's child)
    return _refused_in_process(capsys, monkeypatch, "run", *args, "--", sys.executable, "-c", "print('ran')")


@as_root
def test_run_folders_of_others_or_open_to_others_are_refused(tmp_path, capsys, monkeypatch):
    """The first refusal is a whole ``nxl run`` program (that one line alone on its stderr); the others are the same
    checks, in this process."""
    open_to_all = tmp_path / "open"
    open_to_all.mkdir(mode=0o700)
    open_to_all.chmod(0o777)
    others = tmp_path / "others"
    others.mkdir()
    others.chmod(0o755)
    os.chown(others, NOBODY, NOBODY)
    below_others = others / "mine"  # made by root inside nobody's folder: nobody could swap it
    below_others.mkdir(mode=0o700)
    for n, (folder, why) in enumerate(((open_to_all, "writable by group or others"),
                                       (others, f"belongs to uid {NOBODY}"),
                                       (below_others, f"which belongs to uid {NOBODY}"))):
        args = ("--sink", str(folder), "--listen", f"127.0.0.1:{free_port()}")
        done = _nxl_run(*args, tmpdir=tmp_path) if n == 0 else \
            _nxl_run_refused(*args, tmpdir=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
        assert done.returncode == 2 and "ran" not in done.stdout, done.stderr
        (line,) = done.stderr.splitlines()[-1:]
        assert len(done.stderr.splitlines()) == 1 and why in line and str(folder) in line
        assert not (folder / "token").exists()
    assert "chmod go-w" in _nxl_run_refused("--sink", str(open_to_all), tmpdir=tmp_path, capsys=capsys,
                                            monkeypatch=monkeypatch).stderr
    made = tmp_path / "new" / "deeper" / "run"  # missing folders are made private, and accepted
    done = _nxl_run("--sink", str(made), tmpdir=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ran", done.stderr
    assert stat.S_IMODE(made.stat().st_mode) == stat.S_IMODE(made.parent.stat().st_mode) == 0o700


@as_root
def test_a_token_already_there_is_never_silently_replaced_and_readers_check_it(tmp_path, capsys, monkeypatch):
    """The first refusal is a whole ``nxl run`` program; the others are the same checks, in this process."""
    listen = ["--listen", f"127.0.0.1:{free_port()}"]
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    token = run / "token"
    planted = {"nobody's": (0o600, NOBODY, f"belongs to uid {NOBODY}"), "readable": (0o644, 0, "mode 644")}
    for n, (name, (mode, owner, why)) in enumerate(planted.items()):
        token.write_text(f"planted-{name}-token-0123456789\n")
        token.chmod(mode)
        os.chown(token, owner, owner)
        done = _nxl_run("--sink", str(run), *listen, tmpdir=tmp_path) if n == 0 else \
            _nxl_run_refused("--sink", str(run), *listen, tmpdir=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
        assert done.returncode == 2 and "ran" not in done.stdout and why in done.stderr, done.stderr
        assert token.read_text() == f"planted-{name}-token-0123456789\n" and token.stat().st_uid == owner
        with pytest.raises(PermissionError, match=why):
            read_token(run)
        code, _, err = _cli(capsys, "ctl", "status", "--run", "http://127.0.0.1:9", "--token-file", str(token))
        assert code == 2 and why in err  # the client refuses it before connecting
        token.unlink()
    target = tmp_path / "elsewhere"
    target.write_text("not a token\n")
    token.symlink_to(target)
    done = _nxl_run_refused("--sink", str(run), *listen, tmpdir=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    assert done.returncode == 2 and "not a regular file" in done.stderr and target.read_text() == "not a token\n"
    with pytest.raises(PermissionError, match="symbolic link"):
        read_token(token)
    token.unlink()
    os.mkfifo(token, 0o600)  # a FIFO is refused at once, not waited on
    with pytest.raises(PermissionError, match="not a regular file"):
        read_token(run / "token")
    token.unlink()
    token.write_text("an-earlier-run-of-mine-0123456789\n")  # this user's own 0600 token: a new run, a new token
    token.chmod(0o600)
    done = _nxl_run("--sink", str(run), *listen, tmpdir=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ran", done.stderr
    fresh = read_token(run)
    assert len(fresh) >= 40 and fresh != "an-earlier-run-of-mine-0123456789"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.stat().st_uid == os.getuid()


def test_a_token_another_process_of_the_run_writes_meanwhile_is_read_whole(tmp_path, monkeypatch):
    """Two processes of one run under import nxl_hooks.auto with NXL_LISTEN (workers) each ask for its token: the
    one that finds no file writes it. The other, looking while it was written, found the file made but still empty
    and took '' for the token (its endpoint then said 'too short to guard anything'); now both read one token, the
    one in the file."""
    from nxl_hooks.apps.serve import runs

    run = runs.make_run_dir(tmp_path / "run")
    seen, fchmod = [], os.fchmod

    def meanwhile(fd, mode):  # the moment between the token file's creation and its write: another worker asks
        if not seen:
            seen.append(None)
            seen[0] = runs.run_token(run)
        fchmod(fd, mode)

    monkeypatch.setattr(os, "fchmod", meanwhile)
    mine = runs.run_token(run)
    monkeypatch.undo()
    assert seen == [mine] and (run / "token").read_text() == mine + "\n" and len(mine) >= 40
    assert sorted(path.name for path in run.iterdir()) == ["token"]  # nothing else left in the run folder
    assert stat.S_IMODE((run / "token").stat().st_mode) == 0o600


def test_a_run_folder_on_a_file_system_without_hard_links_still_gets_its_token(tmp_path, monkeypatch):
    """The token is written whole, then linked into place; where the folder's file system has no hard links (some
    FUSE and SMB mounts: EPERM, ENOTSUP) it is written in place as before, not refused (the endpoint served none)."""
    from nxl_hooks.apps.serve import runs

    run = runs.make_run_dir(tmp_path / "run")

    def no_links(source, target, *args, **kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    mine = runs.run_token(run)
    monkeypatch.undo()
    assert (run / "token").read_text() == mine + "\n" and len(mine) >= 40
    assert sorted(path.name for path in run.iterdir()) == ["token"]
    assert stat.S_IMODE((run / "token").stat().st_mode) == 0o600


def test_a_token_that_no_header_can_carry_is_refused_in_a_line_that_does_not_show_it(tmp_path, capsys, monkeypatch):
    """A token file of two lines or of non-ASCII text (an edited or pasted file), or such an NXL_TOKEN, reached
    http.client, whose refusal was either a codec's ("'latin-1' codec can't encode characters") or the whole
    header quoted, the bearer token with it, on the terminal. It is refused in a line that names the file."""
    secret = "s3cret-0123456789abcdef"
    for name, text in (("two lines", f"{secret}\nmore\n"), ("not ASCII", f"{secret}-токен\n"),
                       ("a space", f"{secret} x\n")):
        token = tmp_path / name.replace(" ", "-")
        token.write_text(text)
        token.chmod(0o600)
        code, _, err = _cli(capsys, "ctl", "status", "--run", "http://127.0.0.1:9", "--token-file", str(token))
        assert code == 2 and f"{token} does not hold a bearer token" in err and secret not in err, (name, err)
        monkeypatch.setenv("NXL_TOKEN", text.strip())
        code, _, err = _cli(capsys, "tail", "--run", "http://127.0.0.1:9")
        assert code == 2 and "NXL_TOKEN does not hold a bearer token" in err and secret not in err, (name, err)


@pytest.fixture
def shared():
    """A folder every uid can reach and write (pytest's own temporary folders are private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="nxl-test-"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def nobody_python() -> str:
    """A Python that uid 65534 can run (this environment's may sit in root's private home)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            if subprocess.run([candidate, "-c", "pass"], user=NOBODY, capture_output=True, timeout=60).returncode == 0:
                return candidate
        except OSError:
            continue
    pytest.skip("no Python interpreter that uid 65534 may run")


@as_root
def test_sockets_are_checked_on_both_ends(held, shared, nobody_python, capsys):
    """The client talks only to a socket served by its own uid (or root); the endpoint serves only those."""
    fake = shared / "4242.sock"
    serve = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\ns.listen()\n"
             "print('up', flush=True)\nwhile True:\n    c, _ = s.accept()\n    try:\n"
             "        c.sendall(b'HTTP/1.0 200 OK\\r\\n\\r\\n{\"paused\": true}')\n    except OSError:\n        pass\n"
             "    c.close()\n")
    impostor = subprocess.Popen([nobody_python, "-c", serve, str(fake)], user=NOBODY, stdout=subprocess.PIPE)
    try:
        assert impostor.stdout.readline().strip() == b"up"
        with pytest.raises(PermissionError, match=f"served by uid {NOBODY}"):
            connect_unix(fake, 5)
        code, out, err = _cli(capsys, "ctl", "pause", "--run", str(fake))
        assert code == 2 and "paused" not in out and f"uid {NOBODY}" in err
    finally:
        impostor.kill()
        impostor.wait(timeout=30)

    from nxl_hooks.apps.serve.endpoint import bind_socket

    blocker = shared / "blocker.sock"  # the endpoint's bind: a file there is never replaced
    blocker.write_text("someone's file")
    with socket.socket(socket.AF_UNIX) as sock, pytest.raises(PermissionError, match="not a socket of this user"):
        bind_socket(blocker, sock)
    assert blocker.read_text() == "someone's file"

    sock_mode = held.socket.stat().st_mode
    reachable = shared / "link.sock"  # the endpoint's own socket (a hard link), where every uid can reach it
    os.link(held.socket, reachable)
    try:  # open to everyone: the endpoint still lets only this user (or root) in
        held.socket.chmod(0o666)
        probe = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.settimeout(10)\ns.connect(sys.argv[1])\n"
                 "s.sendall(b'GET /v1/status HTTP/1.0\\r\\n\\r\\n')\nprint(repr(s.recv(100)))\n")
        done = subprocess.run([nobody_python, "-c", probe, str(reachable)], user=NOBODY, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode in (0, 1) and "200" not in done.stdout and "pid" not in done.stdout
        assert done.stdout.strip() == "b''" or "ConnectionResetError" in done.stderr or "BrokenPipe" in done.stderr
    finally:
        held.socket.chmod(stat.S_IMODE(sock_mode))
        reachable.unlink()
    assert held.status()["pid"] == held.pid


@as_root
@pytest.mark.parametrize("listen", ["ipv4", "dual-stack"])
def test_the_token_is_never_sent_to_another_users_program_on_the_runs_port(tmp_path, nobody_python, capsys, listen):
    """Once a run's program ends, any local user may listen on its port; nxl ctl and nxl tail sent them the run's
    bearer token (a run under import nxl_hooks.auto keeps its token for the next). The server's end of a loopback
    connection must now be this user's or root's (the kernel's table of TCP sockets), as a Unix socket's must; also
    where it listens on IPv6's any address, which takes IPv4 too (the kernel lists its end in tcp6, as
    ::ffff:127.0.0.1: looked for in tcp alone, it was not found, and the token went to it)."""
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-the-run-0123456789\n")
    token.chmod(0o600)
    bind = ("s = socket.socket()\ns.bind(('127.0.0.1', 0))\n" if listen == "ipv4" else
            "s = socket.socket(socket.AF_INET6)\ns.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)\n"
            "s.bind(('::', 0))\n")
    serve = (f"import socket\n{bind}s.listen()\n"
             "print(s.getsockname()[1], flush=True)\nwhile True:\n    c, _ = s.accept()\n    c.settimeout(2)\n"
             "    try:\n        print(repr(c.recv(65536)), flush=True)\n"
             "        c.sendall(b'HTTP/1.0 200 OK\\r\\n\\r\\n{\"models\": [], \"paused\": true}')\n"
             "    except OSError:\n        pass\n    c.close()\n")
    squatter = subprocess.Popen([nobody_python, "-c", serve], user=NOBODY, stdout=subprocess.PIPE, text=True)
    try:
        port = int(squatter.stdout.readline())
        for command in (["ctl", "pause"], ["tail"]):
            code, out, err = _cli(capsys, *command, "--run", f"http://127.0.0.1:{port}", "--token-file", str(token))
            assert code == 2 and not out and f"served by uid {NOBODY}" in err and len(err.splitlines()) == 1, err
    finally:
        squatter.kill()
        heard, _ = squatter.communicate(timeout=30)
    assert "s3cret" not in heard and "Bearer" not in heard, heard


@pytest.mark.parametrize("listen, connect", [("127.0.0.1", "127.0.0.1"), ("::", "127.0.0.1"),
                                             ("::", "::ffff:127.0.0.1"), ("127.0.0.1", "::ffff:127.0.0.1"),
                                             ("::1", "::1")])
def test_the_owner_of_a_local_tcp_server_is_found_however_its_address_is_written(listen, connect):
    """A server of this process's (so this user's) on IPv6's any address, reached at 127.0.0.1, has its end listed
    in tcp6 as ::ffff:127.0.0.1, and one on 127.0.0.1 reached at ::ffff:127.0.0.1 has it in tcp: each was looked for
    in its client's family's table alone, not found, and its owner not told (so neither was another user's)."""
    from nxl_hooks.apps.serve.runs import tcp_peer_uid

    server = socket.socket(socket.AF_INET6 if ":" in listen else socket.AF_INET)
    client = socket.socket(socket.AF_INET6 if ":" in connect else socket.AF_INET)
    with server, client:
        if server.family == socket.AF_INET6:
            server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            server.bind((listen, 0))
        except OSError as error:
            pytest.skip(f"no IPv6 here: {error}")
        server.listen()
        client.connect((connect, server.getsockname()[1]))
        accepted, _ = server.accept()
        with accepted:
            assert tcp_peer_uid(client) == os.getuid()


def test_sigterm_removes_the_socket_and_keeps_the_programs_own_handling(model, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    plain = Held(model, tmp_path / "plain", tmpdir)
    own = Held(model, tmp_path / "own", tmpdir, env={"OWN_SIGTERM": "1"})
    try:
        for program in (plain, own):
            program.wait_ready()
        live = tmpdir / f"nxl-{os.getuid()}" / "live"
        assert {p.name for p in live.iterdir()} == {str(plain.pid), str(own.pid)}
        assert plain.stop(signal.SIGTERM) == -signal.SIGTERM  # died of SIGTERM, as it would without nxl
        assert own.stop(signal.SIGTERM) == 3 and "OWN HANDLER" in own.log.read_text()
        for program in (plain, own):
            assert not program.socket.exists() and not list(program.run.glob("*.sock"))
        assert not list(live.iterdir())
    finally:
        plain.stop(signal.SIGKILL)
        own.stop(signal.SIGKILL)


# -- C: which run nxl tail / nxl ctl talk to without --run ---------------------------------------------------------

def test_without_run_the_callers_one_live_run_is_chosen_never_a_dead_one(model, tmp_path, capsys, monkeypatch):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))  # this test's runs only, not other sessions' on the machine
    monkeypatch.delenv("NXL_RUN_DIR", raising=False)
    first, dead = Held(model, tmp_path / "first", tmpdir), Held(model, tmp_path / "dead", tmpdir)
    second = None
    try:
        first.wait_ready()
        dead.wait_ready()
        assert dead.stop(signal.SIGKILL) == -signal.SIGKILL and dead.socket.is_socket()  # left behind
        code, out, err = _cli(capsys, "ctl", "status", "--json")
        assert code == 0, err
        assert [json.loads(line)["pid"] for line in out.splitlines()] == [first.pid]
        second = Held(model, tmp_path / "second", tmpdir).wait_ready()
        for command in (["ctl", "status"], ["tail", "--count", "1"]):
            code, out, err = _cli(capsys, *command)
            lines = err.splitlines()
            assert code == 2 and out == "" and len(lines) == 3, err
            assert lines[0].startswith(f"--run {second.run.resolve()} ") and f"pid {second.pid}" in lines[0]
            assert lines[1].startswith(f"--run {first.run.resolve()} ") and f"pid {first.pid}" in lines[1]
            assert "2 of your runs are live" in lines[2] and str(dead.run) not in err
        code, out, _ = _cli(capsys, "ctl", "status", "--json", "--run", str(second.run))
        assert code == 0 and json.loads(out)["pid"] == second.pid
        second.stop()
        code, out, _ = _cli(capsys, "ctl", "status", "--json")
        assert code == 0 and json.loads(out)["pid"] == first.pid
        first.stop()
        code, out, err = _cli(capsys, "ctl", "status")
        assert code == 2 and "no live run of yours" in err and len(err.splitlines()) == 1
        assert not list((tmpdir / f"nxl-{os.getuid()}" / "live").iterdir())  # the dead one's entry pruned too
    finally:
        for program in (first, dead, second):
            if program is not None:
                program.stop(signal.SIGKILL)


@as_root
def test_a_users_folder_another_user_made_first_is_named_with_its_owner_and_a_way_out(tmp_path, capsys, monkeypatch):
    """Another user made $TMPDIR/nxl-<uid> first (one mkdir in sticky /tmp): nxl run without --sink said "remove
    it", which this user cannot; nxl ctl without --run said "no live run of yours" while one was live (its list
    could not be read)."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    tmpdir.chmod(0o1777)
    squatted = tmpdir / f"nxl-{os.getuid()}"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, NOBODY, NOBODY)
    done = _nxl_run(tmpdir=tmpdir)
    assert done.returncode == 2 and "ran" not in done.stdout and len(done.stderr.splitlines()) == 1, done.stderr
    assert f"{squatted} belongs to uid {NOBODY} (another user)" in done.stderr
    assert "ask them or root to remove it, or pass --sink DIR, or set TMPDIR" in done.stderr

    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    monkeypatch.delenv("NXL_RUN_DIR", raising=False)
    code, out, err = _cli(capsys, "ctl", "status")
    assert code == 2 and not out and len(err.splitlines()) == 1, err
    assert "the list of your live runs could not be read" in err and f"belongs to uid {NOBODY}" in err
    assert "pass --run DIR" in err and "no live run" not in err


class _NotNxl:
    """An HTTP server on 127.0.0.1 that is no nxl_hooks endpoint (``page``: a web page on every path), or one whose
    event stream ends at once (``ended``: as a recorded process that exits does), whose answers are cut short
    (``cut``: the process died while answering), whose status is not one (``odd status``), has faults of other types
    (``odd faults``) or is nested too deep for Python's parser (``nested``), or that never answers
    (``silent``: a stopped process)."""

    def __init__(self, kind: str) -> None:
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if kind == "silent":
                    time.sleep(5)
                    return
                if kind == "cut":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b'{"pid": 1, "')
                    self.close_connection = True
                    return
                if kind == "page":
                    body, kind_of = b"<html>hello</html>", "text/html"
                elif kind == "nested" and self.path.startswith("/v1/status"):
                    body, kind_of = b"[" * 200_000, "application/json"
                elif kind == "odd faults" and self.path.startswith("/v1/status"):  # (an nxl_hooks of another version)
                    body, kind_of = json.dumps({"pid": 1, "paused": False, "models": [
                        {"name": "m", "unrecorded": 5, "head_kind": 3, "calls": 1}]}).encode(), "application/json"
                elif kind == "odd status" and self.path.startswith("/v1/status"):
                    body, kind_of = json.dumps({"pid": 1, "paused": False, "models": [{"layers": 5}]}).encode(), \
                        "application/json"
                elif self.path.startswith("/v1/stream"):
                    body, kind_of = b"", "text/event-stream"
                elif self.path.startswith("/v1/status"):
                    body, kind_of = json.dumps({"pid": 1, "paused": False, "models": []}).encode(), "application/json"
                else:
                    body, kind_of = b"[]", "application/json"
                self.send_response(200)
                self.send_header("Content-Type", kind_of)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # quiet when a client leaves first (tail hangs up a stream as it returns): its traceback on stderr is this
        # server's, not one of the command's lines the tests count
        self.server.handle_error = lambda request, client_address: None
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("command, kind", [(["ctl", "status"], "cut"), (["tail", "--last", "1"], "cut"),
                                           (["ctl", "status"], "odd status"), (["ctl", "status"], "nested"),
                                           (["tail"], "silent")])
def test_tail_and_ctl_say_in_one_line_when_an_answer_is_cut_odd_or_never_comes(capsys, monkeypatch, command, kind):
    """A process that dies while it answers, a status of another shape or nested 200,000 deep, a stopped process:
    one line and exit 2 (they were tracebacks, or nxl tail waited forever, silent). A live process's stream is never silent that long:
    it sends a comment every KEEPALIVE seconds."""
    from nxl_hooks.apps.serve import endpoint

    monkeypatch.setenv("NXL_TOKEN", "t0ken")
    monkeypatch.setattr(endpoint, "KEEPALIVE", 0.2)
    server = _NotNxl(kind)
    started = time.monotonic()
    try:
        assert cli_main([*command, "--run", server.url]) == 2
    finally:
        server.close()
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and server.url in err[0], err
    assert {"cut": "cut short", "odd status": "not an nxl_hooks control endpoint", "silent": "timed out",
            "nested": "not an nxl_hooks control endpoint"}[kind] in err[0]


@pytest.mark.parametrize("command", [["tail"], ["ctl", "status"]])
def test_tail_and_ctl_say_when_they_reach_no_nxl_endpoint_or_its_stream_ends(tmp_path, capsys, monkeypatch, command):
    """The server's own port given instead of --listen's: one line saying so (exit 2), not silence nor a traceback;
    a stream that ends (the process exited) is said too, and is no success."""
    monkeypatch.setenv("NXL_TOKEN", "t0ken")
    page = _NotNxl("page")
    try:
        assert cli_main([*command, "--run", page.url]) == 2
    finally:
        page.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not an nxl_hooks control endpoint" in err[0] and "Traceback" not in err[0], err
    if command == ["tail"]:
        ended = _NotNxl("ended")
        try:
            assert cli_main(["tail", "--run", ended.url]) == 1
        finally:
            ended.close()
        assert "nxl tail: the stream ended: the process exited" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["tail"], ["ctl", "status"]])
def test_tail_and_ctl_say_that_a_peer_answering_no_http_is_no_nxl_endpoint(capsys, monkeypatch, command):
    """A socket of another program that answers a line of its own: the line said only "HOST:PORT: garbage (is the
    run still live? ...)", its peer's words as the reason."""
    import threading

    monkeypatch.setenv("NXL_TOKEN", "t0ken")
    listener = socket.create_server(("127.0.0.1", 0))

    def answer():  # every connection (tail makes two: its status look and its stream), until closed
        with contextlib.suppress(OSError):
            while True:
                peer, _ = listener.accept()
                with peer:
                    peer.recv(65536)
                    peer.sendall(b"garbage\n")

    threading.Thread(target=answer, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        assert cli_main([*command, "--run", url]) == 2
    finally:
        listener.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{url}: its answer is not HTTP: not an nxl_hooks control endpoint" in err[0], err


def test_tail_says_in_one_line_that_it_cannot_read_a_status_of_another_shape(capsys, monkeypatch):
    """A status whose faults are of other types (an nxl_hooks of another version) made tail's watcher die silently, and
    every step then waited for it: tail says so in one line, before the stream's own end."""
    monkeypatch.setenv("NXL_TOKEN", "t0ken")
    server = _NotNxl("odd faults")
    try:
        cli_main(["tail", "--run", server.url])
    finally:
        server.close()
    said = capsys.readouterr()
    # the line (stdout) comes before the stream's end (stderr), which ends tail: handed after it, it would be lost
    (odd,) = [line for line in said.out.splitlines() if "its faults cannot be shown" in line]
    assert "AttributeError" in odd and server.url in odd and "Traceback" not in said.err
    assert "nxl tail: the stream ended" in said.err
