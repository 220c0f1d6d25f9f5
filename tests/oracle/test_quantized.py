"""Quantized and reduced-precision models on CPU: bitsandbytes 4-bit (nf4, fp4) and 8-bit, optimum-quanto,
torchao, and every registered family in bf16/fp16. Each is checked against an oracle built from that model's
own ``output_hidden_states``; quantized head modules are called by the oracle, never dequantized by hand."""

from __future__ import annotations

import pytest
import torch

import big_models as big
import nxl_hooks as nxl

bnb = pytest.importorskip("bitsandbytes")
from transformers import BitsAndBytesConfig  # noqa: E402

QUANT = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "int8": dict(load_in_8bit=True),
}
_LINEAR = {"nf4": bnb.nn.Linear4bit, "fp4": bnb.nn.Linear4bit, "int8": bnb.nn.Linear8bitLt}


def _load(tmp_path_factory, family: str, quant: str, **config):
    cls, _ = big.FAMILIES[family]
    path = big.save(tmp_path_factory.mktemp(family), family, **config)
    return cls.from_pretrained(path, quantization_config=BitsAndBytesConfig(**QUANT[quant])).eval()


@pytest.mark.parametrize("quant", list(QUANT))
def test_bnb_llama_matches_its_own_hidden_states(tmp_path_factory, quant):
    model = _load(tmp_path_factory, "llama", quant)
    assert isinstance(model.model.layers[0].mlp.up_proj, _LINEAR[quant])  # the blocks really are quantized
    assert type(model.lm_head) is torch.nn.Linear  # bitsandbytes keeps lm_head: the gathered readout path
    big.check(model, big.llama_head(model), *big.batch())


# bitsandbytes' CPU 4-bit kernel (AVX512-BF16) repacks weights in blocks of 32 output rows: a 4-bit
# classifier needs num_labels % 32 == 0 to run at all there, so the 4-bit heads get 32 labels.
@pytest.mark.parametrize("quant", ["nf4", "int8"])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_bnb_quantized_classification_heads(tmp_path_factory, family, quant):
    model = _load(tmp_path_factory, family, quant, num_labels=32 if quant == "nf4" else 3)
    quantized = ([model.bert.pooler.dense, model.classifier] if family == "bert"
                 else [model.classifier.dense, model.classifier.out_proj])
    assert all(isinstance(module, _LINEAR[quant]) for module in quantized)  # readout and pre-readout steps
    hand = big.bert_head(model) if family == "bert" else big.roberta_head(model)
    big.check(model, hand, *big.batch())
    big.check(model, hand, *big.batch(seed=2))  # again, after a 4-bit Linear has repacked itself in place


def _with_outlier_features(tmp_path, family: str, norm: str, cls, quant: dict):
    """``family`` with gains of 8 on four hidden dims of the norm at path ``norm`` (the outlier features real models
    have: values past bitsandbytes' 8-bit threshold, 6.0, reach the head), reloaded with ``quant``."""
    model = big.build(family, **({"num_labels": 3} if family == "bert" else {}))
    with torch.no_grad():
        model.get_submodule(norm).weight[:4] = 8.0
    model.save_pretrained(tmp_path)
    return cls.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(**quant)).eval()


def test_an_8bit_head_gives_the_models_own_logit_at_the_last_layer(tmp_path):
    """bitsandbytes' 8-bit Linear picks the columns it computes in 16 bits over its whole input, so a row's output
    depends on the others in its call: the head called on every position of the last layer gave the CLS rows
    another logit than the model's call on those rows alone (~6e-4 off). At l = L and the prediction position LogAt
    is the model's own logit; every layer below is the oracle's (the model's own modules on that layer's states)."""
    import oracle
    from transformers import BertForSequenceClassification

    import nxl_hooks as nxl

    model = _with_outlier_features(tmp_path, "bert", "bert.encoder.layer.1.output.LayerNorm",
                                   BertForSequenceClassification, QUANT["int8"])
    assert isinstance(model.classifier, bnb.nn.Linear8bitLt) and model.classifier.state.threshold > 0
    ids, mask = big.batch()
    ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
    with torch.no_grad(), nxl.attach(model, layers="all") as probe:
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    res = probe.result()
    rows = torch.arange(len(ids))
    assert torch.equal(res.logat[-1, rows, 0], out.logits[rows, res.target].float())
    with torch.no_grad():
        logat, _ = oracle.normxlogit(big.bert_head(model).layer_logits(out.hidden_states), out.hidden_states[0],
                                     res.target)
    torch.testing.assert_close(res.logat[:-1], logat[:-1], rtol=1e-4, atol=1e-5)


def test_generate_steps_of_an_8bit_readout_give_the_models_own_output_logits_at_the_last_layer(tmp_path):
    """An 8-bit lm_head through generate: the library reads out every layer's positions in one call, where other
    positions' outlier columns changed a step's logit (~6e-4 off from step 1 on); at l = L and each step's position
    LogAt is generate's own ``output_logits`` of its token."""
    from transformers import LlamaForCausalLM

    import nxl_hooks as nxl

    model = _with_outlier_features(tmp_path, "llama", "model.norm", LlamaForCausalLM,
                                   dict(QUANT["int8"], llm_int8_skip_modules=[]))
    assert isinstance(model.lm_head, bnb.nn.Linear8bitLt)
    ids, _ = big.batch()
    with torch.no_grad(), nxl.attach(model, layers="all") as probe:
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None,
                             output_logits=True, return_dict_in_generate=True)
    assert len(probe.steps) == len(out.logits) == 3
    for step, own in zip(probe.steps, out.logits):
        assert torch.equal(step.scores["logat"][-1, :, step.position - 1], own.gather(-1, step.token.view(-1, 1))[:, 0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_llama(dtype):
    model = big.build("llama").to(dtype)
    # Same arithmetic in a lower precision, but gathered rows sum in another order than a full matmul.
    big.check(model, big.llama_head(model), *big.batch(), rtol=2e-2, atol=2e-2)


def test_quanto_int8(tmp_path_factory):
    pytest.importorskip("optimum.quanto")
    from optimum.quanto import QLinear
    from transformers import LlamaForCausalLM, QuantoConfig

    path = big.save(tmp_path_factory.mktemp("quanto"), "llama")
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=QuantoConfig(weights="int8")).eval()
    assert isinstance(model.model.layers[0].mlp.up_proj, QLinear)
    big.check(model, big.llama_head(model), *big.batch())


def test_quanto_with_quantized_activations():
    """optimum-quanto's ``quantize(model, weights=qint8, activations=qint8)`` quantizes a QLinear's input in a
    forward pre-hook of its own; the head's modules were called without their hooks, so every layer's logits
    missed the model's lm_head (~2.6e-3 on logits of ~0.5). Its own hooks are part of what it computes now."""
    pytest.importorskip("optimum.quanto")
    from optimum.quanto import Calibration, freeze, qint8, quantize

    model = big.build("llama")
    quantize(model, weights=qint8, activations=qint8)
    with torch.no_grad(), Calibration():
        model(*big.batch())
    freeze(model)
    assert model.lm_head._forward_pre_hooks  # the input's quantization
    big.check(model, big.llama_head(model), *big.batch())


def test_torchao_int8_weight_only(tmp_path_factory):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import LlamaForCausalLM, TorchAoConfig

    path = big.save(tmp_path_factory.mktemp("torchao"), "llama")
    config = TorchAoConfig(Int8WeightOnlyConfig(), modules_to_not_convert=[])  # lm_head too: a quantized readout
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=config).eval()
    assert type(model.lm_head.weight) is not torch.nn.Parameter  # torchao's Int8Tensor: cannot be row-gathered
    big.check(model, big.llama_head(model), *big.batch())


# -- one model per registered family, for the support matrix ------------------------------------------------
#
# test_architectures holds the case table (tiny config, hand-written head) and the full oracle check; here the
# same check runs in half precision and on bitsandbytes-quantized decoders (offload: test_dispatch; LoRA: test_peft).

# Decoders whose final norm and lm_head bitsandbytes leaves unquantized, so the hand-written head applies
# (bitsandbytes converts no Linear of the tiny Falcon: nothing to test there).
BNB_DECODERS = [case for case in big.ONE_PER_FAMILY if case.endswith("-lm") and case != "falcon-lm"]
# The CPU 4-bit kernel wants in_features % 64 == 0 and out_features % 32 == 0: widen the tiny configs.
WIDE = dict(hidden_size=64, intermediate_size=128, head_dim=16, word_embed_proj_dim=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case_id", big.ONE_PER_FAMILY)
def test_half_precision_per_family(monkeypatch, case_id, dtype):
    import test_architectures as arch

    # The oracle computes the same ops in the same dtype, but its full matmul rounds in another order than
    # the library's gathered rows (bf16 has 8 mantissa bits; these random weights give logits up to ~10).
    monkeypatch.setattr(arch, "_TOL", dict(rtol=3e-2, atol=6e-2))
    case = arch.CASES[case_id]
    arch._check_against_oracle(case, case.build().to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["mamba", "mamba2", "falcon_mamba"])
def test_a_half_precision_state_space_model_is_read_out_in_its_heads_dtype(kind, dtype):
    """Mamba's blocks keep their residual stream in float32 (residual_in_fp32), so on a 16-bit model norm_f gives
    float32 and the model casts it to lm_head's dtype: the head-on-top does too (it raised a dtype mismatch, and
    generic discovery refused the model). Every layer against the oracle, l = L the model's own logit to the bit."""
    import oracle
    import tiny

    model = tiny.generating_state_space(kind).to(dtype)
    hand = oracle.state_space(model)
    hand.head = oracle.then(lambda h: h.to(dtype), hand.head)
    ids = torch.randint(0, tiny.GEN_VOCAB - 1, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), nxl.attach(model, layers="all") as probe:
        out = model(input_ids=ids, output_hidden_states=True)
    res = probe.result()
    logits = hand.layer_logits(hand.states(ids, out.hidden_states))
    expected, _ = oracle.normxlogit(logits, model.backbone.embeddings(ids), res.target)
    torch.testing.assert_close(res.logat, expected, rtol=3e-2, atol=6e-2)
    own = out.logits[:, -1].gather(-1, res.target[:, None])[:, 0]
    assert torch.equal(res.logat[-1, :, -1], own.float())


def test_a_4bit_readout_stored_as_bf16_reads_features_in_the_dtype_it_computes_in():
    """A 4-bit head whose packed storage is bf16 (quant_storage) computes in float32 (compute_dtype): its weight's
    dtype is no dtype it computes in. Features rounded to bf16 for it (the cast a plain 16-bit Linear needs, taken
    for any readout) moved every layer of a float32 model by up to 4e-4."""
    import oracle
    import tiny

    model = tiny.generating_llama()
    plain = model.lm_head
    head = bnb.nn.Linear4bit(plain.in_features, plain.out_features, bias=False, compute_dtype=torch.float32,
                             quant_storage=torch.bfloat16, quant_type="nf4")
    head.weight = bnb.nn.Params4bit(plain.weight.data.clone(), requires_grad=False, quant_storage=torch.bfloat16,
                                    quant_type="nf4")
    model.lm_head = head.to("cpu")
    assert model.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, tiny.GEN_VOCAB - 1, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), nxl.attach(model, layers="all") as probe:
        out = model(input_ids=ids, output_hidden_states=True)
        res = probe.result()
        # the hand-written final norm, then the model's own 4-bit head on float32 features
        logits = oracle.layer_logits(out.hidden_states, oracle.rms_norm(model.model.norm), model.lm_head,
                                     last_is_normed=True)
    expected, _ = oracle.normxlogit(logits, model.model.embed_tokens(ids), res.target)
    torch.testing.assert_close(res.logat, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("case_id", "readout"), [("phi-lm", "lm_head"), ("bert-cls", "classifier"),
                                                  ("roberta-cls", "classifier.out_proj")])
def test_a_biased_readout_gives_the_models_own_half_precision_logit_to_the_bit(case_id, readout, dtype):
    """At l = L and the prediction position LogAt is the model's own bf16 / fp16 logit exactly, the readout's bias
    too: nn.Linear adds it inside its product and rounds once (the bias added after the gathered product rounded a
    logit twice, a step off). Both sum in float32, in orders that differ by float32 ulps (test_architectures' 1e-4):
    rounded once to half precision, they vanish on these models."""
    import test_architectures as arch

    case = arch.CASES[case_id]
    model = case.build(num_labels=16).to(dtype)
    with torch.no_grad():
        model.get_submodule(readout).bias.normal_(0.0, 5.0)  # large: a second rounding shows on many outputs
    kind = arch._kind(model)
    ids, mask = arch._batch(case, kind)
    outputs = list(range(model.get_submodule(readout).out_features))
    res, out = arch._run(model, ids, mask, target=outputs)
    examples, positions = arch._expected_rows(case, kind, ids, mask)
    rows = torch.arange(len(examples))
    assert torch.equal(res.logat[-1, rows, positions], arch._own_logits(out, kind, examples, positions).float())


def _biased_phi(dtype: torch.dtype, *, tie: bool) -> torch.nn.Module:
    """A bf16 / fp16 Phi whose lm_head bias is large, so that a readout rounding product and bias apart shows on many
    outputs; ``tie``: 40 outputs lifted together to the top (bias 20), near ties."""
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    model = PhiForCausalLM(PhiConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=256, pad_token_id=0, eos_token_id=None,
                                     bos_token_id=None)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3 if parameter.dim() == 1 else 0.05)
        model.lm_head.bias.normal_(0.0, 1.0 if tie else 5.0)
        if tie:
            model.lm_head.bias[5:45] = 20.0
    return model.to(dtype)


@pytest.mark.parametrize("tie", [False, True], ids=["bias", "near-tie"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_forward_with_logits_to_keep_is_explained_with_the_logits_the_model_returned(dtype, tie):
    """A biased 16-bit readout called with ``logits_to_keep`` (as generate's prefill is) runs on a strided slice,
    where nn.Linear rounds its product and its bias apart. The predicted target, its probability and the rows the
    model kept are its returned logits'; a row whose prediction position it did not keep (right padding) is the
    head's on its hidden states, which the full forward's logits give. (The library recomputed every row: a target
    that was not the argmax of the model's own logits near a tie, probabilities 0.518 for 0.502.)"""
    import nxl_hooks as nxl

    model = _biased_phi(dtype, tie=tie)
    ids = torch.randint(3, 512, (320, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[::8, -2:] = 0  # right-padded rows: their prediction position (4) is not among the last one kept
    with torch.no_grad(), nxl.attach(model, layers=[-1]) as probe:
        kept = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1].float()
    res = probe.result()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits.float()
    own = torch.where(mask[:, -1:].bool(), kept, full[torch.arange(len(ids)), mask.sum(-1) - 1])
    assert torch.equal(res.target, own.argmax(-1))
    torch.testing.assert_close(res.probability, own.softmax(-1).gather(-1, res.target[:, None])[:, 0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_forward_with_logits_to_keep_gives_the_models_own_logit_at_the_last_layer(dtype):
    """Every output of a biased 16-bit readout called with ``logits_to_keep=1``: at l = L and the prediction
    position LogAt is the logit the model returned, to the bit (its nn.Linear on the strided slice rounds product
    and bias apart; the head's gathered rows round once, ~90 outputs in 1024 a step off); a row whose prediction
    position was not kept gives the full forward's."""
    import nxl_hooks as nxl

    model = _biased_phi(dtype, tie=False)
    ids = torch.randint(3, 512, (4, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    with torch.no_grad(), nxl.attach(model, layers="all", target=list(range(512))) as probe:
        kept = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1].float()
    res = probe.result()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits.float()
    rows, positions = torch.arange(len(ids)), mask.sum(-1) - 1
    own = torch.where(mask[:, -1:].bool(), kept, full[rows, positions])
    assert torch.equal(res.logat[-1, rows, positions], own)


def test_a_forward_with_logits_to_keep_gives_the_contrastive_gap_of_the_models_own_logits():
    """The ``contrastive`` score at l = L and the prediction position of a bf16 biased readout called with
    ``logits_to_keep=1`` is the embedding norm times the gap between the model's own returned logits of the target
    and of its foil (the foil's logit was the head's, a rounding step off: the gap missed by up to 0.0625)."""
    import nxl_hooks as nxl

    model = _biased_phi(torch.bfloat16, tie=False)
    ids = torch.randint(3, 512, (64, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), nxl.attach(model, layers="all", methods=["contrastive"]) as probe:
        own = model(input_ids=ids, logits_to_keep=1).logits[:, -1].float()
    res = probe.result()
    rows = torch.arange(len(ids))
    foil = own.scatter(-1, res.target[:, None], float("-inf")).argmax(-1)
    gap = own[rows, res.target] - own[rows, foil]
    torch.testing.assert_close(res.scores["contrastive"][-1, rows, -1], res.embed_norm[:, -1] * gap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_generate_steps_give_the_models_own_output_logits_at_the_last_layer(dtype):
    """A biased 16-bit readout through generate, whose prefill asks ``logits_to_keep=1``: at l = L and each
    step's position LogAt of every output is generate's own ``output_logits``, to the bit, step 0 (the prefill's
    strided readout) too: it missed ~90 of 1024 values by up to 0.03125."""
    import nxl_hooks as nxl

    model = _biased_phi(dtype, tie=False)
    ids = torch.randint(3, 512, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), nxl.attach(model, layers="all", target=list(range(512))) as probe:
        out = model.generate(ids, max_new_tokens=3, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    assert len(probe.steps) == len(out.logits) == 3
    for step, own in zip(probe.steps, out.logits):
        assert torch.equal(step.scores["logat"][-1, :, step.position - 1], own.float())


def test_generate_steps_give_the_contrastive_gap_of_the_models_own_output_logits():
    """The ``contrastive`` score at l = L and each step's position of a bf16 biased readout through generate is the
    embedding norm times the gap between generate's own ``output_logits`` of the token and of its foil, step 0 (the
    prefill's strided readout) too: its foil's logit was the head's, a rounding step off."""
    import nxl_hooks as nxl

    model = _biased_phi(torch.bfloat16, tie=False)
    ids = torch.randint(3, 512, (16, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), nxl.attach(model, layers="all", methods=["contrastive"]) as probe:
        out = model.generate(ids, max_new_tokens=2, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    rows = torch.arange(len(ids))
    for step, own in zip(probe.steps, out.logits):
        own, position = own.float(), step.position - 1
        foil = own.scatter(-1, step.target.view(-1, 1), float("-inf")).argmax(-1)
        gap = own[rows, step.target.view(-1)] - own[rows, foil]
        torch.testing.assert_close(step.scores["contrastive"][-1, :, position].view(-1),
                                   step.embed_norm[:, position] * gap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case_id", ["llama-lm", "gemma2-lm"])
def test_a_model_cast_to_half_precision_while_attached_gives_its_own_logit_to_the_bit(case_id, dtype):
    """Attached in float32 (its RMS norm folded into the gathered rows), one forward, then ``model.to(dtype)``
    while attached: at l = L and the prediction position LogAt is the model's own 16-bit logit exactly, as when
    attached after the cast. (The fold, decided at attach, went on multiplying in 16 bits before the float32 scale:
    every position off, by up to ~2e-2 on Gemma2's soft-capped logits.)"""
    import test_architectures as arch

    import nxl_hooks as nxl

    case = arch.CASES[case_id]
    model = case.build()
    with torch.no_grad():
        for parameter in model.parameters():  # large weights: logits of a few units, where rounding shows
            parameter.normal_(0.0, 0.3)
    kind = arch._kind(model)
    ids, mask = arch._batch(case, kind)
    with torch.no_grad(), nxl.attach(model, layers="all") as probe:
        model(input_ids=ids, attention_mask=mask)
        model.to(dtype)
        out = model(input_ids=ids, attention_mask=mask)
        res = probe.result()
    examples, positions = arch._expected_rows(case, kind, ids, mask)
    own = arch._own_logits(out, kind, examples, positions)
    assert own.dtype == dtype
    rows = torch.arange(len(examples))
    assert torch.equal(res.logat[-1, rows, positions], own[rows, res.target].float())


@pytest.mark.parametrize(("case_id", "kept"), [("llama-lm", ["model.norm", "lm_head"]), ("gemma2-lm", ["model.norm"])])
def test_a_half_precision_model_with_a_float32_final_norm_gives_its_own_logit(case_id, kept):
    """A bf16 model whose final norm (and head) is kept in float32: its hidden states are bf16, the norm's weight
    float32. LogAt at l = L and the prediction position is the model's own logit (Gemma2's norm casts back to bf16:
    exactly; Llama's float32 head: to float32 rounding). The fold, accepted for the float32 weight, multiplied the
    bf16 hidden states by bf16-rounded rows: 2.8% off on Llama, every Gemma2 logit off by up to 1.6e-2."""
    import test_architectures as arch

    import nxl_hooks as nxl

    case = arch.CASES[case_id]
    model = case.build()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    model.to(torch.bfloat16)
    for name in kept:
        model.get_submodule(name).float()
    kind = arch._kind(model)
    ids, mask = arch._batch(case, kind)
    with torch.no_grad(), nxl.attach(model, layers="all") as probe:
        out = model(input_ids=ids, attention_mask=mask)
    res = probe.result()
    examples, positions = arch._expected_rows(case, kind, ids, mask)
    own, rows = arch._own_logits(out, kind, examples, positions), torch.arange(len(examples))
    tolerance = 0.0 if own.dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(res.logat[-1, rows, positions], own[rows, res.target].float(), rtol=tolerance,
                               atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_under_autocast_the_last_layer_gives_the_models_own_logit_to_the_bit(dtype):
    """A float32 Llama run under ``torch.autocast``: the model rounds its normed features to half precision and
    multiplies them by lm_head; at l = L and the prediction position LogAt is its logit exactly. (Its RMS norm
    folded into the gathered rows, the 16-bit product came first and the float32 scale after: ~3e-3 off.)"""
    import nxl_hooks as nxl

    model = big.build("llama")
    with torch.no_grad():
        for parameter in model.parameters():  # large weights: logits of a few units, where rounding shows
            parameter.normal_(0.0, 0.3)
    ids, mask = big.batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype), nxl.attach(model, layers="all") as probe:
        out = model(input_ids=ids, attention_mask=mask)
    res = probe.result()
    rows, positions = torch.arange(len(ids)), big.positions(model, mask)
    assert out.logits.dtype == dtype  # autocast did run the readout in half precision
    assert torch.equal(res.logat[-1, rows, positions], out.logits[rows, positions, res.target].float())


def test_under_autocast_generate_steps_scored_where_a_gpu_would_give_the_models_own_logit(monkeypatch):
    """Where a call's steps would be scored in the publisher thread (a GPU's feature cache), autocast keeps them in
    the calling thread: autocast is per thread, and the publisher computed step 0's logit in float32, ~5e-3 from the
    model's own half-precision one."""
    import nxl_hooks as nxl
    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "SCORED_ELSEWHERE", generate.SCORED_ELSEWHERE | {"cpu"})
    model = big.build("llama")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    ids = torch.tensor([[5, 9, 12, 7, 3]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        own = model(input_ids=ids).logits[0, -1].float()
        with nxl.attach(model, layers="all") as probe:
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    step = probe.steps[0]
    assert step.scores["logat"][-1, 0, ids.shape[1] - 1] == own[int(step.token[0])]


@pytest.mark.parametrize("quant", ["nf4", "int8"])
@pytest.mark.parametrize("case_id", BNB_DECODERS)
def test_bnb_per_decoder_family(tmp_path, case_id, quant):
    import test_architectures as arch

    case = arch.CASES[case_id]
    case.build(**(WIDE if quant == "nf4" else {})).save_pretrained(tmp_path)
    model = case.model.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(**QUANT[quant])).eval()
    assert any(isinstance(module, _LINEAR[quant]) for module in model.modules())
    arch._check_against_oracle(case, model)


def test_saved_result_says_which_model_quantization_and_versions_made_it(tmp_path_factory, tmp_path):
    """A result saved from a 4-bit model, reopened from its file, names the weights it was read from, their
    quantization (the BitsAndBytesConfig the model was loaded with) and the package versions that computed it; the
    float source's says it has none. The file alone then tells a quantized run from its float twin."""
    import importlib.metadata

    from transformers import LlamaForCausalLM

    cls, _ = big.FAMILIES["llama"]
    path = big.save(tmp_path_factory.mktemp("llama"), "llama")
    ids, mask = big.batch()
    for name, config in (("nf4", BitsAndBytesConfig(**QUANT["nf4"])), ("float", None)):
        model = LlamaForCausalLM.from_pretrained(path, quantization_config=config).eval()
        with torch.no_grad(), nxl.attach(model, layers="last") as probe:
            model(input_ids=ids, attention_mask=mask)
        probe.result().save(tmp_path / f"{name}.safetensors")
        meta = nxl.Attribution.load(tmp_path / f"{name}.safetensors").meta
        assert meta["model"] == str(path)
        assert meta["dtype"] == "float32"
        if config is None:
            assert meta["quantization"] is None
        else:
            assert meta["quantization"]["quant_method"] == "bitsandbytes"
            assert meta["quantization"]["load_in_4bit"] is True and meta["quantization"]["bnb_4bit_quant_type"] == "nf4"
        assert meta["versions"]["torch"] == torch.__version__  # (its build too: 2.11.0+cu130)
        for package in ("transformers", "bitsandbytes"):
            assert meta["versions"][package] == importlib.metadata.version(package)
        assert meta["versions"]["nxl_hooks"] == nxl.__version__


def test_a_quantization_config_that_cannot_describe_itself_is_named_by_its_class():
    """A third-party quantizer's config whose ``to_dict`` raises: the model is still recorded, as the oracle has it,
    and its records name the quantization by the config's class."""
    class Broken:
        def to_dict(self):
            raise RuntimeError("not serializable")

    model = big.build("llama")
    model.config.quantization_config = Broken()
    ids, mask = big.batch()
    with torch.no_grad(), nxl.attach(model, layers="last") as probe:
        model(input_ids=ids, attention_mask=mask)
    assert probe.result().meta["quantization"] == {"quant_method": "Broken"}
    big.check(model, big.llama_head(model), ids, mask)
def test_a_stream_read_back_says_which_model_quantization_and_versions_made_it(tmp_path_factory, tmp_path):
    """A 4-bit model's generation written to a stream file and read back: each call says what its call frame holds,
    the weights, their quantization (the BitsAndBytesConfig loaded with) and the versions, as the live call does."""
    import importlib.metadata

    from transformers import LlamaForCausalLM

    path = big.save(tmp_path_factory.mktemp("llama"), "llama")
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(**QUANT["nf4"])).eval()
    ids, mask = big.batch()
    with nxl.attach(model, layers="last", sink=tmp_path / "run.nxl") as probe:
        model.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=False)
    (call,) = nxl.read_stream(tmp_path / "run.nxl")
    assert call.meta == probe.calls[0].meta
    assert call.meta["model"] == str(path) and call.meta["head_kind"] == "causal_lm"
    assert call.meta["quantization"]["quant_method"] == "bitsandbytes"
    assert call.meta["quantization"]["bnb_4bit_quant_type"] == "nf4"
    assert call.meta["versions"]["bitsandbytes"] == importlib.metadata.version("bitsandbytes")
    saved = tmp_path / "step.safetensors"
    call.attribution(call.steps[0]).save(saved)  # one step saved on its own says the same
    assert nxl.Attribution.load(saved).meta["quantization"]["bnb_4bit_quant_type"] == "nf4"


def test_parquet_rows_live_and_exported_say_which_quantization_and_versions_made_them(tmp_path_factory, tmp_path):
    """The footer of a Parquet file, written live by the sink or by ``nxl export`` from a stream file, says what made
    its rows (``nxl.models``): per model, the quantization it was loaded with and the package versions."""
    import importlib.metadata
    import json

    import pyarrow.parquet as pq
    from transformers import LlamaForCausalLM

    from nxl_hooks.apps.cli import main

    path = big.save(tmp_path_factory.mktemp("llama"), "llama")
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(**QUANT["nf4"])).eval()
    ids, mask = big.batch()
    for sink in (f"parquet:{tmp_path / 'live.parquet'}", str(tmp_path / "run.nxl")):
        with nxl.attach(model, layers="last", sink=sink):
            model.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=False)
    assert main(["export", str(tmp_path / "run.nxl"), str(tmp_path / "exported.parquet")]) == 0
    for name in ("live", "exported"):
        models = json.loads(pq.read_metadata(tmp_path / f"{name}.parquet").metadata[b"nxl.models"])
        assert list(models) == [str(path)]
        assert models[str(path)]["quantization"]["quant_method"] == "bitsandbytes"
        assert models[str(path)]["quantization"]["bnb_4bit_quant_type"] == "nf4"
        assert models[str(path)]["versions"]["bitsandbytes"] == importlib.metadata.version("bitsandbytes")
