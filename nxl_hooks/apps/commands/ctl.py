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

from ..options import parse_layers, parse_target
from .tail import add_run_options

NAME = "ctl"
ACTIONS = ("status", "pause", "resume", "attach", "detach")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(NAME, help="pause, resume, re-attach or detach a running program's probes",
                            description="Change what a program started with nxl run records, at run time.")
    parser.add_argument("action", choices=ACTIONS)
    add_run_options(parser)
    parser.add_argument("--layers", type=parse_layers, help="attach: all | last | comma list like 0,2,-1")
    parser.add_argument("--target", type=parse_target, help="attach: predicted | an id | a token | comma list")
    parser.add_argument("--embedding", choices=("layer_input", "word"), help="attach: the embedding norm")
    parser.add_argument("--models", metavar="GLOB", help="attach/detach: only models whose name matches (comma list)")
    parser.add_argument("--json", action="store_true", help="print each process's status as JSON")
    return parser


def describe(status: dict) -> str:
    """One line per process: its state and each model's."""
    models = "; ".join(
        f"{m['name']}: " + ("attached, layers " + ",".join(map(str, m["layers"])) if m["attached"]
                            else ("excluded" if m["excluded"] else "not attached") + (f" ({m['error']})" if m["error"] else ""))
        + f", {m['hooks']} hooks, {m['calls']} requests in memory"
        for m in status["models"]) or "no model loaded"
    return f"pid {status['pid']}: {'paused' if status['paused'] else 'recording'}; {models}"


def run(args: argparse.Namespace) -> int:
    from ..serve.client import endpoints

    body = None
    if args.action != "status":
        body = {"action": args.action, "models": args.models, "embedding": args.embedding,
                "layers": None if args.layers is None else (args.layers if isinstance(args.layers, str)
                                                            else ",".join(map(str, args.layers))),
                "target": None if args.target is None else (",".join(map(str, args.target))
                                                            if isinstance(args.target, list) else str(args.target))}
    for endpoint in endpoints(args.run, args.token_file):
        status = (endpoint.json("GET", "/v1/status") if body is None
                  else endpoint.json("POST", "/v1/control", body))
        print(json.dumps(status) if args.json else describe(status), flush=True)
    return 0
