"""Each optional extra missing: the command that needs it says, in one line and with exit code 2, which
``pip install "nxl_hooks[...]"`` to run. A package is hidden in a child process the way Python itself knows a
module to be absent (``sys.modules[name] = None``: ``import`` fails and ``importlib.util.find_spec`` finds nothing,
so transformers' own availability checks see it missing too). Also: the CLI silences exactly the library-load
noise it knows, and no other warning of those libraries."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forks import Programs
from nxl_hooks.apps.extras import NOISE, quiet_library_noise
from test_loading import world  # noqa: F401 - the fixture: (model, tokenizer, its folder, its GGUF file)

TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def files(world, tmp_path_factory):  # noqa: F811 - world is test_loading's fixture
    root = tmp_path_factory.mktemp("extras")
    _, _, folder, gguf = world
    quanto = shutil.copytree(folder, root / "quanto")  # a checkpoint saved by optimum-quanto, as its config says
    config = json.loads((quanto / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "quanto", "weights": "int8", "activations": None}
    (quanto / "config.json").write_text(json.dumps(config))
    data = root / "data.jsonl"
    data.write_text(json.dumps({"text": TEXT}) + "\n")
    no_pyarrow = _python(root / "no-pyarrow", leave_out="pyarrow")
    waits = ("import time, transformers.modeling_utils\nprint('ready', flush=True)\n"
             "for _ in range(12000):\n    time.sleep(0.05)")
    target = subprocess.Popen([no_pyarrow, "-c", waits],  # Python code that an attach can enter, for 10 minutes
                              stdout=subprocess.PIPE, text=True)  # nxl attach's target, lacking pyarrow
    assert target.stdout.readline().strip() == "ready"
    yield {"folder": folder, "gguf": gguf, "quanto": quanto, "data": data, "out": root, "no-pyarrow": no_pyarrow,
           "target": str(target.pid)}
    target.kill()
    target.wait()


def _python(root: Path, leave_out: str = "") -> str:
    """Another interpreter (a venv at ``root``) whose environment is this one's but for the packages whose names
    start with ``leave_out``: its path, which is not this interpreter's."""
    if not (Path(sys.prefix) / "pyvenv.cfg").is_file():
        pytest.skip("the tests run outside a venv: no environment to copy")
    site = root / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    site.mkdir(parents=True)
    for entry in Path(pytest.__file__).resolve().parents[1].iterdir():
        if not (leave_out and entry.name.startswith(leave_out)):
            (site / entry.name).symlink_to(entry)
    shutil.copy(Path(sys.prefix) / "pyvenv.cfg", root / "pyvenv.cfg")
    (root / "bin").mkdir()
    (root / "bin" / "python").symlink_to(getattr(sys, "_base_executable", sys.executable))
    return str(root / "bin" / "python")


@pytest.fixture(scope="module")
def programs():
    """The interpreter whose forks run this file's child programs (tests/forks.py): it imported torch alone, which
    imports none of the packages the tests hide (checked), so each program hides them before anything does."""
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    prelude = ("import sys, torch\n"
               f"assert not [m for m in sys.modules if m.partition('.')[0] in {sorted(_HIDDEN)!r}], 'imported'")
    with Programs(prelude, env=env) as server:
        yield server


def run_hidden(programs, out: Path, hidden: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    """``nxl ARGV`` in a Python where the ``hidden`` modules are absent (a fork of ``programs``'s interpreter)."""
    code = ("import sys\n"
            "from nxl_hooks.apps.cli import main\n"
            f"sys.exit(main({argv!r}))\n")
    return programs.run(code, [], hidden=hidden, out=out)


CASES = {  # id: (hidden modules, extra, package named, argv)
    "gguf": (["gguf"], "gguf", "gguf", lambda f: ["attribute", str(f["gguf"]), TEXT]),
    # issue 24, item 11: a GGUF file needs accelerate too, which [gguf] now carries (it asked for [big])
    "gguf-accelerate": (["accelerate"], "gguf", "accelerate", lambda f: ["attribute", str(f["gguf"]), TEXT]),
    "big-bitsandbytes": (["bitsandbytes"], "big", "bitsandbytes",
                         lambda f: ["attribute", str(f["folder"]), TEXT, "--load-in-4bit"]),
    "big-accelerate": (["accelerate"], "big", "accelerate",
                       lambda f: ["attribute", str(f["folder"]), TEXT, "--device-map", "auto"]),
    "eval-captum": (["captum"], "eval", "captum",
                    lambda f: ["evaluate", str(f["folder"]), str(f["data"]), "--out", str(f["out"] / "ev")]),
    "eval-scipy": (["scipy"], "eval", "scipy",
                   lambda f: ["audit", "--reference", str(f["folder"]), "--candidate", str(f["folder"]),
                              str(f["data"]), "--out", str(f["out"] / "au")]),
    "quant": (["optimum", "optimum.quanto"], "quant", "optimum-quanto",
              lambda f: ["attribute", str(f["quanto"]), TEXT]),
    "serve": (["fastapi"], "serve", "fastapi", lambda f: ["run", "--", "transformers", "serve", str(f["folder"])]),
    # a sink kind's extra is checked before the program starts (it ran unrecorded, exit 0), in the Python that
    # makes the sink: the program's (nxl's has pyarrow here), the attached process's
    "parquet-run": ([], "parquet", "pyarrow",
                    lambda f: ["run", "--sink", f"parquet:{f['out'] / 'r.parquet'}", "--", f["no-pyarrow"], "-c",
                               "print('the program ran')"]),
    "parquet-run-nxls-python": (["pyarrow"], "parquet", "pyarrow",
                                lambda f: ["run", "--sink", f"parquet:{f['out'] / 'r.parquet'}", "--",
                                           sys.executable, "-c", "print('the program ran')"]),
    "parquet-attach": ([], "parquet", "pyarrow",
                       lambda f: ["attach", f["target"], "--sink", f"parquet:{f['out'] / 'a.parquet'}"]),
}


_HIDDEN = {name.partition(".")[0] for hidden, *_ in CASES.values() for name in hidden} | {"nxl_hooks", "rich"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_missing_extra_is_one_line_naming_the_install(files, case, programs, tmp_path):
    hidden, extra, package, argv = CASES[case]
    if case.endswith("-attach"):
        from serving import gdb_refusal

        if gdb_refusal() is not None:
            pytest.skip(f"nxl attach PID injects through gdb: {gdb_refusal()}")
    done = run_hidden(programs, tmp_path / "nxl", hidden, argv(files))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [done.stderr.strip().splitlines()[-1]]  # one line, the last
    assert errors[0].startswith(f"nxl {argv(files)[0]}: error: ")
    assert f"this needs {package}" in errors[0] and errors[0].endswith(f'pip install "nxl_hooks[{extra}]"')
    said = {"eval-captum": "nxl evaluate: error: the default --methods include grad_norm,grad_x_input (or name "
                           "--methods without them): this needs captum",  # (no --methods was given)
            "eval-scipy": "nxl audit: error: its rank correlations: this needs scipy"}  # (named once)
    assert errors[0].startswith(said.get(case, "")), errors[0]
    assert "the program ran" not in done.stdout and not list(files["out"].glob("*.parquet"))


def test_a_parquet_sink_is_checked_in_the_programs_python_not_in_nxls(files, tmp_path, programs):
    """nxl lacking pyarrow refused --sink parquet: for a program whose own Python has it (checked in nxl's
    process): the program runs, and its steps are in the Parquet file, the tokens it generated."""
    program = ("import json, sys, torch; from transformers import AutoModelForCausalLM; "
               f"model = AutoModelForCausalLM.from_pretrained({str(files['folder'])!r}); "
               "out = model.generate(input_ids=torch.tensor([[1, 5, 6, 7]]), max_new_tokens=3, do_sample=False); "
               "print('NEW', json.dumps(out[0, 4:].tolist()))")
    with_pyarrow = _python(tmp_path / "with-pyarrow")
    done = run_hidden(programs, tmp_path / "nxl", ["pyarrow"],
                      ["run", "--sink", f"parquet:{tmp_path / 'r.parquet'}", "--", with_pyarrow, "-c", program])
    assert done.returncode == 0, done.stderr[-2000:]
    new = json.loads(done.stdout.split("NEW ", 1)[1])
    import pyarrow.parquet

    (written,) = tmp_path.glob("*.parquet")
    rows = pyarrow.parquet.read_table(written).to_pylist()
    assert {row["step"]: row["emitted_id"] for row in rows} == dict(enumerate(new))


def test_an_import_error_of_no_extra_still_shows_its_traceback(files, programs, tmp_path):
    # a required package: a broken install
    done = run_hidden(programs, tmp_path / "nxl", ["rich"], ["attribute", str(files["folder"]), TEXT])
    assert done.returncode == 1 and "Traceback" in done.stderr and "nxl_hooks[" not in done.stderr


def test_only_the_known_library_noise_is_silenced(unfiltered, caplog):
    quiet_library_noise()
    quiet_library_noise()  # idempotent: one filter per logger
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
        logging.getLogger("torchao").warning("a real torchao warning")
        logging.getLogger("torch.utils._pytree").warning(NOISE["torch.utils._pytree"] + " as an opaque value type",
                                                         "<enum 'KernelPreference'>")
        logging.getLogger("torch.utils._pytree").warning("another pytree warning")
        logging.getLogger("other").warning("Failed to load something else")
    assert [r.getMessage() for r in caplog.records] == [
        "a real torchao warning", "another pytree warning", "Failed to load something else"]
    assert sum(len(logging.getLogger(name).filters) for name in NOISE) == len(NOISE)


@pytest.fixture
def unfiltered():
    """The NOISE loggers without filters for the test, as they were after it: no test depends on another's order."""
    kept = {name: logging.getLogger(name).filters[:] for name in NOISE}
    for name in NOISE:
        logging.getLogger(name).filters.clear()
    yield
    for name, filters in kept.items():
        logging.getLogger(name).filters[:] = filters


def test_a_tokenizer_limit_below_the_models_positions_is_not_said(unfiltered):
    """A fine-tune's tokenizer saved with model_max_length 4: transformers would say longer texts "will result in
    indexing errors"; every nxl command checks the model's own limit instead (check_length), so the CLI drops it."""
    from tiny import tokenizer

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("transformers.tokenization_utils_base")
    logger.addHandler(handler)
    try:
        for quiet in (False, True):
            if quiet:
                quiet_library_noise()
            words = tokenizer()  # (transformers says it once per tokenizer)
            words.model_max_length = 4
            words("the cat sat on the mat and the dog")
            assert any(line.startswith("Token indices sequence length") for line in said) is not quiet, said
            said.clear()
    finally:
        logger.removeHandler(handler)


def test_the_gguf_extra_carries_what_reading_a_gguf_file_needs():
    """pip install "nxl_hooks[gguf]" alone attributes a GGUF file: the packages load_model checks for are in it."""
    import re
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    names = {re.match(r"[\w.-]+", spec).group(0) for spec in project["optional-dependencies"]["gguf"]}
    assert {"gguf", "accelerate"} <= names


def test_nxl_convert_help_names_the_gguf_extra(capsys):
    """nxl convert --help names the install that converts (gguf and accelerate), as the missing-package line does:
    it said "pip install gguf", after which converting still stopped for accelerate."""
    from nxl_hooks.apps.cli import main

    assert main(["convert", "--help"]) == 0
    assert 'pip install "nxl_hooks[gguf]"' in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("version", ["2.6.0+cpu", "2.10.1"])
def test_a_torch_below_the_floor_is_one_line_at_import(version, programs, tmp_path):
    """A torch older than pyproject.toml's ``torch>=`` allows, forced past pip: ``import nxl_hooks`` failed on the
    first name it lacked (torch 2.6: ``torch.compiler.is_exporting``), or imported and then raised in compiled
    forwards. Now the import names pyproject's floor and the install in one line. The child sets the version torch
    reports before the import, which is what the check reads."""
    import re

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    (floor,) = re.findall(r'^\s*"torch>=([\d.]+),<3"', pyproject, flags=re.M)  # (as .ci/run reads it; 3.10: no tomllib)
    code = f"import torch\ntorch.__version__ = {version!r}\nimport nxl_hooks"
    done = programs.run(code, [], out=tmp_path / "import")  # (a fork of an interpreter that imported torch alone)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"ImportError: nxl_hooks needs torch >= {floor}, this is torch {version}: pip install 'torch>={floor}'")
