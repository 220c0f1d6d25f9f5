"""Plain forwards at their edges, each against the oracle (``output_hidden_states`` and the head by hand): a
regression head's output asked for, a one-logit classifier, a model left in training mode (nxl.explain), one text
without a pad token, a forward that continues a KV cache (PEFT prefix tuning's virtual tokens, or positions the
probe never saw), a forward Ctrl-C ended, a contrastive score with no output left to contrast with, a block the
forward never runs, and a custom 4-D attention mask.
"""

from __future__ import annotations

import logging
import re
import threading

import pytest
import torch
from tokenizers import processors
from transformers import (BertConfig, BertForSequenceClassification, Gemma2Config, Gemma2ForCausalLM, LogitsProcessor,
                          LogitsProcessorList, PreTrainedTokenizerFast)

import big_models as big
import nxl_hooks as nxl
import oracle
import tiny
from nxl_hooks.method.methods.contrastive import Contrastive

TEXT = "the film was very good"


def _ids(rows: int, seq: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(5, len(tiny.VOCAB), (rows, seq), generator=torch.Generator().manual_seed(seed))


def test_a_regression_head_with_several_outputs_explains_the_output_asked_for():
    """|HoT(h_i^l)[y] - HoT(h_p^L)[y]| at the output y asked for (output 0 was explained whatever was asked)."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=len(tiny.VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        pad_token_id=0, max_position_embeddings=64, num_labels=2, problem_type="regression")).eval()
    ids = _ids(3, 7)
    for target in (0, 1):
        with torch.no_grad(), nxl.attach(model, target=target) as probe:
            out = model(input_ids=ids, output_hidden_states=True)
        res = probe.result()
        logits = oracle.bert_classifier(model).layer_logits(out.hidden_states)  # (L+1, rows, seq, 2)
        expected = (logits[..., target] - logits[-1, :, 0, target][None, :, None]).abs()
        assert res.target.tolist() == [target] * 3
        torch.testing.assert_close(res.logat, expected, rtol=1e-4, atol=1e-5)


def test_a_one_logit_classifier_trained_with_bce_explains_its_signed_logit():
    """transformers' rule: one output is regression only where the config says nothing else; a one-logit binary
    classifier (problem_type="multi_label_classification") reads its logit as it is, signed (it was |HoT - HoT_p|)."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=len(tiny.VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        pad_token_id=0, max_position_embeddings=64, num_labels=1, problem_type="multi_label_classification")).eval()
    with torch.no_grad(), nxl.attach(model) as probe:
        out = model(input_ids=_ids(2, 6), output_hidden_states=True)
    logits = oracle.bert_classifier(model).layer_logits(out.hidden_states)[..., 0]
    res = probe.result()
    torch.testing.assert_close(res.logat, logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res.probability, out.logits[:, 0].sigmoid())  # its own: the sigmoid's
    model.config.problem_type = None  # one output, nothing said: regression
    with torch.no_grad(), nxl.attach(model) as probe:
        model(input_ids=_ids(2, 6))
    assert probe.result().meta["head_kind"] == "regression"


def test_explain_runs_a_model_left_in_training_mode_as_it_predicts_and_gives_each_module_its_mode_back():
    """nxl.explain on a model left in training mode (just fine-tuned) ran its dropout: a random forward, whose
    target, probability and scores changed from one call to the next. It explains the model's prediction (eval
    mode, as the oracle's own forward runs), and each module has its mode back after (one left in eval stays so)."""
    model, tok = tiny.build_model("bert"), tiny.tokenizer()  # BERT's default dropout, 0.1
    model.train()
    model.bert.embeddings.eval()  # a part the user froze
    modes = {name: module.training for name, module in model.named_modules()}
    res = nxl.explain(model, tok, TEXT, layers="all")
    assert {name: module.training for name, module in model.named_modules()} == modes
    enc = tok(TEXT, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    logits = oracle.bert_classifier(model).layer_logits(out.hidden_states)
    target = out.logits.argmax(-1)
    _, expected = oracle.normxlogit(logits, out.hidden_states[0], target)
    assert res.target.tolist() == target.tolist()
    torch.testing.assert_close(res.normxlogit, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res.probability[0], out.logits[0].softmax(-1)[target[0]])


def test_explain_reads_a_sentence_pair_as_the_tokenizer_encodes_it_segment_ids_included():
    """explain(text_pair=...): a classifier's two texts (NLI's premise and hypothesis) are encoded as
    tokenizer(text, text_pair) encodes them, [SEP] between and the second text's segment ids (which BERT adds its
    token-type embedding for), each row of a batch with its own pair."""
    model = tiny.build_model("bert")
    backend = tiny.tokenizer().backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(  # BERT's: [CLS] A [SEP] B [SEP], B in segment 1
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                  sep_token="[SEP]", mask_token="[MASK]",
                                  model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    first, second = ["the film was good", "a plot"], ["the movie is great", "very bad and awful"]
    res = nxl.explain(model, tok, first, text_pair=second, layers="all")
    enc = tok(first, second, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    logits = oracle.bert_classifier(model).layer_logits(out.hidden_states)
    target = out.logits.argmax(-1)
    _, expected = oracle.normxlogit(logits, out.hidden_states[0], target)
    assert enc["token_type_ids"][0].tolist() == [0] * 6 + [1] * 5
    assert torch.equal(res.input_ids, enc["input_ids"]) and torch.equal(res.mask, enc["attention_mask"].bool())
    assert res.target.tolist() == target.tolist()
    real = res.mask[None].expand_as(expected)
    torch.testing.assert_close(res.normxlogit[real], expected[real], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res.probability, out.logits.softmax(-1).gather(1, target[:, None])[:, 0])
    single = nxl.explain(model, tok, first[1], text_pair=second[1], layers="all")  # one pair, a string each
    torch.testing.assert_close(single.normxlogit[:, 0], expected[:, 1, :single.mask.shape[1]], rtol=1e-4, atol=1e-5)


def test_one_text_is_explained_with_a_tokenizer_that_has_no_pad_token():
    """One text needs no padding (GPT-2's and Llama-2's tokenizers have no pad token: explain raised)."""
    model, tok = tiny.build_model("llama"), tiny.tokenizer()
    tok.pad_token = None
    res = nxl.explain(model, tok, TEXT)
    ids = tok(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    logits = oracle.llama(model).layer_logits(out.hidden_states)
    _, expected = oracle.normxlogit(logits, out.hidden_states[0], logits[-1, :, -1].argmax(-1))
    torch.testing.assert_close(res.normxlogit, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("keep", ["reversed", "mask", "some"])
def test_a_forward_with_logits_to_keep_as_indices_explains_the_positions_they_name(keep):
    """``logits_to_keep`` of indices: the model's logit row j is position keep[j]'s. Reversed (as many rows as
    positions: they were read as position j's, the target of another position), a boolean mask, and a few indices
    (negative ones; right padding puts a row's prediction position among them, or not)."""
    model = tiny.build_model("llama")
    ids, mask = _ids(3, 7), torch.ones(3, 7, dtype=torch.long)
    mask[1, -2:] = 0  # row 1 predicts at position 4
    indices = {"reversed": torch.arange(7).flip(0), "mask": torch.tensor([True] * 7),
               "some": torch.tensor([4, -1, 0])}[keep]
    with torch.no_grad(), nxl.attach(model, layers="all") as probe:
        model(input_ids=ids, attention_mask=mask, logits_to_keep=indices)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    logits = oracle.llama(model).layer_logits(out.hidden_states)
    at = mask.sum(-1) - 1
    target = logits[-1, torch.arange(3), at].argmax(-1)
    _, expected = oracle.normxlogit(logits, out.hidden_states[0], target)
    res = probe.result()
    assert torch.equal(res.target, target)
    torch.testing.assert_close(res.normxlogit, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pad", ["left", "none"])
def test_a_batch_explained_with_a_left_padding_tokenizer_keeps_each_texts_own_positions(pad):
    """nxl.explain padded a batch on the tokenizer's side: left padding shifted a shorter text's positions on a model
    of absolute positions (GPT-2), a forward other than its own (another target, probability and scores than the
    text alone, or generate, gives). Each row equals the oracle of its text run alone; also with a tokenizer that has
    no pad token, as GPT-2's ships (transformers refused to pad the batch), which is left as it was."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tiny.VOCAB), n_embd=32, n_layer=2, n_head=4,
                                       pad_token_id=0)).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.mul_(20)  # positions matter, as in a trained model
    tok = tiny.word_tokenizer(tiny.VOCAB)
    tok.padding_side = "left"
    if pad == "none":
        tok.pad_token = None
    texts = ["a very good plot and the movie was", "the film was"]
    res = nxl.explain(model, tok, texts, layers="all")
    assert (tok.pad_token is None) == (pad == "none") and res.mask.sum(-1).tolist() == [8, 3]
    hand = oracle.layer_norm_decoder("transformer.ln_f")(model)
    for row, text in enumerate(texts):
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        logits = hand.layer_logits(out.hidden_states)
        target = logits[-1, :, -1].argmax(-1)
        _, expected = oracle.normxlogit(logits, out.hidden_states[0], target)
        n = ids.shape[1]
        assert int(res.target[row]) == int(target[0]) and tok.padding_side == "left"
        torch.testing.assert_close(res.normxlogit[:, row, :n], expected[:, 0], rtol=1e-4, atol=1e-5)


def test_a_decoder_classifiers_batch_explained_without_a_pad_token_pools_each_row_at_its_own_last_token():
    """A batch padded by the library (the tokenizer has no pad token) is padded with the model's own pad id, which a
    decoder classifier pools each row before: padded with the tokenizer's EOS id instead, a shorter text's prediction
    was read at a pad. Each row's target and scores equal the oracle of its text run alone."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tiny.VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=2, pad_token_id=0)
    model = LlamaForSequenceClassification(config).eval()
    tok = tiny.word_tokenizer(tiny.VOCAB)
    tok.pad_token, tok.eos_token = None, tiny.VOCAB[5]  # an EOS id that is not the model's pad id
    texts = ["a very good plot and the movie was", "the film was"]
    res = nxl.explain(model, tok, texts, layers="all")
    assert tok.pad_token is None and res.mask.sum(-1).tolist() == [8, 3]
    for row, text in enumerate(texts):
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        logits = oracle.llama(model).layer_logits(out.hidden_states)
        target = out.logits.argmax(-1)
        _, expected = oracle.normxlogit(logits, out.hidden_states[0], target)
        n = ids.shape[1]
        assert int(res.target[row]) == int(target[0])
        torch.testing.assert_close(res.normxlogit[:, row, :n], expected[:, 0], rtol=1e-4, atol=1e-5)


def test_a_forward_that_continues_a_kv_cache_of_other_forwards_is_said_not_recorded(caplog):
    """A hand-written decoding loop: its tokens' context is in a cache its first forward filled, recorded alone, so
    its forwards are not recorded, said once per probe (it was recorded over its own tokens alone, with the whole
    mask: a record that could not be read, ranked or saved), and the model's outputs are its own. The reason said
    the cache's positions "ran before the probe saw them", which the probe had seen: it names both ways."""
    model = tiny.build_model("llama")
    ids = _ids(2, 8)

    def loop() -> list[torch.Tensor]:  # the prompt's 5 tokens, then one token a forward
        cache = model(input_ids=ids[:, :5], use_cache=True).past_key_values
        return [model(input_ids=ids[:, n:n + 1], attention_mask=torch.ones(2, n + 1, dtype=torch.long),
                      past_key_values=cache).logits for n in range(5, 8)]

    with torch.no_grad():
        plain = loop()
        with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model) as probe:
            attached = loop()
    for a, b in zip(attached, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"continued a KV cache holding 7 positions \(past_key_values\) filled by "
                       r"other forwards \(before the probe, or earlier ones of your own.* decode with generate"):
        probe.result()
    assert len([r for r in caplog.records if "continued a KV cache" in r.getMessage()]) == 1
    # one cache, one call not recorded (not one per token), said where the operator reads it
    assert probe.unrecorded_calls == 1 and "decode with generate" in probe.unrecorded


def test_a_generate_call_already_running_at_attach_is_counted_unrecorded_once_with_why(caplog):
    """A generate call that started before the probe attached (nxl attach, nxl ctl resume mid-call) continues a
    cache the probe never saw: one call not recorded, saying so (it was silent: unrecorded_calls 0, and the log
    line's advice, to decode with generate, did not fit); its output is its own, and the next call is recorded."""
    model = tiny.build_model("llama")
    ids = _ids(1, 5)
    reached, attached = threading.Event(), threading.Event()

    class Pause(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == 7:  # two tokens made: the probe attaches now, mid-call
                reached.set()
                assert attached.wait(60)
            return scores

    def generate(**extra) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(input_ids=ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, **extra)

    plain, out = generate(), []
    host = threading.Thread(target=lambda: out.append(generate(logits_processor=LogitsProcessorList([Pause()]))))
    host.start()
    assert reached.wait(60)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model) as probe:
        attached.set()
        host.join(60)
        assert not probe.calls and probe.unrecorded_calls == 1
        assert "this generate call started before the probe attached" in probe.unrecorded
        told = [r.getMessage() for r in caplog.records if "started before the probe attached" in r.getMessage()]
        assert len(told) == 1 and not [r for r in caplog.records if "decode with generate" in r.getMessage()]
        assert torch.equal(generate(), plain)
        (call,) = probe.calls
        assert call.complete and len(call.steps) == 6 and probe.unrecorded_calls == 1
    torch.testing.assert_close(out[0], plain, rtol=0, atol=0)


def test_a_generate_taken_before_attaching_is_said_not_followed_and_why(caplog):
    """``g = model.generate`` (a server keeping the method, a functools.partial) taken before the attach bypasses the
    probe's wrapper: each call was said to have "started before the probe attached", and "the calls that start from
    now on are recorded", both false. Each call is counted unrecorded, saying to call model.generate itself; its
    output is unchanged, and model.generate is recorded."""
    model = tiny.build_model("llama")
    ids = _ids(1, 5)
    g = model.generate
    with torch.no_grad():
        plain = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), torch.no_grad(), nxl.attach(model) as probe:
        for _ in range(2):
            assert torch.equal(g(input_ids=ids, max_new_tokens=3, do_sample=False), plain)
        assert not probe.calls and probe.unrecorded_calls == 2
        assert "reference to it taken before the probe attached" in probe.unrecorded
        assert not [r for r in caplog.records if "started before the probe attached" in r.getMessage()]
        model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
        (call,) = probe.calls
    oracle.check_call(model, call, 3)


def test_result_after_a_generate_call_says_where_its_records_are():
    """probe.result() is the last plain forward's: after a generate call (a text-generation pipeline) it blamed
    torch.compile ("no forward has run"), or, with a plain forward before, returned that older forward's record as
    if it were the last. It says the records are probe.steps; a plain forward after it is its result again."""
    model = tiny.build_model("llama")
    ids = _ids(1, 5)
    resumed, cache = tiny.resuming(model, ids)
    with torch.no_grad(), nxl.attach(model) as probe:
        for before in (False, True):
            if before:
                model(input_ids=_ids(1, 2, seed=9))
            model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
            with pytest.raises(RuntimeError, match=r"last call in this thread was a recorded generate call.*probe\.steps"):
                probe.result()
        model.generate(input_ids=resumed, max_new_tokens=2, do_sample=False, **cache)  # not recorded: said so
        with pytest.raises(RuntimeError, match=r"generate call that was not recorded \(probe\.calls\[-1\]\.error"):
            probe.result()
        out = model(input_ids=ids, output_hidden_states=True)
    logits = oracle.llama(model).layer_logits(out.hidden_states)
    _, expected = oracle.normxlogit(logits, out.hidden_states[0], logits[-1, :, -1].argmax(-1))
    torch.testing.assert_close(probe.result().normxlogit, expected, rtol=1e-4, atol=1e-5)


def test_peft_prefix_tuning_explains_the_input_tokens_after_its_virtual_ones():
    """PEFT prefix tuning hands the model a cache of virtual tokens (no input tokens) and a mask widened by them:
    the input tokens are explained, equal to the oracle (the mask's width failed the record)."""
    peft = pytest.importorskip("peft")
    model = big.build("llama")
    config = peft.PrefixTuningConfig(task_type=peft.TaskType.CAUSAL_LM, num_virtual_tokens=3)
    peft_model = peft.get_peft_model(model, config).eval()
    ids, mask = big.batch()
    res = big.check(peft_model, big.llama_head(model), ids, mask)
    assert res.mask.shape == ids.shape


def _held(probe) -> tuple[list, list]:
    """What the probe's recorder holds in this thread of the forwards running in it: (captures, tasks)."""
    return probe._settle().__self__._stacks()  # (the probe holds its recorder through a weak method)


@pytest.mark.parametrize("ended", ["a forward", "a forward's head", "a generate step"])
def test_a_forward_ctrl_c_ended_leaves_nothing_that_a_later_forward_is_taken_for(ended):
    """torch runs a forward's always_call hooks on an Exception only: a KeyboardInterrupt left the probe's entries of
    the ended forward behind, its hidden states held, and a backbone called directly after it was taken for that
    forward, never made (the result was the one before, or said the forward raised). Also when it lands after the
    backbone returned (in the head: each such Ctrl-C kept every layer's hidden states). A generate call after it lets
    them go too."""
    model = tiny.build_model("llama")
    ids, other = _ids(3, 7), _ids(1, 4, seed=9)
    interrupt = []

    def ctrl_c(module, args, output):
        if interrupt:
            interrupt.clear()
            raise KeyboardInterrupt

    handle = (model.lm_head if ended == "a forward's head" else model.model.layers[-1]).register_forward_hook(ctrl_c)
    try:
        with torch.no_grad(), nxl.attach(model) as probe:
            model(input_ids=ids)
            interrupt.append(True)
            with pytest.raises(KeyboardInterrupt):
                if ended != "a generate step":
                    model(input_ids=ids)
                else:
                    model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
            if ended == "a generate step":  # another call: what the ended one held is let go
                model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
                assert _held(probe) == ([], [])
            out = model.model(input_ids=other, output_hidden_states=True)
            res = probe.result()
            assert _held(probe) == ([], [])
    finally:
        handle.remove()
    logits = oracle.llama(model).layer_logits(out.hidden_states)
    logat, _ = oracle.normxlogit(logits, out.hidden_states[0], logits[-1, :, -1].argmax(-1))
    torch.testing.assert_close(res.logat, logat, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("called", ["the task model", "its backbone"])
def test_a_forward_ctrl_c_ended_is_no_result_and_never_the_one_before(called):
    """A forward a KeyboardInterrupt ended runs none of the probe's end hooks: result() gave the forward before it,
    of other ids, as this one's. It says now that the forward did not end; the next forward is its own again."""
    model = tiny.build_model("llama")
    forward = model if called == "the task model" else model.model
    first, stopped, after = _ids(1, 6), _ids(1, 4, seed=9), _ids(1, 5, seed=11)

    def ctrl_c(module, args, output):
        raise KeyboardInterrupt

    with torch.no_grad(), nxl.attach(model) as probe:
        forward(input_ids=first)
        assert probe.result().normxlogit.shape[-1] == 6
        handle = model.model.layers[0].register_forward_hook(ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            forward(input_ids=stopped)
        handle.remove()
        with pytest.raises(RuntimeError, match="did not end under the probe .*Ctrl-C"):
            probe.result()
        assert isinstance(probe.peek(), RuntimeError)
        out = model(input_ids=after, output_hidden_states=True)
        res = probe.result()
    logits = oracle.llama(model).layer_logits(out.hidden_states)
    logat, _ = oracle.normxlogit(logits, out.hidden_states[0], out.logits[:, -1].argmax(-1))
    torch.testing.assert_close(res.logat, logat, rtol=1e-4, atol=1e-5)


def _steered_oracle(model, ids, *others):
    """The LogAt of a forward of ``model`` as the blocks really ran it: the embeddings' output, each block's output
    (read by forward hooks that run last), the last normed, through a hand-applied head. ``others`` are the hooks of
    the test's to take off after."""
    got = []
    taps = [module.register_forward_hook(lambda module, args, output: got.append(output[0] if isinstance(
        output, tuple) else output)) for module in (model.model.embed_tokens, *model.model.layers)]
    with torch.no_grad():
        out = model(input_ids=ids)
    for tap in (*taps, *others):
        tap.remove()
    logits = oracle.llama(model).layer_logits((*got[:-1], model.model.norm(got[-1])))  # (h^L as transformers gives it)
    return oracle.normxlogit(logits, got[0], out.logits[:, -1].argmax(-1))[0]


def test_a_hook_added_after_attaching_that_steers_a_blocks_output_is_never_recorded_silently():
    """A forward hook of the user's registered after attaching runs after the probe's: one that steers a block's
    output left the probe's records on the states before it, silently wrong (layer 1's LogAt 0.26 off). Now the
    forward says why it is not recorded; registered with prepend=True it runs first and the records are right."""
    model = tiny.build_model("llama")
    ids, shift = _ids(2, 6), torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 5
    block = model.model.layers[0]
    with torch.no_grad(), nxl.attach(model) as probe:
        handle = block.register_forward_hook(lambda module, args, output: output + shift)
        model(input_ids=ids)
        handle.remove()
        with pytest.raises(RuntimeError, match=r"a hook changed block 1's output \(layer 1's .* prepend=True"):
            probe.result()
        handle = block.register_forward_hook(lambda module, args, output: output + shift, prepend=True)
        model(input_ids=ids)
        res = probe.result()
    torch.testing.assert_close(res.logat, _steered_oracle(model, ids, handle), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block", [0, 1], ids=["block 1", "block 2"])
@pytest.mark.parametrize("when", ["before attaching", "after attaching"])
def test_a_pre_hook_that_steers_a_blocks_input_changes_the_layers_after_it_only(block, when):
    """A pre-hook of the user's steers its block's input: the layer before is what the block before (or the
    embeddings) gave, the later layers what the steered block made, whenever the hook was registered. The check of
    the states a block gets let a forward through only where they were the very tensor kept, so a steering
    pre-hook on block 2 made every forward "not recorded"; and layer 0 and the embedding norms were read after a
    pre-hook on block 1 registered before attaching but before one registered after."""
    model = tiny.build_model("llama")
    ids, shift = _ids(2, 6), torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 5
    steer = model.model.layers[block]
    register = lambda: steer.register_forward_pre_hook(lambda module, args: (args[0] + shift, *args[1:]))  # noqa: E731
    handle = register() if when == "before attaching" else None
    with torch.no_grad(), nxl.attach(model) as probe:
        handle = handle or register()
        model(input_ids=ids)
        res = probe.result()
    torch.testing.assert_close(res.logat, _steered_oracle(model, ids, handle), rtol=1e-4, atol=1e-5)


def test_contrastive_is_nan_where_every_output_is_explained():
    """No output is left to be the foil: NaN, as without the model's probabilities (it was the gap to output 0,
    itself a target)."""
    model = tiny.build_model("bert")
    ids = _ids(2, 6)
    for target, foiled in (([0, 1], False), (0, True)):
        with torch.no_grad(), nxl.attach(model, target=target, methods=["contrastive"]) as probe:
            out = model(input_ids=ids, output_hidden_states=True)
        scores = probe.result().scores["contrastive"]
        if not foiled:
            assert scores.isnan().all()
            continue
        logits = oracle.bert_classifier(model).layer_logits(out.hidden_states)
        gap = logits[..., 0] - logits[..., 1]  # the foil: the one output not explained
        expected = out.hidden_states[0].norm(dim=-1)[None] * gap
        torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)


def test_a_fixed_foil_the_model_predicts_is_nan_in_that_row():
    """Contrastive(foil=f) explaining target="predicted" where a row's prediction is f: that row has no foil (its gap
    to itself was 0 at every token, unsaid); NaN as where every output is explained, and the other rows' gap holds."""
    model = tiny.build_model("llama")
    ids = _ids(4, 6)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    predicted = out.logits[:, -1].argmax(-1)
    foil = int(predicted[0])
    other = (predicted != foil).nonzero().flatten()
    assert other.numel(), predicted  # some row predicts another output
    with torch.no_grad(), nxl.attach(model, methods=[Contrastive(foil=foil)]) as probe:
        model(input_ids=ids)
    scores = probe.result().scores["contrastive"]
    same = predicted == foil
    assert scores[:, same].isnan().all() and not scores[:, ~same].isnan().any()
    logits = oracle.llama(model).layer_logits(out.hidden_states)  # (layers, rows, seq, vocab)
    target = logits.gather(-1, predicted[None, :, None, None].expand(*logits.shape[:3], 1))[..., 0]
    gap = target - logits[..., foil]
    expected = out.hidden_states[0].norm(dim=-1)[None] * gap
    torch.testing.assert_close(scores[:, other], expected[:, other], rtol=1e-4, atol=1e-5)


def test_a_block_the_forward_never_runs_is_named_with_what_to_do():
    """Llama runs ``layers[:config.num_hidden_layers]``: lowered after building, block model.layers.1 never runs. A
    forward and a generate call say which block and what to do (they said "KeyError: 2" and "2"); asked only for the
    layers of the blocks that run, the forward is recorded and equals the oracle."""
    model = tiny.build_model("llama")
    model.config.num_hidden_layers = 1
    ids = _ids(1, 6)
    not_run = (r"^block model\.layers\.1 did not run in this forward, so layer 2 has no hidden states \(.*\): pass "
               r"layers= only layers of the blocks that run, or make the config run every block$")
    with torch.no_grad(), nxl.attach(model) as probe:
        model(input_ids=ids)
        with pytest.raises(ValueError, match=not_run):
            probe.result()
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
        assert re.match(not_run, probe.calls[-1].error), probe.calls[-1].error
    with torch.no_grad(), nxl.attach(model, layers=[0, 1]) as probe:
        out = model(input_ids=ids, output_hidden_states=True)
    logits = oracle.llama(model).layer_logits(out.hidden_states)
    logat, _ = oracle.normxlogit(logits, out.hidden_states[0], logits[-1, :, -1].argmax(-1))
    torch.testing.assert_close(probe.result().logat, logat, rtol=1e-4, atol=1e-5)


def _four_d(real: torch.Tensor, causal: bool, additive: bool) -> torch.Tensor:
    """A (rows, 1, seq, seq) attention mask as transformers builds one from a 2-D mask ``real``: each query sees the
    real keys (up to itself when ``causal``); boolean, or additive (the dtype's minimum where masked)."""
    seq = real.shape[1]
    seen = real.bool()[:, None, None, :].expand(-1, 1, seq, -1)
    if causal:
        seen = seen & torch.ones(seq, seq, dtype=torch.bool).tril()
    return torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min) if additive else seen


@pytest.mark.parametrize("kind, additive", [("llama", False), ("llama", True), ("bert", False), ("gemma2", True)])
def test_a_4d_attention_mask_masks_the_padding_and_each_row_is_its_text_alone(kind, additive):
    """A custom 4-D attention mask (rows, 1, queries, keys) in a plain forward, or a dict of them by layer type
    (Gemma 2): each row's padding is read from it as from a 2-D mask (the pads were real tokens that ranked, a
    right-padded causal LM row explained the prediction at its last pad, not its last real token, and a dict was not
    recorded at all); each row equals its text run alone, against the oracle."""
    if kind == "gemma2":
        torch.manual_seed(0)
        model = Gemma2ForCausalLM(Gemma2Config(
            vocab_size=len(tiny.VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0, sliding_window=16)).eval()
        hand = oracle.gemma(model)
    else:
        model = tiny.build_model(kind)
        hand = oracle.bert_classifier(model) if kind == "bert" else oracle.llama(model)
    ids, real = _ids(3, 6), torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    ids[real == 0] = 0
    mask = _four_d(real, kind != "bert", additive)
    if kind == "gemma2":  # (additive: its eager attention adds the mask; its window holds every token)
        mask = {"full_attention": mask, "sliding_attention": mask}
    with torch.no_grad(), nxl.attach(model, layers="all") as probe:
        model(input_ids=ids, attention_mask=mask)
    res = probe.result()
    assert torch.equal(res.mask, real.bool())
    for row, n in enumerate(real.sum(-1).tolist()):
        with torch.no_grad():
            alone = model(input_ids=ids[row:row + 1, :n], output_hidden_states=True)
        logits = hand.layer_logits(alone.hidden_states)
        position = 0 if kind == "bert" else n - 1  # BERT's CLS; a causal LM's last real token
        target = logits[-1, 0, position].argmax().view(1)
        _, expected = oracle.normxlogit(logits, alone.hidden_states[0], target)
        assert (int(res.position[row]), int(res.target[row])) == (position, int(target))
        torch.testing.assert_close(res.normxlogit[:, row, :n], expected[:, 0], rtol=1e-4, atol=1e-5)
        assert all(rank < n for rank, _, _ in res.top(6, row=row))  # no pad ranks


def test_one_4d_mask_for_the_whole_batch_is_every_rows():
    """A custom (1, 1, queries, keys) mask that attention broadcasts over a batch of 2 (transformers runs it): both
    rows are recorded, each against the oracle (the mask read from it had one row, so the second row was lost)."""
    model = tiny.build_model("llama")
    ids = _ids(2, 6)
    with torch.no_grad(), nxl.attach(model) as probe:
        model(input_ids=ids, attention_mask=_four_d(torch.ones(1, 6), causal=True, additive=False))
    res = probe.result()
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    logits = oracle.llama(model).layer_logits(out.hidden_states)
    logat, _ = oracle.normxlogit(logits, out.hidden_states[0], logits[-1, :, -1].argmax(-1))
    assert res.mask.shape == (2, 6) and bool(res.mask.all()) and res.position.tolist() == [5, 5]
    torch.testing.assert_close(res.logat, logat, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_training_step_with_gradient_checkpointing_keeps_its_forward_record(reentrant):
    """A training step with gradient checkpointing: backward runs each checkpointed block again. Up to transformers
    5.22 the checkpoint wraps the block's ``__call__`` (from 5.23 its ``forward``), so the block hooks ran in
    backward too, outside any forward, and the step's record became "ran its blocks without calling
    LlamaModel.forward ... set `backbone`". The forward's record stays, equal to the oracle on that forward's own
    hidden states, and the gradients are those of the model unattached."""
    model, ids = tiny.build_model("llama"), _ids(2, 6)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    out = model(input_ids=ids, labels=ids, output_hidden_states=True)
    out.loss.backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with nxl.attach(model, layers="all") as probe:
        model(input_ids=ids, labels=ids).loss.backward()
        res = probe.result()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))
    with torch.no_grad():
        logits = oracle.llama(model).layer_logits([h.detach() for h in out.hidden_states])
    _, expected = oracle.normxlogit(logits, out.hidden_states[0].detach(), logits[-1, :, -1].argmax(-1))
    torch.testing.assert_close(res.normxlogit, expected, rtol=1e-4, atol=1e-5)


def _pipeline_oracle(model, probe, enc, hand: oracle.HandHead) -> nxl.Attribution:
    """The probe's last plain forward equals the oracle of ``enc`` (what the pipeline's last forward was given; one
    text with several masks is a row per mask)."""
    res = probe.result()
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    rows = len(res.target)
    logits, embeddings = hand.layer_logits(out.hidden_states), out.hidden_states[0]
    if rows > len(embeddings):
        logits, embeddings = logits.expand(-1, rows, -1, -1), embeddings.expand(rows, -1, -1)
    logat, expected = oracle.normxlogit(logits, embeddings, res.target)
    torch.testing.assert_close(res.logat, logat, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res.normxlogit, expected, rtol=1e-4, atol=1e-5)
    return res


def test_the_forwards_of_classification_fill_mask_and_zero_shot_pipelines_are_recorded_as_the_oracle():
    """transformers pipelines run the model's own forward: text-classification (a batch the pipeline pads),
    fill-mask (one target row per mask) and zero-shot classification (one forward per candidate label, a sentence
    pair: the last one is result(), read at the entailment label) are recorded, each equal to the oracle; a token
    classification model, whose pipeline is token-classification, is refused at attach in one line."""
    from transformers import BertForTokenClassification, pipeline

    tok = tiny.tokenizer()
    texts = ["the film was very good", "a plot"]
    classifier = tiny.build_model("bert")
    with torch.no_grad(), nxl.attach(classifier, tokenizer=tok) as probe:
        pipeline("text-classification", model=classifier, tokenizer=tok)(texts, batch_size=2)
        res = _pipeline_oracle(classifier, probe, tok(texts, return_tensors="pt", padding=True),
                               oracle.bert_classifier(classifier))
    assert res.readable[1][:4] == ["[CLS]", "a", "plot", "[SEP]"]

    masked = tiny.build_model("mlm")
    text = "the [MASK] was [MASK] good"
    with torch.no_grad(), nxl.attach(masked, tokenizer=tok) as probe:
        pipeline("fill-mask", model=masked, tokenizer=tok)(text)
        res = _pipeline_oracle(masked, probe, tok(text, return_tensors="pt"), oracle.bert_lm(masked))
    assert res.position.tolist() == [2, 4]  # both masks, one row each

    labels = {"entailment": 0, "neutral": 1, "contradiction": 2}
    nli = BertForSequenceClassification(BertConfig(**tiny._SIZES, max_position_embeddings=64, num_labels=3,
                                                   label2id=labels, id2label={i: name for name, i in labels.items()}))
    nli.eval()
    with torch.no_grad(), nxl.attach(nli, tokenizer=tok, target="entailment") as probe:
        pipeline("zero-shot-classification", model=nli, tokenizer=tok)(texts[0], candidate_labels=["good", "bad"],
                                                                        hypothesis_template="{}")
        res = _pipeline_oracle(nli, probe, tok(texts[0], "bad", return_tensors="pt"), oracle.bert_classifier(nli))
    assert res.target.tolist() == [0]

    tagger = BertForTokenClassification(BertConfig(**tiny._SIZES, max_position_embeddings=64, num_labels=3))
    with pytest.raises(nxl.UnknownArchitectureError, match="token classification and question answering are not"):
        nxl.attach(tagger.eval(), tokenizer=tok)
