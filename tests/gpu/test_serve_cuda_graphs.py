"""``transformers serve --continuous-batching --cb-use-cuda-graph`` on a CUDA GPU under ``nxl run``: the server a team
leaves recorded in production, its steps replayed from CUDA graphs. Run whenever a GPU is present, skipped otherwise
(the project's CI has none: on the CPU, tests/process/test_serve.py serves continuous batching without graphs, and
tests/oracle/test_cb_compiled.py records the padded step CUDA graphs capture). Three concurrent chats, one of them
streamed, against a recorded server and a plain one with the same flags: the replies are the plain server's, and
every request's record, read from the sink, has one step per reply token, each equal to the transformers oracle on the
CPU at every layer (steps replayed from a graph ran no Python hook: only the taps captured in the graphs can have
recorded them), and the same through the live endpoint."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from serving import Server, free_port, save_chat_model
from test_serve import CB_FLAGS, SERVE_ENV, Tiny, check_call, ended_on_disk, same_views

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ASKS = [("graph-0", "hello world how are you", 6, True), ("graph-1", "w1 w2 w3 w4 w5 w6 w7 w8 w9", 9, False),
        ("graph-2", "the world", 4, False)]
FLAGS = [*CB_FLAGS, "--cb-use-cuda-graph"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return Tiny(save_chat_model(tmp_path_factory.mktemp("serve") / "tiny"))


def _replies(server: Server) -> dict[str, dict]:
    # within the test's --timeout (gpu.sh: 140 s), and never waiting on a chat once it failed: the server is then
    # stopped by the test's `with`, not left behind
    pool = concurrent.futures.ThreadPoolExecutor(len(ASKS))
    try:
        futures = {rid: pool.submit(server.chat, content, max_tokens=n, request_id=rid, stream=stream, timeout=100)
                   for rid, content, n, stream in ASKS}
        return {rid: future.result(timeout=100) for rid, future in futures.items()}
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def test_cuda_graph_serving_under_nxl_run_records_every_request_as_the_oracle(tiny, tmp_path):
    with Server(tiny.path, serve=FLAGS, device="cuda", log=tmp_path / "plain.log", env=SERVE_ENV) as plain:
        expected = _replies(plain)
    run, listen = tmp_path / "run", f"127.0.0.1:{free_port()}"
    server = Server(tiny.path, nxl=["--layers", "all", "--sink", str(run), "--listen", listen], serve=FLAGS,
                    device="cuda", log=tmp_path / "recorded.log", env=SERVE_ENV)
    server.run, server.listen = run, listen
    with server:
        replies = _replies(server)
        for request_id, content, _, _ in ASKS:  # read while the server still runs
            assert replies[request_id]["content"] == expected[request_id]["content"]  # recording changed no output
            call = ended_on_disk(run, request_id)
            assert call.error is None and call.complete, call.error
            assert call.request_id == replies[request_id]["request_id"] == request_id
            check_call(tiny, call, content, replies[request_id], unattached=False)
            same_views(server, request_id, tmp_path)
    assert "not recorded" not in server.log_text()
