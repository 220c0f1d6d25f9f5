"""What every benchmark script shares: a synchronized timer, the device's name, and the JSON it prints.

``timed(fn, device, clock="cpu")`` counts the CPU seconds of this process instead of wall seconds: on a shared
machine other processes stretch wall time by whatever they run, not the CPU time spent on the work itself (with
one torch thread it is exactly the work; with several it also counts their spin-waits). ``load_average()`` goes
into every report, so a reader can see how busy the machine was.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


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
