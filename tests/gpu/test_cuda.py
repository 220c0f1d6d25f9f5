"""CUDA paths, run whenever a GPU is present and skipped otherwise: bitsandbytes on CUDA, fp16/bf16, and a
device_map split between cuda:0 and cpu (scores computed on each block's own device). Public behaviour only: what
the library returns, and what torch reports about memory (CI has no GPU, so a private name here would rot unseen).
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import big_models as big
import nxl_hooks as nxl
import tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
#: CUDA vs CPU reference: same float32 math, different kernels and summation order.
ACROSS_DEVICES = dict(rtol=1e-3, atol=1e-4)


def _attribute(model, ids, mask) -> tuple[nxl.Attribution, nxl.Probe]:
    with torch.no_grad(), nxl.attach(model, target=[5, 17]) as probe:
        model(input_ids=ids, attention_mask=mask)
    return probe.result(), probe


@pytest.mark.parametrize("quant", ["nf4", "fp4", "int8"])
def test_bnb_on_cuda(tmp_path, quant):
    from transformers import BitsAndBytesConfig
    from test_quantized import QUANT

    path = big.save(tmp_path, "llama")
    model = big.FAMILIES["llama"][0].from_pretrained(path, quantization_config=BitsAndBytesConfig(**QUANT[quant]),
                                                     device_map={"": 0}).eval()
    big.check(model, big.llama_head(model), *big.batch())


def test_bnb_4bit_bert_head_on_cuda(tmp_path):
    from transformers import BitsAndBytesConfig

    path = big.save(tmp_path, "bert", num_labels=3)  # no 32-row constraint on CUDA
    model = big.FAMILIES["bert"][0].from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True),
                                                    device_map={"": 0}).eval()
    big.check(model, big.bert_head(model), *big.batch())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_dtypes_on_cuda(family, dtype):
    model = big.build(family).to("cuda", dtype)
    hand = big.llama_head(model) if family == "llama" else big.bert_head(model)
    loose = dtype != torch.float32
    big.check(model, hand, *big.batch(), rtol=2e-2 if loose else 1e-4, atol=2e-2 if loose else 1e-5)


def _split_llama():
    """Block 1 on the CPU, the rest (final norm and lm_head included) on cuda:0. main_device="cpu": the "cpu"
    block really computes on the CPU instead of being offloaded to run on cuda:0."""
    from accelerate import dispatch_model

    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": "cpu",
                  "model.norm": 0, "lm_head": 0}
    return dispatch_model(big.build("llama"), device_map=device_map, main_device="cpu")


def _cpu_tensor_bytes() -> int:
    """Bytes of every distinct CPU tensor storage that Python objects hold now."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a fake tensor an earlier compiled test left behind: it holds no memory
                continue
    return sum(storages.values())


def _held_by_the_probe(model, ids, mask) -> tuple[int, int]:
    """(CUDA bytes, CPU bytes) the attached forward holds beyond the plain one when the backbone returns (seen by a
    forward hook of our own on it): where the probe keeps each selected layer's hidden states until it scores them."""
    held = {}

    def look(module, args, output) -> None:
        torch.cuda.synchronize()
        held["now"] = (torch.cuda.memory_allocated(), _cpu_tensor_bytes())

    def at_return(attached: bool) -> tuple[int, int]:
        gc.collect()
        handle = model.base_model.register_forward_hook(look)
        try:
            if attached:
                _attribute(model, ids, mask)
            else:
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=mask)
        finally:
            handle.remove()
        return held["now"]

    plain, attached = at_return(False), at_return(True)
    return attached[0] - plain[0], attached[1] - plain[1]


def test_cuda_cpu_split_scores_on_each_blocks_device():
    ids, mask = big.batch()
    ref, _ = _attribute(big.build("llama"), ids, mask)
    split = _split_llama()
    res, _ = _attribute(split, ids.cuda(), mask.cuda())
    torch.testing.assert_close(res.logat, ref.logat, **ACROSS_DEVICES)
    torch.testing.assert_close(res.normxlogit, ref.normxlogit, **ACROSS_DEVICES)
    # Block 1 ran on the CPU: its output stays there until it is scored, instead of crossing to the GPU. Against the
    # same model wholly on cuda:0, the probe holds at least one layer's hidden states less on the GPU, and the split
    # model's probe holds them on the CPU.
    layer = ids.numel() * split.config.hidden_size * 4  # one layer's hidden states, float32
    on_gpu, _ = _held_by_the_probe(big.build("llama").cuda(), ids.cuda(), mask.cuda())
    split_gpu, split_cpu = _held_by_the_probe(split, ids.cuda(), mask.cuda())
    assert on_gpu - split_gpu >= layer and split_cpu >= layer, (on_gpu, split_gpu, split_cpu, layer)


def test_offload_to_cpu_and_disk_executing_on_cuda(tmp_path):
    path = big.save(tmp_path / "model", "llama")
    ids, mask = big.batch()
    ref, _ = _attribute(big.build("llama"), ids, mask)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": "cpu",
                  "model.norm": "cpu", "lm_head": "disk"}
    model = big.FAMILIES["llama"][0].from_pretrained(path, device_map=device_map,
                                                     offload_folder=str(tmp_path / "offload")).eval()
    assert model.lm_head.weight.device.type == "meta"
    res, _ = _attribute(model, ids.cuda(), mask.cuda())
    torch.testing.assert_close(res.logat, ref.logat, **ACROSS_DEVICES)
    torch.testing.assert_close(res.normxlogit, ref.normxlogit, **ACROSS_DEVICES)


def test_generate_on_cuda_cpu_split():
    ids, mask = (tensor.flip(-1) for tensor in big.batch())  # left padding, as for generation
    records = []
    for model, device in ((big.build("llama"), "cpu"), (_split_llama(), "cuda")):
        with torch.no_grad(), nxl.attach(model) as probe:
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=3,
                                 do_sample=False, pad_token_id=0)
        records.append((out.cpu(), probe.steps))
    (cpu_out, cpu_steps), (split_out, split_steps) = records
    assert torch.equal(cpu_out, split_out)
    for cpu_step, split_step in zip(cpu_steps, split_steps, strict=True):
        torch.testing.assert_close(split_step.normxlogit, cpu_step.normxlogit, **ACROSS_DEVICES)


def test_generate_on_cuda_records_reach_the_host_whole_each_batch_in_one_copy_per_tensor(tmp_path):
    """Every tensor of every record (each method's scores included) is on the host once the call returns, equal to
    the same call's on the CPU; the records scored together crossed together: they share host storage. On CUDA the
    steps are scored in the record pipeline's publisher thread, off the generating one; on the CPU in the
    generating thread."""
    ids, mask = (tensor.flip(-1) for tensor in big.batch())
    records, threads = [], {}
    for device in ("cpu", "cuda"):
        model = big.build("llama").to(device)
        threads[device] = tiny.ScoringThreads()
        with torch.no_grad(), nxl.attach(model, methods=["contrastive", threads[device]],
                                         sink=tmp_path / f"{device}.nxl") as probe:
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=4,
                           do_sample=False, pad_token_id=0)
        records.append(probe.steps)
    assert set(threads["cpu"].threads) == {threading.current_thread().name}
    assert set(threads["cuda"].threads) == {"nxl_hooks-publisher"}
    for cpu_step, cuda_step in zip(*records, strict=True):
        tensors = {name: getattr(cuda_step, name) for name in ("token", "target", "embed_norm", "mask", "active",
                                                                 "probability")}
        assert all(value.device.type == "cpu" for value in [*tensors.values(), *cuda_step.scores.values()])
        assert torch.equal(cuda_step.token, cpu_step.token) and torch.equal(cuda_step.mask, cpu_step.mask)
        for name in ("normxlogit", "logat", "contrastive"):
            torch.testing.assert_close(cuda_step.scores[name], cpu_step.scores[name], **ACROSS_DEVICES)
    assert len({step.normxlogit.untyped_storage().data_ptr() for step in records[1]}) < len(records[1])
