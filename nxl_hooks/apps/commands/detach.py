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
    from ..serve.inject import inject, inspect_target, model_processes

    target = inspect_target(args.pid)
    outcome = _checked(args.pid, inject(target, {"action": "detach"}, timeout=args.timeout))
    said, failed = [_said(args.pid, outcome)], []
    if outcome.get("front") is True:  # a server front: nxl attach attached the model processes it spawned
        for pid in model_processes(args.pid):
            try:
                child = inspect_target(pid)
                if child.uid == target.uid:
                    answer = inject(child, {"action": "detach"}, timeout=args.timeout)
                    if answer.get("code") != "not-attached":
                        said.append(_said(pid, _checked(pid, answer)))
            except CliError as error:
                failed.append(f"its model process {pid} still records ({error}); it takes the request only when "
                              f"the server hands it one: nxl detach {pid} while it serves")
    say(one_line("nxl detach: " + "; ".join(said)))
    if failed:
        raise CliError("; ".join(failed))
    return 0


def _checked(pid: int, outcome: dict) -> dict:
    """``outcome`` of process ``pid``'s detach, of the shape it should have; CliError otherwise."""
    if not outcome.get("ok"):
        raise CliError(f"process {pid}: {outcome.get('error')}")
    # the target's side answers, which its user controls: only its shape is read (a missing key was "error: 'hooks'")
    shape = {"run_dir": str, "patches": int, "hooks": int, "threads": list}
    if not all(isinstance(outcome.get(key), kind) for key, kind in shape.items()):
        raise CliError(f"process {pid} answered the detach with an outcome of another shape: whether it runs "
                       "unrecorded is unknown; check its nxl_hooks install and detach again")
    return outcome


def _said(pid: int, outcome: dict) -> str:
    left = "".join(f"; {what} left: {outcome[key]}" for key, what in (("hooks", "hooks"), ("threads", "nxl threads"))
                   if outcome[key])
    return (f"process {pid} runs unrecorded ({outcome['patches']} patches given back{left}); its records stay in "
            f"{outcome['run_dir']}")  # the target's words
