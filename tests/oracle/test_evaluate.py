"""nxl_hooks.eval.faithfulness and nxl_hooks.eval.baselines against hand-computed values, fake models whose output is a known
function of the tokens left, direct torch.autograd, and the oracle of tests/oracle.py."""

import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import tiny
import torch
from oracle import layer_logits, linear, normxlogit, rms_norm
from tiny import word_tokenizer
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

from nxl_hooks.eval import faithfulness as ev
from nxl_hooks.eval.baselines import gradient_scores

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "fine", "plain", "bad", "the", "key", "keys", "is", "are"]
VOCAB = {w: i for i, w in enumerate(WORDS)}


# Fake models: class-1 log-odds = sum of WEIGHT over the tokens still present (not masked, not deleted).
WEIGHT = torch.zeros(len(WORDS))
WEIGHT[VOCAB["good"]], WEIGHT[VOCAB["fine"]], WEIGHT[VOCAB["plain"]], WEIGHT[VOCAB["bad"]] = 2.0, 1.0, 0.0, -1.0


class FakeForSequenceClassification(nn.Module):
    """Looks like a BERT classifier to the registry; logits = [0, sum of weights of unmasked tokens]."""

    def __init__(self):
        super().__init__()
        self.config = BertConfig(num_hidden_layers=1, num_labels=2)
        self.bert = nn.Module()
        self.bert.encoder = nn.Module()
        self.bert.encoder.layer = nn.ModuleList([nn.Identity()])
        self.unused = nn.Parameter(torch.zeros(1))
        self.seen = []

    def forward(self, input_ids, attention_mask=None):
        # Each row's real tokens (attention mask 1): perturbed rows are batched with right padding.
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        self.seen += [ids[keep.bool()] for ids, keep in zip(input_ids, mask)]
        log_odds = WEIGHT[input_ids].sum(-1)
        return SimpleNamespace(logits=torch.stack([torch.zeros_like(log_odds), log_odds], -1))


class FakeForCausalLM(FakeForSequenceClassification):
    """Looks like a Llama LM; at every position, logits over the vocabulary favour token 1 by the same sum."""

    def __init__(self):
        super().__init__()
        self.config = LlamaConfig(num_hidden_layers=1, vocab_size=len(WORDS))
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Identity()])

    def forward(self, input_ids, attention_mask=None):
        two = super().forward(input_ids, attention_mask).logits
        logits = torch.full((*input_ids.shape, len(WORDS)), -1e4)
        logits[..., :2] = two[:, None, :]
        return SimpleNamespace(logits=logits)


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# Text "good fine plain bad" with scores ranking good > fine > plain > bad > last token.
SCORES = [9.0, 4.0, 3.0, 2.0, 1.0, 0.0]  # a BERT example: [CLS] good fine plain bad [SEP] (n = 6)
# int(6 * K) for K = 0.1..0.9: 0 1 1 2 3 3 4 4 5 tokens. Log-odds after removing the top c: 2, 0, -1, -1, 0, 0.
COMP_SUMS = {0: 2.0, 1: 0.0, 2: -1.0, 3: -1.0, 4: 0.0, 5: 0.0}
SUFF_SUMS = {0: 0.0, 1: 2.0, 2: 3.0, 3: 3.0, 4: 2.0, 5: 2.0}  # keeping only the top c
COUNTS = [0, 1, 1, 2, 3, 3, 4, 4, 5]


def test_aopc_mask_mode_exact_values():
    model, tok = FakeForSequenceClassification(), word_tokenizer(WORDS, "[CLS] $A [SEP]")
    rec = ev.score_example(model, tok, {"text": "good fine plain bad", "label": 1}, methods=(), custom={"mine": SCORES})
    assert rec["perturbation"] == "mask" and rec["position"] == 0 and rec["counts"] == COUNTS
    p = _sigmoid(2.0)
    assert rec["output"] == pytest.approx(p)
    mine = rec["methods"]["mine"]
    assert mine["comprehensiveness"] == pytest.approx([p - _sigmoid(COMP_SUMS[c]) for c in COUNTS], abs=1e-6)
    assert mine["sufficiency"] == pytest.approx([p - _sigmoid(SUFF_SUMS[c]) for c in COUNTS], abs=1e-6)
    assert mine["comp_correct"] == [COMP_SUMS[c] > 0 for c in COUNTS]
    summary = ev.aggregate([rec])
    assert summary["methods"]["mine"]["aopc_comprehensiveness"] == pytest.approx(
        sum(p - _sigmoid(COMP_SUMS[c]) for c in COUNTS) / 9, abs=1e-6)
    # [CLS] and [SEP] were in every forward, never masked (SPEC 5), though [SEP] ranks above nothing.
    assert all(ids[0] == VOCAB["[CLS]"] and ids[-1] == VOCAB["[SEP]"] for ids in model.seen)




@pytest.mark.parametrize("scores, ranked", [
    ([0.0, math.nan, 4.0, 3.0, 2.0, 0.0], ["fine", "plain", "bad", "good"]),  # NaN ranks below every number
    ([0.0, 1.0, 1.0, 1.0, 1.0, 0.0], ["good", "fine", "plain", "bad"]),  # ties keep token order
], ids=["nan-last", "ties-in-token-order"])
def test_a_nan_score_ranks_last_and_tied_scores_in_token_order(scores, ranked):
    """A method's NaN score (custom scores, or an overflowed layer) is perturbed after every number, not first, and
    equal scores are perturbed in token order: the fake model's log-odds of the words left are the oracle."""
    model, tok = FakeForSequenceClassification(), word_tokenizer(WORDS, "[CLS] $A [SEP]")
    rec = ev.score_example(model, tok, {"text": "good fine plain bad"}, methods=(), custom={"mine": scores})

    def p(words):
        return _sigmoid(sum(float(WEIGHT[VOCAB[word]]) for word in words))

    original = p(ranked)
    mine = rec["methods"]["mine"]
    assert mine["comprehensiveness"] == pytest.approx([original - p(ranked[c:]) for c in rec["counts"]], abs=1e-6)
    assert mine["sufficiency"] == pytest.approx([original - p(ranked[:c]) for c in rec["counts"]], abs=1e-6)

@pytest.mark.parametrize("ks", [[-0.1], [0.5, 1.5], [float("nan")], [], ["0.1"]])
def test_each_k_is_a_fraction_from_0_to_1(ks):
    model, tok = FakeForSequenceClassification(), word_tokenizer(WORDS, "[CLS] $A [SEP]")
    with pytest.raises(ValueError, match=r"^ks=.*: give one or more fractions of the tokens to perturb, each from 0 "
                                         r"to 1 \(0.1 for 10%\)$"):
        ev.score_example(model, tok, {"text": "good fine plain bad"}, methods=(), ks=ks, custom={"mine": SCORES})
    # Both ends are fractions: nothing perturbed, and every token that may be (6 of them, [CLS] and [SEP] kept).
    rec = ev.score_example(model, tok, {"text": "good fine plain bad"}, methods=(), ks=[0, 1], custom={"mine": SCORES})
    assert rec["counts"] == [0, 6]
    assert rec["methods"]["mine"]["comprehensiveness"] == pytest.approx([0.0, _sigmoid(2.0) - 0.5], abs=1e-6)

@pytest.mark.parametrize("seed", [1.5, "1", True])
def test_a_seed_that_is_no_whole_number_is_refused_before_any_method_runs(seed):
    """1.5 failed in torch's manual_seed (its own words) after the other methods had run."""
    model, tok = FakeForSequenceClassification(), word_tokenizer(WORDS, "[CLS] $A [SEP]")
    with pytest.raises(ValueError, match=rf"^seed={re.escape(repr(seed))}: give a whole number$"):
        ev.score_example(model, tok, {"text": "good fine plain bad"}, methods=("random",), seed=seed)
    for fine in (-3, np.int64(7)):  # (any whole number seeds the random baseline, as before)
        assert ev.score_example(model, tok, {"text": "good fine plain bad"}, methods=("random",), seed=fine)["methods"]


def test_a_bad_ig_steps_is_refused_before_the_model_runs():
    """It was refused by gradient_scores_many, after the example's forwards and the other methods had run."""
    model, tok = FakeForSequenceClassification(), word_tokenizer(WORDS, "[CLS] $A [SEP]")
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    with pytest.raises(ValueError, match=r"^ig_steps=0: give the number of Integrated Gradients steps"):
        ev.score_example(model, tok, {"text": "good fine plain bad"}, methods=("random", "integrated_gradients"),
                         ig_steps=0)
    assert forwards == []


def test_aopc_delete_mode_exact_values_and_prediction_token_kept():
    model, tok = FakeForCausalLM(), word_tokenizer(WORDS, "[CLS] $A")
    # [CLS] good fine plain bad the (n = 6), prediction at the last token; the same ranking as above.
    rec = ev.score_example(model, tok, {"text": "good fine plain bad the"}, methods=(), custom={"mine": [0.0, 4.0, 3.0, 2.0, 1.0, 99.0]})
    assert rec["perturbation"] == "delete" and rec["position"] == 5
    p = _sigmoid(2.0)  # 2-way softmax, the other 12 outputs at -1e4
    comp_sums = {0: 2.0, 1: 0.0, 2: -1.0, 3: -1.0, 4: 0.0, 5: 0.0}  # removing good, fine, plain, bad, [CLS]
    suff_sums = {0: 0.0, 1: 2.0, 2: 3.0, 3: 3.0, 4: 2.0, 5: 2.0}
    assert rec["methods"]["mine"]["comprehensiveness"] == pytest.approx([p - _sigmoid(comp_sums[c]) for c in COUNTS], abs=1e-6)
    assert rec["methods"]["mine"]["sufficiency"] == pytest.approx([p - _sigmoid(suff_sums[c]) for c in COUNTS], abs=1e-6)
    lengths = sorted({len(ids) for ids in model.seen})
    assert lengths == [2, 3, 4, 5, 6]  # [CLS] and the prediction token always stay
    assert all(ids[-1] == VOCAB["the"] for ids in model.seen)  # the highest-scored token is never deleted
    assert all(ids[0] == VOCAB["[CLS]"] for ids in model.seen)


@pytest.mark.parametrize("mode", ["mask", "delete"])
def test_perturb_never_touches_the_prediction_position_or_special_tokens(mode):
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor([1, 11, 12, 13, 2, 15, 16, 17, 18, 2])  # 1, 2: special ids (like [CLS], [SEP])
    for position in (0, 3, 8, 9):
        kept = {position, 0, 4, 9}
        free = 10 - len(kept)
        for _ in range(5):
            scores = torch.rand(10, generator=generator)
            scores[list(kept)] = 100.0  # ranked first if they were candidates
            for count in range(10):
                for keep_top in (False, True):
                    out, new_position = ev.perturb(ids, position, scores, count, keep_top=keep_top, mode=mode,
                                                   mask_id=0, protected_ids=[1, 2])
                    assert out[new_position] == ids[position]
                    changed = (out == 0).sum() if mode == "mask" else len(ids) - len(out)
                    assert changed == (max(free - count, 0) if keep_top else min(count, free))
                    if mode == "mask":
                        assert all(out[i] == ids[i] for i in kept)
                    else:  # every protected token survives, in order
                        assert (out == 1).sum() == 1 and (out == 2).sum() == 2


def test_average_precision_and_dot_hand_computed():
    # Ranking: index 0 (no), 2 (yes), 3 (no), 1 (yes): precisions at the hits 1/2 and 2/4.
    assert ev.average_precision(torch.tensor([0.9, 0.1, 0.5, 0.3]), torch.tensor([0, 1, 1, 0])) == pytest.approx(0.5)
    assert ev.average_precision(torch.tensor([3.0, 2.0, 1.0]), torch.tensor([1, 0, 1])) == pytest.approx((1 + 2 / 3) / 2)
    # (s - min) / sum: [0, 2, 1] / 3 -> 2/3 on the evidence; invariant to scale and offset.
    s, e = torch.tensor([1.0, 3.0, 2.0]), torch.tensor([0, 1, 0])
    assert ev.normalized_dot(s, e) == pytest.approx(2 / 3)
    assert ev.normalized_dot(5 * s - 7, e) == pytest.approx(2 / 3)
    assert ev.normalized_dot(torch.ones(4), torch.tensor([1, 0, 0, 1])) == pytest.approx(0.5)


def test_evidence_mask_whole_words_via_offsets():
    tok = word_tokenizer(WORDS, "[CLS] $A [SEP]")
    enc = tok("the keys is key", return_offsets_mapping=True)
    mask, missing = ev.evidence_mask("the keys is key", enc["offset_mapping"], ["key", "absent"])
    assert mask.tolist() == [0, 0, 0, 0, 1, 0] and missing == ["absent"]


def _tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=32, num_labels=2)).eval()


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2)).eval()


def _by_hand(model, ids, position, target, kind):
    """f(word embeddings) and its gradient by direct torch.autograd."""
    def f(embeds):
        logits = model(inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long)).logits
        return logits[:, position, target] if kind == "lm" else logits[:, target]

    embeds = model.get_input_embeddings()(ids).detach()

    def grad(x):
        x = x.clone().requires_grad_(True)
        return torch.autograd.grad(f(x).sum(), x)[0]

    return embeds, grad


@pytest.mark.parametrize("kind", ["cls", "lm"])
def test_gradient_baselines_match_direct_autograd(kind):
    model = _tiny_bert() if kind == "cls" else _tiny_llama()
    ids = torch.tensor([[2, 5, 9, 10, 8, 3]])
    position, target = (0, 1) if kind == "cls" else (5, 12)
    embeds, grad = _by_hand(model, ids, position, target, "lm" if kind == "lm" else "cls")
    g = grad(embeds)[0]
    mask = torch.ones_like(ids)

    def run(method, aggregation="l1"):
        return gradient_scores(model, ids, mask, position=position, target=target, method=method,
                               aggregation=aggregation)

    # The paper reduces each token's (d,) attribution by its L1 norm; l2 and the signed sum are options.
    torch.testing.assert_close(run("grad_norm"), g.abs().sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(run("grad_norm", "l2"), g.norm(dim=-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(run("grad_x_input"), (g * embeds[0]).abs().sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(run("grad_x_input", "sum"), (g * embeds[0]).sum(-1), rtol=1e-5, atol=1e-6)
    # Integrated Gradients from a zero baseline with 50 Gauss-Legendre points on [0, 1], written out.
    nodes, weights = np.polynomial.legendre.leggauss(50)
    alphas, weights = (nodes + 1) / 2, weights / 2
    path = grad(torch.tensor(alphas, dtype=torch.float32)[:, None, None] * embeds)  # (50, seq, d), rows independent
    integral = (torch.tensor(weights, dtype=torch.float32)[:, None, None] * path).sum(0)
    torch.testing.assert_close(run("integrated_gradients"), (integral * embeds[0]).abs().sum(-1), rtol=1e-4,
                               atol=1e-5)
    with pytest.raises(ValueError, match="aggregation 'max'"):
        run("grad_norm", "max")
    for steps in (0, -3, 2.5):  # captum's AssertionError, or a TypeError from numpy
        with pytest.raises(ValueError, match=rf"^ig_steps={steps}: give the number of Integrated Gradients steps"):
            gradient_scores(model, ids, mask, position=position, target=target, method="integrated_gradients",
                            ig_steps=steps)



def test_a_text_is_scored_whole_and_one_longer_than_the_models_positions_is_refused_in_one_line():
    """The tokenizer's model_max_length (6 here, as a classifier's tokenizer may be saved) cuts nothing: every token
    is scored and evidence past that length is found, as audit reads the text; the model's positions are the limit."""
    tok = word_tokenizer(WORDS, "[CLS] $A [SEP]")
    tok.model_max_length = 6
    text = "the key is good the key is fine bad"  # [CLS] + 9 words + [SEP]: "bad" is token 9
    rec = ev.score_example(_tiny_bert(), tok, {"text": text, "evidence": ["bad"]}, methods=("logat",))
    assert len(rec["tokens"]) == 11 and rec["tokens"][9] == "bad"
    assert rec["evidence"] == [0] * 9 + [1, 0] and rec["evidence_missing"] == []
    torch.manual_seed(0)
    short = BertForSequenceClassification(BertConfig(vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=32,
                                                     max_position_embeddings=8)).eval()
    with pytest.raises(ValueError, match=r"^the text is 11 tokens, but the model reads at most 8 "
                                         r"\(config.max_position_embeddings\): shorten it$"):
        ev.score_example(short, tok, {"text": text}, methods=("logat",))


def test_evidence_found_only_on_tokens_that_never_rank_is_missing_not_a_failure():
    """An evidence word written as a special token (or, under --chat, a template word) matches no ranked token: it is
    listed as missing, alignment is over the words that rank, and an example with none of those still has AOPC."""
    tok = word_tokenizer(WORDS, "[CLS] $A [SEP]")
    text = "good [SEP] fine"  # [CLS] good [SEP] fine [SEP]: only good (1) and fine (3) rank
    scores = [0.0, 2.0, 9.0, 1.0, 0.0]
    rec = ev.score_example(_tiny_bert(), tok, {"text": text, "evidence": ["SEP", "fine"]}, methods=(),
                           custom={"mine": scores})
    assert rec["evidence"] == [0, 0, 0, 1, 0] and rec["evidence_missing"] == ["SEP"]
    assert rec["methods"]["mine"]["ap"] == [0.5]  # ranked: good, then fine, the one evidence token: precision 1/2
    # said in the notes (which reach stderr and the report), not only in the record: a misspelt word left the
    # example's alignment silently over fewer words, or out of AP and dot altogether
    assert rec["notes"] == ["evidence word(s) on no token that ranks (not in the text, or only on special or chat "
                            "template tokens; evidence_missing names them): AP and dot are over the words found"]
    for words in (["SEP"], ["goood"]):
        rec = ev.score_example(_tiny_bert(), tok, {"text": text, "evidence": words}, methods=(),
                               custom={"mine": scores})
        assert rec["evidence"] is None and rec["evidence_missing"] == words and rec["methods"]["mine"]["ap"] is None
        assert len(rec["methods"]["mine"]["comprehensiveness"]) == len(ev.DEFAULT_KS)
        assert rec["notes"] == ["evidence word(s) on no token that ranks (not in the text, or only on special or chat "
                                "template tokens; evidence_missing names them): it counts for AOPC, not AP and dot"]
    rec = ev.score_example(_tiny_bert(), tok, {"text": text, "evidence": ["fine"]}, methods=(), custom={"mine": scores})
    assert rec["evidence_missing"] == [] and rec["notes"] == []

def _llama_oracle(model, tok, text: str) -> tuple[torch.Tensor, ...]:
    """(embeddings, LogAt['is'], NormXLogit['is'], NormXLogit['are']) of the tiny Llama by hand, per layer."""
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    logits = layer_logits(out.hidden_states, rms_norm(model.model.norm), linear(model.lm_head), last_is_normed=True)
    logat, nx_is = normxlogit(logits, out.hidden_states[0], torch.tensor([VOCAB["is"]]))
    _, nx_are = normxlogit(logits, out.hidden_states[0], torch.tensor([VOCAB["are"]]))
    return out.hidden_states[0], logat, nx_is, nx_are



def test_the_summary_reads_alignment_at_the_aopc_layer_and_counts_the_examples_with_evidence():
    """ap_eval and dot_eval are a layered method's at the layer AOPC ranks by (layer=1 here, not the last), and a
    method without layers' one value; n_evidence counts the examples whose evidence was found. AP by hand from the
    oracle's NormXLogit['is'] (one evidence token: 1 / its rank among the ranked tokens, [CLS] and the prediction
    left out); the normalized dot by hand, (s_e - min s) / sum(s - min s)."""
    model, tok = _tiny_llama(), word_tokenizer(WORDS, "[CLS] $A")
    examples = [{"text": "the key the keys", "target": "is", "evidence": ["key"]},
                {"text": "the keys good the key", "target": "is", "evidence": ["good"]},
                {"text": "fine the key", "target": "is"}]
    customs = [[float((7 * i) % 5) for i in range(len(tok(example["text"])["input_ids"]))] for example in examples]
    records = [ev.score_example(model, tok, example, methods=("normxlogit",), layer=1, custom={"mine": custom})
               for example, custom in zip(examples, customs)]
    summary = ev.aggregate(records)

    def by_hand(scores, text, word):
        ranked = scores.detach()[1:-1]  # [CLS] and the prediction position (the last token) never rank
        evidence = tok.convert_ids_to_tokens(tok(text)["input_ids"])[1:-1].index(word)
        shifted = ranked - ranked.min()
        return 1 / (1 + int((ranked > ranked[evidence]).sum())), float(shifted[evidence] / shifted.sum())

    nx = [by_hand(_llama_oracle(model, tok, example["text"])[2][1, 0], example["text"], example["evidence"][0])
          for example in examples[:2]]
    mine = [by_hand(torch.tensor(custom), example["text"], example["evidence"][0])
            for example, custom in zip(examples[:2], customs)]
    for name, expected in (("normxlogit", nx), ("mine", mine)):
        entry = summary["methods"][name]
        assert entry["n_evidence"] == 2 and summary["eval_layer"] == 1
        assert entry["ap_eval"] == pytest.approx(sum(ap for ap, _ in expected) / 2, abs=1e-6), name
        assert entry["dot_eval"] == pytest.approx(sum(dot for _, dot in expected) / 2, abs=1e-5), name


def test_accuracy_after_perturbation_is_per_k_over_the_labelled_examples_for_each_curve():
    """accuracy_comprehensiveness / _sufficiency per K: the share of the labelled examples still predicted right,
    from the fake classifier's log-odds of the words left (above 0: label 1); an example without a label counts for
    AOPC only."""
    model, tok = FakeForSequenceClassification(), word_tokenizer(WORDS, "[CLS] $A [SEP]")
    # (text, its words best first by the custom scores, label); [CLS] and [SEP] never rank
    examples = [("good fine plain bad", SCORES, 1), ("bad plain", [0.0, 2.0, 1.0, 0.0], 0),
                ("good fine plain bad", SCORES, None)]
    records = [ev.score_example(model, tok, {"text": text, **({} if label is None else {"label": label})},
                                methods=(), custom={"mine": scores}) for text, scores, label in examples]
    entry = ev.aggregate(records)["methods"]["mine"]
    assert entry["n"] == 3

    def right(words, label):
        return (sum(float(WEIGHT[VOCAB[word]]) for word in words) > 0) == (label == 1)

    for long in ("comprehensiveness", "sufficiency"):
        per_example = []
        for (text, _, label), record in zip(examples[:2], records):
            ranked = text.split()  # (each text's words are in the order its scores rank them)
            left = (lambda c: ranked[c:]) if long == "comprehensiveness" else (lambda c: ranked[:c])
            per_example.append([right(left(c), label) for c in record["counts"]])
        assert entry[f"accuracy_{long}"] == pytest.approx([sum(k) / 2 for k in zip(*per_example)]), long


def test_a_float64_models_prediction_is_its_argmax_where_float32_would_tie_two_logits():
    """Two float64 logits 1e-12 apart: the example's target (its prediction) is the model's own argmax; its outputs
    were rounded to float32 first, where both are one number and the first was taken."""
    model, tok = _tiny_llama().double(), word_tokenizer(WORDS, "[CLS] $A")
    ids = torch.tensor([tok("the key the keys")["input_ids"]])
    own = tiny.tie_below_float32(model, input_ids=ids)
    top = int(own.argmax())
    assert own[top - 1] < own[top] and own[top - 1].float() == own[top].float()
    record = ev.score_example(model, tok, {"text": "the key the keys"}, methods=("normxlogit",))
    assert record["target"] == record["prediction"] == int(own.argmax())


def test_a_model_whose_output_overflows_to_nan_is_a_value_error_not_a_record_of_nans():
    """A float16 Llama whose last block overflows: its logits are NaN. The example was recorded as predicting output 0
    with NaN probabilities, every curve NaN, and one such example made the run's AOPC NaN (summary.json then held NaN,
    which JSON has not); it fails now, in one line saying what to do (nxl evaluate records it and goes on)."""
    model, tok = tiny.overflowing(_tiny_llama()), word_tokenizer(WORDS, "[CLS] $A")
    model.half()
    example = {"text": "the key the keys", "target": "is"}
    with torch.no_grad():
        assert model(input_ids=torch.tensor([tok(example["text"])["input_ids"]])).logits[0, -1].isnan().all()
    with pytest.raises(ValueError, match=r"^the model's outputs at the prediction position are NaN or infinite \(an "
                                         r"overflow, as in float16\): load the model in bfloat16 or float32$"):
        ev.score_example(model, tok, example, methods=("normxlogit",))


def test_a_perturbed_text_whose_outputs_are_nan_is_a_value_error_not_a_nan_curve():
    """The fake classifier's outputs are NaN wherever "good" was masked: those points of the curves (and the run's
    AOPC) were NaN; the example fails now, saying so."""

    class OverflowingForSequenceClassification(FakeForSequenceClassification):
        def forward(self, input_ids, attention_mask=None):
            logits = super().forward(input_ids, attention_mask).logits
            return SimpleNamespace(logits=logits.masked_fill(~(input_ids == VOCAB["good"]).any(-1, keepdim=True),
                                                             float("nan")))

    tok = word_tokenizer(WORDS, "[CLS] $A [SEP]")
    with pytest.raises(ValueError, match=r"^the model's outputs at the prediction position are NaN or infinite \(an "
                                         r"overflow, as in float16\) on a perturbed text: load the model in bfloat16 "
                                         r"or float32$"):
        ev.score_example(OverflowingForSequenceClassification(), tok, {"text": "good fine plain bad", "label": 1},
                         methods=(), custom={"mine": SCORES})


def test_contrastive_and_normxlogit_match_oracle():
    model, tok = _tiny_llama(), word_tokenizer(WORDS, "[CLS] $A")
    example = {"text": "the key the keys", "target": "is", "foil": "are", "label": "is", "evidence": ["key"]}
    rec = ev.score_example(model, tok, example, methods=("normxlogit", "contrastive"), keep_scores=True)
    _, _, nx_is, nx_are = _llama_oracle(model, tok, example["text"])
    torch.testing.assert_close(torch.tensor(rec["methods"]["normxlogit"]["scores"]), nx_is[-1, 0], rtol=1e-4, atol=1e-5)
    contrast = nx_is[:, 0] - nx_are[:, 0]  # (layers, seq)
    torch.testing.assert_close(torch.tensor(rec["methods"]["contrastive"]["scores"]), contrast[-1], rtol=1e-4, atol=1e-5)
    # Per-layer AP: the evidence "key" is token 2; [CLS] (0) and the prediction position (4) are not ranked.
    for layer, ap in enumerate(rec["methods"]["contrastive"]["ap"]):
        s = contrast[layer, 1:4]  # positions 1..3: "key" is s[1]
        assert ap == pytest.approx(1 / (1 + int((s > s[1]).sum())), abs=1e-6)


@pytest.mark.parametrize("pick", ["prediction", "third"])
def test_contrastive_without_a_foil_contrasts_with_the_best_other_output(pick):
    """No foil in the example: contrastive contrasts the target with the output the model ranks highest after it,
    which is the model's own prediction when the target is another output, else its runner-up. From the model's own
    logits; the scores are the oracle's NormXLogit[target] - NormXLogit[foil] at the last layer."""
    model, tok = _tiny_llama(), word_tokenizer(WORDS, "[CLS] $A")
    text = "the key the keys"
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    best = out.logits[0, -1].argsort(descending=True).tolist()
    target = best[0] if pick == "prediction" else best[2]
    foil = best[1] if pick == "prediction" else best[0]
    rec = ev.score_example(model, tok, {"text": text, "target": target}, methods=("contrastive",), keep_scores=True)
    assert (rec["target"], rec["foil"], rec["prediction"]) == (target, foil, best[0])
    with torch.no_grad():
        logits = layer_logits(out.hidden_states, rms_norm(model.model.norm), linear(model.lm_head),
                              last_is_normed=True)
    nx = [normxlogit(logits, out.hidden_states[0], torch.tensor([t]))[1][-1, 0] for t in (target, foil)]
    torch.testing.assert_close(torch.tensor(rec["methods"]["contrastive"]["scores"]), nx[0] - nx[1], rtol=1e-4,
                               atol=1e-5)
    # without a method that contrasts, nothing is contrasted with: the record names no foil
    alone = ev.score_example(model, tok, {"text": text, "target": target}, methods=("normxlogit",))
    assert (alone["foil"], alone["foil_text"], alone["foil_probability"]) == (None, None, None)

def test_score_example_and_aggregate_round_trip_json():
    model, tok = _tiny_bert(), word_tokenizer(WORDS, "[CLS] $A [SEP]")
    examples = [{"text": "the good key", "label": 1, "evidence": ["good"], "id": 0},
                {"text": "bad the keys fine", "label": 0, "evidence": ["bad"], "id": 1}]
    records = [ev.score_example(model, tok, ex, ig_steps=5) for ex in examples]
    again = json.loads(json.dumps(records))
    assert again == records
    summary = ev.aggregate(again)
    assert json.loads(json.dumps(summary)) == summary
    assert set(summary["methods"]) == set(ev.DEFAULT_METHODS)
    nx = summary["methods"]["normxlogit"]
    assert len(nx["ap"]) == 3 and len(summary["methods"]["random"]["ap"]) == 1
    assert nx["aopc_comprehensiveness"] == pytest.approx(
        sum(sum(r["methods"]["normxlogit"]["comprehensiveness"]) for r in records) / 18)
    # Random rankings are seeded by (seed, text): the same in any shard or process.
    alone = ev.score_example(model, tok, examples[0], methods=("random",))["methods"]["random"]
    assert alone["comprehensiveness"] == pytest.approx(records[0]["methods"]["random"]["comprehensiveness"], abs=1e-6)


class FakeRegressionForSequenceClassification(FakeForSequenceClassification):
    """A BERT-like regressor whose output is the sum of the weights of the unmasked tokens."""

    def __init__(self):
        super().__init__()
        self.config = BertConfig(num_hidden_layers=1, num_labels=1)

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=super().forward(input_ids).logits[:, 1:])


def test_regression_change_and_pearson_after_perturbation():
    model, tok = FakeRegressionForSequenceClassification(), word_tokenizer(WORDS, "[CLS] $A [SEP]")
    texts, gold = ["good fine plain bad", "fine good bad plain", "bad plain"], [1.5, 3.0, -2.0]
    rankings = {"good fine plain bad": SCORES, "fine good bad plain": [0.0, 3.0, 4.0, 1.0, 2.0, 0.0],
                "bad plain": [0.0, 2.0, 1.0, 0.0]}
    records = [ev.score_example(model, tok, {"text": t, "label": y}, methods=(), custom={"mine": rankings[t]})
               for t, y in zip(texts, gold)]
    first = records[0]["methods"]["mine"]
    assert records[0]["output"] == pytest.approx(2.0) and records[0]["probability"] == "output"
    assert first["comprehensiveness"] == pytest.approx([abs(2.0 - COMP_SUMS[c]) for c in COUNTS])
    assert first["comp_pred"] == pytest.approx([COMP_SUMS[c] for c in COUNTS])
    summary = ev.aggregate(records)
    preds = np.array([r["methods"]["mine"]["comp_pred"] for r in records])  # (examples, K)
    expected = [np.corrcoef(preds[:, k], gold)[0, 1] if preds[:, k].std() > 0 else None for k in range(9)]
    got = summary["methods"]["mine"]["pearson_comprehensiveness"]
    assert [g is None for g in got] == [e is None for e in expected]
    assert [g for g in got if g is not None] == pytest.approx([e for e in expected if e is not None])
    assert summary["pearson"] == pytest.approx(np.corrcoef([2.0, 2.0, -1.0], gold)[0, 1])


def test_a_regression_examples_target_and_foil_are_said_unused():
    """A regression head explains its one output: a target or foil in the data was dropped without a word."""
    model, tok = FakeRegressionForSequenceClassification(), word_tokenizer(WORDS, "[CLS] $A [SEP]")
    record = ev.score_example(model, tok, {"text": "good fine", "label": 1.0, "target": "good", "foil": "bad"},
                              methods=(), custom={"mine": [0.0, 2.0, 1.0, 0.0]})
    assert record["target"] == 0 and record["foil"] is None
    assert record["notes"] == ["target and foil not used: a regression head explains its one output"]
    record = ev.score_example(model, tok, {"text": "good fine", "label": 1.0}, methods=(),
                              custom={"mine": [0.0, 2.0, 1.0, 0.0]})
    assert record["notes"] == []


@pytest.mark.parametrize("label", [float("nan"), float("inf"), "nan", "-Infinity", "abc", [1.5], True])
def test_a_regression_label_that_is_no_finite_number_is_a_value_error(label):
    """float() reads "nan" as NaN, and one NaN gold value made every Pearson of the run None, said nowhere (and a
    bare NaN, which is not JSON, in records.jsonl): the example fails with the reason instead. A word or a list failed
    in float()'s words ("could not convert string to float: 'abc'"), and a JSON true was read as 1.0."""
    model, tok = FakeRegressionForSequenceClassification(), word_tokenizer(WORDS, "[CLS] $A [SEP]")
    with pytest.raises(ValueError, match=rf"regression label {re.escape(repr(label))} is not a finite number"):
        ev.score_example(model, tok, {"text": "good fine", "label": label}, methods=())


@pytest.mark.parametrize("methods, kept, message", [
    (["logat", "contrastive"], ["logat"], None),  # contrastive left out, and the record says why
    (["contrastive"], None, r"no method to score \(contrastive contrasts with a foil, which a regression head lacks\)"),
    ([], None, r"no method to score \(none named\): choose from random, embed_norm"),
])
def test_a_regression_head_has_no_foil_to_contrast_with(methods, kept, message):
    """contrastive on a one-output regression head: left out of the record with a note (it was dropped without a
    word), and alone (or with no method) a ValueError that says what to do (it was "stack expects a non-empty
    TensorList")."""
    model, tok = tiny.build_model("regression"), tiny.tokenizer()
    example = {"text": "the film was good", "label": 1.0}
    if message is not None:
        with pytest.raises(ValueError, match=message):
            ev.score_example(model, tok, example, methods=methods)
        return
    record = ev.score_example(model, tok, example, methods=methods)
    assert record["kind"] == "regression" and list(record["methods"]) == kept
    assert record["notes"] == ["contrastive not computed: a regression head has one output, no foil to contrast with"]


@pytest.mark.parametrize("methods", ["default", "all"])
def test_evaluate_of_a_regression_head_leaves_the_foil_methods_of_default_and_all_out_and_says_so(tmp_path, capsys,
                                                                                                  methods):
    """Only a --methods list the user wrote is refused for naming contrastive; 'default' and 'all' name it too, and
    a regression model is evaluated without it, said once on stderr and in run.json's methods."""
    from nxl_hooks.apps.cli import main as cli_main

    model = tiny.save_model(tmp_path / "regression", "regression")
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "the film was good", "label": 1.0}\n{"text": "bad", "label": 0.0}\n')
    out = tmp_path / "out"
    assert cli_main(["evaluate", str(model), str(data), "--out", str(out), "--methods", methods, "--limit", "2"]) == 0
    said = capsys.readouterr().err
    assert f"contrastive left out of --methods {methods}: {model} has a regression head" in said
    run = json.loads((out / "run.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert "contrastive" not in run["methods"] and "logat" in run["methods"]
    assert "contrastive" not in summary["methods"] and "logat" in summary["methods"]


@pytest.mark.parametrize("example, message", [
    ({"text": "the key", "target": "zzz"}, "'zzz' is not a single token"),  # not in the vocabulary: [UNK]
    ({"text": "the key", "target": 99}, "target 99 is out of range.*14 outputs"),  # the LM has 14 outputs
    ({"text": "the key", "label": True}, "True must be an int id or a string"),  # JSON true is not a label id
    ({"text": "the key", "foil": ["is"]}, r"\['is'\] must be an int id or a string"),
    # a foil that is the target: p over the pair is 0.5 whatever is perturbed (every value was 0, and one "best")
    ({"text": "the key", "target": "is", "foil": "is"}, r"the foil .is. is the target itself \(output 12\): give a"),
    ({"text": "the key", "target": "is", "foil": VOCAB["is"]}, r"the foil 12 is the target itself"),
])
def test_bad_lm_targets_are_value_errors(example, message):
    model, tok = FakeForCausalLM(), word_tokenizer(WORDS, "[CLS] $A")
    with pytest.raises(ValueError, match=message):
        ev.score_example(model, tok, example, methods=())


def test_a_foil_whose_first_token_is_the_targets_says_so():
    """Two words of several tokens that start alike are one output (each stands for its first token): said so, not
    "the target itself"."""
    import bpe_tiny

    tok = bpe_tiny.bpe_tokenizer()
    first = {word: tok(word, add_special_tokens=False)["input_ids"][0] for word in (" Vienna", " Nairobi")}
    assert first[" Vienna"] == first[" Nairobi"]  # (this tokenizer has no merge for either word's start)
    example = {"text": "the capital of Austria is", "target": " Vienna", "foil": " Nairobi"}
    with pytest.raises(ValueError, match=r"the foil ' Nairobi' and the target ' Vienna' are one output \(\d+: a word "
                                         r"of several tokens stands for its first\): give a foil whose first token"):
        ev.score_example(bpe_tiny.bpe_llama(tok), tok, example, methods=())


def test_lm_target_resolves_through_the_vocabulary():
    model, tok = FakeForCausalLM(), word_tokenizer(WORDS, "[CLS] $A")
    rec = ev.score_example(model, tok, {"text": "the key", "target": "is", "foil": "are"}, methods=(),
                           custom={"mine": [0.0, 1.0, 2.0]})
    assert rec["target"] == VOCAB["is"] and rec["foil"] == VOCAB["are"]


@pytest.mark.parametrize("label, message", [(5, r"^label 5 is out of range: this classifier has 2 labels, ids 0..1"),
                                            (-1, r"^label -1 is out of range: this classifier has 2 labels, ids 0..1"),
                                            ("nonsense", "'nonsense' is not one of the model's labels")])
def test_out_of_range_class_label_is_a_value_error(label, message):
    model, tok = FakeForSequenceClassification(), word_tokenizer(WORDS, "[CLS] $A [SEP]")
    with pytest.raises(ValueError, match=message):
        ev.score_example(model, tok, {"text": "good fine", "label": label}, methods=())


def test_decoder_classifier_without_pad_token_runs_one_row_at_a_time():
    # transformers refuses batches > 1 for a decoder classifier whose config has no pad_token_id.
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_labels=2, pad_token_id=None)).eval()
    tok = word_tokenizer(WORDS, "[CLS] $A")
    scores = [0.0, 4.0, 3.0, 2.0, 1.0, 0.0]  # [CLS] good fine plain bad the
    rec = ev.score_example(model, tok, {"text": "good fine plain bad the", "label": 1},
                           methods=("normxlogit", "integrated_gradients"), ig_steps=4, custom={"mine": scores})
    assert rec["perturbation"] == "delete" and rec["position"] == 5
    ids = torch.tensor(tok("good fine plain bad the")["input_ids"])

    def p(row):  # one row, by hand
        with torch.no_grad():
            return model(input_ids=row[None]).logits[0].softmax(-1)[rec["target"]]

    for count, comp in zip(rec["counts"], rec["methods"]["mine"]["comprehensiveness"]):
        keep = [0, *range(1 + min(count, 4), 6)]  # drop the top `count` of good > fine > plain > bad
        assert comp == pytest.approx(float(p(ids) - p(ids[keep])), abs=1e-5)
    assert len(rec["methods"]["integrated_gradients"]["comprehensiveness"]) == 9



def test_a_decoder_classifier_whose_text_ends_with_its_pad_id_is_explained_where_it_pools():
    """pad = eos, as many decoder classifiers are set up, and the text ends with it: the classifier reads the last
    token that is not the pad id, so the record's position, what perturbation spares and what the gradients explain
    are that token's, not the trailing pad's."""
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_labels=2, pad_token_id=VOCAB["[SEP]"])).eval()
    tok = word_tokenizer(WORDS, "[CLS] $A [SEP]")
    text = "good fine plain bad"
    ids = torch.tensor(tok(text)["input_ids"])  # [CLS] good fine plain bad [SEP]
    pooled = 4  # "bad": the last token that is not [SEP]
    scores = [0.0, 1.0, 2.0, 3.0, 9.0, 0.0]  # the pooled token ranks first, were it ranked: it must stay
    rec = ev.score_example(model, tok, {"text": text}, methods=("grad_norm",), keep_scores=True,
                           custom={"mine": scores})
    assert rec["position"] == pooled

    def p(keep: list[int]) -> float:  # one row, by hand
        with torch.no_grad():
            return float(model(input_ids=ids[keep][None]).logits[0].softmax(-1)[rec["target"]])

    for count, comp in zip(rec["counts"], rec["methods"]["mine"]["comprehensiveness"]):
        dropped = [3, 2, 1][:count]  # plain > fine > good; [CLS], [SEP] and the pooled "bad" stay
        assert comp == pytest.approx(p(list(range(6))) - p([i for i in range(6) if i not in dropped]), abs=1e-5)
    # The gradient of the pooled token's logit, by hand: the decoder's hidden state there through the score head.
    embeds = model.get_input_embeddings()(ids[None]).detach().requires_grad_(True)
    logit = model.score(model.model(inputs_embeds=embeds).last_hidden_state[0, pooled])[rec["target"]]
    by_hand = torch.autograd.grad(logit, embeds)[0][0].abs().sum(-1)
    assert by_hand[pooled + 1:].eq(0).all()  # causal: the trailing [SEP] cannot change the pooled prediction
    torch.testing.assert_close(torch.tensor(rec["methods"]["grad_norm"]["scores"]), by_hand, rtol=1e-5, atol=1e-6)

def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(WORDS), n_embd=16, n_layer=2, n_head=2, n_positions=32)).eval()


def _tiny_llama_classifier():
    torch.manual_seed(0)
    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_labels=2, pad_token_id=VOCAB["[PAD]"])).eval()


def _tiny_llama_classifier_with_its_own_pad():
    """A decoder classifier whose config.pad_token_id ([MASK]'s id, in no text here) is not the tokenizer's pad."""
    model = _tiny_llama_classifier()
    model.config.pad_token_id = VOCAB["[MASK]"]
    return model


@pytest.mark.parametrize("build, kind", [(_tiny_llama, "lm"), (_tiny_gpt2, "lm"), (_tiny_llama_classifier, "cls"),
                                         (_tiny_llama_classifier_with_its_own_pad, "cls"), (_tiny_bert, "cls")],
                         ids=["llama-lm", "gpt2-lm", "llama-cls", "llama-cls-own-pad", "bert-cls"])
def test_batched_perturbation_equals_one_forward_per_row(build, kind):
    """Every perturbed row is scored in right-padded batches; each must give what it gives alone, unpadded.

    GPT-2 checks learned absolute positions (right padding must not shift them), the Llama classifier the pooling
    of the last non-pad token (padded with its config's pad id, also where the tokenizer's differs), BERT (deletion
    forced) bidirectional attention, which must mask the padding out.
    Tolerance 1e-5 on probabilities: the masked attention gives padding exactly zero weight, so the only difference
    left is float32 summation order in the batched matrix products (about 1e-7 relative at these sizes).
    """
    model = build()
    tok = word_tokenizer(WORDS, "[CLS] $A [SEP]" if kind == "cls" and "Bert" in type(model).__name__ else "[CLS] $A")
    text = "the keys fine plain good bad the key is good the"
    ids = torch.tensor(tok(text)["input_ids"])
    n = len(ids)
    position = 0 if "Bert" in type(model).__name__ else n - 1
    scores = torch.randperm(n, generator=torch.Generator().manual_seed(3)).float().tolist()
    shapes = []
    model.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(kwargs.get("attention_mask")),
                                    with_kwargs=True)
    rec = ev.score_example(model, tok, {"text": text, "target": 1}, methods=(), perturbation="delete",
                           custom={"mine": scores})
    assert rec["position"] == position
    # Alone: drop the top-c ranked tokens (comprehensiveness) or keep only them (sufficiency), one forward each.
    free = [i for i in range(n) if i != position and int(ids[i]) not in tok.all_special_ids]
    ranked = sorted(free, key=lambda i: -scores[i])

    def p_alone(keep: list[int]) -> float:
        row = ids[sorted(keep)]
        with torch.no_grad():
            logits = model(input_ids=row[None]).logits[0]
        logits = logits[-1] if kind == "lm" else logits
        return float(logits.softmax(-1)[1])

    everything = list(range(n))
    p = p_alone(everything)
    for count, comp, suff in zip(rec["counts"], rec["methods"]["mine"]["comprehensiveness"],
                                 rec["methods"]["mine"]["sufficiency"]):
        dropped, kept = set(ranked[:count]), set(ranked[count:])
        assert comp == pytest.approx(p - p_alone([i for i in everything if i not in dropped]), abs=1e-5)
        assert suff == pytest.approx(p - p_alone([i for i in everything if i not in kept]), abs=1e-5)
    # It was batched: one forward for the original, then fewer forwards than distinct rows, with padding.
    batched = [mask for mask in shapes if mask is not None][1:]  # the by-hand forwards above pass no mask
    assert len(batched) < len(set(rec["counts"])) and any((mask == 0).any() for mask in batched)


def test_batches_are_the_cheapest_cut_of_the_sorted_rows():
    """Against every way to cut sorted rows into contiguous batches, by brute force: the cost is the padded tokens
    plus FORWARD_TOKENS per forward, within the row and token caps."""
    import itertools
    import random

    from nxl_hooks.eval.faithfulness import FORWARD_TOKENS, _batches

    rng = random.Random(0)
    for _ in range(40):
        lengths = sorted(rng.randint(1, 40) for _ in range(rng.randint(1, 9)))
        max_rows, max_tokens = rng.randint(1, 6), rng.randint(20, 120)

        def cost(cuts):
            if any(stop - start > max_rows or (stop - start > 1 and (stop - start) * lengths[stop - 1] > max_tokens)
                   for start, stop in cuts):
                return float("inf")
            return sum((stop - start) * lengths[stop - 1] + FORWARD_TOKENS for start, stop in cuts)

        n = len(lengths)
        best = min(cost(list(zip((0, *ends), (*ends, n)))) for k in range(n)
                   for ends in itertools.combinations(range(1, n), k))
        chosen = _batches(lengths, max_rows, max_tokens)
        assert [c for cut in chosen for c in range(*cut)] == list(range(n)) and cost(chosen) == best


def test_each_probe_method_is_timed_on_its_own_forward(monkeypatch):
    """Issue 24, item 16: embed_norm, logat, normxlogit and contrastive shared one timed forward, so the report's
    "s / example" showed one number for four methods. A clock that only moves in the model's forwards, by 10**k on
    the k-th: each method's seconds is then exactly one forward of its own (a distinct power of ten), and its scores
    are still the oracle's."""
    model, tok = _tiny_llama(), word_tokenizer(WORDS, "[CLS] $A")
    clock = SimpleNamespace(now=0.0, forwards=0)

    def forward(*_):
        clock.now += 10.0 ** clock.forwards
        clock.forwards += 1

    model.register_forward_hook(forward)
    monkeypatch.setattr(ev, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    example = {"text": "the key the keys", "target": "is", "foil": "are", "label": "is", "evidence": ["key"]}
    names = ("embed_norm", "logat", "normxlogit", "contrastive")
    rec = ev.score_example(model, tok, example, methods=names, keep_scores=True)
    seconds = {name: rec["methods"][name]["seconds"] for name in names}
    powers = {name: math.log10(value) for name, value in seconds.items()}
    assert all(power.is_integer() for power in powers.values()) and len(set(powers.values())) == 4, seconds
    embeddings, logat, nx_is, nx_are = _llama_oracle(model, tok, example["text"])
    expected = {"embed_norm": embeddings[0].norm(dim=-1), "logat": logat[-1, 0], "normxlogit": nx_is[-1, 0],
                "contrastive": nx_is[-1, 0] - nx_are[-1, 0]}
    for name in names:
        torch.testing.assert_close(torch.tensor(rec["methods"][name]["scores"]), expected[name], rtol=1e-4,
                                   atol=1e-5)


def test_each_k_perturbs_the_exact_fraction_of_the_tokens_whatever_the_float_error():
    """int(n * K) of the exact product: 90 * 0.7 is 62.999... in floats, yet 70% of 90 tokens is 63."""
    model, tok = FakeForSequenceClassification(), word_tokenizer(WORDS, "[CLS] $A [SEP]")
    for n in (90, 170, 360):  # each with a K whose float product falls just under the whole number
        rec = ev.score_example(model, tok, {"text": " ".join(["plain"] * (n - 2))}, methods=(),
                               custom={"mine": [0.0] * n})
        assert rec["counts"] == [n * tenths // 10 for tenths in range(1, 10)]
    # K as written: a float32 0.7 (0.699999988), and a K of more decimals than rounding to 9 would keep
    ks = (np.float32(0.7), 0.01111111111, 0.999999999999)  # 90 K: 62.999999, 0.9999999999, 89.99999999991
    rec = ev.score_example(model, tok, {"text": " ".join(["plain"] * 88)}, methods=(), custom={"mine": [0.0] * 90},
                           ks=ks)
    assert rec["counts"] == [63, 0, 89]


@pytest.mark.parametrize("template, text", [("[CLS] $A", "good"), ("[CLS] $A [SEP]", "unknown words")])
def test_a_text_with_only_special_tokens_beside_the_prediction_perturbs_none_of_them(template, text):
    """<s>, [CLS] and [SEP] are never perturbed (docs/faithfulness.md), even where nothing else is left: a one-word text after <s>
    (deleting <s> would measure the model without it, not the ranking), or [CLS] [UNK] [UNK] [SEP]."""
    decoder = "[SEP]" not in template
    model, tok = FakeForCausalLM() if decoder else FakeForSequenceClassification(), word_tokenizer(WORDS, template)
    ids = torch.tensor(tok(text)["input_ids"])
    position = len(ids) - 1 if decoder else 0
    for keep_top in (False, True):
        for mode in ("mask", "delete"):
            out, _ = ev.perturb(ids, position, torch.arange(len(ids), 0, -1).float(), len(ids), keep_top=keep_top,
                                mode=mode, mask_id=VOCAB["[MASK]"], protected_ids=tok.all_special_ids)
            assert out.tolist() == ids.tolist()
    with pytest.raises(ValueError, match=r"has no token to perturb: all but the prediction are special tokens"):
        ev.score_example(model, tok, {"text": text}, methods=("random",))
