"""Helpers for the server tests and benchmarks/bench_serve.py: a tiny chat model saved to a folder, and a
``transformers serve`` process (plain or under ``nxl run``) on 127.0.0.1 that the caller always stops.

    path = save_chat_model(tmp_path / "tiny")
    with Server(path, nxl=["--sink", str(tmp_path / "run")]) as server:
        reply = server.chat("hello world", max_tokens=5, request_id="r1")      # {"content", "usage", "id", ...}
        reply = server.chat("hello world", max_tokens=5, stream=True)          # SSE, the same fields
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = (["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(60)]
         + ["user:", "assistant:", "system:", "hello", "world", "how", "are", "you", "the", "a", "is", "?"])
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def save_chat_model(path: Path, seed: int = 0) -> Path:
    """A random 2-block Llama over :data:`WORDS` with a word-level tokenizer and a chat template, saved."""
    vocab = {word: i for i, word in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>")
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=False,
                                               max_new_tokens=8)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def live_reader(controller: Any, timeout: float = 60) -> None:
    """Wait until a live reader (``nxl tail``, ``/v1/stream``) follows every model ``controller`` (an in-process
    :class:`~nxl_hooks.apps.serve.controller.Controller`) watches: the steps made from then on reach it."""
    deadline = time.monotonic() + timeout
    while not all(watch.live is not None for watch in controller.watches()):
        assert time.monotonic() < deadline, f"no live reader subscribed within {timeout} s"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def transformers_cli() -> str:
    """The ``transformers`` console script of this interpreter's environment."""
    local = Path(sys.executable).parent / "transformers"
    return str(local) if local.exists() else (shutil.which("transformers") or "transformers")


class Server:
    """``transformers serve MODEL`` on 127.0.0.1 (under ``nxl run NXL...`` unless ``nxl`` is None); ``model`` None:
    ``transformers serve`` alone, which loads the model each request names (``chat(..., model=PATH)``) on demand."""

    def __init__(self, model: Path | None, *, nxl: list[str] | None = None, serve: list[str] = (),
                 log: Path | None = None, env: dict | None = None, device: str = "cpu") -> None:
        self.model, self.port = model, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        command = [transformers_cli(), "serve", *([str(model)] if model is not None else []), "--host", "127.0.0.1",
                   "--port", str(self.port), "--device", device, *serve]
        if nxl is not None:
            command = [sys.executable, "-m", "nxl_hooks", "run", *nxl, "--", *command]
        self.command = command
        self.log = log
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 180) -> "Server":
        out = open(self.log, "wb") if self.log else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.process.returncode}: {self.log_text()[-3000:]}")
                try:
                    if self.get("/health", timeout=2)["status"] == "ok":
                        return self
                except OSError:
                    time.sleep(0.25)
            raise TimeoutError(f"the server was not healthy within {timeout} s: {self.log_text()[-3000:]}")
        except BaseException:  # a timeout, or an interrupt while it starts: no `with` stops it then (its own session)
            self.stop()
            raise

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def get(self, path: str, timeout: float = 30) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=timeout) as response:
            return json.loads(response.read())

    def chat(self, content: str, *, max_tokens: int, request_id: str | None = None, stream: bool = False,
             timeout: float = 120, **body: Any) -> dict:
        """One chat completion: {"id", "request_id" (response header), "content", "usage", "finish_reason"}."""
        payload = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
                   "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {}), **body}
        headers = {"Content-Type": "application/json", **({"X-Request-ID": request_id} if request_id else {})}
        request = urllib.request.Request(self.base + "/v1/chat/completions", data=json.dumps(payload).encode(),
                                         headers=headers, method="POST")
        try:
            response = urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as error:  # what the server said of it, in the test's failure
            raise RuntimeError(f"HTTP {error.code} for request {request_id!r}: {error.read()[:2000]!r}") from error
        with response:
            header_id = response.headers.get("x-request-id")
            if not stream:
                data = json.loads(response.read())
                choice = data["choices"][0]
                return {"id": data["id"], "request_id": header_id, "content": choice["message"]["content"],
                        "usage": data["usage"], "finish_reason": choice["finish_reason"]}
            chunks = [json.loads(line[5:]) for line in response.read().decode().splitlines()
                      if line.startswith("data:")]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        # (the usage: in the last chunk up to transformers 5.24, in one of its own after it, asked for, from 5.25)
        usage = [c["usage"] for c in chunks if c.get("usage")]
        ends = [c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and c["choices"][0].get("finish_reason")]
        return {"id": chunks[-1]["id"], "request_id": header_id, "content": content,
                "usage": usage[-1] if usage else None, "finish_reason": ends[-1] if ends else None,
                "chunks": len(chunks)}

    def stop(self) -> int | None:
        """SIGTERM to the process group (uvicorn exits at once), SIGKILL if it lingers; the exit code."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                return self.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        return self.process.poll()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def gdb_refusal() -> str | None:
    """Why ``nxl attach PID`` cannot inject through gdb on this machine (Python < 3.14), or None where it can: gdb
    missing, or a gdb that cannot call a function in a process here (nxl attach's own check, asked once per
    process)."""
    from nxl_hooks.apps.serve.inject import gdb_refusal as cannot_call

    return "gdb is not installed (apt-get install gdb)" if shutil.which("gdb") is None else cannot_call()
