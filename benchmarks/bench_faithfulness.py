"""Offline faithfulness benchmark: every attribution method on tiny models trained here, in seconds, on
tasks with a known evidence token (examples/train_tasks.py). Prints JSON and writes it with a markdown table.

    python benchmarks/bench_faithfulness.py                  # 3 seeds x 100 held-out examples per task
    python benchmarks/bench_faithfulness.py --seeds 0 --n 30 # a quick look
    python benchmarks/bench_faithfulness.py --smoke          # every task on a few sentences: does it still run (CI)

For each task and seed: train the model, score held-out examples with nxl_hooks.eval.faithfulness (AOPC at the last
layer, alignment at every layer), and AOPC again at every other layer for the layered methods (LogAt,
NormXLogit, contrastive). Figures are means over seeds with the spread (min..max) across seeds.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import train_tasks  # noqa: E402

from nxl_hooks.eval import faithfulness as ev  # noqa: E402
from _common import add_smoke_option, smoke_out  # noqa: E402

LAYERED = ("logat", "normxlogit", "contrastive")
TASKS = {
    "sentiment": {
        "train": train_tasks.train_sentiment,
        "examples": lambda n, seed: train_tasks.sentiment_examples(n, seed=train_tasks.HELD_OUT_SEED + seed),
        "about": "keyword sentiment classification; 2-block BERT (hidden 32) classifier trained with 15% of the words "
                 "masked; evidence = the keyword; perturbation = [MASK]; p = softmax over the 2 labels of the predicted "
                 "label; foil = the other label",
    },
    "sentiment_demo": {
        "train": train_tasks.train_demo_recipe,
        "examples": lambda n, seed: train_tasks.sentiment_examples(n, seed=train_tasks.HELD_OUT_SEED + seed),
        "about": "the same sentences scored by the recipe of the model `nxl demo` ships (examples/train_demo.py): a "
                 "2-block Llama sequence classifier (hidden 64) reading the final [SEP], trained with a third of neutral "
                 "sentences; perturbation = deletion; foil = the runner-up label",
    },
    "agreement": {
        "train": train_tasks.train_agreement,
        "examples": lambda n, seed: train_tasks.agreement_examples(n, seed=train_tasks.HELD_OUT_SEED + seed),
        "about": "subject-verb number agreement with 1-2 attractor nouns and an adverb before the verb; 2-block "
                 "Llama (hidden 64) causal LM; evidence = the subject noun; target = the correct verb, foil = the wrong "
                 "one; perturbation = deletion; p = softmax over (target, foil)",
    },
    "agreement_mlm": {
        "train": train_tasks.train_agreement_mlm,
        "examples": lambda n, seed: train_tasks.agreement_examples(n, seed=train_tasks.HELD_OUT_SEED + seed, masked=True),
        "about": "the same agreement sentences with the verb replaced by <mask>; 2-block BERT (hidden 64) masked LM "
                 "trained with the verb and 15% of the other words masked; perturbation = <mask>; p = softmax over "
                 "(target, foil) at the mask",
    },
    "agreement_ft": {
        "train": functools.partial(train_tasks.train_agreement, verb_only=True),
        "examples": lambda n, seed: train_tasks.agreement_examples(n, seed=train_tasks.HELD_OUT_SEED + seed),
        "about": "the agreement task under the paper's BLiMP fine-tuning protocol: the same 2-block Llama causal LM "
                 "trained with the loss only on the verb (correct verb over the foil), nothing else; perturbation = "
                 "deletion; p = softmax over (target, foil)",
    },
    "agreement_mlm_ft": {
        "train": functools.partial(train_tasks.train_agreement_mlm, mask_rate=0.0),
        "examples": lambda n, seed: train_tasks.agreement_examples(n, seed=train_tasks.HELD_OUT_SEED + seed, masked=True),
        "about": "the paper's BLiMP fine-tuning protocol on the masked LM: the same 2-block BERT trained with only the "
                 "verb masked and the loss only there (correct verb over the foil); perturbation = <mask>; p = softmax "
                 "over (target, foil) at the mask",
    },
}


def _spread(values: list[float | None]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def run_task(name: str, seeds: list[int], n: int, training: dict | None = None) -> dict:
    """One task: train a model per seed (``training`` overrides the recipe's sizes: ``--smoke``), score ``n``
    held-out examples with every method."""
    task = TASKS[name]
    per_seed = []
    for seed in seeds:
        start = time.perf_counter()
        model, tokenizer = task["train"](seed=seed, **(training or {}))
        train_seconds = time.perf_counter() - start
        examples = task["examples"](n, seed)
        start = time.perf_counter()
        summary = ev.aggregate([ev.score_example(model, tokenizer, ex, ev.METHODS, seed=seed) for ex in examples])
        eval_seconds = time.perf_counter() - start
        by_layer = {}
        for layer in summary["layers"][:-1]:
            records = [ev.score_example(model, tokenizer, ex, LAYERED, layer=layer, seed=seed) for ex in examples]
            by_layer[layer] = ev.aggregate(records)["methods"]
        by_layer[summary["layers"][-1]] = summary["methods"]
        per_seed.append({"seed": seed, "train_seconds": train_seconds, "eval_seconds": eval_seconds,
                         "summary": summary, "aopc_by_layer": {
                             m: {str(layer): [by_layer[layer][m]["aopc_comprehensiveness"],
                                              by_layer[layer][m]["aopc_sufficiency"]] for layer in by_layer}
                             for m in LAYERED}})
    methods = list(per_seed[0]["summary"]["methods"])
    layers = per_seed[0]["summary"]["layers"]
    table = {}
    for method in methods:
        rows = [s["summary"]["methods"][method] for s in per_seed]
        entry = {key: _spread([r[key] for r in rows])
                 for key in ("aopc_comprehensiveness", "aopc_sufficiency", "ap_eval", "dot_eval", "seconds")}
        n_layers = len(rows[0]["ap"])
        entry["ap_by_layer"] = [_spread([r["ap"][i] for r in rows])["mean"] for i in range(n_layers)]
        entry["dot_by_layer"] = [_spread([r["dot"][i] for r in rows])["mean"] for i in range(n_layers)]
        if method in LAYERED:
            entry["aopc_by_layer"] = {
                str(layer): [_spread([s["aopc_by_layer"][method][str(layer)][j] for s in per_seed])["mean"] for j in (0, 1)]
                for layer in layers
            }
        table[method] = entry
    return {
        "about": task["about"],
        "n_examples": n,
        "seeds": seeds,
        "layers": layers,
        "accuracy": _spread([s["summary"]["accuracy"] for s in per_seed]),
        "train_seconds": _spread([s["train_seconds"] for s in per_seed]),
        "eval_seconds": _spread([s["eval_seconds"] for s in per_seed]),
        "table": table,
        "checks": _checks(table),
        "per_seed": per_seed,
    }


def _checks(table: dict) -> dict:
    """Does NormXLogit beat random, and which method wins each column (honest reporting)."""
    def mean(method, key):
        return table[method][key]["mean"]

    best = {
        "aopc_comprehensiveness": max(table, key=lambda m: mean(m, "aopc_comprehensiveness")),
        "aopc_sufficiency": min(table, key=lambda m: mean(m, "aopc_sufficiency")),
        "ap_last_layer": max(table, key=lambda m: mean(m, "ap_eval")),
        "ap_any_layer": max(table, key=lambda m: max(table[m]["ap_by_layer"])),
    }
    nx, rnd = table["normxlogit"], table["random"]
    return {
        "normxlogit_beats_random": {
            "aopc_comprehensiveness": nx["aopc_comprehensiveness"]["mean"] > rnd["aopc_comprehensiveness"]["mean"],
            "aopc_sufficiency": nx["aopc_sufficiency"]["mean"] < rnd["aopc_sufficiency"]["mean"],
            "ap_last_layer": nx["ap_eval"]["mean"] > rnd["ap_eval"]["mean"],
            "ap_best_layer": max(nx["ap_by_layer"]) > rnd["ap_eval"]["mean"],
        },
        "best_method": best,
    }


def _cell(spread: dict | None, digits: int = 3) -> str:
    if spread is None:
        return "-"
    return f"{spread['mean']:.{digits}f} ({spread['min']:.{digits}f}..{spread['max']:.{digits}f})"


def _per_layer(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


#: The summary in docs/benchmarks.md: one row per task, each cell "AOPC comp. / AOPC suff. / AP at the last layer".
SUMMARY_METHODS = ("random", "embed_norm", "logat", "normxlogit", "grad_norm", "grad_x_input", "integrated_gradients")
SUMMARY_TASKS = {
    "sentiment_demo": "Llama classifier, the demo's recipe",
    "agreement_ft": "Llama LM, loss only on the verb: the paper's BLiMP protocol",
    "agreement": "Llama LM, loss on every token",
    "sentiment": "BERT classifier",
    "agreement_mlm": "BERT MLM, verb + 15% masked",
    "agreement_mlm_ft": "BERT MLM, only the verb masked",
}


def summary_table(result: dict) -> str:
    """The table docs/benchmarks.md shows, from the benchmark's JSON (paste it there after a rerun)."""
    lines = ["| task | " + " | ".join(SUMMARY_METHODS) + " | NormXLogit > random (comp/suff/AP) |",
             "| --- |" + " --- |" * (len(SUMMARY_METHODS) + 1)]
    for name, about in SUMMARY_TASKS.items():
        task = result["tasks"].get(name)
        if task is None:
            continue
        cells = [" / ".join(f"{task['table'][m][key]['mean']:.2f}"
                            for key in ("aopc_comprehensiveness", "aopc_sufficiency", "ap_eval"))
                 for m in SUMMARY_METHODS]
        beats = task["checks"]["normxlogit_beats_random"]
        verdict = "/".join("yes" if beats[key] else "no"
                           for key in ("aopc_comprehensiveness", "aopc_sufficiency", "ap_last_layer"))
        lines.append(f"| {name} ({about}) | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    lines = ["# Faithfulness benchmark (offline, tiny models)", "",
             f"Written by `python benchmarks/bench_faithfulness.py`; {result['device']}. Means over seeds "
             f"{result['seeds']} with (min..max) across seeds; {result['n_examples']} held-out examples per seed.",
             "AOPC comprehensiveness: higher is better; sufficiency: lower is better (K = 10%..90%, ranking by the "
             "last layer's signed scores). AP and dot: evidence alignment, higher is better; dot uses one "
             "normalization for every method: (s - min s) / sum(s - min s) over the tokens (prediction position "
             "and special tokens left out, as they are never perturbed). Gradient baselines reduce each token's "
             "vector by its L1 norm, as the paper does.", "",
             "## Summary (the table in docs/benchmarks.md)", "", "Each cell: AOPC comprehensiveness ↑ / sufficiency ↓ / "
             "evidence AP at the last layer ↑.", "", summary_table(result), ""]
    for name, task in result["tasks"].items():
        layers = task["layers"]
        lines += [f"## {name}", "", task["about"] + f". Model accuracy {_cell(task['accuracy'])}; "
                  f"training {task['train_seconds']['mean']:.1f} s per model.", "",
                  "| method | AOPC comp. ↑ | AOPC suff. ↓ | AP last layer ↑ | AP per layer " + str(layers) +
                  " | dot per layer | s / example |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for method, row in task["table"].items():
            lines.append(f"| {method} | {_cell(row['aopc_comprehensiveness'])} | {_cell(row['aopc_sufficiency'])} | "
                         f"{_cell(row['ap_eval'])} | {_per_layer(row['ap_by_layer'])} | {_per_layer(row['dot_by_layer'])} | "
                         f"{row['seconds']['mean']:.4f} |")
        lines += ["", "AOPC (comprehensiveness / sufficiency) when ranking by each layer's scores:", "",
                  "| method | " + " | ".join(f"layer {layer}" for layer in layers) + " |",
                  "| --- |" + " --- |" * len(layers)]
        for method in LAYERED:
            by_layer = task["table"][method]["aopc_by_layer"]
            lines.append(f"| {method} | " + " | ".join(f"{by_layer[str(layer)][0]:.3f} / {by_layer[str(layer)][1]:.3f}"
                                                       for layer in layers) + " |")
        checks = task["checks"]
        lines += ["", "NormXLogit beats random: " + ", ".join(f"{k} {'yes' if v else 'NO'}"
                                                         for k, v in checks["normxlogit_beats_random"].items()) +
                  ". Best method: " + ", ".join(f"{k} {v}" for k, v in checks["best_method"].items()) + ".", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--n", type=int, default=100, help="held-out examples per task and seed")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/faithfulness.json")
    add_smoke_option(parser)
    args = parser.parse_args()
    # --smoke: each task's model trained on 64 sentences for one epoch, 3 held-out examples, one seed
    training = {"n_train": 64, "epochs": 1} if args.smoke else None
    if args.smoke:
        args.seeds, args.n, args.out = [0], 3, smoke_out(parser, args.out, "faithfulness")
    args.out = args.out or ROOT / "benchmarks" / "results" / "faithfulness.json"
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    result = {
        "benchmark": "faithfulness",
        "device": f"cpu ({platform.processor() or platform.machine()}, {args.threads} threads), torch {torch.__version__}, "
                  f"transformers {transformers.__version__}",
        "seeds": args.seeds,
        "n_examples": args.n,
        "methods": list(ev.METHODS),
        "smoke": args.smoke,
        "tasks": {name: run_task(name, args.seeds, args.n, training) for name in args.tasks},
    }
    result["total_seconds"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(markdown(result))
    print(json.dumps({name: {"table": {m: {k: v["mean"] if isinstance(v, dict) and "mean" in v else v
                                            for k, v in row.items() if k in ("aopc_comprehensiveness", "aopc_sufficiency", "ap_eval")}
                                       for m, row in task["table"].items()}, "checks": task["checks"]}
                      for name, task in result["tasks"].items()}, indent=1))


if __name__ == "__main__":
    main()
