"""What every benchmark script shares: a synchronized timer, the device's name, the JSON it prints, and ``--smoke``.

``timed(fn, device, clock="cpu")`` counts the CPU seconds of this process instead of wall seconds: on a shared
machine other processes stretch wall time by whatever they run, not the CPU time spent on the work itself (with
one torch thread it is exactly the work; with several it also counts their spin-waits). ``load_average()`` goes
into every report, so a reader can see how busy the machine was.

``random_llama(shape, device, dtype)``: the random-init Llama of :data:`SHAPES` that the forward, generate, compiled
and batching benchmarks measure ("full" on the CPU, "llama2-7b" on a GPU, "smoke" in CI).

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


#: Random-init Llama shapes: "full" (the CPU figures), "smoke" (CI's ``--smoke``), "llama2-7b" (the GPU figures:
#: Llama-2-7B's widths and depth, random weights, so no hub is needed).
SHAPES = {
    "full": dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=8),
    "smoke": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=8),
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32),
    # Llama-2-7B's depth and vocabulary at a width whose arithmetic costs next to nothing: a CPU step bound by the
    # host's Python, as a GPU's eager decoding step is, so what recording adds there shows on the CPU
    "host-bound": dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=32,
                       num_attention_heads=4, num_key_value_heads=4),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """What a generating benchmark runs: ``--device``, ``--shape`` and ``--dtype`` (which :data:`SHAPES` model,
    where, in which dtype), ``--prompt`` and ``--new`` (tokens in, tokens generated)."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--shape", choices=[name for name in SHAPES if name != "smoke"], default="full",
                        help="full: the CPU figures' model; llama2-7b: Llama-2-7B's shape (a GPU's figures); "
                        "host-bound: its depth at width 64, a CPU step bound by Python as a GPU's is")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")


def random_llama(shape: str, device: torch.device, dtype: str = "float32"):
    """The random-init ``LlamaForCausalLM`` of ``SHAPES[shape]`` on ``device`` (built there: a 7B model never passes
    through host memory), in eval mode, generating to its length: no EOS, pad id 0. Seeded: every run the same."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).to(DTYPES[dtype]).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def begin(parser: argparse.ArgumentParser, name: str, **smoke: Any) -> tuple[argparse.Namespace, torch.device,
                                                                             list[float], int]:
    """Parse the arguments of a script measuring on ``--device``: under ``--smoke`` the arguments in ``smoke`` take
    those values (one torch thread too) and the JSON goes to :func:`smoke_out`; then ``--threads`` is applied. Returns
    the arguments, the device, the load average before the run and torch's thread count before (to restore)."""
    args = parser.parse_args()
    if args.smoke:
        for key, value in {**smoke, "threads": 1}.items():
            setattr(args, key, value)
        args.out = smoke_out(parser, args.out, name)
    load_before, threads = load_average(), torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args, torch.device(args.device), load_before, threads


def report_head(benchmark: str, where: str, clock: str, load_before: list[float]) -> dict:
    """The keys every report starts with: which benchmark ran ``where`` (:func:`device_label`, taken while its
    threads were set), on which torch and clock, and how busy the machine was before and after."""
    return {"benchmark": benchmark, "device": where, "torch": torch.__version__, "clock": clock,
            "load_average": {"before": load_before, "after": load_average()}}


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
