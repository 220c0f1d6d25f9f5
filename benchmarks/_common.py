"""What every benchmark script shares: a synchronized timer, the device's name, the JSON it prints, and ``--smoke``.

``timed(fn, device, clock="cpu")`` counts the CPU seconds of this process instead of wall seconds: on a shared
machine other processes stretch wall time by whatever they run, not the CPU time spent on the work itself (with
one torch thread it is exactly the work; with several it also counts their spin-waits). ``load_average()`` goes
into every report, so a reader can see how busy the machine was.

``--smoke`` (every script): tiny sizes, one round, no goal, the JSON written outside ``benchmarks/results/``. The
test suite runs each script so on the CPU (tests/process/test_benchmarks_smoke.py): a benchmark that stops running fails
CI, and one whose figures are still to be taken on a GPU keeps working until then.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn: Callable[[], Any], device: torch.device, clock: str = "wall") -> float:
    """Seconds ``fn()`` takes on ``clock`` ("wall", or "cpu": this process's CPU time), CUDA work finished on both
    sides."""
    now = CLOCKS[clock]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = now()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return now() - start


def load_average() -> list[float]:
    """The machine's 1, 5 and 15-minute load averages (runnable processes), as ``os.getloadavg`` gives them."""
    return [round(value, 2) for value in os.getloadavg()]


def device_label(device: torch.device) -> str:
    """The GPU's name, or the CPU with its thread count: committed figures must say where they were taken."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def emit(report: dict, out: Path | None) -> None:
    """Print the report as JSON, and write it to ``out`` too when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """``--threads``, ``--clock``, ``--out`` and ``--smoke``: how a benchmark runs and where its JSON goes, the same
    flags in every script."""
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's); 1 is steadier on a shared machine")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall seconds, or this process's CPU seconds (steadier on a busy shared machine)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    add_smoke_option(parser)


def add_smoke_option(parser: argparse.ArgumentParser) -> None:
    """``--smoke``: the script's own code on tiny sizes, for CI (``parser.add_argument`` once, the same help)."""
    parser.add_argument("--smoke", action="store_true",
                        help="check that the script runs: tiny sizes, one round, no goal; the JSON goes to --out or a "
                             "temporary file, never to benchmarks/results/")


def smoke_out(parser: argparse.ArgumentParser, out: Path | None, name: str) -> Path:
    """Where a ``--smoke`` run writes its JSON: ``out``, or a new temporary file; never under benchmarks/results/
    (a smoke run's figures mean nothing), which is a usage error (exit 2)."""
    if out is None:
        return Path(tempfile.mkdtemp(prefix="nxl-smoke-")) / f"{name}.json"
    if out.resolve().is_relative_to(RESULTS):
        parser.error(f"--smoke writes no figures: give --out outside {RESULTS}, or none")
    return out
