"""Cost of ``nxl run`` on a vLLM server: throughput of ``vllm serve`` plain (its default: compiled on the CPU)
against ``nxl run --layers all --sink DIR`` (which keeps it compiled and records through buffers compiled into the
model), and of plain eager (``--enforce-eager --no-enable-prefix-caching``) against ``nxl run --eager --layers all
--sink DIR`` (the eager fallback), with 1 and 8 concurrent clients; and each engine's start time (process start to
a healthy ``/health``).

    python benchmarks/bench_vllm.py [--model DIR] [--rounds 2] [--variants plain,nxl_all] [--out FILE]
    python benchmarks/bench_vllm.py --smoke       # the tiny model, one round, plain eager and nxl eager only,
                                                  # their engines started at once (CI)

Every variant's engine is started once, one after the other, and kept up (an idle engine waits for requests); then
each round loads every engine in turn, with 1 then 8 clients, the order rotating each round, so that the engines
meet the same load on a shared machine. Ratios are paired (each variant's round against the plain round of the
same round), medians over rounds, with every round's ratio beside them. Requests are non-streaming completions, greedy,
``ignore_eos``, a fixed ``max_tokens``; whether each recorded variant answered with the same text as its plain
counterpart is reported (``same_texts``: recording changes no reply). Model: a
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
VARIANTS = {"plain": {"nxl": None, "serve": []},
            "plain_eager": {"nxl": None, "serve": ["--enforce-eager", "--no-enable-prefix-caching"]},
            "nxl_all": {"nxl": ["--layers", "all"], "serve": []},  # compiled, as plain
            "nxl_all_eager": {"nxl": ["--eager", "--layers", "all"], "serve": []}}  # nxl run makes it eager itself
#: Each recorded variant's plain counterpart: the same engine mode, whose replies it must equal.
PLAIN = {"nxl_all": "plain", "nxl_all_eager": "plain_eager"}


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
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16, help="requests per engine, client count and round")
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

    variants = ["plain_eager", "nxl_all_eager"] if args.smoke else args.variants.split(",")
    rounds, requests, max_tokens = (1, 4, 8) if args.smoke else (args.rounds, args.requests, args.max_tokens)
    report.update(vllm=vllm.__version__, variants=variants, rounds=rounds, requests=requests, max_tokens=max_tokens,
                  clients=[1, 8], start_s={}, runs=[])
    with tempfile.TemporaryDirectory() as folder:
        model = Path(args.model) if args.model else save_tiny(Path(folder) / "tiny")
        report["model"] = str(args.model or "tiny (3 layers, hidden 128, head_dim 64)")
        servers: dict = {}

        def start(name: str) -> float:
            """Start ``name``'s engine and warm it up: the seconds its start took."""
            variant = VARIANTS[name]
            nxl = None if variant["nxl"] is None else [*variant["nxl"], "--sink", f"{folder}/{name}"]
            servers[name] = VllmServer(model, nxl=nxl, serve=variant["serve"], log=Path(folder) / f"{name}.log",
                                       engine=ENGINE)
            began = time.perf_counter()
            servers[name].start(timeout=900)
            seconds = time.perf_counter() - began
            _load(servers[name], 1, 1, 2)  # warm-up
            return seconds

        try:
            report["engines_started_together"] = args.smoke  # (then their start times are not figures)
            if args.smoke:  # its two engines started at once: half the wait, in CI
                with concurrent.futures.ThreadPoolExecutor(len(variants)) as pool:
                    report["start_s"] = dict(zip(variants, pool.map(start, variants)))
            else:  # one engine per variant, started one after the other, all kept up
                report["start_s"] = {name: start(name) for name in variants}
            for index in range(rounds):  # the loads alternate between the engines, the order rotating each round
                for name in variants[index % len(variants):] + variants[: index % len(variants)]:
                    run = {"round": index, "variant": name}
                    for clients in (1, 8):
                        run[f"clients={clients}"] = _load(servers[name], clients, requests, max_tokens)
                    report["runs"].append(run)
        finally:
            for server in servers.values():
                server.stop()
    _summarize(report)
    report["load_average_after"] = load_average()
    emit(report, args.out)
    return 0


def _summarize(report: dict) -> None:
    """Paired ratios to plain (or plain eager) per round and client count: median, min and max over rounds; whether
    each recorded variant answered as its plain counterpart did."""
    runs = {(run["round"], run["variant"]): run for run in report["runs"]}
    base = "plain" if "plain" in report["variants"] else "plain_eager"
    summary: dict = {"baseline": base, "throughput_ratio": {}, "ratio_per_round": {}, "same_texts": {}}
    for name in report["variants"]:
        for clients in report["clients"]:
            key = f"clients={clients}"
            ratios = [runs[(r, name)][key]["tokens_per_s"] / runs[(r, base)][key]["tokens_per_s"]
                      for r in range(report["rounds"])]
            summary["throughput_ratio"].setdefault(name, {})[key] = statistics.median(ratios)
            summary["ratio_per_round"].setdefault(name, {})[key] = ratios
        plain = PLAIN.get(name)
        if plain in report["variants"]:  # recording changes no reply: the same numerics, the same text
            summary["same_texts"][name] = all(
                runs[(r, name)][key]["texts"] == runs[(r, plain)][key]["texts"]
                for r in range(report["rounds"]) for key in (f"clients={c}" for c in report["clients"]))
    for run in report["runs"]:
        for clients in report["clients"]:
            run[f"clients={clients}"].pop("texts")
    report["summary"] = summary


if __name__ == "__main__":
    sys.exit(main())
