"""``nxl tail [--request-id ID] [--last N]``: one short line per generated token of a running program, as it is
made.

    nxl tail                         # every request of the last `nxl run`, from now on
    nxl tail --last 3                # the last 3 requests in memory first, then on
    nxl tail --run runs/ --request-id my-req-1 --layer -1 -k 3
    nxl tail --method contrastive    # rank by another method the program's probe computes (nxl run --methods)

A line: request, step, ``@`` the token's position in the sequence, the token, then the context tokens that drove it
most at one layer, each as ``position:'text' score`` (a word the prompt holds twice is told apart by its
position)::

    my-req-1            0 @12   '␣Paris'  L2: 9:'␣France' 0.41  3:'␣capital' 0.33

A program that explains a fixed target (``nxl run --target``) ranks what drove that target: the line names it after
the token, ``'␣is'→'␣Paris'``.

Tokens are readable texts (:mod:`nxl_hooks.records.tokens`: ``␣`` a space, ``↵`` a newline). Tokens that each
hold part of one character (an emoji a byte-level tokenizer splits into 2 to 4 tokens) are shown as that character,
on each of them; the line of a token whose character is not complete yet shows ``…`` in its place, and the line of
the token that completes it the whole character (``'…'``, ``'…'``, ``'…'``, ``'😀'``): a line is printed when its
token is made, never changed afterwards.

While no token comes (at the start, once subscribed to every process, or for a while after the last token), a
line on stderr says it waits. What a process does not record (its sink stopped writing, calls that run unrecorded)
is a line of its own, ``!`` first, as soon as its status says so (what it says already when tail connects comes
before that process's first step); so is a model whose requests are plain forwards (a classifier), once it has
served one, and a causal LM once it has run a plain forward (``model(...)``): they make no token, and no line of
tail's. A terminal that stops taking lines (a stalled pipe) holds up at most
:data:`~nxl_hooks.hooks.subscription.LIVE_QUEUE` steps in tail; the steps past those are not shown, and once it
takes lines again one line, ``!`` first, says how many (``! run: 12 step(s) not shown: nxl tail fell behind``), as
it says the steps the endpoint dropped. Every line goes through
:func:`~nxl_hooks.records.tokens.printable` before the terminal sees it: request ids come from the network, and an
escape sequence in one is shown, never run.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import shutil
import threading
import time
from typing import Callable, NamedTuple, Union
from urllib.parse import quote, urlencode

from ...hooks.subscription import LIVE_QUEUE
from ...records.tokens import printable
from ...records.view import METHOD, Choice, StepView
from ..options import CliError, add_method_option, positive_int, say

NAME = "tail"
_FAULT_POLL = 2.0  #: seconds between two looks at each process's status for faults
_WAIT_FIRST = 1.0  #: seconds without a token at the start before tail says it waits
_WAIT_AGAIN = 5.0  #: ... and after the last token (a slow model may take a second per token)
_SILENT_KEEPALIVES = 3  #: an endpoint that sends nothing for this many of its keepalive periods is not answering


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
    parser.add_argument("--layer", type=int, default=None,
                        help="which recorded layer to show, negative from the last recorded (default: the last)")
    parser.add_argument("-k", type=positive_int, default=3, help="context tokens per line (default 3)")
    add_method_option(parser)
    parser.add_argument("--count", type=positive_int, metavar="N", help="stop after N tokens")
    parser.add_argument("--last", type=positive_int, metavar="N",
                        help="first show the last N requests still in the program's memory (then follow on)")
    return parser


def faults(model: dict) -> list[str]:
    """What one model of a status (``/v1/status``'s ``models``) does not record, one phrase each:
    ``["records not written to the sink: disk full", "2 calls not recorded: beam search ..."]``, and steps the live
    feed dropped; empty while everything is recorded and shown."""
    said = [f"records not written to the sink: {model['sink_fault']}"] if model.get("sink_fault") else []
    count, why = model.get("unrecorded_calls") or 0, model.get("unrecorded")
    if count or why:  # why reads "not recorded[ after step N] (...): reason"
        why = why if why and why.startswith("not recorded") else f"not recorded: {why or 'see the log'}"
        said.append(f"{count or 'some'} call{'' if count == 1 else 's'} {why}")
    if model.get("live_dropped"):
        said.append(f"{model['live_dropped']} step(s) not handed to live readers: the live feed fell behind (the "
                    "records keep them)")
    return said


def forward_calls(model: dict) -> list[str]:
    """What nxl tail says of a model (a status's) whose requests are plain forwards (a classifier), once it has
    served one, and of a causal LM once it has run a plain forward (``model(...)``, not ``generate``): they make no
    token, so tail shows no line of theirs; empty for any other model."""
    kind = model.get("head_kind")
    where = "nxl tail shows none of them; each one's top tokens per layer are at the run's endpoint, /v1/requests/ID"
    if kind == "causal_lm" and model.get("forwards"):
        return [f"some of its requests are plain forward calls (model(...), not generate), which make no token: "
                f"{where}"]
    if kind in (None, "causal_lm") or not model.get("calls"):
        return []
    return [f"its requests are forward calls of a {kind.replace('_', ' ')} model, not generated tokens: {where}"]


def _who(view: StepView) -> str:
    """A line's request column: the request id (its first 16 characters) and which of its choices, if several
    (``r1#1``: vLLM's second sample; kept whole, cut from the id)."""
    label = view.choice.label() if view.choice is not None else ""
    return printable(str(view.request_id))[:16 - len(label)] + label


def line(view: StepView, layer: int | None, width: int, method: str = METHOD) -> str:
    """One step as a short line: ``req  step @position 'token'  L2: 5:'a' 0.41  9:'␣b' 0.33`` (the module doc).
    Tokens are the step view's texts (:mod:`nxl_hooks.records.view`: readable, a character split over tokens
    shown whole), quoted as they are; ``layer``: the one shown (:meth:`StepView.ranked`: negative from the last,
    None the last; ValueError for a layer the view does not have)."""
    if method not in view.scores:  # the program's probe does not compute it: the line says so
        return printable(f"{_who(view):<16} {view.step:>4} @{view.position:<5} '{view.token}'"
                       f"  the program's probe does not compute {method!r} (it computes "
                       f"{', '.join(view.scores)}; nxl run --methods {method})")[:max(width, 8)]
    shown, ranked = view.ranked(layer, method)
    best = "  ".join(f"{entry.position}:'{entry.text}' " + (f"{entry.score:.3g}" if entry.score is not None else "nan")
                     for entry in ranked)
    token = f"'{view.token}'" + ("" if view.target is None else f"→'{view.target}'")  # the scores explain the target
    text = printable(f"{_who(view):<16} {view.step:>4} @{view.position:<5} {token:>12}"
                   f"  L{shown}: {best}")
    return text if len(text) <= width else text[: max(width - 1, 8)] + "…"


def end_line(data: dict) -> str:
    """A request's last line: ``my-req-1: ended after 6 tokens`` (and why it stopped early, if it did), or, for an id
    that served only a plain forward, that it generated nothing."""
    if data.get("kind") == "forward":
        return printable(f"{data['request_id']}: a plain forward of {data['model']}, which generates no tokens")
    try:  # (an endpoint's word: a choice of another shape shows none)
        label = "" if data.get("choice") is None else Choice.from_json(data["choice"]).label()
    except ValueError:
        label = ""
    return printable(f"{data['request_id']}{label}: ended after {data['steps']} tokens"
                   + (f" ({data['error']})" if data.get("error") else ""))


class Shown(NamedTuple):
    """A step to print; ``call``: its call's (model, start time), where the endpoint says."""
    view: StepView
    call: tuple = ()


class Ended(NamedTuple):
    """The request ended: its summary (the endpoint's ``end`` event, ``steps`` its number of steps)."""
    summary: dict


class Fault(NamedTuple):
    """A line to print as it is: a process's fault, or steps this reader lost."""
    text: str


class Failed(NamedTuple):
    """A stream failed (``error``: why): the command stops with it."""
    error: str


class Opened(NamedTuple):
    """A stream is subscribed: from now on no step is missed."""


class Closed(NamedTuple):
    """A stream ended."""


#: What the follower threads hand the printing thread (and ``--last`` gives first: only steps and ends).
Item = Union[Shown, Ended, Fault, Failed, Opened, Closed]


class Behind:
    """The steps one stream's reader did not show: those the endpoint dropped (its ``dropped`` event: the total so
    far) and those nxl tail dropped itself, its queue full (a stalled stdout). Said in one line per fall behind, the
    two summed, before the next item it hands on."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.endpoint = self.here = self.told = 0

    def hand(self, items: queue.Queue[Item], item: Item | None, *, step: bool = False) -> None:
        """Put ``item`` (None: only the line of steps not shown, if there are new ones) in ``items``; a ``step`` never
        waits for room: with ``items`` full it is dropped and counted instead, while every other item waits."""
        total = self.endpoint + self.here
        try:
            if total != self.told:
                items.put(Fault(f"! {self.name}: {total} step(s) not shown: nxl tail fell behind (the run's records "
                                "keep them)"), block=not step)
                self.told = total
            if item is not None:
                items.put(item, block=not step)
        except queue.Full:
            self.here += 1


def last_requests(targets: list, n: int, k: int) -> list[Item]:
    """The items of the last ``n`` generation requests in the processes' memory, oldest first: each one's steps
    (:class:`Shown`), then :class:`Ended` once it has ended."""
    found = []
    for endpoint in targets:
        for summary in endpoint.json("GET", "/v1/requests")["requests"]:
            if summary.get("kind") == "generate" and summary.get("request_id") is not None:
                found.append((summary.get("started") or 0.0, endpoint, summary))
    items: list[Item] = []
    for _, endpoint, summary in sorted(found, key=lambda item: item[0])[-n:]:
        # by when it started: an id may serve several calls (and plain forwards), and the id alone gives the newest
        started = summary.get("started")
        query = urlencode({"k": k, **({"started": repr(started)} if isinstance(started, (int, float)) else {})})
        view = endpoint.json("GET", f"/v1/requests/{quote(summary['request_id'], safe='')}?{query}")
        if view.get("started") != started or not isinstance(view.get("steps"), list):
            # an endpoint of an nxl_hooks before ?started= answers with the id's newest record, maybe another one
            items.append(Fault(f"! {endpoint.name}: request {summary['request_id']} (started {started}) not shown: "
                               "the process answered with another record of that id (its nxl_hooks predates 0.4.0, "
                               "which serves each); nxl.read_stream on the run folder reads it"))
            continue
        items += [Shown(StepView.from_json({"request_id": view["request_id"], "model": view.get("model"), **step}),
                        (view.get("model"), view.get("started"))) for step in view["steps"]]
        if view.get("ended"):
            items.append(Ended({**view, "steps": len(view["steps"])}))
    return items


def run(args: argparse.Namespace) -> int:
    from ..serve.client import endpoints
    from ..serve.endpoint import KEEPALIVE

    if args.last and args.request_id:
        raise CliError("--last shows the last requests; --request-id follows one (from its first token): give one")
    targets = endpoints(args.run, args.token_file)
    query = {"k": args.k, **({"request_id": args.request_id} if args.request_id else {})}
    items: queue.Queue[Item] = queue.Queue(LIVE_QUEUE)  # a stalled stdout holds this many, never more

    def connected(hang_up: Callable[[], None]) -> None:
        hang_ups.append(hang_up)
        if stop.is_set():  # tail returned while this stream connected: its hang-ups are past
            hang_up()

    def follow(endpoint, looked: threading.Event) -> None:
        """Hand what ``endpoint`` streams to the printing thread, each item once the first look at its status
        (``looked``) put its faults before them: a short --count still shows what the process already does not
        record. A status that does not answer while a stream would be silent is not waited for."""
        behind = Behind(endpoint.name)
        try:
            for event, data in endpoint.events(f"/v1/stream?{urlencode(query)}", on_open=lambda: items.put(Opened()),
                                               on_connect=connected, timeout=silent):
                looked.wait(silent)
                if stop.is_set():  # tail has returned: nobody reads these any more (the stream closes with the loop)
                    return
                if event == "step":
                    behind.hand(items, Shown(StepView.from_json(data), (data.get("model"), data.get("call_started"))),
                                step=True)
                elif event == "dropped":  # this reader fell behind: how many steps it lost so far
                    dropped = data.get("dropped")
                    behind.endpoint = dropped if isinstance(dropped, int) else behind.endpoint
                    behind.hand(items, None)
                elif event == "end":
                    behind.hand(items, Ended(data))
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            looked.wait(silent)
            if not stop.is_set():  # (hung up by tail's return: nobody reads it)
                behind.hand(items, Failed(str(error) if isinstance(error, CliError) else f"{endpoint.name}: {error}"))
        looked.wait(silent)
        if not stop.is_set():  # a stream that closes with no end (the program exited) still says its drops
            behind.hand(items, Closed())

    def look_for_faults(endpoint, said: set[str]) -> bool:
        """Put each fault line of ``endpoint``'s status not in ``said`` yet in ``items``; False once it is gone."""
        try:
            status = endpoint.status(timeout=10)
        except Exception:  # noqa: BLE001 - the stream reports a process that went away
            return False
        try:
            lines = [f"! pid {status.get('pid')} {model.get('name')}: {fault}"
                     for model in status.get("models", []) for fault in faults(model) + forward_calls(model)]
        except Exception as error:  # noqa: BLE001 - a status of another shape (another nxl_hooks version): said once
            items.put(Fault(f"! {endpoint.name}: its faults cannot be shown, its status is not one this nxl tail "
                            f"reads ({type(error).__name__}: {error}); run the same nxl_hooks version here"))
            return False
        for text in lines:
            if text not in said:
                said.add(text)
                items.put(Fault(text))
        return True

    def watch_faults(endpoint, looked: threading.Event) -> None:
        said: set[str] = set()
        try:
            alive = look_for_faults(endpoint, said)
        finally:  # (whatever happens: the follower waits for it)
            looked.set()
        # (once stopped, the wait returns at once: the test comes first, or this loop would poll flat out)
        while alive and not stop.wait(_FAULT_POLL):
            alive = look_for_faults(endpoint, said)

    silent = _SILENT_KEEPALIVES * KEEPALIVE
    stop = threading.Event()
    hang_ups: list[Callable[[], None]] = []  # one per stream connected
    for endpoint in targets:
        looked = threading.Event()  # set once the first look at its status is done
        threading.Thread(target=watch_faults, args=(endpoint, looked), daemon=True).start()
        threading.Thread(target=follow, args=(endpoint, looked), daemon=True).start()
    try:
        past = last_requests(targets, args.last, args.k) if args.last else []  # after subscribing: none is missed
        return _show(items, args, len(targets), past)
    finally:
        stop.set()
        for hang_up in hang_ups:  # a quiet stream's follower waits in a read: only this ends it, and its connection
            hang_up()
        # A follower or watcher may wait for room in a queue left full (a slow stdout): room, so that it sees the stop
        # and ends. Once stopped, each puts at most a few more items, far fewer than the queue holds.
        with contextlib.suppress(queue.Empty):
            while True:
                items.get_nowait()


def _line(view: StepView, args: argparse.Namespace, width: int) -> str:
    """:func:`line` of ``view`` as the command asked for it; a ``--layer`` the program does not record is exit 2."""
    try:
        return line(view, args.layer, width, args.method)
    except ValueError as error:
        raise CliError(f"--layer {args.layer}: {error}") from None


def _show(items: queue.Queue[Item], args: argparse.Namespace, open_streams: int, past: list[Item]) -> int:
    """Print ``past`` (``--last``), then what the follower threads put in ``items`` until the request ends,
    ``--count`` is reached or every stream has closed; say so on stderr while no token comes."""
    width, shown = shutil.get_terminal_size((120, 20)).columns, 0
    # by call, not request id: a later request that uses the id again shows its first steps too
    seen = {(item.call, item.view.request_id, item.view.step) for item in past if isinstance(item, Shown)}
    waiting = f"request {printable(args.request_id)}" if args.request_id else "requests"
    quiet_since, wait, said, opening = time.monotonic(), _WAIT_FIRST, False, open_streams
    for item in past:
        is_step = isinstance(item, Shown)
        if args.count and shown >= args.count and is_step:
            return 0  # --count reached (the end line of the request shown last still came)
        print(_line(item.view, args, width) if is_step else end_line(item.summary), flush=True)
        shown += is_step
    if args.count and shown >= args.count:
        return 0
    while open_streams:
        try:
            item = items.get(timeout=0.25)
        except queue.Empty:
            if not said and not opening and time.monotonic() - quiet_since >= wait:
                said = True
                hint = "" if args.request_id or args.last else "; nxl tail --last N shows the last N"
                say(f"nxl tail: waiting for {waiting} (Ctrl-C to stop{hint})")
            continue
        if isinstance(item, Shown):
            if (item.call, item.view.request_id, item.view.step) in seen:
                continue  # already shown by --last
            quiet_since, wait, said = time.monotonic(), _WAIT_AGAIN, False
            print(_line(item.view, args, width), flush=True)
            shown += 1
            if args.count and shown >= args.count:
                return 0
        elif isinstance(item, Ended):
            print(end_line(item.summary), flush=True)
            return 0
        elif isinstance(item, Fault):
            print(printable(item.text), flush=True)
        elif isinstance(item, Failed):
            raise CliError(item.error)
        elif isinstance(item, Opened):  # subscribed: from now on nothing is missed
            opening -= 1
            quiet_since = time.monotonic()
        else:
            open_streams -= 1
    say("nxl tail: the stream ended: the process exited, or stopped being recorded")
    return 1
