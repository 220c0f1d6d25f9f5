"""Tensor parallel (issue 18, item 7): transformers' ``tp_plan="auto"`` under ``torchrun --nproc-per-node 2`` (gloo,
CPU) on a tiny Llama saved to a folder, with nxl attached on every rank, against one process and the oracle; and
``nxl attribute --tp``, ``nxl evaluate --tp`` and ``nxl audit --tp`` launched by torchrun against the same command
in one process.

Tolerance: the shards compute the same float32 operations, but the row-parallel layers (o_proj, down_proj) sum
partial products per rank and all-reduce them, so sums are reassociated: a few float32 roundings (~1e-7 relative)
per block. 1e-5 relative / 1e-6 absolute is ten times that over two blocks and far below any real difference
(a wrong or missing shard changes the scores by their own size); by hand the difference was 1.5e-8.

Run as a script, this file is the torchrun worker: ``python tests/process/test_tensor_parallel.py FOLDER OUT
[forward] [generate] [later]`` runs those workers one after the other in each rank (``forward`` alone by default);
the tests share one torchrun of all three (``workers``), each checking its own worker's files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nxl_hooks as nxl

TOL = dict(rtol=1e-5, atol=1e-6)
TEXT = "w5 w9 w12 w7 w30"
#: two rows, the first left-padded: pad positions and per-row prediction positions go through the shards too
IDS = [[0, 0, 5, 9, 12, 7], [33, 8, 41, 20, 17, 6]]
MASK = [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
GENERATED = 6  # tokens the generate test makes


def _env() -> dict:
    """This checkout importable, one thread per rank."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}


def _refusing_ranks(*args: str, cwd: Path) -> list[subprocess.CompletedProcess]:
    """``python -m nxl_hooks ...`` as torchrun's two ranks, each given the environment torchrun gives it, run side by
    side until each stops on its own: torchrun itself ends the other ranks once one has stopped, so it cannot show
    what each rank says by itself. A rank that waits for the other (in the rendezvous of a load) fails the test."""
    from serving import free_port

    world = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [subprocess.Popen([sys.executable, "-m", "nxl_hooks", *args], cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**_env(), **world, "RANK": str(rank), "LOCAL_RANK": str(rank)})
             for rank in range(2)]
    done = []
    for process in ranks:
        try:
            out, err = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for each in ranks:
                each.kill()
                each.communicate()
            pytest.fail(f"a rank of nxl {' '.join(args)} waited instead of stopping on its own")
        done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return done


def _torchrun(*args: str, cwd: Path, timeout: float = 420) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2`` on 127.0.0.1 with a free port, gloo (the CPU), one thread per rank. Past
    ``timeout`` (ranks hung in a collective) the test fails, and torchrun is stopped with SIGTERM, on which it ends
    its workers (SIGKILL would leave them hanging)."""
    from serving import free_port

    env = _env()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), *args]
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                _, err = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                _, err = process.communicate()
            pytest.fail(f"torchrun {' '.join(args)} did not finish within {timeout} s (ranks hung): {err[-2000:]}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny GQA Llama (4 heads, 2 key/value heads: both split over 2 ranks) with random weights everywhere."""
    from test_architectures import CASES, TOK

    path = tmp_path_factory.mktemp("tp") / "llama"
    CASES["llama-lm"].build().save_pretrained(path)
    TOK.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def workers(folder, tmp_path_factory) -> Path:
    """One torchrun of this file's three workers in turn (a padded forward, generate with ``on_step`` on rank 0, an
    attach from another thread): each rank loads its own model for each, so each test reads its worker's files as it
    read those of a torchrun of its own (three torchruns of 2 ranks cost three imports of torch and transformers
    per rank). A rank that hangs fails every test of the three, after the bound of all three."""
    out = tmp_path_factory.mktemp("tp-workers")
    done = _torchrun(__file__, str(folder), str(out), *WORKERS, cwd=out, timeout=420 + 300 + 150)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _one_process(folder: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids, mask = torch.tensor(IDS), torch.tensor(MASK)
    with torch.no_grad(), nxl.attach(model, layers="all") as probe:
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return model, probe.result(), out


def test_tp_plan_auto_under_torchrun_equals_one_process_and_the_oracle(folder, workers):
    import oracle

    model, single, out = _one_process(folder)
    hand = oracle.llama(model)
    logits = hand.layer_logits(out.hidden_states)  # (L+1, batch, seq, vocab) from the unsharded model
    logat, expected = oracle.normxlogit(logits, out.hidden_states[0], single.target)
    mask = torch.tensor(MASK).bool()
    for rank in (0, 1):
        facts = json.loads((workers / f"rank{rank}.json").read_text())
        assert facts == {"world_size": 2, "sharded": True, "q_proj_rows": 16, "layers": [0, 1, 2]}
        res = nxl.Attribution.load(workers / f"rank{rank}.safetensors")
        assert res.target.tolist() == single.target.tolist() and res.position.tolist() == single.position.tolist()
        for layer in range(3):  # per layer: NormXLogit against one process, and against the oracle
            torch.testing.assert_close(res.normxlogit[layer][mask], single.normxlogit[layer][mask], **TOL)
            torch.testing.assert_close(res.normxlogit[layer][mask], expected[layer][mask], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(res.logat[layer][mask], logat[layer][mask], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res.embed_norm[mask], single.embed_norm[mask], **TOL)


def test_nxl_attribute_tp_under_torchrun_equals_one_process(folder, tmp_path):
    from nxl_hooks.apps.cli import main

    single = tmp_path / "single.safetensors"
    assert main(["attribute", str(folder), TEXT, "--layers", "all", "--out", str(single)]) == 0
    (tmp_path / "tp").mkdir()
    done = _torchrun("-m", "nxl_hooks", "attribute", str(folder), TEXT, "--layers", "all", "--tp",
                     "--out", "tp.safetensors", "--html", "tp.html", cwd=tmp_path / "tp")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "tp").iterdir()) == ["tp.html", "tp.safetensors"]  # rank 0's only
    assert done.stdout.count("NormXLogit of") == 1  # rank 1 computes with rank 0 but prints nothing
    mine, theirs = nxl.Attribution.load(tmp_path / "tp" / "tp.safetensors"), nxl.Attribution.load(single)
    assert mine.layers == theirs.layers == [0, 1, 2] and mine.target.tolist() == theirs.target.tolist()
    torch.testing.assert_close(mine.normxlogit, theirs.normxlogit, **TOL)


EXAMPLES = [{"text": "w5 w9 w12 w7 w30", "evidence": ["w9"]}, {"text": "w21 w37 w36 w30 w63", "evidence": ["w37"]},
            {"text": "w58 w24 w35 w27 w42", "evidence": ["w24"]}]


def _close(mine, theirs, where: str = "") -> None:
    """Two records or summaries equal, their numbers within TOL (wall-clock ``seconds`` aside; of ``made_with``'s
    package ``versions``, those both name: each lists what its process imported, and this test's has imported more
    than a torchrun's)."""
    if where.endswith(".versions"):
        shared = set(mine) & set(theirs)
        assert {"nxl_hooks", "torch", "transformers"} <= shared, where
        mine, theirs = ({key: versions[key] for key in shared} for versions in (mine, theirs))
    if isinstance(theirs, dict):
        assert isinstance(mine, dict) and sorted(mine) == sorted(theirs), where
        for key in theirs:
            if key != "seconds":
                _close(mine[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, list):
        assert isinstance(mine, list) and len(mine) == len(theirs), where
        for index, (a, b) in enumerate(zip(mine, theirs)):
            _close(a, b, f"{where}[{index}]")
    elif isinstance(theirs, float):
        assert mine == pytest.approx(theirs, rel=TOL["rtol"], abs=TOL["atol"]), where
    else:
        assert mine == theirs, where


def _results(out: Path) -> list:
    """A dataset run's records and summary."""
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    return [records, json.loads((out / "summary.json").read_text())]


@pytest.mark.parametrize("command, resumed", [
    (["evaluate", "{model}", "data.jsonl", "--methods", "logat,normxlogit"], False),
    (["audit", "--reference", "{model}", "data.jsonl", "--candidate", "{model}"], True)], ids=["evaluate", "audit"])
def test_dataset_commands_tp_under_torchrun_equal_one_process_and_resume(folder, tmp_path, command, resumed,
                                                                          monkeypatch):
    """``nxl evaluate --tp`` / ``nxl audit --tp``: every rank scores every example in the same order (split between
    ranks, their forwards met in each other's collectives), rank 0 alone writes, and the results equal one process.
    A resumed run (one record lost) scores only what is left, on every rank alike (apps/dataset.py resumes both
    commands alike: checked on audit's, a third torchrun less)."""
    from nxl_hooks.apps.cli import main

    (tmp_path / "data.jsonl").write_text("".join(json.dumps(example) + "\n" for example in EXAMPLES))
    argv = [arg.format(model=folder) for arg in command]
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--out", "single"]) == 0
    done = _torchrun("-m", "nxl_hooks", *argv, "--out", "tp", "--tp", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    written = sorted(str(p.relative_to(tmp_path / "tp")) for p in (tmp_path / "tp").rglob("*"))
    assert written == ["parts", "parts/part-0.jsonl", "records.jsonl", "report.html", "run.json", "summary.json"]
    assert done.stdout.count("wrote ") == 1  # rank 1 computes with rank 0 but prints and writes nothing
    _close(_results(tmp_path / "tp"), _results(tmp_path / "single"))
    if not resumed:
        return
    part = tmp_path / "tp" / "parts" / "part-0.jsonl"
    part.write_text(part.read_text().splitlines(keepends=True)[0])  # two of three examples to redo
    done = _torchrun("-m", "nxl_hooks", *argv, "--out", "tp", "--tp", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(part.read_text().splitlines()) == len(EXAMPLES)  # each scored once
    _close(_results(tmp_path / "tp"), _results(tmp_path / "single"))


PROGRAM = """import sys, torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(
    sys.argv[1], distributed_config=transformers.DistributedConfig(tp_plan="auto")).eval()
model.generate(torch.tensor([[5, 9, 12, 7]]), max_new_tokens=3, do_sample=False)
"""


def test_nxl_run_records_a_tp_program_on_every_rank(folder, tmp_path):
    """``torchrun ... -m nxl_hooks run --sink runs/ -- python prog.py``: nxl run execs the program in each rank's
    process, the program's own tp_plan load is attached, and each rank records the call, equal to the no-cache
    oracle on the unsharded model."""
    import transformers

    from oracle import check_call

    (tmp_path / "prog.py").write_text(PROGRAM)
    done = _torchrun("-m", "nxl_hooks", "run", "--sink", "runs", "--", sys.executable, "prog.py", str(folder),
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((tmp_path / "runs").iterdir())) == 2  # one run folder per rank's process
    calls = nxl.read_stream(tmp_path / "runs")
    assert len(calls) == 2
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    for call in calls:
        check_call(model, call, 3)


def test_tp_generate_with_on_step_on_rank_0_only_finishes_and_equals_the_oracle(folder, workers):
    """The docs' way: attach on every rank, read the records on rank 0 (``on_step`` there only). Rank 0 then scores
    each step as it comes and rank 1 lets its steps wait; a readout called as the sharded lm_head is a collective,
    so rank 0 waited in it while rank 1 was in the next forward's, and both hung. Every step on both ranks equals
    the no-cache oracle on the unsharded model."""
    import transformers

    from oracle import check_call

    assert json.loads((workers / "on_step.json").read_text()) == list(range(GENERATED))  # rank 0's callback ran
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    for rank in (0, 1):
        (call,) = nxl.read_stream(workers / f"gen{rank}")
        check_call(model, call, GENERATED)


def test_tp_model_attached_later_from_another_thread_is_refused_not_hung(workers):
    """``nxl attach PID`` (and ``nxl ctl resume`` / ``nxl ctl attach``) attach from a thread of their own, in one
    process, at any moment: a probe there gathered the sharded lm_head, a collective that met the ranks' own forwards
    and hung the program. Each rank's model is now refused in one line (status and log), nothing attached, and the
    program's forwards run on unchanged."""
    for rank in (0, 1):
        facts = json.loads((workers / f"later{rank}.json").read_text())
        assert facts["attached"] is False and facts["outputs_unchanged"] is True, facts
        assert "split over torchrun processes (tensor parallel)" in facts["error"]
        assert "launch the program under torchrun -m nxl_hooks run" in facts["error"]


def test_tp_outside_torchrun_is_one_line(folder, capsys, monkeypatch):
    from nxl_hooks.apps.cli import main

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(["attribute", str(folder), TEXT, "--tp"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was not launched by torchrun (RANK, WORLD_SIZE" in err
    assert "run torchrun --nproc-per-node N -m nxl_hooks ... --tp" in err


def test_tp_with_a_device_map_is_one_line(folder, capsys, monkeypatch):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    from nxl_hooks.apps.cli import main

    assert main(["attribute", str(folder), TEXT, "--tp", "--device-map", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tp (tp=True) with --device-map (device_map=): tensor parallel places" in err


@pytest.mark.parametrize("heads, kv_heads, said", [
    (3, 3, "num_attention_heads is 3 and num_key_value_heads is 3, which 2 does not divide; launch torchrun with "
     "--nproc-per-node 3"),
    (4, 1, "num_key_value_heads is 1, which 2 does not divide; its heads cannot be split: drop --tp (tp=True)"),
], ids=["heads", "kv-heads"])
def test_tp_with_heads_the_ranks_cannot_share_is_one_line(tmp_path, heads, kv_heads, said):
    """Attention heads that 2 ranks cannot split evenly: each rank says so in one line and exits 2, before the
    weights load (each failed in the model's reshape with a traceback: "shape '[1, 4, -1, 8]' is invalid")."""
    import transformers

    from test_architectures import TOK

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=8 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads,
        num_hidden_layers=1, intermediate_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    model.save_pretrained(tmp_path / "llama")
    TOK.save_pretrained(tmp_path / "llama")
    for done in _refusing_ranks("attribute", "llama", TEXT, "--tp", cwd=tmp_path):
        assert done.returncode == 2, done.stderr[-3000:]
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("nxl attribute: error: ") and said in lines[0], lines
        assert "llama: --tp (tp=True) splits the attention heads between the 2 torchrun processes" in lines[0]


@pytest.mark.parametrize("command, said", [
    (["attribute", "{model}", TEXT, "--out", "missing/tp.safetensors"],
     "--out missing/tp.safetensors: the folder missing does not exist; create the folder or pick another path"),
    (["evaluate", "{model}", "data.jsonl", "--methods", "normxlogit", "--out", "taken/run"],
     "--out taken/run: taken is a file, not a folder; give a folder (it is created when missing)"),
], ids=["attribute", "evaluate"])
def test_tp_with_a_bad_out_path_is_one_line_on_every_rank(folder, tmp_path, command, said):
    """A bad --out under --tp: every rank checks the path itself (no rank writes it) and says so in one line, exit 2,
    before the model loads; rank 1 checked a private stand-in and waited for rank 0 in the load until torchrun
    ended it, without a word."""
    (tmp_path / "data.jsonl").write_text(json.dumps(EXAMPLES[0]) + "\n")
    (tmp_path / "taken").write_text("")
    for done in _refusing_ranks(*[arg.format(model=folder) for arg in command], "--tp", cwd=tmp_path):
        assert (done.returncode, done.stderr.splitlines()) == (2, [f"nxl {command[0]}: error: {said}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "taken"]  # nothing written


def test_audit_tp_with_quantize_is_one_line_before_the_reference_loads(folder, tmp_path):
    """`nxl audit --tp --quantize 8bit`: --tp excludes bitsandbytes, which the candidate's load refused only after every
    rank had loaded the reference (its shard, in a rendezvous); each rank now says so in one line before any load."""
    (tmp_path / "data.jsonl").write_text(json.dumps(EXAMPLES[0]) + "\n")
    for done in _refusing_ranks("audit", "--reference", str(folder), "--quantize", "8bit", "data.jsonl", "--out", "out",
                                "--tp", cwd=tmp_path):
        assert done.returncode == 2 and done.stderr.splitlines() == [
            "nxl audit: error: --tp (tp=True) with --load-in-8bit/--load-in-4bit (quantize=): tensor parallel places "
            "one shard per torchrun process itself; drop those (a GGUF file: nxl convert it, then load the folder)"
        ], done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]  # nothing written


def _worker(folder: str, out: str) -> None:
    """One torchrun rank: load with tp_plan="auto", attach, one padded forward, save the attribution."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=transformers.DistributedConfig(tp_plan="auto")).eval()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    local = q_proj.to_local() if hasattr(q_proj, "to_local") else q_proj
    with torch.no_grad(), nxl.attach(model, layers="all") as probe:
        model(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK))
    res = probe.result()
    res.save(Path(out) / f"rank{rank}.safetensors")
    facts = {"world_size": world, "sharded": hasattr(q_proj, "to_local"), "q_proj_rows": local.shape[0],
             "layers": res.layers}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(facts))


def _generate_worker(folder: str, out: str) -> None:
    """One torchrun rank: load with tp_plan="auto", attach with a sink, ``on_step`` on rank 0 only, and generate."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=transformers.DistributedConfig(tp_plan="auto")).eval()
    rank, seen = torch.distributed.get_rank(), []
    options = {"on_step": lambda step: seen.append(step.step)} if rank == 0 else {}
    with torch.no_grad(), nxl.attach(model, layers="all", sink=Path(out) / f"gen{rank}", **options):
        model.generate(torch.tensor([[5, 9, 12, 7]]), max_new_tokens=GENERATED, min_new_tokens=GENERATED,
                       do_sample=False)
    if rank == 0:
        (Path(out) / "on_step.json").write_text(json.dumps(seen))


def _later_worker(folder: str, out: str) -> None:
    """One torchrun rank: load with tp_plan="auto", then attach as nxl attach does (a controller, from another
    thread) while this thread runs forwards; write what the controller says and whether the outputs stayed."""
    import threading

    import transformers

    from nxl_hooks.apps.serve.controller import start, stop
    from nxl_hooks.apps.serve.settings import Settings

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=transformers.DistributedConfig(tp_plan="auto")).eval()
    rank, ids, mask = torch.distributed.get_rank(), torch.tensor(IDS), torch.tensor(MASK)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    (Path(out) / f"run{rank}").mkdir(mode=0o700)
    ctl = start(Settings(run_dir=Path(out) / f"run{rank}", layers="last"))
    side = threading.Thread(target=ctl.adopt, args=(model, folder))
    side.start()
    with torch.no_grad():
        outputs = [model(input_ids=ids, attention_mask=mask).logits for _ in range(4)]
    side.join()
    (model_status,) = ctl.status()["models"]
    stop(ctl)
    facts = {"attached": model_status["attached"], "error": model_status["error"],
             "outputs_unchanged": all(torch.equal(before, each) for each in outputs)}
    (Path(out) / f"later{rank}.json").write_text(json.dumps(facts))


WORKERS = {"forward": _worker, "generate": _generate_worker, "later": _later_worker}

if __name__ == "__main__":
    for name in sys.argv[3:] or ["forward"]:
        WORKERS[name](*sys.argv[1:3])
