"""``nxl detach PID``: undo ``nxl attach PID``; every hook and patch off, the endpoint and nxl's threads closed.

    nxl detach 4242

The process goes on as it was before the attach; its run folder and records stay.
"""

from __future__ import annotations

import argparse

from ..options import CliError, one_line, say
from .attach import add_pid

NAME = "detach"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(NAME, help="undo nxl attach: take every hook and patch off a running process",
                            description="Take off everything nxl attach put on process PID; it runs on unrecorded.")
    add_pid(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from ..serve.inject import inject, inspect_target

    outcome = inject(inspect_target(args.pid), {"action": "detach"}, timeout=args.timeout)
    if not outcome.get("ok"):
        raise CliError(f"process {args.pid}: {outcome.get('error')}")
    # the target's side answers, which its user controls: only its shape is read (a missing key was "error: 'hooks'")
    shape = {"run_dir": str, "patches": int, "hooks": int, "threads": list}
    if not all(isinstance(outcome.get(key), kind) for key, kind in shape.items()):
        raise CliError(f"process {args.pid} answered the detach with an outcome of another shape: whether it runs "
                       "unrecorded is unknown; check its nxl_hooks install and detach again")
    left = "".join(f"; {what} left: {outcome[key]}" for key, what in (("hooks", "hooks"), ("threads", "nxl threads"))
                   if outcome[key])
    say(one_line(f"nxl detach: process {args.pid} runs unrecorded ({outcome['patches']} patches given back{left}); "
                 f"its records stay in {outcome['run_dir']}"))  # the target's words
    return 0
