"""Continuous batching that pads its inputs (compile configs; what CUDA graphs do): every request is recorded through
the taps traced into the compiled step, each step equal to an uncached oracle of that request alone, the requests'
tokens unchanged, and no graph break of nxl_hooks' making (``torch._dynamo`` counters). CUDA graphs themselves:
tests/gpu/test_cb_graphs.py.

The compiled test compiles the step twice on the CPU (before attaching, then again once attached: code compiled
before the probe existed skips its hooks): about 20 s on an idle core, 35-60 s on a loaded one."""

import time

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig, GenerationConfig
from transformers.generation.continuous_batching import model_runner

import nxl_hooks as nxl
from nxl_hooks.hooks import forward
import tiny
from oracle import check_call

NEW = 4


def _greedy() -> GenerationConfig:
    return GenerationConfig(do_sample=False, max_new_tokens=NEW, eos_token_id=-1, pad_token_id=0)


def _prompts(lengths) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(5, len(tiny.VOCAB), (n,), generator=generator).tolist() for n in lengths]


def _compiled(backend="inductor"):
    """The padded path compiled: varlen (and decode, where the model has the fast path) under torch.compile, no
    CUDA graph. A 24-token budget chunks the 23-token prompt, so prefill chunks and decodes share forwards."""
    compile_config = CompileConfig(fullgraph=False, dynamic=False, backend=backend)
    return tiny.cb_config(use_cuda_graph=False, varlen_compile_config=compile_config,
                          decode_compile_config=compile_config)


def _tokens(outputs: dict) -> dict:
    return {key: (list(out.prompt_ids), list(out.generated_tokens)) for key, out in outputs.items()}


@pytest.fixture(scope="module")
def model():
    return tiny.build_model("llama")


def test_compiled_padded_batching_records_every_request_as_the_oracle(model, monkeypatch):
    """Inductor compiles the step before attaching, then again once attached, the taps traced in. The taps copy the
    model's hidden states and embedding rows; the head features and norms are taken after the step, outside the
    graph (a norm compiled with the model's own may change its arithmetic: nxl_hooks/hooks/traced.py). The graphs
    inductor is handed once attached hold as many norm-like operations as the plain step's, the word embedding's
    norm included, and every request equals the oracle. (One test: the two inductor compiles are most of its time.)"""
    monkeypatch.setattr(forward, "HEAD_CHUNK", 5)  # a step's packed tokens go through the head in several chunks
    prompts = _prompts((5, 23, 9, 3))
    # one backend for both runs, as backend="inductor" (equal each time) is: the code compiled before attaching may
    # be reused after, where the taps do not make dynamo compile again
    inductor = tiny.KeptGraphs(inductor=True)
    counters.clear()
    plain = model.generate_batch(prompts, generation_config=_greedy(), continuous_batching_config=_compiled(inductor))
    plain_breaks = set(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] > 0  # the step ran compiled, before the probe existed
    plain_graphs = list(inductor.graphs)
    counters.clear()
    with nxl.attach(model, layers="all", embedding="word") as probe:
        out = model.generate_batch(prompts, generation_config=_greedy(),
                                   continuous_batching_config=_compiled(inductor))
        assert probe._hub._running == []  # every request's call ended with its request
        with pytest.raises(RuntimeError, match="recorded generate call"):
            probe.result()  # the packed steps were not taken for a plain forward: the requests' records are steps
    breaks = dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] > 0  # compiled again once attached, the taps traced in
    attached_graphs = inductor.graphs[len(plain_graphs):]
    assert tiny.nxl_hooks_on(model) == 0
    assert _tokens(out) == _tokens(plain)
    calls = {call.request_id: call for call in probe.calls}
    assert sorted(calls) == sorted(out) == [f"req_{i}" for i in range(len(prompts))]
    for request_id, call in calls.items():
        assert call.error is None and call.prompt_ids.tolist() == [out[request_id].prompt_ids]
        check_call(model, call, NEW)  # code compiled without the taps would leave their buffers as they were
        assert [int(s.token) for s in call.steps] == out[request_id].generated_tokens
        probability = torch.stack([s.probability.reshape(()) for s in call.steps])
        assert bool(((probability > 0) & (probability <= 1)).all())  # the model's own, at the rows it sampled
    # the graph breaks are transformers' own (its paged cache update is compiler.disable'd), those of the run without
    # the probe, and none in nxl_hooks' code (a hook that logged, locked or read the device would add its own)
    assert plain_breaks and set(breaks) <= plain_breaks and not any("nxl_hooks" in reason for reason in breaks)
    plain_norms = sum(inductor.reductions(graph) for graph in plain_graphs)
    assert plain_norms >= 2 * model.config.num_hidden_layers  # the model's own norms are counted
    assert sum(inductor.reductions(graph) for graph in attached_graphs) == plain_norms


def test_a_copy_of_the_model_made_while_the_taps_are_on_takes_none_of_them(model, monkeypatch):
    """``copy.deepcopy`` of the model during a compiled padded step, its taps on: each hook of the probe's is one
    that does nothing in the copy (it held the live taps, writing into the probe's buffers), the copy gives the
    model's own logits, and the requests are recorded as the oracle. Dynamo traces the taps into the step whatever
    its backend: the eager one here (inductor's code: the first test)."""
    import copy

    from nxl_hooks.hooks import guard

    compute, copies = model_runner.ModelRunner.compute_batch, []

    def ours(module: torch.nn.Module) -> list:
        return [hook for hook in (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
                if (getattr(getattr(hook, "func", hook), "__module__", None) or "").startswith("nxl_hooks.")]

    def computing(self, *args, **kwargs):
        if not copies:  # the processor's taps are on from its first step (its warmup)
            copies.append((sum(len(ours(module)) for module in model.modules()), copy.deepcopy(model)))
        return compute(self, *args, **kwargs)

    monkeypatch.setattr(model_runner.ModelRunner, "compute_batch", computing)
    prompts = _prompts((6, 11))
    with nxl.attach(model, layers="all") as probe:
        out = model.generate_batch(prompts, generation_config=_greedy(),
                                   continuous_batching_config=_compiled(backend="eager"))
    ((on, copied),) = copies
    inert = [hook for module in copied.modules()
             for hook in (*module._forward_hooks.values(), *module._forward_pre_hooks.values()) if hook is guard.inert]
    assert tiny.nxl_hooks_on(copied) == 0 and len(inert) == on > 0
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        assert torch.equal(copied(input_ids=ids).logits, model(input_ids=ids).logits)
    assert sorted(call.request_id for call in probe.calls) == sorted(out)
    for call in probe.calls:
        assert call.error is None
        check_call(model, call, NEW)


def test_padded_inputs_run_eagerly_are_recorded_through_the_same_taps(model, monkeypatch):
    """What CUDA graphs do to the inputs (padded to fixed sizes), forced on the CPU without compiling: the taps run
    as plain hooks then, and a capture would take them in. Sampling, two layers, the word embedding."""
    original = model_runner.ModelRunner.__init__

    def padding(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.pad_inputs = True

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", padding)
    prompts = _prompts((7, 19, 4))
    sampling = GenerationConfig(do_sample=True, temperature=3.0, top_k=0, max_new_tokens=NEW, eos_token_id=-1,
                                pad_token_id=0)
    torch.manual_seed(0)
    with nxl.attach(model, layers=[0, -1], embedding="word") as probe:
        out = model.generate_batch(prompts, generation_config=sampling, continuous_batching_config=tiny.cb_config())
        model(input_ids=torch.tensor([prompts[0]]))  # a plain forward meanwhile: recorded as one, not tapped
        assert probe.result().normxlogit.shape == (2, 1, 7)
    assert tiny.nxl_hooks_on(model) == 0
    calls = {call.request_id: call for call in probe.calls}
    assert sorted(calls) == sorted(out) and len(calls) == len(prompts)
    argmax_differs = False
    for request_id, call in calls.items():
        assert call.error is None and call.layers == [0, 2]
        hand_argmax = check_call(model, call, NEW)
        assert [int(s.token) for s in call.steps] == out[request_id].generated_tokens
        argmax_differs |= any(int(a) != int(s.token) for a, s in zip(hand_argmax, call.steps))
    assert argmax_differs, "sampling at temperature 3 should leave the argmax at least once"


def test_attach_to_a_running_padded_manager_records_its_next_requests(model, monkeypatch):
    """A manager started (no warmup) before the probe attached: its processor gets its taps at its first step
    while attached, and each request made after attaching is recorded as the oracle."""
    original, compute = model_runner.ModelRunner.__init__, model_runner.ModelRunner.compute_batch

    def padding(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.pad_inputs = True

    steps = []
    monkeypatch.setattr(model_runner.ModelRunner, "__init__", padding)
    monkeypatch.setattr(model_runner.ModelRunner, "compute_batch",
                        lambda self, *args, **kwargs: steps.append(self.pad_inputs) or compute(self, *args, **kwargs))
    prompts = _prompts((6, 13))
    manager = model.init_continuous_batching(generation_config=_greedy(), continuous_batching_config=tiny.cb_config())
    manager.start()
    try:
        with nxl.attach(model, layers="all") as probe:
            for index, prompt in enumerate(prompts):
                manager.add_request(prompt, request_id=f"late-{index}", max_new_tokens=NEW)
            results, deadline = {}, time.monotonic() + 60
            while len(results) < len(prompts) and time.monotonic() < deadline:
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
    finally:
        manager.stop(block=True, timeout=30)
    assert steps and all(steps) and tiny.nxl_hooks_on(model) == 0  # every step padded; the taps gone with the probe
    calls = {call.request_id: call for call in probe.calls}
    assert sorted(calls) == sorted(results) == ["late-0", "late-1"]
    for request_id, call in calls.items():
        assert call.error is None
        check_call(model, call, NEW)
        assert [int(s.token) for s in call.steps] == results[request_id].generated_tokens
