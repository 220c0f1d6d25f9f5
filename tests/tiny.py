"""Helpers for the dataset, audit and report tests: tiny models saved with a fast word-level tokenizer,
small datasets, and an HTML element reader.

    path = save_model(tmp_path / "bert", "bert")       # a folder load_model / the CLI can read
    model.generate_batch(prompts, continuous_batching_config=cb_config())   # a small paged cache
    data = write_jsonl(tmp_path / "data.jsonl", 6)
    cells = elements(page, "td", "nxl-cell")           # [{"tag": "td", "data-value": "0.25", ...}, ...]
    nxl.attach(model, methods=[seen := ScoringThreads()]); ...; seen.threads  # where its steps were scored
"""

from __future__ import annotations

import inspect
import json
import os
import random
import signal
import threading
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Callable

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

import nxl_hooks
from nxl_hooks.hooks import guard
from nxl_hooks.hooks.probe import count_hooks

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [
    "the",
    "a",
    "film",
    "movie",
    "plot",
    "was",
    "is",
    "good",
    "bad",
    "great",
    "awful",
    "very",
    "quite",
    "and",
    "but",
]
VOCAB = SPECIAL + WORDS


def word_tokenizer(words: list[str], template: str | None = None) -> PreTrainedTokenizerFast:
    """A fast tokenizer with one id per whitespace-separated word of ``words`` (which holds BERT's specials);
    ``template`` adds special tokens around the text, e.g. ``"[CLS] $A [SEP]"``."""
    vocab = {w: i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if template:
        backend.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[(t, vocab[t]) for t in ("[CLS]", "[SEP]") if t in template]
        )
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def tokenizer() -> PreTrainedTokenizerFast:
    """:data:`VOCAB` word by word; adds ``[CLS] ... [SEP]`` like BERT's."""
    return word_tokenizer(VOCAB, "[CLS] $A [SEP]")


_SIZES = dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              pad_token_id=0)


def build_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A random tiny ``"bert"`` classifier (2 labels), ``"regression"`` BERT (one output), ``"mlm"`` BERT masked LM
    or ``"llama"`` causal LM over :data:`VOCAB`."""
    torch.manual_seed(seed)
    if kind in ("bert", "regression"):
        labels = 1 if kind == "regression" else 2
        return BertForSequenceClassification(BertConfig(**_SIZES, max_position_embeddings=64, num_labels=labels)).eval()
    if kind == "mlm":
        return BertForMaskedLM(BertConfig(**_SIZES, max_position_embeddings=64)).eval()
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**_SIZES, num_key_value_heads=2)).eval()
    raise ValueError(kind)


def cb_config(**options):
    """A ContinuousBatchingConfig sized for tests: the default cache takes ~60% of the machine's memory. A 24-token
    batch budget chunks long prompts and packs prefill chunks beside decodes."""
    import inspect

    from transformers import ContinuousBatchingConfig

    # the cache's page size is block_size up to transformers 5.16, page_size after
    page = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig.__init__).parameters else "block_size"
    return ContinuousBatchingConfig(**{"num_blocks": 16, "max_batch_tokens": 24, page: 16, **options})


def cpu_compile(**options):
    """A CompileConfig with which generate compiles its static-cache decoding steps on the CPU too (transformers
    compiles them on accelerators only, unless ``_compile_all_devices``). ``options``: CompileConfig's own."""
    from transformers import CompileConfig

    config = CompileConfig(**options)
    config._compile_all_devices = True
    return config


#: The generating decoder's id space (:func:`generating_llama`): ids 1..99 are tokens, 0 pads.
GEN_VOCAB, GEN_PAD = 100, 0


def generating_llama(seed: int = 0) -> LlamaForCausalLM:
    """A random 3-block Llama over :data:`GEN_VOCAB` ids that generates freely: no EOS (random weights: each test
    chooses its own), pad id :data:`GEN_PAD`. The model of the generate, pipeline and host-read tests."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=GEN_VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = GEN_PAD
    return model


def resuming(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(input ids, keyword arguments) of a ``generate`` call of ``model`` that resumes the KV cache an earlier call of
    one token on ``ids`` filled: a call the probe runs unrecorded, saying why (its context ran in forwards before
    it). Made before attaching, so that nothing of the earlier call is recorded."""
    first = model.generate(input_ids=ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    # (the cache under the keyword this transformers names it: 5.24, cache; before, past_key_values)
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return first.sequences, {keyword: first.past_key_values}


def generating_state_space(kind: str, seed: int = 0) -> torch.nn.Module:
    """A random 2-block state-space causal LM over :data:`GEN_VOCAB` ids, ``"mamba"``, ``"mamba2"`` or
    ``"falcon_mamba"``, that generates as :func:`generating_llama` does (no EOS, pad id :data:`GEN_PAD`)."""
    import transformers

    torch.manual_seed(seed)
    sizes = dict(vocab_size=GEN_VOCAB, hidden_size=16, num_hidden_layers=2, state_size=4, pad_token_id=GEN_PAD)
    if kind == "mamba2":  # its heads: num_heads * head_dim = expand * hidden_size
        sizes.update(num_heads=4, head_dim=8, n_groups=1, chunk_size=8)
    name = {"mamba": "Mamba", "mamba2": "Mamba2", "falcon_mamba": "FalconMamba"}[kind]
    config = getattr(transformers, f"{name}Config")(**sizes)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = GEN_PAD
    return model


def save_model(path: Path, kind: str, seed: int = 0, model: torch.nn.Module | None = None) -> Path:
    """Save ``model`` (default: :func:`build_model`) and the tokenizer to ``path``."""
    (model or build_model(kind, seed)).save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


def examples(n: int, seed: int = 0) -> list[dict]:
    """Short reviews; label 1 when the evidence word is positive."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        word = rng.choice(["good", "bad", "great", "awful"])
        filler = rng.sample(["the", "film", "was", "very", "plot", "and", "quite"], rng.randint(2, 5))
        filler.insert(rng.randint(0, len(filler)), word)
        out.append(
            {"id": f"ex{i}", "text": " ".join(filler), "label": int(word in ("good", "great")), "evidence": [word]}
        )
    return out


def write_jsonl(path: Path, n: int, seed: int = 0) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in examples(n, seed)))
    return path


class _Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[dict] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.found.append({"tag": tag, **{k: v for k, v in attrs}})


def elements(page: str, tag: str, cls: str | None = None) -> list[dict]:
    """Attributes of every ``tag`` element (with class ``cls``) in document order, via the stdlib HTML parser."""
    parser = _Elements()
    parser.feed(page)
    return [e for e in parser.found if e["tag"] == tag and (cls is None or cls in e.get("class", "").split())]


def ctrl_c_reaches() -> None:
    """A child's ``preexec_fn``: SIGINT as a terminal gives it (default action, not blocked), whatever the test
    process inherited (a worker started with SIGINT ignored or blocked passes that on across exec, and Python then
    raises no KeyboardInterrupt in the child)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _source(function: object) -> str:
    """The file a hook's function (or its callable object's class) is defined in; "" for a builtin."""
    try:
        return inspect.getfile(function if inspect.isroutine(function) else type(function))
    except TypeError:
        return ""


def nxl_hooks_on(model: torch.nn.Module) -> int:
    """How many nxl_hooks hooks are on ``model`` (transformers adds hooks of its own for output_hidden_states and
    keeps them, so a plain count would depend on which calls ran before), counted here by the file each hook's
    function lives in, a wrapped instance ``generate`` as one; and the library's own count (count_hooks, what
    ``nxl detach`` and ``nxl ctl status`` say) agreeing with it."""
    package = os.path.dirname(nxl_hooks.__file__) + os.sep
    functions = [getattr(hook, "func", hook) for m in model.modules()
                 for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
                 if hook is not guard.inert]  # what a copy made while attached holds instead: it does nothing
    generate = vars(model).get("generate")  # an instance generate: the probe's wrapper by its function's file
    functions += [getattr(generate, "func", generate)] if generate is not None else []
    counted = sum(_source(f).startswith(package) for f in functions)
    assert counted == count_hooks(model), (counted, count_hooks(model))
    return counted


class ScoringThreads:
    """An attribution method (the public protocol): LogAt, noting the name of the thread each score call runs in
    (``threads``); with ``fail``, its first call raises ``RuntimeError("scoring broke")`` instead (its first in the
    thread named ``fail`` where that is a name), once ``wait`` is set where one is given (up to 30 s)."""

    name = "test_scoring_threads"
    description = "LogAt, noting its thread (defined in tests/tiny.py)"
    pointwise = True

    def __init__(self, fail: bool | str = False, wait: threading.Event | None = None) -> None:
        self.threads: list[str] = []
        self.fail, self.wait = fail, wait

    def score(self, given) -> torch.Tensor:
        thread = threading.current_thread().name
        self.threads.append(thread)
        if self.fail is True or self.fail == thread:
            self.fail = False
            if self.wait is not None:
                self.wait.wait(30)
            raise RuntimeError("scoring broke")
        return given.logat


class KeptGraphs:
    """A ``torch.compile`` backend that keeps the FX graphs dynamo hands it and runs them as traced (no inductor):
    what attaching adds to a compiled model's graphs, counted. ``CompileConfig(backend=KeptGraphs())``. With
    ``inductor``, each kept graph is then compiled by inductor, as ``backend="inductor"`` with the same mode and
    options compiles it: one compile both runs and counts."""

    NORMS = ("pow", "mean", "rsqrt", "norm", "sum")  #: what a final norm or an embedding norm is traced into

    def __init__(self, inductor: bool = False) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.inductor = inductor

    def __deepcopy__(self, memo: dict) -> "KeptGraphs":  # CompileConfig.to_dict deep-copies its backend
        return self

    def __call__(self, gm: torch.fx.GraphModule, inputs: list, mode: str | None = None, options: dict | None = None
                 ) -> Callable:  # (generate passes its CompileConfig's mode and options)
        self.graphs.append(gm)
        if not self.inductor:
            return gm.forward
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        patches = {**(list_mode_options(mode) if mode else {}), **(options or {})}
        return compile_fx(gm, inputs, config_patches=patches)

    @staticmethod
    def operations(graph: torch.fx.GraphModule) -> list[tuple[str, str]]:
        """What ``graph`` computes, in order: (kind, target) of each call in it."""
        return [(node.op, str(node.target)) for node in graph.graph.nodes
                if node.op in ("call_function", "call_method", "call_module")]

    def reductions(self, graph: torch.fx.GraphModule | None = None) -> int:
        """The norm-like operations of ``graph`` (default: of all the graphs kept)."""
        return sum(any(name in str(node.target) for name in self.NORMS)
                   for gm in ([graph] if graph is not None else self.graphs) for node in gm.graph.nodes
                   if node.op in ("call_function", "call_method"))


def overflowing(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a Llama) with its last block's MLP scaled up: its logits stay finite in float32 and are NaN once
    the model is cast to float16 (an overflow). Returns the model."""
    with torch.no_grad():
        model.model.layers[-1].mlp.up_proj.weight.mul_(3e3)
        model.model.layers[-1].mlp.down_proj.weight.mul_(3e5)
    return model


def tie_below_float32(model: torch.nn.Module, **inputs: Any) -> torch.Tensor:
    """Give a float64 causal LM's top output at the last position of ``inputs`` a twin: the output before it, its
    ``lm_head`` row a copy a hair (1e-12) smaller in logit, so both logits are one number in float32. Returns the
    model's own logits there after the change."""
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
        top = int(logits.argmax())
        assert top > 0  # (a twin before it)
        model.lm_head.weight[top - 1] = model.lm_head.weight[top] * (1 - 1e-12 * float(logits[top].sign()))
        return model(**inputs).logits[0, -1]
