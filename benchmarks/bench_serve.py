"""Cost of ``nxl run`` on a real server: request latency and throughput of ``transformers serve``, plain and
under ``nxl run`` (``--layers last`` and ``--layers all``, records written to a sink), with 1 and 4 concurrent
clients; and a soak of many requests showing the server's memory and the state nxl keeps staying flat.

    python benchmarks/bench_serve.py [--models tiny,smollm2] [--rounds N] [--soak 1000] \\
        [--out benchmarks/results/serve_cpu.json] [--readme docs/benchmarks.md]
    python benchmarks/bench_serve.py --render benchmarks/results/serve_cpu.json --readme docs/benchmarks.md  # table
    python benchmarks/bench_serve.py --smoke        # the tiny model, one round, no soak: does it still run (CI)
    python benchmarks/bench_serve.py --load16 --out benchmarks/results/serve_cpu_16clients.json   # 16 clients only

The three servers of a model run side by side on 127.0.0.1 and are measured in interleaved rounds (the order
rotates each round), so the machine's noise falls on all of them alike; ratios are of medians measured in one run.
Requests are non-streaming chat completions, greedy, a fixed ``max_tokens``; every variant must answer with the
same text (checked). Without continuous batching serve runs one request at a time, so 4 clients mostly measure
queueing: throughput is the figure to read there. Models: the tiny chat model of tests/serving.py, and
SmolLM2-135M-Instruct (tests/real_model.py fetches it; ``--smollm2 DIR`` or ``$NXL_TEST_CACHE`` point at a converted
folder; the JSON says why it did not run otherwise). The soak (tiny model) interleaves a plain and an
``nxl run --layers all`` server, prompts and lengths varying, and samples the server's RSS, the calls nxl keeps in
memory and the bytes in its sink. ``--readme`` rewrites the table between the ``bench_serve`` markers.

``--load16`` measures only the load of many clients under continuous batching: SmolLM2 served with
``--continuous-batching``, plain and under ``nxl run --layers all`` (sink on), 16 clients sending 64 requests per
round, the two servers in alternating rounds (paired ratios: each nxl round against the plain round beside it);
the server's RSS after warm-up and after every round, the machine's load averages around every round, and the size
the probe's per-request feature caches reach (the formula of docs/engines.md) next to the RSS growth.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from _common import add_smoke_option, emit, smoke_out  # noqa: E402
from serving import Server, save_chat_model  # noqa: E402

QUESTION = {"tiny": "hello world how are you", "smollm2": "Write a short story about a robot who learns to paint."}
ROUNDS, MAX_TOKENS = {"tiny": 30, "smollm2": 10}, {"tiny": 32, "smollm2": 24}
VARIANTS = {"plain": None, "nxl_last": ["--layers", "last"], "nxl_all": ["--layers", "all"]}
MARKERS = ("<!-- bench_serve:begin -->", "<!-- bench_serve:end -->")


def _smollm2(folder: str | None) -> tuple[Path | None, str | None]:
    """The SmolLM2 folder, or None and why not."""
    if folder:
        return Path(folder), None
    try:
        from real_model import smollm2_dir  # tests/real_model.py: fetched once into the cache

        return smollm2_dir(), None
    except ImportError:
        cache = Path(os.environ.get("NXL_TEST_CACHE", Path.home() / ".cache" / "nxl_hooks")) / "smollm2-0.1.2" / "hf"
        if (cache / "model.safetensors").exists():
            return cache, None
        return None, f"no converted SmolLM2 folder at {cache} and no tests/real_model.py to fetch one"
    except Exception as error:  # noqa: BLE001 - offline: say so in the JSON
        return None, f"{type(error).__name__}: {error}"


THREADS = {"OMP_NUM_THREADS": "1"}  # set by main(): torch threads of each server


def _start(model: Path, variant: str, work: Path, extra: list[str] = (), tag: str = "") -> Server:
    """A server of ``variant``; under nxl run its run folder is ``work/run-<variant>-<model><tag>``."""
    nxl = VARIANTS[variant]
    if nxl is not None:
        nxl = [*nxl, "--sink", str(work / f"run-{variant}-{model.name}{tag}"), *extra]
    return Server(model, nxl=nxl, log=work / f"{variant}-{model.name}{tag}.log", env=THREADS).start()


def _timed(server: Server, content: str, max_tokens: int) -> tuple[float, str]:
    start = time.perf_counter()
    reply = server.chat(content, max_tokens=max_tokens)
    return time.perf_counter() - start, reply["content"]


def measure(servers: dict[str, Server], content: str, max_tokens: int, clients: int, rounds: int) -> dict:
    """Latency and throughput per variant; ratios to plain. A round sends one batch of ``clients`` concurrent
    requests to each variant in turn (the order rotates), so slow spells of a shared machine hit all alike."""
    latencies: dict[str, list[float]] = {name: [] for name in servers}
    throughput: dict[str, list[float]] = {name: [] for name in servers}
    # The server's own CPU seconds per request: what the probe adds to the work, whatever else the machine runs
    # (wall latency on a shared machine also carries the other processes' load).
    cpu: dict[str, list[float]] = {name: [] for name in servers}
    processes = {name: psutil.Process(server.pid) for name, server in servers.items()}
    answers: dict[str, set[str]] = {name: set() for name in servers}
    names = list(servers)
    for index in range(rounds):
        for name in names[index % len(names):] + names[: index % len(names)]:
            start, busy = time.perf_counter(), sum(processes[name].cpu_times()[:2])
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                done = list(pool.map(lambda _: _timed(servers[name], content, max_tokens), range(clients)))
            throughput[name].append(clients / (time.perf_counter() - start))
            cpu[name].append((sum(processes[name].cpu_times()[:2]) - busy) / clients)
            latencies[name] += [seconds for seconds, _ in done]
            answers[name] |= {text for _, text in done}
    if len({frozenset(a) for a in answers.values()}) != 1 or len(answers["plain"]) != 1:
        raise AssertionError(f"the variants answered differently: {answers}")
    out = {}
    for name in names:
        lat = sorted(latencies[name])
        out[name] = {"latency_median_s": statistics.median(lat), "latency_min_s": lat[0],
                     "latency_p90_s": lat[int(0.9 * (len(lat) - 1))],
                     "throughput_rps": statistics.median(throughput[name]), "requests": len(lat),
                     "cpu_per_request_s": statistics.median(cpu[name])}
    for name in names[1:]:
        out[name]["latency_ratio"] = out[name]["latency_median_s"] / out["plain"]["latency_median_s"]
        # the fastest request of each: the least disturbed by the machine's other work
        out[name]["latency_min_ratio"] = out[name]["latency_min_s"] / out["plain"]["latency_min_s"]
        out[name]["throughput_ratio"] = out[name]["throughput_rps"] / out["plain"]["throughput_rps"]
        plain_cpu = out["plain"]["cpu_per_request_s"]  # 0 where a request took less than the clock's tick
        out[name]["cpu_ratio"] = out[name]["cpu_per_request_s"] / plain_cpu if plain_cpu else None
    return out


CB_SERVE = ["--continuous-batching", "--cb-num-blocks", "256", "--cb-block-size", "16", "--cb-max-batch-tokens",
            "256"]


def _rss_mib(server: Server) -> float:
    return psutil.Process(server.pid).memory_info().rss / 2**20


def load16(model: Path, work: Path, rounds: int, max_tokens: int, clients: int = 16, requests: int = 64) -> dict:
    """``requests`` chat completions from ``clients`` threads per round, plain and ``nxl run --layers all`` under
    continuous batching, in alternating rounds; throughput, RSS and load averages per round, paired ratios."""
    servers = {}
    for variant, nxl in (("plain", None), ("nxl_all", ["--layers", "all", "--sink", str(work / "run-load16")])):
        servers[variant] = Server(model, nxl=nxl, serve=CB_SERVE, log=work / f"load16-{variant}.log",
                                  env=THREADS).start()
    prompts = [f"{QUESTION['smollm2']} Number {index}." for index in range(requests)]
    rounds_out: list[dict] = []
    try:
        answers = {}
        for name, server in servers.items():  # warm-up: kernels, tokenizer, the manager's first batch
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                answers[name] = list(pool.map(lambda p: server.chat(p, max_tokens=max_tokens)["content"],
                                              prompts[:clients]))
        if answers["plain"] != answers["nxl_all"]:
            raise AssertionError("the servers answered differently under continuous batching")
        rss_start = {name: _rss_mib(server) for name, server in servers.items()}
        order = list(servers)
        for index in range(rounds):
            for name in order if index % 2 == 0 else order[::-1]:
                load_before = os.getloadavg()[0]
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                    replies = list(pool.map(lambda p: servers[name].chat(p, max_tokens=max_tokens), prompts))
                seconds = time.perf_counter() - start
                rounds_out.append({"round": index, "variant": name, "seconds": seconds,
                                   "throughput_rps": requests / seconds,
                                   "tokens": sum(r["usage"]["completion_tokens"] for r in replies),
                                   "rss_mib": _rss_mib(servers[name]), "load_average_1min_before": load_before,
                                   "load_average_1min_after": os.getloadavg()[0]})
                print(f"load16 round {index} {name}: {seconds:.1f} s, RSS {rounds_out[-1]['rss_mib']:.0f} MiB",
                      file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    import nxl_hooks as nxl

    (folder,) = [p for p in (work / "run-load16").iterdir() if p.is_dir()]
    calls = nxl.read_stream(folder)
    # every request of the warm-up and the rounds: one complete call, one step per completion token
    recorded = {"calls": len(calls), "requests_sent": clients + rounds * requests,
                "complete_with_every_step": sum(c.complete and len(c.steps) == c.sequences.shape[1] - c.prompt_ids.shape[1]
                                                for c in calls),
                "steps_with_probability": sum(s.probability is not None for c in calls for s in c.steps),
                "steps": sum(len(c.steps) for c in calls)}
    by = {name: [r for r in rounds_out if r["variant"] == name] for name in servers}
    paired = [n["throughput_rps"] / p["throughput_rps"] for p, n in zip(by["plain"], by["nxl_all"])]
    config = json.loads((model / "config.json").read_text())
    layers, width = config["num_hidden_layers"] + 1, config["hidden_size"]
    return {
        "model": model.name, "clients": clients, "requests_per_round": requests, "rounds": rounds,
        "max_tokens": max_tokens, "serve_flags": CB_SERVE, "nxl_flags": ["--layers", "all", "--sink", "DIR"],
        "rounds_detail": rounds_out,
        "throughput_rps_median": {name: statistics.median(r["throughput_rps"] for r in rs) for name, rs in by.items()},
        "seconds_median": {name: statistics.median(r["seconds"] for r in rs) for name, rs in by.items()},
        "throughput_ratio_paired": paired, "throughput_ratio_median": statistics.median(paired),
        "rss_mib_after_warmup": rss_start,
        "rss_growth_mib": {name: rs[-1]["rss_mib"] - rss_start[name] for name, rs in by.items()},
        "recorded": recorded,
        # what the probe allocates per request while it runs: every layer's features of every position, float32,
        # capacity doubled from 16 positions (docs/engines.md, "Memory")
        "feature_cache_mib_per_request_at_64_positions": layers * width * 4 * 64 / 2**20,
        "feature_cache_mib_16_concurrent_at_128_capacity": clients * layers * width * 4 * 128 / 2**20,
    }


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def soak(model: Path, work: Path, total: int, block: int = 50) -> dict:
    """``total`` requests to a plain and an ``nxl run --layers all`` server, interleaved in blocks; samples of
    RSS (MiB), kept calls and sink bytes every ``4 * block`` requests."""
    extra = ["--sink-file-mb", "1", "--sink-files", "4"]
    servers = {"plain": _start(model, "plain", work, tag="-soak"),
               "nxl_all": _start(model, "nxl_all", work, extra, tag="-soak")}
    sink = work / f"run-nxl_all-{model.name}-soak"
    rng = random.Random(0)
    words = [f"w{i}" for i in range(60)] + ["hello", "world", "how", "are", "you", "the"]
    samples: list[dict] = []
    try:
        for done in range(0, total, block):
            asks = [(" ".join(rng.choices(words, k=rng.randint(2, 30))), rng.randint(4, 24)) for _ in range(block)]
            for server in servers.values():
                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    list(pool.map(lambda ask: server.chat(ask[0], max_tokens=ask[1]), asks))
            if (done + block) % (4 * block) == 0:
                status = _status(sink)
                samples.append({"requests": done + block,
                                **{f"rss_mib_{name}": psutil.Process(s.pid).memory_info().rss / 2**20
                                   for name, s in servers.items()},
                                "kept_calls": sum(m["calls"] for m in status["models"]),
                                "sink_bytes": _tree_bytes(sink)})
    finally:
        for server in servers.values():
            server.stop()
    first, last = samples[0], samples[-1]
    return {"requests_per_server": total, "samples": samples,
            "rss_growth_mib": {name: last[f"rss_mib_{name}"] - first[f"rss_mib_{name}"] for name in servers},
            "kept_calls_max": max(s["kept_calls"] for s in samples), "sink_bytes_max": max(s["sink_bytes"] for s in samples)}


def _status(run: Path) -> dict:
    from nxl_hooks.apps.serve.client import endpoints

    (endpoint,) = endpoints(str(run))
    return endpoint.json("GET", "/v1/status")


def table(report: dict) -> str:
    """The table of a report, as docs/benchmarks.md shows it."""
    lines = ["| model | clients | plain: median latency, throughput, server CPU per request "
             "| nxl run --layers last (ratio to plain) | nxl run --layers all |",
             "| --- | --- | --- | --- | --- |"]
    for key, result in report["latency"].items():
        model, clients = key.rsplit("/", 1)
        plain = result["plain"]
        cells = [f"{plain['latency_median_s'] * 1000:.0f} ms, {plain['throughput_rps']:.2f} req/s, "
                 f"CPU {_cpu_ms(plain)}"]
        for name in ("nxl_last", "nxl_all"):
            r = result[name]
            cpu = f", CPU {_cpu_ms(r)} ({r['cpu_ratio']:.2f}x)" if r.get("cpu_ratio") is not None else ""
            cells.append(f"{r['latency_median_s'] * 1000:.0f} ms (**{r['latency_ratio']:.2f}x**), "
                         f"{r['throughput_rps']:.2f} req/s ({r['throughput_ratio']:.2f}x){cpu}")
        lines.append(f"| {model} | {clients.removeprefix('clients=')} | " + " | ".join(cells) + " |")
    if report.get("soak"):
        s = report["soak"]
        growth = s["rss_growth_mib"]
        lines.append("")
        lines.append(f"Soak ({s['requests_per_server']} requests per server, tiny model, 4 clients): RSS growth from "
                     f"request {s['samples'][0]['requests']} to {s['samples'][-1]['requests']}: plain "
                     f"{growth['plain']:+.1f} MiB, nxl run --layers all {growth['nxl_all']:+.1f} MiB; calls kept in "
                     f"memory at most {s['kept_calls_max']} (the default bound, 16); sink at most "
                     f"{s['sink_bytes_max'] / 2**20:.1f} MiB (4 files of 1 MiB).")
    return "\n".join(lines)


def _cpu_ms(result: dict) -> str:
    return f"{result['cpu_per_request_s'] * 1000:.0f} ms" if "cpu_per_request_s" in result else "not measured"


def _rewrite_readme(path: Path, text: str) -> None:
    readme = path.read_text()
    begin, end = readme.index(MARKERS[0]) + len(MARKERS[0]), readme.index(MARKERS[1])
    path.write_text(readme[:begin] + "\n" + text + "\n" + readme[end:])


def _rounds(text: str) -> dict[str, int]:
    """``--rounds``: "6" (every model) or "tiny=30,smollm2=6"."""
    if text.isdigit():
        return dict.fromkeys(ROUNDS, int(text))
    pairs = [part.split("=", 1) for part in text.split(",")]
    if not all(len(pair) == 2 and pair[0] in ROUNDS and pair[1].isdigit() for pair in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number, or model=number pairs ({', '.join(ROUNDS)})")
    return {model: int(count) for model, count in pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,smollm2", help="comma list: tiny, smollm2")
    parser.add_argument("--smollm2", metavar="DIR", help="a converted SmolLM2-135M-Instruct folder")
    parser.add_argument("--rounds", type=_rounds, default={},
                        help="rounds per model and client count: N for every model, or e.g. tiny=30,smollm2=6 "
                             "(default: tiny 30, smollm2 10)")
    parser.add_argument("--max-tokens", type=int, help="new tokens per request (default: tiny 32, smollm2 24)")
    parser.add_argument("--soak", type=int, default=1000, help="requests per server in the soak (0: none)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per server (default 1: the servers "
                        "share the machine's cores with each other and the clients)")
    parser.add_argument("--load16", action="store_true",
                        help="only the 16-client continuous-batching load on SmolLM2 (see above)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--readme", type=Path, help="rewrite the table between the bench_serve markers of this page "
                        "(docs/benchmarks.md)")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="measure nothing: redo the table of a saved report (in it, and in --readme)")
    add_smoke_option(parser)
    args = parser.parse_args()
    if args.smoke:  # every variant's server and both client counts, on the tiny model: one round, 4 tokens, no soak
        if args.readme:
            parser.error("--smoke writes no figures: leave out --readme")
        args.models, args.rounds, args.max_tokens, args.soak = "tiny", {"tiny": 1}, 4, 0
        args.out = smoke_out(parser, args.out, "serve")
    if args.render:
        report = json.loads(args.render.read_text())
        report["table"] = table(report)
        args.render.write_text(json.dumps(report, indent=2) + "\n")
        print(report["table"])
        if args.readme:
            _rewrite_readme(args.readme, report["table"])
        return
    THREADS["OMP_NUM_THREADS"] = str(args.threads)
    report: dict[str, Any] = {
        "benchmark": "serve", "device": f"cpu ({platform.processor() or platform.machine()})", "cpus": os.cpu_count(),
        "machine_note": "a VM with 2 cores shared with other sessions: figures are noisy; ratios are of medians "
                        "measured side by side in one run",
        "settings": {"server_threads": args.threads, "rounds": {m: args.rounds.get(m, ROUNDS[m]) for m in ROUNDS},
                     "max_tokens": {m: args.max_tokens or MAX_TOKENS[m] for m in MAX_TOKENS},
                     "request": "non-streaming chat completion, temperature 0", "sink": "on for nxl run"},
        "load_average_before": [round(value, 2) for value in os.getloadavg()], "latency": {}, "skipped": {}}
    if args.load16:
        folder, why = _smollm2(args.smollm2)
        if folder is None:
            raise SystemExit(f"--load16 needs SmolLM2: {why}")
        with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
            report["load16"] = load16(folder, Path(tmp), args.rounds.get("smollm2", 3),
                                      args.max_tokens or MAX_TOKENS["smollm2"])
        report["load_average_after"] = [round(value, 2) for value in os.getloadavg()]
        emit(report, args.out)
        return
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        work = Path(tmp)
        folders = {"tiny": save_chat_model(work / "tiny")}
        if "smollm2" in args.models:
            folder, why = _smollm2(args.smollm2)
            if folder is None:
                report["skipped"]["smollm2"] = why
            else:
                folders["smollm2"] = folder
        for name, folder in folders.items():
            if name not in args.models.split(","):
                continue
            with contextlib.ExitStack() as started:  # each server stopped, also when a later one fails to start
                servers = {}
                for variant in VARIANTS:
                    servers[variant] = _start(folder, variant, work)
                    started.callback(servers[variant].stop)
                max_tokens = args.max_tokens or MAX_TOKENS[name]
                for server in servers.values():  # warm up: first requests load kernels, tokenizers, caches
                    for _ in range(1 if args.smoke else 3):  # (a smoke run's figures mean nothing)
                        server.chat(QUESTION[name], max_tokens=max_tokens)
                for clients in (1, 4):
                    report["latency"][f"{name}/clients={clients}"] = measure(
                        servers, QUESTION[name], max_tokens, clients, args.rounds.get(name, ROUNDS[name]))
                    print(f"{name} clients={clients}: {report['latency'][f'{name}/clients={clients}']}",
                          file=sys.stderr, flush=True)
        if args.soak:
            report["soak"] = soak(folders["tiny"], work, args.soak)
    report["load_average_after"] = [round(value, 2) for value in os.getloadavg()]
    report["table"] = table(report)
    emit(report, args.out)
    if args.readme:
        _rewrite_readme(args.readme, report["table"])


if __name__ == "__main__":
    main()
