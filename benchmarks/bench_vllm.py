"""Cost of ``nxl run`` on a vLLM server: throughput of ``vllm serve`` plain (its default: compiled on the CPU),
plain eager (``--enforce-eager --no-enable-prefix-caching``: what recording imposes, so the eager fallback's own
cost shows apart from the hooks'), under ``nxl run --layers all --sink DIR`` (eager), and the same with
``NXL_VLLM_COMPILED=1`` (compiled, recorded through buffers), with 1 and 8 concurrent clients; and each engine's
start time (process start to a healthy ``/health``).

    python benchmarks/bench_vllm.py [--model DIR] [--rounds 2] [--variants plain,nxl_all_compiled] [--out FILE]
    python benchmarks/bench_vllm.py --smoke       # the tiny model, one round, plain eager and nxl only (CI)

One engine runs at a time (memory): each round starts every variant in turn, measures it with 1 then 8 clients,
and stops it; the order rotates each round, and ratios are paired (each variant's round against the plain round of
the same round), medians over rounds. Requests are non-streaming completions, greedy, ``ignore_eos``, a fixed
``max_tokens``; the eager variants must answer with the same text (recording changes no reply: checked). Model: a
tiny Llama built here (head_dim 64, as vLLM's CPU attention needs) unless ``--model`` names a folder (SmolLM2).
Needs vLLM importable (its own virtual environment: tests/README.md); without it the report says so and exits 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "vllm")]
from _common import add_smoke_option, emit, load_average, smoke_out  # noqa: E402

PROMPTS = ["The capital of France is", "They are here and it is there;", "The keys to the cabinet are",
           "Paris is a city. Rome is", "the film was very good and"]
#: The engine measured: vLLM's defaults but for the dtype, a model length that fits the tiny model, and the seed.
ENGINE = ["--dtype", "float32", "--max-model-len", "512", "--seed", "0"]
VARIANTS = {"plain": {"nxl": None, "serve": [], "env": {}},
            "plain_eager": {"nxl": None, "serve": ["--enforce-eager", "--no-enable-prefix-caching"], "env": {}},
            "nxl_all": {"nxl": ["--layers", "all"], "serve": [], "env": {}},  # nxl run makes the engine eager itself
            "nxl_all_compiled": {"nxl": ["--layers", "all"], "serve": [], "env": {"NXL_VLLM_COMPILED": "1"}}}


def _complete(server, prompt: str, max_tokens: int) -> tuple[str, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(server.base + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        data = json.loads(response.read())
    return data["choices"][0]["text"], data["usage"]["completion_tokens"]


def _load(server, clients: int, requests: int, max_tokens: int) -> dict:
    """``requests`` completions from ``clients`` threads: tokens per second and the texts, by prompt."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda prompt: _complete(server, prompt, max_tokens), prompts))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(n for _, n in answers), "tokens_per_s": sum(n for _, n in answers) /
            seconds, "texts": dict(zip(prompts, (text for text, _ in answers)))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder (default: a tiny Llama built here)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16, help="requests per client count and round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path)
    add_smoke_option(parser)
    args = parser.parse_args()
    args.out = smoke_out(parser, args.out, "vllm") if args.smoke else args.out
    report: dict = {"smoke": args.smoke, "load_average_before": load_average()}
    try:
        import vllm.envs  # not just "vllm": tests/vllm, on sys.path here, is a namespace package of that name
    except ImportError as error:
        report["skipped"] = f"vLLM is not importable here ({error}): run it in the vllm tier's environment"
        emit(report, args.out)
        return 0
    from test_vllm_serve import VllmServer, save_tiny

    variants = ["plain_eager", "nxl_all"] if args.smoke else args.variants.split(",")
    rounds, requests, max_tokens = (1, 4, 8) if args.smoke else (args.rounds, args.requests, args.max_tokens)
    report.update(vllm=vllm.__version__, variants=variants, rounds=rounds, requests=requests, max_tokens=max_tokens,
                  clients=[1, 8], runs=[])
    with tempfile.TemporaryDirectory() as folder:
        model = Path(args.model) if args.model else save_tiny(Path(folder) / "tiny")
        report["model"] = str(args.model or "tiny (3 layers, hidden 128, head_dim 64)")
        for index in range(rounds):
            order = variants[index % len(variants):] + variants[: index % len(variants)]
            for name in order:
                variant = VARIANTS[name]
                nxl = None if variant["nxl"] is None else [*variant["nxl"], "--sink", f"{folder}/{name}-{index}"]
                server = VllmServer(model, nxl=nxl, serve=variant["serve"], log=Path(folder) / f"{name}-{index}.log",
                                    engine=ENGINE, env=variant["env"])
                start = time.perf_counter()
                server.start(timeout=900)
                run = {"round": index, "variant": name, "start_s": time.perf_counter() - start}
                try:
                    _load(server, 1, 1, 2)  # warm-up
                    for clients in (1, 8):
                        run[f"clients={clients}"] = _load(server, clients, requests, max_tokens)
                finally:
                    server.stop()
                report["runs"].append(run)
    _summarize(report)
    report["load_average_after"] = load_average()
    emit(report, args.out)
    return 0


def _summarize(report: dict) -> None:
    """Paired ratios to plain (or plain eager) per round and client count, their medians; the texts checked."""
    runs = {(run["round"], run["variant"]): run for run in report["runs"]}
    base = "plain" if "plain" in report["variants"] else "plain_eager"
    summary: dict = {"baseline": base, "start_s": {}, "throughput_ratio": {}}
    for name in report["variants"]:
        summary["start_s"][name] = statistics.median(run["start_s"] for (_, v), run in runs.items() if v == name)
        for clients in report["clients"]:
            key = f"clients={clients}"
            ratios = [runs[(r, name)][key]["tokens_per_s"] / runs[(r, base)][key]["tokens_per_s"]
                      for r in range(report["rounds"])]
            summary["throughput_ratio"].setdefault(name, {})[key] = statistics.median(ratios)
    for (round_, name), run in runs.items():  # recording changes no reply: the same numerics, the same text
        if name != "plain" and "plain_eager" in report["variants"]:
            for clients in report["clients"]:
                key = f"clients={clients}"
                if run[key]["texts"] != runs[(round_, "plain_eager")][key]["texts"]:
                    raise SystemExit(f"{name} answered differently from plain_eager in round {round_} ({key})")
    for run in report["runs"]:
        for clients in report["clients"]:
            run[f"clients={clients}"].pop("texts")
    report["summary"] = summary


if __name__ == "__main__":
    sys.exit(main())
