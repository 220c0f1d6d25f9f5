"""``nxl attach PID`` / ``nxl detach PID`` on real processes started without nxl: ``transformers serve`` (plain and
continuous batching) under a client loop, and a plain script holding a model in a loop; every refusal the CI
machine can produce; an injection that fails inside the target. Loopback only, bounded loops, every process
stopped by PID. Recorded steps are checked against the uncached oracle (tests/oracle.py, via test_serve's
check_call); answers against the unattached model."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

import nxl_hooks as nxl
from nxl_hooks.apps.serve.client import Endpoint
from nxl_hooks.apps.options import CliError
from nxl_hooks.apps.serve import inject
from nxl_hooks.apps.serve.inject import (Target, _private_parent, _queue, bootstrap_source, injector_command,
                                          permission_refusal, trusted_file)
from oracle import normxlogit, prefix_logits
from serving import Server, gdb_refusal
import tiny as tiny_models
from test_serve import CB_FLAGS, SERVE_ENV, Tiny, _cli, check_call, tiny  # noqa: F401 - tiny: the fixture

REPO = Path(nxl.__file__).resolve().parent.parent
needs_gdb = pytest.mark.skipif(gdb_refusal() is not None, reason=f"nxl attach PID injects through gdb: {gdb_refusal()}")

CONTENTS = ("hello world how are you", "the world is", "w1 w2 w3")


class Clients:
    """One client thread sending chat requests one after the other (ids r0, r1, ...) until stopped: (id, content,
    started, ended, reply or exception) per request."""

    def __init__(self, server: Server, limit: int = 2000, **body: object) -> None:
        self.server, self.limit, self.done, self.body = server, limit, [], body  # body: more of each request's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        for n in range(self.limit):
            if self._stop.is_set():
                return
            content = CONTENTS[n % len(CONTENTS)]
            started = time.monotonic()
            try:
                reply = self.server.chat(content, max_tokens=4, request_id=f"r{n}", stream=n % 2 == 1,
                                         **self.body)
            except Exception as error:  # noqa: BLE001 - asserted by the test
                reply = error
            self.done.append((f"r{n}", content, started, time.monotonic(), reply))
            time.sleep(0.05)  # a steady load, not a flood, on a small CI machine

    def started_after(self, moment: float) -> list[tuple]:
        return [entry for entry in list(self.done) if entry[2] > moment]

    def wait_for(self, moment: float, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.started_after(moment)) < count:
            assert time.monotonic() < deadline and self._thread.is_alive(), "the client loop stalled"
            time.sleep(0.1)

    def __enter__(self) -> "Clients":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def _attach_and_detach_under_load(tiny: Tiny, tmp_path: Path, capsys, serve: list[str]) -> None:
    run, expected = tmp_path / "run", {c: tiny.text(tiny.generate(c, 4)) for c in CONTENTS}
    with Server(tiny.path, serve=serve, log=tmp_path / "log", env=SERVE_ENV) as server, Clients(server) as clients:
        clients.wait_for(0, 2)
        code, _, err = _cli(capsys, "attach", str(server.pid), "--layers", "all", "--sink", str(run))
        assert code == 0, err
        attached = time.monotonic()
        assert f"process {server.pid} recorded" in err and str(run) in err
        code, out, err = _cli(capsys, "ctl", "status", "--run", str(run), "--json")  # nxl ctl works as under nxl run
        (model,) = json.loads(out)["models"]
        assert code == 0 and model["attached"] and model["hooks"] > 0 and model["layers"] == [0, 1, 2], err
        # the socket of the process that holds the model: serve's own up to transformers 5.24, the model process it
        # spawned from 5.25 (attached with it)
        (sock,) = run.glob("*.sock")
        assert int(sock.stem) in {server.pid, *(child.pid for child in psutil.Process(server.pid).children())}
        for path, mode in ((run, 0o700), (sock, 0o600)):  # owner-only, as under nxl run
            assert stat.S_IMODE(path.stat().st_mode) == mode
        clients.wait_for(attached, 3)
        detaching = time.monotonic()
        code, _, err = _cli(capsys, "detach", str(server.pid))
        assert code == 0 and "runs unrecorded" in err and " left: " not in err, err  # no hook, no nxl thread
        detached = time.monotonic()
        clients.wait_for(detached, 2)
    for request_id, content, _, _, reply in clients.done:  # no request failed, none changed
        assert isinstance(reply, dict), f"{request_id}: {reply!r}"
        assert reply["content"] == expected[content] and reply["request_id"] == request_id
    calls = {call.request_id: call for call in nxl.read_stream(run)}
    during = [entry for entry in clients.started_after(attached) if entry[3] < detaching]
    assert len(during) >= 3
    for request_id, content, _, _, reply in during:  # every request that started after the attach
        assert calls[request_id].complete
        check_call(tiny, calls[request_id], content, reply)
    assert not {entry[0] for entry in clients.started_after(detached)} & set(calls)
    assert not sock.exists()  # the endpoint is closed


@needs_gdb
def test_attach_and_detach_transformers_serve_while_it_serves(tiny, tmp_path, capsys):
    _attach_and_detach_under_load(tiny, tmp_path, capsys, [])


@needs_gdb
def test_attach_and_detach_transformers_serve_continuous_batching(tiny, tmp_path, capsys):
    _attach_and_detach_under_load(tiny, tmp_path, capsys, CB_FLAGS)


@needs_gdb
def test_a_detach_an_idle_model_process_cannot_take_says_it_still_records(tiny, tmp_path, capsys):
    """transformers 5.25+: a model process takes an injected request only once the server hands it a request (its
    main thread waits in its queue). Detaching an idle server, its own part is undone, and the command exits 2
    naming the model process that still records and how to detach it; which then works while it serves."""
    if not hasattr(importlib.import_module("transformers.cli.serving.utils"), "GenerateRunner"):
        pytest.skip("up to transformers 5.24, serve holds its model in its own process")
    run = tmp_path / "run"
    with Server(tiny.path, log=tmp_path / "log", env=SERVE_ENV) as server:
        with Clients(server) as clients:
            clients.wait_for(0, 1)
            code, _, err = _cli(capsys, "attach", str(server.pid), "--layers", "last", "--sink", str(run))
            assert code == 0, err
        (sock,) = run.glob("*.sock")
        code, _, err = _cli(capsys, "detach", str(server.pid), "--timeout", "3")
        assert code == 2 and f"its model process {sock.stem} still records" in err, err
        assert f"nxl detach {sock.stem} while it serves" in err and sock.exists()
        with Clients(server):
            code, _, err = _cli(capsys, "detach", sock.stem)
        assert code == 0 and "runs unrecorded" in err and not sock.exists(), err


@needs_gdb
def test_a_model_process_the_server_starts_after_the_attach_is_recorded_and_detached(tiny, tmp_path, capsys):
    """transformers 5.25+: serve started without a model loads the one a request names in a process of its own, and
    stops it after --model-timeout seconds without requests; the next request starts another. One started after
    nxl attach ran unrecorded (the attach had reached the one before it). It now starts with nxl run's bootstrap:
    its requests are recorded in the run folder, exactly, and nxl detach of the server detaches it too."""
    if not hasattr(importlib.import_module("transformers.cli.serving.utils"), "GenerateRunner"):
        pytest.skip("up to transformers 5.24, serve holds its model in its own process")
    run, model = tmp_path / "run", str(tiny.path)
    with Server(None, serve=["--model-timeout", "3"], log=tmp_path / "log", env=SERVE_ENV) as server:
        with Clients(server, model=model) as clients:
            clients.wait_for(0, 1)
            code, _, err = _cli(capsys, "attach", str(server.pid), "--layers", "all", "--sink", str(run))
            assert code == 0 and "and the model processes it starts from now on" in err, err
        (first,) = map(psutil.Process, inject.model_processes(server.pid))  # (not multiprocessing's resource tracker)
        first.wait(timeout=60)  # stopped after 3 s without requests
        reply = server.chat(CONTENTS[1], max_tokens=4, request_id="late-1", model=model)
        (second,) = map(psutil.Process, inject.model_processes(server.pid))
        assert second.pid != first.pid and (run / f"{second.pid}.sock").exists()  # its endpoint, in the run folder
        (call,) = nxl.read_stream(run, request_id="late-1")
        assert call.complete
        check_call(tiny, call, CONTENTS[1], reply)
        with Clients(server, model=model):  # (an idle model process takes nxl detach's request with the next one)
            code, _, err = _cli(capsys, "detach", str(server.pid))
        assert code == 0 and "runs unrecorded" in err, err
        assert not list(run.glob("*.sock"))
        server.chat(CONTENTS[2], max_tokens=4, request_id="after-1", model=model)
        second.wait(timeout=60)
        server.chat(CONTENTS[2], max_tokens=4, request_id="after-2", model=model)  # in a third model process
        (third,) = inject.model_processes(server.pid)  # started as by a server never attached
        assert third != second.pid and not list(run.glob("*.sock"))
    assert not nxl.read_stream(run, request_id="after-1") and not nxl.read_stream(run, request_id="after-2")


_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from transformers import AutoTokenizer, LlamaForCausalLM
    folder, go = sys.argv[1], sys.argv[2]
    print("ready", flush=True)
    for _ in range(6000):  # no model until the test says so (5 min at most: a loaded machine injects slowly)
        if os.path.exists(go):
            break
        time.sleep(0.05)
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("hello world how are you", return_tensors="pt")["input_ids"]
    for n in range(1500):
        if os.path.exists(go + ".stop"):
            break
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
        print(json.dumps(out[0, ids.shape[1]:].tolist()), flush=True)
        time.sleep(0.05)
""")


def _start(tmp_path: Path, code: str, *args: str, env: dict | None = None, python: list[str] | None = None):
    script = tmp_path / "target.py"
    script.write_text(code)
    out = open(tmp_path / "target.log", "w")
    process = subprocess.Popen([*(python or [sys.executable]), str(script), *args], stdout=out,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 120
    while "ready" not in (tmp_path / "target.log").read_text():
        assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "target.log").read_text()
        time.sleep(0.1)
    return process


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


@needs_gdb
def test_a_plain_script_waited_for_attached_recorded_detached(tiny, tmp_path, capsys):
    go, run, log = tmp_path / "go", tmp_path / "run", tmp_path / "target.log"
    process = _start(tmp_path, _SCRIPT, str(tiny.path), str(go))
    try:
        pid = str(process.pid)
        code, _, err = _cli(capsys, "attach", pid)  # transformers imported, no model yet
        assert code == 2 and len(err.splitlines()) == 1 and "no transformers model" in err and "--wait" in err
        go.touch()
        code, _, err = _cli(capsys, "attach", pid, "--wait", "90", "--layers", "7")  # blocks 0..2 only
        assert code == 2 and len(err.splitlines()) == 1 and "no model could be attached" in err, err
        code, _, err = _cli(capsys, "attach", pid, "--layers", "0,-1", "--sink", str(run))  # nothing was left
        assert code == 0, err
        code, _, err = _cli(capsys, "attach", pid)
        assert code == 2 and "recorded already" in err and len(err.splitlines()) == 1
        deadline = time.monotonic() + 120
        while len(nxl.read_stream(run) if run.exists() else []) < 3:
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.2)
        live = Endpoint(socket_path=run / f"{pid}.sock")
        reader = threading.Thread(target=lambda: list(live.events("/v1/stream", timeout=60)), daemon=True)
        reader.start()  # a live reader (nxl tail) connected at the detach
        code, _, err = _cli(capsys, "detach", pid)
        assert code == 0 and " left: " not in err, err
        reader.join(timeout=10)
        assert not reader.is_alive()  # its stream was closed with the endpoint
        lines = len(log.read_text().splitlines())
        calls = nxl.read_stream(run)
        code, _, err = _cli(capsys, "detach", pid)
        assert code == 2 and "not attached" in err
        while len(log.read_text().splitlines()) < lines + 3:  # it goes on, unrecorded
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.2)
        go.with_suffix(".stop").touch()
        assert process.wait(timeout=60) == 0
    finally:
        _stop(process)
    ids = tiny.tokenizer("hello world how are you", return_tensors="pt")["input_ids"]
    tokens = tiny.model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)[0, ids.shape[1]:].tolist()
    printed = [line for line in log.read_text().splitlines() if line.startswith("[")]
    assert printed and all(line == str(tokens) for line in printed)  # outputs identical before, during, after
    assert len(nxl.read_stream(run)) == len(calls)  # nothing recorded after the detach
    complete = [call for call in calls if call.complete]
    assert len(complete) >= 3 and all(call.layers == [0, 2] for call in calls)
    for call in calls:  # one cut by the detach ends incomplete, with the steps it made
        assert [int(s.token[0]) for s in call.steps] == tokens[: len(call.steps)]
        if call.prompt_mask is None:  # cut before its prompt ran: in the stream all the same, saying why
            assert not call.complete and not call.steps and call.error
            continue
        assert call.prompt_ids.tolist() == ids.tolist()
    sequence = torch.cat([ids, torch.tensor([tokens])], dim=1)
    for step in complete[-1].steps:  # each step equal to the uncached oracle
        logits, embeddings = prefix_logits(tiny.model, tiny.hand, sequence[:, : step.position],
                                           torch.ones(1, step.position, dtype=torch.bool))
        torch.testing.assert_close(step.normxlogit, normxlogit(logits, embeddings, step.token)[1][[0, 2]],
                                   rtol=1e-4, atol=1e-4)


@needs_gdb
@pytest.mark.version_free
def test_an_interrupted_attach_wait_never_attaches_the_process_later(tiny, tmp_path):
    """Ctrl-C on nxl attach --wait once the process took the request: the command removes its run folder and
    exits 130, and the process, once it loads its model, does not attach after all (it did: hooks, endpoint and
    records, in the run folder made again 0755, and the next nxl attach was refused 'recorded already'), nor says
    anything of it (its answer, to the folder removed, was a traceback in the process's stderr)."""
    go, run, again = tmp_path / "go", tmp_path / "run", tmp_path / "again"
    private = tmp_path / "tmp"
    private.mkdir(mode=0o700)
    process = _start(tmp_path, _SCRIPT, str(tiny.path), str(go))
    try:
        pid = str(process.pid)
        attach = subprocess.Popen([sys.executable, "-m", "nxl_hooks", "attach", pid, "--wait", "120", "--sink",
                                   str(run)], env={**os.environ, "TMPDIR": str(private)}, stderr=subprocess.PIPE,
                                  text=True, preexec_fn=tiny_models.ctrl_c_reaches)
        deadline = time.monotonic() + 120
        while not list(private.glob("nxl-attach-*/request.json.taken")):  # the process took the request
            assert attach.poll() is None and time.monotonic() < deadline, attach.stderr.read()
            time.sleep(0.05)
        attach.send_signal(signal.SIGINT)
        assert attach.wait(timeout=60) == 130 and not run.exists()
        go.touch()  # the model loads now: the request's thread finds it
        code = subprocess.run([sys.executable, "-m", "nxl_hooks", "attach", pid, "--sink", str(again), "--wait", "90"],
                              capture_output=True, text=True, timeout=300)  # waits for that thread to end first
        assert code.returncode == 0 and "recorded (" in code.stderr, code.stderr
        assert not run.exists()
        done = subprocess.run([sys.executable, "-m", "nxl_hooks", "detach", pid], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
    finally:
        _stop(process)
    assert "Traceback" not in (tmp_path / "target.log").read_text()


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGTERM (its SigCgt mask in /proc)."""
    caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt"))
    return bool(int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


@needs_gdb
@pytest.mark.version_free
def test_sigterm_on_an_attached_process_removes_its_socket_as_under_nxl_run(tiny, tmp_path, capsys):
    """The endpoint starts in nxl attach's thread, where Python sets no signal handler: the injected script sets
    its SIGTERM handler from the main thread (the socket was left behind), and a detach gives the default back."""
    go, run = tmp_path / "go", tmp_path / "run"
    go.touch()
    process = _start(tmp_path, _SCRIPT, str(tiny.path), str(go))
    try:
        pid = str(process.pid)
        assert not _catches_sigterm(process.pid)
        code, _, err = _cli(capsys, "attach", pid, "--sink", str(run), "--wait", "90")
        assert code == 0, err
        assert _catches_sigterm(process.pid) and (run / f"{pid}.sock").exists()
        code, _, err = _cli(capsys, "detach", pid)
        assert code == 0, err
        deadline = time.monotonic() + 60
        while _catches_sigterm(process.pid):  # the detach's script runs in the main thread, as the attach's
            assert time.monotonic() < deadline
            time.sleep(0.1)
        code, _, err = _cli(capsys, "attach", pid, "--sink", str(run))
        assert code == 0 and (run / f"{pid}.sock").exists(), err
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == -signal.SIGTERM  # it dies of the signal, as without nxl
    finally:
        _stop(process)
    assert not (run / f"{pid}.sock").exists()


# -- refusals: one line, exit code 2, nothing injected ---------------------------------------------------------

_LOOP = "import sys, time\nprint('ready', flush=True)\nfor _ in range(1200):\n    time.sleep(0.05)\n"


def _refused(capsys, *args: str) -> str:
    code, out, err = _cli(capsys, *args)
    assert code == 2 and not out and len(err.splitlines()) == 1, (code, out, err)
    return err


_IMPORTED = "import transformers.modeling_utils\n" + _LOOP  # transformers imported, no model loaded yet


def _default_again(process: subprocess.Popen) -> None:
    """Wait for ``process`` to give SIGTERM its default action back (a call queued for its main thread)."""
    deadline = time.monotonic() + 30
    while _catches_sigterm(process.pid):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    assert process.poll() is None


@needs_gdb
@pytest.mark.version_free
def test_a_refused_attach_leaves_the_signal_handlers_as_they_were(tmp_path, capsys):
    """A refusal that needs no import is answered in the main thread before any handler is set; one made after
    nxl_hooks imported (no model loaded, at once or after --wait) queues the default's return for the main thread,
    which alone sets handlers."""
    process = _start(tmp_path, _LOOP)
    try:
        pid = str(process.pid)
        assert f"process {pid}: transformers is not imported: no model" in _refused(capsys, "attach", pid)
        assert not _catches_sigterm(process.pid)
        assert "loaded in this process yet (waited 1 s); try again once it is, or with a longer --wait" in _refused(
            capsys, "attach", pid, "--wait", "1")
        _default_again(process)
        assert f"process {pid}: not attached by nxl attach (nothing to detach)" in _refused(capsys, "detach", pid)
        assert process.poll() is None
    finally:
        _stop(process)
    folder = tmp_path / "imported"
    folder.mkdir()
    process = _start(folder, _IMPORTED)
    try:
        assert "no transformers model is loaded in this process yet" in _refused(capsys, "attach", str(process.pid))
        _default_again(process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == -signal.SIGTERM
    finally:
        _stop(process)
    for log in (tmp_path / "target.log", folder / "target.log"):
        assert "Traceback" not in log.read_text()


# Two attach requests in one process, as nxl attach's threads carry them out: #1 (--wait 1) finds no model and is
# refused while #2 waits on it; the program loads its model meanwhile, and #2 attaches. Prints what each answered and
# whether SIGTERM has nxl's handler once the main thread has run the calls the two queued.
_TWO_ATTACHES = """
import json, os, signal, sys, tempfile, threading, time
import transformers.modeling_utils
from transformers import LlamaConfig, LlamaForCausalLM
from nxl_hooks.apps.serve import remote

def die(signum, frame):  # the handler the attach's script sets in the main thread
    os._exit(3)
die.__nxl_attach__ = True
for signum in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, die)
run = tempfile.mkdtemp()
out = {}
first = threading.Thread(target=lambda: out.update({1: remote.handle({"action": "attach", "wait": 1,
                                                                       "env": {"NXL_RUN_DIR": run}})}))
second = threading.Thread(target=lambda: out.update({2: remote.handle({"action": "attach", "wait": 60,
                                                                        "env": {"NXL_RUN_DIR": run}})}))
first.start()
time.sleep(0.2)
second.start()
first.join()
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2))
second.join()
for _ in range(20):
    time.sleep(0.05)  # the main thread runs bytecode: the queued calls run here
marked = getattr(signal.getsignal(signal.SIGTERM), "__nxl_attach__", False)
print(json.dumps({"first": out[1]["code"], "second": out[2]["ok"], "marked": marked}), flush=True)
remote.handle({"action": "detach"})
"""


@pytest.mark.version_free
def test_an_attach_refused_beside_one_that_attaches_leaves_nxls_handler(tmp_path):
    """A refused attach gives the default action back through a call queued for the main thread; one that ran after
    the other request had attached took the handler from the attached process (its socket then stayed behind)."""
    done = subprocess.run([sys.executable, "-c", _TWO_ATTACHES], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said == {"first": "no-model", "second": True, "marked": True}, said

@pytest.mark.version_free
def test_refusals_before_anything_is_injected(tmp_path, capsys, monkeypatch):
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert f"no process {gone.pid}" in _refused(capsys, "attach", str(gone.pid))
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        assert "is not a Python process" in _refused(capsys, "attach", str(sleeper.pid))
    finally:
        _stop(sleeper)
    cases = [({"PYTHON_DISABLE_REMOTE_DEBUG": "1"}, None, "disabled remote debugging"),
             ({}, [sys.executable, "-X", "disable_remote_debug"], "disabled remote debugging"),
             ({"NXL_RUN_DIR": str(tmp_path)}, None, "runs under nxl run already")]
    if gdb_refusal() is None:  # (asked inside the target: through gdb)
        # no site and no PYTHONPATH: the target's interpreter cannot find nxl_hooks
        cases.append(({"PYTHONPATH": ""}, [sys.executable, "-S"], "-m pip install "))
    for n, (env, python, message) in enumerate(cases):
        folder = tmp_path / str(n)
        folder.mkdir()
        process = _start(folder, _LOOP, env=env, python=python)
        try:
            err = _refused(capsys, "attach", str(process.pid))
            assert message in err and process.poll() is None
            if "pip" in message:
                # what works: the checkout this nxl_hooks runs from (no index serves the name)
                assert f"{sys.executable} -m pip install {REPO}), then attach again" in err
        finally:
            _stop(process)
    process = _start(tmp_path, _LOOP)
    try:
        monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no gdb on PATH
        assert "apt-get install gdb" in _refused(capsys, "attach", str(process.pid))
        monkeypatch.undo()
        assert process.poll() is None
    finally:
        _stop(process)


@pytest.mark.version_free
def test_no_ptrace_capability_for_another_users_process_is_refused(tmp_path):
    if os.geteuid() != 0 or shutil.which("capsh") is None:
        pytest.skip("needs root and capsh to drop CAP_SYS_PTRACE")
    other = subprocess.Popen(["sleep", "60"], user=65534, group=65534)
    try:
        done = subprocess.run(["capsh", "--drop=cap_sys_ptrace", "--", "-c",
                               f"{sys.executable} -m nxl_hooks attach {other.pid}"],
                              capture_output=True, text=True, timeout=180)
    finally:
        _stop(other)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "lacks CAP_SYS_PTRACE" in done.stderr and "uid 65534" in done.stderr


@pytest.mark.version_free
def test_permission_rules_owner_or_root_and_ptrace_scope():
    assert "only its owner or root" in permission_refusal(7, 1000, euid=1001, ptrace_cap=False, scope=None)
    assert permission_refusal(7, 1000, euid=1000, ptrace_cap=False, scope=0) is None
    assert permission_refusal(7, 1000, euid=0, ptrace_cap=True, scope=1) is None
    assert "ptrace_scope is 1" in permission_refusal(7, 1000, euid=1000, ptrace_cap=False, scope=1)
    assert "ptrace_scope is 2" in permission_refusal(7, 1000, euid=0, ptrace_cap=False, scope=2)
    assert "ptrace_scope is 3" in permission_refusal(7, 1000, euid=0, ptrace_cap=True, scope=3)
    assert "CAP_SYS_PTRACE" in permission_refusal(7, 1000, euid=0, ptrace_cap=False, scope=None)


@pytest.mark.version_free
def test_python_314_goes_through_remote_exec_with_the_bootstrap_file(tmp_path):
    bootstrap = tmp_path / "bootstrap.py"
    target = Target(4242, 0, 0, "/usr/bin/python3.14", (3, 14), trusted=(1, 2))
    command = injector_command(target, bootstrap)
    assert target.route == "remote_exec" and not bootstrap.with_suffix(".gdb").exists()
    # the interpreter file the kernel resolved, isolated (never a venv's link, never the target's environment)
    assert command == ["/usr/bin/python3.14", "-I", "-S", "-c", f"import sys; sys.remote_exec(4242, {str(bootstrap)!r})"]
    older = Target(4242, 0, 0, "/usr/bin/python3.13", (3, 13), trusted=(1, 2))
    assert older.route == "gdb" and injector_command(older, bootstrap)[:3] == ["gdb", "-p", "4242"]
    # an interpreter this process may not run (another user's file): gdb, which runs nothing of it
    assert Target(4242, 1000, 1000, "/home/u/python3.14", (3, 14), trusted=None).route == "gdb"
    # the bootstrap never raises and leaves __main__ as it was, whatever its script does
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit(3)")
    probe = ("import __main__, pathlib; source = pathlib.Path(%r).read_text(); before = set(vars(__main__)); "
             "exec(compile(source, 'b', 'exec'), vars(__main__)); "
             "print(sorted(set(vars(__main__)) - before - {'before'}))")
    bootstrap.write_text(bootstrap_source(str(script)))
    done = subprocess.run([sys.executable, "-c", probe % str(bootstrap)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


_SPAWNS = textwrap.dedent("""
    import multiprocessing, time
    def idle():
        time.sleep(300)
    if __name__ == "__main__":
        context = multiprocessing.get_context("spawn")
        lock = context.Lock()  # (a semaphore: multiprocessing's resource tracker starts, another child)
        spawned = [context.Process(target=idle, daemon=True) for _ in range(2)]
        for each in spawned:
            each.start()
        print("ready", *(each.pid for each in spawned), flush=True)
        time.sleep(300)
""")


@pytest.mark.version_free
def test_the_model_processes_of_a_server_are_the_children_python_spawned(tmp_path):
    """What nxl attach follows from a server whose models run in processes of their own (transformers serve from
    5.25): the children of the process that multiprocessing spawned, as the kernel lists them, not the resource
    tracker it also starts, nor a process that is not a child."""
    process = _start(tmp_path, _SPAWNS)
    try:
        deadline = time.monotonic() + 60
        while len(line := (tmp_path / "target.log").read_text().split()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        spawned = sorted(int(pid) for pid in line[1:3])
        children = {child.pid for child in psutil.Process(process.pid).children()}
        assert set(spawned) < children  # the resource tracker is a child too
        assert inject.model_processes(process.pid) == spawned
        assert inject.model_processes(spawned[0]) == [] and inject.model_processes(os.getpid()) == []
    finally:
        _stop(process)


@pytest.mark.version_free
def test_a_pid_given_again_to_another_process_is_never_injected_into(tmp_path, monkeypatch):
    """The pid inspected may name another process by the time the injector runs (the target ended; a tracer of
    its owner's held nxl attach back meanwhile): the start time is checked again before each injector run, and
    the bootstrap itself runs its script only in the process with that pid, uid and start time."""
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *args, **kwargs: started.append(args) or pytest.fail("ran"))
    gone = Target(os.getpid(), os.getuid(), os.getgid(), sys.executable, (3, 11), None, started="1")
    with pytest.raises(CliError, match=f"process {os.getpid()} ended while nxl attach waited .* nothing was injected"):
        _queue(gone, tmp_path / "bootstrap.py", 5)
    assert started == []
    monkeypatch.undo()
    script, ran = tmp_path / "script.py", tmp_path / "ran"
    script.write_text(f"open({str(ran)!r}, 'a').write('ran')")
    runner = ("import os, sys; from nxl_hooks.apps.serve.inject import Target, _start_time, bootstrap_source; "
              "own = Target(os.getpid(), os.getuid(), os.getgid(), sys.executable, started=sys.argv[2] or "
              "_start_time(os.getpid())); exec(bootstrap_source(sys.argv[1], own))")
    for given in ("1", ""):  # another start time (another process with this pid), then its own
        done = subprocess.run([sys.executable, "-c", runner, str(script), given], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr
        assert ran.exists() == (given == ""), given


@pytest.mark.version_free
def test_nxl_attach_makes_its_folders_only_where_no_one_else_can_replace_them(tmp_path, monkeypatch):
    """A temporary folder others may write without a sticky bit (root's TMPDIR inherited from a user's shell)
    would let them swap the bootstrap gdb runs: /tmp is used then."""
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    monkeypatch.setattr(tempfile, "tempdir", str(open_to_all))
    assert _private_parent() == "/tmp"
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    assert _private_parent() == str(private)


@pytest.mark.version_free
def test_the_314_route_runs_exactly_the_checked_file_with_nothing_of_the_environment(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir(mode=0o755)
    tmp_path.chmod(0o755)
    stand_in, said = folder / "python3.14", tmp_path / "said"  # an "interpreter" that says how it was run
    stand_in.write_text(f'#!/bin/sh\necho "$@" > {said}\nenv >> {said}\n')
    stand_in.chmod(0o755)
    owners = frozenset({0, os.geteuid()})
    identity = trusted_file(str(stand_in), owners)
    assert identity is not None
    (tmp_path / "link").symlink_to(stand_in)
    (tmp_path / "open").mkdir()
    shutil.copy(stand_in, tmp_path / "open" / "python3.14")
    (tmp_path / "open").chmod(0o777)  # others could swap the file in it
    assert trusted_file(str(tmp_path / "link"), owners) is None
    assert trusted_file(str(tmp_path / "open" / "python3.14"), owners) is None
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the caller's environment does not reach it either
    monkeypatch.setenv("LD_PRELOAD", "nothing.so")
    target = Target(os.getpid(), os.getuid(), os.getgid(), str(stand_in), (3, 14), identity)
    _queue(target, tmp_path / "bootstrap.py", 5)
    args, *env = said.read_text().splitlines()
    assert args == f"-I -S -c import sys; sys.remote_exec({os.getpid()}, {str(tmp_path / 'bootstrap.py')!r})"
    assert not [line for line in env if line.startswith(("PYTHON", "LD_"))], env
    replacement = tmp_path / "other"
    replacement.write_text("#!/bin/sh\ntouch " + str(tmp_path / "ran") + "\n")
    replacement.chmod(0o755)
    replacement.rename(stand_in)  # the path now names another file than the one checked
    with pytest.raises(CliError, match="replaced since nxl attach checked it"):
        _queue(target, tmp_path / "bootstrap.py", 5)
    assert not (tmp_path / "ran").exists()


_STEPS_SINK = """
import json
from pathlib import Path


class StepsSink:  # a sink kind only the target's environment has: its step records' tokens, one line each
    def __init__(self, arg, **options):
        self.fh = Path(arg).open("a")

    def write_call(self, call, meta):
        pass

    def write_step(self, step):
        self.fh.write(json.dumps({"call": step.call, "token": step.token.tolist()}) + "\\n")
        self.fh.flush()

    def write_end(self, call):
        pass

    def close(self):
        self.fh.close()
"""


@needs_gdb
def test_a_sink_kind_installed_in_the_target_only_records_there(tiny, tmp_path, capsys):
    """nxl attach checked --sink KIND:ARG among the plugins of its own environment, so a kind installed in the
    target's alone was refused ("no sink kind"); the target makes the sink, and knows its kinds."""
    site = tmp_path / "site"
    (site / "steps_sink-1.0.dist-info").mkdir(parents=True)
    (site / "steps_sink.py").write_text(_STEPS_SINK)
    info = site / "steps_sink-1.0.dist-info"
    info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: steps-sink\nVersion: 1.0\n")
    info.joinpath("entry_points.txt").write_text("[nxl_hooks.sinks]\nsteps = steps_sink:StepsSink\n")
    go, out = tmp_path / "go", tmp_path / "steps.jsonl"
    go.touch()
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    process = _start(tmp_path, _SCRIPT, str(tiny.path), str(go), env=env)
    try:
        pid = str(process.pid)
        code, _, err = _cli(capsys, "attach", pid, "--sink", f"steps:{out}", "--wait", "90")
        assert code == 0, err
        deadline = time.monotonic() + 120
        while len(out.read_text().splitlines() if out.exists() else []) < 6:
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.2)
        code, _, err = _cli(capsys, "detach", pid)
        assert code == 0, err
        code, _, err = _cli(capsys, "attach", pid, "--sink", "nosuchkind:x")  # refused there, in one line
        assert code == 2 and "no sink kind 'nosuchkind'" in err and len(err.splitlines()) == 1, err
    finally:
        _stop(process)
    log = (tmp_path / "target.log").read_text().splitlines()
    emitted = {tuple(json.loads(line)) for line in log if line.startswith("[")}  # (and nxl's own lines)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    calls = {}
    for record in records:
        calls.setdefault(record["call"], []).append(record["token"][0])
    whole = [tuple(tokens) for tokens in calls.values() if len(tokens) == 3]
    assert whole and set(whole) <= emitted  # the tokens each recorded call generated, as the target printed them

_HIDDEN = ("import sys, time\nsys.modules['nxl_hooks'] = None\n"
           + _LOOP.replace("time.sleep", "print(_, flush=True); time.sleep"))


@needs_gdb
@pytest.mark.version_free
def test_an_injection_that_fails_inside_the_target_leaves_it_running(tmp_path, capsys):
    # nxl_hooks is found by the check (a fresh interpreter), but hidden inside the running process
    process = _start(tmp_path, _HIDDEN)
    try:
        err = _refused(capsys, "attach", str(process.pid), "--wait", "1")
        assert f"process {process.pid}: nxl_hooks is not importable there: install it there" in err
        seen = len((tmp_path / "target.log").read_text().splitlines())
        deadline = time.monotonic() + 60
        while len((tmp_path / "target.log").read_text().splitlines()) < seen + 5:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        _stop(process)


_BLOCKED = """
import threading, time
done = threading.Event()
threading.Timer(8.0, done.set).start()
print("ready", flush=True)
done.wait()  # the main thread runs no Python code until then
print("main thread back", flush=True)
"""


@needs_gdb
@pytest.mark.version_free
def test_a_request_the_main_thread_does_not_pick_up_is_withdrawn_and_never_runs(tmp_path, capsys):
    process = _start(tmp_path, _BLOCKED)
    try:
        err = _refused(capsys, "attach", str(process.pid), "--timeout", "2")
        assert "did not run the request within 2 s" in err and "withdrawn" in err
        assert process.wait(timeout=60) == 0  # the queued bootstrap ran once the main thread woke, and did nothing
    finally:
        _stop(process)
    assert (tmp_path / "target.log").read_text().splitlines() == ["ready", "main thread back"]


@pytest.mark.parametrize("answer", [{"ok": True, "status": "x"}, {"ok": True, "status": {"models": [{"name": 3}]}},
                                    {"ok": True}])
@pytest.mark.version_free
def test_an_answer_of_another_shape_is_one_line_and_the_run_folder_goes(tmp_path, capsys, monkeypatch, answer):
    """The answer comes from the target's side, which its user controls (their own nxl_hooks, or a result file
    written into the folder they were handed): one of another shape was a traceback (exit 1), the folder left."""
    from nxl_hooks.apps.serve import inject as injection

    monkeypatch.setattr(injection, "inspect_target", lambda pid: Target(pid, os.geteuid(), os.getegid(),
                                                                        sys.executable, (3, 11)))
    monkeypatch.setattr(injection, "inject", lambda *args, **kwargs: answer)
    run = tmp_path / "run"
    assert "answered the attach with a status of another shape" in _refused(capsys, "attach", "4242", "--sink",
                                                                            str(run))
    assert not run.exists()


@pytest.mark.parametrize("answer", [{"ok": True}, {"ok": True, "run_dir": "r", "patches": "2", "hooks": 0,
                                                    "threads": []}])
@pytest.mark.version_free
def test_a_detach_answer_of_another_shape_is_one_line(capsys, monkeypatch, answer):
    """The target's side's detach answer, read as attach's is: a missing key was 'nxl detach: error: 'hooks''."""
    from nxl_hooks.apps.serve import inject as injection

    monkeypatch.setattr(injection, "inspect_target", lambda pid: Target(pid, os.geteuid(), os.getegid(),
                                                                        sys.executable, (3, 11)))
    monkeypatch.setattr(injection, "inject", lambda *args, **kwargs: answer)
    assert "answered the detach with an outcome of another shape" in _refused(capsys, "detach", "4242")


@pytest.mark.parametrize("command", ["attach", "detach"])
@pytest.mark.version_free
def test_an_answer_nested_too_deep_is_one_line(tmp_path, capsys, monkeypatch, command):
    """The result file is written by the target's side, in a folder its user was handed: 200,000 '[' (a regular
    file under the 1 MiB read) was a RecursionError traceback out of root's nxl attach / nxl detach."""
    from nxl_hooks.apps.serve import inject as injection

    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(injection, "inspect_target", lambda pid: Target(pid, os.geteuid(), os.getegid(),
                                                                        sys.executable, (3, 11)))

    def answer_nested(target, bootstrap, patience):  # the target's side: answers, then claims the request
        (request,) = tmp.glob("nxl-attach-*/request.json")
        (request.parent / "request.json.result").write_text("[" * 200_000)
        request.rename(request.parent / "taken")

    monkeypatch.setattr(injection, "_queue", answer_nested)
    run = tmp_path / "run"
    err = _refused(capsys, command, str(os.getpid()), *(["--sink", str(run)] if command == "attach" else []))
    assert "the answer of the attached process could not be read (nested too deeply to read)" in err
    assert not run.exists()



@pytest.mark.version_free
def test_a_gdb_that_cannot_call_into_processes_is_found_out_on_a_child_not_the_target(tmp_path, monkeypatch, capsys):
    """Where gdb fails a call into a process half way (a kernel that refuses its register writes, as on some VMs),
    the process is left broken (its sleep raised OSError 514): nxl attach asks gdb to call into a child of its own
    first and refuses in one line with gdb's reason, the target untouched. gdb's reason is also what a failed
    injection says (the line after "Error in sourced command file:", not only that line)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    stand_in = folder / "gdb"  # answers as gdb did there, to the probe (-ex) and to the injection (-x FILE)
    stand_in.write_text("#!/bin/sh\necho '__GI___clock_nanosleep (clock_id=1) at clock_nanosleep.c:71'\n"
                        "echo 'NXL_PROBE'\necho '/tmp/x/bootstrap.gdb:3: Error in sourced command file:'\n"
                        "echo \"Couldn't write extended state status: Bad address.\"\n"
                        "echo '[Inferior 1 (process 4242) detached]'\n")
    stand_in.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    inject.gdb_refusal.cache_clear()
    process = _start(tmp_path, _LOOP)
    try:
        err = _refused(capsys, "attach", str(process.pid))
        assert "gdb cannot call a function in a process on this machine (" in err
        assert "Couldn't write extended state status: Bad address." in err and "start the program under nxl run" in err
        assert process.poll() is None
    finally:
        _stop(process)
        inject.gdb_refusal.cache_clear()  # (the real gdb is asked again)
    target = Target(os.getpid(), os.getuid(), os.getgid(), sys.executable, (3, 11), None)
    with pytest.raises(CliError) as refused:
        _queue(target, tmp_path / "bootstrap.py", 5)
    said = str(refused.value)
    assert "Couldn't write extended state status: Bad address." in said and "Error in sourced command" in said
    assert "clock_nanosleep" not in said and "nothing was injected" in said


def test_the_scripts_handler_dies_of_the_signal_while_the_endpoint_module_is_half_imported(monkeypatch):
    """The attach's script sets its SIGTERM handler in the main thread, and its worker thread then imports nxl_hooks:
    a signal while the endpoint module is in sys.modules but its handler not yet defined raised AttributeError into
    the target's main thread; it dies of the signal as without nxl (the default action)."""
    import ast
    import types

    source = inject.script_source(str(Path("/nonexistent") / "request"))
    (die,) = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == "die"]
    kills, handlers, space = [], [], {}
    fake_os = types.SimpleNamespace(kill=lambda pid, signum: kills.append((pid, signum)), getpid=os.getpid)
    fake_signal = types.SimpleNamespace(signal=lambda signum, action: handlers.append((signum, action)),
                                        SIG_DFL=signal.SIG_DFL)
    exec(compile(ast.Module([die], type_ignores=[]), "<script>", "exec"), {"os": fake_os, "signal": fake_signal,
                                                                            "sys": sys}, space)
    half = types.ModuleType("nxl_hooks.apps.serve.endpoint")  # imported so far: no _die yet
    monkeypatch.setitem(sys.modules, "nxl_hooks.apps.serve.endpoint", half)
    space["die"](signal.SIGTERM, None)
    assert handlers == [(signal.SIGTERM, signal.SIG_DFL)] and kills == [(os.getpid(), signal.SIGTERM)]
    half._die = lambda signum, frame: kills.append(("endpoint", signum))  # once defined, the endpoint's own
    space["die"](signal.SIGHUP, None)
    assert kills[-1] == ("endpoint", signal.SIGHUP) and len(handlers) == 1
