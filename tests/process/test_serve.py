"""Attaching to running programs: ``nxl run``, ``import nxl_hooks.auto``, the control endpoint, ``nxl tail`` /
``nxl ctl``, and the rotating sink. Real parts started by the tests (``transformers serve`` on a tiny model saved
to a temp folder), loopback only, bounded waits, every process stopped. Numbers are checked against the
uncached oracle of tests/oracle.py."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

import nxl_hooks as nxl
from nxl_hooks.apps.cli import main as cli_main
from nxl_hooks.apps.commands.run import unbooted_flag
from nxl_hooks.apps.serve.settings import Settings, parse_listen
from nxl_hooks.hooks.generate import BATCH_STEPS
from oracle import llama, normxlogit, prefix_logits
from serving import Server, free_port, save_chat_model

NXL = [sys.executable, "-m", "nxl_hooks"]
SERVE_ENV = {"OMP_NUM_THREADS": "1"}
CB_FLAGS = ["--continuous-batching", "--cb-num-blocks", "64", "--cb-max-batch-tokens", "256", "--cb-block-size", "16"]


# -- fixtures ----------------------------------------------------------------------------------------------

class Tiny:
    """The saved chat model, loaded here too: the oracle and the reference outputs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.model = LlamaForCausalLM.from_pretrained(path).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.hand = llama(self.model)

    def prompt(self, content: str) -> torch.Tensor:
        """The ids serve generates from: the chat template with the generation prompt."""
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer(text, return_tensors="pt")["input_ids"]

    def generate(self, content: str, max_tokens: int) -> list[int]:
        """The unattached model's own greedy tokens for a chat request."""
        ids = self.prompt(content)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, max_new_tokens=max_tokens, do_sample=False)
        return out[0, ids.shape[1]:].tolist()

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return Tiny(save_chat_model(tmp_path_factory.mktemp("serve") / "tiny"))


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    """One ``transformers serve`` under ``nxl run`` for the module: records to a run folder, HTTP endpoint too."""
    run = tmp_path_factory.mktemp("run") / "run"
    listen = f"127.0.0.1:{free_port()}"
    srv = Server(tiny.path, nxl=["--sink", str(run), "--listen", listen, "--keep-calls", "8"],
                 log=run.parent / "server.log", env=SERVE_ENV)
    srv.run, srv.listen = run, listen
    with srv:
        yield srv


def _nxl(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*NXL, *args], capture_output=True, text=True, timeout=timeout, **kwargs)


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``nxl ARGS`` in this process (the clients import nothing heavy): (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = cli_main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _ctl(capsys, server: Server, *args: str) -> dict:
    code, out, err = _cli(capsys, "ctl", *args, "--run", str(server.run), "--json")
    assert code == 0, err
    (status,) = [json.loads(line) for line in out.splitlines()]
    return status


def _endpoint(server: Server, path: str) -> bytes:
    """GET over the HTTP endpoint, with the run's token."""
    token = (server.run / "token").read_text().strip()
    request = urllib.request.Request(f"http://{server.listen}{path}", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


# -- what every recorded request must satisfy ---------------------------------------------------------------

def check_call(tiny: Tiny, call: nxl.GenerationCall, content: str, reply: dict, *, unattached: bool = True
               ) -> list[int]:
    """The call's prompt is the chat prompt, its steps are the response's tokens (count and text) and, unless
    ``unattached`` is False (the caller compares the host's replies with an unattached server's), the unattached
    model's own greedy tokens; every step equals the uncached oracle. Returns the tokens."""
    prompt = tiny.prompt(content)
    assert call.prompt_ids.tolist() == prompt.tolist()  # (continuous batching feeds int32 ids)
    tokens = [int(step.token[0]) for step in call.steps]
    assert len(tokens) == reply["usage"]["completion_tokens"]
    assert tiny.text(tokens) == reply["content"]
    if unattached:  # the host's outputs are those of an unattached model
        assert tokens == tiny.generate(content, len(tokens))
    sequence = torch.cat([prompt, torch.tensor([tokens])], dim=1)
    rows = torch.tensor(call.layers)
    for index, step in enumerate(call.steps):
        assert (step.step, step.position) == (index, prompt.shape[1] + index)
        logits, embeddings = prefix_logits(tiny.model, tiny.hand, sequence[:, : step.position],
                                           torch.ones(1, step.position, dtype=torch.bool))
        logat, expected = normxlogit(logits, embeddings, step.token)
        torch.testing.assert_close(step.logat, logat[rows], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(step.normxlogit, expected[rows], rtol=1e-4, atol=1e-4)
        # the model's own probability of the emitted token, and its text, are in the record (also under
        # continuous batching, and read back from disk)
        probability = torch.softmax(logits[-1, 0, step.position - 1].float(), -1)[tokens[index]]
        assert step.probability is not None and step.readable is not None and len(step.readable) == 1
        torch.testing.assert_close(step.probability.reshape(-1)[0], probability, rtol=1e-4, atol=1e-6)
    assert [step.readable[0].replace("␣", " ") for step in call.steps] == [tiny.tokenizer.decode([t]) for t in tokens]
    return tokens


def ended_on_disk(run: Path, request_id: str, timeout: float = 30) -> nxl.GenerationCall:
    """``request_id``'s call as the sink wrote it, once its end is on disk: a reply can go out before its records
    are written (the sink writes in a thread of its own, and a continuous-batching request's end does not wait for
    the publisher)."""
    deadline = time.monotonic() + timeout
    while True:
        calls = nxl.read_stream(run, request_id=request_id)
        if (len(calls) == 1 and calls[0].complete) or time.monotonic() > deadline:
            (call,) = calls
            return call
        time.sleep(0.05)


def same_views(server: Server, request_id: str, tmp_path: Path) -> None:
    """One request seen three ways: its live JSON view (memory), its frames handed out by the endpoint, and the
    sink on disk. The texts and probabilities are the same in each."""
    disk = ended_on_disk(server.run, request_id)
    frames = tmp_path / f"{request_id}-views.nxl"
    frames.write_bytes(_endpoint(server, f"/v1/requests/{request_id}/frames"))
    (handed,) = nxl.read_stream(frames)
    live = json.loads(_endpoint(server, f"/v1/requests/{request_id}?k=1"))["steps"]
    assert len(disk.steps) == len(handed.steps) == len(live) > 0
    for on_disk, from_endpoint, shown in zip(disk.steps, handed.steps, live):
        assert on_disk.readable == from_endpoint.readable and on_disk.readable[0] == shown["token"]
        assert torch.equal(on_disk.probability, from_endpoint.probability)
        assert shown["probability"] == pytest.approx(float(on_disk.probability.reshape(-1)[0]), rel=1e-6)
        assert on_disk.to_attribution().top(1, layer=-1) == from_endpoint.to_attribution().top(1, layer=-1)


def check_view(tiny: Tiny, view: dict, content: str, tokens: list[int], k: int) -> None:
    """The endpoint's JSON readout: per step the emitted token's text and, per layer, the k best context tokens
    by the oracle's NormXLogit (the prediction position and special tokens do not rank)."""
    sequence = torch.cat([tiny.prompt(content), torch.tensor([tokens])], dim=1)
    special = set(tiny.tokenizer.all_special_ids)
    assert [s["token_id"] for s in view["steps"]] == tokens
    assert [s["token"] for s in view["steps"]] == [tiny.tokenizer.decode([t]) for t in tokens]
    for step in view["steps"]:
        position = step["position"]
        logits, embeddings = prefix_logits(tiny.model, tiny.hand, sequence[:, :position],
                                           torch.ones(1, position, dtype=torch.bool))
        _, expected = normxlogit(logits, embeddings, torch.tensor([step["token_id"]]))
        eligible = [i for i in range(position) if i != position - 1 and int(sequence[0, i]) not in special]
        for layer, top in step["top"].items():
            scores = expected[int(layer), 0]
            best = sorted(eligible, key=lambda i: -float(scores[i]))[:k]
            assert [entry[0] for entry in top] == best
            assert [entry[1] for entry in top] == [tiny.tokenizer.decode([int(sequence[0, i])]) for i in best]
            torch.testing.assert_close(torch.tensor([entry[2] for entry in top]), scores[best], rtol=1e-4, atol=1e-5)


# -- transformers serve under nxl run -----------------------------------------------------------------------

def test_serve_requests_recorded_per_request_id_and_match_the_oracle(server, tiny, tmp_path):
    asks = [("plain-1", "hello world how are you", 6, False), ("sse-1", "hello world", 5, True),
            (None, "how are you", 4, False)]
    replies = {}
    for request_id, content, max_tokens, stream in asks:
        reply = server.chat(content, max_tokens=max_tokens, request_id=request_id, stream=stream)
        assert reply["id"] == reply["request_id"] == (request_id or reply["id"])  # serve's own id otherwise
        replies[reply["id"]] = (content, reply)
    assert replies["sse-1"][1]["chunks"] > 2  # it really streamed

    # while the server keeps serving another request, read the records over the endpoint and from the sink
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(server.chat, "the world is", max_tokens=40, request_id="busy-1", stream=True)
        listed = json.loads(_endpoint(server, "/v1/requests"))["requests"]
        assert {"plain-1", "sse-1"} <= {entry["request_id"] for entry in listed}
        for request_id, (content, reply) in replies.items():
            (call,) = nxl.read_stream(server.run, request_id=request_id)
            assert call.complete and call.thread and call.request_id == request_id
            tokens = check_call(tiny, call, content, reply)
            view = json.loads(_endpoint(server, f"/v1/requests/{request_id}?k=2"))
            assert view["complete"] and view["steps"] and len(view["steps"]) == len(tokens)
            assert view["prompt"] == [tiny.tokenizer.decode([t]) for t in tiny.prompt(content)[0].tolist()]
            check_view(tiny, view, content, tokens, k=2)
            frames = tmp_path / f"{request_id}.nxl"  # one request's frames, handed out: a stream file
            frames.write_bytes(_endpoint(server, f"/v1/requests/{request_id}/frames"))
            (handed,) = nxl.read_stream(frames)
            assert [int(s.token[0]) for s in handed.steps] == tokens and handed.request_id == request_id
            assert all(torch.equal(a.normxlogit, b.normxlogit) for a, b in zip(handed.steps, call.steps))
            same_views(server, request_id, tmp_path)
        busy_reply = busy.result(timeout=120)
    (busy_call,) = nxl.read_stream(server.run, request_id="busy-1")
    check_call(tiny, busy_call, "the world is", busy_reply)


def test_a_request_without_an_id_is_recorded_under_the_x_request_id_serve_sends_back(server):
    """docs/server.md: a request sent without X-Request-ID is recorded under the id serve made for it, the one the
    response's X-Request-ID header carries; /v1/responses puts it in its body's ids with a prefix (resp_, msg_), so
    the body's id is not the record's (the docs said "the response's id")."""
    payload = {"input": "hello world", "max_output_tokens": 3, "temperature": 0, "stream": False}
    request = urllib.request.Request(server.base + "/v1/responses", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        request_id, body = response.headers.get("x-request-id"), json.loads(response.read())
    assert request_id and body["id"] == f"resp_{request_id}"
    call = ended_on_disk(server.run, request_id)
    assert call.request_id == request_id and call.steps and nxl.read_stream(server.run, request_id=body["id"]) == []
    said = " ".join((Path(__file__).parents[2] / "docs" / "server.md").read_text().split())
    assert "the id serve made for it, which the response's `X-Request-ID` header carries" in said


def test_ctl_pause_resume_attach_detach_change_recording_not_outputs(server, tiny, capsys):
    content, expected = "hello you", tiny.text(tiny.generate("hello you", 5))
    paused = _ctl(capsys, server, "pause")
    (model,) = paused["models"]
    assert paused["paused"] and not model["attached"] and model["hooks"] == 0  # zero hooks while paused
    assert server.chat(content, max_tokens=5, request_id="while-paused")["content"] == expected
    resumed = _ctl(capsys, server, "resume")
    assert resumed["models"][0]["attached"] and resumed["models"][0]["hooks"] > 0
    code, _, err = _cli(capsys, "ctl", "attach", "--layers", "7", "--run", str(server.run))  # layers 0..2
    assert code == 2 and "nothing changed" in err
    assert _ctl(capsys, server, "status")["models"][0]["layers"] == [0, 1, 2]
    last = _ctl(capsys, server, "attach", "--layers", "last")
    assert last["models"][0]["layers"] == [2] and last["options"]["layers"] == "last"
    reply = server.chat(content, max_tokens=5, request_id="after-attach")
    assert reply["content"] == expected
    detached = _ctl(capsys, server, "detach")
    assert detached["models"][0]["excluded"] and detached["models"][0]["hooks"] == 0
    assert server.chat(content, max_tokens=5, request_id="while-detached")["content"] == expected
    assert _ctl(capsys, server, "attach", "--layers", "all")["models"][0]["layers"] == [0, 1, 2]

    ids = [c.request_id for c in nxl.read_stream(server.run)]
    assert "while-paused" not in ids and "while-detached" not in ids
    (call,) = nxl.read_stream(server.run, request_id="after-attach")
    assert call.layers == [2]
    check_call(tiny, call, content, reply)


@pytest.mark.version_free
def test_tail_prints_one_line_per_token_of_a_request(server, tiny):
    tail = subprocess.Popen([*NXL, "tail", "--run", str(server.run), "--request-id", "tail-1", "-k", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # usually subscribed before the request starts; if not, it replays the request's steps
        reply = server.chat("are you the world", max_tokens=6, request_id="tail-1", stream=True)
        out, err = tail.communicate(timeout=60)
    finally:
        if tail.poll() is None:
            tail.kill()
    assert tail.returncode == 0, err
    lines = out.splitlines()
    steps, end = lines[:-1], lines[-1]
    assert len(steps) == reply["usage"]["completion_tokens"] and end == f"tail-1: ended after {len(steps)} tokens"
    (call,) = nxl.read_stream(server.run, request_id="tail-1")
    tokens = [tiny.tokenizer.decode([int(s.token[0])]) for s in call.steps]
    for index, (text, token) in enumerate(zip(steps, tokens)):
        request_id, step, at, shown, rest = text.split(maxsplit=4)
        assert (request_id, int(step), shown) == ("tail-1", index, repr(token)) and rest.startswith("L2: ")
        assert at == f"@{call.steps[index].position}"


def _tail(server, *args: str, then=None) -> tuple[str, str]:
    """Run ``nxl tail --run RUN ARGS``; once it says it waits (it is subscribed then), call ``then()`` (a request);
    (stdout, stderr) once it exits (within 60 s, else killed)."""
    tail = subprocess.Popen([*NXL, "tail", "--run", str(server.run), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, encoding="utf-8",
                            env={**os.environ, "COLUMNS": "1000"})  # lines are cut to the terminal's width
    err: list[str] = []
    waiting = threading.Event()

    def read_err() -> None:
        for text in tail.stderr:
            err.append(text)
            if text.startswith("nxl tail: waiting for"):
                waiting.set()

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    try:
        if then is not None:
            assert waiting.wait(60), "".join(err)
            then()
        out = tail.stdout.read()
        tail.wait(timeout=60)
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait()
    reader.join(10)
    assert tail.returncode == 0, "".join(err)
    return out, "".join(err)


def _entries(text: str) -> list[tuple[int, str]]:
    """The ``position:'text'`` entries of a tail line's top list."""
    return [(int(position), name) for position, name in re.findall(r"(\d+):'(.*?)' (?:-?[\d.e+-]+|nan)", text)]


@pytest.mark.version_free
def test_tail_says_it_waits_shows_positions_and_the_last_requests(server, tiny, capsys):
    """Issue 24 item 13: idle, tail says it waits; a prompt that holds 'hello' twice shows both, told apart by their
    positions, and the token's own position; --last 1 shows the last request again, whole, with its end line."""
    content = "hello hello world"
    out, err = _tail(server, "--count", "1", "-k", "10",
                     then=lambda: server.chat(content, max_tokens=2, request_id="tail-idle"))
    assert err.startswith("nxl tail: waiting for requests (Ctrl-C to stop; nxl tail --last N shows the last N)\n")
    (first,) = out.splitlines()
    (call,) = nxl.read_stream(server.run, request_id="tail-idle")
    ids = tiny.prompt(content)[0].tolist()
    names = [tiny.tokenizer.decode([i]) for i in ids]
    assert first.split()[:3] == ["tail-idle", "0", f"@{len(ids)}"] and names.count("hello") == 2
    entries = _entries(first)
    assert {p for p, name in entries if name == "hello"} == {i for i, name in enumerate(names) if name == "hello"}
    assert all(names[p] == name for p, name in entries)
    out, err = _tail(server, "--last", "1", "--count", "2", "-k", "10")
    *lines, end = out.splitlines()
    assert [line.split()[:3] for line in lines] == [["tail-idle", str(s.step), f"@{s.position}"] for s in call.steps]
    assert lines[0] == first and end == "tail-idle: ended after 2 tokens"
    code, _, err = _cli(capsys, "tail", "--run", str(server.run), "--last", "1", "--request-id", "x")  # (no start)
    assert code == 2 and err.count("\n") == 1 and "--last" in err


def save_emoji_model(path: Path) -> Path:
    """A byte-level BPE chat model that, after a newline, writes '😀' (4 byte tokens) then a newline, over and over:
    its blocks add nothing, and its head maps each token of the cycle (newline, the emoji's 4 bytes) to the next."""
    import bpe_tiny

    tok = bpe_tiny.bpe_tokenizer()
    model = bpe_tiny.bpe_llama(tok, tie_word_embeddings=False)
    cycle = tok.encode("\n") + tok.encode("😀")
    assert len(cycle) == 5
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        weight = model.get_input_embeddings().weight
        unit = weight / weight.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        head = unit.clone()
        for before, after in zip(cycle, cycle[1:] + cycle[:1]):
            head[after] = unit[before]  # the largest logit after `before` (cosine 1)
        model.lm_head.weight.copy_(head)
    return bpe_tiny.save_bpe(path, model, tok)


@pytest.mark.version_free
def test_tail_shows_an_emoji_split_over_byte_tokens_as_text(tmp_path):
    """Issue 24 item 13: an emoji that a byte-level tokenizer splits into 4 tokens is shown as '😀', never as bytes
    ('\\xf0\\x9f'): in the context (the prompt's emoji, on each of its 4 positions) and as generated tokens, whose
    lines show '…' until the token that completes the character."""
    path = save_emoji_model(tmp_path / "emoji")
    run = tmp_path / "run"
    with Server(path, nxl=["--sink", str(run)], log=tmp_path / "server.log", env=SERVE_ENV) as srv:
        srv.run = run
        out, err = _tail(srv, "--count", "5", "-k", "40",
                         then=lambda: srv.chat("I like 😀", max_tokens=5, request_id="emoji"))
    (call,) = nxl.read_stream(run, request_id="emoji")
    assert call.text == "😀\n" and [s.readable[0] for s in call.steps] == ["\\xf0", "\\x9f", "\\x98", "\\x80", "↵"]
    lines = out.splitlines()
    assert [line.split()[3] for line in lines] == ["'…'", "'…'", "'…'", "'😀'", "'↵'"]
    prompt_len = call.prompt_ids.shape[1]
    emoji = {p for p, name in enumerate(call.readable[0]) if name.startswith("\\x")}
    assert len(emoji) == 4
    last = _entries(lines[-1])
    assert {name for p, name in last if p in emoji} == {"😀"} and {p for p, _ in last} >= emoji
    assert {name for p, name in last if p >= prompt_len} <= {"😀"}
    assert "\\x" not in out and "\ufffd" not in out


@pytest.mark.version_free
def test_tail_shows_a_hostile_request_id_escaped(server, tiny):
    """An X-Request-ID with a title change, a screen clear and a C1 byte is accepted by serve; nxl tail and
    nxl ctl show it escaped and never write a control character to the operator's terminal."""
    hostile = "\x1b]0;owned\x07\x1b[2Jx\x9b"
    tail = subprocess.Popen([*NXL, "tail", "--run", str(server.run), "--request-id", hostile, "-k", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        reply = server.chat("hello world", max_tokens=3, request_id=hostile, stream=True)
        out, err = tail.communicate(timeout=60)
    finally:
        if tail.poll() is None:
            tail.kill()
    assert tail.returncode == 0, err
    assert reply["request_id"] == hostile  # serve took it as it came
    lines = out.splitlines()
    assert len(lines) == 4 and lines[-1] == "\\x1b]0;owned\\x07\\x1b[2Jx\\x9b: ended after 3 tokens"
    assert all(line.startswith("\\x1b]0;owned\\x07") for line in lines)
    assert not any(char in out + err for char in "\x1b\x07\x9b")


@pytest.mark.version_free
def test_endpoint_needs_the_token_streams_and_listens_on_loopback_only(server, tiny):
    import psutil

    from nxl_hooks.apps.serve.client import Endpoint

    status = json.loads(_endpoint(server, "/v1/status"))
    sock = Path(status["endpoint"]["socket"])
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600 and sock.parent == server.run.resolve()
    assert stat.S_IMODE((server.run / "token").stat().st_mode) == 0o600
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        for path in ("/v1/status", "/v1/requests", "/v1/requests/plain-1", "/v1/stream"):
            request = urllib.request.Request(f"http://{server.listen}{path}", headers=headers)
            with pytest.raises(urllib.error.HTTPError, match="401"):
                urllib.request.urlopen(request, timeout=10)
    live, seen = Endpoint(url=f"http://{server.listen}", token=(server.run / "token").read_text().strip()), []

    def follow() -> None:  # every request's steps, as server-sent events
        for event, data in live.events("/v1/stream?k=1", timeout=60):
            seen.append((event, data))
            if len(seen) == 3:
                return

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    for attempt in range(10):  # the first request may start before the stream is subscribed
        server.chat("hello world", max_tokens=4, request_id=f"live-{attempt}")
        reader.join(timeout=1)
        if not reader.is_alive():
            break
    assert len(seen) == 3 and all(event == "step" and data["request_id"].startswith("live-") for event, data in seen)
    for first, second in zip(seen, seen[1:]):  # in order: the next step of a request, or a later request's first
        same = first[1]["request_id"] == second[1]["request_id"]
        assert second[1]["step"] == (first[1]["step"] + 1 if same else 0)
    assert all(len(top) == 1 and set(data["top"]) == {"0", "1", "2"} for _, data in seen for top in data["top"].values())

    listening = {c.laddr.ip for c in psutil.Process(server.pid).net_connections("inet") if c.status == "LISTEN"}
    assert listening == {"127.0.0.1"}
    refused = _nxl("run", "--listen", f"0.0.0.0:{free_port()}", "--", sys.executable, "-c", "print('ran')")
    assert refused.returncode == 2 and "ran" not in refused.stdout
    assert "not a loopback address" in refused.stderr and "--allow-remote" in refused.stderr
    with pytest.raises(ValueError, match="not a loopback address"):
        parse_listen("192.168.1.5:80")
    assert parse_listen("192.168.1.5:80", allow_remote=True) == ("192.168.1.5", 80)
    assert parse_listen(":8765") == ("127.0.0.1", 8765) and parse_listen("[::1]:9") == ("::1", 9)


@pytest.mark.version_free
def test_sigkill_mid_generation_keeps_every_completed_step(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    generation = json.dumps({"min_new_tokens": 900, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False})
    with Server(tiny.path, nxl=["--sink", str(run), "--layers", "0,-1"], log=tmp_path / "log",
                env=SERVE_ENV) as server:
        body = json.dumps({"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 900,
                           "stream": True, "generation_config": generation}).encode()
        request = urllib.request.Request(server.base + "/v1/chat/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json", "X-Request-ID": "killed-1"})
        streamed = []
        with urllib.request.urlopen(request, timeout=60) as response:
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    delta = json.loads(line[5:])["choices"][0]["delta"].get("content")
                    streamed += [delta] if delta else []
                if len(streamed) >= 30:
                    os.killpg(server.pid, signal.SIGKILL)
                    break
        assert server.process.wait(timeout=30) == -signal.SIGKILL
    (call,) = nxl.read_stream(run, request_id="killed-1")
    assert not call.complete and call.layers == [0, 2] and len(call.steps) < 900
    assert [s.step for s in call.steps] == list(range(len(call.steps)))
    tokens = [int(s.token[0]) for s in call.steps]
    words, seen = tiny.text(tokens).split(), "".join(streamed).split()
    # The file holds what the client saw, up to the records still in the pipeline when the kill came (steps waiting
    # to be scored together, and frames the sink thread had not written; under load a few more may be in flight):
    # every frame on disk whole, in order
    assert len(seen) - BATCH_STEPS - 8 <= len(words) and words[: len(seen)] == seen[: len(words)]
    sequence = torch.cat([tiny.prompt("hello world"), torch.tensor([tokens])], dim=1)
    for step in (call.steps[0], call.steps[-1]):
        logits, embeddings = prefix_logits(tiny.model, tiny.hand, sequence[:, : step.position],
                                           torch.ones(1, step.position, dtype=torch.bool))
        torch.testing.assert_close(step.normxlogit, normxlogit(logits, embeddings, step.token)[1][[0, 2]],
                                   rtol=1e-4, atol=1e-4)
    code, _, err = _cli(capsys, "ctl", "status", "--run", str(run))  # its socket is left: nobody answers
    assert code == 2 and "no running process" in err


_SELF_TERMINATED = """
import os, signal, sys
import torch
from transformers import AutoModelForCausalLM


class Streamer:  # prints each generated token, and at the 20th the process gets SIGTERM (a stop from outside)
    seen = 0

    def put(self, value):
        if value.numel() > 1:  # the prompt
            return
        print("token", int(value.reshape(-1)[0]), flush=True)
        Streamer.seen += 1
        if Streamer.seen == 20:
            os.kill(os.getpid(), signal.SIGTERM)

    def end(self):
        pass


model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
model.generate(input_ids=torch.tensor([[1, 64, 67]]), max_new_tokens=60, min_new_tokens=60, do_sample=False,
               streamer=Streamer())
print("not reached", flush=True)
"""


@pytest.mark.version_free
def test_sigterm_mid_generation_ends_the_record_saying_so_with_every_step_made(tiny, tmp_path):
    """A program with no SIGTERM handler of its own, stopped mid-generate under nxl run: it dies of the signal as
    it would without nxl, and before that the call's record ends saying so, holding every step made (the last few
    were waiting to be scored together: they were lost, and the record said nothing)."""
    run, program = tmp_path / "run", tmp_path / "program.py"
    program.write_text(_SELF_TERMINATED)
    done = _nxl("run", "--sink", str(run), "--layers", "0,-1", "--", sys.executable, str(program), str(tiny.path),
                timeout=180, env={**os.environ, **SERVE_ENV})
    assert done.returncode == -signal.SIGTERM and "not reached" not in done.stdout, done.stderr[-3000:]
    printed = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("token ")]
    (call,) = nxl.read_stream(run)
    assert not call.complete and call.error == ("the process got SIGTERM while this call ran: its records end at "
                                                "the last step made before")
    # the 20th token was printed before the forward that emits it to the record began
    assert len(printed) == 20 and [int(s.token[0]) for s in call.steps] == printed[:-1]
    assert [s.step for s in call.steps] == list(range(19)) and call.layers == [0, 2]
    sequence = torch.cat([call.prompt_ids, torch.tensor([printed[:-1]])], dim=1)
    for step in (call.steps[0], call.steps[-1]):
        logits, embeddings = prefix_logits(tiny.model, tiny.hand, sequence[:, : step.position],
                                           torch.ones(1, step.position, dtype=torch.bool))
        torch.testing.assert_close(step.normxlogit, normxlogit(logits, embeddings, step.token)[1][[0, 2]],
                                   rtol=1e-4, atol=1e-4)
    assert not list(run.glob("*.sock"))

def test_continuous_batching_three_concurrent_clients(tiny, tmp_path):
    run = tmp_path / "run"
    asks = [("cb-0", "hello world how are you", 6, True), ("cb-1", "w1 w2 w3 w4 w5 w6 w7 w8 w9", 9, False),
            ("cb-2", "the world", 4, True)]
    listen = f"127.0.0.1:{free_port()}"
    server = Server(tiny.path, nxl=["--sink", str(run), "--listen", listen], serve=CB_FLAGS, log=tmp_path / "log",
                    env=SERVE_ENV)
    server.run, server.listen = run, listen
    with server:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = {rid: pool.submit(server.chat, content, max_tokens=n, request_id=rid, stream=stream)
                       for rid, content, n, stream in asks}
            replies = {rid: future.result(timeout=120) for rid, future in futures.items()}
        for request_id, content, _, _ in asks:  # read while the server still runs
            call = ended_on_disk(run, request_id)
            assert call.request_id == replies[request_id]["request_id"] == request_id
            check_call(tiny, call, content, replies[request_id])
            same_views(server, request_id, tmp_path)


def test_live_feed_names_the_request_of_every_step_with_more_requests_running_than_kept(tiny, tmp_path):
    """--keep-calls 1 and four continuous-batching requests at once: /v1/stream names the request of every step,
    and a reader following one request gets each of its steps (the feed found a step's request among the calls
    kept in memory, where running requests fell out: their steps went out with no request id)."""
    from nxl_hooks.apps.serve.client import Endpoint

    run, listen = tmp_path / "run", f"127.0.0.1:{free_port()}"
    server = Server(tiny.path, nxl=["--sink", str(run), "--listen", listen, "--keep-calls", "1"], serve=CB_FLAGS,
                    log=tmp_path / "log", env=SERVE_ENV)
    with server:
        live = Endpoint(url=f"http://{listen}", token=(run / "token").read_text().strip())
        seen: list[dict] = []
        one: list[dict] = []

        def follow(path: str, into: list, until: Callable[[str], bool]) -> None:
            for event, data in live.events(path, timeout=60):
                into.append(data)
                if until(event):
                    return

        everything = threading.Thread(target=follow, args=("/v1/stream?k=1", seen, lambda _: len(seen) > 1000),
                                      daemon=True)
        everything.start()
        for attempt in range(10):  # the feed starts with its first reader: requests before it are not streamed
            server.chat("hello world", max_tokens=2, request_id=f"warm-{attempt}")
            if seen:
                break
        only = threading.Thread(target=follow, args=("/v1/stream?k=1&request_id=cb-2", one, lambda e: e == "end"),
                                daemon=True)
        only.start()
        time.sleep(1)  # (the request-id reader is subscribed: nothing asserted depends on how long this is)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: server.chat(f"hello w{i} world", max_tokens=8 + i, request_id=f"cb-{i}"),
                          range(4)))
        steps = {f"cb-{i}": len(ended_on_disk(run, f"cb-{i}").steps) for i in range(4)}
        only.join(timeout=30)
        deadline = time.monotonic() + 30
        while sum(d["request_id"] in steps for d in seen) < sum(steps.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert seen and all(d["request_id"] is not None for d in seen), [d["request_id"] for d in seen]
    assert {r: sum(d["request_id"] == r for d in seen) for r in steps} == steps
    assert not only.is_alive() and [d.get("step") for d in one[:-1]] == list(range(steps["cb-2"]))


# -- nxl run / import nxl_hooks.auto on a plain Python program ----------------------------------------------

_PROGRAM = textwrap.dedent("""
    import gc, json, multiprocessing, os, sys, weakref
    facts = {"chained": os.environ.get("CHAINED_MARK"),
             "heavy_at_start": sorted(m for m in ("torch", "transformers", "nxl_hooks") if m in sys.modules)}
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    from nxl_hooks.hooks.generate import REQUEST_ID

    def work(path):
        model = AutoModelForCausalLM.from_pretrained(path)
        model.generate(input_ids=torch.tensor([[1, 64, 67]]), max_new_tokens=2, do_sample=False)

    if __name__ == "__main__":
        kept = AutoModelForCausalLM.from_pretrained(sys.argv[1])
        other = AutoModelForCausalLM.from_pretrained(sys.argv[2])
        base = AutoModel.from_pretrained(sys.argv[1])           # no head: not attachable, one log line
        probe = vars(kept).get("_nxl_probe")
        facts["attached"] = [probe is not None, "_nxl_probe" in vars(other), "_nxl_probe" in vars(base)]
        ids = torch.tensor([[1, 64, 67, 68]])
        outs = []
        for i in range(20):
            token = REQUEST_ID.set(f"req-{i}") if i % 2 else None
            outs.append(kept.generate(input_ids=ids, max_new_tokens=3, do_sample=False)[0].tolist())
            if token is not None:
                REQUEST_ID.reset(token)
        facts["outputs"] = outs
        facts["kept_calls"] = [c.request_id for c in probe.calls]
        process = multiprocessing.get_context("spawn").Process(target=work, args=(sys.argv[1],))
        process.start(); process.join(120)
        facts["worker"] = [process.exitcode, process.pid]
        ref = weakref.ref(kept)
        del kept, probe
        gc.collect()
        facts["freed"] = ref() is None
        print("FACTS " + json.dumps(facts))
""")


def test_nxl_run_attaches_an_unmodified_program_bounded_and_weakly(tiny, tmp_path):
    (tmp_path / "app.py").write_text(_PROGRAM)
    chained = tmp_path / "own_site"
    chained.mkdir()
    (chained / "sitecustomize.py").write_text("import os\nos.environ['CHAINED_MARK'] = 'yes'\n")
    other = save_chat_model(tmp_path / "other-model", seed=1)
    run = tmp_path / "run"
    done = _nxl("run", "--sink", str(run), "--models", "tiny*", "--layers", "last", "--",
                sys.executable, str(tmp_path / "app.py"), str(tiny.path), str(other),
                env={**os.environ, "PYTHONPATH": os.pathsep.join([str(chained), os.environ.get("PYTHONPATH", "")]),
                     **SERVE_ENV}, timeout=300)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.split("FACTS ", 1)[1])
    assert facts["chained"] == "yes" and facts["heavy_at_start"] == []
    assert facts["attached"] == [True, False, False]
    assert sum("nxl_hooks:" in line for line in done.stderr.splitlines()) == 1  # the headless model, one line
    assert "LlamaModel" in done.stderr or "not recorded" in done.stderr
    ids = torch.tensor([[1, 64, 67, 68]])
    with torch.no_grad():
        plain = tiny.model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)[0].tolist()
    assert facts["outputs"] == [plain] * 20
    kept = facts["kept_calls"]  # 16 by default under nxl run: the last 16 of 20
    assert len(kept) == 16 and kept[-1] == "req-19" and kept[1] == "req-5" and len(kept[0]) == 32
    assert facts["freed"]
    exitcode, worker = facts["worker"]
    assert exitcode == 0
    folders = {p.name for p in run.iterdir() if p.is_dir()}  # each process its own files, pid in names
    (parent,) = {name.split("-")[0] for name in folders} - {str(worker)}
    assert folders == {f"{parent}-tiny", f"{worker}-tiny"}
    (child_call,) = nxl.read_stream(run / f"{worker}-tiny")
    assert child_call.complete and len(child_call.steps) == 2 and child_call.layers == [2]
    calls = nxl.read_stream(run / f"{parent}-tiny")
    assert len(calls) == 20 and calls[1].request_id == "req-1" and len(calls[0].request_id) == 32


def test_import_auto_attaches_in_code_and_bad_settings_never_harm(tiny, tmp_path):
    code = textwrap.dedent("""
        import sys, torch
        from transformers import AutoModelForCausalLM     # imported before nxl_hooks.auto: still patched
        import nxl_hooks.auto
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
        out = model.generate(input_ids=torch.tensor([[1, 64, 67]]), max_new_tokens=2, do_sample=False)
        probe = nxl_hooks.auto.probe(model)
        print("RESULT", out[0].tolist(), None if probe is None else len(probe.steps))
    """)
    env = {**os.environ, "NXL_RUN_DIR": str(tmp_path / "run"), **SERVE_ENV}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two programs at once: half the wait
        good, bad = pool.map(lambda extra: subprocess.run([sys.executable, "-c", code, str(tiny.path)],
                                                          capture_output=True, text=True, env={**env, **extra},
                                                          timeout=180), [{}, {"NXL_LAYERS": "one,two"}])
    with torch.no_grad():
        plain = tiny.model.generate(input_ids=torch.tensor([[1, 64, 67]]), max_new_tokens=2, do_sample=False)
    assert good.returncode == bad.returncode == 0, good.stderr + bad.stderr
    assert good.stdout.split("RESULT ")[1].strip() == f"{plain[0].tolist()} 2"
    assert bad.stdout.split("RESULT ")[1].strip() == f"{plain[0].tolist()} None"  # runs unrecorded
    lines = [line for line in bad.stderr.splitlines() if "nxl_hooks" in line]
    assert len(lines) == 1 and "NXL_LAYERS" in lines[0]


def test_import_auto_with_nxl_listen_serves_http_with_a_token_of_its_run(tiny, tmp_path):
    """NXL_LISTEN without nxl run (import nxl_hooks.auto, the variables set by hand): the endpoint writes the run's
    token itself (nxl run --listen writes it before the program starts; here no one did, and the endpoint never
    listened, saying only that the token file was missing)."""
    code = textwrap.dedent("""
        import json, sys, urllib.request
        import nxl_hooks.auto
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
        address = nxl_hooks.auto.controller().status()["endpoint"]["http"]
        token = open(sys.argv[2]).read().strip()
        ask = urllib.request.Request(f"http://{address}/v1/status", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(ask, timeout=30) as response:
            print("RESULT", [entry["name"] for entry in json.loads(response.read())["models"]])
    """)
    run = tmp_path / "run"
    env = {**os.environ, "NXL_RUN_DIR": str(run), "NXL_LISTEN": f"127.0.0.1:{free_port()}", **SERVE_ENV}
    done = subprocess.run([sys.executable, "-c", code, str(tiny.path), str(run / "token")], capture_output=True,
                          text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("RESULT ")[1].strip() == repr([str(tiny.path)])
    assert stat.S_IMODE((run / "token").stat().st_mode) == 0o600


def test_a_program_that_explains_a_model_nxl_run_attached_is_told_how_and_then_can(tiny, tmp_path):
    """nxl.explain in a program under nxl run: one probe per model, and nxl run's is on it. The refusal says how
    (it said only to leave a `with nxl.attach` block the program never wrote); done so, the scores are the
    oracle's and nxl run's probe records again after the resume."""
    code = textwrap.dedent("""
        import json, sys, torch
        import nxl_hooks as nxl, nxl_hooks.auto
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
        tok = AutoTokenizer.from_pretrained(sys.argv[1])
        try:
            nxl.explain(model, tok, "hello world how are")
        except RuntimeError as refused:
            print("REFUSED", refused)
        nxl_hooks.auto.controller().pause()
        res = nxl.explain(model, tok, "hello world how are")
        nxl_hooks.auto.controller().resume()
        model.generate(input_ids=torch.tensor([[1, 64, 67]]), max_new_tokens=2, do_sample=False)
        calls = len(nxl_hooks.auto.probe(model).calls)
        print("RESULT", json.dumps([res.input_ids[0].tolist(), res.normxlogit[:, 0].tolist(), calls]))
    """)
    done = subprocess.run([*NXL, "run", "--", sys.executable, "-c", code, str(tiny.path)], capture_output=True,
                          text=True, env={**os.environ, **SERVE_ENV}, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    refusal = done.stdout.split("REFUSED ")[1].splitlines()[0]
    assert "under nxl run (or import nxl_hooks.auto)" in refusal and "controller().pause()" in refusal, refusal
    ids, scores, calls = json.loads(done.stdout.split("RESULT ")[1])
    logits, embeddings = prefix_logits(tiny.model, tiny.hand, torch.tensor([ids]), torch.ones(1, len(ids)))
    _, expected = normxlogit(logits, embeddings, logits[-1, 0, -1].argmax()[None])
    torch.testing.assert_close(torch.tensor(scores), expected[:, 0], rtol=1e-4, atol=1e-5)
    assert calls == 1


def test_nxl_run_loading_options_reach_the_programs_own_loads(tiny, tmp_path, capsys, monkeypatch):
    """--dtype and --load-in-8bit become defaults of the program's from_pretrained for the models --models picks;
    what the program sets itself wins; a GGUF file with bitsandbytes is refused before the program starts. A model
    saved quantized another way (4-bit) kept its own quantization under the 8-bit default, with a warning of
    transformers only: the defaults are not applied to it, said; one saved 8-bit takes them."""
    code = textwrap.dedent("""
        import sys, torch
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig
        picked = AutoModelForCausalLM.from_pretrained(sys.argv[1])
        own = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
        old_name = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
        facts = [picked.model.norm.weight.dtype, type(picked.model.layers[0].self_attn.q_proj).__name__,
                 own.model.norm.weight.dtype, old_name.model.norm.weight.dtype]
        if len(sys.argv) > 2:  # saved 8-bit (as the default) and 4-bit (not), loaded again
            picked.save_pretrained(sys.argv[2] + "-8bit")
            AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, quantization_config=(
                BitsAndBytesConfig(load_in_4bit=True))).save_pretrained(sys.argv[2] + "-4bit")
            for bits in ("8bit", "4bit"):
                again = AutoModelForCausalLM.from_pretrained(sys.argv[2] + "-" + bits)
                facts += [again.model.norm.weight.dtype, type(again.model.layers[0].self_attn.q_proj).__name__]
        print("FACTS", *facts)
    """)
    runs = [(["--dtype", "bfloat16", "--load-in-8bit", "--models", "tiny*"],
             [str(tiny.path), str(tmp_path / "tiny-saved")]),
            (["--gguf-file", "m.gguf"], [str(tiny.path)])]  # defaults that cannot work for this model (below)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the two programs at once: half the wait
        done, fallen = pool.map(lambda run: _nxl("run", *run[0], "--", sys.executable, "-c", code, *run[1],
                                                 env={**os.environ, **SERVE_ENV}, timeout=300), runs)
    assert done.returncode == 0, done.stderr
    # the first load takes both defaults; the second sets its own dtype (8-bit still applies: it did not set that),
    # the third too, under transformers' older name (torch_dtype: the default dtype overrode it); the model saved
    # 8-bit takes both, the one saved 4-bit neither (float32, as the program asked)
    assert done.stdout.split("FACTS ")[1].split() == ["torch.bfloat16", "Linear8bitLt", "torch.float32",
                                                      "torch.float32", "torch.bfloat16", "Linear8bitLt",
                                                      "torch.float32", "Linear4bit"]
    (said,) = [line for line in done.stderr.splitlines() if "were not applied" in line]
    assert said.startswith("nxl_hooks: the loading options of nxl run were not applied to ") and \
        "tiny-saved-4bit is saved quantized (bitsandbytes 4-bit fp4" in said and \
        "not bitsandbytes 8-bit as asked" in said, said
    refused = _refused_in_process(capsys, monkeypatch, "run", "--gguf-file", "m.gguf", "--load-in-4bit", "--",
                                  sys.executable, "-c", "print('ran')")
    assert refused.returncode == 2 and "ran" not in refused.stdout and "transformers refuses" in refused.stderr
    # defaults that cannot work for this model (it has no such GGUF file): it loads as the program asked, said
    assert fallen.returncode == 0, fallen.stderr
    assert fallen.stdout.split("FACTS ")[1].split() == ["torch.float32", "Linear", "torch.float32", "torch.float32"]
    said = [line for line in fallen.stderr.splitlines() if "nxl_hooks" in line]
    assert len(said) == 3 and all("the loading options of nxl run were not applied" in line for line in said), said


def _refused_in_process(capsys, monkeypatch, *args: str) -> subprocess.CompletedProcess:
    """``nxl ARGS`` that must refuse before its program starts, run in this process (a refusal is decided before
    ``nxl run`` execs, so no interpreter start is needed to see it): exit code, stdout and stderr as ``_nxl``'s. An
    ``nxl run`` that went on to exec its program fails the test instead of replacing this process."""
    def started(*program) -> None:
        raise AssertionError(f"nxl {args[0]} was to refuse, but started {program[1]}")

    monkeypatch.setattr(os, "execvpe", started)
    code, out, err = _cli(capsys, *args)
    return subprocess.CompletedProcess(["nxl", *args], code, out, err)


@pytest.mark.version_free
def test_nxl_run_says_which_of_your_variables_its_flags_replace(tmp_path, capsys, monkeypatch):
    """nxl run writes every NXL_* variable from its flags: one the caller set and gave no flag for was replaced by
    the flag's default without a word (NXL_LAYERS=last recorded every layer). One line names each such variable and
    the value the program gets; a flag given, or a variable equal to what is written, is not named."""
    started: dict = {}
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: started.update(env))
    for name in [name for name in os.environ if name.startswith("NXL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("NXL_LAYERS", "last")
    monkeypatch.setenv("NXL_EAGER", "1")
    monkeypatch.setenv("NXL_TARGET", "5")  # its flag is given below
    monkeypatch.setenv("NXL_KEEP_CALLS", "16")  # the default: nothing replaced
    monkeypatch.setenv("NXL_SINK_MAX_BYTES", "1000000")  # the flag's value as the flag takes it: MB
    code, _, err = _cli(capsys, "run", "--sink", str(tmp_path / "r"), "--target", "7", "--", "true")
    assert code == 0 and started["NXL_LAYERS"] == "all" and started["NXL_EAGER"] == "0", err
    (line,) = [line for line in err.splitlines() if "replace" in line]
    assert line == ("nxl run: the flags' defaults replace your environment's NXL_LAYERS='last' (--layers all), "
                    "NXL_EAGER='1' (no --eager), NXL_SINK_MAX_BYTES='1000000' (--sink-file-mb 64): give the flag to "
                    "choose the value"), err
    for name in ("NXL_LAYERS", "NXL_EAGER", "NXL_TARGET", "NXL_KEEP_CALLS", "NXL_SINK_MAX_BYTES"):
        monkeypatch.delenv(name)
    code, _, err = _cli(capsys, "run", "--sink", str(tmp_path / "r2"), "--", "true")
    assert code == 0 and "replace" not in err, err


@pytest.mark.version_free
def test_python_flags_that_keep_the_bootstrap_out_are_refused_before_the_program_starts(tmp_path, capsys,
                                                                                         monkeypatch):
    """-I and -E make Python ignore PYTHONPATH and -S skips site, which imports the bootstrap: the program would run
    with nothing recorded and nothing said. Refused in one line, alone or among other short flags; -s (no user
    site) and flags after -c (the program's own) leave the bootstrap in; the same flags in a script's ``#!`` line
    are refused as well (the script ran unrecorded, unsaid). The first refusal is a whole ``nxl``
    program (nothing but that line on its stderr); the other spellings are the same check, run in this process."""
    booted = "import sys; print('BOOTED', any(getattr(f, 'nxl_post_import', False) for f in sys.meta_path))"
    for n, flags in enumerate((["-I"], ["-Iu"], ["-B", "-E"], ["-BE"], ["-S"], ["-W", "ignore", "-S"])):
        run = tmp_path / "".join(flags)
        command = ("run", "--sink", str(run), "--", sys.executable, *flags, "-c", booted)
        refused = _nxl(*command) if n == 0 else _refused_in_process(capsys, monkeypatch, *command)
        letter = next(letter for letter in "IES" if letter in "".join(flags))
        assert refused.returncode == 2 and "BOOTED" not in refused.stdout, (flags, refused.stdout, refused.stderr)
        assert refused.stderr.strip().splitlines() == [refused.stderr.strip()], refused.stderr
        assert f"error: python -{letter}: " in refused.stderr and f"drop -{letter}" in refused.stderr
        assert not run.exists()
    for flags in (["-s"], ["-u", "-s"]):  # PYTHONPATH still read, site still run
        kept = _nxl("run", "--", sys.executable, *flags, "-c", booted, "-I", env={**os.environ, **SERVE_ENV})
        assert kept.returncode == 0 and kept.stdout.split() == ["BOOTED", "True"], (flags, kept.stderr)
    # the same flags in a script's #! line (its interpreter's, as the kernel starts it: the rest of the line one
    # argument, which env -S splits): it ran unrecorded, unsaid. "-X dev -E" is -X with the value " dev -E"; an
    # interpreter that is a script of its own (its #! naming itself) is not followed (it recursed without end)
    loop = tmp_path / "loop-python"
    for name, line, refused in (("E", f"{sys.executable} -E", True), ("u", f"{sys.executable} -u", False),
                                ("env", f"/usr/bin/env -S {sys.executable} -E", True),
                                ("X", f"{sys.executable} -X dev -E", False), ("loop-python", f"{loop} -E", False)):
        script = tmp_path / name
        script.write_text(f"#!{line}\n{booted}\n")
        script.chmod(0o755)
        if name == "loop-python":
            assert unbooted_flag([str(script)]) is None
            continue
        ran = _nxl("run", "--", str(script), env={**os.environ, **SERVE_ENV})
        if refused:
            assert ran.returncode == 2 and "BOOTED" not in ran.stdout
            assert f"error: {script}'s #! line starts python -E: " in ran.stderr and "drop -E" in ran.stderr
        else:
            assert ran.returncode == 0 and ran.stdout.split() == ["BOOTED", "True"], ran.stderr


@pytest.mark.version_free
def test_a_program_whose_environment_lacks_nxl_hooks_is_lent_nxl_hooks_alone(tiny, tmp_path):
    """nxl run with a program whose interpreter's environment has no nxl_hooks: the bootstrap makes nxl_hooks
    importable and nothing else of nxl's environment (a module only there stays unimportable: the program's own
    imports do not change), and the model is recorded as the oracle says. Lacking what nxl_hooks needs (torch...),
    the program runs unchanged and one line says to install nxl_hooks there."""
    nxl_env = tmp_path / "nxl-env"  # nxl's environment: nxl_hooks and a module nobody else has
    (nxl_env / "only_in_nxls_env").mkdir(parents=True)
    (nxl_env / "only_in_nxls_env" / "__init__.py").write_text("")
    (nxl_env / "nxl_hooks").symlink_to(Path(nxl.__file__).resolve().parent)
    program_env = tmp_path / "program-env"  # the program's: nxl's real one less nxl_hooks (torch, transformers...)
    program_env.mkdir()
    for entry in Path(torch.__file__).resolve().parents[1].iterdir():
        if "nxl_hooks" not in entry.name and entry.suffix != ".pth":
            (program_env / entry.name).symlink_to(entry)
    python = getattr(sys, "_base_executable", sys.executable)  # an interpreter that has no nxl_hooks of its own
    nxl_cmd = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(nxl_env)!r}); "
                                     "from nxl_hooks.apps.cli import main; sys.exit(main())"]
    code = textwrap.dedent("""
        import importlib.util, json, sys
        facts = {"only": importlib.util.find_spec("only_in_nxls_env") is not None}
        if len(sys.argv) > 1:
            import torch
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
            out = model.generate(input_ids=torch.tensor([[1, 64, 67, 68]]), max_new_tokens=3, do_sample=False)
            facts.update(outputs=out[0].tolist(), nxl=sys.modules["nxl_hooks"].__file__)
        print("FACTS " + json.dumps(facts))
    """)
    run = tmp_path / "run"
    env = {**os.environ, **SERVE_ENV, "PYTHONPATH": str(program_env)}
    done = subprocess.run([*nxl_cmd, "run", "--sink", str(run), "--layers", "all", "--", python, "-c", code,
                           str(tiny.path)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.split("FACTS ", 1)[1])
    assert facts["only"] is False and facts["nxl"].startswith(str(nxl_env))
    (folder,) = [p for p in run.iterdir() if p.is_dir()]
    (call,) = nxl.read_stream(folder)
    sequence = torch.tensor([facts["outputs"]])
    with torch.no_grad():
        assert sequence.tolist() == tiny.model.generate(input_ids=sequence[:, :4], max_new_tokens=3,
                                                        do_sample=False).tolist()
    assert len(call.steps) == 3
    for step in call.steps:
        logits, embeddings = prefix_logits(tiny.model, tiny.hand, sequence[:, : step.position],
                                           torch.ones(1, step.position, dtype=torch.bool))
        torch.testing.assert_close(step.normxlogit, normxlogit(logits, embeddings, step.token)[1][call.layers],
                                   rtol=1e-4, atol=1e-4)
    only_transformers = tmp_path / "only-transformers"  # a model would load here, but nxl_hooks lacks torch
    only_transformers.mkdir()
    (only_transformers / "transformers").symlink_to(program_env / "transformers")
    env["PYTHONPATH"] = str(only_transformers)  # unchanged, unrecorded, said once
    bare = subprocess.run([*nxl_cmd, "run", "--", python, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert bare.returncode == 0 and json.loads(bare.stdout.split("FACTS ", 1)[1]) == {"only": False}, bare.stderr
    said = [line for line in bare.stderr.splitlines() if line.startswith("nxl_hooks:")]
    assert len(said) == 1 and "lacks torch" in said[0] and f"install nxl_hooks into that environment ({python} -m " \
        "pip install " in said[0], bare.stderr


@pytest.mark.version_free
def test_a_python_without_transformers_under_nxl_run_is_told_nothing(tmp_path):
    """Every Python the program starts inherits the bootstrap (PYTHONPATH): a helper (``python -c 'print(42)'``) or
    build tool whose environment lacks nxl_hooks and transformers loads no model, so nothing is lost: it wrote the
    'not recording: ... lacks torch, transformers' line into the program's stderr."""
    python = getattr(sys, "_base_executable", sys.executable)  # no nxl_hooks, no transformers of its own
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    assert subprocess.run([python, "-c", "import transformers"], capture_output=True, env=env).returncode != 0
    program = (f"import subprocess; helper = subprocess.run([{python!r}, '-c', 'print(42)'], capture_output=True, "
               "text=True); print(repr(helper.stdout), repr(helper.stderr))")
    nxl_cmd = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(nxl.__file__).parents[1])!r}); "
                                     "from nxl_hooks.apps.cli import main; sys.exit(main())"]  # nxl_hooks for nxl alone
    done = subprocess.run([*nxl_cmd, "run", "--", python, "-c", program], capture_output=True, text=True, timeout=60,
                          env={**env, **SERVE_ENV}, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "'42\\n' ''", (done.stdout, done.stderr)
    assert "nxl_hooks" not in done.stderr, done.stderr


@pytest.mark.version_free
def test_settings_round_trip_through_the_environment(tmp_path):
    settings = Settings(run_dir=tmp_path, sink=True, layers=[0, -1], target=["a", 3], models=["x*", "y"],
                        keep_calls=4, listen="127.0.0.1:9", sink_max_bytes=100, sink_max_files=2,
                        load={"dtype": "bfloat16", "quantize": "8bit", "max_memory": {"cpu": "1GiB"}})
    assert Settings.from_env(settings.to_env()) == settings
    assert settings.selects("/models/x-large") and settings.selects("org/y") and not settings.selects("z")
    with pytest.raises(ValueError, match="NXL_KEEP_CALLS"):
        Settings.from_env({"NXL_RUN_DIR": "r", "NXL_KEEP_CALLS": "-1"})
    with pytest.raises(ValueError, match="not a loopback address"):
        Settings.from_env({"NXL_RUN_DIR": "r", "NXL_LISTEN": "10.0.0.1:80"})


def test_classifier_forwards_are_kept_per_request_and_match_the_oracle(tmp_path):
    """A model that does not generate (here a classifier): each forward is a request, kept (bounded) with its id,
    and read over the endpoint as the top-k tokens per layer of the oracle."""
    import tiny as tiny_models
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from nxl_hooks.apps.serve.client import endpoints
    from nxl_hooks.apps.serve.controller import Controller
    from nxl_hooks.hooks.generate import REQUEST_ID
    from nxl_hooks.hooks.probe import count_hooks

    path = tmp_path / "cls"
    torch.manual_seed(0)
    LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tiny_models.VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, num_labels=3)).save_pretrained(path)
    tiny_models.tokenizer().save_pretrained(path)
    served, reference = (LlamaForSequenceClassification.from_pretrained(path).eval() for _ in range(2))
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = ["the film was good", "a very bad plot", "the movie is great and the plot good"]
    controller = Controller(Settings(run_dir=tmp_path / "run", keep_calls=2))
    controller.adopt(served, str(path))
    try:
        for index, text in enumerate(texts):
            token = REQUEST_ID.set(f"cls-{index}")
            with torch.no_grad():
                served(**tokenizer(text, return_tensors="pt", return_token_type_ids=False))
            REQUEST_ID.reset(token)
        (endpoint,) = endpoints(str(tmp_path / "run"))
        listed = endpoint.json("GET", "/v1/requests")["requests"]
        assert [(r["request_id"], r["kind"]) for r in listed] == [("cls-1", "forward"), ("cls-2", "forward")]
        (row,) = endpoint.json("GET", "/v1/requests/cls-2?k=3")["explained"]
        enc = tokenizer(texts[2], return_tensors="pt", return_token_type_ids=False)
        with torch.no_grad():
            out = reference(**enc, output_hidden_states=True)
        target = out.logits[0].argmax()
        _, expected = normxlogit(llama(reference).layer_logits(out.hidden_states), out.hidden_states[0],
                                 target.view(1))
        ids, seq = enc["input_ids"][0].tolist(), enc["input_ids"].shape[1]
        eligible = [i for i in range(seq) if i != seq - 1 and ids[i] not in tokenizer.all_special_ids]
        assert row["position"] == seq - 1 and row["target"] == [int(target)]
        assert row["tokens"] == tokenizer.convert_ids_to_tokens(ids)
        for layer, top in row["top"].items():
            scores = expected[int(layer), 0]
            best = sorted(eligible, key=lambda i: -float(scores[i]))[:3]
            assert [entry[0] for entry in top] == best
            torch.testing.assert_close(torch.tensor([entry[2] for entry in top]), scores[best], rtol=1e-4, atol=1e-5)
        controller.pause()
        assert count_hooks(served) == 0  # paused: no hook of the probe, nor the one that keeps forwards
    finally:
        controller.close()
    assert not list((tmp_path / "run").glob("*.sock"))  # closed: its socket is gone


def test_a_causal_lms_plain_forwards_are_kept_once_each_beside_its_generate_calls(tiny, tmp_path):
    """A causal LM's own model(...) (scoring, log-probabilities) under nxl run / nxl attach: each plain forward is a
    request kept with its attribution, equal to the oracle's, and the forwards inside a generate call are that
    call's steps only (they were kept nowhere while the status said all was recorded); nxl tail says they make no
    token line."""
    from nxl_hooks.apps.commands.tail import forward_calls
    from nxl_hooks.apps.serve.client import endpoints
    from nxl_hooks.apps.serve.controller import Controller
    from nxl_hooks.hooks.generate import REQUEST_ID

    served = LlamaForCausalLM.from_pretrained(tiny.path).eval()
    controller = Controller(Settings(run_dir=tmp_path / "run"))
    controller.adopt(served, str(tiny.path))
    ids = tiny.tokenizer("hello world how are you", return_tensors="pt")["input_ids"]
    try:
        for request_id, run in (("f0", served), ("g0", lambda x: served.generate(x, max_new_tokens=3,
                                                                                 do_sample=False)), ("f1", served)):
            token = REQUEST_ID.set(request_id)
            with torch.no_grad():
                run(ids)
            REQUEST_ID.reset(token)
        (model,) = controller.status()["models"]
        assert model["calls"] == 3 and model["forwards"] == 2 and model["unrecorded_calls"] == 0
        (said,) = forward_calls(model)
        assert "plain forward calls" in said and "/v1/requests/ID" in said
        (endpoint,) = endpoints(str(tmp_path / "run"))
        listed = endpoint.json("GET", "/v1/requests")["requests"]
        assert sorted((r["request_id"], r["kind"]) for r in listed) == [("f0", "forward"), ("f1", "forward"),
                                                                       ("g0", "generate")]
        (row,) = endpoint.json("GET", "/v1/requests/f1?k=3")["explained"]
        with torch.no_grad():
            out = tiny.model(ids, output_hidden_states=True)
        target = out.logits[0, -1].argmax()
        _, expected = normxlogit(llama(tiny.model).layer_logits(out.hidden_states), out.hidden_states[0],
                                 target.view(1))
        assert row["position"] == ids.shape[1] - 1 and row["target"] == [int(target)]
        for layer, top in row["top"].items():
            assert len(top) == 3
            torch.testing.assert_close(torch.tensor([entry[2] for entry in top]),
                                       expected[int(layer), 0][[entry[0] for entry in top]], rtol=1e-4, atol=1e-5)
    finally:
        controller.close()


def test_keep_calls_holds_across_a_pause_and_resume(tiny, tmp_path):
    """--keep-calls N keeps N generate calls in memory in all: the calls of a probe a pause (or nxl ctl attach) took
    off make room for the new probe's. They were kept beside N of the new one's, 2N in memory and in status."""
    from nxl_hooks.apps.serve.controller import Controller
    from nxl_hooks.hooks.generate import REQUEST_ID

    served = LlamaForCausalLM.from_pretrained(tiny.path).eval()
    controller = Controller(Settings(run_dir=tmp_path / "run", keep_calls=2))
    controller.adopt(served, str(tiny.path))
    ids = tiny.tokenizer("hello world how are you", return_tensors="pt")["input_ids"]
    try:
        for index in range(4):
            if index == 2:
                controller.pause()
                controller.resume()
            token = REQUEST_ID.set(f"g{index}")
            with torch.no_grad():
                served.generate(ids, max_new_tokens=2, do_sample=False)
            REQUEST_ID.reset(token)
        (model,) = controller.status()["models"]
        assert model["calls"] == 2
        assert [record.request_id for _, record, _ in controller.records()] == ["g2", "g3"]
    finally:
        controller.close()


def test_a_model_the_program_compiles_whole_runs_under_nxl_run(tiny, tmp_path):
    """The program's torch.compile(model, fullgraph=True) under nxl run: the run's keeper of plain forwards is traced
    with the model's hooks and adds no graph break (it raised dynamo's Unsupported into the program's call); the
    output is the model's, and the probe's own record of that forward still equals the oracle, for the thread that
    ran it (a generate in another thread took it as its own request)."""
    from torch._dynamo.utils import counters

    from nxl_hooks.apps.serve.controller import Controller

    served = LlamaForCausalLM.from_pretrained(tiny.path).eval()
    controller = Controller(Settings(run_dir=tmp_path / "run"))
    controller.adopt(served, str(tiny.path))
    ids = tiny.tokenizer("hello world how are you", return_tensors="pt")["input_ids"]
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch.no_grad():
            out = torch.compile(served, fullgraph=True, backend="eager")(ids)
            expected = tiny.model(ids, output_hidden_states=True)
        torch.testing.assert_close(out.logits, expected.logits)
        assert not counters["graph_break"]
        # another thread's generate neither lists that forward among the run's requests nor takes it from this one
        other = threading.Thread(target=lambda: served.generate(ids, max_new_tokens=2, do_sample=False))
        other.start()
        other.join(60)
        (watch,) = controller.watches()
        assert not other.is_alive() and not watch.forwards and controller.status()["models"][0]["forwards"] == 0
        result = watch.probe.result()
        _, oracle = normxlogit(llama(tiny.model).layer_logits(expected.hidden_states), expected.hidden_states[0],
                               expected.logits[0, -1].argmax().view(1))
        torch.testing.assert_close(result.normxlogit[:, 0], oracle[:, 0], rtol=1e-4, atol=1e-5)
    finally:
        torch._dynamo.reset()
        controller.close()


def test_hooks_transformers_keeps_are_not_counted_as_nxls(tiny, tmp_path):
    """A program that once asked its model for output_hidden_states carries transformers' own output-capturing
    hooks: a paused model counts none of nxl's, and none is said left behind (they were counted as nxl's)."""
    from nxl_hooks.apps.serve.controller import Controller
    from nxl_hooks.hooks.probe import count_hooks

    model = LlamaForCausalLM.from_pretrained(tiny.path).eval()
    with torch.no_grad():
        model(tiny.tokenizer("hello world", return_tensors="pt")["input_ids"], output_hidden_states=True)
    theirs = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert theirs > 0  # transformers' own, kept on the model
    controller = Controller(Settings(run_dir=tmp_path / "run"))
    controller.adopt(model, str(tiny.path))
    try:
        (attached,) = controller.status()["models"]
        assert attached["attached"] and attached["hooks"] > 0
        controller.pause()
        (paused,) = controller.status()["models"]
        assert paused["hooks"] == 0 and count_hooks(model) == 0
    finally:
        controller.close()
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == theirs  # left alone


_FORWARDS = """
import pathlib, sys, time, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
model = AutoModelForSequenceClassification.from_pretrained(sys.argv[1]).eval()
tok = AutoTokenizer.from_pretrained(sys.argv[1])
print("READY", flush=True)
deadline = time.monotonic() + 300
while not pathlib.Path(sys.argv[2]).exists() and time.monotonic() < deadline:  # a classifier serving requests
    with torch.no_grad():
        model(**tok("the film was good", return_tensors="pt", return_token_type_ids=False))
    time.sleep(0.2)
"""


@pytest.mark.version_free
def test_tail_says_that_a_classifiers_requests_are_forward_calls(tmp_path):
    """A program that only classifies (forward calls, no generate) under nxl run --sink: nxl tail on its run folder
    says in one '!' line that its requests are forward calls, which make no token line, and where they are (it
    printed nothing but 'waiting', as if hung)."""
    import tiny as tiny_models
    from transformers import LlamaConfig, LlamaForSequenceClassification

    path = tmp_path / "cls"
    LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tiny_models.VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, num_labels=3)).save_pretrained(path)
    tiny_models.tokenizer().save_pretrained(path)
    (tmp_path / "app.py").write_text(_FORWARDS)
    run, stop = tmp_path / "run", tmp_path / "stop"
    program = subprocess.Popen([*NXL, "run", "--sink", str(run), "--", sys.executable, str(tmp_path / "app.py"),
                                str(path), str(stop)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **SERVE_ENV})
    tail = None
    try:
        assert program.stdout.readline() == "READY\n", program.stderr.read()
        tail = subprocess.Popen([*NXL, "tail", "--run", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "COLUMNS": "1000"})
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.append(tail.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)  # the status is read every 2 s
        assert said == [f"! pid {program.pid} {path}: its requests are forward calls of a sequence classification "
                        "model, not generated tokens: nxl tail shows none of them; each one's top tokens per layer "
                        "are at the run's endpoint, /v1/requests/ID\n"]
    finally:
        stop.touch()
        if tail is not None:
            tail.kill()
            tail.wait()
        program.wait(120)
    assert program.returncode == 0


# -- the rotating sink ----------------------------------------------------------------------------------------

def _records(calls: list[nxl.GenerationCall]) -> list[tuple]:
    return [(c.request_id, c.complete, [(s.step, s.position, int(s.token[0])) for s in c.steps]) for c in calls]


@pytest.mark.version_free
def test_rotating_sink_rotates_keeps_the_newest_files_and_reads_back_in_order(tiny, tmp_path):
    folder = tmp_path / "records"
    ids = tiny.prompt("hello world how are you")
    sink = nxl.RotatingSink(folder, max_bytes=6000, max_files=1000)
    from nxl_hooks.hooks.generate import REQUEST_ID

    with nxl.attach(tiny.model, sink=sink) as probe:
        for i in range(3):
            token = REQUEST_ID.set(f"r{i}")
            tiny.model.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
            REQUEST_ID.reset(token)
    files = sorted(folder.iterdir())
    assert len(files) > 3 and all(f.name.endswith(f"-{1:08d}.nxl") for f in files)
    assert all(f.stat().st_size <= 6000 for f in files) and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert _records(nxl.read_stream(folder)) == _records(probe.calls)  # one call spans several files
    for file in files[1:]:  # every rotated file reads on its own: the running call's frame is written again
        assert nxl.read_stream(file)

    second = nxl.RotatingSink(folder, max_bytes=6000, max_files=3)  # a new writer: numbers go on, oldest go
    with nxl.attach(tiny.model, sink=second) as probe2:
        tiny.model.generate(input_ids=ids, max_new_tokens=24, do_sample=False)
    names = sorted(f.name for f in folder.iterdir())
    assert len(names) == 3 and int(names[0][:8]) > len(files)
    assert all(name.endswith(f"-{len(files) + 1:08d}.nxl") for name in names)
    (kept,) = nxl.read_stream(folder)  # the first writer's files are gone; the call starts at its first kept step
    expected = _records(probe2.calls)[0]
    assert kept.complete and kept.steps[-1].step == 23 and kept.steps[0].step > 0
    assert _records([kept])[0][2] == expected[2][kept.steps[0].step:]
    assert all(torch.equal(a.normxlogit, b.normxlogit) for a, b in zip(kept.steps, probe2.calls[0].steps[kept.steps[0].step:]))

    empty = nxl.RotatingSink(folder, max_bytes=6000, max_files=3)  # nothing recorded: its file is removed
    empty.close()
    assert sorted(f.name for f in folder.iterdir()) == names
    with pytest.raises(ValueError, match="at least 1"):
        nxl.RotatingSink(folder, max_bytes=0)


@pytest.mark.version_free
def test_frames_are_safetensors_blobs_of_any_layout_and_dtype(tmp_path):
    """The sink's own encoder (safetensors.torch.save's checks cost too much per step) writes what safetensors'
    loader reads back exactly: non-contiguous, half-precision, empty and bool tensors, and the metadata."""
    from safetensors import safe_open
    from safetensors.torch import load

    from nxl_hooks.records.attribution import _blob

    tensors = {"t": torch.randn(3, 4).t(), "bf16": torch.randn(2, 3).bfloat16(), "f16": torch.randn(5).half(),
               "empty": torch.zeros(0, 5), "ids": torch.tensor([[1], [2]]), "flags": torch.tensor([True, False])}
    blob = _blob(tensors, {"nxl_hooks": "{}"})
    loaded = load(blob)
    assert set(loaded) == set(tensors)
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value)
    path = tmp_path / "blob.safetensors"  # safe_open reads a file: the header as written
    path.write_bytes(blob)
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"nxl_hooks": "{}"}
