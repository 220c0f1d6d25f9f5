"""Latency of ``nxl attach PID`` and ``nxl detach PID`` on a running ``transformers serve`` (started without nxl,
the tiny chat model of tests/serving.py, one client sending requests one after the other).

    python benchmarks/bench_attach.py [--rounds 3] [--out benchmarks/results/attach_cpu.json]
    python benchmarks/bench_attach.py --smoke        # one round, the client pausing between requests (CI)

Per round: ``nxl attach PID --layers all --sink DIR`` as a fresh command (what a user types: its interpreter
start and imports included), timed from the command's start to its return, and to the first request recorded in
the sink; then ``nxl detach PID``, from its start to its return (after which nothing more is recorded: checked).
The same through the Python API in this process (``inspect_target`` + ``inject``: no interpreter start, nxl_hooks
and torch imported already), and ``nxl --help`` alone: what every ``nxl`` command pays to start.
Every answer of the server, before, during and after, must equal the first one (checked). Wall seconds: on a
shared machine they include whatever else runs; the load average is in the report.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from _common import add_smoke_option, emit, load_average, smoke_out  # noqa: E402
from serving import Server, save_chat_model  # noqa: E402

import nxl_hooks as nxl  # noqa: E402
from nxl_hooks.apps.serve.inject import inject, inspect_target, model_processes  # noqa: E402
from nxl_hooks.apps.serve.settings import Settings  # noqa: E402

QUESTION, MAX_TOKENS = "hello world how are you", 8


def _nxl(*args: str) -> float:
    """Run ``nxl ARGS`` and return its wall seconds (it must succeed)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "nxl_hooks", *args], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"nxl {' '.join(args)}: {done.stderr.strip()}")
    return time.perf_counter() - start


def _api(pid: int, request: dict) -> tuple[float, float]:
    """(seconds of the checks, seconds of the injection until the outcome) of one request through the API."""
    start = time.perf_counter()
    target = inspect_target(pid)
    checked = time.perf_counter()
    outcome = inject(target, request, timeout=60)
    if not outcome.get("ok"):
        raise RuntimeError(outcome.get("error"))
    return checked - start, time.perf_counter() - checked


def _recorded(run: Path, start: float, since: int = 0) -> float:
    """Seconds from ``start`` until ``run`` holds more than ``since`` recorded requests (at most 300 s)."""
    while len(nxl.read_stream(run)) <= since:
        if time.perf_counter() - start > 300:
            raise SystemExit(f"nothing recorded in {run} within 300 s of the attach")
        time.sleep(0.01)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    add_smoke_option(parser)
    args = parser.parse_args()
    # A smoke run's client pauses between requests: still several a second (the attach is timed to the first one
    # recorded, and the detach checked against those after it), not a core kept busy for the whole run (in CI).
    pause = 0.0
    if args.smoke:  # the same commands and checks, one round
        args.rounds, args.out, pause = 1, smoke_out(parser, args.out, "attach"), 0.1
    elif args.out is None:
        args.out = ROOT / "benchmarks" / "results" / "attach_cpu.json"
    work = Path(tempfile.mkdtemp(prefix="bench-attach-"))
    model = save_chat_model(work / "tiny")
    rounds, answers, stop = [], [], threading.Event()
    with Server(model, log=work / "server.log", env={"OMP_NUM_THREADS": "1"}) as server:
        def client() -> None:
            for n in range(100000):
                if stop.wait(pause if n else 0):
                    return
                answers.append(server.chat(QUESTION, max_tokens=MAX_TOKENS, request_id=f"q{n}")["content"])

        loop = threading.Thread(target=client, daemon=True)
        loop.start()
        before = load_average()
        for index in range(args.rounds):
            run = work / f"run{index}"
            start = time.perf_counter()
            attach_s = _nxl("attach", str(server.pid), "--layers", "all", "--sink", str(run))
            first_record_s = _recorded(run, start)
            detach_s = _nxl("detach", str(server.pid))
            recorded = len(nxl.read_stream(run))
            time.sleep(1.0)
            assert len(nxl.read_stream(run)) == recorded, "a request was recorded after the detach"
            api_run = work / f"api{index}"
            api_run.mkdir(mode=0o700)
            start = time.perf_counter()
            env = Settings(run_dir=api_run, sink=True).to_env()
            # (the process that holds the model: serve's own up to transformers 5.24, the one it spawned from 5.25)
            holder = (model_processes(server.pid) or [server.pid])[0]
            check_s, inject_s = _api(holder, {"action": "attach", "env": env, "wait": 0})
            api_first_s = _recorded(api_run, start)
            detach_check_s, detach_inject_s = _api(holder, {"action": "detach"})
            rounds.append({"attach_command_s": attach_s, "attach_to_first_record_s": first_record_s,
                           "detach_command_s": detach_s, "nxl_help_s": _nxl("--help"),
                           "api_checks_s": check_s, "api_attach_inject_s": inject_s,
                           "api_attach_to_first_record_s": api_first_s,
                           "api_detach_s": detach_check_s + detach_inject_s})
        stop.set()
        loop.join(timeout=120)
    assert answers and all(answer == answers[0] for answer in answers), "an answer changed"
    report = {
        "benchmark": "attach", "smoke": args.smoke, "device": "cpu", "machine_note": "a VM with 2 cores shared with other sessions",
        "python": sys.version.split()[0], "requests_answered": len(answers), "load_average_before": before,
        "load_average_after": load_average(), "rounds": rounds,
        "median": {key: statistics.median(r[key] for r in rounds) for key in rounds[0]},
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
