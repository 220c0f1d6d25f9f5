"""Cost of recording transformers' compiled generate (a static cache, compiled by generate itself), versus the same
compiled generate unrecorded.

    python benchmarks/bench_compiled.py [--repeats 5] [--calls 2] [--batch 1] [--threads 1] [--clock wall|cpu] [--device cpu] \\
        [--shape full|llama2-7b] [--dtype float32|bfloat16] [--out benchmarks/results/compiled_cpu.json]
    python benchmarks/bench_compiled.py --smoke     # tiny model, one round, dynamo's eager backend (CI)

Model: random-init Llama as benchmarks/bench_generate.py (hidden 512, 8 layers, vocab 32000; on a GPU
``--shape llama2-7b --dtype bfloat16``), a 128-token prompt,
64 new tokens, greedy, ``cache_implementation="static"`` with ``CompileConfig(_compile_all_devices=True)`` so that
the CPU compiles as a GPU does (inductor). Three copies of the same weights, each compiled once before the timed
rounds: "plain" (no probe), "attached" (``nxl.attach(layers="all")`` for the whole run: attaching makes generate
compile a call that traces the hooks, once) and "attached_sink" (the same, every record also written to a sink
file). Every round runs the three back to back in a rotating order; each ratio is against the plain run of the same
round, and the report gives the median of those paired ratios. Each attached call is checked: every step recorded,
the same tokens as plain. Each variant's turn is ``--calls`` calls back to back, timed until their records are
all made (on a GPU a call's steps are recorded in a thread of their own when it returns, while the next call runs:
:meth:`nxl_hooks.hooks.generate.Run.finish`); how soon each call returns is reported beside it
(``return_over_plain``).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import CompileConfig

import nxl_hooks as nxl
from _common import add_model_options, add_run_options, begin, device_label, emit, random_llama, report_head, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend generate compiles with")
    parser.add_argument("--calls", type=int, default=2,
                        help="calls back to back per variant and round, timed until their records are made")
    add_model_options(parser)
    add_run_options(parser)
    args, device, load_before, threads = begin(parser, "compiled", repeats=1, prompt=8, new=4, backend="eager")
    where = device_label(device)

    plain_model = random_llama("smoke" if args.smoke else args.shape, device, args.dtype)  # the full run of new tokens
    config = plain_model.config
    models = {"plain": plain_model, "attached": copy.deepcopy(plain_model), "attached_sink": copy.deepcopy(plain_model)}
    compile_config = CompileConfig(backend=args.backend)
    compile_config._compile_all_devices = True
    ids = torch.randint(3, config.vocab_size, (args.batch, args.prompt), device=device)
    generation = dict(input_ids=ids, max_new_tokens=args.new, do_sample=False, cache_implementation="static",
                      compile_config=compile_config)
    sink_folder = tempfile.TemporaryDirectory()
    sink = Path(sink_folder.name) / "run.nxl"
    probes = {"attached": nxl.attach(models["attached"], layers="all"),
              "attached_sink": nxl.attach(models["attached_sink"], layers="all", sink=sink)}
    outputs: dict[str, torch.Tensor] = {}

    returned: dict[str, list[float]] = {name: [] for name in models}  # each timed call's wall seconds to return

    def run(name: str) -> float:
        probe = probes.get(name)

        def calls() -> None:  # back to back; then, recorded, until their records are made
            for _ in range(args.calls):
                start = time.perf_counter()
                outputs[name] = models[name].generate(**generation)
                returned[name].append(time.perf_counter() - start)
            if probe is not None:
                probe.calls

        seconds = timed(calls, device, args.clock)
        if probe is not None:  # every step of these calls recorded, and the tokens are plain's
            for call in probe.calls[-args.calls:]:
                assert call.error is None and len(call.steps) == args.new, call.error
        return seconds

    times: dict[str, list[float]] = {name: [] for name in models}
    ratios: dict[str, list[float]] = {name: [] for name in models if name != "plain"}
    names = list(models)
    same_rounds: list[bool] = []
    try:
        with torch.no_grad():
            for round_ in range(args.repeats + 1):  # round 0 compiles and warms up, and is dropped
                measured = {}
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    measured[name] = run(name)
                same_rounds.append(all(torch.equal(outputs[name], outputs["plain"]) for name in names))
                # on a GPU this is reported with what plain does itself (below), not stopped on: kernels may differ
                assert same_rounds[-1] or not args.smoke, "a recorded compiled generate emitted other tokens"
                if round_:
                    for name, seconds in measured.items():
                        times[name].append(seconds)
                        if name != "plain":
                            ratios[name].append(seconds / measured["plain"])
                else:  # (warm-up)
                    for values in returned.values():
                        values.clear()
                print(f"round {round_}: " + ", ".join(f"{n} {v:.2f}s" for n, v in measured.items()), file=sys.stderr)
        unrecorded = {name: probe.unrecorded for name, probe in probes.items()}
        divergence = _divergence(models, generation)
    finally:
        for probe in probes.values():
            probe.detach()
        if args.threads:
            torch.set_num_threads(threads)
    recorded_on_disk = len(nxl.read_stream(sink)[-1].steps)
    sink_folder.cleanup()
    paired = {name: statistics.median(values) for name, values in ratios.items()}
    report = {
        **report_head("compiled", where, args.clock, load_before),
        "backend": args.backend,
        "mode": compile_config.mode,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "model": {"arch": "llama", "shape": "smoke" if args.smoke else args.shape, "dtype": str(plain_model.dtype),
                  "hidden": config.hidden_size, "layers": config.num_hidden_layers,
                  "vocab": config.vocab_size, "prompt_tokens": args.prompt, "new_tokens": args.new,
                  "batch": args.batch, "decoding": "greedy, static cache, compiled by generate"},
        "smoke": args.smoke,
        "repeats": {name: len(values) for name, values in times.items()},
        "median_seconds": {name: statistics.median(values) for name, values in times.items()},
        "paired_ratios": ratios,
        "paired_ratio_medians": paired,
        # how soon each call returns, recorded / plain (medians): where its steps are recorded in a thread of their
        # own (on a GPU), before they are
        "return_seconds_medians": {name: statistics.median(values) for name, values in returned.items()},
        "return_over_plain": {name: statistics.median(values) / statistics.median(returned["plain"])
                              for name, values in returned.items() if name != "plain"},
        "attached_over_plain": paired["attached"],
        "attached_sink_over_plain": paired["attached_sink"],
        "goal_attached_over_plain": None if args.smoke else 1.05,  # a smoke run's ratios mean nothing
        "unrecorded": unrecorded,
        "sink_steps_of_last_call": recorded_on_disk,
        "same_tokens_as_plain": all(same_rounds),
        # where recorded and plain calls part (tokens, and the logits up to there), and where two plain calls do:
        # tells a change recording made from kernels that do not repeat themselves
        "divergence": divergence,
    }
    emit(report, args.out)


def _divergence(models: dict[str, torch.nn.Module], generation: dict) -> dict[str, dict]:
    """For "attached" and a second "plain" call, against a plain call: the first step whose token differs (None:
    none does) and the largest logit difference up to and including it."""
    def logits(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        out = models[name].generate(**generation, return_dict_in_generate=True, output_logits=True)
        return out.sequences[:, -len(out.logits):], torch.stack(out.logits, 1).float()

    tokens, reference = logits("plain")
    found = {}
    for name in ("attached", "plain"):
        other_tokens, other = logits(name)
        differs = (other_tokens != tokens).any(0).nonzero()
        first = int(differs[0]) if len(differs) else None
        until = tokens.shape[1] if first is None else first + 1
        found["attached" if name == "attached" else "plain_again"] = {
            "first_differing_step": first,
            "max_logit_difference_until_then": float((other[:, :until] - reference[:, :until]).abs().max())}
    return found


if __name__ == "__main__":
    main()
