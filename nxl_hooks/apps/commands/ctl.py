"""``nxl ctl status|pause|resume|attach|detach``: change what a running program records, without a restart.

    nxl ctl pause                          # every model: zero hooks until resume
    nxl ctl resume
    nxl ctl attach --layers last           # re-attach with other options (--models GLOB: only those models)
    nxl ctl detach --models '*draft*'      # stop recording some models
    nxl ctl status --json
"""

from __future__ import annotations

import argparse
import json

from ...records.tokens import printable
from ..options import CliError
from ..schema import options
from ..serve.settings import CTL, Settings, add_run_options
from .tail import add_connect_options, faults

NAME = "ctl"
ACTIONS = ("status", "pause", "resume", "attach", "detach")


def add_parser(sub: argparse._SubParsersAction, *, group: type = Settings) -> argparse.ArgumentParser:
    """``nxl ctl``'s parser: the action, where the run is, and the options of ``group`` that ``nxl ctl`` changes
    (:data:`~nxl_hooks.apps.serve.settings.CTL`)."""
    parser = sub.add_parser(NAME, help="pause, resume, re-attach or detach a running program's probes",
                            description="Change what a program started with nxl run records, at run time.")
    parser.add_argument("action", choices=ACTIONS)
    add_connect_options(parser)
    add_run_options(parser.add_argument_group("attach / detach (as nxl run takes them; left out: kept as they are)"),
                    group=group, where=CTL, defaults=False)
    parser.add_argument("--json", action="store_true", help="print each process's status as JSON")
    return parser


def request(args: argparse.Namespace, *, group: type = Settings) -> dict | None:
    """The control request of parsed ``nxl ctl`` arguments: the action and each option given, as its variable's
    text (what :meth:`~nxl_hooks.apps.serve.settings.Settings.changes` reads back); None for ``status``."""
    given = [option for option in options(group, CTL) if getattr(args, option.dest) is not None]
    # what the action reads (the endpoint parses every option and would drop the others without a word)
    ignored = [option.flag for option in given if args.action != "attach"
               and (args.action != "detach" or option.name != "models")]
    if ignored:
        takes = "only --models" if args.action == "detach" else "no option"
        raise CliError(f"nxl ctl {args.action} takes {takes} ({', '.join(map(str, ignored))} given): the attach "
                       "options apply to nxl ctl attach, --models to attach and detach")
    if args.action == "status":
        return None
    return {"action": args.action, **{option.name: option.text(getattr(args, option.dest)) for option in given}}


def describe(status: dict) -> str:
    """One line per process: its state and each model's, with what it does not record; escaped for a terminal
    (:func:`~nxl_hooks.records.tokens.printable`: names and errors may hold anything)."""
    models = "; ".join(
        f"{m['name']}: " + ("attached, layers " + ",".join(map(str, m["layers"])) if m["attached"]
                            else ("excluded" if m["excluded"] else "not attached") + (f" ({m['error']})" if m["error"] else ""))
        + f", {m['hooks']} hooks, {m['calls']} requests in memory" + (f"; {m['engine']}" if m.get("engine") else "")
        + "".join(f"; {fault}" for fault in faults(m))
        for m in status["models"]) or "no model loaded"
    # "recording" only while some attached model records: the calls of its probe now are none yet, some recorded,
    # or some running (an endpoint of an older nxl_hooks says it of every call in memory)
    recording = any(m.get("recording", m["attached"] and (not m["calls"] or m.get("recorded", 1) or m.get("running")))
                    for m in status["models"])
    state = "paused" if status["paused"] else "recording" if recording else "not recording"
    return printable(f"pid {status['pid']}: {state}; {models}")


def run(args: argparse.Namespace) -> int:
    from ..serve.client import Refused, endpoints

    body = request(args)
    held: list[str] = []  # the lines of processes that hold no model --models names, until one does
    loaded: list[str] = []  # their models
    done = False
    for endpoint in endpoints(args.run, args.token_file):
        try:
            status = endpoint.status(body)
            done = True
        except Refused as refusal:
            if refusal.status != 404 or not isinstance(refusal.answer.get("loaded"), list):  # another: its message
                raise
            loaded += map(str, refusal.answer["loaded"])
            status = endpoint.status()  # changed nothing: shown as it is, beside the processes that hold the model
        try:
            held.append(json.dumps(status) if args.json else describe(status))  # JSON escapes every control
        except (KeyError, TypeError, ValueError, AttributeError):
            raise endpoint._foreign("its status is not one") from None
        if done:
            print("\n".join(held), flush=True)
            held = []
    if not done:
        raise CliError(f"--models {body['models']} matches none of the models loaded in the run "
                       f"({', '.join(dict.fromkeys(loaded)) or 'none'}); nothing changed: give a glob of one of them")
    return 0
