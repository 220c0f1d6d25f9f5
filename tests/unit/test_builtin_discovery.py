"""Built-in sink kinds and engines are found from their modules, as methods are: a new one is one file."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import nxl_hooks
from nxl_hooks.apps.extras import extra_hint
from nxl_hooks.hooks import engines
from nxl_hooks.records import sinks


def test_every_builtin_sink_kind_maps_to_the_factory_its_module_declares():
    assert set(sinks.builtin_kinds()) == {"file", "folder", "parquet"}
    for kind, declared in sinks.builtin_kinds().items():
        factory, arg = sinks.sink_factory(f"{kind}:somewhere", here=False)
        assert (factory.__module__, factory.__name__, arg) == (declared["module"], declared["factory"], "somewhere")
    assert sinks.requirement("parquet") == ("pyarrow.parquet", "parquet") and sinks.requirement("file") is None


def test_listing_the_sink_kinds_imports_no_sink_module_nor_its_extra():
    code = ("import sys; from nxl_hooks.records import sinks; sinks.kind_name('parquet:x.parquet')\n"
            "print(sorted(sinks.builtin_kinds()), 'nxl_hooks.records.parquet' in sys.modules, 'pyarrow' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.split("\n")[0] == "['file', 'folder', 'parquet'] False False", done.stderr[-2000:]


@pytest.fixture
def dropped(tmp_path, monkeypatch):
    """A folder added to the package paths of nxl_hooks.records and nxl_hooks.hooks.engines, for a module dropped
    in there; the discovery caches cleared around the test."""
    for package in (nxl_hooks.records, engines):
        monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    for cached in (sinks.builtin_kinds, engines.builtin_engines):
        cached.cache_clear()
    yield tmp_path
    for cached in (sinks.builtin_kinds, engines.builtin_engines):
        cached.cache_clear()
    for name in ("nxl_hooks.records.tsvsink", "nxl_hooks.hooks.engines.toy"):
        sys.modules.pop(name, None)


def test_a_sink_module_dropped_into_the_package_is_a_kind_with_its_extra(dropped):
    (dropped / "tsvsink.py").write_text(textwrap.dedent('''
        class TsvSink:
            def __init__(self, path, **options):
                self.path = path

        SINKS = {"tsv": {"factory": "TsvSink", "needs": "nxl_no_such_module.sub", "extra": "tsv"}}
        '''))
    assert sinks.kind_name("tsv:out.tsv") == "tsv"
    factory, arg = sinks.sink_factory("tsv:out.tsv", here=False)
    assert (factory.__name__, arg) == ("TsvSink", "out.tsv")
    with pytest.raises(ImportError) as missing:  # made here: what it needs is checked first
        sinks.sink_factory("tsv:out.tsv")
    assert extra_hint(missing.value) == ('this needs nxl_no_such_module, from the optional extra [tsv]: '
                                         'pip install "nxl_hooks[tsv]"')
    with pytest.raises(ValueError, match=r"known: [^)]*\btsv\b"):
        sinks.make_sink("nokind:x")


def test_a_sink_module_installed_compiled_alone_is_still_a_kind(dropped):
    """An install that ships .pyc files without their sources (compileall -b, then the .py removed): the module
    has no source to read its declaration from, so it is imported and asked (the built-in kinds were all lost,
    'file' included, and attach(sink="x.nxl") failed with a KeyError)."""
    import py_compile

    source = dropped / "tsvsink.py"
    source.write_text('class TsvSink:\n    pass\n\nSINKS = {"tsv": {"factory": "TsvSink"}}\n')
    py_compile.compile(str(source), cfile=str(dropped / "tsvsink.pyc"), doraise=True)
    source.unlink()
    assert sinks.kind_name("tsv:out.tsv") == "tsv"
    assert sinks.sink_factory("tsv:out.tsv")[0].__name__ == "TsvSink"


def test_every_builtin_engine_is_found_in_its_module():
    found = engines.builtin_engines()
    assert {name: factory.__module__ for name, factory in found.items()} == {
        "transformers-continuous-batching": "nxl_hooks.hooks.engines.transformers_cb",
        "vllm": "nxl_hooks.hooks.engines.vllm"}


def test_an_engine_module_dropped_into_the_package_follows_a_model(dropped):
    (dropped / "toy.py").write_text(textwrap.dedent('''
        class ToyEngine:
            name, unfollowed = "toy", None

            def claims(self, model):
                return True

            def install(self, gens):
                pass

            def uninstall(self):
                pass

            def stray(self, arguments):
                return None

        ENGINE = ToyEngine
        '''))
    assert "toy" in [engine.name for engine in engines.engines_for(object())]
