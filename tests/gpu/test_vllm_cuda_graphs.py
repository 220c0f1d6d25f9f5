"""vLLM on a CUDA GPU under ``nxl run``: its default engine, torch.compile with CUDA graphs, recorded exactly.

Runs where a CUDA GPU and a CUDA build of vLLM are both present, skipped otherwise (the project's CI has neither: on
the CPU, tests/vllm records vLLM's compiled mode, which has no CUDA graphs there). One engine start: the tiny Llama
of tests/vllm served under ``nxl run --layers all`` with vLLM's GPU defaults (compiled, CUDA graphs), but for the
settings recording turns off itself, the V2 model runner among them (GPUs default to it since vLLM 0.25; the engine
follows V1: nxl run sets VLLM_USE_V2_MODEL_RUNNER=0 and says so). Two concurrent chats, each step equal to vLLM's
own raw logit at the last layer and to the transformers oracle (on the CPU) at every layer: steps replayed from CUDA
graphs ran no Python hook, so only the capture compiled into the graphs (buffers written inside them) can have
recorded them.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm.envs", reason="needs a CUDA build of vLLM (pip install vllm)")

from test_vllm_serve import ENGINE, VllmServer, check_concurrent_pair, save_tiny  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-cuda")
    server = VllmServer(save_tiny(folder / "tiny"), nxl=["--layers", "all", "--sink", str(folder / "run")],
                        log=folder / "server.log", engine=[*ENGINE, "--gpu-memory-utilization", "0.3"])
    server.run = folder / "run"
    try:
        yield server.start(timeout=900)
    finally:
        server.stop()


def test_vllm_with_cuda_graphs_recorded_exactly(server, capsys):
    from transformers import LlamaForCausalLM

    from nxl_hooks.apps.cli import main

    assert main(["ctl", "status", "--run", str(server.run)]) == 0
    status = capsys.readouterr().out
    assert "recorded through buffers compiled into the model" in status and "CUDA graphs NONE" not in status, status
    assert "V2 model runner off: VLLM_USE_V2_MODEL_RUNNER=0" in (server.run.parent / "server.log").read_text()
    check_concurrent_pair(server, LlamaForCausalLM.from_pretrained(server.model).eval(), "cuda")
