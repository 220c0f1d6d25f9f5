"""The control endpoint of one process: a live readout of its records and the switches of ``nxl ctl``.

    GET  /v1/status                      the process, its models, hooks and options
    GET  /v1/requests                    the requests in memory, oldest first ({"requests": [...]})
    GET  /v1/requests/ID?k=5             one request: per step, the top-k context tokens of every layer (a
                                         classifier's: per explained row); the newest record of the id, or with
                                         &started=T the one that /v1/requests lists with that started time
    GET  /v1/requests/ID/frames          one request as a stream file (nxl.read_stream reads it)
    GET  /v1/stream[?request_id=ID&k=3]  steps as they are made, as server-sent events (event: step | dropped | end)
    POST /v1/control                     {"action": "pause" | "resume" | "attach" | "detach", "layers": ...,
                                          "target": ..., "embedding": ..., "models": "GLOB"}

Secure by default. It always listens on a Unix socket ``<run folder>/<pid>.sock``, mode 0600 in a run folder
that :func:`~nxl_hooks.apps.serve.runs.check_private` accepted, and checks the peer's uid at accept: only the
user who started the program (or root) gets in. With ``--listen HOST:PORT`` it also serves HTTP, on loopback
unless ``--allow-remote`` was given, and every request there needs ``Authorization: Bearer <token>`` with the
token of ``<run folder>/token`` (0600). Prompts are user data: nothing is served without one of the two.

It never starves the host (docs/security.md): each listener serves at most :data:`MAX_CONNECTIONS` connections at
once, one thread each, and closes any connection over that at once (the Unix socket has its own bound, so the
owner gets in while the TCP port is flooded); event streams take at most :data:`MAX_STREAMS` of them, so status
and ``nxl ctl`` always get in, and a stream whose reader closed its connection ends within a poll of its feed; a
request must arrive whole within :data:`REQUEST_SECONDS`; a body needs a valid ``Content-Length`` of at most
:data:`MAX_BODY` bytes; a reader that stops reading is dropped after :data:`WRITE_SECONDS`. Every error is
``{"error": "..."}`` with a 4xx status, or a 500 that names no Python internals (the program's log has them).

Why the standard library's ``http.server`` and not uvicorn/starlette: the endpoint runs inside any Python program
(not only servers that ship uvicorn), in its own daemon threads, and must not touch the program's event loop; a
control plane for one operator needs no more than a thread per connection. Its one signal handler goes only where
SIGTERM/SIGHUP still have their default action (the process dies): it removes the socket, then dies the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import hmac
import io
import json
import logging
import os
import signal
import socket
import socketserver
import stat
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator, Protocol
from urllib.parse import parse_qs, unquote, urlsplit

from ...arch.spec import HeadKind
from ...records.files import file_in_the_way, json_value
from ...records.reader import read_stream
from ...records.steps import GenerationCall, Step
from ...hooks.probe import end_records
from ...hooks.subscription import Subscription
from ...records.writer import stream_bytes
from .readout import Watched, call_view, ended, forward_view, step_view, summary
from .runs import check_private, enlist, peer_uid, run_token, socket_path
from .settings import NoMatch, Settings, address_family, parse_listen

__all__ = ["MAX_BODY", "MAX_CONNECTIONS", "MAX_STREAMS", "REQUEST_SECONDS", "WRITE_SECONDS", "ControlServer",
           "bind_socket"]

_log = logging.getLogger("nxl_hooks")
#: Seconds between the event stream's comments: a reader hearing nothing for a few times that knows the process is
#: not answering (`nxl tail`).
KEEPALIVE = 10.0
MAX_CONNECTIONS = 16  #: connections (and handler threads) per listener; one more is closed at once
#: event streams per listener: the other connections stay free for status and nxl ctl, however many readers come
MAX_STREAMS = MAX_CONNECTIONS - 2
REQUEST_SECONDS = 5.0  #: a request (line, headers, body) must arrive whole within this time, or is dropped
WRITE_SECONDS = 30.0  #: a reader that takes no bytes for this long is dropped
MAX_BODY = 64 << 10  #: bytes of a request body (a control action is a few hundred)


class _BadRequest(Exception):
    """A refusal: ``status`` and the answer's ``error``, with ``answer``'s fields beside it (what a client reads)."""

    def __init__(self, status: int, message: str, **answer: Any) -> None:
        super().__init__(message)
        self.status, self.answer = status, answer


class _Deadline(io.RawIOBase):
    """A socket's reading side that gives up once ``deadline`` (time.monotonic) has passed: a client that sends
    a byte every few seconds cannot hold a handler thread longer than a client that sends nothing."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class _Handler(BaseHTTPRequestHandler):
    server_version = "nxl_hooks"
    protocol_version = "HTTP/1.0"  # one request per connection; an event stream ends when the connection closes
    default_request_version = "HTTP/1.0"  # a garbled request line still gets a status line and a JSON error

    # -- plumbing ----------------------------------------------------------------------------------------

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BufferedReader(_Deadline(self.connection, time.monotonic() + REQUEST_SECONDS))

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the host's stderr stays quiet
        pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line, a header too long, an unknown method) as JSON."""
        self.close_connection = True
        try:
            self._json(code, {"error": message or self.responses.get(code, ("error",))[0]})
        except OSError:
            pass

    def reader_left(self) -> bool:
        """Whether the client closed its connection (or reset it). A stream's reader sends nothing after its request,
        so an end of input means it is gone (as nginx takes it): peeked without waiting, nothing read."""
        sock = self.connection
        timeout = sock.gettimeout()
        sock.settimeout(0)  # with a timeout, recv would first wait for input
        try:
            return sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:  # nothing to read: still connected
            return False
        except OSError:
            return True
        finally:
            sock.settimeout(timeout)

    def _authorized(self) -> bool:
        token = self.server.token
        if token is None:  # the Unix socket: its peer was checked at accept (_Listener.verify_request)
            return True
        # the scheme in any case (RFC 7235); the token compared in constant time
        scheme, _, given = self.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="nxl_hooks"')
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, value: Any) -> None:
        # allow_nan=False: a NaN or inf that reaches a reply fails here, not in its reader's parser (views send None)
        self._send(status, json.dumps(value, allow_nan=False).encode())

    def _body_length(self) -> int:
        """The body's size as its Content-Length declares it: a number, given once, at most MAX_BODY."""
        if "Transfer-Encoding" in self.headers:
            raise _BadRequest(411, "send the body with a Content-Length, not a Transfer-Encoding")
        declared = self.headers.get_all("Content-Length") or ["0"]
        if len(set(declared)) != 1 or not declared[0].strip().isdigit() or not declared[0].strip().isascii():
            raise _BadRequest(400, f"Content-Length {', '.join(declared)!r:.80}: give the body's size in bytes, once")
        length = int(declared[0])
        if length > MAX_BODY:
            raise _BadRequest(413, f"a body of {length} bytes: the control endpoint takes at most {MAX_BODY}")
        return length

    def _read_body(self, length: int) -> bytes:
        """The whole body, all of it within the request's time."""
        try:
            body = self.rfile.read(length)
        except TimeoutError:
            body = None
        if body is None or len(body) < length:
            raise _BadRequest(400, f"the body is shorter than its Content-Length ({length} bytes) or came too "
                                   f"slowly: send all of it within {REQUEST_SECONDS:g} s")
        return body

    def _discard_input(self) -> None:
        """After refusing a body unread: end our side, then read what the client still sends (at most one second,
        1 MiB), so that closing does not reset the connection and lose the answer on its way."""
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_WR)
        deadline, left = time.monotonic() + 1.0, 1 << 20
        while left > 0 and (wait := deadline - time.monotonic()) > 0:
            self.connection.settimeout(wait)
            chunk = self.connection.recv(min(left, 65536))
            if not chunk:
                return
            left -= len(chunk)

    def _dispatch(self, method: str) -> None:
        self.request_body: bytes | None = None
        try:
            length = self._body_length()
            if not self._authorized():  # before the body: a stranger's bytes are not read
                raise _BadRequest(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' with "
                                       "the token in the run folder's token file")
            self.request_body = self._read_body(length)
            self.connection.settimeout(WRITE_SECONDS)  # read whole: from now on, only a reader that stalls
            url = urlsplit(self.path)
            query = {key: values[-1] for key, values in parse_qs(url.query).items()}
            parts = [unquote(part) for part in url.path.strip("/").split("/")]
            self.server.app.route(self, method, parts, query)
        except _BadRequest as error:
            self.close_connection = True
            try:
                self._json(error.status, {"error": str(error), **error.answer})
                if self.request_body is None:
                    self._discard_input()
            except OSError:
                pass
        except OSError:  # the reader left or stalled (BrokenPipe, ConnectionReset, a write that timed out)
            self.close_connection = True
        except Exception as error:  # noqa: BLE001 - a failing readout is the reader's problem, not the host's
            _log.warning("nxl_hooks: control endpoint: %s %s: %s: %s", method, self.path.split("?")[0],
                         type(error).__name__, error)
            try:
                self._json(500, {"error": "the control endpoint failed on this request; the program's log says why"})
            except OSError:
                pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def body(self) -> dict:
        """The request body as a JSON object (400 when it is not one)."""
        try:
            value = json_value(self.request_body or b"{}")
        except ValueError as error:
            raise _BadRequest(400, f"the body is not a JSON object: {error}") from None
        if not isinstance(value, dict):
            raise _BadRequest(400, "the body must be a JSON object")
        return value


class _Listener:
    """What both listeners share: at most MAX_CONNECTIONS connections at once, one daemon thread each; one more
    gets a short 503 and is closed at once, without a thread."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # the kernel's backlog: a burst of connections is refused by us, not by SYN drops

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.streams = 0  #: event streams open, at most MAX_STREAMS
        self.streams_changed = threading.Condition()  # guards streams; notified as one ends, for what waits on that
        super().__init__(*args, **kwargs)

    @contextlib.contextmanager
    def stream_slot(self) -> Iterator[None]:
        """One of the listener's MAX_STREAMS event streams, held while it is served; a 503 once they are taken."""
        with self.streams_changed:
            if self.streams >= MAX_STREAMS:
                raise _BadRequest(503, f"{self.streams} readers are connected to /v1/stream already, the most it "
                                       f"serves at once (the other {MAX_CONNECTIONS - MAX_STREAMS} connections are "
                                       "kept for status and nxl ctl): close one, or try again shortly")
            self.streams += 1
        try:
            yield
        finally:
            with self.streams_changed:
                self.streams -= 1
                self.streams_changed.notify_all()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            try:
                request.setblocking(False)
                body = json.dumps({"error": f"the control endpoint is serving {MAX_CONNECTIONS} connections "
                                            "already; try again shortly"}).encode()
                request.send(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        # socketserver.ThreadingMixIn's, with the slot given back before the connection closes: a client that read
        # its answer to the end (the close) and asks again at once finds its slot free, so a stream refused, or a
        # status just answered, never holds one of the connections kept for status and nxl ctl past its close
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - as socketserver: said by handle_error, the listener goes on
            self.handle_error(request, client_address)
        finally:
            self.slots.release()
            self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):  # a client that reset its connection is no news for the host's log
            _log.warning("nxl_hooks: control endpoint: %s: %s", type(error).__name__, error)


class _UnixServer(_Listener, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    def server_bind(self) -> None:
        bind_socket(Path(self.server_address), self.socket)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        uid = peer_uid(request)  # before a slot or a thread: only this user, or root, is served
        return uid is None or uid in (os.getuid(), 0)


class _TCPServer(_Listener, ThreadingHTTPServer):
    def __init__(self, address: tuple[str, int], handler: type) -> None:
        self.address_family = address_family(address[0])  # (ThreadingHTTPServer's own is AF_INET: [::1] fails)
        super().__init__(address, handler)


def _host_port(host: str, port: int) -> str:
    """``host:port`` as --listen takes it: an IPv6 address in brackets (``[::1]:8765``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_socket(path: Path, sock: socket.socket) -> None:
    """Bind ``sock`` (AF_UNIX) to ``path`` in a checked run folder, mode 0600 before it listens. bind() never
    replaces a file; the one file removed first is a socket of this user left by an earlier process with this
    pid (dead, since the pid is ours now). Anything else there is refused with PermissionError."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    if info is not None:
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
            raise PermissionError(f"{path} is there already and is not a socket of this user: not replacing it")
        path.unlink()
    sock.bind(str(path))
    os.chmod(path, 0o600)  # before listen(): nobody connects before it is private
    info = os.lstat(path)
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{path} changed under the endpoint: not serving there")


# -- stale sockets: removed at exit, SIGTERM and SIGHUP included ---------------------------------------------------

_CLEANUP: list[tuple[int, Path]] = []  # (pid, file): removed by that process only (a forked child keeps its parent's)
_CLEANUP_LOCK = threading.RLock()  # re-entrant: the signal handler may run while the main thread holds it


def _clean_up() -> None:
    with _CLEANUP_LOCK:
        mine = [path for pid, path in _CLEANUP if pid == os.getpid()]
        _CLEANUP[:] = [(pid, path) for pid, path in _CLEANUP if pid != os.getpid()]
    for path in mine:
        _remove(path)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:  # gone already, or the folder with it
        pass


def _die(signum: int, frame: Any) -> None:
    """SIGTERM/SIGHUP where the program left the default action: end the records (each running call's end frame
    says so, the sinks write what is queued: :func:`~nxl_hooks.hooks.probe.end_records`, a few seconds at most),
    remove the files, then die of the signal. A second one meanwhile kills at once."""
    signal.signal(signum, signal.SIG_DFL)
    try:
        end_records(signal.Signals(signum).name, frame)
    except BaseException:  # noqa: BLE001 - the process dies of the signal all the same
        pass
    _clean_up()
    os.kill(os.getpid(), signum)


_die.__nxl_attach__ = True  # nxl's own, as nxl attach's script marks its handler: nxl detach gives the default back


def own_signals() -> None:
    """In the main thread, where alone Python sets handlers: :func:`_die` for SIGTERM and SIGHUP where the program
    left their default action (its own handler stays: it exits through atexit, which removes the files too)."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) == signal.SIG_DFL:
            try:
                signal.signal(signum, _die)
            except (OSError, ValueError):  # an interpreter without signal support: atexit still removes them
                pass


def _forget(*paths: Path | None) -> None:
    with _CLEANUP_LOCK:
        _CLEANUP[:] = [(pid, path) for pid, path in _CLEANUP if path not in paths]


def _remove_at_exit(*paths: Path) -> None:
    with _CLEANUP_LOCK:
        first = not _CLEANUP
        _CLEANUP.extend((os.getpid(), path) for path in paths)
    if first:  # (the list empties as each endpoint stops: registered once, not once per endpoint started)
        atexit.unregister(_clean_up)
        atexit.register(_clean_up)
    if threading.current_thread() is threading.main_thread():  # (elsewhere a graceful exit still runs atexit)
        own_signals()


def _int(query: dict, name: str, default: int, low: int = 0, high: int = 1000) -> int:
    try:
        value = int(query.get(name, default))
    except ValueError:
        raise _BadRequest(400, f"{name}={query.get(name)!r:.80}: give a whole number") from None
    if not low <= value <= high:
        raise _BadRequest(400, f"{name}={value}: give a number from {low} to {high}")
    return value


def _started(query: dict) -> float | None:
    """``?started=``: which of the calls and forwards of a request id, by its ``started`` in /v1/requests."""
    if "started" not in query:
        return None
    try:
        return float(query["started"])
    except ValueError:
        raise _BadRequest(400, f"started={query['started']!r:.80}: give the request's started time as /v1/requests "
                               "lists it") from None


def _rows(call: GenerationCall) -> int:
    """The rows (batch size) of a call: what ``?row=`` may pick from."""
    if call.prompt_ids is not None:
        return int(call.prompt_ids.shape[0])
    steps = list(call.steps)
    return int(steps[0].token.shape[0]) if steps else 1


class Shown(Protocol):
    """One step as a live reader gets it (:class:`~nxl_hooks.apps.serve.controller.LiveStep`)."""

    @property
    def watch(self) -> Watched: ...

    @property
    def call(self) -> GenerationCall | None: ...

    @property
    def step(self) -> Step: ...


class Host(Protocol):
    """What the endpoint asks of the controller it serves (:class:`~nxl_hooks.apps.serve.controller.Controller`:
    the endpoint is below it, so it names what it uses instead of importing it)."""

    settings: Settings
    endpoint: Any

    def status(self) -> dict: ...

    def records(self) -> list[tuple[Watched, Any, dict]]: ...

    def find(self, request_id: str, *, generation: bool = False,
             started: float | None = None) -> tuple[Watched, Any, dict] | None: ...

    def watches(self) -> list[Watched]: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def configure(self, *, models: str | list[str] | None = None, **options: Any) -> None: ...

    def exclude(self, models: str | list[str] | None = None) -> None: ...

    def subscribe(self, request_id: str | None = None) -> Subscription[Shown]: ...

    def unsubscribe(self, reader: Subscription[Shown]) -> None: ...


def _may_generate(watch: Any) -> bool:
    """Whether the model ``watch`` follows may still serve a request a generation call after a plain forward (a
    causal LM scores a prompt, then generates under its id): its stream waits for that call."""
    probe = watch.probe or watch.detached
    return probe is None or probe.kind is HeadKind.CAUSAL_LM


class ControlServer:
    """The endpoint of one controller (module docstring): ``ControlServer(controller).start()``. Its threads are
    daemons: they end with the program, and the socket file is removed at exit (SIGTERM included)."""

    def __init__(self, controller: Host) -> None:
        self.controller = controller
        self.settings = controller.settings
        self.socket: Path | None = None
        self.address: tuple[str, int] | None = None
        self._servers: list[socketserver.BaseServer] = []
        self._entry: Path | None = None

    def describe(self) -> dict:
        return {"socket": str(self.socket) if self.socket else None,
                "http": _host_port(*self.address) if self.address else None}

    def start(self) -> None:
        """Serve on ``<run folder>/<pid>.sock`` (and ``--listen``'s address), once the run folder passed
        :func:`~nxl_hooks.apps.serve.runs.check_private`; enlisted as one of this user's live runs."""
        run_dir = self.settings.run_dir.resolve()
        blocked = file_in_the_way(run_dir)  # (mkdir said only "[Errno 17] File exists: ..." or "[Errno 20] Not a ...")
        if blocked is not None:
            what = "is a file" if blocked == run_dir else f"is below {blocked}, a file, not a folder"
            raise NotADirectoryError(f"the run folder {run_dir} (NXL_RUN_DIR) {what}: give a folder, or leave "
                                     "NXL_RUN_DIR unset")
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(run_dir)
        path = socket_path(run_dir, os.getpid())
        server = _UnixServer(str(path), _Handler)
        self.socket = path
        _remove_at_exit(path)  # first: nothing after this leaves the socket behind
        try:
            self._entry = enlist(path)
        except OSError as error:  # the list is a convenience (nxl ctl / tail without --run): the endpoint serves on
            _log.warning("nxl_hooks: process %d is not among this user's live runs (%s: %s): nxl ctl and nxl tail "
                         "reach it with --run %s", os.getpid(), type(error).__name__, error, run_dir)
        else:
            _remove_at_exit(self._entry)
        self._serve(server, token=None)
        if self.settings.listen:
            self._listen()

    def _listen(self) -> None:
        try:
            host, port = parse_listen(self.settings.listen, allow_remote=self.settings.allow_remote)
            token = run_token(self.settings.run_dir)  # (written here under import nxl_hooks.auto)
            if len(token) < 16:
                raise ValueError(f"the token in {self.settings.run_dir} is too short to guard anything")
            server = _TCPServer((host, port), _Handler)
        except Exception as error:  # noqa: BLE001 - another worker has the port: the Unix socket still works
            _log.warning("nxl_hooks: no HTTP control endpoint in process %d (%s: %s); its Unix socket is %s",
                         os.getpid(), type(error).__name__, error, self.socket)
            return
        self._serve(server, token=token)
        self.address = server.server_address[:2]
        if port == 0:  # the port the system picked: said nowhere else but nxl ctl status, which needs the address
            _log.warning("nxl_hooks: process %d serves HTTP control on http://%s (--listen %s)", os.getpid(),
                         _host_port(*self.address), self.settings.listen)

    def _serve(self, server: socketserver.BaseServer, *, token: str | None) -> None:
        server.app, server.token = self, token
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5},
                                  name="nxl-control", daemon=True)
        thread.start()
        self._servers.append(server)

    def stop(self) -> None:
        """Close the endpoint: its listening sockets, its threads, the socket file and the live-run entry."""
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for path in (self.socket, self._entry):
            if path is not None:
                _remove(path)
        _forget(self.socket, self._entry)  # nothing of a stopped endpoint stays referenced (nxl detach)

    # -- routes ------------------------------------------------------------------------------------------

    def route(self, handler: _Handler, method: str, parts: list[str], query: dict) -> None:
        if parts[:1] != ["v1"]:
            raise _BadRequest(404, f"no such endpoint {handler.path!r}: see /v1/status, /v1/requests, /v1/stream")
        rest = parts[1:]
        if method == "GET" and rest == ["status"]:
            return handler._json(200, self.controller.status())
        if method == "GET" and rest == ["requests"]:
            records = self.controller.records()[-_int(query, "limit", 1000, 1, 100000):]
            return handler._json(200, {"requests": [summary(watch, call) for watch, call, _ in records]})
        if method == "GET" and len(rest) == 2 and rest[0] == "requests":
            watch, record, _ = self._find(rest[1], _started(query))
            k = _int(query, "k", 5, 1)
            if isinstance(record, GenerationCall):
                view = call_view(watch, record, k=k, row=_int(query, "row", 0, 0, _rows(record) - 1))
            else:
                view = forward_view(watch, record, k=k)
            return handler._json(200, view)
        if method == "GET" and len(rest) == 3 and rest[0] == "requests" and rest[2] == "frames":
            return handler._send(200, self._frames(rest[1]), "application/octet-stream")
        if method == "GET" and rest == ["stream"]:
            request_id, k = query.get("request_id") or None, _int(query, "k", 3, 1)
            with handler.server.stream_slot():
                return self._stream(handler, request_id, k)
        if method == "POST" and rest == ["control"]:
            return handler._json(200, self._control(handler.body()))
        raise _BadRequest(404 if method == "GET" else 405, f"no such endpoint: {method} {handler.path}")

    def _find(self, request_id: str, started: float | None) -> tuple:
        found = self.controller.find(request_id, started=started)
        if found is None:
            when = "" if started is None else f" that started at {started!r}"
            raise _BadRequest(404, f"no request {request_id!r}{when} in memory (see /v1/requests; older ones are in "
                                   "the sink: nxl.read_stream(run folder, request_id=...))")
        return found

    def _frames(self, request_id: str) -> bytes:
        found = self.controller.find(request_id, generation=True)
        if found is None and self.controller.find(request_id) is not None:
            raise _BadRequest(404, f"{request_id!r} was a forward, not a generation: its record is "
                                   f"/v1/requests/{request_id}")
        if found is not None and (found[1].prompt_mask is not None or found[1].ended is not None):
            return stream_bytes(found[1], found[2])  # (one not recorded too, once ended: its end says why)
        if self.settings.sink:  # no longer in memory: this process's files
            for watch in self.controller.watches():
                folder = self.settings.run_dir / watch.slug
                calls = read_stream(folder, request_id=request_id) if folder.is_dir() else []
                if calls:
                    return stream_bytes(calls[-1], {})
        raise _BadRequest(404, f"no recorded request {request_id!r} in this process")

    def _control(self, body: dict) -> dict:
        action, controller = body.get("action"), self.controller
        try:  # what nxl ctl sends, read as the variables are (the settings' group declares which options)
            options = type(self.settings).changes({key: value for key, value in body.items() if key != "action"})
        except ValueError as error:  # the option's own message says what is wrong
            raise _BadRequest(400, str(error)) from None
        models = options.pop("models", None)
        if action == "pause":
            controller.pause()
        elif action == "resume":
            controller.resume()
        elif action in ("attach", "detach"):
            try:
                if action == "attach":
                    controller.configure(models=models, **options)
                else:
                    controller.exclude(models)
            except NoMatch as error:  # nxl ctl reads `loaded`: another process of the run may hold the model
                raise _BadRequest(404, str(error), loaded=error.loaded) from None
            except ValueError as error:
                raise _BadRequest(400, str(error)) from None
        else:
            raise _BadRequest(400, f"action={action!r:.80}: use pause, resume, attach or detach")
        return controller.status()

    def _stream(self, handler: _Handler, request_id: str | None, k: int) -> None:
        """Server-sent events: ``step`` per step made, a :class:`~nxl_hooks.records.view.StepView` (one request's,
        from its first step, then ``end``; or every request's from now on); ``dropped`` (the total so far) when
        this reader fell behind and lost steps; ``: keepalive`` comments while idle."""
        controller = self.controller
        reader = controller.subscribe(request_id)
        try:
            handler.send_response(200)
            handler.send_header("Content-Type", "text/event-stream")
            handler.send_header("Cache-Control", "no-store")
            handler.end_headers()
            handler.wfile.flush()
            watched = None  # (watch, call) of the request, once seen
            replayed = 0  # steps of the request's call sent: those the feed hands on again are not sent twice
            dropped = 0

            def emit(event: str, data: dict) -> None:
                handler.wfile.write(f"event: {event}\ndata: {json.dumps(data, allow_nan=False)}\n\n".encode())
                handler.wfile.flush()

            def send_step(watch: Watched, call: GenerationCall | None, step: Step) -> None:
                # Only the request's own call is replayed, so only its steps can come twice. Told apart by the
                # object, never by id(): a call that left memory frees its id for the next one, whose first
                # steps were then taken for sent and lost.
                nonlocal replayed
                if watched is not None and call is watched[1]:
                    if step.step < replayed:
                        return
                    replayed = step.step + 1
                # with the model, when its call started tells apart the calls of a request id used again
                emit("step", {**step_view(watch, call, step, k=k).to_json(),
                              "call_started": call.started if call is not None else None})

            idle = time.monotonic()
            while True:
                if request_id is not None and watched is None:
                    found = controller.find(request_id, generation=True)
                    if found is not None:
                        watched = found[:2]
                        for step in list(watched[1].steps):  # joined mid-request (or after): replay
                            send_step(*watched, step)
                    elif (forward := controller.find(request_id)) is not None and not _may_generate(forward[0]):
                        emit("end", summary(*forward[:2]))  # a classifier's request has no steps: said, not awaited
                        return
                item = reader.get(timeout=0.25)
                if reader.dropped > dropped:
                    dropped = reader.dropped
                    emit("dropped", {"dropped": dropped})
                if item is None:
                    # closed (nxl detach), or its reader left: no reader keeps a thread (a connection) here
                    if controller.endpoint is not self or handler.reader_left():
                        return
                    if watched is not None and ended(watched[1]):
                        # The call ends in the publisher once its steps are kept, before the last of them has come
                        # through the live feed to this reader: those still on their way are sent from memory.
                        for step in list(watched[1].steps):
                            send_step(*watched, step)
                        emit("end", summary(*watched))
                        return
                    if time.monotonic() - idle > KEEPALIVE:
                        handler.wfile.write(b": keepalive\n\n")
                        handler.wfile.flush()
                        idle = time.monotonic()
                    continue
                idle = time.monotonic()
                if watched is None and request_id is not None and item.call is not None:
                    watched = (item.watch, item.call)
                if watched is not None and item.call is not watched[1]:
                    continue  # another call that uses the id: the stream follows one, which its end counts
                send_step(*item)
        finally:
            controller.unsubscribe(reader)
