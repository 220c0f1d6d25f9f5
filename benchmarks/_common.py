"""What every benchmark script shares: a synchronized timer, the device's name, and the JSON it prints."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn()`` takes, with CUDA work finished on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


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
