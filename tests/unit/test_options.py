"""The option groups (apps/schema.py): every ``nxl run`` option goes flag -> Settings -> NXL_* -> Settings unchanged,
one field added to a group is a flag, a variable, an ``nxl ctl`` change the endpoint reads and a docs row; the
loading options are one shape from flags, keywords and NXL_LOAD; the docs tables are generated; no nxl parser takes
abbreviations, and what nxl tail / nxl ctl print reaches the terminal escaped (request ids, tokens, names, errors,
faults)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
from pathlib import Path

import pytest
import torch

from nxl_hooks.apps.cli import build_parser, main as cli_main, one_line
from nxl_hooks.apps.commands import ctl, tail
from nxl_hooks.apps.loading import Loading, load_model, program_defaults
from nxl_hooks.apps.loading_options import named
from nxl_hooks.apps.options import loading_identity, loading_options
from nxl_hooks.apps.schema import Option, generated, options, setting
from nxl_hooks.apps.serve.settings import ATTACH, OPTIONS, Settings, add_run_options, markdown_table
from nxl_hooks.method.select import option_text, parse_layers, parse_target
from nxl_hooks.records.view import StepView
from serving import live_reader

DOC = Path(__file__).resolve().parents[2] / "docs" / "nxl-run-options.md"

#: For each option with a flag: what a user types, and the value it stands for (written by hand, not by the schema).
#: Every value differs from the default, so a flag that is dropped on the way fails.
TYPED = {
    "sink": (["--sink", "runs/"], True),
    "layers": (["--layers", "0,2,-1"], [0, 2, -1]),
    "target": (["--target", " are, is,7"], [" are", " is", 7]),
    "embedding": (["--embedding", "word"], "word"),
    "methods": (["--methods", "contrastive, logat"], ["contrastive", "logat"]),
    "models": (["--models", "tiny*, org/other"], ["tiny*", "org/other"]),
    "keep_calls": (["--keep-calls", "0"], 0),
    "listen": (["--listen", "127.0.0.1:8765"], "127.0.0.1:8765"),
    "allow_remote": (["--allow-remote"], True),
    "eager": (["--eager"], True),
    "sink_max_bytes": (["--sink-file-mb", "3"], 3 * 1024 * 1024),
    "sink_max_files": (["--sink-files", "2"], 2),
    "plugins": (["--plugins", "jsonl, sinks:my-sink"], ["jsonl", "sinks:my-sink"]),
}
#: The options nxl run sets itself (no flag), as their variables hold them.
SET_BY_RUN = {"run_dir": ("runs/1-abc", Path("runs/1-abc")),
              "sink_spec": ("parquet:out-{model}.parquet", "parquet:out-{model}.parquet"),
              "load": ('{"dtype": "bfloat16", "max_memory": {"cpu": "1GiB"}}',
                       {"dtype": "bfloat16", "max_memory": {"cpu": "1GiB"}})}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_run_options(parser)
    return parser


def test_every_option_is_sampled_here():
    assert {o.name for o in OPTIONS if o.flag} == set(TYPED)
    assert {o.name for o in OPTIONS if not o.flag} == set(SET_BY_RUN)
    assert [o.name for o in OPTIONS] == [f.name for f in dataclasses.fields(Settings)]
    assert len({o.env for o in OPTIONS}) == len(OPTIONS) and all(o.env.startswith("NXL_") for o in OPTIONS)


@pytest.mark.parametrize("name", sorted(TYPED))
def test_each_flag_round_trips_through_settings_and_the_environment(name):
    argv, value = TYPED[name]
    settings = Settings.from_args(_parser().parse_args(argv), run_dir=Path("r"))
    assert getattr(settings, name) == value != getattr(Settings(run_dir=Path("r")), name)
    env = settings.to_env()
    assert Settings.from_env(env) == settings
    # every other field kept its default on the way
    assert {o.name for o in OPTIONS if getattr(settings, o.name) != o.default} == {name, "run_dir"}


@pytest.mark.parametrize("name", sorted(SET_BY_RUN))
def test_options_nxl_run_sets_round_trip_through_the_environment(name):
    text, value = SET_BY_RUN[name]
    (option,) = [o for o in OPTIONS if o.name == name]
    settings = Settings.from_env({"NXL_RUN_DIR": "r", option.env: text})
    assert getattr(settings, name) == value
    assert Settings.from_env(settings.to_env()) == settings


def test_all_flags_at_once_and_defaults_when_left_out():
    argv = [arg for typed, _ in TYPED.values() for arg in typed]
    settings = Settings.from_args(_parser().parse_args(argv), run_dir=Path("r"))
    assert {name: getattr(settings, name) for name in TYPED} == {name: value for name, (_, value) in TYPED.items()}
    assert Settings.from_env(settings.to_env()) == settings
    plain = Settings.from_args(_parser().parse_args([]), run_dir=Path("r"))
    assert plain == Settings(run_dir=Path("r")) == Settings.from_env({"NXL_RUN_DIR": "r"})
    assert (plain.layers, plain.target, plain.models, plain.keep_calls, plain.sink_max_bytes) == (
        "all", "predicted", ["*"], 16, 64 << 20)


@pytest.mark.parametrize("env, message", [
    ({"NXL_SINK": "yes"}, r"NXL_SINK: 'yes': use 1 \(on\) or 0 \(off\)"),
    ({"NXL_EMBEDDING": "words"}, r"NXL_EMBEDDING: embedding='words': use 'layer_input' \(default\) or 'word'"),
    ({"NXL_LAYERS": "one,two"}, r"NXL_LAYERS: 'one,two': use 'all', 'last'"),
    ({"NXL_TARGET": "a,,b"}, r"NXL_TARGET: 'a,,b': empty item"),
    ({"NXL_SINK_MAX_FILES": "0"}, r"NXL_SINK_MAX_FILES: '0': give a whole number of at least 1"),
    ({"NXL_SINK_MAX_FILES": "-2"}, r"NXL_SINK_MAX_FILES: '-2': give a whole number of at least 1"),
    ({"NXL_KEEP_CALLS": "many"}, r"NXL_KEEP_CALLS: 'many': give a whole number"),
    ({"NXL_LOAD": '{"dtype": 1, "head": "x"}'}, r"NXL_LOAD: .*a JSON object of dtype"),
    ({"NXL_LISTEN": "10.0.0.1:80"}, r"not a loopback address"),
    ({"NXL_PLUGINS": "sink:jsonl"}, r"^NXL_PLUGINS: 'sink:jsonl': 'sink:jsonl' is not a plugin's NAME or GROUP:NAME "
                                    r"with GROUP one of architectures, methods, sinks, engines"),
    ({"NXL_PLUGINS": "jsonl,,x"}, r"^NXL_PLUGINS: 'jsonl,,x': '' is not a plugin's NAME"),
])
def test_a_bad_variable_is_named(env, message):
    with pytest.raises(ValueError, match=message):
        Settings.from_env({"NXL_RUN_DIR": "r", **env})


def test_a_run_folder_is_needed():
    with pytest.raises(ValueError, match="NXL_RUN_DIR is not set"):
        Settings.from_env({})
    assert Settings.from_env({}, run_dir=Path("elsewhere")).run_dir == Path("elsewhere")


@pytest.mark.parametrize("argv, message", [
    (["--sink-files", "0"], "'0': give a whole number of at least 1"),
    (["--embedding", "words"], "invalid choice: 'words'"),
    (["--layers", "first"], "'first': use 'all', 'last' or a comma list of ints"),
])
def test_a_bad_flag_is_one_line_with_exit_2(capsys, argv, message):
    code = cli_main(["run", *argv, "--", "true"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


# -- settings accepted silently before (issue 24, item 7): one rule each, the same for the flag and the variable --

@pytest.mark.parametrize("env, message", [
    ({"NXL_TARGET": ""}, r"^NXL_TARGET: '' is empty: leave it out for the default \(predicted\)"),
    ({"NXL_MODELS": ""}, r"^NXL_MODELS: '' is empty: leave it out for the default \(\*\)"),
    ({"NXL_LAYERS": ""}, r"^NXL_LAYERS: '' is empty: leave it out for the default \(all\)"),
    ({"NXL_MODELS": ","}, r"^NXL_MODELS: ',': give at least one glob"),
    ({"NXL_MODELS": "[*"}, r"^NXL_MODELS: '\[\*': in '\[\*' a '\[' opens a character class that is never closed"),
    ({"NXL_MODELS": "tiny*,gpt[2"}, r"in 'gpt\[2' a '\[' opens a character class"),
    ({"NXL_SINK_SPEC": "parquet:x.parquet", "NXL_SINK_MAX_FILES": "3"},
     r"^--sink-files \(NXL_SINK_MAX_FILES\) size the run folder's rotated record files, but --sink parquet:x.parquet "
     r"writes to that sink kind instead; drop them"),
], ids=["target", "models", "layers", "models comma", "unclosed class", "unclosed class 2", "sink kind sized"])
def test_a_setting_that_would_be_read_silently_is_refused(env, message):
    """NXL_TARGET='' meant "predicted" while --target '' was refused; NXL_MODELS='[*' matched no model and
    recorded nothing without a word; an empty --models meant every model."""
    with pytest.raises(ValueError, match=message):
        Settings.from_env({"NXL_RUN_DIR": "r", **env})


def test_an_empty_variable_is_still_the_default_where_the_default_is_written_empty():
    settings = Settings.from_env({"NXL_RUN_DIR": "r", "NXL_LISTEN": "", "NXL_LOAD": "", "NXL_SINK_SPEC": ""})
    assert settings == Settings(run_dir=Path("r")) == Settings.from_env(Settings(run_dir=Path("r")).to_env())
    assert Settings.from_env({"NXL_RUN_DIR": "r", "NXL_MODELS": "[[]x*,a[!]]"}).models == ["[[]x*", "a[!]]"]


@pytest.mark.parametrize("argv, message", [
    (["--models", ""], "argument --models: '' is empty: leave it out for the default (*)"),
    (["--models", " , "], "argument --models: ' , ': give at least one glob"),
    (["--models", "[*"], "argument --models: '[*': in '[*' a '[' opens a character class that is never closed"),
    (["--target", ""], "argument --target: '' is empty: leave it out for the default (predicted)"),
    (["--sink", "parquet:{tmp}/x.parquet", "--sink-files", "3"],
     "--sink-files (NXL_SINK_MAX_FILES) size the run folder's rotated record files, but --sink parquet:"),
    (["--sink", "parquet:{tmp}/x.parquet", "--sink-file-mb", "2"], "--sink-file-mb (NXL_SINK_MAX_BYTES) size the"),
], ids=["models empty", "models blank", "models unclosed", "target empty", "sink-files", "sink-file-mb"])
def test_nxl_run_refuses_them_in_one_line_before_any_folder(capsys, tmp_path, monkeypatch, argv, message):
    def started(*_):  # accepted: nxl run would replace this test process with the program
        raise AssertionError(f"nxl run {argv} started the program")

    monkeypatch.setattr(os, "execvpe", started)
    code = cli_main(["run", *[arg.replace("{tmp}", str(tmp_path)) for arg in argv], "--", "true"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert list(tmp_path.iterdir()) == []


def test_the_plugin_allow_list_is_left_to_the_environment_unless_given():
    """NXL_PLUGINS unset lets every plugin load, empty none (nxl_hooks.arch.plugins): nxl run writes it only when
    --plugins is given, so the program otherwise keeps the environment's own; nxl attach has no such flag (a
    running process chose its plugins when it started)."""
    from nxl_hooks.arch import plugins

    assert "NXL_PLUGINS" not in Settings.from_args(_parser().parse_args([]), run_dir=Path("r")).to_env()
    for given, names, text in ((["--plugins", ""], [], ""), (["--plugins", "jsonl"], ["jsonl"], "jsonl")):
        settings = Settings.from_args(_parser().parse_args(given), run_dir=Path("r"))
        assert settings.plugins == names and settings.to_env()["NXL_PLUGINS"] == text
        assert Settings.from_env(settings.to_env()) == settings
    environ = {"NXL_PLUGINS": "sinks:jsonl"}  # what the program reads: the loader's own rule agrees
    assert Settings.from_env({"NXL_RUN_DIR": "r", **environ}).plugins == ["sinks:jsonl"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(os.environ, "NXL_PLUGINS", "sinks:jsonl")
        assert plugins.allowed(plugins.SINKS, "jsonl") and not plugins.allowed(plugins.ENGINES, "jsonl")
        patch.setitem(os.environ, "NXL_PLUGINS", Settings(run_dir=Path("r"), plugins=[]).to_env()["NXL_PLUGINS"])
        assert not plugins.allowed(plugins.SINKS, "jsonl")
    assert "--plugins" in _subparser("run").format_help() and "--plugins" not in _subparser("attach").format_help()


@pytest.mark.parametrize("value", ["all", "last", [0, -1], [3], "predicted", " Paris", 7, [" are", " is"],
                                   ["Paris", 3], ","])
def test_layers_and_targets_read_back_from_their_text(value):
    parse = parse_layers if value in ("all", "last") or (isinstance(value, list) and
                                                         all(isinstance(v, int) for v in value)) else parse_target
    assert parse(option_text(value)) == value


def test_the_docs_list_every_option():
    text = DOC.read_text()
    assert markdown_table() in text, "regenerate the table: python -c 'from nxl_hooks.apps.serve.settings import " \
                                     "markdown_table; print(markdown_table())'"
    for option in OPTIONS:
        assert f"`{option.env}`" in text and (option.flag is None or f"`{option.flag}" in text)


def test_nxl_run_help_lists_every_flag(capsys):
    assert cli_main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for option in OPTIONS:
        assert option.flag is None or option.flag in out


def test_every_generated_docs_table_is_current():
    """The tables of docs pages are their groups' own (python -m nxl_hooks.apps.schema docs/*.md rewrites them)."""
    pages = sorted(DOC.parent.glob("*.md"))
    marked = {page.name for page in pages if "<!-- generated: " in page.read_text()}
    assert {"nxl-run-options.md", "command-line.md"} <= marked
    stale = [page.name for page in pages if generated(page.read_text()) != page.read_text()]
    assert not stale, f"run python -m nxl_hooks.apps.schema docs/*.md (out of date: {stale})"
    text = (DOC.parent / "command-line.md").read_text()
    for option in options(Loading):
        assert f"`{option.name}`" in text and all(f"`{flag}" in text for flag in option.flags)


# -- one declaration: an option added to a group reaches every way in and out ---------------------------------

def _colour(text: str) -> str:
    if text not in ("plain", "red"):
        raise ValueError(f"{text!r}: use plain or red")
    return text


@dataclasses.dataclass
class _WithColour(Settings):
    """Settings plus one option, declared as one field: what adding an nxl run option is."""

    colour: str = setting("plain", Option("NXL_COLOUR", _colour, "how tokens are coloured", flag="--colour",
                                          metavar="NAME", ctl=True))


def test_one_field_is_a_flag_a_variable_a_ctl_change_and_a_docs_row(tmp_path, capsys):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_run_options(parser, group=_WithColour)
    assert "--colour NAME" in parser.format_help() and "how tokens are coloured (default: plain)" in " ".join(
        parser.format_help().split())
    # the flag, and the variable nxl run writes for it, read back
    settings = _WithColour.from_args(parser.parse_args(["--colour", "red", "--layers", "last"]), run_dir=Path("r"))
    assert (settings.colour, settings.layers) == ("red", "last")
    assert _WithColour.from_args(parser.parse_args([]), run_dir=Path("r")).colour == "plain"
    env = settings.to_env()
    assert env["NXL_COLOUR"] == "red" and _WithColour.from_env(env) == settings
    assert _WithColour.from_env({"NXL_RUN_DIR": "r"}).colour == "plain"
    with pytest.raises(ValueError, match=r"^NXL_COLOUR: 'mauve': use plain or red$"):
        _WithColour.from_env({"NXL_RUN_DIR": "r", "NXL_COLOUR": "mauve"})
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--colour", "mauve"])
    assert exit_.value.code == 2 and "argument --colour: 'mauve': use plain or red" in capsys.readouterr().err
    # nxl ctl takes it (ctl=True) and sends it as text; the endpoint of a program recording with this group reads it
    sub = argparse.ArgumentParser().add_subparsers()
    ctl_parser = ctl.add_parser(sub, group=_WithColour)
    args = ctl_parser.parse_args(["attach", "--colour", "red", "--models", "tiny*"])
    body = ctl.request(args, group=_WithColour)
    assert body == {"action": "attach", "colour": "red", "models": "tiny*"}
    assert _WithColour.changes({"colour": "red", "models": "tiny*"}) == {"colour": "red", "models": ["tiny*"]}
    with pytest.raises(ValueError, match=r"^colour: 'mauve': use plain or red$"):
        _WithColour.changes({"colour": "mauve"})
    with pytest.raises(ValueError, match=r"^'colour' is not an option here: use layers, target, embedding, models$"):
        Settings.changes({"colour": "red"})  # the group without it refuses it
    assert "--colour" not in ctl.add_parser(argparse.ArgumentParser().add_subparsers()).format_help()
    _control_endpoint_reads(tmp_path)
    # the docs table
    row = "| `--colour NAME` | `NXL_COLOUR` | `plain` | how tokens are coloured (default: plain) |"
    assert row in markdown_table(_WithColour) and row not in markdown_table()
    assert markdown_table(_WithColour).startswith(markdown_table().rstrip("\n"))


def _control_endpoint_reads(tmp_path):
    """A running program's endpoint reads the options of its settings' group: a bad value or an unknown field is
    a 400 naming it, and nothing changes; a good one is taken."""
    from nxl_hooks.apps.options import CliError
    from nxl_hooks.apps.serve.client import endpoints
    from nxl_hooks.apps.serve.controller import Controller
    from nxl_hooks.apps.serve.endpoint import ControlServer

    for group, run in ((_WithColour, tmp_path / "colour"), (Settings, tmp_path / "plain")):
        controller = Controller(group(run_dir=run))
        server = ControlServer(controller)  # what the controller starts once the program loads a model
        server.start()
        try:
            (endpoint,) = endpoints(str(run))
            with pytest.raises(CliError, match=r"400 colour: 'mauve': use plain or red$" if group is _WithColour
                               else r"400 'colour' is not an option here: use layers, target, embedding, models$"):
                endpoint.json("POST", "/v1/control", {"action": "pause", "colour": "mauve"})
            with pytest.raises(CliError, match=r"400 'layer' is not an option here"):  # a typo is not ignored
                endpoint.json("POST", "/v1/control", {"action": "pause", "layer": "last"})
            with pytest.raises(CliError, match=r"400 models: ' , ': give at least one glob"):  # never "all models"
                endpoint.json("POST", "/v1/control", {"action": "detach", "models": " , "})
            assert not endpoint.json("GET", "/v1/status")["paused"]
            body = {"action": "pause", **({"colour": "red"} if group is _WithColour else {})}
            assert endpoint.json("POST", "/v1/control", body)["paused"]
        finally:
            server.stop()
            controller.close()


# -- loading options: one group, read alike from flags, keyword arguments and NXL_LOAD ---------------------------

def test_loading_options_are_one_shape_from_flags_keywords_and_nxl_load(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)  # max_memory's device 0 is one this machine has
    argv = ["attribute", "m", "t", "--dtype", "bfloat16", "--device-map", "auto", "--max-memory", "0=1GiB,cpu=2GiB",
            "--offload-folder", "off", "--load-in-4bit"]
    from_flags = Loading.from_args(build_parser().parse_args(argv))
    from_keywords = Loading(dtype=torch.bfloat16, device_map="auto", max_memory={0: "1GiB", "cpu": "2GiB"},
                            offload_folder="off", quantize="4bit")
    nxl_load = '{"dtype": "bfloat16", "device_map": "auto", "max_memory": {"0": "1GiB", "cpu": "2GiB"}, ' \
               '"offload_folder": "off", "quantize": "4bit"}'
    from_env = Settings.from_env({"NXL_RUN_DIR": "r", "NXL_LOAD": nxl_load}).load
    expected = {"dtype": "bfloat16", "device_map": "auto", "max_memory": {0: "1GiB", "cpu": "2GiB"},
                "offload_folder": "off", "quantize": "4bit"}
    for loading in (from_flags, from_keywords, from_env):
        assert isinstance(loading, Loading) and dict(loading) == expected
        assert list(loading.max_memory) == [0, "cpu"]  # device 0 is the number accelerate takes, also from JSON
    assert from_flags == from_keywords == from_env == Loading.from_json(from_flags.to_json())
    assert program_defaults(from_env)["offload_folder"] == "off"  # nxl run: the program's from_pretrained gets it
    # the same check, whichever way in: the parser's own message
    with pytest.raises(ValueError, match=r"^gguf_file: 'model.bin': name the .gguf file inside MODEL$"):
        Loading(gguf_file="model.bin")
    with pytest.raises(ValueError, match=r"^NXL_LOAD: .*\(gguf_file: 'model.bin': name the .gguf file inside MODEL\)$"):
        Settings.from_env({"NXL_RUN_DIR": "r", "NXL_LOAD": '{"gguf_file": "model.bin"}'})
    with pytest.raises(ValueError, match=r"^gguf_file: 'model.bin': name the .gguf file inside MODEL$"):
        load_model("no/such/model", gguf_file="model.bin")  # before any path or hub lookup
    with pytest.raises(ValueError, match=r"^--tp \(tp=True\) with --device-map \(device_map=\): tensor parallel "
                                         r"places one shard"):
        Loading(tp=True, device_map="cpu")
    # nxl run hands the program only the options marked program: --head, --tp and --chat are a command's own
    with pytest.raises(ValueError, match=r"^'head' is not an option here: use dtype, device_map, max_memory, "
                                         r"offload_folder, quantize, gguf_file$"):
        Loading.program({"head": "causal_lm"})
    run_help, attribute_help = (" ".join(_subparser(name).format_help().split()) for name in ("run", "attribute"))
    for option in options(Loading):
        assert option.flags and all(flag in attribute_help for flag in option.flags)
        assert all((flag in run_help) == option.program for flag in option.flags), option.flags
    # the run identity of evaluate and audit is unchanged (a run from before resumes)
    assert loading_identity(loading_options(build_parser().parse_args(
        ["attribute", "m", "t", "--load-in-8bit", "--chat"]))) == {
        "head": None, "dtype": None, "device_map": None, "max_memory": None, "quantize": "8bit", "gguf_file": None,
        "chat": True}


def test_load_model_refusals_name_the_keyword_beside_the_flag(monkeypatch):
    """load_model is Python API, but its refusals named only the flags ("--tp loads one shard ...", "--max-memory
    needs --device-map"), which a Python caller does not have: each names the flag first, then the keyword, by one
    rule (loading_options.named), the flags as the option declares them."""
    assert [named(option.name) for option in options(Loading)] == [
        "--head (head=)", "--dtype (dtype=)", "--device-map (device_map=)", "--max-memory (max_memory=)",
        "--offload-folder (offload_folder=)", "--load-in-8bit/--load-in-4bit (quantize=)", "--gguf-file (gguf_file=)",
        "--tp (tp=True)", "--chat (chat=True)"]
    assert named("offload_folder", "DIR") == "--offload-folder DIR (offload_folder=)"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"^--tp \(tp=True\) loads one shard of the model per torchrun process, but "
                                         r"this process was not launched by torchrun .* or drop --tp \(tp=True\)$"):
        load_model("org/model", tp=True)  # (a hub id: not looked up before the refusal)
    with pytest.raises(ValueError, match=r"^--max-memory \(max_memory=\) needs --device-map \(device_map=\), e.g. "
                                         r"auto: it caps what each device holds$"):
        load_model("org/model", max_memory={"cpu": "1GiB"})
    with pytest.raises(ValueError, match=r"^--tp \(tp=True\) with --load-in-8bit/--load-in-4bit \(quantize=\), "
                                         r"--gguf-file \(gguf_file=\): tensor parallel places one shard"):
        load_model("org/model", tp=True, quantize="8bit", gguf_file="m.gguf")


def test_commands_that_attach_take_the_attach_settings_as_declared():
    """nxl attribute's --layers, --target and --embedding are nxl run's fields (one declaration): same help, same
    parsers, and the fields' defaults where left out (attribute reads args itself)."""
    attribute = _subparser("attribute")
    text = " ".join(attribute.format_help().split()).replace("- ", "-")  # (argparse wraps after a hyphen)
    left_out = attribute.parse_args(["m", "t"])
    given = attribute.parse_args(["m", "t", "--layers", "0,-1", "--target", " are,7", "--embedding", "word"])
    for option in options(Settings, where=lambda option: option.name in ATTACH):
        assert " ".join(option.describe().split()) in text
        assert getattr(left_out, option.dest) == option.default == getattr(Settings(run_dir=Path("r")), option.name)
    assert (given.layers, given.target, given.embedding) == ([0, -1], [" are", 7], "word")


@pytest.mark.parametrize("generate", [[], ["--generate", "2"]], ids=["explain", "generate"])
def test_an_option_declared_in_attach_reaches_attach_from_nxl_attribute(monkeypatch, generate):
    """One declaration in ATTACH is a flag of nxl attribute and goes on to attach (it was parsed, then dropped)."""
    import tiny
    from nxl_hooks.apps import loading, options as option_groups, terminal
    from nxl_hooks.apps.commands import attribute
    from nxl_hooks.apps.serve import settings

    explain = importlib.import_module("nxl_hooks.hooks.explain")  # the module (nxl_hooks.hooks.explain: its function)
    attach_fields = (*ATTACH, "keep_calls")  # a Settings field attach takes, declared as an attach option
    monkeypatch.setattr(settings, "ATTACH", attach_fields)
    monkeypatch.setattr(option_groups, "ATTACH", attach_fields)
    monkeypatch.setattr(loading, "load_model", lambda name, **_: (tiny.build_model("llama"), tiny.tokenizer()))
    given = {}

    class Given(Exception):
        pass

    def spy(*_, **options):
        given.update(options)
        raise Given  # what goes on to attach is all this test reads: stop before the forward

    monkeypatch.setattr(explain, "explain", spy)
    monkeypatch.setattr(terminal, "print_generation", spy)
    args = build_parser().parse_args(["attribute", "m", "the film was good", "--keep-calls", "3", *generate])
    with pytest.raises(Given):
        attribute.run(args)
    assert given["keep_calls"] == 3 and given["layers"] == "all" and given["embedding"] == "layer_input"


def _subparser(name: str) -> argparse.ArgumentParser:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices[name]


# -- no abbreviations ------------------------------------------------------------------------------------------

def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def test_no_parser_takes_abbreviations(capsys):
    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 7 and all(parser.allow_abbrev is False for parser in parsers)
    code = cli_main(["run", "--keep", "3", "--", "true"])  # --keep-calls, abbreviated
    err = capsys.readouterr().err
    assert code == 2 and "unrecognized arguments: --keep" in err
    code = cli_main(["attribute", "m", "text", "--layer", "all"])
    err = capsys.readouterr().err
    assert code == 2 and "unrecognized arguments: --layer" in err


# -- what reaches the operator's terminal ------------------------------------------------------------------

HOSTILE = "\x1b]0;owned\x07\x1b[2Jx\x9b31m\u202e"  # a title change, a screen clear, a C1 CSI, a bidi override
RAW = ("\x1b", "\x07", "\x9b", "\u202e")


def _step(request_id: str, token: str, name: str) -> StepView:
    return StepView.from_json({"request_id": request_id, "step": 3, "position": 12, "token_id": 5, "token": token,
                               "top": {"2": [[0, name, 0.5], [1, "b", -0.25]]}})


def test_tail_shows_a_byte_token_escaped_once():
    text = tail.line(_step("r1", "\\xf0\\x9f", "␣Paris"), None, 200)
    assert "'\\xf0\\x9f'" in text and "\\\\x" not in text  # one backslash each, as the token's text has it
    assert text.split() == ["r1", "3", "@12", "'\\xf0\\x9f'", "L2:", "0:'␣Paris'", "0.5", "1:'b'", "-0.25"]


def test_tail_and_ctl_escape_what_comes_from_the_network():
    line = tail.line(_step(HOSTILE, HOSTILE, HOSTILE), None, 500)
    status = {"pid": 7, "paused": False, "models": [{
        "name": HOSTILE, "attached": False, "excluded": False, "error": HOSTILE, "hooks": 0, "calls": 0,
        "sink_fault": HOSTILE, "unrecorded": None, "unwritten": 0}]}
    for text in (line, ctl.describe(status), one_line(f"server said {HOSTILE}")):
        assert not any(char in text for char in RAW), repr(text)
        assert "\\x1b]0;owned\\x07\\x1b[2Jx\\x9b31m\\u202e" in text


class _NoSpace:
    """A registered sink kind whose disk is full: its first frame fails as a full disk does."""

    def __init__(self, arg: str) -> None:
        self.arg = arg

    def write_call(self, call, meta) -> None:
        raise OSError(28, "No space left on device")

    def write_step(self, step) -> None:
        self.write_call(None, None)

    def write_end(self, call) -> None:
        self.write_call(None, None)

    def close(self) -> None:
        pass


def test_status_counts_a_running_call_as_running_not_recorded(tmp_path):
    """A call still generating is not yet recorded (its end may still say why not: a failed request, a detach):
    status counts it in ``running``, and nxl ctl still says the process records; once it ends it is recorded."""
    import threading

    import tiny as tiny_models
    from transformers import AutoModelForCausalLM

    from nxl_hooks.apps.serve.controller import Controller

    model = AutoModelForCausalLM.from_pretrained(tiny_models.save_model(tmp_path / "lm", "llama"))
    controller = Controller(Settings(run_dir=tmp_path / "run"))
    controller.adopt(model, "lm")
    inside, resume, forwards = threading.Event(), threading.Event(), []

    def hold(module, args):  # the second forward waits: the call is running
        forwards.append(1)
        if len(forwards) == 2:
            inside.set()
            resume.wait(timeout=60)

    handle = model.register_forward_pre_hook(hold)
    worker = threading.Thread(target=model.generate, args=(torch.tensor([[1, 5, 7, 9]]),),
                              kwargs={"max_new_tokens": 3, "do_sample": False})
    try:
        worker.start()
        assert inside.wait(timeout=60)
        (held,) = controller.status()["models"]
        said = ctl.describe(controller.status())
        resume.set()
        worker.join(timeout=60)
        (done,) = controller.status()["models"]
    finally:
        resume.set()
        handle.remove()
        controller.close()
    assert (held["calls"], held["recorded"], held["running"]) == (1, 0, 1) and ": recording;" in said
    assert (done["calls"], done["recorded"], done["running"]) == (1, 1, 0)


def test_status_says_recording_after_a_resume_whatever_the_calls_before_it(tmp_path):
    """nxl ctl said "not recording" while every call in memory was unrecorded, also after a pause and resume that
    put a new probe on, which records the next request: the state reads the current probe's calls only. A probe
    whose every call so far ran unrecorded is still "not recording"."""
    import tiny as tiny_models
    from transformers import AutoModelForCausalLM

    from nxl_hooks.apps.serve.controller import Controller

    model = AutoModelForCausalLM.from_pretrained(tiny_models.save_model(tmp_path / "lm", "llama"))
    ids = torch.tensor([[1, 5, 7, 9]])
    resumed, cache = tiny_models.resuming(model, ids)
    controller = Controller(Settings(run_dir=tmp_path / "run"))
    controller.adopt(model, "lm")
    try:
        model.generate(resumed, max_new_tokens=2, do_sample=False, **cache)  # not recorded
        unrecorded = ctl.describe(controller.status())
        controller.pause()
        controller.resume()
        (resumed_status,) = controller.status()["models"]
        resumed_said = ctl.describe(controller.status())
        model.generate(ids, max_new_tokens=2, do_sample=False)
        (recorded,) = controller.status()["models"]
    finally:
        controller.close()
    assert ": not recording;" in unrecorded
    assert (resumed_status["calls"], resumed_status["recorded"]) == (1, 0) and resumed_status["recording"]
    assert ": recording;" in resumed_said
    assert (recorded["calls"], recorded["recorded"], recorded["recording"]) == (2, 1, True)


def test_faults_are_named_in_status_ctl_and_tail(tmp_path, capsys, monkeypatch):
    """A real sink fault (a full disk) and a real unrecorded call (one resuming a filled cache): /v1/status hands them
    out, nxl ctl says them and nxl tail prints each as a line of its own, before its first step however slow the
    status is."""
    import threading
    import time

    import tiny as tiny_models
    from transformers import AutoModelForCausalLM

    import nxl_hooks as nxl
    from nxl_hooks.apps.serve.client import Endpoint, endpoints
    from nxl_hooks.apps.serve.controller import Controller

    path = tiny_models.save_model(tmp_path / "lm", "llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    run = tmp_path / "run"
    nxl.register_sink("nospace-options-test", _NoSpace)
    controller = Controller(Settings(run_dir=run, sink_spec="nospace-options-test:x"))
    ids = torch.tensor([[1, 5, 7, 9]])
    resumed, cache = tiny_models.resuming(model, ids)
    controller.adopt(model, str(path))
    try:
        (healthy,) = controller.status()["models"]
        assert healthy["attached"] and healthy["sink_fault"] is None and healthy["unrecorded"] is None
        assert tail.faults(healthy) == [] and "sink" not in ctl.describe(controller.status())
        model.generate(ids, max_new_tokens=2, do_sample=False)  # the sink fails at the call's first frame
        model.generate(resumed, max_new_tokens=2, do_sample=False, **cache)  # not recorded
        probe = controller.watches()[0].probe
        assert probe.flush()  # the sink thread has met the fault
        assert probe.sink_fault and "No space left on device" in probe.sink_fault and probe.unwritten == 2
        assert probe.unrecorded and "KV cache already holding" in probe.unrecorded
        (endpoint,) = endpoints(str(run))
        (model_status,) = endpoint.json("GET", "/v1/status")["models"]
        assert model_status["sink_fault"] == probe.sink_fault and model_status["unrecorded"] == probe.unrecorded
        assert model_status["unwritten"] == probe.unwritten
        assert probe.unrecorded_calls == model_status["unrecorded_calls"] == 1  # the resumed call alone
        assert tail.faults(model_status) == [f"records not written to the sink: {probe.sink_fault}",
                                             f"1 call {probe.unrecorded}"]
        capsys.readouterr()
        assert cli_main(["ctl", "status", "--run", str(run)]) == 0
        said = capsys.readouterr().out.strip()
        assert said.endswith(f"; records not written to the sink: {probe.sink_fault}; 1 call {probe.unrecorded}")

        status = Endpoint.status
        # a status answered after tail's first steps (a loaded machine): the faults it had on connecting still come
        monkeypatch.setattr(Endpoint, "status", lambda *args, **kwargs: time.sleep(2) or status(*args, **kwargs))
        codes: list[int] = []
        follower = threading.Thread(target=lambda: codes.append(cli_main(["tail", "--run", str(run), "--count", "2"])),
                                    daemon=True)
        follower.start()
        live_reader(controller)  # tail follows steps from now on
        model.generate(input_ids=torch.tensor([[1, 5, 6]]), max_new_tokens=4, do_sample=False)
        follower.join(timeout=60)
        assert codes == [0]
        lines = capsys.readouterr().out.splitlines()
        pid = f"! pid {os.getpid()} {path}"
        assert f"{pid}: records not written to the sink: {probe.sink_fault}" in lines
        assert f"{pid}: 1 call {probe.unrecorded}" in lines
        assert len([line for line in lines if not line.startswith("!")]) == 2  # the two steps asked for
    finally:
        controller.close()


def test_the_controller_and_the_plan_share_one_text_cache(tmp_path):
    import tiny as tiny_models
    from transformers import AutoModelForCausalLM

    from nxl_hooks.apps.serve.controller import Controller
    from nxl_hooks.records.tokens import visible

    path = tiny_models.save_model(tmp_path / "lm", "llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    controller = Controller(Settings(run_dir=tmp_path / "run", target=" film"))  # a named target: tokenizer given
    controller.adopt(model, str(path))
    try:
        (watch,) = controller.watches()
        plan = watch.probe.plan
        assert plan.tokenizer is watch.texts.tokenizer and plan.texts is watch.texts._texts
        ids = watch.texts.tokenizer(" the film", add_special_tokens=False)["input_ids"]
        assert plan.readable(ids) == [visible(watch.texts.tokenizer.decode([i])) for i in ids]
        assert set(ids) <= set(plan.texts._known)  # what the plan read is what the controller's view reads
        assert [watch.texts.text(i) for i in ids] == plan.readable(ids)
    finally:
        controller.close()


def test_a_tokenizer_that_does_not_fit_the_model_leaves_ids_recorded(tmp_path):
    """Under nxl run every model is attached with its own tokenizer (texts in every record), but one with more
    tokens than the model's embedding rows (tokens added, the model not resized) must not leave it unrecorded."""
    import tiny as tiny_models
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nxl_hooks.apps.serve.controller import Controller

    path = tiny_models.save_model(tmp_path / "lm", "llama")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    grown = AutoTokenizer.from_pretrained(path)
    rows = model.get_input_embeddings().num_embeddings
    grown.add_tokens([f"extra{i}" for i in range(rows + 1 - len(grown))])
    grown.save_pretrained(path)
    assert len(AutoTokenizer.from_pretrained(path)) > rows
    controller = Controller(Settings(run_dir=tmp_path / "run"))
    controller.adopt(model, str(path))
    try:
        (watch,) = controller.watches()
        assert watch.error is None and watch.probe is not None
        model.generate(torch.tensor([[1, 5, 7]]), max_new_tokens=2, do_sample=False)
        (call,) = watch.probe.calls
        assert len(call.steps) == 2 and call.readable is None  # recorded, with ids instead of texts
        with pytest.raises(ValueError, match="tokenizer does not match"):  # a named target needs it: said so
            controller.configure(target=" film")
    finally:
        controller.close()


class _FullThenFine:
    """A registered sink kind: its first instance's disk is full, its second writes (keeps nothing), its third
    hangs in its first step write until released (an NFS mount gone away)."""

    made: list["_FullThenFine"] = []

    def __init__(self, arg: str) -> None:
        import threading

        self.number, self.release, self.steps = len(_FullThenFine.made), threading.Event(), 0
        _FullThenFine.made.append(self)

    def write_call(self, call, meta) -> None:
        if self.number == 0:
            raise OSError(28, "No space left on device")

    def write_step(self, step) -> None:
        if self.number == 2:
            self.release.wait(timeout=120)
        self.steps += 1

    def write_end(self, call) -> None:
        pass

    def close(self) -> None:
        pass


def test_status_keeps_what_earlier_probes_lost_across_pause_resume(tmp_path, monkeypatch):
    """A pause takes the probe off, a resume puts a new one on: /v1/status, nxl ctl and nxl tail still say the sink
    fault, the records it left unwritten and the calls not recorded, and count on from there (they read only the
    current probe: after the pause all was "recorded", no fault). A sink stuck when the probe detaches: its fault
    (the newest) and what it held are said too, and what its thread held once it comes back."""
    import tiny as tiny_models
    from transformers import AutoModelForCausalLM

    import nxl_hooks as nxl
    from nxl_hooks.apps.serve.controller import Controller
    from nxl_hooks.hooks import publish

    monkeypatch.setattr(publish, "DRAIN_SECONDS", 0.5)  # how long a detach waits for the stuck sink
    path = tiny_models.save_model(tmp_path / "lm", "llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    model.generation_config.eos_token_id = None  # every step runs
    _FullThenFine.made = []
    nxl.register_sink("full-then-fine-options-test", _FullThenFine)
    controller = Controller(Settings(run_dir=tmp_path / "run", sink_spec="full-then-fine-options-test:x"))
    ids = torch.tensor([[1, 5, 7, 9]])
    resumed, cache = tiny_models.resuming(model, ids)
    controller.adopt(model, str(path))

    def status() -> dict:
        (model_status,) = controller.status()["models"]
        return model_status

    try:
        model.generate(ids, max_new_tokens=2, do_sample=False)  # the sink fails at the call's first frame
        model.generate(resumed, max_new_tokens=2, do_sample=False, **cache)  # not recorded
        first = controller.watches()[0].probe
        assert first.flush()
        fault, why = first.sink_fault, first.unrecorded
        assert "No space left on device" in fault and first.unwritten == 2 and "KV cache already holding" in why
        lost = {"sink_fault": fault, "unwritten": 2, "unrecorded": why, "unrecorded_calls": 1}
        said = [f"records not written to the sink: {fault}", f"1 call {why}"]
        controller.pause()
        paused = status()
        assert not paused["attached"] and {key: paused[key] for key in lost} == lost
        assert tail.faults(paused) == said and ctl.describe(controller.status()).endswith("; ".join(said))
        controller.resume()  # a new probe, a sink that writes
        model.generate(ids, max_new_tokens=3, do_sample=False)
        assert controller.watches()[0].probe.flush()
        resumed = status()
        assert resumed["attached"] and {key: resumed[key] for key in lost} == lost and tail.faults(resumed) == said
        controller.pause()  # the first probe is now counted as it stood, the second as it stands
        assert {key: status()[key] for key in lost} == lost
        controller.resume()  # a sink that hangs
        model.generate(ids, max_new_tokens=3, do_sample=False)
        controller.pause()  # the detach waits DRAIN_SECONDS, then leaves the sink stuck
        stuck = status()
        assert stuck["sink_fault"].startswith("it was still writing when the probe detached")
        assert 2 < stuck["unwritten"] <= 2 + 3 and stuck["unrecorded_calls"] == 1
        hung = controller.watches()[0].detached
        _FullThenFine.made[2].release.set()
        assert hung.flush(timeout=60)  # its thread came back: what it held and did not write is counted too
        assert status()["unwritten"] == 2 + 3 - _FullThenFine.made[2].steps
    finally:
        for sink in _FullThenFine.made:
            sink.release.set()
        controller.close()


def test_a_forward_the_recorder_cannot_follow_is_reported_everywhere(tmp_path, capsys):
    """generate continuing a KV cache filled before the call (positions 0..2), whose forwards the call's record
    never held. The probe, /v1/status, nxl ctl and nxl tail all say 1 call not recorded, with the positions and
    what records it, once; the call record says so too; nothing says "recording" and no more."""
    import inspect
    import threading
    import time

    import tiny as tiny_models
    from transformers import AutoModelForCausalLM, DynamicCache

    import nxl_hooks as nxl  # noqa: F401 - the controller attaches through it
    from nxl_hooks.apps.serve.client import endpoints
    from nxl_hooks.apps.serve.controller import Controller

    path = tiny_models.save_model(tmp_path / "lm", "llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    run = tmp_path / "run"
    controller = Controller(Settings(run_dir=run, sink=False))
    controller.adopt(model, str(path))
    try:
        ids = torch.tensor([[1, 5, 7, 9]])
        # the cache under the keyword this transformers names it (5.24: cache; before: past_key_values)
        keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :3], **{keyword: cache}, use_cache=True)
        assert cache.get_seq_length() == 3
        model.generate(ids, max_new_tokens=2, do_sample=False, **{keyword: cache})
        probe = controller.watches()[0].probe
        assert probe.unrecorded_calls == 1
        assert probe.unrecorded.startswith("not recorded: generate was given a KV cache already holding positions "
                                           "0..2") and probe.unrecorded.endswith("generate from the full prompt "
                                                                                 "without that cache (leave out "
                                                                                 "cache / past_key_values)")
        (call,) = probe.calls
        assert call.steps == [] and call.error == probe.unrecorded
        (endpoint,) = endpoints(str(run))
        (model_status,) = endpoint.json("GET", "/v1/status")["models"]
        assert model_status["unrecorded_calls"] == 1 and model_status["unrecorded"] == probe.unrecorded
        capsys.readouterr()
        assert cli_main(["ctl", "status", "--run", str(run)]) == 0
        said = capsys.readouterr().out.strip()
        # recording: the program's own forward that filled the cache is kept as a request (a causal LM's plain
        # forwards are), the generate call that continued it is not
        assert said.startswith(f"pid {os.getpid()}: recording; ") and "2 requests in memory" in said
        assert said.endswith(f"; 1 call {probe.unrecorded}")

        codes: list[int] = []
        follower = threading.Thread(target=lambda: codes.append(cli_main(["tail", "--run", str(run), "--count", "1"])),
                                    daemon=True)
        follower.start()
        live_reader(controller)  # tail follows steps from now on
        time.sleep(1.0)  # and its first status poll (begun beside the subscription) made by then
        model.generate(input_ids=torch.tensor([[1, 5, 6]]), max_new_tokens=1, do_sample=False)  # followed: 1 step
        follower.join(timeout=60)
        assert codes == [0]
        lines = capsys.readouterr().out.splitlines()
        assert f"! pid {os.getpid()} {path}: 1 call {probe.unrecorded}" in lines  # its prefix said once
        assert probe.unrecorded_calls == 1 and len(probe.calls[-1].steps) == 1  # the followed call is recorded
    finally:
        controller.close()


def test_an_endpoint_serves_when_the_users_live_run_list_cannot_be_kept(tmp_path, monkeypatch, caplog):
    """Another user who made /tmp/nxl-<uid> first (one mkdir) made every endpoint of this user fail to start, its
    socket left bound and dead: the live-run list is a convenience, so the endpoint serves without it and says so."""
    from nxl_hooks.apps.serve import endpoint as endpoint_module
    from nxl_hooks.apps.serve.client import endpoints
    from nxl_hooks.apps.serve.controller import Controller

    def squatted(sock):
        raise PermissionError("/tmp/nxl-1001 is not a private folder of this user: remove it, or pass --sink DIR")

    monkeypatch.setattr(endpoint_module, "enlist", squatted)
    controller = Controller(Settings(run_dir=tmp_path / "run"))
    server = endpoint_module.ControlServer(controller)
    server.start()
    try:
        (endpoint,) = endpoints(str(tmp_path / "run"))
        assert endpoint.json("GET", "/v1/status")["paused"] is False
        assert "is not among this user's live runs (PermissionError" in caplog.text and "--run" in caplog.text
    finally:
        server.stop()
        controller.close()
    assert not server.socket.exists()


def test_max_memory_takes_every_size_accelerate_reads_and_refuses_what_it_cannot():
    """Sizes as accelerate reads them (a float, then a unit in any case; ASCII digits alone are bytes) pass, as they
    loaded before sizes were checked; what accelerate refuses, or reads as another number, is one line."""
    from accelerate.utils.modeling import convert_file_size_to_int

    from nxl_hooks.apps.loading_options import read_max_memory

    for size in ("10 GiB", "1e1GiB", ".5GB", "2mib", "1.5KB"):
        assert read_max_memory(f"cpu={size}") == {"cpu": size}
        assert convert_file_size_to_int(size) > 0  # (what the load does with it)
    assert read_max_memory("cpu=100000") == {"cpu": 100000}
    assert Loading.from_json('{"device_map": "auto", "max_memory": {"cpu": "10 GiB"}}').max_memory == {"cpu": "10 GiB"}
    for size in ("²", "٣٠٠", "inf GiB", "-1GiB", "10XB", "GiB"):  # ('٣٠٠': Arabic-Indic digits, no unit)
        with pytest.raises(ValueError, match="is no size: give bytes"):
            read_max_memory(f"cpu={size}")
    with pytest.raises(ValueError, match="'²'"):  # a device named so is no accelerator number
        read_max_memory("²=1GiB")


def test_a_device_map_with_the_whole_model_is_refused_only_beside_a_module_on_disk():
    """"" (the root module) beside modules on disk does not load; beside modules on the same device, however
    written (cpu, cpu:0), it does, and is passed on as given."""
    from nxl_hooks.apps.loading_options import read_device_map

    assert read_device_map('{"": "cpu", "lm_head": "cpu:0"}') == {"": "cpu", "lm_head": "cpu:0"}
    with pytest.raises(ValueError, match=r"beside modules on disk does not load"):
        read_device_map('{"": "cpu", "lm_head": "disk"}')


@pytest.mark.version_free
def test_an_empty_device_map_is_refused_in_one_line():
    """--device-map '{}' (or device_map={}, or NXL_LOAD's) places nothing: transformers raised KeyError: '', which the
    command line said as the one word ''."""
    from nxl_hooks.apps.loading_options import read_device_map

    for read in (lambda: read_device_map("{}"), lambda: Loading(device_map={}),
                 lambda: Loading.from_json('{"device_map": {}}')):
        with pytest.raises(ValueError, match=r"\{\}: an empty mapping places no module; give auto, a device, or a "
                                             r"mapping \{module: device\}\)?$"):  # (NXL_LOAD's: in brackets)
            read()


@pytest.mark.version_free
def test_ctl_models_glob_that_matches_no_model_changes_nothing_and_says_so(tmp_path, capsys):
    """nxl ctl attach/detach --models GLOB where GLOB matched no loaded model answered 200 and exit 0, changing no
    model, while attach made its options the process's for models loaded later. Now: a glob that matches in no
    process of the run is one line naming it and the models loaded (exit 2), and no process changed; one that
    matches in one process changes that one, and a process where it matches nothing keeps its options."""
    import json

    import tiny as tiny_models
    from transformers import AutoModelForCausalLM

    from nxl_hooks.apps.serve.controller import Controller

    run = tmp_path / "run"  # a run of two processes: each one's socket, as nxl run puts them in one folder
    run.mkdir()
    controllers, models = [], []  # (the controllers hold their models weakly)
    for name in ("alpha", "beta"):
        path = tiny_models.save_model(tmp_path / name, "llama")
        controller = Controller(Settings(run_dir=tmp_path / f"run-{name}"))
        models.append(AutoModelForCausalLM.from_pretrained(path))
        controller.adopt(models[-1], str(path))
        controllers.append(controller)
        (run / f"{len(controllers)}.sock").symlink_to(controller.endpoint.socket)
    alpha, beta = controllers

    def state() -> list:
        return [(c.options, [(w.probe.layers if w.probe else None, w.excluded) for w in c.watches()])
                for c in controllers]

    try:
        before = state()
        assert before[0][1] == [([0, 1, 2], False)]
        capsys.readouterr()
        for action in (["attach", "--layers", "last"], ["detach"]):
            assert cli_main(["ctl", *action, "--models", "gamma*", "--run", str(run)]) == 2
            out, err = capsys.readouterr()
            assert out == "" and err == (f"nxl ctl: error: --models gamma* matches none of the models loaded in the "
                                         f"run ({tmp_path / 'alpha'}, {tmp_path / 'beta'}); nothing changed: give a "
                                         "glob of one of them\n")
            assert state() == before
        assert cli_main(["ctl", "attach", "--layers", "last", "--models", "bet*", "--run", str(run), "--json"]) == 0
        said = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [s["models"][0]["layers"] for s in said] == [[0, 1, 2], [2]]  # each process's line, alpha's unchanged
        assert alpha.options == before[0][0] and beta.options["layers"] == "last"
        assert cli_main(["ctl", "detach", "--models", "alpha", "--run", str(run)]) == 0
        assert [watch.excluded for c in controllers for watch in c.watches()] == [True, False]
    finally:
        for controller in controllers:
            controller.close()


def test_the_output_check_of_one_rank_never_makes_or_removes_the_folder_another_rank_writes_in(tmp_path, monkeypatch):
    """Every rank of a sharded run checks --out before its model loads. The check made the missing folder itself and
    removed it: another rank finding it made wrote its own check's file in it, and the first rank's removal failed
    (refused: 'cannot be made (Directory not empty)'), or removed it under the other. It now tries a folder of a name
    of its own beside it: another rank making the folder and writing in it meanwhile is left alone."""
    from nxl_hooks.records.files import cannot_write_in

    out = tmp_path / "shared" / "out"
    rmdir = os.rmdir

    def another_rank_meanwhile(path, *args, **kwargs):  # the moment before the check undoes what it made
        out.mkdir(parents=True, exist_ok=True)
        (out / "rank1.part").write_text("rank 1's records")
        return rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", another_rank_meanwhile)
    assert cannot_write_in(out, out / "records.jsonl") is None
    monkeypatch.undo()
    assert (out / "rank1.part").read_text() == "rank 1's records"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["shared"]  # the check left nothing of its own
