"""Dataset runs: loading, append-only logs, resuming after a crash or SIGKILL, sharding under accelerate launch."""

import csv
import html
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import nxl_hooks
import tiny
from nxl_hooks.eval import audit
from nxl_hooks.eval import faithfulness as ev
from nxl_hooks.apps.cli import main
from nxl_hooks.apps.dataset import SettingsMismatchError, load_examples, read_records, run_dataset, run_id

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": tiny.save_model(root / "llama", "llama", seed=0),
        "llama2": tiny.save_model(root / "llama2", "llama", seed=1),
        "bert": tiny.save_model(root / "bert", "bert", seed=0),
        "bert1": tiny.save_model(root / "bert1", "bert", seed=1),
        "data": tiny.write_jsonl(root / "data.jsonl", 6),
        "long": tiny.write_jsonl(root / "long.jsonl", 12),  # audited whole once (whole_audit), killed, sharded
    }


def _cli(args: list[str], **popen: object) -> subprocess.Popen:
    """``nxl ARGS`` in a child process with one torch thread. Runs whose records are compared byte for byte
    all go through here: float reductions depend on the thread count, and this test process's count is
    whatever the machine has (never changed here: that would leak into later tests)."""
    return subprocess.Popen([sys.executable, "-m", "nxl_hooks", *args],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **popen)


def _run_cli(args: list[str]) -> None:
    child = _cli(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 0, err.decode()[-3000:]


def _outputs(out: Path) -> tuple[dict, list[dict]]:
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), records


def test_jsonl_and_csv_load_alike(tmp_path):
    (tmp_path / "d.jsonl").write_text(
        '{"text": "good film", "label": "1", "evidence": ["good"]}\n\n{"text": "bad plot", "label": "neg"}\n'
    )
    (tmp_path / "d.csv").write_text("text,label,evidence\ngood film,1,good\nbad plot,neg,\n")
    expected = [
        {"id": 0, "text": "good film", "label": "1", "evidence": ["good"]},
        {"id": 1, "text": "bad plot", "label": "neg"},
    ]
    assert load_examples(tmp_path / "d.jsonl") == expected
    assert load_examples(tmp_path / "d.csv") == expected
    (tmp_path / "e.csv").write_text('sentence,label,evidence\nok,0.5,"[""a b"", ""c""]"\nfine,2,x|y z\n')
    rows = load_examples(tmp_path / "e.csv", text="sentence")
    assert rows[0]["label"] == "0.5" and rows[0]["evidence"] == ["a b", "c"] and rows[1]["evidence"] == ["x", "y", "z"]
    with pytest.raises(ValueError, match="--text-field"):
        load_examples(tmp_path / "e.csv")


def test_csv_cell_beyond_csv_limit(tmp_path):
    """A CSV cell longer than csv's default limit (131072 characters) is read whole, as a JSONL text is, and the
    process-wide limit is left as it was."""
    text = "film " * 30_000
    (tmp_path / "long.csv").write_text(f'text,label\n"{text}",1\n')
    limit = csv.field_size_limit()
    assert load_examples(tmp_path / "long.csv") == [{"id": 0, "text": text, "label": "1"}]
    assert csv.field_size_limit() == limit


@pytest.mark.skipif(sys.version_info >= (3, 11), reason="Python 3.11+ reads a NUL character in a CSV cell")
def test_csv_error_names_its_line(tmp_path):
    (tmp_path / "nul.csv").write_text("text,label\nthe film,1\nthe\0plot,0\n")
    with pytest.raises(ValueError, match=r"nul.csv:3 cannot be read as CSV \(line contains NUL\): fix that row"):
        load_examples(tmp_path / "nul.csv")



@pytest.mark.parametrize("row, error", [('"unterminated film,1', "unexpected end of data"),
                                        ('"quoted" and more,1', "',' expected after '\"'")],
                         ids=["quote never closed", "text after a closing quote"])
def test_a_quote_csv_cannot_read_is_one_line_naming_the_row_it_starts_on(models, tmp_path, capsys, row, error):
    """A quote never closed swallowed every later row into one example's text, silently; now the row is named
    (the line it starts on) and nxl refuses the data in one line, exit 2."""
    path = tmp_path / "data.csv"
    path.write_text(f"text,label\ngood film,1\n{row}\nnice film,1\nfine film,0\n")
    message = (f"{path}:3 cannot be read as CSV ({error}): fix that row (a quoted cell ends with its quote, a quote "
               "in it is doubled), or save the data as .jsonl")
    with pytest.raises(ValueError) as info:
        load_examples(path)
    assert str(info.value) == message
    capsys.readouterr()
    assert main(["evaluate", str(models["bert"]), str(path), "--out", str(tmp_path / "out"), "--methods", "logat"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"nxl evaluate: error: {message}"]

def test_hub_dataset_source(monkeypatch):
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return [{"idx": 0, "sentence": "a fine film", "label": 1}, {"idx": 1, "sentence": "dull", "label": 0}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    rows = load_examples("hf:nyu-mll/glue:sst2:validation", text="sentence")
    assert rows == [{"id": 0, "text": "a fine film", "label": 1}, {"id": 1, "text": "dull", "label": 0}]
    load_examples("hf:stanfordnlp/sst2:validation", text="sentence")
    assert calls == [("nyu-mll/glue", "sst2", "validation"), ("stanfordnlp/sst2", None, "validation")]
    with pytest.raises(ValueError, match="hf:NAME:SPLIT"):
        load_examples("hf:sst2")


def test_torn_last_line_is_ignored_then_cut(tmp_path):
    items = [{"n": i} for i in range(4)]
    (tmp_path / "parts").mkdir()
    part = tmp_path / "parts" / "part-0.jsonl"
    ours = run_id({"k": 1})
    part.write_text(f'{{"n": 0, "index": 0, "run_id": "{ours}"}}\n{{"n": 1, "index": 1, "run_id": "{ours}"}}\n'
                    '{"n": 2, "ind')  # killed mid-write
    assert sorted(read_records(tmp_path)) == [0, 1]
    calls = []
    records = run_dataset(items, lambda ex: calls.append(ex["n"]) or dict(ex), tmp_path, settings={"k": 1})
    assert calls == [2, 3]
    assert records == [{"n": i, "index": i} for i in range(4)]
    lines = [json.loads(line) for line in part.read_text().splitlines()]
    assert [{k: v for k, v in line.items() if k != "run_id"} for line in lines] == records
    assert [line["run_id"] for line in lines] == [ours] * 4


def test_other_settings_are_refused(tmp_path):
    run_dataset([{"n": 0}], dict, tmp_path, settings={"model": "a"})
    with pytest.raises(SettingsMismatchError, match="model"):
        run_dataset([{"n": 0}], dict, tmp_path, settings={"model": "b"})


@pytest.mark.parametrize("written", ["0.3.9", None], ids=["run.json names its version", "run.json names none"])
def test_a_run_of_another_version_is_not_resumed_and_the_line_names_it(monkeypatch, tmp_path, written):
    """A folder another nxl_hooks scored was resumed with this version's numbers added to its own (0.4.0 fixed
    numbers), or, from 0.3, refused as having "other settings (different: model_files)", a key 0.3 never wrote."""
    from nxl_hooks.apps import dataset

    with monkeypatch.context() as older:
        older.setattr(dataset, "VERSION", "0.3.9")
        run_dataset([{"n": 0}], lambda ex: {"by": "0.3.9"}, tmp_path, settings={"model": "a"})
    run = tmp_path / "run.json"
    if written is None:  # as nxl_hooks 0.3 and before wrote it
        run.write_text(json.dumps({k: v for k, v in json.loads(run.read_text()).items() if k != "nxl_hooks"}))
    before = (tmp_path / "parts" / "part-0.jsonl").read_bytes()
    made = "nxl_hooks 0.3.9" if written else r"an nxl_hooks that did not record its version \(0.3 or before, .*\)"
    with pytest.raises(SettingsMismatchError, match=f"holds a run made by {made}, whose records nxl_hooks "
                                                    f"{nxl_hooks.__version__} does not resume"):
        run_dataset([{"n": 0}, {"n": 1}], lambda ex: {"by": "this"}, tmp_path, settings={"model": "a"})
    assert (tmp_path / "parts" / "part-0.jsonl").read_bytes() == before


def test_an_evaluate_run_of_0_3_is_refused_naming_its_version(models, tmp_path, capsys, monkeypatch):
    """The run folder as nxl_hooks 0.3 leaves it (run.json without model_files or a version, records of another
    identity) was refused as "other settings (different: model_files)": a key the user never set."""
    from nxl_hooks.apps import dataset

    argv = ["evaluate", str(models["bert"]), str(models["data"]), "--out", str(tmp_path), "--limit", "2",
            "--methods", "logat"]
    with monkeypatch.context() as older:
        older.setattr(dataset, "VERSION", "0.3.0")
        assert main(argv) == 0
    run = tmp_path / "run.json"
    run.write_text(json.dumps({k: v for k, v in json.loads(run.read_text()).items()
                               if k not in ("nxl_hooks", "model_files")}))
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "error" in line] == [
        f"nxl evaluate: error: {tmp_path} holds a run made by an nxl_hooks that did not record its version (0.3 or "
        f"before, or an early 0.4 build), whose records nxl_hooks "
        f"{nxl_hooks.__version__} does not resume (its numbers may differ); use another --out folder, or delete this "
        "one to start over"]


@pytest.mark.parametrize("change", [
    lambda folder, models: shutil.copyfile(models["bert1"] / "model.safetensors", folder / "model.safetensors"),
    lambda folder, _: (folder / "config.json").write_text(
        json.dumps({**json.loads((folder / "config.json").read_text()), "classifier_dropout": 0.5})),
], ids=["weights replaced, same size", "config edited"])
@pytest.mark.parametrize("command", ["evaluate", "audit"])
def test_a_changed_model_is_not_resumed(models, tmp_path, capsys, change, command):
    """The run's identity holds the model's files, not only its path: new weights at the same path were resumed with
    the old model's numbers."""
    folder = tmp_path / "model"
    shutil.copytree(models["bert"], folder)
    where = {"evaluate": [str(folder)], "audit": ["--reference", str(folder), "--candidate", str(models["bert"])]}
    argv = [command, *where[command], str(models["data"]), "--out", str(tmp_path / "o"), "--limit", "2"]
    argv += ["--methods", "logat"] if command == "evaluate" else []
    assert main(argv) == 0 and main(argv) == 0  # unchanged: resumed
    change(folder, models)
    capsys.readouterr()
    assert main(argv) == 2
    key = "model_files" if command == "evaluate" else "reference_files"
    assert f"holds a run with other settings (different: {key})" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["evaluate", "audit"])
def test_a_run_resumes_with_another_offload_folder(models, tmp_path, capsys, command):
    """Where offloaded weights wait changes no number: a run resumes with another --offload-folder (or none), where
    the folder was part of its identity ("other settings (different: loading)")."""
    where = {"evaluate": [str(models["bert"])], "audit": ["--reference", str(models["bert"]), "--candidate",
                                                          str(models["bert1"])]}
    argv = [command, *where[command], str(models["data"]), "--out", str(tmp_path / "o"), "--limit", "2",
            "--device-map", "auto"]
    argv += ["--methods", "logat"] if command == "evaluate" else []
    assert main([*argv, "--offload-folder", str(tmp_path / "a")]) == 0
    records = (tmp_path / "o" / "records.jsonl").read_text()
    assert main([*argv, "--offload-folder", str(tmp_path / "b")]) == 0 and main(argv) == 0, capsys.readouterr().err
    assert (tmp_path / "o" / "records.jsonl").read_text() == records  # resumed: nothing scored again


def test_exception_after_n_records_resumes_to_identical_result(models, tmp_path):
    reference = tiny.build_model("llama", 0)
    candidate = tiny.build_model("llama", 1)
    tok = tiny.tokenizer()
    examples = tiny.examples(5)

    def score(example):
        return audit.audit_example(reference, candidate, tok, example)

    whole = run_dataset(examples, score, tmp_path / "whole", settings={})
    seen = []

    def crashing(example):
        if len(seen) == 3:
            raise RuntimeError("injected crash")
        seen.append(example["id"])
        return score(example)

    with pytest.raises(RuntimeError, match="injected"):
        run_dataset(examples, crashing, tmp_path / "resumed", settings={}, record_failures=False)
    assert len(read_records(tmp_path / "resumed")) == 3
    redone = []
    resumed = run_dataset(examples, lambda ex: redone.append(ex["id"]) or score(ex), tmp_path / "resumed", settings={})
    assert redone == [e["id"] for e in examples[3:]]
    assert resumed == whole
    assert audit.aggregate(resumed) == audit.aggregate(whole)


class _Unprintable(Exception):
    """An example's failure whose message cannot be made: its ``__str__`` raises."""

    def __str__(self) -> str:
        raise ValueError("no text")


def test_an_example_whose_error_cannot_be_printed_is_recorded_and_the_run_goes_on(tmp_path):
    """The example's record says ``<unprintable TYPE>`` (making it raised ValueError('no text') out of the run)."""
    def score(example):
        if example["n"] == 1:
            raise _Unprintable()
        return {"n": example["n"]}

    records = run_dataset([{"id": f"e{n}", "n": n} for n in range(3)], score, tmp_path, settings={})
    assert records[1] == {"index": 1, "id": "e1", "error": "_Unprintable: <unprintable _Unprintable>"}
    assert [record.get("n") for record in records] == [0, None, 2]


def test_an_example_whose_error_has_no_message_is_recorded_by_its_type_once(tmp_path):
    """A message-less error (``KeyError()``, a blank message) read ``KeyError: KeyError``: one_line gives the type's
    name for no message, which the record then put after the type again."""
    def score(example):
        if example["n"] == 1:
            raise KeyError()
        if example["n"] == 2:
            raise ValueError("  ")
        return {"n": example["n"]}

    records = run_dataset([{"id": f"e{n}", "n": n} for n in range(3)], score, tmp_path, settings={})
    assert [record.get("error") for record in records] == [None, "KeyError", "ValueError"]


def test_evaluate_command_writes_records_summary_and_report(models, tmp_path):
    methods = "random,normxlogit,logat"
    assert (
        main(
            [
                "evaluate",
                str(models["bert"]),
                str(models["data"]),
                "--out",
                str(tmp_path / "ev"),
                "--methods",
                methods,
                "--limit",
                "4",
            ]
        )
        == 0
    )
    summary, records = _outputs(tmp_path / "ev")
    model, tok = tiny.build_model("bert", 0), tiny.tokenizer()
    for index, example in enumerate(tiny.examples(4)):
        direct = ev.score_example(model, tok, example, methods.split(","))
        for rec in (direct, records[index]):
            for entry in rec["methods"].values():
                entry.pop("seconds")
        assert {**direct, "index": index, "made_with": 0} == records[index]
    assert summary["n"] == 4 and list(summary["methods"]) == methods.split(",")
    [made] = summary["made_with"]  # the one model of the run, in its role
    assert made["examples"] == 4 and list(made["models"]) == ["model"]
    assert made["models"]["model"]["model"] == str(models["bert"]) and made["models"]["model"]["dtype"] == "float32"
    page = (tmp_path / "ev" / "report.html").read_text()
    assert page.count('class="nxl-point"') >= 3 * 9 and "Per-layer alignment" in page


@pytest.mark.parametrize("command", ["evaluate", "audit"])
def test_the_terminal_says_how_many_examples_failed_also_when_resumed(models, tmp_path, capsys, command):
    """An example that failed was said once, on stderr, as it failed: the run's last lines ("2 examples", or an
    audit's "wrote ...") never said that the figures leave it out, and a resumed run, which does not retry it, said
    nothing of it at all. Every finished run now ends with one line counting summary.json's failures."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "good film", "label": 1}) + "\n"
                    + json.dumps({"text": " ".join(["film"] * 100), "label": 1}) + "\n"  # beyond 64 positions
                    + json.dumps({"text": "bad plot", "label": 0}) + "\n")
    args = (["evaluate", str(models["bert"]), str(data), "--methods", "logat"] if command == "evaluate" else
            ["audit", "--reference", str(models["bert"]), "--candidate", str(models["bert1"]), str(data)])
    for run in ("first", "resumed"):
        assert main([*args, "--out", str(tmp_path / "out")]) == 0
        failed = json.loads((tmp_path / "out" / "summary.json").read_text())["failed"]
        assert [f["index"] for f in failed] == [1]
        err = capsys.readouterr().err.splitlines()
        expected = (f"nxl {command}: 1 of 3 examples failed and is in none of the figures (summary.json's failed "
                    f"lists each with its reason); the first: example 1: {failed[0]['error']}")
        assert err[-1] == expected, run


@pytest.mark.parametrize("command", ["evaluate", "audit"])
def test_the_records_notes_reach_stderr_summary_and_report_once_each_with_their_count(models, tmp_path, capsys,
                                                                                       command):
    """A target word of several tokens explains its first: the note saying so was in records.jsonl alone, never on
    stderr, in summary.json or on report.html, where the user looks. The run's end now says each note once with how
    many examples it concerns (the word's tokens judged by the tokenizer's own tokenize)."""
    data = tmp_path / "d.jsonl"
    targets = ["good film", "bad", "good film"]  # one word of two tokens, twice; one of one token
    data.write_text("".join(json.dumps({"text": "the film was", "target": t}) + "\n" for t in targets))
    assert tiny.tokenizer().tokenize("good film") == ["good", "film"] and tiny.tokenizer().tokenize("bad") == ["bad"]
    args = (["evaluate", str(models["llama"]), str(data), "--methods", "logat"] if command == "evaluate" else
            ["audit", "--reference", str(models["llama"]), "--candidate", str(models["llama2"]), str(data)])
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    summary, records = _outputs(tmp_path / "out")
    note = "'good film' is 2 tokens here (good film): only the first, good, is explained"
    assert [r["notes"] for r in records] == [[note], [], [note]]
    assert summary["notes"] == [{"note": note, "examples": 2}]
    said = [line for line in capsys.readouterr().err.splitlines() if "note" in line]
    assert said == [f"nxl {command}: note on 2 of 3 examples: {note}"]
    assert html.escape(note) in (tmp_path / "out" / "report.html").read_text()


def _made_with_rows(page: str) -> list[list[str]]:
    """The cells of the report's "Made with" table, as text."""
    section = page.split("<h2>Made with</h2>", 1)[1].split("</table>", 1)[0]
    return [[html.unescape(cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", section.split("<tbody>", 1)[1])]


def test_the_summary_and_report_say_what_made_each_models_numbers(models, tmp_path):
    """run.json and summary.json named the nxl_hooks version alone: nothing in an audit's outputs said which weights,
    in which dtype and quantization, computed by which torch, transformers or bitsandbytes, made the numbers.
    summary.json's made_with now says it of each model, and the report shows it, each checked against what is read
    here independently: the installed distributions, the dtype of a model loaded as asked, the quantization given."""
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    out = tmp_path / "out"
    assert main(["audit", "--reference", str(models["llama"]), "--quantize", "8bit", str(models["data"]), "--limit",
                 "3", "--dtype", "bfloat16", "--out", str(out)]) == 0
    summary, records = _outputs(out)
    [made] = summary["made_with"]
    assert made["examples"] == 3 and [r["made_with"] for r in records] == [0, 0, 0]
    given = BitsAndBytesConfig(load_in_8bit=True)
    loaded = {"reference": LlamaForCausalLM.from_pretrained(models["llama"], dtype=torch.bfloat16),
              "candidate": LlamaForCausalLM.from_pretrained(models["llama"], dtype=torch.bfloat16,
                                                            quantization_config=given)}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = {"nxl_hooks": project["version"],
                 **{name: importlib.metadata.version(name) for name in ("torch", "transformers", "bitsandbytes",
                                                                        "accelerate")}}
    assert list(made["models"]) == ["reference", "candidate"]
    rows = _made_with_rows((out / "report.html").read_text())
    for (role, model), row in zip(loaded.items(), rows, strict=True):
        said = made["models"][role]
        [dtype] = {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}
        assert said["model"] == str(models["llama"]) and said["dtype"] == dtype == "bfloat16", role
        assert {name: said["versions"].get(name) for name in installed} == installed, role
        assert row[:4] == ["3", role, str(models["llama"]), dtype]
        assert all(f"{name} {version}" in row[5] for name, version in installed.items()), row
    assert made["models"]["reference"]["quantization"] is None and rows[0][4] == "none"
    quantization = made["models"]["candidate"]["quantization"]
    assert quantization["quant_method"] == "bitsandbytes" and quantization["load_in_8bit"] is True
    assert quantization["load_in_4bit"] is False and quantization["llm_int8_threshold"] == given.llm_int8_threshold
    assert "load_in_8bit=True" in rows[1][4] and rows[1][4].startswith("bitsandbytes: ")


def test_a_run_resumed_with_other_package_versions_goes_on_and_says_each_set(models, tmp_path, capsys):
    """What made the records (made_with) is no part of a run's identity: a run resumed after torch changed goes on.
    Its outputs claim no one set for all: each record names its set, the summary counts the examples of each (and of
    records written before records said: none), the report shows each and stderr says there are several."""
    out = tmp_path / "out"
    args = ["audit", "--reference", str(models["llama"]), "--candidate", str(models["llama2"]), str(models["data"]),
            "--limit", "3", "--out", str(out)]
    assert main(args) == 0
    part = out / "parts" / "part-0.jsonl"
    first, second, _ = (json.loads(line) for line in part.read_text().splitlines())
    now = first["made_with"]
    del first["made_with"]  # an early 0.4 build's record
    before = {role: {**made, "versions": {**made["versions"], "torch": "2.11.0"}} for role, made in now.items()}
    second["made_with"] = before  # made by another torch; the third example left to the resumed run
    part.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    capsys.readouterr()
    assert main(args) == 0
    summary, records = _outputs(out)
    assert summary["made_with"] == [{"examples": 1, "models": None}, {"examples": 1, "models": before},
                                    {"examples": 1, "models": now}]
    assert [r["made_with"] for r in records] == [0, 1, 2]
    assert "the records were made with 3 different sets of models and package versions (1, 1, 1 examples" in \
        capsys.readouterr().err
    page = (out / "report.html").read_text()
    rows = _made_with_rows(page)
    assert [row[:2] for row in rows] == [["1", "–"], ["1", "reference"], ["1", "candidate"], ["1", "reference"],
                                         ["1", "candidate"]]
    assert rows[0][2] == "not recorded" and "torch 2.11.0" in rows[1][5] and "torch 2.11.0" not in rows[3][5]
    assert "3 different sets made these records" in page


def test_evaluate_command_runs_on_a_masked_lm(tmp_path):
    """The checks evaluate runs once before the dataset (architecture, layer, tokenizer) take the tokenizer a masked
    LM needs to find its [MASK]: every example scores, as score_example scores it directly."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(**tiny._SIZES, max_position_embeddings=64)).eval()
    path = tiny.save_model(tmp_path / "mlm", "bert", model=model)
    examples = [{"text": "the film was [MASK]", "label": "good", "id": 0},
                {"text": "a [MASK] plot and a bad movie", "label": "great", "id": 1}]
    data = tmp_path / "mlm.jsonl"
    data.write_text("".join(json.dumps(example) + "\n" for example in examples))
    methods = "random,normxlogit"
    assert main(["evaluate", str(path), str(data), "--out", str(tmp_path / "ev"), "--methods", methods,
                 "--layer", "-1"]) == 0
    summary, records = _outputs(tmp_path / "ev")
    assert summary["n"] == 2 and summary["failed"] == []
    for index, example in enumerate(examples):
        direct = ev.score_example(model, tiny.tokenizer(), example, methods.split(","))
        for rec in (direct, records[index]):
            for entry in rec["methods"].values():
                entry.pop("seconds")
        assert {**direct, "index": index, "made_with": 0} == records[index]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _audit_args(models, out: Path) -> list[str]:
    """``nxl audit`` of the 12 examples of ``models["long"]`` into ``out``."""
    return [
        "audit",
        "--reference",
        str(models["llama"]),
        "--candidate",
        str(models["llama2"]),
        str(models["long"]),
        "--out",
        str(out),
    ]


@pytest.fixture(scope="module")
def whole_audit(models, tmp_path_factory) -> tuple[dict, list[dict]]:
    """The outputs of ``_audit_args`` run whole in one child process with one torch thread: what a run killed and
    resumed, and a run sharded by accelerate launch (one thread per process), must each equal (one run for both)."""
    out = tmp_path_factory.mktemp("whole") / "whole"
    _run_cli(_audit_args(models, out))
    return _outputs(out)


def test_sigkill_mid_dataset_resumes_to_identical_result(models, whole_audit, tmp_path):
    args = _audit_args(models, tmp_path / "killed")
    child = _cli(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    part = tmp_path / "killed" / "parts" / "part-0.jsonl"
    deadline = time.monotonic() + 120  # a bound on failure: a loaded machine took over 60 s
    while not (part.exists() and part.read_bytes().count(b"\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    kept = len(read_records(tmp_path / "killed"))
    assert 2 <= kept < 12, "the child must be killed mid-dataset"
    _run_cli(args)
    assert _outputs(tmp_path / "killed") == whole_audit


def test_ctrl_c_mid_dataset_says_what_is_kept_and_exits_130(models, tmp_path):
    """Ctrl-C in a dataset run ended it with exit 130 and no word: nothing said that the finished examples are kept,
    nor that the same command goes on from there. It says both in one line; the merged outputs are absent, not
    written from part of the data."""
    data = tiny.write_jsonl(tmp_path / "long.jsonl", 40)
    out = tmp_path / "stopped"
    args = ["audit", "--reference", str(models["llama"]), "--candidate", str(models["llama2"]), str(data)]
    child = _cli([*args, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 preexec_fn=tiny.ctrl_c_reaches)
    part = out / "parts" / "part-0.jsonl"
    deadline = time.monotonic() + 120
    while not (part.exists() and part.read_bytes().count(b"\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130, err.decode()[-3000:]
    kept = len(read_records(out))
    assert 2 <= kept < 40, "the child must be stopped mid-dataset"
    last = err.decode().rstrip("\n").splitlines()[-1]
    assert last == (f"nxl audit: interrupted: {kept} of 40 examples are kept in {out}; run the same command again "
                    "to go on from there"), last
    assert "Traceback" not in err.decode()
    assert not any((out / name).exists() for name in ("records.jsonl", "summary.json", "report.html"))


def _launch_two() -> list[str]:
    """`accelerate launch` of two processes, run as a module so no PATH is needed; the program comes after it."""
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    if torch.cuda.is_available():
        pytest.skip("this test shards across CPU processes; on a GPU machine accelerate would use the GPUs")
    # Without GPUs, --multi_gpu starts N CPU processes (gloo); --cpu would start one.
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
    ]


def test_accelerate_launch_two_processes_equals_one(models, whole_audit, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    program = ["-m", "nxl_hooks", *_audit_args(models, tmp_path / "two")]
    done = subprocess.run([*_launch_two(), *program], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    parts = sorted((tmp_path / "two" / "parts").glob("part-*.jsonl"))
    shares = [len(p.read_text().splitlines()) for p in parts]
    assert [p.name for p in parts] == ["part-0.jsonl", "part-1.jsonl"] and shares == [6, 6]
    assert done.stdout.count("wrote ") == 1  # merged once, by the main process
    assert _outputs(tmp_path / "two") == whole_audit  # one process, one thread, as accelerate runs each process


def test_a_csv_label_reads_as_the_jsonl_string_does(tmp_path):
    """A CSV label cell that looked like a number became an int: a causal LM's gold word "7" was scored as output id 7
    (another token), while the same row in JSONL, and the CSV target "7", read the word. A CSV label is now the
    string it is in JSONL: a language model's word, a classifier's label name or else its id, a regression's number
    (each judged by the tokenizer's own vocabulary and the model's own logits here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    row = {"text": "the capital is", "label": " 4", "target": "7", "foil": " Paris"}
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    assert load_examples(tmp_path / "d.jsonl") == [{"id": 0, **row}]
    (tmp_path / "d.csv").write_text('text,label,target,foil\nthe capital is, 7 ,7," Paris"\n')
    assert load_examples(tmp_path / "d.csv") == [
        {"id": 0, "text": "the capital is", "label": "7", "target": "7", "foil": " Paris"}
    ]
    with pytest.raises(ValueError, match="positive"):
        load_examples(tmp_path / "d.csv", limit=0)

    words = [*tiny.VOCAB, "7"]
    tok = tiny.word_tokenizer(words)
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(**{**tiny._SIZES, "vocab_size": len(words)}, num_key_value_heads=2)).eval()
    (tmp_path / "lm.csv").write_text("text,label\nthe film was,7\n")
    (tmp_path / "lm.jsonl").write_text(json.dumps({"text": "the film was", "label": "7"}) + "\n")
    seven = tok.convert_tokens_to_ids("7")
    with torch.no_grad():
        predicted = int(lm(**tok("the film was", return_tensors="pt")).logits[0, -1].argmax())
    for name in ("lm.csv", "lm.jsonl"):
        record = ev.score_example(lm, tok, load_examples(tmp_path / name)[0], ["logat"])
        assert (record["label"], record["correct"]) == (seven, predicted == seven), name

    (tmp_path / "cls.csv").write_text("text,label\ngood film,1\nbad film,LABEL_0\n")
    bert = tiny.build_model("bert", 0)
    labels = [ev.score_example(bert, tiny.tokenizer(), example, ["logat"])["label"]
              for example in load_examples(tmp_path / "cls.csv")]
    assert labels == [1, bert.config.label2id["LABEL_0"]]
    (tmp_path / "reg.csv").write_text("text,label\ngood film,0.5\n")
    record = ev.score_example(tiny.build_model("regression", 0), tiny.tokenizer(),
                              load_examples(tmp_path / "reg.csv")[0], ["logat"])
    assert record["label"] == 0.5


def test_a_label_name_that_is_another_outputs_id_says_which_reading_was_taken(tmp_path, capsys):
    """A classifier whose labels are named "1" and "2" (ids 0 and 1): a CSV label or target "1" is the label named
    "1" (id 0) by the names-first rule, but a CSV of ids (whose cells are always text) was misread so silently.
    A note now says which reading was taken and how to give the other; "2" is no id of the model, so no note (each
    judged by the model's own config and logits)."""
    bert = tiny.build_model("bert", 0)
    bert.config.id2label, bert.config.label2id = {0: "1", 1: "2"}, {"1": 0, "2": 1}
    folder = tiny.save_model(tmp_path / "digits", "bert", model=bert)
    data = tmp_path / "d.csv"
    data.write_text("text,label,target\ngood film,1,1\nbad film,2,2\n")
    config = bert.config
    note = (f"'1' is read as the label named '1' (id {config.label2id['1']}), not as id 1 ({config.id2label[1]!r}): "
            "to mean id 1, give the number 1 (an int; in a dataset, a JSONL number: a CSV cell is always text)")
    for command in ("evaluate", "audit"):
        args = ([command, str(folder), str(data), "--methods", "logat"] if command == "evaluate" else
                [command, "--reference", str(folder), "--candidate", str(folder), str(data)])
        assert main([*args, "--out", str(tmp_path / command)]) == 0
        summary, records = _outputs(tmp_path / command)
        assert [r["target"] for r in records] == [config.label2id["1"], config.label2id["2"]]
        assert [r["notes"] for r in records] == [[note], []] and summary["notes"] == [{"note": note, "examples": 1}]
        assert [line for line in capsys.readouterr().err.splitlines() if "note" in line] == [
            f"nxl {command}: note on 1 of 2 examples: {note}"]
    with torch.no_grad():
        predicted = [int(bert(**tiny.tokenizer()(text, return_tensors="pt")).logits.argmax()) for text in
                     ("good film", "bad film")]
    summary, records = _outputs(tmp_path / "evaluate")
    assert [r["label"] for r in records] == [config.label2id["1"], config.label2id["2"]]
    assert summary["accuracy"] == (sum(p == config.label2id[name] for p, name in zip(predicted, "12")) / 2)


def test_run_that_failed_before_any_record_does_not_lock_its_folder(tmp_path):
    def failing(example):
        raise RuntimeError("injected crash")

    with pytest.raises(RuntimeError, match="injected"):
        run_dataset([{"n": 0}], failing, tmp_path, settings={"model": "a"}, record_failures=False)
    assert run_dataset([{"n": 0}], dict, tmp_path, settings={"model": "b"}) == [{"n": 0, "index": 0}]
    assert json.loads((tmp_path / "run.json").read_text()) == {"model": "b", "nxl_hooks": nxl_hooks.__version__}
    with pytest.raises(SettingsMismatchError, match="model"):  # now it holds a record of model b
        run_dataset([{"n": 0}], dict, tmp_path, settings={"model": "a"})


def test_one_failing_process_stops_both_instead_of_hanging(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        "from nxl_hooks.apps.dataset import _state, run_dataset\n"
        "def score(example):\n"
        "    if _state().process_index == 1:\n"
        "        raise KeyError('injected in process 1')\n"
        "    return dict(example)\n"
        "run_dataset([{'n': i} for i in range(6)], score, sys.argv[1], settings={}, record_failures=False)\n"
    )
    done = subprocess.run(
        [*_launch_two(), str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "injected in process 1" in done.stderr and "another process failed" in done.stderr
    assert sorted(read_records(tmp_path / "out")) == [0, 2, 4]  # process 0 finished its share, kept for the rerun
