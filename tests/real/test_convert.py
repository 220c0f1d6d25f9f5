"""``nxl convert MODEL.gguf OUT`` (issue 18, item 1): a GGUF file as a transformers folder that from_pretrained and
``transformers serve`` load, and the serving quickstart (docs/real-model-quickstart.md) run for real on SmolLM2.

The refusals need no model; the rest is the real-model tier (tests/real_model.py: SmolLM2-135M-Instruct's GGUF file).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

import nxl_hooks as nxl
import real_model
from nxl_hooks.apps.cli import main
from serving import Server, transformers_cli

NXL = [sys.executable, "-m", "nxl_hooks"]
DOC = Path(__file__).resolve().parents[2] / "docs" / "real-model-quickstart.md"
QUESTION = "What is the capital of France?"


def _one_line_exit_2(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


# -- refusals ---------------------------------------------------------------------------------------------------


def test_convert_refuses_what_is_not_a_gguf_file(capsys, tmp_path):
    err = _one_line_exit_2(capsys, ["convert", str(tmp_path), str(tmp_path / "out")])
    assert "is not a .gguf file: pass the file, or its folder plus --gguf-file NAME" in err


def test_convert_refuses_an_output_folder_that_is_not_empty(capsys, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    err = _one_line_exit_2(capsys, ["convert", str(tmp_path / "m.gguf"), str(tmp_path / "out")])
    assert "exists and is not an empty folder" in err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_convert_refuses_a_link_to_an_empty_folder(capsys, tmp_path):
    """Before the model loads: the converted folder is renamed into place, which a link cannot take (the whole
    model was converted, then "Not a directory")."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "empty")
    err = _one_line_exit_2(capsys, ["convert", str(tmp_path / "m.gguf"), str(tmp_path / "out")])
    assert "out is a symbolic link: name a new folder (or an empty one) for the converted model" in err


def test_convert_refuses_a_folder_below_a_file_before_the_model_loads(capsys, tmp_path):
    """OUT below a file was found only once the whole model was converted, said as "[Errno 17] File exists"."""
    (tmp_path / "file.txt").write_text("mine")
    err = _one_line_exit_2(capsys, ["convert", str(tmp_path / "m.gguf"), str(tmp_path / "file.txt" / "out")])
    assert f"{tmp_path / 'file.txt'} is a file, not a folder; give a folder" in err
    assert (tmp_path / "file.txt").read_text() == "mine"


def test_convert_refuses_a_missing_file(capsys, tmp_path):
    err = _one_line_exit_2(capsys, ["convert", str(tmp_path / "m.gguf"), str(tmp_path / "out")])
    assert "no GGUF file at" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("serve, gguf", [(["models/", "--port", "1"], "m.Q4.gguf"),
                                         (["--port", "1", "models/"], "m.Q4.gguf"),
                                         (["--port", "1", "--continuous-batching", "{tmp}/my models/"], "m.Q4.gguf"),
                                         (["--port", "1", "models/"], "{tmp}/m.Q4.gguf"),
                                         (["--continuous-batching", "org/model", "--port", "1"], "m.Q4.gguf")])
def test_nxl_run_gguf_with_serve_says_which_convert_to_run(tmp_path, serve, gguf):
    """Refused at start, before any run folder: one line naming the nxl convert command, exit 2, and the serve
    command of the folder it makes, with the program's other arguments (the value of an option before the model
    folder was taken for it: ``--port 1 models/`` said ``nxl convert 1/m.Q4.gguf``); after a flag of no value, the
    folder is the one that holds the file; a file given by its absolute path is in no folder of them (each
    "held" it); where no argument is told apart as the folder, the command names serve's other arguments."""
    serve, gguf = [arg.format(tmp=tmp_path) for arg in serve], gguf.format(tmp=tmp_path)
    if serve[-1].startswith(str(tmp_path)):
        Path(serve[-1]).mkdir()
        (Path(serve[-1]) / gguf).write_bytes(b"")
    if Path(gguf).is_absolute():
        Path(gguf).write_bytes(b"")
    sink = tmp_path / "runs"
    done = subprocess.run([*NXL, "run", "--sink", str(sink), "--gguf-file", gguf, "--",
                           transformers_cli(), "serve", *serve],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = [text for text in done.stderr.splitlines() if text.startswith("nxl run:")]
    if serve[0] == "--continuous-batching":
        assert line.endswith("nxl convert MODEL_DIR/m.Q4.gguf MODEL_DIR-converted && nxl run -- transformers serve "
                             "MODEL_DIR-converted, with serve's other arguments"), line
        return
    folder = serve[-1] if serve[0] == "--port" else serve[0]
    out = folder.rstrip("/") + "-converted"
    served = " ".join(shlex.quote(out if arg == folder else arg) for arg in serve)
    assert line.endswith(f"nxl convert {shlex.quote(os.path.join(folder, gguf))} {shlex.quote(out)} && nxl run -- "
                         f"transformers serve {served}"), line
    assert not sink.exists()


# -- the real model ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(smollm2_dir, tmp_path_factory) -> Path:
    """SmolLM2's GGUF file through ``nxl convert`` (about 20 s)."""
    out = tmp_path_factory.mktemp("convert") / "smollm2"
    assert main(["convert", str(real_model.smollm2_gguf()), str(out)]) == 0
    return out


@pytest.mark.real_model
def test_the_converted_folder_loads_and_equals_the_gguf_model(converted, smollm2):
    gguf = real_model.smollm2_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    by_gguf = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert tokenizer.chat_template and tokenizer.chat_template == by_gguf.chat_template
    messages = [{"role": "user", "content": QUESTION}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    assert ids.tolist() == by_gguf.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                       return_dict=True)["input_ids"].tolist()
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    model = transformers.AutoModelForCausalLM.from_pretrained(converted).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    assert model.dtype == torch.float32
    with torch.no_grad():
        mine, theirs = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert torch.equal(mine, theirs)  # float32 weights saved losslessly: the same numbers, not just close ones
    with torch.no_grad():  # the session's model (tests/conftest.py), which other real-model tests take as loaded by hand
        assert torch.equal(smollm2[0](input_ids=ids).logits, theirs)
    assert tokenizer.decode(mine[0, -1].argmax()) == by_gguf.decode(theirs[0, -1].argmax())


def _doc_commands() -> list[str]:
    """The shell lines of the quickstart, joined where they continue with a backslash."""
    text = DOC.read_text()
    blocks = [block.split("```", 1)[0] for block in text.split("```bash\n")[1:]]
    return [line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.real_model
def test_the_serving_quickstart_runs_on_smollm2(converted, tmp_path):
    """docs/real-model-quickstart.md for real: the commands it shows (convert done by the fixture), on 127.0.0.1 with
    a free port and this test's run folder: serve under nxl run, one chat request, nxl tail, read_stream."""
    commands = _doc_commands()
    assert commands[0] == "nxl convert SmolLM2-135M-Instruct.Q4_1.gguf smollm2"
    assert commands[1] == "nxl run --sink runs/ -- transformers serve smollm2 --port 8000"
    assert commands[2].startswith("curl -s http://localhost:8000/v1/chat/completions") and QUESTION in commands[2]
    assert commands[3] == "nxl tail --run runs/ --request-id quick-1"
    run = tmp_path / "runs"
    with Server(converted, nxl=["--sink", str(run)], log=tmp_path / "server.log") as server:
        tail = subprocess.Popen([*NXL, "tail", "--run", str(run), "--request-id", "quick-1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(1.0)  # usually subscribed before the request starts; if not, it replays the request's steps
            reply = server.chat(QUESTION, max_tokens=8, request_id="quick-1")
            out, err = tail.communicate(timeout=120)
        finally:
            if tail.poll() is None:
                tail.kill()
                tail.wait()
    assert tail.returncode == 0, err
    (call,) = nxl.read_stream(run, request_id="quick-1")
    new = reply["usage"]["completion_tokens"]
    assert call.complete and len(call.steps) == new > 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    tokens = [int(step.token[0]) for step in call.steps]
    assert tokenizer.decode(tokens, skip_special_tokens=True) == reply["content"]
    assert "Paris" in reply["content"]
    lines = out.splitlines()
    assert len(lines) == new + 1 and lines[-1] == f"quick-1: ended after {new} tokens"
    assert all(line.split(maxsplit=2)[:2] == ["quick-1", str(index)] for index, line in enumerate(lines[:-1]))
    prompt = call.prompt_mask.shape[1]
    for index, step in enumerate(call.steps):  # each step explains its whole context, at the recorded layers
        assert step.position == prompt + index and step.normxlogit.shape[-1] == step.position
        assert torch.isfinite(step.normxlogit).all()
