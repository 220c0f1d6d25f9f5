"""Cost of an attached forward versus a plain one, and versus a full-vocabulary logit lens.

    python benchmarks/bench_forward.py [--repeats 30] [--threads 2] [--clock wall|cpu] [--device cpu] \\
        [--out benchmarks/results/forward_cpu.json]
    python benchmarks/bench_forward.py --smoke      # tiny model, one round: does it still run (CI)

Two ways of using the probe are timed, each with ``result()``:

- ``server``: attached once, many forwards (a server loop; attach/detach outside the timed region);
- ``once``: attach, one forward, result, detach (the CLI and notebook pattern).

This machine is shared and noisy, so every round runs all variants back to back in a rotating order, each ratio is
taken against the plain forward of the same round, and the report gives the median of those paired ratios (medians
of separate series, or best-of, swing by 5%). Model: random-init Llama, hidden 512, 8 layers, vocab 32000.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import nxl_hooks as nxl
from _common import add_run_options, device_label, emit, load_average, random_llama, report_head, smoke_out, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    add_run_options(parser)
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.tokens, args.threads = 1, 16, 1  # one thread: no spin-waits beside other tests
        args.out = smoke_out(parser, args.out, "forward")
    device = torch.device(args.device)
    load_before = load_average()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = random_llama("smoke" if args.smoke else "full", device)
    config = model.config
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), device=device)

    def plain():
        model(input_ids=ids)

    def logit_lens():  # what a naive per-layer explainer does: every layer through lm_head(norm(h))
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
        for h in hidden[:-1]:
            model.lm_head(model.model.norm(h))
        model.lm_head(hidden[-1])  # already normed by transformers

    def server():  # attach/detach stay outside the timed region, as in a server loop
        with nxl.attach(model, layers="all") as probe:
            return timed(lambda: (model(input_ids=ids), probe.result()), device, args.clock)

    def once():
        def run():
            with nxl.attach(model, layers="all") as probe:
                model(input_ids=ids)
            probe.result()

        return timed(run, device, args.clock)

    def measure(variants: dict) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        times: dict[str, list[float]] = {name: [] for name in variants}
        ratios: dict[str, list[float]] = {name: [] for name in variants if name != "plain"}
        names = list(variants)
        for round_ in range(args.repeats + 1):  # round 0 warms up and is dropped
            shift = round_ % len(names)
            seconds = {name: variants[name]() for name in names[shift:] + names[:shift]}
            if round_:
                for name, value in seconds.items():
                    times[name].append(value)
                for name in ratios:
                    ratios[name].append(seconds[name] / seconds["plain"])
        return times, ratios

    with torch.no_grad():
        times, ratios = measure({"plain": lambda: timed(plain, device, args.clock), "server": server, "once": once})
        # Apart: the lens allocates layers x tokens x vocabulary floats, which would disturb whatever runs next.
        lens_times, lens_ratios = measure({"plain": lambda: timed(plain, device, args.clock),
                                           "logit_lens": lambda: timed(logit_lens, device, args.clock)})
    times["logit_lens"], ratios["logit_lens"] = lens_times["logit_lens"], lens_ratios["logit_lens"]

    median = {name: statistics.median(values) for name, values in times.items()}
    paired = {name: statistics.median(values) for name, values in ratios.items()}
    report = {
        **report_head("forward", device_label(device), args.clock, load_before),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),  # PASSIVE: idle threads sleep, CPU time = work
        "model": {"arch": "llama", "hidden": config.hidden_size, "layers": config.num_hidden_layers,
                  "vocab": config.vocab_size, "tokens": args.tokens, "batch": 1},
        "smoke": args.smoke,
        "repeats": args.repeats,
        "median_seconds": median,
        "paired_ratio_medians": paired,
        "server_over_plain": paired["server"],
        "once_over_plain": paired["once"],
        "logit_lens_over_plain": paired["logit_lens"],
    }
    if not args.smoke:  # a smoke run's ratios mean nothing
        report["goals"] = {"server_over_plain": 1.02, "once_over_plain": 1.03}
    emit(report, args.out)


if __name__ == "__main__":
    main()
