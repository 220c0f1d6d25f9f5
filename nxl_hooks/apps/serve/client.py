"""Talk to the control endpoints of a run: what ``nxl tail`` and ``nxl ctl`` use.

    for endpoint in endpoints("runs/"):                      # one per live process of the run
        endpoint.json("GET", "/v1/status")
    for event, data in endpoint.events("/v1/stream"): ...    # server-sent events

A run is a run folder (every ``<pid>.sock`` in it), one socket file, or ``http://127.0.0.1:PORT`` with a token
(``--token-file``, or the ``token`` file of the run folder). Without one: ``NXL_RUN_DIR`` if set (a program under
``nxl run``), else this user's live run (:func:`choose_run`). What it connects to is checked first: a Unix
socket, or a TCP port on this machine, must be served by this user or root (the peer's credentials; the kernel's
table of TCP sockets), a token file must be this user's, mode 0600
(:func:`~nxl_hooks.apps.serve.runs.read_token`).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import shlex
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from ...records.files import json_value, user_path
from ..options import CliError, say
from .runs import bearer, live_sockets, peer_uid, read_token, tcp_peer_uid

__all__ = ["Endpoint", "Refused", "choose_run", "connect_unix", "endpoints"]


def connect_unix(path: Path | str, timeout: float | None) -> socket.socket:
    """A connected Unix socket, once the process serving it proved to be this user's or root's (SO_PEERCRED):
    a socket another user put in the run folder is refused with PermissionError, before a byte is sent."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(str(path))
        _check_peer(peer_uid(sock), str(path), "someone else's socket in the run folder")
    except BaseException:
        sock.close()
        raise
    return sock


def _check_peer(uid: int | None, name: str, why: str) -> None:
    """PermissionError unless ``uid`` (None: it cannot be told) is this user's or root's."""
    if uid is not None and uid not in (os.getuid(), 0):
        raise PermissionError(f"{name} is served by uid {uid}, not by you (uid {os.getuid()}) or root: not talking "
                              f"to it ({why})")


class _TCPConnection(http.client.HTTPConnection):
    """An HTTP connection that sends nothing (the bearer token least of all) to a server on this machine that is
    another user's: one who took the run's port once its program ended (:func:`~.runs.tcp_peer_uid`)."""

    def connect(self) -> None:
        super().connect()
        try:
            _check_peer(tcp_peer_uid(self.sock), f"{self.host}:{self.port}",
                        "another user's program on the run's port: the run has ended, or moved")
        except BaseException:
            self.close()
            raise


class Refused(CliError):
    """An endpoint's own refusal: its ``status`` and its JSON ``answer`` (``error``, and what else it says)."""

    def __init__(self, message: str, status: int, answer: dict) -> None:
        super().__init__(message)
        self.status, self.answer = status, answer


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = connect_unix(self._path, self.timeout)


class Endpoint:
    """One process's control endpoint: a Unix socket, or an HTTP address and its bearer token."""

    def __init__(self, *, socket_path: Path | None = None, url: str | None = None, token: str | None = None) -> None:
        self.socket_path, self.url, self.token = socket_path, url, token
        self.name = socket_path.stem if socket_path is not None else url

    def _connection(self, timeout: float | None) -> http.client.HTTPConnection:
        if self.socket_path is not None:
            return _UnixConnection(str(self.socket_path), timeout)
        parts = urlsplit(self.url)
        return _TCPConnection(parts.hostname, parts.port or 80, timeout=timeout)

    def _open(self, method: str, path: str, body: dict | None, timeout: float | None,
              on_connect: Callable[[Callable[[], None]], Any] | None = None) -> http.client.HTTPResponse:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        connection = self._connection(timeout)
        try:
            if on_connect is not None:
                connection.connect()
                on_connect(functools.partial(_hang_up, connection.sock))
            connection.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
            return connection.getresponse()
        except PermissionError:
            raise
        except OSError as error:  # (a peer that closed without an answer too: RemoteDisconnected)
            raise CliError(f"{self.name}: {getattr(error, 'strerror', None) or error} (is the run still live? give "
                           "the folder or the --listen address nxl run printed)") from None
        except http.client.HTTPException:  # its raw first line was the whole message ("fake: garbage")
            raise self._foreign("its answer is not HTTP") from None

    def _foreign(self, what: str) -> CliError:
        return CliError(f"{self.name}: {what}: not an nxl_hooks control endpoint (give the folder or the --listen "
                        "address nxl run printed, not the server's own port)")

    def get(self, method: str, path: str, body: dict | None = None, timeout: float = 30) -> tuple[int, bytes]:
        """(status, body bytes) of one request."""
        response = self._open(method, path, body, timeout)
        try:
            return response.status, response.read()
        except (OSError, http.client.HTTPException) as error:  # cut short: the process died while answering
            raise CliError(f"{self.name}: the answer was cut short ({type(error).__name__}) (is the run still "
                           "live? give the folder or the --listen address nxl run printed)") from None

    def json(self, method: str, path: str, body: dict | None = None, timeout: float = 30) -> Any:
        """The JSON answer of one request; CliError with the endpoint's message when it is not a success."""
        status, data = self.get(method, path, body, timeout)
        if status != 200:
            raise self._refused(status, data)
        try:
            return json_value(data or b"null")
        except ValueError:
            raise self._foreign(f"it answered {status} with no JSON") from None

    def _refused(self, status: int, data: bytes) -> CliError:
        """What an answer other than 200 says: the endpoint's own error, else that it is none of nxl_hooks'."""
        try:
            value = json_value(data or b"null")
        except ValueError:
            value = None
        if not isinstance(value, dict) or not isinstance(value.get("error"), str):
            return self._foreign(f"it answered {status}")
        return Refused(f"{self.name}: {status} {value['error']}", status, value)

    def status(self, body: dict | None = None, timeout: float = 30) -> dict:
        """The process's status (``body``: a change to make first, POSTed to ``/v1/control``); CliError when what
        answers is no nxl_hooks endpoint."""
        value = (self.json("GET", "/v1/status", timeout=timeout) if body is None
                 else self.json("POST", "/v1/control", body, timeout=timeout))
        if not (isinstance(value, dict) and isinstance(value.get("models"), list)
                and all(isinstance(model, dict) for model in value["models"])):
            raise self._foreign("its status is not one")
        return value

    def events(self, path: str, timeout: float | None = None, on_open: Callable[[], Any] | None = None,
               on_connect: Callable[[Callable[[], None]], Any] | None = None) -> Iterator[tuple[str, dict]]:
        """(event, data) of a server-sent event stream, until the endpoint closes it. ``on_open``: called once the
        endpoint answered (it is subscribed then: no step made later is missed). ``on_connect``: called once
        connected with a function that hangs up from any thread: the iteration then ends (a quiet stream's reader
        waits in a read that nothing else ends)."""
        response = self._open("GET", path, None, timeout, on_connect)
        if response.status != 200:
            raise self._refused(response.status, response.read())
        if not (response.getheader("Content-Type") or "").startswith("text/event-stream"):
            raise self._foreign("it answered with no event stream")
        if on_open is not None:
            on_open()
        event, data = "message", []
        for raw in response:
            line = raw.decode().rstrip("\r\n")
            if not line:
                if data:
                    try:
                        value = json_value("\n".join(data))
                    except ValueError:
                        raise self._foreign(f"it sent a {event!r} event that is not JSON") from None
                    yield event, value
                event, data = "message", []
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())


def _hang_up(sock: socket.socket) -> None:
    """End a connection that another thread may be reading: its read returns at once, as at the end of the stream
    (a close alone leaves that read waiting)."""
    with contextlib.suppress(OSError):  # closed already
        sock.shutdown(socket.SHUT_RDWR)


def _answers(path: Path) -> bool:
    """Whether a process of this user (or root) answers on the socket (False for a dead process's leftover)."""
    try:
        connect_unix(path, 2).close()
        return True
    except PermissionError:
        raise
    except OSError:  # a process that ended without removing its socket (SIGKILL)
        return False


def choose_run() -> Path:
    """The run folder of this user's one live run: a process alive whose socket answers (dead ones are never
    picked). With several, each is printed on its own line (newest first) and CliError says to pass one."""
    runs: dict[Path, list[tuple[int, float]]] = {}
    try:
        live = live_sockets()
    except PermissionError as error:
        raise CliError(f"the list of your live runs could not be read ({error}); pass --run DIR, the folder nxl run "
                       "printed") from None
    for sock, started in live:
        try:
            if _answers(sock):
                runs.setdefault(sock.parent, []).append((int(sock.stem), started))
        except PermissionError:  # not this user's process: not a run to choose
            continue
    if not runs:
        raise CliError("no live run of yours (start one with nxl run, or pass --run DIR, the folder nxl run printed)")
    if len(runs) > 1:
        for folder, processes in runs.items():
            pids = ",".join(str(pid) for pid, _ in processes)
            started = time.strftime("%H:%M:%S", time.localtime(max(when for _, when in processes)))
            say(f"--run {shlex.quote(str(folder))}    (pid {pids}, started {started})")
        raise CliError(f"{len(runs)} of your runs are live (listed above, newest first): pass one with --run")
    return next(iter(runs))


def endpoints(run: str | None = None, token_file: str | None = None) -> list[Endpoint]:
    """The live endpoints of ``run`` (module docstring); CliError saying what to do when there is none."""
    if run is None:
        run = os.environ.get("NXL_RUN_DIR") or str(choose_run())
    if not run.strip():  # (a variable left unset: pathlib reads '' as this folder, and the line named none)
        raise CliError("--run is empty: give the folder nxl run printed, a control socket or http://127.0.0.1:PORT, "
                       "or leave --run out for your one live run")
    if run.startswith(("http://", "https://")):
        if run.startswith("https://"):
            raise CliError(f"{run}: the endpoint speaks plain HTTP on loopback; use http://")
        try:
            host = urlsplit(run).hostname
            urlsplit(run).port  # (a port that is no number raises)
        except ValueError:
            host = None
        if not host:
            raise CliError(f"{run}: give the address nxl run --listen printed, http://127.0.0.1:PORT")
        token = os.environ.get("NXL_TOKEN")
        if token_file or not token:
            if not token_file:
                raise CliError(f"{run} needs its bearer token: pass --token-file RUN_FOLDER/token (or set NXL_TOKEN)")
            token = read_token(Path(token_file))
        else:
            token = bearer(token, "NXL_TOKEN")
        return [Endpoint(url=run.rstrip("/"), token=token)]
    path = user_path(run)
    if path.is_socket():
        return [Endpoint(socket_path=path)]
    if not path.is_dir():
        raise CliError(f"{run}: no run folder or control socket there (give the folder `nxl run` printed)")
    live = [Endpoint(socket_path=sock) for sock in sorted(path.glob("*.sock")) if _answers(sock)]
    if not live:
        if next(path.glob("*/*.nxl"), None) is not None:  # its sink's folders (one per process and model) hold records
            raise CliError(f"{run}: no running process has a control socket there (the program has ended, or not "
                           f"loaded a model yet); what it recorded is on disk: nxl export {run} records.parquet, or "
                           "nxl.read_stream(folder) in Python")
        raise CliError(f"{run}: no running process has a control socket there (has the program loaded a model yet?)")
    return live
