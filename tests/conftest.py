"""Shared by every test module: the tests directory on sys.path (tiny.py, oracle.py), and a guard that no test
leaves torch's thread count changed (results must not depend on which tests ran before)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _thread_count_unchanged():
    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    if after != before:
        torch.set_num_threads(before)  # repair first, so one leak does not fail every later test too
        pytest.fail(f"this test changed torch's thread count from {before} to {after}: restore it (or run the "
                    "part that needs another count in a child process)")
