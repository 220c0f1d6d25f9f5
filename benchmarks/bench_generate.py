"""Cost of attributing every generated token while generate runs, versus plain generate (and inseq, if present).

    python benchmarks/bench_generate.py [--repeats 7] [--threads 1] [--clock wall|cpu] [--device cpu] \\
        [--batch 1] [--shape full|llama2-7b|host-bound] [--dtype float32|bfloat16] \\
        [--out benchmarks/results/generate_cpu.json]
    python benchmarks/bench_generate.py --smoke     # tiny model, one round: does it still run (CI)

Model: random-init Llama, hidden 512, 8 layers, vocab 32000 (as benchmarks/bench_forward.py; on a GPU
``--shape llama2-7b --dtype bfloat16``); a 128-token prompt, 64 new tokens, greedy, ``--batch`` rows. Every round
runs the variants back to back in a rotating order and each ratio is taken
against the plain generate of the same round; the report gives the median of those paired ratios (the machine is
shared and noisy: medians of separate series swing by 5%). "attached": generate under
``nxl.attach(layers="all")``, which builds one record per new token (all 9 layers × the whole context), timed until
its records are made (on a GPU the last ones are scored after generate returns);
"attached_sink": the same, every record also written to a sink file (as ``nxl run --sink`` does): the records go
through the record pipeline (nxl_hooks.hooks.publish), written by the sink's own thread; each round checks that
the file holds every record.
"inseq_saliency": inseq's ``saliency``
on the same prompt, generating the same 64 tokens itself and attributing each with a gradient pass; it runs only
where ``import inseq`` works (it is no dependency of nxl_hooks; the JSON says why it did not run otherwise).
Besides the ratios: what recording adds per generated token in seconds (``added_us_per_new_token``, paired medians)
and, counted instead of timed, in Python calls of the generating thread (``added_python_calls_per_new_token``: the
same from run to run, whatever else the machine runs). ``--shape host-bound`` (Llama-2-7B's 32 layers and vocabulary
at width 64) makes a CPU decoding step as bound by the host's Python as a GPU's eager one is.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

import nxl_hooks as nxl
from _common import add_model_options, add_run_options, begin, device_label, emit, random_llama, report_head, timed


def _word_tokenizer(vocab_size: int):
    """Word-level: ids 0-2 are <pad> <s> </s>, id i >= 3 is the word ``w{i}`` (inseq works on text; no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]  # not substrings of any word: added tokens are matched inside text
    vocab = {name: i for i, name in enumerate(specials)} | {f"w{i}": i for i in range(len(specials), vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<pad>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")


def _inseq_variant(model, tokenizer, prompt: str, new_tokens: int, expected: torch.Tensor):
    """(run, None) when inseq works here, else (None, why not)."""
    try:
        import inseq
    except Exception as err:  # noqa: BLE001 - any import failure is a reason to report, not to crash
        return None, f"import inseq failed: {type(err).__name__}: {err}"
    try:
        explainer = inseq.load_model(model, "saliency", tokenizer=tokenizer)
        generation = {"max_new_tokens": new_tokens, "do_sample": False, "min_new_tokens": new_tokens}
        out = explainer.attribute(prompt, generation_args=generation, show_progress=False)
        produced = [token.token for token in out.sequence_attributions[0].target][-new_tokens:]
        wanted = [f"w{int(i)}" for i in expected[0, -new_tokens:]]
        if produced != wanted:
            return None, f"inseq generated other tokens than plain generate: {produced[:8]} vs {wanted[:8]}"
    except Exception as err:  # noqa: BLE001
        return None, f"inseq saliency failed on this model: {type(err).__name__}: {err}"

    def run():
        explainer.attribute(prompt, generation_args=generation, show_progress=False)

    return run, None


def _python_calls(run: Callable[[], object]) -> int:
    """How many Python functions, and C functions called from Python, ``run()`` calls in this thread (counted with
    ``sys.setprofile``: whatever else the machine runs; only a finalizer or a garbage collection that happens to run
    in this thread moves it)."""
    count = 0

    def profile(frame, event: str, arg) -> None:
        nonlocal count
        count += event in ("call", "c_call")

    before = sys.getprofile()  # (a profiler this script runs under is given back)
    with torch.no_grad():
        sys.setprofile(profile)
        try:
            run()
        finally:
            sys.setprofile(before)
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=1)
    add_model_options(parser)
    parser.add_argument("--no-inseq", action="store_true", help="skip the inseq comparison")
    parser.add_argument("--inseq-repeats", type=int, default=2,
                        help="rounds that also time inseq (it is ~10x slower; its check run is its warm-up)")
    add_run_options(parser)
    args, device, load_before, _ = begin(parser, "generate", repeats=1, prompt=8, new=4, inseq_repeats=1)

    model = random_llama("smoke" if args.smoke else args.shape, device, args.dtype)  # always the full 64 tokens
    config = model.config
    ids = torch.randint(3, config.vocab_size, (args.batch, args.prompt), device=device)
    generation = dict(input_ids=ids, max_new_tokens=args.new, do_sample=False)

    def plain():
        return model.generate(**generation)

    reference = plain()

    def recorded(probe) -> None:
        """The call, then until its records are made: where its steps are scored off the calling thread (on a GPU),
        its last ones are made after it returns."""
        model.generate(**generation)
        probe.calls

    def attached():  # attach/detach stay outside the timed region, as in a server loop
        with nxl.attach(model, layers="all") as probe:
            seconds = timed(lambda: recorded(probe), device, args.clock)
        assert len(probe.steps) == args.new
        return seconds

    def attached_calls() -> int:
        """:func:`_python_calls` of a recorded call, the attach's own first call made before (as in a server loop)."""
        with nxl.attach(model, layers="all") as probe:
            recorded(probe)
            return _python_calls(lambda: recorded(probe))

    sink_folder = tempfile.TemporaryDirectory()

    def attached_sink():
        path = Path(sink_folder.name) / "run.nxl"
        with nxl.attach(model, layers="all", sink=path) as probe:
            seconds = timed(lambda: recorded(probe), device, args.clock)
        assert len(probe.steps) == args.new and probe.sink_fault is None
        assert len(nxl.read_stream(path)[0].steps) == args.new  # every record on disk once detached
        return seconds

    variants = {"plain": lambda: timed(plain, device, args.clock), "attached": attached, "attached_sink": attached_sink}
    inseq_note = "skipped (--no-inseq)"
    if not args.no_inseq:
        tokenizer = _word_tokenizer(config.vocab_size)
        prompt = " ".join(f"w{int(i)}" for i in ids[0])
        inseq_run, inseq_note = _inseq_variant(model, tokenizer, prompt, args.new, reference)
        if inseq_run is not None:
            variants["inseq_saliency"] = lambda: timed(inseq_run, device, args.clock)
            inseq_note = (f"ran inseq {importlib.metadata.version('inseq')}: load_model(model, 'saliency')"
                          ".attribute(prompt, generation_args=greedy), the same tokens as plain generate")

    times: dict[str, list[float]] = {name: [] for name in variants}
    ratios: dict[str, list[float]] = {name: [] for name in variants if name != "plain"}
    added: dict[str, list[float]] = {name: [] for name in ratios}  # seconds over the same round's plain call
    names = list(variants)
    with torch.no_grad():
        for round_ in range(args.repeats + 1):  # round 0 warms up and is dropped
            measured = {}
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                if name != "inseq_saliency":
                    measured[name] = variants[name]()
                elif 1 <= round_ <= args.inseq_repeats:
                    with torch.enable_grad():  # gradients are inseq's method
                        measured[name] = variants[name]()
            if round_:
                for name, seconds in measured.items():
                    times[name].append(seconds)
                    if name != "plain":
                        ratios[name].append(seconds / measured["plain"])
                        added[name].append(seconds - measured["plain"])
            print(f"round {round_}: " + ", ".join(f"{n} {v:.2f}s" for n, v in measured.items()), file=sys.stderr)

    sink_folder.cleanup()
    calls = {"plain": _python_calls(plain), "attached": attached_calls()}
    median = {name: statistics.median(values) for name, values in times.items()}
    paired = {name: statistics.median(values) for name, values in ratios.items() if values}
    with nxl.attach(model, layers="all") as probe:
        model.generate(**generation)
    cache_bytes = probe.steps[-1].normxlogit.shape[0] * config.hidden_size * model.dtype.itemsize  # per row
    report = {
        **report_head("generate", device_label(device), args.clock, load_before),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),  # PASSIVE: idle threads sleep, CPU time = work
        "model": {"arch": "llama", "shape": "smoke" if args.smoke else args.shape, "dtype": str(model.dtype),
                  "hidden": config.hidden_size, "layers": config.num_hidden_layers, "vocab": config.vocab_size,
                  "prompt_tokens": args.prompt, "new_tokens": args.new, "batch": args.batch, "decoding": "greedy"},
        "smoke": args.smoke,
        "repeats": {name: len(values) for name, values in times.items()},
        "median_seconds": median,
        "paired_ratio_medians": paired,
        "attached_over_plain": paired["attached"],
        "attached_sink_over_plain": paired["attached_sink"],
        # what recording adds to each generated token (paired medians, on --clock): with --shape host-bound on the
        # CPU, the host's Python per decoding step, which bounds a GPU's eager step
        "added_us_per_new_token": {name: 1e6 * statistics.median(values) / args.new
                                   for name, values in added.items() if values and name != "inseq_saliency"},
        # the same, counted, not timed: the Python functions (and C functions called from Python) the generating
        # thread ran per generated token beyond plain generate's (itself: plain_python_calls_per_new_token), a
        # machine-independent measure of that host work (on a GPU a batch is scored in the publisher thread:
        # there it counts only what the hooks do)
        "added_python_calls_per_new_token": (calls["attached"] - calls["plain"]) / args.new,
        "plain_python_calls_per_new_token": calls["plain"] / args.new,
        "goal_attached_over_plain": None if args.smoke else 1.05,  # a smoke run's ratios mean nothing
        "goal_attached_sink_over_plain": None if args.smoke else 1.03,
        "inseq_saliency_over_plain": paired.get("inseq_saliency"),
        "inseq": inseq_note,
        "feature_cache_bytes_per_token_all_layers": cache_bytes,
        "same_tokens_as_plain": bool(torch.equal(torch.stack([s.token for s in probe.steps], 1).to(device),
                                                 reference[:, args.prompt:])),
        # whether plain generate itself repeats its tokens here (a GPU's kernels may not: then the line above
        # cannot tell what recording did)
        "plain_repeats_its_tokens": bool(torch.equal(plain(), reference)),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
