"""Plugins through entry points (``nxl_hooks.arch.plugins``): a plugin of each group (architectures, engines, sinks,
methods) declared by a real ``*.dist-info/entry_points.txt`` on a temporary ``sys.path`` entry is used with no edit
to nxl_hooks; a broken plugin of each group leaves the host's call unchanged and says so in one line; the
``NXL_PLUGINS`` allow-list decides which load."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import nxl_hooks as nxl
import tiny
from nxl_hooks.arch import plugins, registry
from nxl_hooks.hooks import engines
from nxl_hooks.records import sinks
from oracle import check_call

#: A third party's package: one module with an object for each group.
GOOD = textwrap.dedent('''
    from nxl_hooks.arch.registry import ArchSpec


    def toy_architecture():
        return ArchSpec(name="toy-plugin", model_types=("nxl_toy",), blocks="model.layers",
                        heads={"causal_lm": ("model.norm", "lm_head")}, source="the toy plugin")


    class CollectSink:
        made = []

        def __init__(self, arg, **options):
            self.arg, self.calls, self.steps, self.ends, self.closed = arg, [], [], [], False
            CollectSink.made.append(self)

        def write_call(self, call, meta):
            self.calls.append(meta)

        def write_step(self, step):
            self.steps.append(step)

        def write_end(self, call):
            self.ends.append(call.complete)

        def close(self):
            self.closed = True


    class ToyEngine:
        name, unfollowed, installed = "toy", None, []

        def claims(self, model):
            return True

        def install(self, gens):
            ToyEngine.installed.append(gens.plan.model)

        def uninstall(self):
            ToyEngine.installed.append("uninstalled")

        def stray(self, arguments):
            return None


    class ToyMethod:
        name = "toy-method"
''')



def _points(module, architecture, sink, engine, method):
    """An entry_points.txt declaring one plugin of each group, all in ``module``."""
    return (f"[nxl_hooks.architectures]\n{architecture} = {module}:toy_architecture\n\n"
            f"[nxl_hooks.sinks]\n{sink} = {module}:CollectSink\n\n"
            f"[nxl_hooks.engines]\n{engine} = {module}:ToyEngine\n\n"
            f"[nxl_hooks.methods]\n{method} = {module}:ToyMethod\n")


GOOD_POINTS = _points("nxl_good_plugin", "nxl_toy", "collect", "toy", "toy-method")
BROKEN_POINTS = _points("nxl_broken_plugin", "nxl_toy", "broken", "broken", "broken")

#: A package that fails to import, and leaves a mark each time something tries.
BROKEN = "open({mark!r}, 'a').write('imported\\n')\nraise ImportError('needs a package that is not installed')\n"

_GROUPS = {"architectures": plugins.ARCHITECTURES, "sinks": plugins.SINKS, "engines": plugins.ENGINES,
           "methods": plugins.METHODS}


def _distribution(site, name, module_source, points):
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(points)
    (site / f"{name}.py").write_text(module_source)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for the test's distributions; the loader, the registries and the modules as they were
    after the test."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delenv(plugins.SETTING, raising=False)
    for name in ("_points", "_loaded", "_failed"):
        monkeypatch.setattr(plugins, name, {})
    monkeypatch.setattr(registry, "_SPECS", registry.specs())
    monkeypatch.setattr(sinks, "_KINDS", dict(sinks._KINDS))
    monkeypatch.setattr(engines, "_FACTORIES", dict(engines._FACTORIES))
    yield folder
    for module in ("nxl_good_plugin", "nxl_broken_plugin"):
        sys.modules.pop(module, None)


def _broken(site, points=BROKEN_POINTS):
    mark = site.parent / "imported"
    _distribution(site, "nxl_broken_plugin", BROKEN.format(mark=str(mark)), points)
    return mark


def _toy_model():
    """The generating Llama under a model_type no registry entry names (generic discovery would take it)."""
    model = tiny.generating_llama()
    model.config.model_type = "nxl_toy"
    return model


def _generate(model):
    return model.generate(input_ids=torch.tensor([[5, 9, 12, 7]]), max_new_tokens=3, do_sample=False)


def test_a_plugin_of_each_group_is_used_through_its_entry_point(site):
    _distribution(site, "nxl_good_plugin", GOOD, GOOD_POINTS)
    model = _toy_model()
    plain = _generate(model)
    with nxl.attach(model, layers="all", sink="collect:anywhere") as probe:
        out = _generate(model)
    good = sys.modules["nxl_good_plugin"]
    assert torch.equal(out, plain)
    assert probe.describe()["spec"] == "toy-plugin"  # the architecture plugin's spec, not generic discovery
    (call,) = probe.calls
    check_call(model, call, 3)  # the plugin's spec gives the oracle's numbers
    (sink,) = good.CollectSink.made
    assert sink.arg == "anywhere" and sink.closed and sink.ends == [True]
    assert [step.token.tolist() for step in sink.steps] == [step.token.tolist() for step in call.steps]
    assert good.ToyEngine.installed == [model, "uninstalled"]
    registered = []
    assert plugins.load_all(plugins.METHODS, register=lambda *given: registered.append(given)) == {
        "toy-method": good.ToyMethod}
    assert registered == [("toy-method", good.ToyMethod)]  # what a registry's one-line call gets
    assert plugins.load(plugins.METHODS, "toy-method") is good.ToyMethod


def test_a_broken_plugin_of_each_group_leaves_the_host_call_unchanged_with_one_line(site, caplog):
    _broken(site)
    model = _toy_model()
    plain = _generate(model)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        with nxl.attach(model, layers="all") as probe:  # the architecture and engine plugins are asked here
            out = _generate(model)
        assert plugins.load_all(plugins.METHODS) == {}
        with pytest.raises(ValueError) as refused:  # a sink named by the user: refused, before any hook goes on
            nxl.attach(model, sink="broken:x")
        with nxl.attach(model, layers="all") as again:  # asked again: no second line
            _generate(model)
    assert torch.equal(out, plain)
    assert probe.describe()["spec"] == "discovered:nxl_toy" and again.calls[0].complete
    check_call(model, probe.calls[0], 3)
    lines = [record.getMessage() for record in caplog.records if record.name == "nxl_hooks"]
    assert len(lines) == 3, lines  # architecture, engine, method: one line each, once
    for group, name in (("architectures", "nxl_toy"), ("engines", "broken"), ("methods", "broken")):
        (line,) = [line for line in lines if f"plugin {name!r} (nxl_hooks.{group}" in line]
        assert "\n" not in line and "not installed" in line and "uninstall its package" in line
        assert plugins.SETTING in line
    message = str(refused.value)
    assert "\n" not in message and "plugin 'broken' (nxl_hooks.sinks" in message and "not installed" in message
    assert nxl.detach_all(model) == 0


def test_a_plugin_its_registry_refuses_is_left_out_with_one_line_once(site, caplog):
    _distribution(site, "nxl_good_plugin", GOOD, GOOD_POINTS)

    def refuse(name, method):
        raise ValueError(f"entry point {name!r} gives a method named 'other': the names must match")

    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        assert plugins.load_all(plugins.METHODS, register=refuse) == {}
        assert plugins.load_all(plugins.METHODS, register=refuse) == {}  # asked again: no second line
    (line,) = [record.getMessage() for record in caplog.records]
    assert "plugin 'toy-method' (nxl_hooks.methods)" in line and "names must match" in line
    assert plugins.failure(plugins.METHODS, "toy-method") in line


#: A third party's package that imports, and whose code exits the process when it is called.
EXITING = textwrap.dedent('''
    import sys


    def toy_architecture():
        sys.exit("the architecture plugin gave up")


    class ToyEngine:
        def __init__(self):
            sys.exit("the engine plugin gave up")


    class ExitingEngine:
        name, unfollowed = "exiting", None

        def claims(self, model):
            return True

        def install(self, gens):
            sys.exit("the engine gave up installing")

        def uninstall(self):
            sys.exit("the engine gave up uninstalling")

        def stray(self, arguments):
            return None


    class ToyMethod:
        name = "toy-method"

        def __init__(self):
            sys.exit("the method plugin gave up")
''')


def test_a_plugin_whose_code_raises_systemexit_is_left_out_with_one_line(site, caplog):
    """Not at import (the loader's own line) but when it is called: an architecture function, an engine factory,
    an engine's install and uninstall, a method class made by the registry. Each is that plugin's line; the
    host's attach, generate, detach and method lookups go on as without it. Ctrl-C is still the user's."""
    _distribution(site, "nxl_exiting_plugin", EXITING,
                  "[nxl_hooks.architectures]\nnxl_toy = nxl_exiting_plugin:toy_architecture\n\n"
                  "[nxl_hooks.engines]\ntoy = nxl_exiting_plugin:ToyEngine\n"
                  "exiting = nxl_exiting_plugin:ExitingEngine\n\n"
                  "[nxl_hooks.methods]\ntoy-method = nxl_exiting_plugin:ToyMethod\n")
    model = _toy_model()
    plain = _generate(model)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        with nxl.attach(model, layers="all") as probe:
            out = _generate(model)
        names = nxl.method_names()
        with pytest.raises(ValueError) as unknown:
            nxl.get_method("toy-method")
    sys.modules.pop("nxl_exiting_plugin", None)
    assert torch.equal(out, plain) and probe.describe()["spec"] == "discovered:nxl_toy"
    check_call(model, probe.calls[0], 3)
    assert "toy-method" not in names and "normxlogit" in names
    assert "SystemExit: the method plugin gave up" in str(unknown.value)
    lines = [record.getMessage() for record in caplog.records if record.name == "nxl_hooks"]
    for said in ("architecture plugin gave up", "engine plugin gave up", "engine gave up installing",
                 "engine gave up uninstalling", "method plugin gave up"):
        (line,) = [line for line in lines if f"(SystemExit: the {said})" in line]  # each once, in one line
        assert "\n" not in line
    assert nxl.detach_all(model) == 0
    with pytest.raises(KeyboardInterrupt):
        plugins.contained(KeyboardInterrupt())


def test_a_plugin_whose_error_cannot_be_printed_is_left_out_with_one_line(site, caplog):
    """A plugin that raises on import an error whose ``__str__`` raises: its line says ``<unprintable TYPE>`` (the
    loader's report raised into the host's lookup)."""
    _distribution(site, "nxl_unprintable_plugin",
                  "class Unprintable(Exception):\n    def __str__(self):\n        raise ValueError('no text')\n"
                  "raise Unprintable()\n", "[nxl_hooks.sinks]\nodd = nxl_unprintable_plugin:Sink\n")
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        assert plugins.load(plugins.SINKS, "odd") is None
    line = plugins.failure(plugins.SINKS, "odd")
    assert "(Unprintable: <unprintable Unprintable>)" in line and "\n" not in line
    assert [r.getMessage() for r in caplog.records if "nxl_unprintable_plugin" in r.getMessage()] == [
        f"nxl_hooks: {line}"]


def test_nxl_run_refuses_a_broken_sink_plugin_in_one_line(site):
    _broken(site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "nxl_hooks", "run", "--sink", "broken:x", "--", "true"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "plugin 'broken' (nxl_hooks.sinks" in done.stderr and "not installed" in done.stderr


@pytest.mark.parametrize("setting, expected", [
    (None, {"architectures": ["nxl_toy"], "sinks": ["broken", "collect"], "engines": ["broken", "toy"],
            "methods": ["broken", "toy-method"]}),
    ("", {"architectures": [], "sinks": [], "engines": [], "methods": []}),
    ("collect, engines:toy,toy-method", {"architectures": [], "sinks": ["collect"], "engines": ["toy"],
                                        "methods": ["toy-method"]}),
])
def test_the_allow_list_decides_which_plugins_load(site, monkeypatch, caplog, setting, expected):
    _distribution(site, "nxl_good_plugin", GOOD, GOOD_POINTS)
    mark = _broken(site, BROKEN_POINTS.replace("nxl_toy =", "nxl_other ="))
    if setting is not None:
        monkeypatch.setenv(plugins.SETTING, setting)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        found = {short: sorted(plugins.load_all(group)) for short, group in _GROUPS.items()}
        with nxl.attach(_toy_model()) as probe:
            spec = probe.describe()["spec"]
    # a broken plugin that the list lets load is the one line it always is; not loaded, it is never imported
    assert found == {short: [name for name in names if name != "broken"] for short, names in expected.items()}
    broken_allowed = any("broken" in names for names in expected.values())
    assert mark.exists() == broken_allowed
    lines = [r.getMessage() for r in caplog.records if "nxl_broken_plugin" in r.getMessage()]
    assert len(lines) == (4 if broken_allowed else 0), lines  # each allowed broken plugin: its line, once
    assert spec == ("toy-plugin" if "nxl_toy" in expected["architectures"] else "discovered:nxl_toy")
    if "collect" not in expected["sinks"]:
        with pytest.raises(ValueError, match="no sink kind 'collect'"):
            nxl.attach(_toy_model(), sink="collect:x")


def test_a_sink_plugin_named_as_a_built_in_kind_never_takes_its_records(site, tmp_path):
    """``file:``/``folder:`` write the crash-safe stream: a plugin of that name (it took them) is never used."""
    _distribution(site, "nxl_good_plugin", GOOD, "[nxl_hooks.sinks]\nfile = nxl_good_plugin:CollectSink\n"
                                                 "folder = nxl_good_plugin:CollectSink\n")
    model = _toy_model()
    with nxl.attach(model, sink=f"file:{tmp_path / 'run.nxl'}") as probe:
        _generate(model)
    with nxl.attach(model, sink=f"folder:{tmp_path / 'runs'}"):
        _generate(model)
    assert "nxl_good_plugin" not in sys.modules
    (call,) = nxl.read_stream(tmp_path / "run.nxl")
    assert [step.token.tolist() for step in call.steps] == [step.token.tolist() for step in probe.calls[0].steps]
    assert len(nxl.read_stream(tmp_path / "runs")) == 1


#: An architecture plugin whose entry names the shipped 'llama' beside (or instead of) its own model type.
SHADOWING = textwrap.dedent('''
    import nxl_hooks as nxl
    from nxl_hooks.arch.registry import ArchSpec

    CALLS = []


    def llama_too():
        CALLS.append("llama_too")
        return ArchSpec(name="toy-plugin", model_types=("nxl_toy", "llama"), blocks="model.blocks",
                        heads={"causal_lm": ("model.norm", "lm_head")})


    def llama_only():
        CALLS.append("llama_only")
        return ArchSpec(name="toy-plugin", model_types=("llama",), blocks="model.layers",
                        heads={"causal_lm": ("model.norm", "lm_head")})


    def half_done():
        nxl.register_architecture("nxl_half", blocks="model.layers", heads={"causal_lm": ["model.norm", "lm_head"]})
        raise RuntimeError("gave up after registering")
''')


def test_an_architecture_plugin_adds_only_new_model_types_and_is_named_in_its_entrys_messages(site, caplog):
    """Attaching a model of the plugin's type replaced the shipped 'llama' entry for every later Llama; a plugin
    giving no entry for its own type was called again at each attach with no word; its entry's refusal read
    'registry entry [toy-plugin] in :', naming nothing to fix."""
    _distribution(site, "nxl_shadowing_plugin", SHADOWING,
                  "[nxl_hooks.architectures]\nnxl_toy = nxl_shadowing_plugin:llama_too\n"
                  "nxl_other = nxl_shadowing_plugin:llama_only\nnxl_half = nxl_shadowing_plugin:half_done\n")
    shipped = registry.specs()["llama"]
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        with pytest.raises(registry.RegistryError) as refused:  # its own entry is its, and says whose it is
            nxl.attach(_toy_model())
        other = _toy_model()
        other.config.model_type = "nxl_other"
        for _ in range(2):
            with nxl.attach(other, layers="all") as probe:
                _generate(other)
        half = _toy_model()
        half.config.model_type = "nxl_half"
        with nxl.attach(half) as failed:  # what a failed plugin registered is undone, as if it were not installed
            pass
    assert failed.describe()["spec"] == "discovered:nxl_half" and "nxl_half" not in registry.specs()
    calls = sys.modules.pop("nxl_shadowing_plugin").CALLS
    assert calls == ["llama_too", "llama_only"]  # once each
    assert "[toy-plugin] in plugin 'nxl_toy' (nxl_hooks.architectures): key 'blocks'" in str(refused.value)
    assert registry.specs()["llama"] is shipped and registry.is_shipped(shipped)
    assert probe.describe()["spec"] == "discovered:nxl_other"
    check_call(other, probe.calls[0], 3)
    lines = [record.getMessage() for record in caplog.records if record.name == "nxl_hooks"]
    assert sum("also gave entries for 'llama'" in line for line in lines) == 2, lines  # one per plugin
    (line,) = [line for line in lines if "plugin 'nxl_other'" in line and "failed" in line]
    assert "no entry for model_type 'nxl_other' (only for 'llama')" in line and "\n" not in line


def test_an_architecture_plugin_giving_neither_specs_nor_a_path_says_what_it_gave_in_one_line(site, caplog):
    """A function that returned a number was said as "TypeError: 'int' object is not iterable", which names
    neither what it gave nor what it should give."""
    _distribution(site, "nxl_odd_plugin", "def number():\n    return 42\n",
                  "[nxl_hooks.architectures]\nnxl_toy = nxl_odd_plugin:number\n")
    model = _toy_model()
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        probe = nxl.attach(model, layers="all")  # the plugin is asked here, left out, and the model attached
    sys.modules.pop("nxl_odd_plugin", None)
    with probe:
        out = _generate(model)
    assert torch.equal(out, _generate(model)) and probe.describe()["spec"] == "discovered:nxl_toy"
    check_call(model, probe.calls[0], 3)
    (line,) = [record.getMessage() for record in caplog.records if "plugin 'nxl_toy'" in record.getMessage()]
    assert "(TypeError: it gave 42; expected ArchSpecs, a TOML file's path, or None" in line and "\n" not in line


def test_a_model_left_undiscovered_when_its_architecture_plugin_failed_is_refused_naming_that_plugin(site, caplog):
    """A BERT-like encoder (no final norm: generic discovery finds nothing) whose own plugin failed to import was
    refused as "no registry entry names it and generic discovery found no blocks/final norm/head", saying nothing
    of the installed plugin that names it: only a log line did. The refusal now carries that plugin's line."""
    _broken(site, "[nxl_hooks.architectures]\nnxl_bertlike = nxl_broken_plugin:toy_architecture\n")
    model = tiny.build_model("bert")
    model.config.model_type = "nxl_bertlike"
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        with pytest.raises(nxl.UnknownArchitectureError) as refused:
            nxl.attach(model)
    (line,) = [r.getMessage() for r in caplog.records if "plugin 'nxl_bertlike'" in r.getMessage()]
    told = str(refused.value)
    assert told.startswith("model_type 'nxl_bertlike' (BertForSequenceClassification) is not supported: no "
                           "registry entry names it, and its plugin 'nxl_bertlike' (nxl_hooks.architectures, "
                           "nxl_broken_plugin:toy_architecture) failed to load (ImportError: needs a package that is "
                           "not installed); left out: fix or uninstall its package"), told
    assert line.removeprefix("nxl_hooks: ") in told and "\n" not in told and "nxl.register_architecture(" in told
    assert nxl.detach_all(model) == 0


#: Engine plugins written wrong: one lacking ``stray``, one whose factory takes an argument.
WRONG_ENGINES = textwrap.dedent('''
    class NoStray:
        name, unfollowed = "nostray", None
        claims = install = uninstall = staticmethod(lambda *given: True)


    def needs_argument(settings):
        return NoStray()
''')


def test_an_engine_plugin_that_cannot_be_made_is_its_plugin_line_once_per_process(site, caplog):
    """Each attach logged "engine 'nostray' not recorded (TypeError: ... lacks one of name, unfollowed, claims,
    install, uninstall or stray ...)" again, naming neither the plugin nor the member it lacks, where plugins.md
    promises the plugin's line, once per process."""
    _distribution(site, "nxl_wrong_engines", WRONG_ENGINES,
                  "[nxl_hooks.engines]\nnostray = nxl_wrong_engines:NoStray\n"
                  "needs = nxl_wrong_engines:needs_argument\n")
    model = _toy_model()
    plain = _generate(model)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        for _ in range(2):
            with nxl.attach(model, layers="all") as probe:
                out = _generate(model)
            assert torch.equal(out, plain)
            check_call(model, probe.calls[0], 3)
    sys.modules.pop("nxl_wrong_engines", None)
    lines = [record.getMessage() for record in caplog.records if record.name == "nxl_hooks"]
    assert lines == [
        "nxl_hooks: plugin 'nostray' (nxl_hooks.engines) failed to load (TypeError: it made 'NoStray', which lacks "
        "stray (an Engine has name, unfollowed, claims, install, uninstall, stray)); left out: fix or uninstall its "
        "package, or leave it out of NXL_PLUGINS",
        "nxl_hooks: plugin 'needs' (nxl_hooks.engines) failed to load (TypeError: needs_argument() missing 1 "
        "required positional argument: 'settings'); left out: fix or uninstall its package, or leave it out of "
        "NXL_PLUGINS"]


def test_nxl_run_refuses_a_sink_plugin_whose_factory_takes_no_arg_in_one_line(site):
    """The program started, and each model it loaded ran unrecorded, said only in the program's log."""
    _distribution(site, "nxl_noarg_sink", "def no_arg():\n    raise AssertionError('never called')\n",
                  "[nxl_hooks.sinks]\nnoarg = nxl_noarg_sink:no_arg\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "nxl_hooks", "run", "--sink", "noarg:x", "--", "true"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "sink 'noarg:x': its factory no_arg cannot be called as factory(ARG, **options)" in done.stderr
