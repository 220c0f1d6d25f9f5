"""PEFT: attribution goes through the active adapter (LoRA blocks, a ModulesToSaveWrapper score head, LoRA on
lm_head) without merging, and through the base model under ``disable_adapter()``. ``attach`` takes the PeftModel.

Oracles read the adapter's own weights by hand (``modules_to_save["default"]``, ``lora_A``/``lora_B``), so
they do not go through the wrapper the library calls.
"""

from __future__ import annotations

import itertools
import re
import types

import pytest
import torch

import big_models as big
import nxl_hooks as nxl
import oracle

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402


def _lora_head(layer, adapter: str = "default") -> oracle.Fn:
    """base(h) + B(A(h)) * scaling for a lora.Linear, by hand (dropout is off in eval)."""
    base = oracle.linear(layer.base_layer)
    down, up = oracle.linear(layer.lora_A[adapter]), oracle.linear(layer.lora_B[adapter])
    scaling = layer.scaling[adapter]
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


@pytest.mark.parametrize("task", ["CAUSAL_LM", "SEQ_CLS"])
def test_lora_on_the_head_of_a_family_generic_discovery_serves(task):
    """OLMo (no registry entry) with LoRA on lm_head, or a SEQ_CLS adapter's modules_to_save copy of score:
    discovery took only a bare Linear for the head, so PEFT's wrapper made the model "not supported"."""
    import test_architectures as arch
    import transformers as tf

    cls = tf.OlmoForCausalLM if task == "CAUSAL_LM" else tf.OlmoForSequenceClassification
    model = arch.Case(arch._cfg(tf.OlmoConfig, **dict(arch._GQA, vocab_size=big.VOCAB)), cls, oracle.olmo).build()
    targets = ["q_proj", "lm_head"] if task == "CAUSAL_LM" else ["q_proj"]
    peft_model = get_peft_model(model, LoraConfig(task_type=task, r=4, target_modules=targets,
                                                  init_lora_weights=False)).eval()
    if task == "CAUSAL_LM":
        adapted, base = _lora_head(model.lm_head), oracle.linear(model.lm_head.base_layer)
    else:
        wrapper = model.score
        with torch.no_grad():  # the adapter's trained copy of the head, unlike the base one
            wrapper.modules_to_save["default"].weight.add_(torch.randn_like(wrapper.original_module.weight))
        adapted, base = oracle.linear(wrapper.modules_to_save["default"]), oracle.linear(wrapper.original_module)
    _check_both(peft_model, adapted, base, oracle.plain_layer_norm)


@pytest.mark.parametrize("case_id", big.ONE_PER_FAMILY)
def test_lora_blocks_per_family(case_id):
    """LoRA on every block Linear of each family: the blocks' outputs change, the hand-written head still applies."""
    import test_architectures as arch

    case = arch.CASES[case_id]
    peft_model = get_peft_model(case.build(), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False,
                                                            exclude_modules=r".*(pooler|classifier).*"))
    arch._check_against_oracle(case, peft_model.eval().get_base_model())


def test_a_classifier_inside_modules_to_save_is_the_one_that_runs_as_adapters_change():
    """RoBERTa's head steps (classifier.dense, tanh, classifier.out_proj) lie inside the one ModulesToSaveWrapper
    PEFT puts on ``classifier``: attached once, each forward is scored with the copy that ran (the adapter's, the
    original under ``disable_adapter()``, another adapter's after ``set_adapter``); they were refused as "another
    module than when the probe attached"."""
    import test_architectures as arch

    case = arch.CASES["roberta-cls"]
    model = case.build()
    config = dict(task_type="SEQ_CLS", r=4, target_modules=["query", "value"], init_lora_weights=False)
    peft_model = get_peft_model(model, LoraConfig(**config)).eval()
    peft_model.add_adapter("second", LoraConfig(**config))
    wrapper = model.classifier
    with torch.no_grad():  # each adapter's trained copy of the head, unlike the base one and each other
        for name in ("default", "second"):
            for weight in wrapper.modules_to_save[name].parameters():
                weight.add_(torch.randn_like(weight))
    ids, mask = arch._batch(case, "sequence_classification")
    rows = torch.arange(len(ids))
    recorded = []
    with torch.no_grad(), nxl.attach(peft_model) as probe:
        def scored_with(head: torch.nn.Module) -> None:
            out = peft_model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            res = probe.result()
            hand = oracle.roberta_classifier(types.SimpleNamespace(classifier=head))
            logits = hand.layer_logits(out.hidden_states)
            logat, expected = oracle.normxlogit(logits, out.hidden_states[0], res.target)
            torch.testing.assert_close(res.logat, logat, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(res.normxlogit, expected, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(res.logat[-1, rows, 0], out.logits[rows, res.target], rtol=1e-4, atol=1e-5)
            recorded.append(res.logat)

        scored_with(wrapper.modules_to_save["default"])
        with peft_model.disable_adapter():
            scored_with(wrapper.original_module)
        peft_model.set_adapter("second")
        scored_with(wrapper.modules_to_save["second"])
    assert not any(torch.allclose(a, b, atol=1e-3) for a, b in itertools.combinations(recorded, 2))


def test_a_head_module_replaced_while_attached_is_said_not_the_one_attached():
    """An adapter put on lm_head after attaching (or one unloaded from it, or resize_token_embeddings) gives the
    model another readout: the records say so (they were made with the one before, numbers silently off)."""
    model = big.build("llama")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False),
                                adapter_name="a").eval()
    ids, mask = big.batch()
    with torch.no_grad(), nxl.attach(peft_model) as probe:
        peft_model(input_ids=ids, attention_mask=mask)
        probe.result()  # recorded with the readout it attached to
        peft_model.add_adapter("b", LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False))
        peft_model.set_adapter("b")
        peft_model(input_ids=ids, attention_mask=mask)
        with pytest.raises(RuntimeError, match="lm_head is another module than when the probe attached"):
            probe.result()
    # attached again, the new readout is the one read: equal to the oracle with the adapter's lm_head by hand
    _check_both(peft_model, _lora_head(model.lm_head, "b"), oracle.linear(model.lm_head.base_layer),
                oracle.rms_norm(model.model.norm))


def test_a_called_readout_takes_as_many_positions_at_once_as_its_bytes_allow(monkeypatch):
    """A readout that must be called (an adapter's, a quantized one) makes every output of the positions it is given:
    rows x positions x vocabulary floats, bounded by CALLED_READOUT_BYTES (only positions were: 256 of them for
    each of a batch's rows, every layer, at each generated token)."""
    from nxl_hooks.method import head as nxl_head

    model = big.build("llama")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False)).eval()
    ids, mask = big.batch()  # 2 rows, 7 positions
    monkeypatch.setattr(nxl_head, "CALLED_READOUT_BYTES", 4 * 2 * model.config.vocab_size * 3)  # 3 positions a call
    calls, forward = [], model.lm_head.forward

    def counted(hidden, *args, **kwargs):  # (the probe calls forward itself: a hook of the test's would not see it)
        calls.append(tuple(hidden.shape[:2]))
        return forward(hidden, *args, **kwargs)

    monkeypatch.setattr(model.lm_head, "forward", counted)
    big.check(peft_model, oracle.HandHead(oracle.rms_norm(model.model.norm), _lora_head(model.lm_head),
                                          last_is_normed=True), ids, mask)
    ours = calls[1:]  # (the model's own forward called it first, over every position)
    assert calls[0] == (2, 7) and ours and all(rows * positions <= 2 * 3 for rows, positions in ours)


_WRAPPED_EMBEDDINGS = {"lora": dict(target_modules=["embed_tokens"], init_lora_weights=False),
                       "trainable tokens": dict(target_modules=["q_proj"], trainable_token_indices=[5, 9]),
                       "modules_to_save": dict(target_modules=["q_proj"], modules_to_save=["embed_tokens"])}


@pytest.mark.parametrize("wrapped", list(_WRAPPED_EMBEDDINGS))
def test_an_input_embedding_peft_wraps_is_read_through_its_wrapper(wrapped):
    """LoRA on embed_tokens, trainable tokens and modules_to_save put the input embedding in a module of PEFT's: a
    tokenizer is still checked against its rows (attach raised AttributeError), and embedding="word" divides the
    adapted row by Gemma's sqrt(d) scale, which sits on the wrapped embedding (the norms were sqrt(d) too large)."""
    import tiny
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0)
    torch.manual_seed(0)
    model = GemmaForCausalLM(config).eval()
    peft_model = get_peft_model(model, LoraConfig(r=4, **_WRAPPED_EMBEDDINGS[wrapped])).eval()
    embedding = model.get_input_embeddings()
    assert type(embedding).__module__.startswith("peft.")  # PEFT's module, not the model's
    ids = torch.tensor([[5, 9, 17, 33, 41, 60]])
    with torch.no_grad():
        expected = (embedding(ids).float() / config.hidden_size ** 0.5).norm(dim=-1)  # the adapted row, unscaled
        with nxl.attach(peft_model, embedding="word", layers="last", tokenizer=tiny.tokenizer()) as probe:
            peft_model(input_ids=ids)
    result = probe.result()
    torch.testing.assert_close(result.embed_norm, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result.normxlogit, expected[None] * result.logat, rtol=1e-5, atol=1e-6)


_PROMPT_LEARNING = {"prompt tuning": lambda task: peft.PromptTuningConfig(task_type=task, num_virtual_tokens=3),
                    "p-tuning": lambda task: peft.PromptEncoderConfig(task_type=task, num_virtual_tokens=3,
                                                                      encoder_hidden_size=16)}


@pytest.mark.parametrize("family, task", [("llama", "CAUSAL_LM"), ("llama_cls", "SEQ_CLS")])
@pytest.mark.parametrize("method", list(_PROMPT_LEARNING))
def test_prompt_tuning_virtual_tokens_are_named_and_never_rank(method, family, task):
    """Prompt tuning and P-tuning put virtual tokens' embeddings before the input's and call the base model with
    inputs_embeds only: the record keeps their positions' scores (equal to the oracle from the PeftModel's own
    hidden states), names the real tokens by the ids the PeftModel was called with, and marks the virtual ones
    (id -1, special) so that they never rank (the ids were None and the virtual tokens ranked like the text)."""
    model = big.build(family)
    peft_model = get_peft_model(model, _PROMPT_LEARNING[method](task)).eval()
    ids, mask = big.batch()
    ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
    virtual, rows = 3, torch.arange(len(ids))
    with torch.no_grad(), nxl.attach(peft_model) as probe:
        out = peft_model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        prompts = peft_model.get_prompt(batch_size=len(ids))  # the virtual tokens' embeddings, by PEFT itself
    res = probe.result()
    hand = oracle.HandHead(oracle.rms_norm(model.model.norm), oracle.linear(big._readout(model).modules_to_save[
        "default"] if task == "SEQ_CLS" else big._readout(model)), last_is_normed=True)
    logat, expected = oracle.normxlogit(hand.layer_logits(out.hidden_states), out.hidden_states[0], res.target)
    torch.testing.assert_close(res.logat, logat, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res.normxlogit, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res.embed_norm[:, :virtual], prompts.float().norm(dim=-1), rtol=1e-5, atol=1e-6)
    # a causal LM predicts after each row's last token; a classifier given inputs_embeds (no pad ids) pools the last
    last = mask.sum(-1) - 1 if task == "CAUSAL_LM" else torch.full((len(ids),), ids.shape[1] - 1)
    assert res.position.tolist() == (last + virtual).tolist()
    own = out.logits[rows, res.position] if out.logits.dim() == 3 else out.logits
    torch.testing.assert_close(res.logat[-1, rows, res.position], own[rows, res.target], rtol=1e-4, atol=1e-5)
    assert res.input_ids[:, :virtual].eq(-1).all() and torch.equal(res.input_ids[:, virtual:], ids)
    assert res.special is not None and res.special[:, :virtual].all() and not res.special[:, virtual:].any()
    for row in rows.tolist():
        ranked = [position for position, _, _ in res.top(k=20, row=row)]
        assert ranked and min(ranked) >= virtual


def test_prompt_tuning_virtual_tokens_never_rank_beside_a_one_token_row():
    """A row of one real token leaves nothing but special tokens to rank: the fall-back that ranks them then must
    still leave out the virtual tokens, which are no input token (the three of them were the whole ranking)."""
    peft_model = get_peft_model(big.build("llama"), _PROMPT_LEARNING["prompt tuning"]("CAUSAL_LM")).eval()
    with torch.no_grad(), nxl.attach(peft_model) as probe:
        peft_model(input_ids=torch.tensor([[17]]))
    res = probe.result()
    assert res.input_ids.tolist() == [[-1, -1, -1, 17]] and res.position.tolist() == [3]
    assert not res.rankable(0).any() and res.top(k=5) == []


@pytest.mark.parametrize("method", list(_PROMPT_LEARNING))
def test_prompt_tuning_word_embedding_norms_are_the_ids_rows_and_the_virtual_tokens_own(method):
    """embedding="word" on a prompt-tuned model: PEFT runs the word embedding before its backbone, which gets
    inputs_embeds only; the norms are the ids' unscaled rows (Gemma's sqrt(d) taken off) and the virtual tokens' own
    embeddings (get_prompt) (the forward was refused: "embedding='word' needs input_ids")."""
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0)
    torch.manual_seed(0)
    model = GemmaForCausalLM(config).eval()
    peft_model = get_peft_model(model, _PROMPT_LEARNING[method]("CAUSAL_LM")).eval()
    ids = torch.tensor([[5, 9, 17, 33], [41, 60, 2, 7]])
    with torch.no_grad(), nxl.attach(peft_model, embedding="word", layers="last") as probe:
        peft_model(input_ids=ids)
        prompts = peft_model.get_prompt(batch_size=len(ids))
    res = probe.result()
    expected = torch.cat([prompts.float().norm(dim=-1), model.get_input_embeddings().weight[ids].float().norm(dim=-1)],
                         dim=1)
    torch.testing.assert_close(res.embed_norm, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res.normxlogit, expected[None] * res.logat, rtol=1e-5, atol=1e-6)


def test_prompt_tuning_explain_names_the_real_tokens_by_their_text():
    """explain() on a prompt-tuning PeftModel: the tokens are the text's (they were None), the virtual ones named."""
    import tiny

    tok = tiny.tokenizer()
    peft_model = get_peft_model(tiny.build_model("llama"), _PROMPT_LEARNING["prompt tuning"]("CAUSAL_LM")).eval()
    text = "the film was very good"
    res = nxl.explain(peft_model, tok, text)
    pieces = tok.convert_ids_to_tokens(tok(text)["input_ids"])
    assert res.tokens == [["[virtual 0]", "[virtual 1]", "[virtual 2]", *pieces]]
    assert res.token_labels(0)[:3] == ["[virtual 0]", "[virtual 1]", "[virtual 2]"]
    assert all(position >= 3 for position, _, _ in res.top(k=20))


def test_prompt_tuning_generate_says_why_it_is_not_recorded():
    """generate() on a prompt-tuning PeftModel is not recorded, and says so truly (it blamed assisted decoding)."""
    model = big.build("llama")
    peft_model = get_peft_model(model, _PROMPT_LEARNING["prompt tuning"]("CAUSAL_LM")).eval()
    ids, _ = big.batch(rows=1)
    with torch.no_grad(), nxl.attach(peft_model) as probe:
        peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    assert "PEFT prompt tuning ran 3 virtual tokens" in str(probe.calls[-1].error)


def test_prompt_tuning_put_on_after_attaching_is_said_in_generate():
    """A prompt-tuning adapter put on the attached model (get_peft_model after attach): generate's first forward runs
    the virtual tokens' embeddings before the prompt's, which the call's error blamed on assisted decoding."""
    model = big.build("llama")
    ids, _ = big.batch(rows=1)
    with torch.no_grad(), nxl.attach(model) as probe:
        peft_model = get_peft_model(model, _PROMPT_LEARNING["prompt tuning"]("CAUSAL_LM")).eval()
        peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    error = str(probe.calls[-1].error)
    assert "a wrapper put on the model after the probe attached (PEFT prompt tuning)" in error
    assert "assisted" not in error and probe.unrecorded_calls == 1


def test_a_prompt_learning_adapter_folder_is_not_told_to_merge(tmp_path):
    """merge_and_unload does not exist for prompt-learning adapters: the refusal of their folder says to attach in
    Python instead (it advised merging)."""
    from nxl_hooks.apps.loading import _adapter_refusal

    (tmp_path / "adapter_config.json").write_text('{"peft_type": "PROMPT_TUNING", "base_model_name_or_path": "b"}')
    said = _adapter_refusal("adapter", tmp_path)
    assert "merge_and_unload" not in said and "attach to the PeftModel in Python" in said


def test_a_mixed_adapter_batch_is_scored_only_where_the_head_is_the_same_for_every_row():
    """PEFT's mixed-adapter batches (``adapter_names=[...]``, one adapter per row) run each row through its own
    adapter: with LoRA on the blocks alone the head is the base one for every row and the records equal the oracle;
    with LoRA on lm_head each row has its own readout, which the records called with the active adapter for every
    row (each layer below L silently off): that forward, and such a generate call, now say why they are not
    recorded."""
    ids, mask = big.batch()
    names = ["b", "__base__"]
    for targets in (["q_proj", "v_proj"], ["q_proj", "lm_head"]):
        model = big.build("llama")
        config = dict(r=4, target_modules=targets, init_lora_weights=False)
        peft_model = get_peft_model(model, LoraConfig(**config), adapter_name="a").eval()
        peft_model.add_adapter("b", LoraConfig(**config))
        with torch.no_grad(), nxl.attach(peft_model) as probe:
            out = peft_model(input_ids=ids, attention_mask=mask, output_hidden_states=True, adapter_names=names)
            try:
                res = probe.result()
            except RuntimeError as error:
                res = error
            generated = peft_model.generate(input_ids=ids[:, :4], attention_mask=torch.ones_like(ids[:, :4]),
                                            max_new_tokens=2, do_sample=False, adapter_names=names, pad_token_id=0)
        call = probe.calls[-1]
        if "lm_head" in targets:
            assert re.search("adapter_names .* the model's lm_head applies one adapter per row", str(res))
            assert "adapter_names" in str(call.error) and not call.steps
            continue
        # rows differ in their blocks' adapters only: the base head is every row's
        hand = oracle.HandHead(oracle.rms_norm(model.model.norm), oracle.linear(model.lm_head), last_is_normed=True)
        logat, expected = oracle.normxlogit(hand.layer_logits(out.hidden_states), out.hidden_states[0], res.target)
        torch.testing.assert_close(res.logat, logat, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res.normxlogit, expected, rtol=1e-4, atol=1e-5)
        assert call.error is None and len(call.steps) == 2
        with torch.no_grad():  # each row's first step: its own adapter's logit, as a forward of that row alone gives
            for row, name in enumerate(names):
                alone = peft_model(input_ids=ids[row:row + 1, :4], adapter_names=[name]).logits[0, -1]
                token = generated[row, 4]
                torch.testing.assert_close(call.steps[0].logat[-1, row, -1], alone[token], rtol=1e-4, atol=1e-5)
