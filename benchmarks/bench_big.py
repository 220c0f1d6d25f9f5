"""Big-model paths: a bitsandbytes 4-bit model and an accelerate-offloaded model, attached versus plain forward,
and the extra peak memory the probe adds versus the formula it should follow.

    python benchmarks/bench_big.py [--repeats 7] [--device cpu|cuda] [--out benchmarks/results/big_cpu.json]

Model: random-init Llama, hidden 512, 8 layers, vocab 32000, 256 tokens, batch 1 (as bench_forward.py, but MLP
1408 wide: bitsandbytes' CPU 4-bit kernel needs in_features divisible by its 64-value blocks).
- "bnb_4bit": reloaded with ``BitsAndBytesConfig(load_in_4bit=True)`` nf4 (on CUDA: bf16 compute, on cuda:0).
- "offloaded": reloaded with a device_map that keeps the first half of the blocks in place and offloads the
  rest, the final norm and lm_head (CPU: to disk; CUDA: half to CPU RAM, the rest and lm_head to disk, all
  executing on cuda:0). Weights are on ``meta`` outside their forward.
Timing: plain and attached forwards interleaved in one process, medians, ratio of medians.
Memory: the probe keeps, per selected layer and token, the head features (d' values in the model's compute
dtype) plus one float32 embedding norm per token: ``tokens * (layers * d' * bytes + 4)``. "kept_bytes" counts
what the probe actually holds when the backbone returns; "extra_peak_bytes" is the attached forward's peak
allocation minus the plain forward's, both with ``logits_to_keep=1`` (CUDA: ``torch.cuda.max_memory_allocated``;
CPU: torch's profiler memory timeline, since tracemalloc does not see torch's allocator).
"extra_peak_bytes_full_logits" is the same with every position's logits, whose tokens x vocab floats are the
plain forward's peak: the probe has freed its features by then, so it adds next to nothing there.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

import nxl_hooks as nxl
from _common import device_label, emit, timed

_CONFIG = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8)


def _offload_map(device: torch.device) -> dict[str, int | str]:
    half = _CONFIG.num_hidden_layers // 2
    here: int | str = 0 if device.type == "cuda" else "cpu"
    ram = "cpu" if device.type == "cuda" else "disk"  # on a CPU-only machine "cpu" is not an offload
    device_map: dict[str, int | str] = {"model.embed_tokens": here, "model.rotary_emb": here}
    for index in range(_CONFIG.num_hidden_layers):
        device_map[f"model.layers.{index}"] = here if index < half else (ram if index < half + half // 2 else "disk")
    return device_map | {"model.norm": ram, "lm_head": "disk"}


def _load(setup: str, path: Path, device: torch.device, offload_dir: Path) -> torch.nn.Module:
    if setup == "bnb_4bit":
        extra = {"device_map": {"": 0}, "dtype": torch.bfloat16} if device.type == "cuda" else {}
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_compute_dtype=extra.get("dtype", torch.float32))
        return LlamaForCausalLM.from_pretrained(path, quantization_config=quantization, **extra).eval()
    device_map = _offload_map(device)
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


def _kept_bytes(model, ids) -> tuple[int, int]:
    """(bytes the probe holds when the backbone returns, element size of its features)."""
    seen = {}
    with nxl.attach(model, layers="all") as probe:
        assemble = probe._assemble

        def spy(p):
            features = list(p.features.values())
            seen["bytes"] = sum(t.numel() * t.element_size() for t in features) + p.embed_norm.numel() * 4
            seen["element"] = features[0].element_size()
            return assemble(p)

        probe._assemble = spy
        model(input_ids=ids)
    return seen["bytes"], seen["element"]


def _measure(model, ids, device: torch.device, repeats: int) -> dict:
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
    tokens, layers = ids.shape[1], _CONFIG.num_hidden_layers + 1
    formula = tokens * (layers * _CONFIG.hidden_size * element + 4)
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
                       f"d'={_CONFIG.hidden_size}",
            "formula_bytes": formula,
            "bytes_per_token_per_layer": _CONFIG.hidden_size * element,
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
    args = parser.parse_args()
    device = torch.device(args.device)

    report: dict = {
        "benchmark": "big",
        "device": device_label(device),
        "torch": torch.__version__,
        "model": {"arch": "llama", "hidden": 512, "layers": 8, "vocab": 32000, "tokens": args.tokens, "batch": 1},
        "repeats": args.repeats,
    }
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        torch.manual_seed(0)
        path = Path(tmp) / "model"
        LlamaForCausalLM(_CONFIG).save_pretrained(path)
        ids = torch.randint(0, _CONFIG.vocab_size, (1, args.tokens), device=device)
        for setup in ("bnb_4bit", "offloaded"):
            model = _load(setup, path, device, Path(tmp) / f"offload_{setup}")
            report[setup] = _measure(model, ids, device, args.repeats)
            if setup == "offloaded":
                report[setup]["device_map"] = _offload_map(device)
            del model
    emit(report, args.out)


if __name__ == "__main__":
    main()
