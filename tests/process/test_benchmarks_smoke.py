"""Every benchmark script still runs: each one with ``--smoke`` (tiny sizes, one round, no goal) on the CPU, in a
child process, as a user would start it. Its JSON must hold what the script promises, and nothing under
benchmarks/results/ (the committed figures) may change. A new script in benchmarks/ is picked up by the glob and
fails here until it has a check below.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("bench_*.py"))


def _forward(report: dict, out: Path) -> None:
    assert report["model"]["layers"] == 2 and report["repeats"] == 1 and "goals" not in report
    assert all(report["paired_ratio_medians"][name] > 0 for name in ("server", "once", "logit_lens"))


def _generate(report: dict, out: Path) -> None:
    # the attached generate emitted exactly the plain generate's tokens, one record per token
    assert report["same_tokens_as_plain"] is True and report["goal_attached_over_plain"] is None
    assert report["plain_repeats_its_tokens"] is True
    assert report["attached_over_plain"] > 0 and report["attached_sink_over_plain"] > 0


def _big(report: dict, out: Path) -> None:
    hidden = report["model"]["hidden"]
    for setup in ("bnb_4bit", "offloaded"):
        memory = report[setup]["memory"]
        # what the probe holds at the backbone's return is the formula (features + embedding norms), plus at most
        # one float32 vector of the model's width held once per attach
        assert 0 <= memory["kept_bytes"] - memory["formula_bytes"] <= hidden * 4, memory
        assert report[setup]["attached_over_plain"] > 0


def _faithfulness(report: dict, out: Path) -> None:
    # the script's TASKS, read from its source (importing it would put examples/ on this process's sys.path)
    source = ast.parse((BENCHMARKS / "bench_faithfulness.py").read_text(encoding="utf-8"))
    (tasks,) = [node.value for node in source.body if isinstance(node, ast.Assign)
                and getattr(node.targets[0], "id", None) == "TASKS"]
    assert set(report["tasks"]) == {key.value for key in tasks.keys}
    for task in report["tasks"].values():
        assert set(task["table"]) == set(report["methods"]) and task["n_examples"] == 3
    assert "## Summary" in out.with_suffix(".md").read_text(encoding="utf-8")


def _real(report: dict, out: Path) -> None:
    from nxl_hooks.eval.tasks import TASKS

    assert set(report["tasks"]) == set(TASKS) and list(report["timing"]) == ["1"]
    for summary in report["tasks"].values():
        assert set(summary["methods"]) == set(report["methods"])
    assert "| task (accuracy) |" in out.with_suffix(".md").read_text(encoding="utf-8")


def _serve(report: dict, out: Path) -> None:
    assert {"tiny/clients=1", "tiny/clients=4"} <= set(report["latency"]) and "soak" not in report
    for result in report["latency"].values():
        # plain and nxl run answered (the script checks that every variant gave the same text)
        assert {"plain", "nxl_last", "nxl_all"} <= set(result)
        assert all(variant["requests"] >= 1 and variant["throughput_rps"] > 0 for variant in result.values())
    assert report["table"].count("| tiny |") == len(report["latency"])


def _attach(report: dict, out: Path) -> None:
    (round_,) = report["rounds"]  # the script itself checks that every answer stayed the same and that nothing
    assert report["requests_answered"] > 0  # was recorded after the detach
    assert 0 < round_["attach_command_s"] <= round_["attach_to_first_record_s"]
    assert round_["api_attach_to_first_record_s"] > 0 and round_["detach_command_s"] > 0


def _vllm(report: dict, out: Path) -> None:
    if importlib.util.find_spec("vllm.envs") is None:  # vLLM lives in the vllm tier's own environment
        assert "not importable" in report["skipped"]
        return
    assert [run["variant"] for run in report["runs"]] == ["plain_eager", "nxl_all_eager"]
    assert report["start_s"]["plain_eager"] > 0 and report["start_s"]["nxl_all_eager"] > 0
    for run in report["runs"]:
        assert all(run[f"clients={c}"]["tokens"] == 4 * 8 for c in (1, 8))
    assert report["summary"]["same_texts"] == {"nxl_all_eager": True}  # recording changed no reply
    assert set(report["summary"]["throughput_ratio"]["nxl_all_eager"]) == {"clients=1", "clients=8"}


def _compiled(report: dict, out: Path) -> None:
    # every attached compiled call was checked by the script: each step recorded, the same tokens as plain
    assert report["same_tokens_as_plain"] is True and report["unrecorded"] == {"attached": None, "attached_sink": None}
    assert report["sink_steps_of_last_call"] == report["model"]["new_tokens"] and report["attached_over_plain"] > 0
    assert set(report["return_over_plain"]) == {"attached", "attached_sink"}  # each timed call's return, apart
    assert all(seconds > 0 for seconds in report["return_seconds_medians"].values())
    # on the CPU both repeat plain to the bit: the report tells a GPU's kernels apart from recording with this
    assert report["divergence"] == {name: {"first_differing_step": None, "max_logit_difference_until_then": 0.0}
                                    for name in ("attached", "plain_again")}


def _batching(report: dict, out: Path) -> None:
    # every request of every attached call was recorded whole (the script checks), with plain's tokens
    assert report["every_request_recorded"] is True and report["same_tokens_as_plain"] is True
    assert report["batching"]["requests"] == 4 and report["attached_throughput_over_plain"] > 0
    # each switch's variant was recorded whole too, and took effect: the other one scored the steps in the other
    # thread (on the CPU: the manager's by default, where the model computes)
    variants = report["variants"]
    assert {name: v["steps_scored_in"] for name, v in variants.items()} == {
        "attached": ["manager"], "attached_ends_wait": ["manager"], "attached_other_scoring_thread": ["publisher"]}
    assert variants["attached_ends_wait"]["switches"] == {"ENGINE_ENDS_WAIT": True}
    assert all(v["throughput_over_plain"] > 0 for v in variants.values())
    # each call's manager warmup was timed (generate_batch's), and the ratios without it reported per variant
    assert set(report["warmup_median_seconds"]) == {"plain", *variants}
    assert all(seconds > 0 for seconds in report["warmup_median_seconds"].values())
    assert set(report["throughput_over_plain_after_warmup"]) == set(variants)


CHECKS = {"bench_forward": _forward, "bench_batching": _batching, "bench_compiled": _compiled, "bench_generate": _generate, "bench_big": _big,
          "bench_faithfulness": _faithfulness, "bench_real": _real, "bench_serve": _serve, "bench_attach": _attach,
          "bench_vllm": _vllm}


def _results() -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted((BENCHMARKS / "results").iterdir())}


@pytest.mark.parametrize("script", SCRIPTS, ids=[script.stem for script in SCRIPTS])
def test_benchmark_runs_in_smoke_mode(script, tmp_path, monkeypatch):
    assert script.stem in CHECKS, f"{script.name} has no --smoke check in {Path(__file__).name}: add one"
    from serving import gdb_refusal

    if script.stem == "bench_attach" and gdb_refusal() is not None:
        pytest.skip(f"nxl attach injects through gdb here (Python < 3.14): {gdb_refusal()}")
    before = _results()
    out = tmp_path / f"{script.stem}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}  # the CPU, where CI runs it
    done = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{script.name} --smoke failed:\n{done.stderr[-4000:]}"
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report.get("smoke", True) is True  # bench_serve's report has no such key
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    CHECKS[script.stem](report, out)
    assert _results() == before, "a --smoke run changed benchmarks/results/"


def test_smoke_runs_refuse_to_write_into_results(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from _common import smoke_out

    parser = argparse.ArgumentParser(prog="bench_x.py")
    with pytest.raises(SystemExit) as exit_:
        smoke_out(parser, BENCHMARKS / "results" / "forward_cpu.json", "forward")
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("bench_x.py: error: --smoke writes no figures")
    elsewhere = smoke_out(parser, None, "forward")
    assert elsewhere.name == "forward.json" and not elsewhere.resolve().is_relative_to(BENCHMARKS.resolve())
    elsewhere.parent.rmdir()


def test_batching_times_each_warmup_on_the_clock_of_its_call(monkeypatch):
    # throughput_over_plain_after_warmup subtracts each call's warmup from the call's seconds: under --clock cpu a
    # warmup taken in wall seconds (a capture or a loaded machine waits) made those ratios negative
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _common
    import bench_batching
    import torch

    now = {"wall": 0.0, "cpu": 0.0}
    for clock in now:
        monkeypatch.setitem(_common.CLOCKS, clock, lambda clock=clock: now[clock])

    def warmup(manager):  # waits 5 s, computes 2 s
        now["wall"] += 5.0
        now["cpu"] += 2.0
        return "warmed"

    monkeypatch.setattr(bench_batching.ContinuousBatchingManager, "warmup", warmup)
    seconds: list[float] = []
    with bench_batching._warmups(seconds, torch.device("cpu"), "cpu") as found:
        assert found and bench_batching.ContinuousBatchingManager.warmup(None) == "warmed"
    assert seconds == [2.0]
