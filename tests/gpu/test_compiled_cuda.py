"""Compiled generate on CUDA, run whenever a GPU is present and skipped otherwise: transformers' own compiled
static-cache generate (its default on CUDA) and ``mode="reduce-overhead"`` (CUDA graphs) are recorded, every step
equal to the CPU oracle, with the unrecorded call's logits to the bit (nothing of the probe's is in the compiled
code); recording adds no synchronisation per generated token."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

import nxl_hooks as nxl
import tiny
from oracle import check_call
from test_sync import _syncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _warm_syncs(model, inputs: dict) -> dict[int, int]:
    """Synchronisations of a call making 4 and 12 tokens, each counted on its second run: a static cache of a new
    length compiles (and captures) again on its first, which synchronises as it likes."""
    for new in (4, 12):
        _syncs(model, inputs, new)
    return {new: _syncs(model, inputs, new) for new in (4, 12)}


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("rows", [1, 4])
def test_compiled_generate_on_cuda_is_recorded(mode, rows):
    torch._dynamo.reset()
    model = tiny.generating_llama().cuda()
    ids = torch.randint(1, tiny.GEN_VOCAB, (rows, 6), generator=torch.Generator().manual_seed(rows)).cuda()
    config = CompileConfig(mode=mode)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), cache_implementation="static",
                  compile_config=config)
    plain = model.generate(**inputs, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                           output_logits=True)
    with nxl.attach(model, layers="all") as probe:
        for _ in range(2):  # the second call replays what the first compiled (and captured)
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                                 output_logits=True)
            assert torch.equal(out.sequences, plain.sequences)
            assert all(torch.equal(a, b) for a, b in zip(out.logits, plain.logits, strict=True))
        added = _warm_syncs(model, inputs)
    plain_syncs = _warm_syncs(model, inputs)
    # a constant per call, not one per token
    assert added[12] - plain_syncs[12] == added[4] - plain_syncs[4], (added, plain_syncs)
    assert probe.unrecorded is None
    model.cpu()
    for call in probe.calls[:2]:
        check_call(model, call, 8)
