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
    left = "".join(f"; {what} left: {outcome[key]}" for key, what in (("hooks", "hooks"), ("threads", "nxl threads"))
                   if outcome[key])
    say(one_line(f"nxl detach: process {args.pid} runs unrecorded ({outcome['patches']} patches given back{left}); "
                 f"its records stay in {outcome['run_dir']}"))  # the target's words
    return 0
