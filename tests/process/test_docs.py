"""The documentation holds together: the MkDocs site builds in strict mode (a broken link, a missing page in the nav
or an API reference that names nothing fails), every public name is in the API reference, README's links and
anchors lead somewhere, README keeps the test command CI runs, the changelog's table of removed module paths is
true of the code, the version is one number everywhere, the server page sends a running process to `nxl attach`,
whose rules as root docs/security.md states, README and docs/engines.md state the committed 16-client serving
figures, and the package is typed for type checkers as docs/api.md says.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nxl_hooks

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
#: What the 0.1 redirect table held for these names (tests/unit/test_layers.py checked them through the redirect): the
#: changelog must send each old path to a module that really has the name.
OLD_NAMES = [("evaluate", "score_example"), ("stream", "read_stream"), ("stream", "print_generation"),
             ("capture", "attach"), ("capture", "resolve_layers"), ("registry", "specs"), ("viz", "heatmap"),
             ("viz", "audit_report"), ("cli", "main"), ("head", "module_device")]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    # In a child process: mkdocstrings imports and inspects the package, and the snippets extension reads
    # CHANGELOG.md relative to the working directory.
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = _build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, f"mkdocs build --strict failed (pip install -e '.[docs]'):\n{done.stderr[-4000:]}"
    return out


def _copy_of_the_docs(tmp_path: Path) -> Path:
    for name in ("mkdocs.yml", "CHANGELOG.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path / "mkdocs.yml"


def test_site_builds_in_strict_mode(site):
    pages = {path.parent.name for path in site.glob("*/index.html")}
    assert {"command-line", "python", "server", "benchmarks", "api", "changelog", "testing"} <= pages
    assert "0.2.0" in (site / "changelog" / "index.html").read_text(encoding="utf-8")  # the snippet was included


@pytest.mark.parametrize("plant, says", [
    ("[gone](no-such-page.md)", "no-such-page.md"),
    ("::: nxl_hooks.no_such_name", "no_such_name"),
])
def test_strict_build_fails_on_a_broken_link_or_reference(tmp_path, plant, says):
    """The check itself: the same configuration refuses a page with a dead link or an API entry naming nothing."""
    config = _copy_of_the_docs(tmp_path)
    page = tmp_path / "docs" / "python.md"
    page.write_text(page.read_text(encoding="utf-8") + f"\n{plant}\n", encoding="utf-8")
    done = _build(config, tmp_path / "site")
    assert done.returncode != 0 and says in done.stderr, done.stderr[-2000:]


def test_every_public_name_is_in_the_api_reference(site):
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    missing = [name for name in nxl_hooks.__all__ if f'id="nxl_hooks.{name}"' not in api]
    assert not missing, f"add '::: nxl_hooks.NAME' to docs/api.md for: {', '.join(missing)}"


def test_the_public_api_is_typed_for_type_checkers():
    """The package ships its PEP 561 marker (without it a type checker skips an installed nxl_hooks: every name
    Any), and a record's scores read as tensors, on Attribution and on Step, which shares its properties; the calls
    read_stream returns as GenerationCalls."""
    import typing

    import torch

    from nxl_hooks.records.reader import Stream

    assert (ROOT / "nxl_hooks" / "py.typed").is_file()
    for record in (nxl_hooks.Attribution, nxl_hooks.Step):
        for name in ("normxlogit", "logat"):
            assert typing.get_type_hints(getattr(record, name).fget)["return"] is torch.Tensor, (record, name)
    assert typing.get_type_hints(nxl_hooks.Step.methods.fget)["return"] == list[str]
    assert Stream.__orig_bases__ == (list[nxl_hooks.GenerationCall],)


def _accepts(hint, value) -> bool:
    """Whether a type checker takes ``value`` for the annotation ``hint`` (the forms attach's annotations use)."""
    import collections.abc
    import types
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in args)
    if hint is type(None):
        return value is None
    if origin is type:
        return isinstance(value, type) and issubclass(value, args[0])
    if origin in (collections.abc.Sequence, collections.abc.Iterable):
        return (isinstance(value, origin) and not isinstance(value, str)
                and all(_accepts(args[0], item) for item in value))
    return isinstance(value, origin or hint)


def test_attach_is_typed_for_every_value_its_docs_take():
    """py.typed ships, so mypy --strict checks a user's call against attach's annotations: ``methods=`` took neither
    one Method object nor a class (docs/methods.md: ``methods=Contrastive(foil=3)``), and ``layers=`` / ``target=``
    no numpy integer or array (docs/python.md: numpy integers are fine), each an error in a user's type check; nor
    did ``explain`` take a tuple of texts."""
    import typing

    import numpy as np
    import torch

    from nxl_hooks.method.methods.contrastive import Contrastive

    hints = typing.get_type_hints(nxl_hooks.attach)
    taken = {
        "methods": ["contrastive", "contrastive,logat", ["contrastive"], Contrastive(foil=3), Contrastive,
                    [Contrastive, "logat", Contrastive(foil=3)], None],
        "layers": ["all", "last", -1, [0, -1], np.int64(2), [np.int32(0)], np.array([0, 2])],
        "target": ["predicted", 5, "Paris", ["Paris", 7], torch.tensor([3, 4]), np.int64(7), np.array([3, 11])],
    }
    refused = {name: [value for value in values if not _accepts(hints[name], value)] for name, values in taken.items()}
    assert refused == {name: [] for name in taken}, refused
    # explain's texts: one, a list, or a tuple of them (docs/python.md: "a tuple of two texts is a batch of two")
    hints = typing.get_type_hints(nxl_hooks.explain)
    texts = ["a text", ["a", "b"], ("a", "b")]
    assert [text for text in texts if not _accepts(hints["text"], text)] == []
    assert [text for text in [*texts, None] if not _accepts(hints["text_pair"], text)] == []


def test_every_public_name_has_a_docstring_with_a_usage_line():
    """The API page shows each name's docstring: eight of them (``Given``, ``GenerationCall``, ``get_method``,
    ``method_names``, the errors and the warning) said what the name is but not how it is used. A usage line is a
    call in an inline literal (``nxl.method_names()``) or an indented example."""
    import inspect

    usage = re.compile(r"``[^`]*\w\([^`]*``|^\s{4}\S.*\(", re.M)
    missing = [name for name in nxl_hooks.__all__ if not usage.search(inspect.getdoc(getattr(nxl_hooks, name)) or "")]
    assert not missing, f"give these docstrings a usage line: {', '.join(missing)}"


def test_readme_links_and_anchors_lead_somewhere(site):
    for document in ("README.md", "CHANGELOG.md"):
        text = (ROOT / document).read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            if not path:  # an anchor on the same page
                slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                         for h in re.findall(r"^#+ (.+)$", text, re.M)}
                assert anchor in slugs, f"{document}: no heading for #{anchor}"
                continue
            assert (ROOT / path).exists(), f"{document} links to {path}, which does not exist"
            if anchor and path.startswith("docs/"):
                html = (site / Path(path).relative_to("docs").with_suffix("") / "index.html").read_text("utf-8")
                assert f'id="{anchor}"' in html, f"{document}: {path} has no heading #{anchor}"


def test_the_manual_says_a_running_process_is_attached_and_what_root_trusts_then(site):
    server = (ROOT / "docs" / "server.md").read_text(encoding="utf-8")
    assert "cannot be attached from outside" not in server and "(attach-pid.md)" in server
    anchor = "what-root-trusts-nxl-attach-pid"  # linked from attach-pid.md; the rules nxl attach keeps as root
    assert f"(security.md#{anchor})" in (ROOT / "docs" / "attach-pid.md").read_text(encoding="utf-8")
    assert f'id="{anchor}"' in (site / "security" / "index.html").read_text("utf-8")


def test_readme_keeps_the_test_command_ci_runs():
    """.ci/run runs README's test command literally, and the fast tier on the floor of the supported transformers
    range: each command stays in both, the same, and README's stated range starts at pyproject.toml's floor."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = 'pip install -e ".[test]" && python -m pytest -n 2 tests'
    assert command in ci and f"```bash\n{command}\n```" in readme
    floor = re.search(r'"transformers>=([0-9.]+),<6"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"))[1]
    assert 'pip install -e ".[test]" "transformers[serving]==$floor" && python -m pytest -n 2 @tests/floor.txt' in ci
    assert f'pip install -e ".[test]" "transformers[serving]=={floor}"' in readme
    assert "python -m pytest -n 2 @tests/floor.txt" in readme and f"transformers {floor} up to the newest 5.x" in readme


def test_the_vllm_tiers_packages_convert_the_real_model():
    """The vLLM tier's environment (.ci/run's, and tests/README's command) converts SmolLM2's GGUF file itself when no
    tier did before (tests/vllm/test_vllm_real.py): it holds every package of the [gguf] extra. It had gguf alone,
    so the tier run on its own errored ("reading a .gguf file needs accelerate")."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    needed = {re.match(r"[A-Za-z0-9_.-]+", requirement)[0] for requirement in extra["gguf"]}
    (ci,) = re.findall(r'^vllm_tests="([^"]*)"', (ROOT / ".ci" / "run").read_text(encoding="utf-8"), flags=re.M)
    readme = " ".join((ROOT / "tests" / "README.md").read_text(encoding="utf-8").split())
    (command,) = re.findall(r"pip install (pytest pytest-xdist [^&`]*)", readme)
    assert needed <= set(ci.split()) and needed <= set(command.split()), (needed, ci, command)


def test_the_16_client_serving_figures_are_the_committed_ones():
    """README and docs/engines.md quote benchmarks/results/serve_cpu_16clients.json; a rerun that changes the file
    (or an edit of either page) must keep them saying what it holds."""
    load = json.loads((ROOT / "benchmarks" / "results" / "serve_cpu_16clients.json").read_text("utf-8"))["load16"]
    paired, growth = load["throughput_ratio_paired"], load["rss_growth_mib"]
    median, nxl, plain = f"{load['throughput_ratio_median']:.2f}", round(growth["nxl_all"]), f"{growth['plain']:.1f}"
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert (f"throughput was {median}x plain on a 2-core CPU (the median of {len(paired)} paired rounds, "
            f"{min(paired):.2f}x to {max(paired):.2f}x) and the server's memory grew by {nxl} MiB after warm-up "
            f"(plain: +{plain} MiB)") in readme, "README.md: state the 16-client figures of serve_cpu_16clients.json"
    engines = (ROOT / "docs" / "engines.md").read_text(encoding="utf-8")
    ratios = ", ".join(f"{ratio:.2f}" for ratio in paired)
    assert f"| {ratios} (median **{median}**) |" in engines and f"| +{plain} MiB | **+{nxl} MiB** |" in engines, \
        "docs/engines.md: state the 16-client figures of serve_cpu_16clients.json"


def test_the_attach_figures_are_the_committed_ones():
    """README and docs/attach-pid.md quote benchmarks/results/attach_cpu.json; a rerun that changes the file must
    change every figure the pages take from it (the requests answered and the load average too, not only the
    medians)."""
    run = json.loads((ROOT / "benchmarks" / "results" / "attach_cpu.json").read_text("utf-8"))
    median = run["median"]
    page = " ".join((ROOT / "docs" / "attach-pid.md").read_text(encoding="utf-8").split())
    rows = {"`nxl attach PID --layers all --sink DIR`, command start to return": f"{median['attach_command_s']:.1f}",
            "the same, command start to the first request recorded": f"{median['attach_to_first_record_s']:.1f}",
            "`nxl detach PID`, command start to return": f"{median['detach_command_s']:.1f}",
            "through the API: attach, until the process answered": f"{median['api_attach_inject_s']:.1f}"}
    for what, seconds in rows.items():
        assert f"| {what} | {seconds} |" in page, f"docs/attach-pid.md: {what} is {seconds} s in attach_cpu.json"
    before, after = round(run["load_average_before"][0]), round(run["load_average_after"][0])
    assert f"(load average {before} to {after} during the run" in page, "docs/attach-pid.md: state its load average"
    assert f"{run['requests_answered']} requests were answered during the run" in page, \
        "docs/attach-pid.md: state how many requests attach_cpu.json's run answered"
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert (f"`nxl attach` took {median['attach_to_first_record_s']:.1f} s from the command's start to the first "
            f"recorded request and `nxl detach` {median['detach_command_s']:.1f} s") in readme, \
        "README.md: state the attach figures of attach_cpu.json"

def _changelog_moves() -> dict[str, list[str]]:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `nxl_hooks\.(\w+)` \| (.+) \|$", text, re.M)
    return {old: re.findall(r"`(nxl_hooks[\w.]+)`", new) for old, new in rows}


def test_changelog_says_where_each_old_module_path_went():
    moves = _changelog_moves()
    assert len(moves) == 14 and {old for old, _ in OLD_NAMES} <= set(moves)
    for old, new in moves.items():
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"nxl_hooks.{old}")
        assert not hasattr(nxl_hooks, old)
        for module in new:
            importlib.import_module(module)  # each named home exists
    for old, name in OLD_NAMES:
        assert any(callable(getattr(importlib.import_module(m), name, None)) for m in moves[old]), (old, name)


def test_old_cli_module_is_gone_and_the_package_runs_instead():
    # what `python -m nxl_hooks.cli` looks up (tests/process/test_cli.py runs `python -m nxl_hooks`)
    assert importlib.util.find_spec("nxl_hooks.cli") is None and importlib.util.find_spec("nxl_hooks.__main__")
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "`python -m nxl_hooks.cli ...` becomes `python -m nxl_hooks ...`" in changelog


def test_one_version_everywhere():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    latest = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.M).group(1)
    assert project == nxl_hooks.__version__ == latest


def test_the_license_text_is_the_declared_license():
    """pyproject.toml declares MIT, and the LICENSE file the wheel ships (hatchling's default license files) is the
    MIT text: there was no license text at all."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    text = " ".join((ROOT / "LICENSE").read_text(encoding="utf-8").split())
    assert project["license"] == "MIT" and text.startswith("MIT License Copyright (c) 2026 the nxl_hooks developers")
    assert "Permission is hereby granted, free of charge, to any person obtaining a copy of this software" in text


def test_tests_readme_sorts_every_test_file_into_a_tier():
    """Every test file lives in a tier's folder and tests/README.md lists it there, by its path."""
    tests = ROOT / "tests"
    assert not sorted(p.name for p in tests.glob("test_*.py")), "put each test file in a tier folder (tests/README.md)"
    listed = (tests / "README.md").read_text(encoding="utf-8")
    unlisted = [str(p.relative_to(tests)) for p in sorted(tests.glob("*/test_*.py"))
                if f"`{p.relative_to(tests)}`" not in listed]
    assert not unlisted, f"tests/README.md: list these in the table of their tier: {', '.join(unlisted)}"


def test_the_built_site_is_git_ignored():
    """``mkdocs build`` writes ./site/ by default (mkdocs.yml names no site_dir): a build must not leave hundreds of
    untracked files in the checkout (issue 24, item 16)."""
    assert "site_dir" not in (ROOT / "mkdocs.yml").read_text()
    ignored = {line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()}
    assert ignored & {"site/", "/site/", "site"}
