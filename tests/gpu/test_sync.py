"""Synchronisations on CUDA, run whenever a GPU is present and skipped otherwise: attached eager ``generate`` adds
a constant number of device synchronisations per call to the generating thread (``torch.cuda.set_sync_debug_mode``
warns at each one), none per generated token, at batch 1 and 4, with a sink too; every step equals the CPU oracle.
The record pipeline's publisher thread reads the records back; its synchronisations are not the generating
thread's."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import nxl_hooks as nxl
import tiny
from oracle import check_call

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _syncs(model, inputs: dict, new: int) -> int:
    """Synchronisations the calling thread made while generating ``new`` tokens."""
    mine, seen = threading.current_thread(), []
    with warnings.catch_warnings():  # restores showwarning and the filters
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: seen.append(
            threading.current_thread() is mine and "synchroniz" in str(message))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(seen)


@pytest.mark.parametrize("sink", [False, True], ids=["", "sink"])
@pytest.mark.parametrize("rows", [1, 4])
def test_attached_generate_adds_no_synchronisation_per_token(rows, sink, tmp_path):
    model = tiny.generating_llama().cuda()
    ids = torch.randint(1, tiny.GEN_VOCAB, (rows, 6), generator=torch.Generator().manual_seed(rows)).cuda()
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    added, calls = {}, {}
    _syncs(model, inputs, 3)  # CUDA's own first-use work (cuBLAS handles, kernels loaded) is no call's
    for new in (3, 12):
        plain = _syncs(model, inputs, new)
        with nxl.attach(model, layers="all", sink=tmp_path / f"run{new}.nxl" if sink else None) as probe:
            attached = _syncs(model, inputs, new)
        added[new], calls[new] = attached - plain, probe.calls[0]
    assert added[3] == added[12], added  # a constant per call, not one per token
    model.cpu()
    for new, call in calls.items():
        check_call(model, call, new)
