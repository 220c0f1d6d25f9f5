"""The control endpoint of one process: a live readout of its records and the switches of ``nxl ctl``.

    GET  /v1/status                      the process, its models, hooks and options
    GET  /v1/requests                    the requests in memory, oldest first ({"requests": [...]})
    GET  /v1/requests/ID?k=5             one request: per step, the top-k context tokens of every layer (a
                                         classifier's: per explained row)
    GET  /v1/requests/ID/frames          one request as a stream file (nxl.read_stream reads it)
    GET  /v1/stream[?request_id=ID&k=3]  steps as they are made, as server-sent events (event: step | end)
    POST /v1/control                     {"action": "pause" | "resume" | "attach" | "detach", "layers": ...,
                                          "target": ..., "embedding": ..., "models": "GLOB"}

Secure by default. It always listens on a Unix socket ``<run folder>/<pid>.sock``, mode 0600, and also checks the
peer's uid: only the user who started the program gets in. With ``--listen HOST:PORT`` it also serves HTTP, on
loopback unless ``--allow-remote`` was given, and every request there needs ``Authorization: Bearer <token>``
with the token of ``<run folder>/token`` (0600). Prompts are user data: nothing is served without one of the two.

Why the standard library's ``http.server`` and not uvicorn/starlette: the endpoint runs inside any Python program
(not only servers that ship uvicorn), in its own daemon threads, and must not touch the program's event loop or
signal handlers; a control plane for one operator needs no more than a thread per connection.
"""

from __future__ import annotations

import atexit
import hmac
import json
import logging
import os
import queue
import socket
import socketserver
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from ...records.sink import read_stream, stream_bytes
from ...records.steps import GenerationCall
from ..options import parse_layers, parse_target
from .readout import call_view, ended, forward_view, step_view, summary
from .runs import read_token, socket_path
from .settings import parse_listen

__all__ = ["ControlServer"]

_log = logging.getLogger("nxl_hooks")
_KEEPALIVE = 10.0  # seconds between SSE comments: a reader that left is noticed within that time


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    server_version = "nxl_hooks"
    protocol_version = "HTTP/1.0"  # one request per connection; an event stream ends when the connection closes

    # -- plumbing ----------------------------------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the host's stderr stays quiet
        pass

    def _authorized(self) -> bool:
        token = self.server.token
        if token is None:  # the Unix socket: file mode 0600, and the peer must be this user
            if not hasattr(socket, "SO_PEERCRED"):
                return True
            creds = self.connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            return uid in (os.getuid(), 0)
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

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
        self._send(status, json.dumps(value).encode())

    def _dispatch(self, method: str) -> None:
        try:
            if not self._authorized():
                raise _BadRequest(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' with "
                                       "the token in the run folder's token file")
            url = urlsplit(self.path)
            query = {key: values[-1] for key, values in parse_qs(url.query).items()}
            parts = [unquote(part) for part in url.path.strip("/").split("/")]
            self.server.app.route(self, method, parts, query)
        except _BadRequest as error:
            self._json(error.status, {"error": str(error)})
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as error:  # noqa: BLE001 - a failing readout is the reader's problem, not the host's
            _log.warning("nxl_hooks: control endpoint: %s: %s", type(error).__name__, error)
            try:
                self._json(500, {"error": f"{type(error).__name__}: {error}"})
            except OSError:
                pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        if length > 1 << 20:
            raise _BadRequest(413, "request body too large")
        try:
            value = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError as error:
            raise _BadRequest(400, f"the body is not JSON: {error}") from None
        if not isinstance(value, dict):
            raise _BadRequest(400, "the body must be a JSON object")
        return value


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False

    def server_bind(self) -> None:
        path = Path(self.server_address)
        if path.exists() or path.is_symlink():
            path.unlink()  # our pid's socket from an earlier process with the same pid
        super().server_bind()
        os.chmod(path, 0o600)  # before listen(): nobody else connects, ever

    def handle_error(self, request: Any, client_address: Any) -> None:
        _log.warning("nxl_hooks: control endpoint: %s", sys.exc_info()[1])


class _TCPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        _log.warning("nxl_hooks: control endpoint: %s", sys.exc_info()[1])


def _int(query: dict, name: str, default: int, low: int = 0, high: int = 1000) -> int:
    try:
        value = int(query.get(name, default))
    except ValueError:
        raise _BadRequest(400, f"{name}={query.get(name)!r}: give a whole number") from None
    if not low <= value <= high:
        raise _BadRequest(400, f"{name}={value}: give a number from {low} to {high}")
    return value


class ControlServer:
    """The endpoint of one controller (module docstring): ``ControlServer(controller).start()``. Its threads are
    daemons: they end with the program, and the socket file is removed at a normal exit."""

    def __init__(self, controller: Any) -> None:
        self.controller = controller
        self.settings = controller.settings
        self.socket: Path | None = None
        self.address: tuple[str, int] | None = None
        self._servers: list[socketserver.BaseServer] = []

    def describe(self) -> dict:
        return {"socket": str(self.socket) if self.socket else None,
                "http": f"{self.address[0]}:{self.address[1]}" if self.address else None}

    def start(self) -> None:
        run_dir = self.settings.run_dir
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = socket_path(run_dir, os.getpid())
        server = _UnixServer(str(path), _Handler)
        self._serve(server, token=None)
        self.socket = path
        atexit.register(self._remove_socket, os.getpid())
        if self.settings.listen:
            self._listen()

    def _listen(self) -> None:
        try:
            host, port = parse_listen(self.settings.listen, allow_remote=self.settings.allow_remote)
            token = read_token(self.settings.run_dir)
            if len(token) < 16:
                raise ValueError(f"the token in {self.settings.run_dir} is too short to guard anything")
            server = _TCPServer((host, port), _Handler)
        except Exception as error:  # noqa: BLE001 - another worker has the port: the Unix socket still works
            _log.warning("nxl_hooks: no HTTP control endpoint in process %d (%s: %s); its Unix socket is %s",
                         os.getpid(), type(error).__name__, error, self.socket)
            return
        self._serve(server, token=token)
        self.address = server.server_address[:2]

    def _serve(self, server: socketserver.BaseServer, *, token: str | None) -> None:
        server.app, server.token = self, token
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5},
                                  name="nxl-control", daemon=True)
        thread.start()
        self._servers.append(server)

    def stop(self) -> None:
        """Close the endpoint: its listening sockets, its threads, the socket file."""
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._remove_socket(os.getpid())
        atexit.unregister(self._remove_socket)  # nothing of a stopped endpoint stays referenced (nxl detach)

    def _remove_socket(self, pid: int) -> None:
        if self.socket is not None and pid == os.getpid():  # not from a forked child's exit
            self.socket.unlink(missing_ok=True)

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
            watch, record, _ = self._find(rest[1])
            k = _int(query, "k", 5, 1)
            view = (call_view(watch, record, k=k, row=_int(query, "row", 0)) if isinstance(record, GenerationCall)
                    else forward_view(watch, record, k=k))
            return handler._json(200, view)
        if method == "GET" and len(rest) == 3 and rest[0] == "requests" and rest[2] == "frames":
            return handler._send(200, self._frames(rest[1]), "application/octet-stream")
        if method == "GET" and rest == ["stream"]:
            return self._stream(handler, query.get("request_id") or None, _int(query, "k", 3, 1))
        if method == "POST" and rest == ["control"]:
            return handler._json(200, self._control(handler.body()))
        raise _BadRequest(404 if method == "GET" else 405, f"no such endpoint: {method} {handler.path}")

    def _find(self, request_id: str) -> tuple:
        found = self.controller.find(request_id)
        if found is None:
            raise _BadRequest(404, f"no request {request_id!r} in memory (see /v1/requests; older ones are in the "
                                   "sink: nxl.read_stream(run folder, request_id=...))")
        return found

    def _frames(self, request_id: str) -> bytes:
        found = self.controller.find(request_id)
        if found is not None and not isinstance(found[1], GenerationCall):
            raise _BadRequest(404, f"{request_id!r} was a forward, not a generation: its record is "
                                   f"/v1/requests/{request_id}")
        if found is not None and found[1].prompt_mask is not None:
            return stream_bytes(found[1], found[2])
        if self.settings.sink:  # no longer in memory: this process's files
            for watch in self.controller.watches():
                folder = self.settings.run_dir / watch.slug
                calls = read_stream(folder, request_id=request_id) if folder.is_dir() else []
                if calls:
                    return stream_bytes(calls[-1], {})
        raise _BadRequest(404, f"no recorded request {request_id!r} in this process")

    def _control(self, body: dict) -> dict:
        action, controller = body.get("action"), self.controller
        try:
            options = {"layers": parse_layers(str(body["layers"])) if body.get("layers") is not None else None,
                       "target": parse_target(str(body["target"])) if body.get("target") is not None else None,
                       "embedding": body.get("embedding")}
        except Exception as error:  # noqa: BLE001 - argparse's own message says what is wrong
            raise _BadRequest(400, str(error)) from None
        if options["embedding"] not in (None, "layer_input", "word"):
            raise _BadRequest(400, f"embedding={options['embedding']!r}: use layer_input or word")
        models = body.get("models")
        if action == "pause":
            controller.pause()
        elif action == "resume":
            controller.resume()
        elif action == "attach":
            try:
                controller.configure(models=models, **options)
            except ValueError as error:
                raise _BadRequest(400, str(error)) from None
        elif action == "detach":
            controller.exclude(models)
        else:
            raise _BadRequest(400, f"action={action!r}: use pause, resume, attach or detach")
        return controller.status()

    def _stream(self, handler: _Handler, request_id: str | None, k: int) -> None:
        """Server-sent events: ``step`` per step made (one request's, from its first step, then ``end``; or every
        request's from now on), ``: keepalive`` comments while idle."""
        controller = self.controller
        feed = controller.subscribe(request_id)
        try:
            handler.send_response(200)
            handler.send_header("Content-Type", "text/event-stream")
            handler.send_header("Cache-Control", "no-store")
            handler.end_headers()
            handler.wfile.flush()
            sent: dict[int, int] = {}  # id(call) -> steps sent
            watched = None  # (watch, call) of the request, once seen

            def emit(event: str, data: dict) -> None:
                handler.wfile.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
                handler.wfile.flush()

            def send_step(watch: Any, call: Any, step: Any) -> None:
                key = id(call)
                if call is not None and step.step < sent.get(key, 0):
                    return  # already replayed
                sent[key] = step.step + 1
                view = step_view(watch.texts, call, step, k=k)
                emit("step", {"request_id": call.request_id if call else None, "model": watch.name, **view})

            idle = time.monotonic()
            while True:
                if request_id is not None and watched is None:
                    found = controller.find(request_id)
                    if found is not None and isinstance(found[1], GenerationCall):
                        watched = found[:2]
                        for step in list(watched[1].steps):  # joined mid-request (or after): replay
                            send_step(*watched, step)
                try:
                    watch, call, step = feed.queue.get(timeout=0.25)
                except queue.Empty:
                    if controller.endpoint is not self:  # closed (nxl detach): no reader keeps a thread here
                        return
                    if watched is not None and ended(watched[1]):
                        emit("end", summary(*watched))
                        return
                    if time.monotonic() - idle > _KEEPALIVE:
                        handler.wfile.write(b": keepalive\n\n")
                        handler.wfile.flush()
                        idle = time.monotonic()
                    continue
                idle = time.monotonic()
                if watched is None and request_id is not None and call is not None:
                    watched = (watch, call)
                send_step(watch, call, step)
        finally:
            controller.unsubscribe(feed)
