"""``nxl tail [--request-id ID]``: one short line per generated token of a running program, as it is made.

    nxl tail                         # every request of the last `nxl run`
    nxl tail --run runs/ --request-id my-req-1 --layer -1 -k 3

What a process does not record (its sink stopped writing, calls that run unrecorded) is a line of its own, ``!``
first, as soon as its status says so. Every line goes through
:func:`~nxl_hooks.records.tokens.visible` before the terminal sees it: request ids come from the network, and an
escape sequence in one is shown, never run.
"""

from __future__ import annotations

import argparse
import queue
import shutil
import threading
from urllib.parse import urlencode

from ...records.tokens import visible
from ..options import CliError, positive_int

NAME = "tail"
_FAULT_POLL = 2.0  #: seconds between two looks at each process's status for faults


def add_connect_options(parser: argparse.ArgumentParser) -> None:
    """--run and --token-file: which running program to talk to (shared with nxl ctl)."""
    parser.add_argument("--run", metavar="RUN",
                        help="the run folder nxl run printed, a control socket, or http://127.0.0.1:PORT "
                             "(default: your one live run)")
    parser.add_argument("--token-file", metavar="FILE", help="the bearer token file, for an http:// run")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(NAME, help="follow a running program's generated tokens live (one line each)",
                            description="Print one line per generated token: request, step, token, and the "
                                        "context tokens that drove it most at one layer.")
    add_connect_options(parser)
    parser.add_argument("--request-id", metavar="ID", help="only this request (from its first token; ends with it)")
    parser.add_argument("--layer", type=int, default=None, help="which recorded layer to show (default: the last)")
    parser.add_argument("-k", type=positive_int, default=3, help="context tokens per line (default 3)")
    parser.add_argument("--count", type=positive_int, metavar="N", help="stop after N tokens")
    return parser


def faults(model: dict) -> list[str]:
    """What one model of a status (``/v1/status``'s ``models``) does not record, one phrase each:
    ``["records not written to the sink: disk full", "2 calls not recorded (last: ...)"]``; empty while everything
    is recorded."""
    said = [f"records not written to the sink: {model['sink_fault']}"] if model.get("sink_fault") else []
    count, why = model.get("unrecorded_calls") or 0, model.get("unrecorded")
    if count or why:  # why reads "not recorded[ after step N] (...): reason"
        why = why if why and why.startswith("not recorded") else f"not recorded: {why or 'see the log'}"
        said.append(f"{count or 'some'} call{'' if count == 1 else 's'} {why}")
    return said


def line(data: dict, layer: int | None, width: int) -> str:
    """One step as a short line: ``req  step  'token'  L2: 'a' 0.41  '␣b' 0.33``. Tokens are readable texts
    (:mod:`nxl_hooks.records.tokens`), quoted as they are: a byte token reads ``'\\xf0\\x9f'``, escaped once."""
    top = data["top"]
    key = str(layer) if layer is not None and str(layer) in top else max(top, key=int)
    best = "  ".join(f"'{name}' {score:.3g}" if score is not None else f"'{name}' nan" for _, name, score in top[key])
    token = f"'{data['token']}'"
    text = visible(f"{visible(str(data['request_id']))[:16]:<16} {data['step']:>4} {token:>12}  L{key}: {best}")
    return text if len(text) <= width else text[: max(width - 1, 8)] + "…"


def run(args: argparse.Namespace) -> int:
    from ..serve.client import endpoints

    targets = endpoints(args.run, args.token_file)
    query = {"k": args.k, **({"request_id": args.request_id} if args.request_id else {})}
    items: queue.Queue = queue.Queue()

    def follow(endpoint) -> None:
        try:
            for event, data in endpoint.events(f"/v1/stream?{urlencode(query)}"):
                items.put((event, data))
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            items.put(("error", {"error": f"{endpoint.name}: {error}"}))
        items.put(("closed", {}))

    def watch_faults(endpoint) -> None:
        said: set[str] = set()
        while True:
            try:
                status = endpoint.json("GET", "/v1/status", timeout=10)
            except Exception:  # noqa: BLE001 - the stream reports a process that went away
                return
            for model in status.get("models", []):
                for fault in faults(model):
                    text = f"! pid {status.get('pid')} {model.get('name')}: {fault}"
                    if text not in said:
                        said.add(text)
                        items.put(("fault", {"text": text}))
            stop.wait(_FAULT_POLL)

    stop = threading.Event()
    for endpoint in targets:
        threading.Thread(target=follow, args=(endpoint,), daemon=True).start()
        threading.Thread(target=watch_faults, args=(endpoint,), daemon=True).start()
    try:
        return _show(items, args, len(targets))
    finally:
        stop.set()


def _show(items: queue.Queue, args: argparse.Namespace, open_streams: int) -> int:
    """Print what the follower threads put in ``items`` until the request ends, ``--count`` is reached or every
    stream has closed."""
    width, shown = shutil.get_terminal_size((120, 20)).columns, 0
    while open_streams:
        event, data = items.get()
        if event == "step":
            print(line(data, args.layer, width), flush=True)
            shown += 1
            if args.count and shown >= args.count:
                return 0
        elif event == "end":
            print(visible(f"{data['request_id']}: ended after {data['steps']} tokens"
                          + (f" ({data['error']})" if data.get("error") else "")), flush=True)
            return 0
        elif event == "fault":
            print(visible(data["text"]), flush=True)
        elif event == "error":
            raise CliError(data["error"])
        elif event == "closed":
            open_streams -= 1
    return 0
