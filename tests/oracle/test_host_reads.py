"""No host read per generated token: attached ``generate`` (eager, or compiled by generate itself) reads values
back from the device (``.cpu()``, ``.tolist()``, ``.item()``, ``bool(t)``, ``int(t)``...) only a constant number of
times per call more than plain ``generate`` does, whatever the number of tokens, at batch 1 and 4 (left padding, a
row that stops early at its EOS token), with a sink and a live subscriber; every step still equals the uncached
oracle. Counted with a ``TorchFunctionMode``, which sees the calling thread only: the record pipeline's own thread
reads the records."""

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import LlamaForCausalLM

import nxl_hooks as nxl
import tiny
from oracle import check_call

VOCAB, PAD = tiny.GEN_VOCAB, tiny.GEN_PAD
#: What reads a tensor's values back to the host (on an accelerator: a synchronisation).
READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy, torch.equal, torch.Tensor.nonzero,
         torch.nonzero, torch.Tensor.__format__}


class HostReads(TorchFunctionMode):
    """Counts the host reads made in this thread while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = func is torch.Tensor.to and "cpu" in (*args[1:], kwargs.get("device"))
        self.count += func in READS or to_host
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny.generating_llama()


def _inputs(model, rows: int) -> dict:
    """Greedy inputs; at batch 4, row 0 left-padded and an EOS id that row 0 alone emits at step 1, so it finishes
    early while the others run every step."""
    for seed in range(100):
        ids = torch.randint(1, VOCAB, (rows, 6), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones(rows, 6, dtype=torch.long)
        inputs = dict(input_ids=ids, attention_mask=mask, do_sample=False)
        if rows == 1:
            return inputs
        ids[0, :2], mask[0, :2] = PAD, 0
        reference = model.generate(**inputs, max_new_tokens=10)[:, 6:]
        eos = int(reference[0, 1])
        if eos != int(reference[0, 0]) and eos not in reference[1:].reshape(-1).tolist():
            return {**inputs, "eos_token_id": eos}
    raise AssertionError("no prompt whose row 0 alone emits a token at step 1")


def _reads(model, inputs: dict, new: int) -> int:
    compiled = "compile_config" in inputs
    if compiled:  # compiled anew, so that the same steps run compiled in every call (CACHES)
        torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2) if compiled else contextlib.nullcontext(), HostReads() as reads:
        model.generate(**inputs, max_new_tokens=new)
    return reads.count


#: generate's own KV caches: a dynamic one (positions from its shape), a static one run eagerly (positions a
#: device tensor: its length, or cache_position before transformers 5.24), and a static one generate compiles itself
#: (its steps recorded when the call returns; dynamo guards the compiled step on the counting mode's count, so past
#: its recompile_limit it runs the call's later steps eagerly, after compiled ones: the two first here)
CACHES = {"dynamic": {}, "static": {"cache_implementation": "static", "disable_compile": True},
          "compiled": {"cache_implementation": "static"}}


@pytest.mark.parametrize("rows,cache", [(1, "dynamic"), (4, "dynamic"), (1, "static"), (4, "compiled")])
def test_attached_generate_adds_no_host_read_per_token(model, tmp_path, rows, cache):
    inputs = {**_inputs(model, rows), **CACHES[cache]}
    if cache == "compiled":
        inputs["compile_config"] = tiny.cpu_compile(backend="eager")
    added = {}
    for new in (3, 10):
        plain = _reads(model, inputs, new)
        with nxl.attach(model, layers="all", sink=tmp_path / f"{new}.nxl") as probe:
            live = probe.subscribe(follow=True)
            attached = _reads(model, inputs, new)
            live.close()
        added[new] = attached - plain
        call = probe.calls[0]
        check_call(model, call, new)  # every step equals the oracle
        assert len(list(live)) == new and len(nxl.read_stream(tmp_path / f"{new}.nxl")[0].steps) == new
        if rows > 1:  # row 0 finished at step 1, on the device: its later tokens are pads, masked and inactive
            assert int(call.steps[1].token[0]) == inputs["eos_token_id"]
            assert [bool(step.active[0]) for step in call.steps] == [True, True] + [False] * (new - 2)
            for step in call.steps[3:]:
                assert not step.mask[0, 6 + 2: step.position].any() and step.mask[0, 2: 6 + 2].all()
            assert all(step.mask[1:].all() for step in call.steps)
    assert added[3] == added[10], added  # a constant per call, not one per token
    assert added[10] <= 8, added
    torch._dynamo.reset()  # (the model's compiled call is left to no other test)
