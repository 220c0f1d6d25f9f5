"""Continuous batching on a GPU, synchronous batching: eagerly (its forward on the manager's own compute stream, the
probe's hooks in it), with CUDA graphs (``use_cuda_graph=True``), and with CUDA graphs over the compiled step: every
request recorded (through the taps captured in the graphs where they replay), each step equal to the eager CPU
oracle, the tokens those of the same manager without the probe. Run whenever a GPU is present, skipped otherwise (the
padded and compiled paths themselves run on the CPU in CI: tests/oracle/test_cb_compiled.py). The requests' steps
are scored in the record pipeline's publisher thread, off the manager's."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig, GenerationConfig

import nxl_hooks as nxl
import tiny
from oracle import check_call

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEW = 4


def _greedy() -> GenerationConfig:
    return GenerationConfig(do_sample=False, max_new_tokens=NEW, eos_token_id=-1, pad_token_id=0)


def _config(path: str):
    # asynchronous batching is not followed; "eager": no graphs, the forward on the manager's own compute stream (the
    # path transformers serve takes by default when the attention needs a mask), the probe's hooks in it
    options = dict(use_cuda_graph=path != "eager", use_async_batching=False)
    if path == "compiled_graphs":
        # mode="default": CompileConfig's own default, "reduce-overhead", captures CUDA graphs of its own inside the
        # manager's capture, which CUDA refuses (transformers' plain run fails the same way)
        compile_config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
        options.update(varlen_compile_config=compile_config, decode_compile_config=compile_config)
    return tiny.cb_config(**options)


@pytest.mark.parametrize("path", ["eager", "graphs", "compiled_graphs"])
def test_cuda_graph_batching_records_every_request_as_the_eager_oracle(path):
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, len(tiny.VOCAB), (n,), generator=generator).tolist() for n in (5, 23, 9, 3)]
    oracle_model = tiny.build_model("llama")  # float32 on the CPU: the reference
    model = tiny.build_model("llama").cuda()
    plain = model.generate_batch(prompts, generation_config=_greedy(), continuous_batching_config=_config(path))
    threads = tiny.ScoringThreads()
    # graphs captured before attaching are captured again
    with nxl.attach(model, layers="all", methods=[threads]) as probe:
        out = model.generate_batch(prompts, generation_config=_greedy(), continuous_batching_config=_config(path))
    assert {k: v.generated_tokens for k, v in out.items()} == {k: v.generated_tokens for k, v in plain.items()}
    calls = {call.request_id: call for call in probe.calls}
    assert sorted(calls) == sorted(out) and len(calls) == len(prompts)
    for request_id, call in calls.items():
        assert call.error is None, call.error
        check_call(oracle_model, call, NEW)
        assert [int(s.token) for s in call.steps] == out[request_id].generated_tokens
        for step in call.steps:
            torch.testing.assert_close(step.scores["test_scoring_threads"], step.logat)
    # scored off the manager's thread: its tokens are host ints, its features (where scoring computes) on the GPU
    assert set(threads.threads) == {"nxl_hooks-publisher"}
