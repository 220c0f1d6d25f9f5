"""Cost of an attached forward versus a plain one, and versus a full-vocabulary logit lens.

    python benchmarks/bench_forward.py [--repeats 15] [--device cpu] [--out benchmarks/results/forward_cpu.json]

All variants run interleaved in one process (this machine is shared and noisy); medians are reported and the
ratios are of medians measured side by side. Model: random-init Llama, hidden 512, 8 layers, vocab 32000.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import nxl_hooks as nxl
from _common import device_label, emit, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8)
    model = LlamaForCausalLM(config).eval().to(device)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), device=device)

    def plain():
        model(input_ids=ids)

    def logit_lens():  # what a naive per-layer explainer does: every layer through lm_head(norm(h))
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
        for h in hidden[:-1]:
            model.lm_head(model.model.norm(h))
        model.lm_head(hidden[-1])  # already normed by transformers

    def attached():  # attach/detach stay outside the timed region, as in a server loop
        with nxl.attach(model, layers="all") as probe:
            seconds = timed(lambda: (model(input_ids=ids), probe.result()), device)
        return seconds

    variants = {"plain": lambda: timed(plain, device), "attached": attached,
                "logit_lens": lambda: timed(logit_lens, device)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        names = list(variants)
        for round_ in range(args.repeats + 1):  # round 0 warms up and is dropped
            for name in names[round_ % 3:] + names[: round_ % 3]:  # rotate: no variant always follows another
                run = variants[name]
                seconds = run()
                if round_:
                    times[name].append(seconds)

    median = {name: statistics.median(values) for name, values in times.items()}
    report = {
        "benchmark": "forward",
        "device": device_label(device),
        "torch": torch.__version__,
        "model": {"arch": "llama", "hidden": 512, "layers": 8, "vocab": 32000, "tokens": args.tokens, "batch": 1},
        "repeats": args.repeats,
        "median_seconds": median,
        "attached_over_plain": median["attached"] / median["plain"],
        "logit_lens_over_plain": median["logit_lens"] / median["plain"],
        "goal_attached_over_plain": 1.05,
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
