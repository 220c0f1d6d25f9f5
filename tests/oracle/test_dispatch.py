"""accelerate: models dispatched with a device_map, CPU offload and disk offload (weights on ``meta`` outside
their forward), the head offloaded too, give the attributions of the same model undispatched.

Tolerance: rtol 1e-5, atol 1e-6. On one CPU the arithmetic is the same; only weight loading differs.
"""

from __future__ import annotations

import threading

import pytest
import torch

import big_models as big
import nxl_hooks as nxl
import oracle
import tiny

accelerate = pytest.importorskip("accelerate")
from accelerate import cpu_offload, disk_offload  # noqa: E402
from nxl_hooks.method.placement import offloaded  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)
# Block 0 computes in place, block 1 and the whole head (final norm and lm_head) are offloaded to disk.
LLAMA_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
             "model.layers.1": "disk", "model.norm": "disk", "lm_head": "disk"}


def _attribute(model, ids, mask, **attach) -> nxl.Attribution:
    with torch.no_grad(), nxl.attach(model, **attach) as probe:
        model(input_ids=ids, attention_mask=mask)
    return probe.result()


def _assert_same(res: nxl.Attribution, ref: nxl.Attribution) -> None:
    assert torch.equal(res.target, ref.target)
    torch.testing.assert_close(res.logat, ref.logat, **TOL)
    torch.testing.assert_close(res.normxlogit, ref.normxlogit, **TOL)
    torch.testing.assert_close(res.embed_norm, ref.embed_norm, **TOL)


def _offload(how: str, family: str, path, tmp_path):
    cls, _ = big.FAMILIES[family]
    if how == "device_map":
        return cls.from_pretrained(path, device_map=LLAMA_MAP, offload_folder=str(tmp_path / "offload")).eval()
    model = cls.from_pretrained(path).eval()
    if how == "cpu_offload":  # weights kept in a CPU state dict, on meta outside each module's forward
        return cpu_offload(model, execution_device="cpu")
    return disk_offload(model, str(tmp_path / "disk"), execution_device="cpu")


@pytest.mark.parametrize("how", ["device_map", "cpu_offload", "disk_offload"])
def test_offloaded_llama_equals_undispatched(tmp_path, how):
    path = big.save(tmp_path / "model", "llama")
    ids, mask = big.batch()
    ref = _attribute(big.build("llama"), ids, mask, target=[5, 17])
    model = _offload(how, "llama", path, tmp_path)
    assert model.lm_head.weight.device.type == "meta" and model.model.norm.weight.device.type == "meta"
    _assert_same(_attribute(model, ids, mask, target=[5, 17]), ref)
    _assert_same(_attribute(model, ids, mask), _attribute(big.build("llama"), ids, mask))
    assert model.lm_head.weight.device.type == "meta"  # reading the head left it offloaded


@pytest.mark.parametrize("family", ["bert", "llama_cls"])
def test_offloaded_classifier_equals_undispatched(tmp_path, family):
    path = big.save(tmp_path / "model", family)
    ids, mask = big.batch()
    ids = ids.masked_fill(mask == 0, 0)
    model = _offload("disk_offload", family, path, tmp_path)
    _assert_same(_attribute(model, ids, mask), _attribute(big.build(family), ids, mask))


def test_offloaded_norm_replica_is_materialized_and_hook_free(tmp_path):
    """Under a device_map whose blocks sit elsewhere than the final norm, the norm runs as a local copy on each
    block's device; the copy must hold the real (not meta) weights and leave the offloaded original as it was."""
    from nxl_hooks.method.placement import replica

    model = _offload("disk_offload", "llama", big.save(tmp_path / "model", "llama"), tmp_path)
    norm = model.model.norm
    copy = replica(norm, torch.device("cpu"))
    assert not hasattr(copy, "_hf_hook") and copy.weight.device.type == "cpu"
    torch.testing.assert_close(copy.weight, big.build("llama").model.norm.weight, rtol=0, atol=0)
    assert norm.weight.device.type == "meta" and hasattr(norm, "_hf_hook")
    hidden = torch.randn(2, 3, 64)
    torch.testing.assert_close(copy(hidden), big.build("llama").model.norm(hidden), rtol=0, atol=0)


@pytest.mark.parametrize("case_id", big.ONE_PER_FAMILY)
def test_disk_offload_per_family(tmp_path, case_id):
    import test_architectures as arch

    case = arch.CASES[case_id]
    ids, mask = arch._batch(case, arch._kind(case.build()))
    model = case.build()
    # DeBERTa-v2 reads rel_embeddings.weight outside its forward, which full offload breaks in transformers
    # itself: there the blocks and the head are offloaded, the embeddings and encoder stay.
    parts = [*model.deberta.encoder.layer, model.pooler, model.classifier] if case_id.startswith("deberta") else [model]
    for index, part in enumerate(parts):
        disk_offload(part, str(tmp_path / str(index)), execution_device="cpu")
    assert all(param.device.type == "meta" for part in parts for param in part.parameters())
    _assert_same(_attribute(model, ids, mask), _attribute(case.build(), ids, mask))


def test_generate_with_offloaded_head(tmp_path, monkeypatch):
    """Streaming attribution during generate reads the offloaded head the same way: same tokens, same steps. The
    offloaded head is read in the generating thread, between the model's forwards (accelerate loads its weights into
    the module for each call), where a head that stays put is read in the publisher thread (as on a GPU: here the
    CPU is made one of the devices scored there)."""
    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "SCORED_ELSEWHERE", generate.SCORED_ELSEWHERE | {"cpu"})
    ids, mask = (tensor.flip(-1) for tensor in big.batch())  # left padding, as for generation
    runs, threads = [], []
    for model in (big.build("llama"), disk_offload(big.build("llama"), str(tmp_path), execution_device="cpu")):
        threads.append(tiny.ScoringThreads())
        with torch.no_grad(), nxl.attach(model, methods=[threads[-1]]) as probe:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
        runs.append((out, probe.steps))
    (plain_out, plain_steps), (offloaded_out, offloaded_steps) = runs
    assert torch.equal(plain_out, offloaded_out)
    assert [set(t.threads) for t in threads] == [{"nxl_hooks-publisher"}, {threading.current_thread().name}]
    for plain_step, offloaded_step in zip(plain_steps, offloaded_steps, strict=True):
        torch.testing.assert_close(offloaded_step.normxlogit, plain_step.normxlogit, **TOL)


def test_a_norm_copy_follows_a_weight_replaced_twice(monkeypatch):
    """The final norm's local copy (made where a block runs on another device than the norm) is made again when the
    norm's weights change, also when one is replaced twice and the last takes the first's address (its id) at the
    same version: the allocator decides that, so here id() answers alike for every object, as it then does."""
    from nxl_hooks.arch.registry import resolve
    from nxl_hooks.method import head as head_module

    monkeypatch.setattr(head_module, "id", lambda _: 0, raising=False)
    model = big.build("llama")
    head = head_module.Head(model, *resolve(model))
    norm, hidden = model.model.norm, torch.randn(2, 3, 64)
    norm.weight = torch.nn.Parameter(torch.randn_like(norm.weight))  # as loaded: version 0
    head._step_on(0, norm, torch.device("cpu"))  # the copy a block elsewhere would use
    for _ in range(2):
        norm.weight = torch.nn.Parameter(torch.randn_like(norm.weight))
    torch.testing.assert_close(head._step_on(0, norm, torch.device("cpu"))(hidden), norm(hidden), rtol=0, atol=0)


@pytest.mark.parametrize("how", ["cpu_offload", "disk_offload", "lm_head_alone"])
def test_a_model_offloaded_after_attaching_is_recorded(tmp_path, how):
    """Offloaded with accelerate once attached: the head took its readout for not offloaded for good (decided when
    attaching) and kept folding the final norm, whose weights then wait on meta; and the lm_head offloaded alone
    (accelerate's hook in a SequentialHook, which align_module_device does not load) was still read row by row. Every
    forward and generate was "not recorded (NotImplementedError: Cannot copy out of meta tensor; no data!)". The
    numbers are the oracle's."""
    ids, mask = big.batch()
    twin = big.build("llama")
    with torch.no_grad():
        out = twin(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        logits = big.llama_head(twin).layer_logits(out.hidden_states)
    model = big.build("llama")
    with torch.no_grad(), nxl.attach(model) as probe:
        if how == "cpu_offload":
            cpu_offload(model, execution_device="cpu")
        elif how == "disk_offload":
            disk_offload(model, str(tmp_path), execution_device="cpu")
        else:
            cpu_offload(model.lm_head, execution_device="cpu")
        assert model.lm_head.weight.is_meta and model.model.norm.weight.is_meta == (how != "lm_head_alone")
        model(input_ids=ids, attention_mask=mask)
        res = probe.result()
        model.generate(input_ids=ids.flip(-1), attention_mask=mask.flip(-1), max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
        assert len(probe.steps) == 2  # recorded (result() raised where it was not)
    logat, expected = oracle.normxlogit(logits, out.hidden_states[0], res.target)
    torch.testing.assert_close(res.logat, logat, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res.normxlogit, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("how", ["cpu_offload", "lm_head_alone"])
def test_an_offloaded_readout_is_offloaded_while_a_call_has_its_weights_loaded(how):
    """Asked while the model's own call has the weights loaded (another thread reading the head: the record
    pipeline), the readout must still be offloaded, so that the reading takes the lock; accelerate's offload hook
    of a module offloaded alone sits in a SequentialHook, which has no `offload` of its own: it was not."""
    model = big.build("llama")
    cpu_offload(model if how == "cpu_offload" else model.lm_head, execution_device="cpu")
    assert offloaded(model.lm_head)  # idle: on meta
    model.lm_head._hf_hook.pre_forward(model.lm_head)  # what the call does first: the weights loaded
    try:
        assert not model.lm_head.weight.is_meta and offloaded(model.lm_head)
    finally:
        model.lm_head._hf_hook.post_forward(model.lm_head, None)


@pytest.mark.parametrize("case_id", ["gemma-lm", "gemma2-lm"])
def test_a_scaled_embedding_offloaded_gives_its_raw_rows_norms(tmp_path, case_id):
    """embedding="word" for a scaled embedding (Gemma: its rows times sqrt(d)) is the norm of the raw weight rows. An
    offloaded one's weights wait on meta after its call, and the norms were taken from its output divided back by the
    scale: in bfloat16, rounded after scaling, up to 1.4e-3 off the rows' own."""
    import test_architectures as arch

    case = arch.CASES[case_id]
    twin = case.build().to(torch.bfloat16)
    ids, mask = arch._batch(case, arch._kind(twin))
    rows = twin.model.embed_tokens.weight.detach()[ids].float().norm(dim=-1)  # the raw rows, by hand
    model = disk_offload(case.build().to(torch.bfloat16), str(tmp_path), execution_device="cpu")
    res = _attribute(model, ids, mask, embedding="word")
    assert model.model.embed_tokens.weight.is_meta  # read, and left offloaded
    torch.testing.assert_close(res.embed_norm, rows, rtol=1e-6, atol=0)
