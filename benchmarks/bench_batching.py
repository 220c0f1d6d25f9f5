"""Throughput of transformers' continuous batching with every request recorded, versus the same batching unrecorded:
the engine ``transformers serve --continuous-batching`` runs, in process (no HTTP, so only the engine's own cost).

    python benchmarks/bench_batching.py [--repeats 3] [--requests 64] [--prompt 128] [--new 64] [--device cpu] \\
        [--shape full|llama2-7b] [--dtype float32|bfloat16] [--cuda-graph] [--threads 1] [--out FILE]
    python benchmarks/bench_batching.py --smoke     # tiny model, one round: does it still run (CI)

Model: random-init Llama of benchmarks/_common.py's SHAPES (on a GPU ``--shape llama2-7b --dtype bfloat16
--cuda-graph``); ``--requests`` prompts of ``--prompt`` random tokens, each decoding ``--new`` tokens greedily,
submitted at once to ``generate_batch`` with synchronous batching (the mode nxl_hooks follows; asynchronous batching is
reported as not recorded) and, with ``--cuda-graph``, CUDA graphs. "attached": the same call under
``nxl.attach(layers="all")`` (attach and detach outside the timed region, as in a server that stays attached),
timed until every request's records are made. Two more recorded variants each flip one of the recorder's
switches, to tell on the machine at hand which setting is faster: "attached_ends_wait" makes each request's end wait
for the records of the request that ended before it, as a ``generate`` call's does (``ENGINE_ENDS_WAIT``), and
"attached_other_scoring_thread" scores the requests' steps in the other thread than this device's default
(``SCORED_ELSEWHERE``: the publisher on a GPU, the manager's thread on the CPU). Every round runs plain and the
recorded variants in a rotating order; the report gives the median of the paired throughput ratios (recorded / plain
of the same round), the default's as ``attached_throughput_over_plain`` and each variant's under ``variants``.
``generate_batch`` warms a new manager up in every call, plain or recorded (with CUDA graphs it captures them there);
a server's manager does so once, so ``throughput_over_plain_after_warmup`` gives the same paired ratios without each
call's warmup (``warmup_median_seconds``), the steady state's. Each attached call is checked: every request recorded whole, one step per
token; and whether each request's tokens are plain's is reported. Then one more call of each counts the torch
functions the manager's thread calls (device operations and tensor attribute reads alike), per generated token:
what recording adds there is what a step replayed as a CUDA graph feels on a GPU, where each launch costs the host
microseconds, and unlike time it is the same on every run. Every timed call also reads the manager thread's own
CPU time and wall time, and (attached) the CPU time of the record pipeline's publisher thread, per generated token
(medians): where recording's cost lands. The manager's wall time beyond its CPU time is waiting: for the device, or
for the interpreter lock while another thread holds it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import threading
import time
from typing import Callable, ContextManager, Iterator

import torch
from torch.overrides import TorchFunctionMode
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

import nxl_hooks as nxl
from nxl_hooks.hooks import generate as recorder
from _common import add_model_options, add_run_options, begin, device_label, emit, random_llama, report_head, timed


class _Calls(TorchFunctionMode):
    """Counts the torch functions called in the thread that entered it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _wrapping(name: str, wrap: Callable[[Callable], Callable]) -> Iterator[bool]:
    """While entered, ``ContinuousBatchingManager.<name>`` is ``wrap(its own)``; yields whether this transformers has
    that method to wrap."""
    own = getattr(ContinuousBatchingManager, name, None)
    if own is None:
        yield False
        return
    setattr(ContinuousBatchingManager, name, wrap(own))
    try:
        yield True
    finally:
        setattr(ContinuousBatchingManager, name, own)


def _in_manager_threads(within: Callable[[], ContextManager]) -> ContextManager[bool]:
    """While entered, each continuous-batching manager's ``_run_generation_loop`` runs inside ``within()``, in its own
    thread; yields whether this transformers has that method to wrap."""
    def wrap(loop: Callable) -> Callable:
        def wrapped(manager, *args, **kwargs):
            with within():
                return loop(manager, *args, **kwargs)
        return wrapped

    return _wrapping("_run_generation_loop", wrap)


def manager_calls(run) -> int | None:
    """How many torch functions the continuous-batching manager's own thread calls while ``run()`` runs (None where
    this transformers has no ``ContinuousBatchingManager._run_generation_loop`` to count in)."""
    counts = []

    @contextlib.contextmanager
    def counting() -> Iterator[None]:
        with _Calls() as calls:
            try:
                yield
            finally:
                counts.append(calls.count)

    with _in_manager_threads(counting) as found:
        if not found:
            return None
        run()
    return sum(counts)


def _clocked(loops: list[tuple[float, float]]) -> ContextManager:
    """A manager's thread's (CPU seconds, wall seconds) in its generation loop, appended to ``loops`` (inside
    :func:`_in_manager_threads`)."""
    @contextlib.contextmanager
    def clock() -> Iterator[None]:
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            yield
        finally:
            loops.append((time.thread_time() - cpu, time.perf_counter() - wall))

    return _in_manager_threads(clock)


def _warmups(seconds: list[float], device: torch.device, clock: str) -> ContextManager[bool]:
    """While entered, the seconds on ``clock`` of each manager's ``warmup`` (generate_batch's, in the calling thread
    before its loop starts: with CUDA graphs, their capture) are appended to ``seconds``: the clock the calls are
    timed on, since the steady state's ratios subtract the one from the other."""
    def wrap(warmup: Callable) -> Callable:
        def timed_warmup(manager, *args, **kwargs):
            returned = []
            seconds.append(timed(lambda: returned.append(warmup(manager, *args, **kwargs)), device, clock))
            return returned[0]
        return timed_warmup

    return _wrapping("warmup", wrap)


def publisher_cpu() -> float | None:
    """CPU seconds of this process's record-pipeline publisher thread so far (None where there is none)."""
    for thread in threading.enumerate():
        if thread.name == "nxl_hooks-publisher" and thread.ident is not None:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(parser)
    add_run_options(parser)
    parser.add_argument("--requests", type=int, default=64, help="requests submitted at once")
    parser.add_argument("--cuda-graph", action="store_true", help="capture the batching's forwards in CUDA graphs")
    parser.add_argument("--repeats", type=int, default=3)
    args, device, load_before, threads = begin(parser, "batching", repeats=1, requests=4, prompt=8, new=4)
    where = device_label(device)
    model = random_llama("smoke" if args.smoke else args.shape, device, args.dtype)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, model.config.vocab_size, (args.prompt,), generator=generator).tolist()
               for _ in range(args.requests)]
    greedy = GenerationConfig(do_sample=False, max_new_tokens=args.new, eos_token_id=-1, pad_token_id=0)
    page = ContinuousBatchingConfig().page_size
    # room for every request at once, and no more: the default cache takes most of the device's memory
    blocks = args.requests * -(-(args.prompt + args.new) // page)
    tokens: dict[str, dict] = {}
    clocks: dict[str, list[tuple[float, float]]] = {}  # the manager thread's (CPU, wall) seconds of each call
    publisher: dict[str, list[float]] = {}  # the publisher thread's CPU seconds of each recorded call
    scoring: dict[str, set[str]] = {}  # the threads that made each variant's records
    switches = {"attached": {}, "attached_ends_wait": {"ENGINE_ENDS_WAIT": True},
                "attached_other_scoring_thread": {"SCORED_ELSEWHERE": recorder.SCORED_ELSEWHERE ^ {device.type}}}

    warmed: dict[str, float] = {}  # the last call's warmup seconds, per variant

    def batch(name: str):
        config = ContinuousBatchingConfig(num_blocks=blocks, use_cuda_graph=args.cuda_graph, use_async_batching=False)
        loops: list[tuple[float, float]] = []
        warmups: list[float] = []
        with _clocked(loops), _warmups(warmups, device, args.clock):
            out = model.generate_batch(prompts, generation_config=greedy, continuous_batching_config=config,
                                       progress_bar=False)
        warmed[name] = sum(warmups)
        tokens[name] = {key: list(result.generated_tokens) for key, result in out.items()}
        if len(loops) == 1:  # the manager's thread ended with the call
            clocks.setdefault(name, []).append(loops[0])

    def plain() -> float:
        return timed(lambda: batch("plain"), device, args.clock)

    def attached(name: str) -> float:
        defaults = {switch: getattr(recorder, switch) for switch in switches[name]}
        vars(recorder).update(switches[name])
        record = recorder.Run._record

        def recording(run, *args):  # once per batch of a request's steps
            scoring.setdefault(name, set()).add(
                "publisher" if threading.current_thread().name == "nxl_hooks-publisher" else "manager")
            return record(run, *args)

        recorder.Run._record = recording
        try:
            with nxl.attach(model, layers="all") as probe:
                # until every record is made too: a request's end does not wait for the publisher, whose last
                # batches would otherwise be scored after the clock stopped
                seconds = timed(lambda: (batch(name), probe.calls), device, args.clock)
                # the probe's own thread: it started with its first record
                publisher.setdefault(name, []).append(publisher_cpu() or 0.0)
        finally:
            vars(recorder).update(defaults)
            recorder.Run._record = record
        calls = probe.calls
        assert len(calls) == args.requests, f"{len(calls)} of {args.requests} requests recorded"
        for call in calls:
            assert call.error is None and call.complete and len(call.steps) == args.new, call.error
        return seconds

    variants = {"plain": plain, **{name: functools.partial(attached, name) for name in switches}}
    times: dict[str, list[float]] = {name: [] for name in variants}
    ratios: dict[str, list[float]] = {name: [] for name in switches}
    warmup_seconds: dict[str, list[float]] = {name: [] for name in variants}
    after_warmup: dict[str, list[float]] = {name: [] for name in switches}  # the ratios without it
    same: list[bool] = []
    names = list(variants)
    try:
        with torch.no_grad():
            for round_ in range(args.repeats + 1):  # round 0 warms up (and captures) and is dropped
                measured = {}
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    measured[name] = variants[name]()
                same.extend(tokens[name] == tokens["plain"] for name in switches)
                if round_:
                    for name, seconds in measured.items():
                        times[name].append(seconds)
                        warmup_seconds[name].append(warmed[name])
                        if name in ratios:  # throughput: recorded over plain
                            ratios[name].append(measured["plain"] / seconds)
                            after_warmup[name].append((measured["plain"] - warmed["plain"])
                                                      / (seconds - warmed[name]))
                print(f"round {round_}: " + ", ".join(f"{n} {v:.2f}s" for n, v in measured.items()), file=sys.stderr)
        generated = args.requests * args.new
        timed_clocks = {name: values[1:] for name, values in clocks.items()}  # round 0 dropped, as its times
        published = {name: values[1:] for name, values in publisher.items()}
        counted = {name: manager_calls(variants[name]) for name in ("plain", "attached")}
    finally:
        if args.threads:
            torch.set_num_threads(threads)
    median = {name: statistics.median(values) for name, values in times.items()}
    per_token = (None if None in counted.values() else
                 {**{name: count / generated for name, count in counted.items()},
                  "added": (counted["attached"] - counted["plain"]) / generated})
    report = {
        **report_head("batching", where, args.clock, load_before),
        "model": {"arch": "llama", "shape": "smoke" if args.smoke else args.shape, "dtype": str(model.dtype),
                  "hidden": model.config.hidden_size, "layers": model.config.num_hidden_layers,
                  "vocab": model.config.vocab_size},
        "batching": {"requests": args.requests, "prompt_tokens": args.prompt, "new_tokens": args.new,
                     "cuda_graph": args.cuda_graph, "asynchronous": False, "page_size": page, "num_blocks": blocks},
        "smoke": args.smoke,
        "repeats": {name: len(values) for name, values in times.items()},
        "median_seconds": median,
        "median_tokens_per_s": {name: generated / seconds for name, seconds in median.items()},
        "paired_throughput_ratios": ratios["attached"],
        "manager_thread_torch_calls_per_token": per_token,
        "manager_thread_us_per_token": _per_token_us(timed_clocks, generated),
        "publisher_thread_cpu_us_per_token": {name: 1e6 * statistics.median(values) / generated
                                              for name, values in published.items() if values},
        # the defaults, then each switched: which is faster here (ENGINE_ENDS_WAIT, SCORED_ELSEWHERE)
        "variants": {name: {"switches": {switch: sorted(value) if isinstance(value, frozenset) else value
                                         for switch, value in switches[name].items()},
                            "steps_scored_in": sorted(scoring[name]),
                            "paired_throughput_ratios": ratios[name],
                            "throughput_over_plain": statistics.median(ratios[name])} for name in switches},
        # generate_batch warms each new manager up in every call, plain's and recorded (with CUDA graphs: captures
        # them); a server's manager does so once: the ratios without it are the steady state's
        "warmup_median_seconds": {name: statistics.median(values) for name, values in warmup_seconds.items()},
        "throughput_over_plain_after_warmup": {name: statistics.median(values) for name, values in after_warmup.items()},
        "attached_throughput_over_plain": statistics.median(ratios["attached"]),
        "goal_attached_throughput_over_plain": None if args.smoke else 0.95,
        "every_request_recorded": True,  # checked every round
        "same_tokens_as_plain": all(same),
    }
    emit(report, args.out)


def _per_token_us(clocks: dict[str, list[tuple[float, float]]], generated: int) -> dict | None:
    """The manager thread's median CPU and wall microseconds per generated token, plain and each recorded variant,
    and what recording added (``added``: the default's; ``added_<variant>`` the others'), None where a call's thread
    was not clocked."""
    if "plain" not in clocks or not all(clocks.values()):
        return None
    out = {name: {kind: 1e6 * statistics.median(pair[index] for pair in pairs) / generated
                  for index, kind in enumerate(("cpu", "wall"))} for name, pairs in clocks.items()}
    for name in [name for name in out if name != "plain"]:
        key = "added" if name == "attached" else f"added_{name.removeprefix('attached_')}"
        out[key] = {kind: out[name][kind] - out["plain"][kind] for kind in ("cpu", "wall")}
    return out


if __name__ == "__main__":
    main()
