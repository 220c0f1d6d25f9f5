"""PEFT: attribution goes through the active adapter (LoRA blocks, a ModulesToSaveWrapper score head, LoRA on
lm_head) without merging, and through the base model under ``disable_adapter()``. ``attach`` takes the PeftModel.

Oracles read the adapter's own weights by hand (``modules_to_save["default"]``, ``lora_A``/``lora_B``), so
they do not go through the wrapper the library calls.
"""

from __future__ import annotations

import pytest
import torch

import big_models as big
import oracle

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402


def _lora_head(layer) -> oracle.Fn:
    """base(h) + B(A(h)) * scaling for a lora.Linear, by hand (dropout is off in eval)."""
    base = oracle.linear(layer.base_layer)
    down, up = oracle.linear(layer.lora_A["default"]), oracle.linear(layer.lora_B["default"])
    scaling = layer.scaling["default"]
    return lambda h: base(h) + up(down(h)) * scaling


def _check_both(peft_model, adapted: oracle.Fn, base: oracle.Fn, norm: oracle.Fn) -> None:
    ids, mask = big.batch()
    with_adapter = big.check(peft_model, oracle.HandHead(norm, adapted, last_is_normed=True), ids, mask)
    with peft_model.disable_adapter():
        without = big.check(peft_model, oracle.HandHead(norm, base, last_is_normed=True), ids, mask)
    assert not torch.allclose(with_adapter.logat, without.logat, atol=1e-3)  # the two heads really differ


def test_lora_causal_lm():
    model = big.build("llama")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.eval()
    readout = oracle.linear(model.lm_head)  # LoRA changes the blocks, the head is the base one
    _check_both(peft_model, readout, readout, oracle.rms_norm(model.model.norm))
    assert not peft_model.base_model.model.model.layers[0].self_attn.q_proj.merged


def test_lora_on_lm_head():
    model = big.build("llama")
    config = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    peft_model = get_peft_model(model, config).eval()
    lm_head = model.lm_head
    assert type(lm_head).__module__.startswith("peft.") and not lm_head.merged  # a LoRA layer, not a Linear
    _check_both(peft_model, _lora_head(lm_head), oracle.linear(lm_head.base_layer), oracle.rms_norm(model.model.norm))


def test_lora_classifier_modules_to_save_head():
    model = big.build("llama_cls")
    peft_model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False)).eval()
    wrapper = model.score
    assert type(wrapper).__name__ == "ModulesToSaveWrapper"
    with torch.no_grad():  # the adapter's trained copy of the head, unlike the base one
        wrapper.modules_to_save["default"].weight.add_(torch.randn_like(wrapper.original_module.weight))
    _check_both(peft_model, oracle.linear(wrapper.modules_to_save["default"]), oracle.linear(wrapper.original_module),
                oracle.rms_norm(model.model.norm))


@pytest.mark.parametrize("case_id", big.ONE_PER_FAMILY)
def test_lora_blocks_per_family(case_id):
    """LoRA on every block Linear of each family: the blocks' outputs change, the hand-written head still applies."""
    import test_architectures as arch

    case = arch.CASES[case_id]
    peft_model = get_peft_model(case.build(), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False,
                                                            exclude_modules=r".*(pooler|classifier).*"))
    arch._check_against_oracle(case, peft_model.eval().get_base_model())
