"""Big-model paths: a bitsandbytes 4-bit model and an accelerate-offloaded model, attached versus plain forward,
and the extra peak memory the probe adds versus the formula it should follow.

    python benchmarks/bench_big.py [--repeats 7] [--device cpu|cuda] [--out benchmarks/results/big_cpu.json]
    python benchmarks/bench_big.py --smoke          # tiny model, one round, on the CPU: does it still run (CI)

Model: random-init Llama, hidden 512, 8 layers, vocab 32000, 256 tokens, batch 1 (as bench_forward.py, but MLP
1408 wide: bitsandbytes' CPU 4-bit kernel needs in_features divisible by its 64-value blocks).
- "bnb_4bit": reloaded with ``BitsAndBytesConfig(load_in_4bit=True)`` nf4 (on CUDA: bf16 compute, on cuda:0).
- "offloaded": reloaded with a device_map that keeps the first half of the blocks in place and offloads the
  rest, the final norm and lm_head (CPU: to disk; CUDA: half to CPU RAM, the rest and lm_head to disk, all
  executing on cuda:0). Weights are on ``meta`` outside their forward.
Timing: plain and attached forwards interleaved in one process, medians, ratio of medians.
Memory: the probe keeps, per selected layer and token, the head features (d' values in the model's compute
dtype) plus one float32 embedding norm per token: ``tokens * (layers * d' * bytes + 4)``. "kept_bytes" is what
the probe actually holds when the backbone returns, seen from outside: the bytes of every live tensor at that moment
(a forward hook of our own on the backbone), attached minus plain; beyond the formula it counts what the probe
holds once per attach (on the 4-bit model, the final norm's weight in float32: d' x 4 bytes). "extra_peak_bytes"
is the attached forward's peak allocation minus the plain forward's, both with ``logits_to_keep=1`` (CUDA:
``torch.cuda.max_memory_allocated``; CPU: torch's profiler memory timeline, since tracemalloc does not see torch's
allocator).
"extra_peak_bytes_full_logits" is the same with every position's logits, whose tokens x vocab floats are the
plain forward's peak: the probe has freed its features by then, so it adds next to nothing there.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
from pathlib import Path

import torch
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

import nxl_hooks as nxl
from _common import add_smoke_option, device_label, emit, smoke_out, timed

#: The measured model, and the tiny one of ``--smoke`` (bitsandbytes' CPU 4-bit kernel: in_features a multiple of
#: 64, out_features of 32, in both).
CONFIGS = {
    "full": LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                        num_attention_heads=8, num_key_value_heads=8),
    "smoke": LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2),
}


def _offload_map(config: LlamaConfig, device: torch.device) -> dict[str, int | str]:
    half = config.num_hidden_layers // 2
    here: int | str = 0 if device.type == "cuda" else "cpu"
    ram = "cpu" if device.type == "cuda" else "disk"  # on a CPU-only machine "cpu" is not an offload
    device_map: dict[str, int | str] = {"model.embed_tokens": here, "model.rotary_emb": here}
    for index in range(config.num_hidden_layers):
        device_map[f"model.layers.{index}"] = here if index < half else (ram if index < half + half // 2 else "disk")
    return device_map | {"model.norm": ram, "lm_head": "disk"}


def _load(setup: str, path: Path, config: LlamaConfig, device: torch.device, offload_dir: Path) -> torch.nn.Module:
    if setup == "bnb_4bit":
        extra = {"device_map": {"": 0}, "dtype": torch.bfloat16} if device.type == "cuda" else {}
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_compute_dtype=extra.get("dtype", torch.float32))
        return LlamaForCausalLM.from_pretrained(path, quantization_config=quantization, **extra).eval()
    device_map = _offload_map(config, device)
    return LlamaForCausalLM.from_pretrained(path, device_map=device_map, offload_folder=str(offload_dir)).eval()


def _cpu_peak(fn) -> int:
    """Peak bytes allocated by torch on the CPU while ``fn`` runs (tensors alive before it are not counted)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak


def _peak(fn, device: torch.device) -> int:
    if device.type != "cuda":
        return _cpu_peak(fn)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _live_bytes() -> int:
    """Bytes of every distinct tensor storage that Python objects hold now (weights on ``meta`` hold none)."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def _kept_bytes(model, ids) -> tuple[int, int]:
    """(bytes the probe holds when the backbone returns, element size of the hidden states), from outside: the live
    tensor bytes at that moment, attached minus plain (the weights, the input and the KV cache are in both)."""
    seen: dict[str, int] = {}

    def at_return(module, args, output) -> None:
        seen["live"] = _live_bytes()
        seen["element"] = output[0].element_size()

    def live(attached: bool) -> int:
        gc.collect()
        handle = model.base_model.register_forward_hook(at_return)
        try:
            if attached:
                with nxl.attach(model, layers="all") as probe:
                    model(input_ids=ids)
                    probe.result()
            else:
                model(input_ids=ids)
        finally:
            handle.remove()
        return seen["live"]

    plain = live(attached=False)
    return live(attached=True) - plain, seen["element"]


def _measure(model, ids, config: LlamaConfig, device: torch.device, repeats: int) -> dict:
    def plain(**kwargs):
        model(input_ids=ids, **kwargs)

    def attached(**kwargs):
        with nxl.attach(model, layers="all") as probe:
            model(input_ids=ids, **kwargs)
            probe.result()

    def attached_timed():  # attach/detach outside the timed region, as in a server loop
        with nxl.attach(model, layers="all") as probe:
            return timed(lambda: (model(input_ids=ids), probe.result()), device)

    times: dict[str, list[float]] = {"plain": [], "attached": []}
    for round_ in range(repeats + 1):  # round 0 warms up (and lets 4-bit CPU Linears repack) and is dropped
        for name, seconds in (("plain", timed(plain, device)), ("attached", attached_timed())):
            if round_:
                times[name].append(seconds)
    median = {name: statistics.median(values) for name, values in times.items()}
    kept, element = _kept_bytes(model, ids)
    tokens, layers = ids.shape[1], config.num_hidden_layers + 1
    formula = tokens * (layers * config.hidden_size * element + 4)
    # Full logits (tokens x 32000 floats) are the plain forward's peak and come after the probe has let its
    # features go; with logits_to_keep=1 (what generate does) the probe's features meet the blocks' own peak.
    plain_peak = _peak(lambda: plain(logits_to_keep=1), device)
    attached_peak = _peak(lambda: attached(logits_to_keep=1), device)
    full_extra = _peak(attached, device) - _peak(plain, device)
    return {
        "median_seconds": median,
        "attached_over_plain": median["attached"] / median["plain"],
        "memory": {
            "formula": f"tokens * (layers * d' * {element} + 4), tokens={tokens}, layers={layers}, "
                       f"d'={config.hidden_size}",
            "formula_bytes": formula,
            "bytes_per_token_per_layer": config.hidden_size * element,
            "kept_bytes": kept,
            "plain_peak_bytes": plain_peak,
            "attached_peak_bytes": attached_peak,
            "extra_peak_bytes": attached_peak - plain_peak,
            "extra_peak_over_formula": (attached_peak - plain_peak) / formula,
            "extra_peak_bytes_full_logits": full_extra,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    add_smoke_option(parser)
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.tokens, args.out = 1, 16, smoke_out(parser, args.out, "big")
        torch.set_num_threads(1)  # this process only: no spin-waits beside the other tests
    device = torch.device(args.device)
    config = CONFIGS["smoke" if args.smoke else "full"]

    report: dict = {
        "benchmark": "big",
        "device": device_label(device),
        "torch": torch.__version__,
        "model": {"arch": "llama", "hidden": config.hidden_size, "layers": config.num_hidden_layers,
                  "vocab": config.vocab_size, "tokens": args.tokens, "batch": 1},
        "smoke": args.smoke,
        "repeats": args.repeats,
    }
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        torch.manual_seed(0)
        path = Path(tmp) / "model"
        LlamaForCausalLM(config).save_pretrained(path)
        ids = torch.randint(0, config.vocab_size, (1, args.tokens), device=device)
        for setup in ("bnb_4bit", "offloaded"):
            model = _load(setup, path, config, device, Path(tmp) / f"offload_{setup}")
            report[setup] = _measure(model, ids, config, device, args.repeats)
            if setup == "offloaded":
                report[setup]["device_map"] = _offload_map(config, device)
            del model
    emit(report, args.out)


if __name__ == "__main__":
    main()
