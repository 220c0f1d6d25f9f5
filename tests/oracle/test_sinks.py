"""Record sinks: the RecordSink protocol, the registry (in-process and through an entry point), the Parquet
exporter (live and ``nxl export``), records read back complete (texts and probabilities), and sink faults.
Parquet values are checked against the stream's records and against the uncached oracle of tests/oracle.py."""

from __future__ import annotations

import errno
import json
import os
import re
import logging
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

import nxl_hooks as nxl
from nxl_hooks.apps.cli import main as cli_main
from nxl_hooks.records import sinks
import tiny
import oracle
from oracle import check_call
from forks import Programs
from serving import save_chat_model

pq = pytest.importorskip("pyarrow.parquet")

PROMPTS = ["hello world how are you", "the w3 is a"]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    path = save_chat_model(tmp_path_factory.mktemp("sinks") / "tiny")
    model = LlamaForCausalLM.from_pretrained(path).eval()
    model.generation_config.eos_token_id = None  # every row runs max_new_tokens
    return path, model, AutoTokenizer.from_pretrained(path)


def _generate(model, tokenizer, sink, *, layers="all", new=4, prompts=PROMPTS):
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with nxl.attach(model, layers=layers, tokenizer=tokenizer, sink=sink) as probe:
        model.generate(**enc, max_new_tokens=new, do_sample=False)
    return probe


def _table(path) -> dict[str, list]:
    return pq.read_table(path).to_pydict()


def _from_rows(columns: dict[str, list], call, layers) -> nxl.GenerationCall:
    """A GenerationCall rebuilt from Parquet rows alone (no record object), for the oracle."""
    rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
    batch, prompt_len = call.prompt_mask.shape
    steps = []
    for index in sorted({r["step"] for r in rows}):
        mine = [r for r in rows if r["step"] == index]
        n = mine[0]["emitted_position"]
        shape = (len(layers), batch, n)
        score, logat = torch.zeros(shape), torch.zeros(shape)
        embed, mask = torch.zeros(batch, n), torch.zeros(batch, n, dtype=torch.bool)
        token = torch.zeros(batch, dtype=torch.long)
        for r in mine:
            at = (layers.index(r["layer"]), r["row"], r["position"])
            score[at], logat[at] = r["normxlogit"], r["logat"]
            embed[r["row"], r["position"]], mask[r["row"], r["position"]] = r["embed_norm"], True
            token[r["row"]] = r["emitted_id"]
        steps.append(nxl.Step(call=0, step=index, position=n, token=token, target=token.clone(), normxlogit=score,
                              logat=logat, embed_norm=embed, mask=mask, active=torch.ones(batch, dtype=torch.bool),
                              layers=layers))
    ids = torch.zeros(batch, prompt_len + len(steps), dtype=torch.long)
    for r in rows:  # every context token the rows name, prompt and generated
        ids[r["row"], r["position"]] = r["token_id"] if r["token_id"] is not None else 0
    for step in steps:
        ids[:, step.position] = step.token
    return nxl.GenerationCall(index=0, layers=layers, prompt_ids=ids[:, :prompt_len], prompt_mask=call.prompt_mask,
                              steps=steps, sequences=ids, complete=True)


def test_parquet_live_and_exported_rows_equal_the_stream_records_and_the_oracle(chat, tmp_path, monkeypatch):
    from nxl_hooks.hooks import generate

    # each call's steps scored together at its end, in both calls alike (a step of a loaded machine that waits past
    # BATCH_SECONDS is scored apart, and a matmul of another shape may differ in the last place)
    monkeypatch.setattr(generate, "BATCH_SECONDS", None)
    path, model, tokenizer = chat
    live = _generate(model, tokenizer, f"parquet:{tmp_path / 'live.parquet'}", layers=[0, 1, -1])
    assert live.sink_fault is None and not (tmp_path / "live.parquet.partial").exists()
    stream = _generate(model, tokenizer, tmp_path / "run.nxl", layers=[0, 1, -1])
    (call,) = nxl.read_stream(tmp_path / "run.nxl")
    code = cli_main(["export", str(tmp_path / "run.nxl"), str(tmp_path / "export.parquet")])
    assert code == 0
    columns, exported = _table(tmp_path / "live.parquet"), _table(tmp_path / "export.parquet")
    assert {k: v for k, v in columns.items() if k not in ("request_id", "time")} == \
        {k: v for k, v in exported.items() if k not in ("request_id", "time")}  # one format, live and exported
    # every row is the stream's record at that place, and every real position of every step has its row
    mask_total = sum(int(s.mask.sum()) * len(s.layers) for s in call.steps)
    assert len(columns["row"]) == mask_total
    texts = [row + [s.readable[b] for s in call.steps] for b, row in enumerate(call.readable)]
    ids = torch.cat([call.prompt_ids, torch.stack([s.token for s in call.steps], 1)], 1)
    for i in range(0, len(columns["row"]), 7):
        r = {k: v[i] for k, v in columns.items()}
        step = call.steps[r["step"]]
        at = (step.layers.index(r["layer"]), r["row"], r["position"])
        assert r["normxlogit"] == pytest.approx(float(step.normxlogit[at]), rel=1e-6)
        assert r["logat"] == pytest.approx(float(step.logat[at]), rel=1e-6)
        assert r["embed_norm"] == pytest.approx(float(step.embed_norm[r["row"], r["position"]]), rel=1e-6)
        assert r["probability"] == pytest.approx(float(step.probability[r["row"]]), rel=1e-6)
        assert r["token_id"] == int(ids[r["row"], r["position"]])
        assert r["token_text"] == texts[r["row"]][r["position"]]
        assert r["emitted_text"] == r["target_text"] == step.readable[r["row"]]
        assert r["request_id"] == live.calls[0].request_id
    assert columns["token_text"][0] in ("<pad>", "hello") and "hello" in columns["token_text"]
    # the oracle, from the Parquet rows alone: each step's scores and the emitted tokens
    check_call(model, _from_rows(columns, stream.calls[0], [0, 1, 2]), 4)


def test_fixed_targets_are_named_by_the_tokenizers_text_in_memory_on_disk_in_parquet_and_in_views(tmp_path):
    """attach(target=[a, b]) around generate: a fixed target the context does not hold was named '#ID' (step views,
    the repr, the generation page) and had no text in to_attribution() or Parquet's target_text, though the probe had
    the tokenizer. The call records each target's text once (read back from its stream file): the oracle is the
    tokenizer's own decode of the id, its leading space shown '␣'."""
    import bpe_tiny
    from nxl_hooks.records.html import generation_html

    tok = bpe_tiny.bpe_tokenizer()
    model = bpe_tiny.bpe_llama(tok)
    enc = tok("The capital of Italy is", return_tensors="pt")
    targets = [tok(word, add_special_tokens=False)["input_ids"] for word in (" Paris", " London")]
    assert all(len(ids) == 1 for ids in targets)  # one token each
    targets = [ids[0] for ids in targets]
    assert not set(targets) & set(enc["input_ids"][0].tolist())  # the context does not name them
    decoded = [tok.decode([i]) for i in targets]
    assert all(text.startswith(" ") and text[1:].isalpha() for text in decoded)
    expected = ["␣" + text[1:] for text in decoded]
    with torch.no_grad(), nxl.attach(model, layers=[-1], tokenizer=tok, target=targets,
                                     sink=tmp_path / "run.nxl") as probe:
        model.generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=0)
    (back,) = nxl.read_stream(tmp_path / "run.nxl", strict=True)
    named = 0
    for call in (probe.calls[-1], back):
        page = generation_html(call)
        for step in call.steps:
            assert step.to_attribution().target_text == [expected]
            for label, (target, text) in enumerate(zip(targets, expected)):
                if int(step.token[0]) != target:  # the view names the target where it is not the token
                    named += 1
                    assert step.view(call, label=label).target == text
            if int(step.token[0]) != targets[0]:
                assert f"explaining target '{expected[0]}' (id {targets[0]}" in repr(step)
                assert f" · explains {expected[0]}" in page
        assert call.target_texts == dict(zip(targets, expected))  # recorded once, with the call
    assert named
    assert cli_main(["export", str(tmp_path / "run.nxl"), str(tmp_path / "run.parquet")]) == 0
    columns = _table(tmp_path / "run.parquet")
    assert columns["target_id"] and all(
        (target, text) == (targets[index], expected[index])
        for target, text, index in zip(columns["target_id"], columns["target_text"], columns["target_index"]))


def test_parquet_token_ids_the_records_do_not_hold_are_null_not_minus_one(chat, tmp_path):
    """A prompt given as inputs_embeds has no token ids: its rows' token_id was -1, an id no tokenizer has, which a
    join or a count took for a token; it is null now, like its token_text."""
    _, model, tokenizer = chat
    tokenizer.padding_side = "left"
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    embeds = model.get_input_embeddings()(enc.input_ids).detach()
    with nxl.attach(model, layers=[-1], tokenizer=tokenizer, sink=f"parquet:{tmp_path / 'live.parquet'}"):
        out = model.generate(inputs_embeds=embeds, attention_mask=enc.attention_mask, max_new_tokens=3,
                             do_sample=False)
    columns = _table(tmp_path / "live.parquet")
    prompt_len = enc.input_ids.shape[1]
    rows = list(zip(columns["row"], columns["position"], columns["token_id"], columns["token_text"]))
    assert rows and all(token_id is None and text is None for _, position, token_id, text in rows
                        if position < prompt_len)
    generated = [(r, p, i) for r, p, i, _ in rows if p >= prompt_len]
    assert generated and all(i == int(out[r, p - prompt_len]) for r, p, i in generated)  # generate's own tokens


def test_a_model_folder_or_request_id_that_is_not_utf8_is_recorded_and_exported_named_as_its_bytes(
        chat, tmp_path, monkeypatch):
    """A model loaded from a folder whose name is not UTF-8 (Latin-1 'café', which Python names 'caf\\udce9') and
    a request id holding such a byte: Parquet refuses lone surrogates, so the live sink lost every row and
    ``nxl export`` of the stream failed. Records name them as Python prints the bytes ('caf\\xe9'), and a stream an
    earlier writer wrote with the name as Python held it reads and exports so too."""
    from nxl_hooks.hooks.generate import REQUEST_ID
    from nxl_hooks.records.writer import stream_bytes

    path, model, tokenizer = chat
    folder = os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9")  # what os.listdir() and sys.argv give
    shown = str(os.fsencode(folder))[2:-1]  # how Python prints its bytes: .../caf\xe9
    monkeypatch.setattr(model, "name_or_path", folder)
    token = REQUEST_ID.set("req-\udcff")
    try:
        live = _generate(model, tokenizer, f"parquet:{tmp_path / 'live.parquet'}", new=2)
        _generate(model, tokenizer, tmp_path / "run.nxl", new=2)
    finally:
        REQUEST_ID.reset(token)
    assert live.sink_fault is None and live.unwritten == 0
    assert (live.calls[0].model, live.calls[0].request_id) == (shown, "req-\\xff")
    (call,) = nxl.read_stream(tmp_path / "run.nxl", strict=True)
    call.model, call.request_id = folder, "req-\udcff"  # as nxl_hooks 0.4 before this fix wrote them
    (tmp_path / "old.nxl").write_bytes(stream_bytes(call, {}))
    assert nxl.read_stream(tmp_path / "old.nxl")[0].model == shown
    for stream in ("run", "old"):
        assert cli_main(["export", str(tmp_path / f"{stream}.nxl"), str(tmp_path / f"{stream}.parquet")]) == 0
    for name in ("live", "run", "old"):
        columns = _table(tmp_path / f"{name}.parquet")
        assert len(columns["row"]) > 0 and set(columns["model"]) == {shown}, name
        assert set(columns["request_id"]) == {"req-\\xff"}, name


class _ListSink:
    """A sink written in a test file: keeps every record it gets."""

    made: list["_ListSink"] = []

    def __init__(self, arg: str, **options) -> None:
        self.arg, self.options, self.records = arg, options, []
        _ListSink.made.append(self)

    def write_call(self, call, meta):
        self.records.append(("call", call.index, sorted(meta)))

    def write_step(self, step):
        self.records.append(("step", step.call, step.step, step.normxlogit.clone()))

    def write_end(self, call):
        self.records.append(("end", call.index, call.complete))

    def close(self):
        self.records.append(("close",))


def test_a_sink_kind_registered_in_a_test_file_is_used_by_attach(chat):
    _, model, tokenizer = chat
    nxl.register_sink("listsink", _ListSink)
    probe = _generate(model, tokenizer, "listsink:somewhere", layers="last", new=3, prompts=PROMPTS[:1])
    (sink,) = [s for s in _ListSink.made if s.arg == "somewhere"]
    kinds = [r[0] for r in sink.records]
    assert kinds == ["call", "step", "step", "step", "end", "close"]
    assert sink.records[-2] == ("end", 0, True)
    for record, step in zip(sink.records[1:4], probe.steps, strict=True):
        assert record[2] == step.step and torch.equal(record[3], step.normxlogit)
    assert isinstance(sink, nxl.RecordSink)
    assert nxl.make_sink(sink) is sink


def test_a_built_in_sink_kind_cannot_be_replaced_and_other_names_can(chat, tmp_path):
    """register_sink refuses every built-in kind in one line naming what to do: ``file:`` (the crash-safe stream,
    readable after a SIGKILL) stays the built-in sink for every later spec. A name of one's own registers; registered
    again, the last registration wins."""
    _, model, tokenizer = chat
    for kind in sinks.builtin_kinds():
        with pytest.raises(ValueError) as refused:
            nxl.register_sink(kind, _ListSink)
        assert str(refused.value) == (f"sink kind '{kind}' is built in and cannot be replaced: register the factory "
                                      f"under another name (e.g. 'my-{kind}') and write that name in the sink spec")
    made = len(_ListSink.made)
    probe = _generate(model, tokenizer, f"file:{tmp_path / 'run.nxl'}", layers="last", new=3, prompts=PROMPTS[:1])
    assert len(_ListSink.made) == made  # the refused factory was never called
    (call,) = nxl.read_stream(tmp_path / "run.nxl", strict=True)
    assert [s.token.tolist() for s in call.steps] == [s.token.tolist() for s in probe.calls[0].steps]
    nxl.register_sink("my-file", lambda arg, **options: pytest.fail("replaced by the later registration"))
    nxl.register_sink("my-file", _ListSink)
    _generate(model, tokenizer, "my-file:mine", layers="last", new=3, prompts=PROMPTS[:1])
    (mine,) = [s for s in _ListSink.made[made:] if s.arg == "mine"]
    assert [r[0] for r in mine.records] == ["call", "step", "step", "step", "end", "close"]


def test_sink_specs_name_what_is_wrong(chat, tmp_path):
    _, model, _ = chat
    with pytest.raises(ValueError, match="no sink kind 'nosuchkind' is registered"):
        nxl.attach(model, sink="nosuchkind:x")
    with pytest.raises(ValueError, match="write_call, write_step, write_end and close"):
        nxl.attach(model, sink=42)
    with pytest.raises(ValueError, match="starting with a letter"):
        nxl.register_sink("1x", _ListSink)
    assert not list(tmp_path.iterdir())  # refused before any file was made
    assert isinstance(nxl.make_sink(tmp_path / "a.nxl"), nxl.Sink)
    folder = nxl.make_sink(f"{tmp_path}/rot/", max_bytes=1000)
    assert isinstance(folder, nxl.RotatingSink) and folder.max_bytes == 1000
    folder.close()
    (tmp_path / "x:y").mkdir()
    assert isinstance(nxl.make_sink(str(tmp_path / "x:y")), nxl.RotatingSink)  # a path with a colon stays a path


def test_a_sink_factory_that_exits_is_refused_in_one_line_and_the_host_goes_on(chat):
    """A sink kind whose factory calls sys.exit: attach is refused with a ValueError in one line naming it (the
    SystemExit reached the host and ended it), no hook is left on; a Ctrl-C inside a factory stays the user's."""
    _, model, _ = chat

    def exits(arg, **options):
        raise SystemExit(f"cannot open {arg}\nbye")

    def interrupted(arg, **options):
        raise KeyboardInterrupt

    nxl.register_sink("exitsink", exits)
    nxl.register_sink("ctrlcsink", interrupted)
    with pytest.raises(ValueError) as refused:
        nxl.attach(model, sink="exitsink:x")
    assert str(refused.value) == ("sink 'exitsink:x': its factory raised SystemExit (cannot open x bye) instead of "
                                  "returning a sink: fix or uninstall the package of that sink kind, or give another "
                                  "sink")
    assert nxl.detach_all(model) == 0
    with pytest.raises(KeyboardInterrupt):
        nxl.attach(model, sink="ctrlcsink:x")
    assert nxl.detach_all(model) == 0


class _Partial:
    """A sink written with two of its four methods."""

    def __init__(self, arg, **options):
        self.arg = arg

    def write_call(self, call, meta):
        pass

    def close(self):
        pass


def test_a_sink_factory_of_another_signature_or_a_sink_lacking_methods_is_refused_naming_what_to_fix(chat):
    """A factory that takes no ARG raised its own ``TypeError: no_arg() takes 0 positional arguments but 1 was
    given``, naming neither the sink nor what a factory takes; a sink lacking two methods was said to lack
    "write_call, write_step, write_end or close"."""
    _, model, _ = chat
    plain = model.generate(input_ids=torch.tensor([[5, 9, 12]]), max_new_tokens=2, do_sample=False)

    def no_arg():
        return _Partial("x")

    nxl.register_sink("noargsink", no_arg)
    nxl.register_sink("partialsink", _Partial)
    with pytest.raises(ValueError) as no_arg_refused:
        nxl.attach(model, sink="noargsink:x")
    with pytest.raises(ValueError) as partial_refused:
        nxl.attach(model, sink="partialsink:x")
    assert nxl.detach_all(model) == 0
    assert torch.equal(model.generate(input_ids=torch.tensor([[5, 9, 12]]), max_new_tokens=2, do_sample=False), plain)
    told = str(no_arg_refused.value)
    assert told.startswith("sink 'noargsink:x': its factory test_a_sink_factory_of_another_signature_or_a_sink_"
                           "lacking_methods_is_refused_naming_what_to_fix.<locals>.no_arg cannot be called as "
                           "factory(ARG, **options) (too many positional arguments)") and "\n" not in told
    assert str(partial_refused.value) == (
        "sink 'partialsink:x': its factory returned _Partial, which lacks write_step, write_end: a sink has "
        "write_call, write_step, write_end and close (nxl.RecordSink); fix the package of that sink kind, or give "
        "another sink")
    # a factory taking every option is called with any, one named as the signature check's parameter too (then its
    # sink is refused for what it lacks)
    with pytest.raises(ValueError, match="its factory returned _Partial, which lacks write_step"):
        nxl.make_sink("partialsink:y", function="f")


class _NoStepArgument(_Partial):
    """A sink whose ``write_step`` takes no step, and whose ``close`` takes an argument."""

    def write_step(self):
        pass

    def write_end(self, call):
        pass


class _CloseTakesOne(_NoStepArgument):
    def write_step(self, step):
        pass

    def close(self, how):
        pass


def test_a_sink_whose_method_cannot_be_called_as_the_probe_calls_it_is_refused_naming_the_method(chat):
    """A sink whose ``write_step(self)`` took no step was attached, then every record failed in the sink's thread
    (``TypeError: ...write_step() takes 1 positional argument but 2 were given``) and was lost; a sink object given
    as it is, the same. Both are refused at attach, in one line naming the method and how the probe calls it."""
    _, model, _ = chat
    plain = model.generate(input_ids=torch.tensor([[5, 9, 12]]), max_new_tokens=2, do_sample=False)
    nxl.register_sink("nostepsink", _NoStepArgument)
    with pytest.raises(ValueError) as made:
        nxl.attach(model, sink="nostepsink:x")
    with pytest.raises(ValueError) as given:
        nxl.attach(model, sink=_CloseTakesOne("x"))
    assert nxl.detach_all(model) == 0
    assert torch.equal(model.generate(input_ids=torch.tensor([[5, 9, 12]]), max_new_tokens=2, do_sample=False), plain)
    assert str(made.value) == (
        "sink 'nostepsink:x': its write_step cannot be called as write_step(step) (too many positional arguments), as "
        "the probe calls it (nxl.RecordSink); fix the package of that sink kind, or give another sink")
    told = str(given.value)
    assert "its close cannot be called as close() (missing a required argument: 'how')" in told and "\n" not in told


class _UnprintableExit(SystemExit):
    """A factory's exit whose message cannot be made: its ``__str__`` raises."""

    def __str__(self) -> str:
        raise ValueError("no text")


@pytest.mark.parametrize("error, told", [
    (_UnprintableExit(), "_UnprintableExit (<unprintable _UnprintableExit>)"),  # it raised ValueError('no text')
    (SystemExit(), "SystemExit"),  # a bare sys.exit(): it read 'SystemExit (SystemExit)', the type as the message
], ids=["unprintable", "no-message"])
def test_a_sink_factory_whose_exit_cannot_be_printed_or_has_no_message_is_refused_in_one_line(chat, error, told):
    """The refusal says ``<unprintable TYPE>`` for an exit's message that cannot be made, the type alone for none,
    into the user's attach."""
    _, model, _ = chat

    def exits(arg, **options):
        raise error

    nxl.register_sink("exitingsink", exits)
    with pytest.raises(ValueError) as refused:
        nxl.attach(model, sink="exitingsink:x")
    assert str(refused.value).startswith(f"sink 'exitingsink:x': its factory raised {told} instead of returning a sink")
    assert nxl.detach_all(model) == 0


_PLUGIN = '''
import json
from pathlib import Path


class JsonLinesSink:
    """A third party's sink: one JSON line per record."""

    def __init__(self, arg, **options):
        self.path = Path(arg)
        self.fh = self.path.open("a")

    def write_call(self, call, meta):
        self.fh.write(json.dumps({"kind": "call", "call": call.index, "prompt": call.prompt_ids.tolist()}) + "\\n")

    def write_step(self, step):
        self.fh.write(json.dumps({"kind": "step", "call": step.call, "step": step.step,
                                  "token": step.token.tolist(), "score": step.normxlogit.tolist()}) + "\\n")
        self.fh.flush()

    def write_end(self, call):
        self.fh.write(json.dumps({"kind": "end", "call": call.index, "complete": call.complete}) + "\\n")

    def close(self):
        self.fh.close()
'''

_APP = '''
import sys, torch
from transformers import LlamaForCausalLM
model = LlamaForCausalLM.from_pretrained(sys.argv[1]).eval()
out = model.generate(input_ids=torch.tensor([[1, 64, 67, 68]]), max_new_tokens=3, do_sample=False)
print("OUT", out[0].tolist())
'''


def test_a_sink_kind_from_an_installed_entry_point_is_used_by_nxl_run(chat, tmp_path):
    path, model, _ = chat
    site = tmp_path / "site"
    (site / "jsonl_sink_plugin-1.0.dist-info").mkdir(parents=True)
    (site / "jsonl_sink_plugin.py").write_text(_PLUGIN)
    (site / "jsonl_sink_plugin-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: jsonl-sink-plugin\nVersion: 1.0\n")
    (site / "jsonl_sink_plugin-1.0.dist-info" / "entry_points.txt").write_text(
        "[nxl_hooks.sinks]\njsonl = jsonl_sink_plugin:JsonLinesSink\n")
    (tmp_path / "app.py").write_text(_APP)
    out = tmp_path / "records-{model}.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "nxl_hooks", "run", "--sink", f"jsonl:{out}", "--layers", "all",
                           "--", sys.executable, str(tmp_path / "app.py"), str(path)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    (written,) = tmp_path.glob("records-*-tiny.jsonl")  # {model}: the process's model folder name
    records = [json.loads(line) for line in written.read_text().splitlines()]
    assert [r["kind"] for r in records] == ["call", "step", "step", "step", "end"]
    assert records[-1]["complete"] is True
    emitted = json.loads(done.stdout.split("OUT ", 1)[1])
    assert [r["token"][0] for r in records[1:4]] == emitted[4:]
    with nxl.attach(model, layers="all") as probe:  # the same request in this process
        model.generate(input_ids=torch.tensor([[1, 64, 67, 68]]), max_new_tokens=3, do_sample=False)
    for record, step in zip(records[1:4], probe.steps, strict=True):
        torch.testing.assert_close(torch.tensor(record["score"]), step.normxlogit, rtol=1e-5, atol=1e-6)
    refused = subprocess.run([sys.executable, "-m", "nxl_hooks", "run", "--sink", "nokind:x", "--", "true"],
                             capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "no sink kind 'nokind'" in refused.stderr


def test_records_read_back_equal_the_live_ones_field_by_field_with_texts(chat, tmp_path):
    _, model, tokenizer = chat
    probe = _generate(model, tokenizer, tmp_path / "run.nxl", new=3)
    (disk,) = nxl.read_stream(tmp_path / "run.nxl")
    live = probe.calls[0]
    assert disk.readable == live.readable and disk.request_id == live.request_id
    for a, b in zip(live.steps, disk.steps, strict=True):
        assert (a.call, a.step, a.position, a.layers, a.n_blocks) == (b.call, b.step, b.position, b.layers, b.n_blocks)
        for name in ("token", "target", "normxlogit", "logat", "embed_norm", "mask", "active", "probability"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.readable == b.readable and a.readable is not None
        assert a.to_attribution().top(3) == b.to_attribution().top(3)
    step = disk.steps[-1]
    texts = tokenizer.convert_ids_to_tokens(torch.cat([live.prompt_ids[0], torch.stack(
        [s.token[0] for s in live.steps[:-1]])]).tolist())
    for position, text, score in step.to_attribution().top(3):
        assert text == texts[position] and score == pytest.approx(float(step.normxlogit[-1, 0, position]))


def test_a_step_whose_token_texts_cannot_be_made_is_written_without_them_and_read_back_whole(chat, tmp_path):
    """A tokenizer that cannot decode one generated id (a tiktoken-style one raising KeyError): that step's record
    was lost, a gap that read_stream took for damage, dropping every later step and the call's end (nxl export
    --strict refused the file). It is written without its texts, every step read back equals the oracle, and the
    call's note is in the file."""
    path, model, _ = chat
    tokenizer = AutoTokenizer.from_pretrained(path)  # (its own: the texts of its ids are not known yet)
    enc = tokenizer(PROMPTS[:1], return_tensors="pt")
    bad = int(model.generate(**enc, max_new_tokens=2, do_sample=False)[0, -1])  # the second generated id

    class Picky(type(tokenizer)):
        def batch_decode(self, sequences, **kwargs):
            if any(bad in ids for ids in sequences):
                raise KeyError(bad)
            return super().batch_decode(sequences, **kwargs)

    tokenizer.__class__ = Picky
    with nxl.attach(model, layers="all", tokenizer=tokenizer, sink=tmp_path / "run.nxl"):
        model.generate(**enc, max_new_tokens=4, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a file read as damaged warns
        (disk,) = nxl.read_stream(tmp_path / "run.nxl")
    check_call(model, disk, 4)
    assert [step.readable is None for step in disk.steps] == [False, True, False, False]
    assert disk.notes == [f"the token texts of step 1 could not be made (KeyError: {bad})"]


class _FullDisk(_ListSink):
    def write_step(self, step):
        if step.step == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        super().write_step(step)


def test_a_full_sink_sets_sink_fault_and_notes_each_call_it_affects(chat, tmp_path):
    _, model, tokenizer = chat
    nxl.register_sink("fulldisk", _FullDisk)
    enc = tokenizer(PROMPTS[:1], return_tensors="pt")
    with nxl.attach(model, tokenizer=tokenizer, sink="fulldisk:x") as probe:
        model.generate(**enc, max_new_tokens=3, do_sample=False)
        model.generate(**enc, max_new_tokens=2, do_sample=False)
    # the sink thread met the fault while the calls ran on: known for sure once the probe detached
    assert probe.sink_fault == "OSError: [Errno 28] No space left on device"
    assert probe.unwritten == 4  # step 2 of the first call and both steps of the second (step 1 raised)
    first, second = probe.calls
    assert len(first.steps) == 3 and first.complete  # the host's call and its records in memory are unharmed
    assert first.notes == second.notes == ["not written to the sink, which stopped: OSError: [Errno 28] No space "
                                           "left on device"]
    (sink,) = [s for s in _ListSink.made if isinstance(s, _FullDisk)]
    assert [r[0] for r in sink.records] == ["call", "step", "close"]  # nothing after the fault; its file released


class _LostUnreadable(_FullDisk):
    """Fails at step 1, and its ``lost`` is a property over the handle that failed: it raises when read."""

    @property
    def lost(self):
        raise RuntimeError("handle closed")

    def close(self):
        raise OSError(errno.EIO, "Input/output error")


def test_a_sink_whose_lost_cannot_be_read_counts_none_lost_and_never_raises_into_the_host(chat, monkeypatch,
                                                                                         caplog):
    """The optional ``lost`` is the sink's code: one that raises when read neither kills the sink thread (the
    frames after the fault are still counted) nor, with no call seen, raises out of the probe's detach."""
    _, model, tokenizer = chat
    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    enc = tokenizer(PROMPTS[:1], return_tensors="pt")
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        with nxl.attach(model, tokenizer=tokenizer, sink=_LostUnreadable("x")) as probe:
            model.generate(**enc, max_new_tokens=3, do_sample=False)
            model.generate(**enc, max_new_tokens=3, do_sample=False)
        assert probe.unwritten == 5  # of the 6 step records only step 0 of the first call was written
        assert probe.sink_fault == "OSError: [Errno 28] No space left on device"
        with nxl.attach(model, sink=_LostUnreadable("y")) as idle:  # no call: the close fails in this thread
            pass
    assert died == [] and idle.sink_fault == "OSError: [Errno 5] Input/output error" and idle.unwritten == 0
    assert any("count of lost records could not be read (RuntimeError: handle closed)" in r.getMessage()
               for r in caplog.records)


class _BatchingUnreadable(_ListSink):
    """Takes runs of steps, but its ``write_steps`` is a property that raises when read (a wrapper over a handle)."""

    @property
    def write_steps(self):
        raise RuntimeError("handle not open yet")


def test_a_sink_whose_write_steps_cannot_be_read_gets_its_steps_one_by_one(chat, monkeypatch):
    """Whether a sink takes runs of steps is the sink's code: Python 3.11's isinstance reads the attribute, and one
    that raised killed the sink thread there, every frame after it lost without a word."""
    _, model, tokenizer = chat
    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    enc = tokenizer(PROMPTS[:1], return_tensors="pt")
    sink = _BatchingUnreadable("x")
    with nxl.attach(model, tokenizer=tokenizer, sink=sink) as probe:
        model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert died == [] and probe.sink_fault is None and probe.unwritten == 0
    assert [r[0] for r in sink.records] == ["call", "step", "step", "step", "end", "close"]


class _Unprintable(Exception):
    def __str__(self):
        raise ValueError("cannot render")


class _UnprintableSink(_ListSink):
    """Fails at its first record with an exception whose message cannot be rendered (its ``__str__`` raises)."""

    def write_call(self, call, meta):
        raise _Unprintable()


class _UnprintableFault(_ListSink):
    """Stops by itself at its first record, its ``fault`` an object whose ``str()`` raises."""

    fault = None

    def write_call(self, call, meta):
        self.fault = _Unprintable()


def test_a_sink_error_whose_message_cannot_be_rendered_is_a_sink_fault_not_a_dead_sink_thread(chat, monkeypatch,
                                                                                                caplog):
    """The sink's exception (or ``fault``) is the sink's code: a ``__str__`` that raises is said by its type, the
    sink thread goes on counting what it no longer writes, and nothing but the library's lines reaches the host."""
    _, model, tokenizer = chat
    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    enc = tokenizer(PROMPTS[:1], return_tensors="pt")
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        with nxl.attach(model, tokenizer=tokenizer, sink=_UnprintableSink("x")) as probe:
            model.generate(**enc, max_new_tokens=3, do_sample=False)
            model.generate(**enc, max_new_tokens=2, do_sample=False)
        with nxl.attach(model, tokenizer=tokenizer, sink=_UnprintableFault("y")) as stopped:
            model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert died == []
    assert probe.sink_fault == "_Unprintable: <unprintable _Unprintable>" and probe.unwritten == 5
    assert [len(call.steps) for call in probe.calls] == [3, 2]  # the records in memory are whole
    assert all(call.notes == [f"not written to the sink, which stopped: {probe.sink_fault}"] for call in probe.calls)
    assert stopped.sink_fault == "<unprintable _Unprintable>" and stopped.unwritten == 3
    assert all(r.getMessage().startswith("nxl_hooks: ") and "\n" not in r.getMessage() for r in caplog.records)


_FORKING = """
import json, os, sys, time
sys.path[:0] = sys.argv[3:]
import torch, tiny, nxl_hooks as nxl

class SlowDisk(nxl.Sink):  # a write takes a while: the fork lands while the sink's thread holds its lock
    def _append(self, data, frames=1):
        time.sleep(0.3)
        return super()._append(data, frames)

kind, where = sys.argv[1], sys.argv[2]
sink = {"stream": lambda: SlowDisk(where), "rotating": lambda: nxl.RotatingSink(where),
        "parquet": lambda: "parquet:" + where}[kind]()
model = tiny.generating_llama(seed=3)
ids = torch.randint(1, tiny.GEN_VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
probe = nxl.attach(model, layers="all", sink=sink)
model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
time.sleep(0.1)
pid = os.fork()
if pid == 0:  # the child generates too and detaches; what its probe says goes to stdout
    model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
    probe.detach()
    print(json.dumps({"fault": probe.sink_fault, "unwritten": probe.unwritten,
                      "notes": [call.notes for call in probe.calls]}), flush=True)
    os._exit(0)
model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
_, status = os.waitpid(pid, 0)
probe.detach()
assert status == 0, status
"""


@pytest.fixture(scope="module")
def programs():
    """``run(PROGRAM, kind, where)``: ``python -c PROGRAM kind where tests``'s exit code, stdout and stderr, each
    program in a fresh process forked from one interpreter that imported torch, tiny and nxl_hooks once (tests/
    forks.py; no sink is open there: each program opens its own, in its own process)."""
    tests = Path(__file__).resolve().parents[1]
    prelude = f"import sys\nsys.path[:0] = [{str(tests)!r}]\nimport torch, tiny, nxl_hooks"
    with Programs(prelude, env={**os.environ, "OMP_NUM_THREADS": "1"}) as server:
        yield lambda program, kind, where: server.run(program, [kind, where, tests], out=where, timeout=120)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("kind", ["stream", "rotating", "parquet"])
def test_a_forked_child_leaves_the_parents_sink_whole_and_says_its_own_records_stay_in_memory(tmp_path, kind,
                                                                                             programs):
    """A host that forks while attached (a pre-fork server, a data loader): the child never writes to, closes or
    takes the lock of the parent's sink (a stream file's frames would interleave, a Parquet file be finished twice,
    a lock held by the parent's sink thread at the fork never be released), and says so on its probe."""

    where = tmp_path / {"stream": "run.nxl", "rotating": "runs", "parquet": "run.parquet"}[kind]
    done = programs(_FORKING, kind, where)
    assert done.returncode == 0, done.stderr[-3000:]
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert "forked from the one that opened the sink" in child["fault"]
    assert child["unwritten"] == 2  # the child's own two steps
    assert any("forked" in note for note in child["notes"][-1])
    model = tiny.generating_llama(seed=3)
    if kind == "parquet":  # the parent's two calls, every step, and nothing of the child's
        rows = _table(where)
        assert sorted({(call, step) for call, step in zip(rows["call"], rows["step"])}) == [
            (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
        return
    stream = nxl.read_stream(where)
    assert stream.damage is None and [call.index for call in stream] == [0, 1]
    for call in stream:
        check_call(model, call, 3)


_FORKED_DIRECT = """
import json, os, sys
sys.path[:0] = sys.argv[3:]
import torch, tiny, nxl_hooks as nxl

kind, where = sys.argv[1], sys.argv[2]
model = tiny.generating_llama(seed=3)
ids = torch.randint(1, tiny.GEN_VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
with nxl.attach(model, layers="all") as probe:
    model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
(call,) = probe.calls
sink = nxl.Sink(where) if kind == "stream" else nxl.RotatingSink(where)
sink.write_call(call, {})
pid = os.fork()
if pid == 0:  # the child writes to its parent's sink itself, no probe in between, then closes it
    said = []
    for write in (lambda: sink.write_step(call.steps[0]), lambda: sink.write_steps(call.steps),
                  lambda: sink.write_end(call)):
        try:
            write()
            said.append(None)
        except RuntimeError as error:
            said.append(str(error))
    sink.close()
    print(json.dumps(said), flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert status == 0, status
sink.write_steps(call.steps)
sink.write_end(call)
sink.close()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("kind", ["stream", "rotating"])
def test_a_forked_child_that_writes_to_its_parents_sink_itself_is_told_and_leaves_the_file_whole(tmp_path, kind,
                                                                                                  programs):
    """Without a probe in between, a child's write to the parent's sink is refused in one line (neither dropped
    without a word nor interleaved into the parent's file), and its close leaves the parent's file alone."""

    where = tmp_path / {"stream": "run.nxl", "rotating": "runs"}[kind]
    done = programs(_FORKED_DIRECT, kind, where)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(said) == 3 and all(line and "forked from" in line and "open a sink of its own" in line
                                  for line in said), said
    stream = nxl.read_stream(where)
    assert stream.damage is None and [call.index for call in stream] == [0]
    check_call(tiny.generating_llama(seed=3), stream[0], 3)


class _Cancelled(Exception):
    pass


class _GoneClient:  # as transformers serve's DirectStreamer once its client disconnected: the prompt's put raises
    def put(self, value):
        raise _Cancelled("client went away")

    def end(self):
        pass


def _resumed_gone_next(model, sink):
    """Three requests on ``model`` attached with ``sink``: "resumed" (resuming a filled cache, not recorded), "gone"
    (its streaming client gone before its first forward) and "next" (recorded whole); returns the probe."""
    from nxl_hooks.hooks.generate import REQUEST_ID

    ids = torch.randint(1, tiny.GEN_VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    resumed, cache = tiny.resuming(model, ids)
    with nxl.attach(model, layers="all", sink=sink) as probe:
        for request, prompt, kwargs in (("resumed", resumed, cache), ("gone", ids, {"streamer": _GoneClient()}),
                                        ("next", ids, {})):
            token = REQUEST_ID.set(request)
            try:
                model.generate(input_ids=prompt, max_new_tokens=3, do_sample=False, **kwargs)
            except _Cancelled:
                pass
            finally:
                REQUEST_ID.reset(token)
    return probe


@pytest.mark.parametrize("kind", ["stream", "rotating"])
def test_calls_not_recorded_and_calls_ended_before_their_prompt_ran_are_in_the_stream_with_why(tmp_path, kind):
    """A call said not recorded (resuming a filled cache) and one that raised before its first forward (a streaming
    client gone while its request waited) are read back from the sink: their request id, and an end that says why
    (they were in probe.calls alone, so read_stream(request_id=...) found nothing); the call after them is whole."""
    model = tiny.generating_llama(seed=3)
    where = tmp_path / {"stream": "run.nxl", "rotating": "runs"}[kind]
    probe = _resumed_gone_next(model, where if kind == "stream" else nxl.RotatingSink(where))
    stream = nxl.read_stream(where, strict=True)
    assert stream.damage is None
    assert [(c.request_id, c.complete, len(c.steps)) for c in stream] == [("resumed", False, 0), ("gone", False, 0),
                                                                         ("next", True, 3)]
    resumed, gone, _ = stream
    assert resumed.error == probe.calls[0].error
    assert resumed.error.startswith("not recorded: generate was given a KV cache")
    assert "_Cancelled" in gone.error and gone.error == probe.calls[1].error
    assert resumed.prompt_mask is None and gone.prompt_mask is None and resumed.ended is not None
    assert resumed.model == gone.model == probe.calls[0].model == "LlamaForCausalLM"  # named before its frames go
    assert nxl.read_stream(where, request_id="resumed")[0].error == resumed.error
    check_call(model, stream[2], 3)
    # a running program's endpoint hands out such a call's frames from memory, as for a recorded one
    from types import SimpleNamespace

    from nxl_hooks.apps.serve.endpoint import ControlServer

    calls = {call.request_id: (None, call, probe.describe()) for call in probe.calls}
    host = SimpleNamespace(settings=SimpleNamespace(sink=None), find=lambda request_id, generation=False: calls.get(request_id))
    handed = tmp_path / "handed.nxl"
    handed.write_bytes(ControlServer(host)._frames("resumed"))
    (read,) = nxl.read_stream(handed, strict=True)
    assert (read.request_id, read.error, read.prompt_mask, read.steps) == ("resumed", resumed.error, None, [])


def test_parquet_live_and_exported_list_the_calls_with_no_rows_and_why(tmp_path, capsys):
    """Parquet rows are steps, so a call not recorded (resuming a filled cache) or stopped before its first forward has
    none: the file lists such calls with why in its footer's metadata (nxl.calls), live and exported, and
    nxl export says how many; a call recorded whole is not listed, its rows are there."""
    model = tiny.generating_llama(seed=3)
    probe = _resumed_gone_next(model, f"parquet:{tmp_path / 'live.parquet'}")
    _resumed_gone_next(model, tmp_path / "run.nxl")
    assert cli_main(["export", str(tmp_path / "run.nxl"), str(tmp_path / "exported.parquet")]) == 0
    printed = capsys.readouterr().out
    assert "2 call(s) not recorded, stopped early or with notes: why in the file's metadata nxl.calls" in printed
    resumed, gone, _ = probe.calls
    for name in ("live.parquet", "exported.parquet"):
        table = pq.read_table(tmp_path / name)
        said = json.loads(pq.read_metadata(tmp_path / name).metadata[b"nxl.calls"])
        assert (said["calls"], said["more"]) == (3, 0)
        assert [(c["request_id"], c["recorded"], c["complete"], c["error"]) for c in said["listed"]] == [
            ("resumed", False, False, resumed.error), ("gone", False, False, gone.error)], name
        assert set(table.column("request_id").to_pylist()) == {"next"}


def test_parquet_lists_each_call_with_no_rows_once_past_its_limit_and_across_writers(tmp_path, monkeypatch):
    """nxl.calls lists a call once, by the call (indexes repeat across the writers of a folder: each process counts
    from 0), and past its limit counts only the calls with something to say: clean ones are never counted."""
    from nxl_hooks.records import parquet
    from nxl_hooks.records.steps import GenerationCall

    monkeypatch.setattr(parquet, "LISTED", 2)
    def clean(index):
        return GenerationCall(index=index, layers=[0], prompt_mask=torch.ones(1, 2, dtype=torch.bool),
                              prompt_ids=torch.ones(1, 2, dtype=torch.long), complete=True)

    def failed(index, why):
        return GenerationCall(index=index, layers=[0], error=why)

    calls = [failed(0, "a"), clean(0), failed(1, "b"), clean(1), failed(2, "c"), clean(2), failed(0, "d")]
    sink = parquet.export_parquet(calls, tmp_path / "out.parquet")
    said = json.loads(pq.read_metadata(tmp_path / "out.parquet").metadata[b"nxl.calls"])
    assert [c["error"] for c in said["listed"]] == ["a", "b"] and said["more"] == 2 and said["calls"] == 7
    assert sink.unexplained == 4


def test_a_step_of_a_call_whose_frame_holds_no_prompt_is_refused(tmp_path):
    """A prompt-less call frame is a call that was not recorded: a step record after it is no writer's."""
    from nxl_hooks.records import writer

    model = tiny.generating_llama(seed=3)
    with nxl.attach(model, layers="all") as probe:
        model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=1, do_sample=False)
    (call,) = probe.calls
    step = call.steps[0]
    call.prompt_mask = call.prompt_ids = None
    path = tmp_path / "crafted.nxl"
    path.write_bytes(writer._FILE_MAGIC + writer.encode_call(call, {}, seq=0) + writer.encode_step(step, seq=1))
    with pytest.raises(nxl.StreamError, match="a step frame for call 0, whose 'call' frame holds no prompt"):
        nxl.read_stream(path)


def test_a_detach_while_a_prompt_is_being_recorded_leaves_a_readable_stream(chat, tmp_path, monkeypatch):
    """nxl ctl pause under load: the probe detaches (from another thread) while a call's prompt is being recorded,
    after its token texts were made and before its mask was set. The call is written as one whose prompt never ran
    recorded, with none of its prompt's fields (they once went in with no mask, and the whole stream was refused);
    the host's output is unchanged and the next call is recorded whole."""
    from nxl_hooks.hooks.plan import Plan

    path, model, tokenizer = chat
    ids = tokenizer(["hello world how are you"], return_tensors="pt")["input_ids"]
    plain = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    inside, resume, template = threading.Event(), threading.Event(), Plan.template

    def held(self, *args):  # the generating thread, between the prompt's texts and its mask
        inside.set()
        resume.wait(timeout=60)
        return template(self, *args)

    monkeypatch.setattr(Plan, "template", held)
    out = {}
    probe = nxl.attach(model, layers="all", tokenizer=tokenizer, sink=tmp_path / "run.nxl")
    worker = threading.Thread(target=lambda: out.setdefault("ids", model.generate(input_ids=ids, max_new_tokens=3,
                                                                                  do_sample=False)))
    worker.start()
    assert inside.wait(timeout=60)
    detacher = threading.Thread(target=probe.detach)
    detacher.start()
    detacher.join(timeout=60)
    resume.set()
    worker.join(timeout=60)
    assert not worker.is_alive() and not detacher.is_alive() and torch.equal(out["ids"], plain)
    (read,) = nxl.read_stream(tmp_path / "run.nxl", strict=True)
    assert "detached" in read.error and not read.complete and read.steps == []
    assert (read.prompt_mask, read.prompt_ids, read.readable, read.prompt_template) == (None, None, None, None)
    monkeypatch.setattr(Plan, "template", template)
    with nxl.attach(model, layers="all", tokenizer=tokenizer, sink=tmp_path / "next.nxl"):
        model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    (whole,) = nxl.read_stream(tmp_path / "next.nxl", strict=True)
    assert whole.complete and whole.readable == [tokenizer.convert_ids_to_tokens(ids[0])]
    check_call(model, whole, 3)


def test_a_call_frame_with_texts_but_no_prompt_from_an_earlier_writer_is_read(tmp_path):
    """nxl_hooks 0.4 before this release wrote the token texts and template of a call detached mid-prompt into its
    prompt-less frame: such a stream reads (the call as not recorded, with why), instead of being refused whole."""
    from nxl_hooks.records import writer
    from nxl_hooks.records.steps import GenerationCall

    call = GenerationCall(index=0, layers=[0, 1], request_id="r", error="the probe detached while this call ran")
    header = {"kind": "call", "call": 0, "layers": [0, 1], "meta": {}, "request_id": "r",
              "readable": [["user:", "hello"]], "seq": 0}
    frame = writer._encode({"prompt_mask": torch.zeros(0, 0, dtype=torch.bool),
                            "prompt_template": torch.zeros(1, 2, dtype=torch.bool)}, header)
    path = tmp_path / "old.nxl"
    path.write_bytes(writer._FILE_MAGIC + frame + writer.encode_end(call, seq=1))
    (read,) = nxl.read_stream(path, strict=True)
    assert (read.request_id, read.error, read.prompt_mask, read.readable, read.prompt_template) == (
        "r", call.error, None, None, None)


@pytest.mark.parametrize("how", ["read-only", "removed"])
def test_a_read_only_or_removed_folder_is_a_sink_fault(chat, tmp_path, how):
    _, model, tokenizer = chat
    folder = tmp_path / "rotated"
    folder.mkdir()
    sink = nxl.RotatingSink(folder, max_bytes=1)  # every frame its own file: the second one cannot be made
    if how == "removed":
        (folder / "00000001-00000001.nxl").unlink()
        folder.rmdir()
    else:
        folder.chmod(0o500)
    try:
        if how == "read-only" and os.access(folder, os.W_OK):
            pytest.skip("running as a user that writes into read-only folders (root)")
        probe = _generate(model, tokenizer, sink, new=2, prompts=PROMPTS[:1])
    finally:
        if folder.exists():
            folder.chmod(0o700)
    expected = "Permission denied" if how == "read-only" else "No such file or directory"
    assert probe.sink_fault is not None and expected in probe.sink_fault and "\n" not in probe.sink_fault
    assert probe.calls[0].notes == [f"not written to the sink, which stopped: {probe.sink_fault}"]
    assert probe.calls[0].complete and len(probe.calls[0].steps) == 2  # the records in memory are whole


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_stream_file_deleted_while_recording_is_a_sink_fault_not_records_written_nowhere(chat, tmp_path, kind):
    # an open descriptor writes on into a deleted file: without a look at its links, the records after the
    # deletion went nowhere, with no fault and none counted unwritten
    _, model, tokenizer = chat
    folder = tmp_path / "runs"
    folder.mkdir()
    sink = str(folder / "run.nxl") if kind == "file" else nxl.RotatingSink(folder / "rotated")
    enc = tokenizer(PROMPTS[:1], return_tensors="pt")
    with nxl.attach(model, tokenizer=tokenizer, sink=sink) as probe:
        model.generate(**enc, max_new_tokens=2, do_sample=False)
        probe.flush()  # the first call is on disk; then the file goes, alone or with its folder
        if kind == "file":
            os.unlink(sink)
        else:
            shutil.rmtree(folder)
        model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert probe.sink_fault is not None and "deleted" in probe.sink_fault and "\n" not in probe.sink_fault
    assert probe.unwritten == 3 and not probe.calls[0].notes
    assert probe.calls[1].notes == [f"not written to the sink, which stopped: {probe.sink_fault}"]


def test_without_pyarrow_export_and_the_parquet_sink_name_the_extra(chat, tmp_path, monkeypatch, capsys):
    _, model, tokenizer = chat
    _generate(model, tokenizer, tmp_path / "run.nxl", new=1, prompts=PROMPTS[:1])
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.setitem(sys.modules, name, None)  # import pyarrow now raises ImportError
    capsys.readouterr()
    assert cli_main(["export", str(tmp_path / "run.nxl"), str(tmp_path / "out.parquet")]) == 2
    err = capsys.readouterr().err
    assert err == 'nxl export: error: Parquet export needs pyarrow: pip install "nxl_hooks[parquet]"\n'
    with pytest.raises(ImportError, match=r'pip install "nxl_hooks\[parquet\]"'):
        nxl.attach(model, sink=f"parquet:{tmp_path / 'live.parquet'}")
    assert not list(tmp_path.glob("*.parquet*"))


def test_a_second_parquet_writer_on_one_file_is_refused(tmp_path):
    """Two models (or processes) given one parquet path: the second is refused in one line, the stream files' rule
    (a lock), and the first's rows stay whole."""
    from nxl_hooks.records.parquet import ParquetSink

    first = ParquetSink(tmp_path / "out.parquet")
    with pytest.raises(ValueError) as refused:
        ParquetSink(tmp_path / "out.parquet")
    assert str(refused.value) == (f"{tmp_path / 'out.parquet.partial'} is being written by another sink (a second "
                                  "model or process): give each its own path, or detach the other first")
    first.close()
    assert (tmp_path / "out.parquet").is_file() and not (tmp_path / "out.parquet.partial").exists()
    assert pq.read_metadata(tmp_path / "out.parquet").num_rows == 0  # the first's file, whole
    ParquetSink(tmp_path / "out.parquet").close()  # the file is free again once the first is done


def test_without_file_locks_a_second_parquet_writer_is_refused_not_emptying_the_first(tmp_path, monkeypatch):
    """A file system without locks (flock: ENOLCK, some NFS): no lock tells a live writer's .partial from a dead
    one's, so one that is there is refused in one line (the takeover emptied the live writer's file)."""
    import errno

    from nxl_hooks.records import writer
    from nxl_hooks.records.parquet import ParquetSink

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(writer.fcntl, "flock", no_locks)
    first = ParquetSink(tmp_path / "out.parquet")
    partial = tmp_path / "out.parquet.partial"
    partial.write_bytes(b"PAR1 rows of a live writer")  # what it holds (written through its own descriptor, alike)
    with pytest.raises(ValueError) as refused:
        ParquetSink(tmp_path / "out.parquet")
    assert str(refused.value) == (f"{partial} exists, and its file system has no locks to tell whether another sink "
                                  "still writes it: if none does (a crashed run left it), remove it; else give another "
                                  "path")
    assert partial.read_bytes() == b"PAR1 rows of a live writer"
    first.close()
    ParquetSink(tmp_path / "out.parquet").close()  # gone with its writer: the path is free again


_PARQUET_KILLED = """
import os, sys, time
import nxl_hooks as nxl
from nxl_hooks.records.parquet import ParquetSink

stream, out, fork = sys.argv[1], sys.argv[2], sys.argv[3] == "fork"
sink = ParquetSink(out, row_group_rows=1)
for _ in range(20):  # a few hundred KB in row groups: on disk, past any buffer
    for call in nxl.read_stream(stream):
        sink.write_call(call, {})
        for step in call.steps:
            sink.write_step(step)
if fork and os.fork() == 0:  # a worker that outlives its parent, and never touches the sink
    time.sleep(600)
    os._exit(0)
print("writing", flush=True)
time.sleep(600)  # killed here, its file never finished
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("fork", ["", "fork"], ids=["killed", "killed-with-a-forked-worker-alive"])
def test_a_parquet_file_left_by_a_killed_writer_is_taken_over_with_one_line(chat, tmp_path, caplog, fork):
    """A process SIGKILLed while it writes leaves out.parquet.partial behind (no footer: unreadable). The next
    writer to that path takes it over with one log line (it was refused until removed by hand), also while a worker
    the dead one forked still runs (its copy of the descriptor held the lock), and its file holds its own rows."""
    path, model, tokenizer = chat
    _generate(model, tokenizer, tmp_path / "run.nxl", new=3)
    out, partial = tmp_path / "out.parquet", tmp_path / "out.parquet.partial"
    writer = subprocess.Popen([sys.executable, "-c", _PARQUET_KILLED, str(tmp_path / "run.nxl"), str(out), fork],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert writer.stdout.readline() == "writing\n", writer.stderr.read()
        writer.kill()
        writer.wait(60)
        assert partial.stat().st_size > 100_000 and not out.exists()
        with pytest.raises(Exception):
            pq.read_metadata(partial)  # what the dead writer left cannot be read
        with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
            assert cli_main(["export", str(tmp_path / "run.nxl"), str(out)]) == 0
    finally:
        try:
            os.killpg(writer.pid, signal.SIGKILL)  # the forked worker too
        except ProcessLookupError:  # none was left
            pass
    said = [r.getMessage() for r in caplog.records if r.name == "nxl_hooks"]
    assert said == [f"nxl_hooks: {partial} was left by a writer that died before it finished (a crash, SIGKILL), its "
                    "rows lost with it (a Parquet file without its footer cannot be read): replaced by this writer's"]
    (call,) = nxl.read_stream(tmp_path / "run.nxl")
    rows = _table(out)
    assert len(rows["row"]) == sum(int(s.mask.sum()) * len(s.layers) for s in call.steps)  # its own, once
    assert not partial.exists()


def test_no_parquet_writer_empties_a_partial_file_it_did_not_begin(chat, tmp_path, capsys):
    """``nxl export X.partial X`` took its own source stream for a dead writer's ``X.partial``: emptied it and renamed
    it to X, --force or not. The export refuses it before anything loads, and a live sink (no input to check)
    refuses a ``.partial`` that no Parquet writer began instead of emptying it."""
    from nxl_hooks.records.parquet import ParquetSink

    _, model, tokenizer = chat
    out, source = tmp_path / "scores.parquet", tmp_path / "scores.parquet.partial"
    _generate(model, tokenizer, source, new=2, prompts=PROMPTS[:1])
    before = source.read_bytes()
    capsys.readouterr()
    for force in ([], ["--force"]):
        assert cli_main(["export", str(source), str(out), *force]) == 2
        assert capsys.readouterr().err == (f"nxl export: error: OUT.parquet {out} would write over {source}, an "
                                           "input of this command: write the output elsewhere\n")
    with pytest.raises(ValueError) as refused:
        ParquetSink(out)
    assert str(refused.value) == (f"{source} is no Parquet file a writer left unfinished (it does not begin with "
                                  "b'PAR1'): nxl_hooks empties only its own; move it away, or write the Parquet file "
                                  "elsewhere")
    assert source.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [source.name]


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_second_stream_writer_on_one_file_or_folder_is_refused_at_attach_and_changes_nothing(tmp_path, kind):
    """Two models given one stream path (or one RotatingSink folder): the second attach is refused in one line before
    the file is touched (it truncated the first's file, or interleaved calls numbered alike), the first's records
    stay whole, and the place is free again once the first detaches."""
    where = tmp_path / ("run.nxl" if kind == "file" else "runs")
    spec = where if kind == "file" else f"{where}/"
    first, second = tiny.generating_llama(seed=3), tiny.generating_llama(seed=4)
    ids = torch.randint(1, tiny.GEN_VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    files = lambda: {path: path.read_bytes() for path in ([where] if kind == "file" else where.iterdir())}
    with nxl.attach(first, layers="all", sink=spec) as probe:
        first.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
        assert probe.flush()
        before = files()
        with pytest.raises(ValueError) as refused:
            nxl.attach(second, sink=spec)
        assert files() == before
    assert str(refused.value) == (f"{where} is being written by another sink (a second model or process): give "
                                  f"each its own {'path' if kind == 'file' else 'folder'}, or detach the other first")
    assert probe.sink_fault is None and nxl.detach_all(second) == 0  # the refused attach left no hook
    (call,) = nxl.read_stream(where, strict=True)
    check_call(first, call, 3)
    with nxl.attach(second, layers="all", sink=spec):  # free again: a new file, or the folder's next writer
        second.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
    stream = nxl.read_stream(where, strict=True)
    assert [len(call.steps) for call in stream] == ([2] if kind == "file" else [3, 2])
    check_call(second, stream[-1], 2)


@pytest.mark.parametrize("name", ["scores.parquet", "notes.txt"])
def test_a_stream_sink_never_empties_a_file_that_holds_no_stream(tmp_path, name):
    """attach(sink="scores.parquet") (``parquet:`` forgotten) emptied the Parquet file there at attach: a file that
    holds anything but a stream is refused in one line, left as it is, and the model keeps no hook; a stream file,
    even one whose writer was killed in its first bytes, is emptied and written anew."""
    model = tiny.generating_llama(seed=3)
    ids = torch.randint(1, tiny.GEN_VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    path = tmp_path / name
    path.write_bytes(b"PAR1 someone's data")
    with pytest.raises(ValueError) as refused:
        nxl.attach(model, sink=path)
    assert path.read_bytes() == b"PAR1 someone's data" and nxl.detach_all(model) == 0
    hint = " (a Parquet sink is 'parquet:PATH')" if name.endswith(".parquet") else ""
    assert str(refused.value) == (f"{path} holds something other than an nxl_hooks stream, which a stream sink "
                                  f"would empty: give another path, or remove the file first{hint}")
    path.write_bytes(b"nxl_hooks.str")  # a writer killed while it wrote the file's magic
    with nxl.attach(model, layers="all", sink=path):
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
    (call,) = nxl.read_stream(path, strict=True)
    check_call(model, call, 2)


def test_one_sink_object_given_to_two_probes_is_refused(tmp_path):
    """Both probes would number their calls from 0 in one file: the second attach is refused in one line."""
    sink = nxl.Sink(tmp_path / "run.nxl")
    first, second = tiny.generating_llama(seed=3), tiny.generating_llama(seed=4)
    with nxl.attach(first, sink=sink):
        with pytest.raises(ValueError) as refused:
            nxl.attach(second, sink=sink)
    assert str(refused.value) == (f"the sink {tmp_path / 'run.nxl'} is given to another attached probe already: "
                                  "give each probe a sink of its own (one path per model), or detach the other first")
    assert nxl.detach_all(second) == 0


_FORK_OUTLIVES = """
import os, sys
import nxl_hooks as nxl

kind, where = sys.argv[1], sys.argv[2]
make = (lambda: nxl.Sink(where)) if kind == "file" else (lambda: nxl.RotatingSink(where))
sink = make()
read, write = os.pipe()
ready, started = os.pipe()
pid = os.fork()
if pid == 0:  # a worker that outlives its parent's sink, and never closes it
    os.write(started, b"!")  # (the fork, and what runs at it, is done)
    os.close(write)
    os.read(read, 1)  # until the parent is done
    os._exit(0)
os.read(ready, 1)
sink.close()
try:
    make().close()  # the parent writes there again while the worker lives
    print("opened again")
except ValueError as error:
    print(error)
os.close(write)
os.waitpid(pid, 0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_forked_child_does_not_keep_its_parents_stream_file_locked(tmp_path, kind):
    where = tmp_path / ("run.nxl" if kind == "file" else "runs")
    done = subprocess.run([sys.executable, "-c", _FORK_OUTLIVES, kind, str(where)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "opened again"

def test_a_rotating_sink_whose_close_fails_lets_go_of_its_folder(tmp_path, monkeypatch):
    folder = tmp_path / "runs"
    sink = nxl.RotatingSink(folder)

    def failing(fd):  # the disk's I/O error at the close's fsync
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as patched:
        patched.setattr(os, "fsync", failing)
        with pytest.raises(OSError, match="Input/output error"):
            sink.close()
    nxl.RotatingSink(folder).close()  # not "being written by another sink": the failed close let go of it


# -- a full disk and other write faults (issue 24, items 5 and 6) -------------------------------------------------
# A full disk is simulated without root or a mount: a child process whose file-size limit (RLIMIT_FSIZE) stops its
# writes past a few KB, with SIGXFSZ ignored so that the write fails with an OSError (EFBIG), as on a full disk.

_FULL_DISK = '''
import json, os, resource, signal, sys, torch
from transformers import AutoTokenizer, LlamaForCausalLM
import nxl_hooks as nxl
model_dir, spec, watched, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = LlamaForCausalLM.from_pretrained(model_dir).eval()
model.generation_config.eos_token_id = None
tok = AutoTokenizer.from_pretrained(model_dir)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

def open_on(name):  # this process's descriptors on the watched file
    return [fd for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}").startswith(name)]

enc = tok(["hello world how are you"], return_tensors="pt")
with nxl.attach(model, tokenizer=tok, sink=spec) as probe:
    model.generate(**enc, max_new_tokens=12, do_sample=False)
    probe.flush()  # the sink has written (or failed on) every record made so far; the probe is still attached
    attached = open_on(watched)
print(json.dumps({"fault": probe.sink_fault, "attached": attached, "detached": open_on(watched),
                  "steps": len(probe.calls[0].steps), "unwritten": probe.unwritten, "notes": probe.calls[0].notes}))
'''


def _full_disk(chat, tmp_path, spec: str, watched: Path, limit: int) -> dict:
    path, _, _ = chat
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(path), spec, str(watched), str(limit)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads the child's descriptors in /proc")
def test_a_stream_sink_on_a_full_disk_closes_its_file(chat, tmp_path):
    """The write that fails is the sink's fault; its descriptor is closed then (the folder could not be unmounted
    while the host ran on), the host's generate and its records in memory are whole, and the file reads back up to
    its last whole record."""
    stream = tmp_path / "run.nxl"
    found = _full_disk(chat, tmp_path, str(stream), stream, 3000)
    assert found["fault"] is not None and "File too large" in found["fault"], found
    assert found["attached"] == [] and found["detached"] == [], found
    assert found["steps"] == 12
    (call,) = nxl.read_stream(stream)
    assert 0 < len(call.steps) < 12 and not call.complete
    assert found["unwritten"] == 12 - len(call.steps)  # what is not on disk, no more


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads the child's descriptors in /proc")
def test_a_live_parquet_sink_on_a_full_disk_leaves_no_partial_file(chat, tmp_path):
    out = tmp_path / "live.parquet"
    found = _full_disk(chat, tmp_path, f"parquet:{out}", tmp_path / "live.parquet", 1500)
    assert found["fault"] is not None and "File too large" in found["fault"], found
    assert found["detached"] == [] and found["steps"] == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither live.parquet nor live.parquet.partial
    # every step it had taken went with the removed file: all counted and said, whenever the write failed
    assert found["unwritten"] == 12 and found["notes"] == [f"not written to the sink, which stopped: {found['fault']}"]


def _limited(limit: int):
    def apply() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an ignored signal stays ignored across exec
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return apply


def test_export_on_a_full_disk_leaves_nothing_and_the_next_export_works(chat, tmp_path):
    _, model, tokenizer = chat
    _generate(model, tokenizer, tmp_path / "run.nxl", new=6)
    out = tmp_path / "out" / "scores.parquet"
    out.parent.mkdir()
    done = subprocess.run([sys.executable, "-m", "nxl_hooks", "export", str(tmp_path / "run.nxl"), str(out)],
                          capture_output=True, text=True, timeout=300, preexec_fn=_limited(2048))
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"nxl export: error: writing {out} failed (File "
                                                                   "too large); nothing was written"), done.stderr
    assert list(out.parent.iterdir()) == []  # no scores.parquet.partial
    assert cli_main(["export", str(tmp_path / "run.nxl"), str(out)]) == 0  # not "another writer"
    assert len(_table(out)["row"]) > 0


@pytest.mark.parametrize("existed", [False, True], ids=["new", "there-before"])
def test_a_stream_file_that_cannot_be_started_on_a_full_disk_is_named(chat, tmp_path, existed):
    """The first write of a stream file (its magic line, when the probe attaches) fails on a full disk: the one line
    said no more than "[Errno 27] File too large", not which file. The file it created was left behind, and read
    back as a writer that stopped before its first record: it is removed; a file that was there is left."""
    path, _, _ = chat
    out = tmp_path / "run.nxl"
    if existed:
        out.touch()
    done = subprocess.run([sys.executable, "-m", "nxl_hooks", "attribute", str(path), "hello world", "--generate", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, preexec_fn=_limited(4))
    assert done.returncode == 2, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("nxl attribute:")]
    assert said == [f"nxl attribute: error: [Errno {errno.EFBIG}] File too large: '{out}'"], done.stderr
    assert out.exists() == existed


def test_export_does_not_replace_an_existing_file_without_force(chat, tmp_path, capsys):
    _, model, tokenizer = chat
    _generate(model, tokenizer, tmp_path / "run.nxl", new=2, prompts=PROMPTS[:1])
    mine = tmp_path / "existing.parquet"
    mine.write_text("someone's table")
    capsys.readouterr()
    assert cli_main(["export", str(tmp_path / "run.nxl"), str(mine)]) == 2
    assert capsys.readouterr().err == (f"nxl export: error: {mine} exists: nxl export does not replace a file unless "
                                       "told to; pick a new name, or add --force to replace it\n")
    assert mine.read_text() == "someone's table" and sorted(p.name for p in tmp_path.iterdir()) == [
        "existing.parquet", "run.nxl"]
    assert cli_main(["export", str(tmp_path / "run.nxl"), str(mine), "--force"]) == 0
    assert len(_table(mine)["row"]) > 0


def test_exporting_a_damaged_stream_prints_one_nxl_line(chat, tmp_path):
    """Not the warnings machinery's two lines (the warning, then a line of nxl_hooks' source)."""
    _, model, tokenizer = chat
    stream = tmp_path / "run.nxl"
    _generate(model, tokenizer, stream, new=4, prompts=PROMPTS[:1])
    data = bytearray(stream.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte in a middle frame: whole frames follow it
    stream.write_bytes(bytes(data))
    done = subprocess.run([sys.executable, "-m", "nxl_hooks", "export", str(stream), str(tmp_path / "o.parquet")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    (line,) = done.stdout.splitlines()
    assert line.startswith(f"{tmp_path / 'o.parquet'}: ") and f"; {stream}: damaged, read up to: " in line, line


def test_export_strict_refuses_damage_but_not_a_torn_last_frame(chat, tmp_path, capsys):
    """--strict refuses what read_stream(strict=True) refuses; a torn last frame, where a killed writer stopped, is
    no damage: exported, and said to be left out (it was called "damaged", exported with exit 0 under --strict)."""
    _, model, tokenizer = chat
    stream = tmp_path / "run.nxl"
    _generate(model, tokenizer, stream, new=4, prompts=PROMPTS[:1])
    whole = stream.read_bytes()
    stream.write_bytes(whole[:-1])
    capsys.readouterr()
    assert cli_main(["export", str(stream), str(tmp_path / "torn.parquet"), "--strict"]) == 0
    line = capsys.readouterr().out
    assert f"; {stream}: torn, its end left out (a writer killed mid-write): frame " in line, line
    assert "damaged, read up to" not in line, line
    flipped = bytearray(whole)
    flipped[len(whole) // 2] ^= 0xFF  # a flipped byte in a middle frame: damage
    stream.write_bytes(bytes(flipped))
    assert cli_main(["export", str(stream), str(tmp_path / "flipped.parquet"), "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nxl export: error: {stream} is damaged: frame ") and err.count("\n") == 1, err
    assert not (tmp_path / "flipped.parquet").exists()


@pytest.mark.parametrize("spec, what", [
    ("raise", "a bare name is no file path, folder or sink kind"),
    (":x", "'' before ':' is no sink kind"),
    ("x:y", "'x' before ':' is no sink kind"),
])
def test_a_bare_word_is_no_sink(chat, tmp_path, monkeypatch, spec, what):
    """make_sink(":x") and make_sink("raise") made stream files named ':x' and 'raise' (issue 24, item 7): a bare
    word is as likely a kind without its ':ARG' as a file name, so it is refused, in attach too, before any file."""
    _, model, tokenizer = chat
    monkeypatch.chdir(tmp_path)
    expected = (f"sink {spec!r}: {what}; write a stream file as NAME.nxl or ./NAME, a folder as NAME/, or a "
                "registered kind as KIND:ARG (known: ")
    with pytest.raises(ValueError) as error:
        nxl.make_sink(spec)
    assert str(error.value).startswith(expected) and "parquet" in str(error.value)
    with pytest.raises(ValueError, match=re.escape(expected)):
        nxl.attach(model, tokenizer=tokenizer, sink=spec)
    assert list(tmp_path.iterdir()) == []
    for path in (f"./{spec}", f"{spec}.nxl", Path(spec)):  # written as paths, they are paths
        sink = nxl.make_sink(path)
        assert isinstance(sink, nxl.Sink) and sink.path == Path(path)
        sink.close()

SYSTEM_CHAT = [{"role": "system", "content": "Answer in one word."},
               {"role": "user", "content": "The capital of France is"}]


def test_parquet_rows_reproduce_the_librarys_ranking_without_the_chat_template(tmp_path):
    """Issue 24 item 9: "which prompt token got most attribution at the last layer", asked of the Parquet rows with
    pyarrow alone, leaving out the template's positions by the ``template`` column (and, equally, by ``ranked``),
    is what ``top()`` of the same records says, and no template token; without the column, a template token wins.
    The template's positions are cut by hand (tests/oracle/test_chat_ranking.py's oracle). Records carry the model
    name, times and the generated text."""
    import bpe_tiny
    import pyarrow.compute as pc
    from test_chat_ranking import by_hand

    folder = bpe_tiny.save_bpe(tmp_path / "bpe")
    tok = AutoTokenizer.from_pretrained(folder)
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    model.generation_config.eos_token_id = None
    ids, ranked_by_hand = by_hand(tok, [("<|im_start|>system\n", False), ("Answer in one word.", False),
                                        ("<|im_end|>\n<|im_start|>user\n", False), ("The capital of France is", True),
                                        ("<|im_end|>\n<|im_start|>assistant\n", False)])
    enc = tok(tok.apply_chat_template(SYSTEM_CHAT, tokenize=False, add_generation_prompt=True), return_tensors="pt")
    assert enc["input_ids"][0].tolist() == ids
    before = time.time()
    with nxl.attach(model, tokenizer=tok, layers=[0, -1], sink=f"parquet:{tmp_path / 'live.parquet'}") as probe:
        out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    after = time.time()
    call = probe.calls[-1]
    assert call.model == str(folder) and before <= call.started <= call.ended <= after
    assert all(call.started <= s.time <= call.ended for s in call.steps)
    assert [s.time for s in call.steps] == sorted(s.time for s in call.steps)
    assert call.text == tok.decode(out[0, len(ids):]) and call.texts == [call.text]
    with nxl.attach(model, tokenizer=tok, layers=[0, -1], sink=tmp_path / "run.nxl"):
        model.generate(**enc, max_new_tokens=4, do_sample=False)
    (disk,) = nxl.read_stream(tmp_path / "run.nxl")
    assert disk.model == str(folder) and disk.special_ids == sorted(tok.all_special_ids) and disk.text == call.text
    assert disk.started <= disk.steps[0].time <= disk.ended
    assert cli_main(["export", str(tmp_path / "run.nxl"), str(tmp_path / "export.parquet")]) == 0
    for name, record in (("live.parquet", call), ("export.parquet", disk)):
        table = pq.read_table(tmp_path / name)
        assert set(table["model"].to_pylist()) == {str(folder)}
        assert all(abs(t.timestamp() - record.steps[step].time) < 1e-5
                   for t, step in zip(table["time"].to_pylist(), table["step"].to_pylist()))
        last = table.filter(pc.equal(table["layer"], record.layers[-1]))
        for step in record.steps:
            rows = last.filter(pc.equal(last["step"], step.step))
            assert rows["prediction_position"].to_pylist() == [step.position - 1] * step.position
            assert rows["in_prompt"].to_pylist() == [p < len(ids) for p in range(step.position)]
            template = rows["template"].to_pylist()
            assert {p for p in range(len(ids)) if not template[p]} == ranked_by_hand  # the template, by hand
            best = lambda t: t["token_text"][pc.index(t["normxlogit"], pc.max(t["normxlogit"])).as_py()].as_py()
            prompt = rows.filter(rows["in_prompt"])
            asked = prompt.filter(pc.and_(pc.invert(prompt["template"]), pc.invert(prompt["special"])))
            asked = asked.filter(pc.not_equal(asked["position"], asked["prediction_position"]))
            library = [(p, t) for p, t, _ in record.attribution(step).top(100) if p < len(ids)][0]
            position = asked["position"][pc.index(asked["normxlogit"], pc.max(asked["normxlogit"])).as_py()].as_py()
            assert (position, best(asked)) == library and position in ranked_by_hand
            assert best(prompt.filter(prompt["ranked"])) == library[1]  # the ranked column says the same
            assert rows["ranked"].to_pylist() == record.attribution(step).rankable(0).tolist()
        first = last.filter(pc.equal(last["step"], 0))
        unfiltered = pc.index(first["normxlogit"], pc.max(first["normxlogit"])).as_py()
        assert first["template"][unfiltered].as_py()  # without the column a template token is the answer


def test_a_step_read_back_ranks_as_its_call_does_without_special_tokens(tmp_path):
    """docs/records-and-sinks.md's ``calls[0].steps[0].to_attribution().top(3)``: no special token ranks
    (docs/reading-results.md), as in ``call.attribution(step)``: the prompt's words by NormXLogit, by hand."""
    model, tok = tiny.build_model("llama"), tiny.tokenizer()
    model.generation_config.eos_token_id = None
    enc = tok(["the film was very"], return_tensors="pt")  # [CLS] the film was very [SEP]
    with torch.no_grad(), nxl.attach(model, tokenizer=tok, sink=tmp_path / "run.nxl") as probe:
        model.generate(**enc, max_new_tokens=2, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
        logits = oracle.llama(model).layer_logits(out.hidden_states)
    _, by_hand = oracle.normxlogit(logits, out.hidden_states[0], out.logits[:, -1].argmax(-1))
    words = [1, 2, 3, 4]  # not [CLS] (0), nor [SEP] (5), the prediction position
    expected = [tok.convert_ids_to_tokens(int(enc["input_ids"][0, p]))
                for p in sorted(words, key=lambda p: -float(by_hand[-1, 0, p]))]
    (disk,) = nxl.read_stream(tmp_path / "run.nxl")
    for call in (disk, probe.calls[0]):
        step = call.steps[0]
        assert [text for _, text, _ in step.to_attribution().top(6)] == expected
        assert step.to_attribution().top(6) == call.attribution(step).top(6)


def test_an_on_step_callbacks_step_ranks_without_special_tokens(monkeypatch):
    """``step.to_attribution()`` inside an ``on_step`` callback leaves out the call's special tokens whatever the
    publisher thread has done: here it delivers (links) no step before the callback has looked (it was linked only
    there, so the callback's ranking held [CLS] or not by timing)."""
    from nxl_hooks.hooks.publish import Hub

    looked, deliver = threading.Event(), Hub._deliver

    def late(hub, call, step):
        looked.wait(60)
        deliver(hub, call, step)

    monkeypatch.setattr(Hub, "_deliver", late)
    model, tok = tiny.build_model("llama"), tiny.tokenizer()
    model.generation_config.eos_token_id = None
    enc = tok(["the film was very"], return_tensors="pt")  # [CLS] the film was very [SEP]
    ranked = []

    def on_step(step: nxl.Step) -> None:
        ranked.append([position for position, _, _ in step.to_attribution().top(6)])
        looked.set()

    with torch.no_grad(), nxl.attach(model, tokenizer=tok, on_step=on_step) as probe:
        model.generate(**enc, max_new_tokens=1, do_sample=False, pad_token_id=0)
    assert ranked and sorted(ranked[0]) == [1, 2, 3, 4]  # neither [CLS] (0) nor [SEP] (5)
    assert ranked[0] == [position for position, _, _ in probe.calls[0].attribution(probe.calls[0].steps[0]).top(6)]
