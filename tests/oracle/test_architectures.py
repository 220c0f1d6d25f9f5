"""Every registered architecture and head kind against the hand-written oracle (tests/oracle.py).

Each case builds a tiny random model from its config (hidden 32, 2 blocks, vocab 64), runs one padded batch
under ``nxl.attach`` with ``output_hidden_states=True`` and checks, independently of the library:
the prediction positions and pad mask, every layer's LogAt and NormXLogit against the oracle head, and at
l = L and the prediction position LogAt against the model's own output logit (relative 1e-4, float32).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import transformers as tf

import nxl_hooks as nxl
from nxl_hooks.arch import registry
import oracle
from tiny import nxl_hooks_on, word_tokenizer

VOCAB, PAD, MASK = 64, 0, 4
_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_TOL = dict(rtol=1e-4, atol=1e-5)

_DEC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
_GQA = dict(_DEC, num_key_value_heads=2)
_ENC = dict(_DEC, max_position_embeddings=32)
_FAIRSEQ = dict(vocab_size=VOCAB, d_model=32, max_position_embeddings=32, pad_token_id=PAD, bos_token_id=1,
                eos_token_id=2)


# A 64-token word-level tokenizer: specials 0..4, then words w5..w63.
TOK = word_tokenizer(_SPECIAL + [f"w{i}" for i in range(len(_SPECIAL), VOCAB)])


@dataclass(frozen=True)
class Case:
    """One architecture and head: how to build it tiny, and its hand-written head-on-top."""

    config: Callable[[], tf.PretrainedConfig]
    model: type
    oracle: Callable[[torch.nn.Module], oracle.HandHead]
    decoder: bool = True  # decoders: left and right padding in one batch; encoders: right padding

    def build(self, **config_overrides) -> torch.nn.Module:
        torch.manual_seed(0)
        config = self.config()
        for key, value in config_overrides.items():
            setattr(config, key, value)
        model = self.model(config).eval()
        # Random init zeroes biases and keeps norms at identity: randomize everything so that a missing
        # bias, norm or scale shows up (tied weights stay tied: they are one parameter).
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.3)
        return model


def _cfg(cls, **kw):
    return lambda: cls(**kw)


_LLAMA = _cfg(tf.LlamaConfig, **_GQA)
_GEMMA2 = _cfg(tf.Gemma2Config, **_GQA, head_dim=8, final_logit_softcapping=2.0)
_GEMMA3 = _cfg(tf.Gemma3TextConfig, **_GQA, head_dim=8, final_logit_softcapping=2.0, sliding_window=4)
_MIXTRAL = _cfg(tf.MixtralConfig, **_GQA, num_local_experts=4, num_experts_per_tok=2)
_GPT_NAMES = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
_GPT2 = _cfg(tf.GPT2Config, **_GPT_NAMES)
_OPT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
            pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
# Like opt-350m: project_in / project_out (word_embed_proj_dim != hidden_size) and no final LayerNorm.
_OPT_350M = _cfg(tf.OPTConfig, **_OPT, word_embed_proj_dim=16, do_layer_norm_before=False)
_FALCON = _cfg(tf.FalconConfig, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
_BERT = _cfg(tf.BertConfig, **_ENC)
_BERT_DECODER = _cfg(tf.BertConfig, **_ENC, is_decoder=True)
_ROBERTA = _cfg(tf.RobertaConfig, **_ENC)
_DISTILBERT = _cfg(tf.DistilBertConfig, vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                   max_position_embeddings=32, pad_token_id=PAD)
_ELECTRA = _cfg(tf.ElectraConfig, **_ENC, embedding_size=16)  # embeddings_project before block 1
_DEBERTA = _cfg(tf.DebertaV2Config, **_ENC, relative_attention=True, pos_att_type=["p2c", "c2p"],
                position_biased_input=False, max_relative_positions=-1, position_buckets=8, norm_rel_ebd="layer_norm",
                share_att_key=True)
# Like deberta-v2-xlarge: a ConvLayer on block 1's output is what enters block 2 (h[1]: hidden_states[1]).
_CONV = dict(_ENC, relative_attention=True, pos_att_type=["p2c", "c2p"], position_biased_input=False,
             max_relative_positions=-1, position_buckets=8, norm_rel_ebd="layer_norm", share_att_key=True,
             conv_kernel_size=3, conv_act="gelu")
_DEBERTA_CONV = _cfg(tf.DebertaV2Config, **_CONV)

CASES: dict[str, Case] = {
    "llama-lm": Case(_LLAMA, tf.LlamaForCausalLM, oracle.llama),
    "llama-cls": Case(_LLAMA, tf.LlamaForSequenceClassification, oracle.llama),
    "llama-reg": Case(_cfg(tf.LlamaConfig, **_GQA, num_labels=1), tf.LlamaForSequenceClassification, oracle.llama),
    "mistral-lm": Case(_cfg(tf.MistralConfig, **_GQA), tf.MistralForCausalLM, oracle.llama),
    "mistral-cls": Case(_cfg(tf.MistralConfig, **_GQA), tf.MistralForSequenceClassification, oracle.llama),
    "mixtral-lm": Case(_MIXTRAL, tf.MixtralForCausalLM, oracle.llama),
    "mixtral-cls": Case(_MIXTRAL, tf.MixtralForSequenceClassification, oracle.llama),
    # MoE on every block (interleave step 1), chunked attention and NoPE layers: the head is Llama's
    "llama4-lm": Case(_cfg(tf.Llama4TextConfig, **_GQA, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
                           intermediate_size_mlp=64, interleave_moe_layer_step=1, attention_chunk_size=4),
                      tf.Llama4ForCausalLM, oracle.llama),
    "qwen2-lm": Case(_cfg(tf.Qwen2Config, **_GQA), tf.Qwen2ForCausalLM, oracle.llama),
    "qwen2-cls": Case(_cfg(tf.Qwen2Config, **_GQA), tf.Qwen2ForSequenceClassification, oracle.llama),
    "qwen3-lm": Case(_cfg(tf.Qwen3Config, **_GQA, head_dim=8), tf.Qwen3ForCausalLM, oracle.llama),
    "qwen3-cls": Case(_cfg(tf.Qwen3Config, **_GQA, head_dim=8), tf.Qwen3ForSequenceClassification, oracle.llama),
    "gemma-lm": Case(_cfg(tf.GemmaConfig, **_GQA, head_dim=8), tf.GemmaForCausalLM, oracle.gemma),
    "gemma-cls": Case(_cfg(tf.GemmaConfig, **_GQA, head_dim=8), tf.GemmaForSequenceClassification, oracle.gemma),
    "gemma2-lm": Case(_GEMMA2, tf.Gemma2ForCausalLM, oracle.gemma),
    "gemma2-cls": Case(_GEMMA2, tf.Gemma2ForSequenceClassification, oracle.gemma),
    "gemma3-lm": Case(_GEMMA3, tf.Gemma3ForCausalLM, oracle.gemma),
    "gemma3-cls": Case(_GEMMA3, tf.Gemma3TextForSequenceClassification, oracle.gemma),
    "phi-lm": Case(_cfg(tf.PhiConfig, **_DEC), tf.PhiForCausalLM, oracle.layer_norm_decoder("model.final_layernorm")),
    "phi-cls": Case(_cfg(tf.PhiConfig, **_DEC), tf.PhiForSequenceClassification,
                    oracle.layer_norm_decoder("model.final_layernorm")),
    "phi3-lm": Case(_cfg(tf.Phi3Config, **_GQA), tf.Phi3ForCausalLM, oracle.llama),
    "phi3-cls": Case(_cfg(tf.Phi3Config, **_GQA), tf.Phi3ForSequenceClassification, oracle.llama),
    "gpt2-lm": Case(_GPT2, tf.GPT2LMHeadModel, oracle.layer_norm_decoder("transformer.ln_f")),
    "gpt2-cls": Case(_GPT2, tf.GPT2ForSequenceClassification, oracle.layer_norm_decoder("transformer.ln_f")),
    "gpt_neox-lm": Case(_cfg(tf.GPTNeoXConfig, **_DEC), tf.GPTNeoXForCausalLM,
                        oracle.layer_norm_decoder("gpt_neox.final_layer_norm")),
    "gpt_neox-cls": Case(_cfg(tf.GPTNeoXConfig, **_DEC), tf.GPTNeoXForSequenceClassification,
                         oracle.layer_norm_decoder("gpt_neox.final_layer_norm")),
    "opt-lm": Case(_cfg(tf.OPTConfig, **_OPT), tf.OPTForCausalLM, oracle.opt),
    "opt-cls": Case(_cfg(tf.OPTConfig, **_OPT), tf.OPTForSequenceClassification, oracle.opt),
    "opt_proj-lm": Case(_OPT_350M, tf.OPTForCausalLM, oracle.opt),
    "opt_proj-cls": Case(_OPT_350M, tf.OPTForSequenceClassification, oracle.opt),
    "falcon-lm": Case(_FALCON, tf.FalconForCausalLM, oracle.layer_norm_decoder("transformer.ln_f")),
    "falcon-cls": Case(_FALCON, tf.FalconForSequenceClassification, oracle.layer_norm_decoder("transformer.ln_f")),
    "cohere-lm": Case(_cfg(tf.CohereConfig, **_GQA, logit_scale=0.5), tf.CohereForCausalLM, oracle.cohere),
    "cohere2-lm": Case(_cfg(tf.Cohere2Config, **_GQA, logit_scale=0.5, sliding_window=4), tf.Cohere2ForCausalLM,
                       oracle.cohere),
    "cohere2_moe-lm": Case(_cfg(tf.Cohere2MoeConfig, **_GQA, logit_scale=0.5, sliding_window=4, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32), tf.Cohere2MoeForCausalLM,
                           oracle.cohere),
    "granitemoe-lm": Case(_cfg(tf.GraniteMoeConfig, **_GQA, num_local_experts=4, num_experts_per_tok=2,
                               logits_scaling=4.0, embedding_multiplier=3.0), tf.GraniteMoeForCausalLM, oracle.granite),
    "granitemoeshared-lm": Case(_cfg(tf.GraniteMoeSharedConfig, **_GQA, num_local_experts=4, num_experts_per_tok=2,
                                     shared_intermediate_size=32, logits_scaling=4.0, embedding_multiplier=3.0),
                                tf.GraniteMoeSharedForCausalLM, oracle.granite),
    "granite-lm": Case(_cfg(tf.GraniteConfig, **_GQA, logits_scaling=4.0, embedding_multiplier=3.0),
                       tf.GraniteForCausalLM, oracle.granite),
    "granite_swa-lm": Case(_cfg(tf.GraniteSWAConfig, **_GQA, logits_scaling=4.0, embedding_multiplier=3.0,
                                sliding_window=3), tf.GraniteSWAForCausalLM, oracle.granite),
    "granitemoe_swa-lm": Case(_cfg(tf.GraniteMoeSWAConfig, **_GQA, num_local_experts=4, num_experts_per_tok=2,
                                   logits_scaling=4.0, embedding_multiplier=3.0, sliding_window=3),
                              tf.GraniteMoeSWAForCausalLM, oracle.granite),
    # Granite 4.0-H: Mamba-2 and attention blocks (blocks 1 and 3 Mamba), MoE in each
    "granitemoehybrid-lm": Case(_cfg(tf.GraniteMoeHybridConfig, **dict(_GQA, num_hidden_layers=4), num_local_experts=4,
                                     num_experts_per_tok=2, logits_scaling=4.0, embedding_multiplier=3.0,
                                     mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
                                     layer_types=["mamba", "attention", "mamba", "attention"]),
                                tf.GraniteMoeHybridForCausalLM, oracle.granite),
    "bert-cls": Case(_BERT, tf.BertForSequenceClassification, oracle.bert_classifier, decoder=False),
    "bert-reg": Case(_cfg(tf.BertConfig, **_ENC, num_labels=1), tf.BertForSequenceClassification,
                     oracle.bert_classifier, decoder=False),
    "bert-mlm": Case(_BERT, tf.BertForMaskedLM, oracle.bert_lm, decoder=False),
    "bert-lm": Case(_BERT_DECODER, tf.BertLMHeadModel, oracle.bert_lm, decoder=False),
    "roberta-cls": Case(_ROBERTA, tf.RobertaForSequenceClassification, oracle.roberta_classifier, decoder=False),
    "roberta-mlm": Case(_ROBERTA, tf.RobertaForMaskedLM, oracle.roberta_lm, decoder=False),
    "roberta-lm": Case(_cfg(tf.RobertaConfig, **_ENC, is_decoder=True), tf.RobertaForCausalLM, oracle.roberta_lm,
                       decoder=False),
    "xlm_roberta-cls": Case(_cfg(tf.XLMRobertaConfig, **_ENC), tf.XLMRobertaForSequenceClassification,
                            oracle.roberta_classifier, decoder=False),
    "camembert-mlm": Case(_cfg(tf.CamembertConfig, **_ENC), tf.CamembertForMaskedLM, oracle.roberta_lm, decoder=False),
    "distilbert-cls": Case(_DISTILBERT, tf.DistilBertForSequenceClassification, oracle.distilbert_classifier,
                           decoder=False),
    "distilbert-mlm": Case(_DISTILBERT, tf.DistilBertForMaskedLM, oracle.distilbert_lm, decoder=False),
    "electra-cls": Case(_ELECTRA, tf.ElectraForSequenceClassification, oracle.electra_classifier, decoder=False),
    "electra-mlm": Case(_ELECTRA, tf.ElectraForMaskedLM, oracle.electra_lm, decoder=False),
    "electra-lm": Case(_cfg(tf.ElectraConfig, **_ENC, embedding_size=16, is_decoder=True), tf.ElectraForCausalLM,
                       oracle.electra_lm, decoder=False),
    "deberta_v2-cls": Case(_DEBERTA, tf.DebertaV2ForSequenceClassification, oracle.deberta_classifier,
                           decoder=False),
    "deberta_v2-mlm": Case(_DEBERTA, tf.DebertaV2ForMaskedLM, oracle.deberta_lm, decoder=False),
    "deberta_v2_conv-cls": Case(_DEBERTA_CONV, tf.DebertaV2ForSequenceClassification, oracle.deberta_classifier,
                                decoder=False),
    "deberta_v2_conv-mlm": Case(_DEBERTA_CONV, tf.DebertaV2ForMaskedLM, oracle.deberta_lm, decoder=False),
    # one block: the conv's output is h[L], the classifier's input (the l = L parity)
    "deberta_v2_conv1-cls": Case(_cfg(tf.DebertaV2Config, **dict(_CONV, num_hidden_layers=1)),
                                 tf.DebertaV2ForSequenceClassification, oracle.deberta_classifier, decoder=False),
}


def _batch(case: Case, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 7 tokens. Decoders: row 0 left-padded, row 1 right-padded, row 2 full; encoders: right
    padding. Real tokens never equal the pad id; masked LMs get [MASK] at (0, 1), (0, 4), (1, 2)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(len(_SPECIAL), VOCAB, (3, 7), generator=gen)
    mask = torch.ones_like(ids)
    if case.decoder:
        mask[0, :2] = 0
        mask[1, 4:] = 0
    else:
        mask[1, 5:] = 0
        mask[2, 3:] = 0
    if kind == "masked_lm":
        ids[0, 1] = ids[0, 4] = ids[1, 2] = MASK
    return ids.masked_fill(mask == 0, PAD), mask


def _expected_rows(case: Case, kind: str, ids: torch.Tensor, mask: torch.Tensor):
    """(example, position) per explained row, as transformers reads each head's prediction."""
    index = torch.arange(ids.shape[1])
    if kind == "masked_lm":
        return (ids == MASK).nonzero(as_tuple=True)
    examples = torch.arange(ids.shape[0])
    if kind == "causal_lm":
        return examples, (index * mask).argmax(-1)  # the last real token
    if case.decoder:
        return examples, (index * (ids != PAD)).argmax(-1)  # rightmost non-pad token, by pad_token_id
    return examples, torch.zeros_like(examples)  # CLS


def _kind(model) -> str:
    # by the transformers class it is, or extends (a user's subclass may have any name)
    name = next(cls.__name__ for cls in type(model).__mro__ if cls.__module__.startswith("transformers."))
    if name.endswith("ForSequenceClassification"):
        return "regression" if model.config.num_labels == 1 else "sequence_classification"
    return "masked_lm" if name.endswith("ForMaskedLM") else "causal_lm"


def _run(model, ids, mask, **attach):
    with torch.no_grad(), nxl.attach(model, **attach) as probe:
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return probe.result(), out


def _own_logits(out, kind: str, examples, positions) -> torch.Tensor:
    """The model's own output logits at each row's prediction position: (rows, outputs)."""
    if kind in ("sequence_classification", "regression"):
        return out.logits[examples]
    return out.logits[examples, positions]


def _check_against_oracle(case: Case, model, ran: tuple | None = None) -> nxl.Attribution:
    """Rows, positions, pad mask, every layer and the l = L parity of one padded batch, predicted target; ``ran``:
    that batch's (result, output with hidden states) recorded already."""
    kind = _kind(model)
    ids, mask = _batch(case, kind)
    res, out = ran or _run(model, ids, mask, tokenizer=TOK)
    assert res.meta["head_kind"] == kind

    examples, positions = _expected_rows(case, kind, ids, mask)
    assert res.example.tolist() == examples.tolist()
    assert res.position.tolist() == positions.tolist()
    assert torch.equal(res.mask, mask.bool()[examples])

    hot = case.oracle(model)
    logits = hot.layer_logits(out.hidden_states)[:, examples]  # (L+1, rows, seq, outputs)
    final = logits[-1, torch.arange(len(examples)), positions]  # (rows, outputs)
    own = _own_logits(out, kind, examples, positions)
    torch.testing.assert_close(final, own.float(), **_TOL)  # the oracle itself reproduces the model

    if kind == "regression":
        expected = (logits[..., 0] - final[None, :, None, 0]).abs()
        assert res.target.tolist() == [0] * len(examples)
        assert torch.allclose(torch.tensor(res.meta["prediction"])[:, 0], own[:, 0], **_TOL)
    else:
        assert torch.equal(res.target, final.argmax(-1))  # "predicted" is the model's own argmax
        expected, _ = oracle.normxlogit(logits, out.hidden_states[0][examples], res.target)
        # Parity: at l = L and the prediction position, LogAt is the model's own logit for the target.
        rows = torch.arange(len(examples))
        torch.testing.assert_close(res.logat[-1, rows, positions], own[rows, res.target].float(), **_TOL)

    embed = out.hidden_states[0][examples].float().norm(dim=-1)
    torch.testing.assert_close(res.embed_norm, embed, **_TOL)
    torch.testing.assert_close(res.logat, expected, **_TOL)
    torch.testing.assert_close(res.normxlogit, embed[None] * expected, **_TOL)
    assert res.layers == list(range(model.config.num_hidden_layers + 1))
    assert res.tokens[0] == TOK.convert_ids_to_tokens(ids[examples[0]].tolist())
    return res


def test_every_shipped_model_type_has_a_case():
    """A shipped entry skips the check of its numbers at attach (registry.is_tested) because its case here checks
    them against the oracle: a shipped model_type without a case would be trusted unchecked."""
    shipped = {model_type for model_type, spec in registry.specs().items() if registry.is_shipped(spec)}
    covered = {case.config().model_type for case in CASES.values()}
    assert not shipped - covered, f"shipped registry entries without a case in CASES: {sorted(shipped - covered)}"


@pytest.mark.parametrize("case_id", list(CASES))
def test_matches_oracle(case_id: str):
    res = _check_against_oracle(CASES[case_id], CASES[case_id].build())
    assert not res.meta["spec"].startswith("discovered")  # served by its registry entry


# -- targets, embeddings and layer subsets on a few representative heads ------------------------------------


@pytest.mark.parametrize(
    ("case_id", "target", "ids"),
    [
        ("llama-lm", [7, "w9", 30], [7, 9, 30]),  # int and token-string targets, trailing k axis
        ("gpt2-lm", "w12", [12]),
        ("bert-cls", ["neg", 1], [0, 1]),  # label names, as config.id2label names the outputs
        ("bert-mlm", ["w5", 6], [5, 6]),
        ("gemma2-cls", 1, [1]),
    ],
    ids=["llama-lm-list", "gpt2-lm-token", "bert-cls-labels", "bert-mlm-list", "gemma2-cls-int"],
)
def test_explicit_targets(case_id, target, ids):
    case = CASES[case_id]
    model = case.build(id2label={0: "neg", 1: "pos"}, label2id={"neg": 0, "pos": 1})
    kind = _kind(model)
    batch, mask = _batch(case, kind)
    res, out = _run(model, batch, mask, target=target, tokenizer=TOK)
    examples, _ = _expected_rows(case, kind, batch, mask)
    logits = case.oracle(model).layer_logits(out.hidden_states)[:, examples]
    expected = logits[..., ids]  # (L+1, rows, seq, k)
    if not isinstance(target, list):
        expected = expected[..., 0]
    assert res.target.tolist() == [ids if isinstance(target, list) else ids[0]] * len(examples)
    assert res.logat.shape == expected.shape
    torch.testing.assert_close(res.logat, expected, **_TOL)
    embed = out.hidden_states[0][examples].float().norm(dim=-1)
    scale = embed[None, :, :, None] if isinstance(target, list) else embed[None]
    torch.testing.assert_close(res.normxlogit, scale * expected, **_TOL)


@pytest.mark.parametrize("label2id", [{"LABEL_0": 0, "LABEL_1": 1}, {"pos": 0, "neg": 1}, None],
                         ids=["left-default", "swapped", "none"])
def test_a_label_name_is_the_output_id2label_names_so_whatever_label2id_says(label2id):
    """``from_pretrained(path, id2label=...)`` (the fine-tuning recipe) keeps the checkpoint's ``label2id``: a label
    name the records and pipelines show (``id2label``'s) was refused, or, with the names swapped, explained the
    other output."""
    case = CASES["bert-cls"]
    model = case.build(id2label={0: "neg", 1: "pos"})
    model.config.label2id = label2id
    batch, mask = _batch(case, "sequence_classification")
    res, out = _run(model, batch, mask, target="pos", tokenizer=TOK)
    logits = case.oracle(model).layer_logits(out.hidden_states)
    assert res.target.tolist() == [1] * len(batch) and res.target_text == [["pos"]] * len(batch)
    torch.testing.assert_close(res.logat, logits[..., 1], **_TOL)


@pytest.mark.parametrize("case_id", ["gemma-lm", "granite-lm", "opt_proj-cls", "bert-mlm"])
def test_word_embedding_norm(case_id):
    """embedding="word": the raw word-embedding row. Gemma's sqrt(d) scale is divided back out; Granite's
    multiplier and OPT's project_in come after the embedding module, so they never enter it."""
    case = CASES[case_id]
    model = case.build()
    kind = _kind(model)
    ids, mask = _batch(case, kind)
    res, out = _run(model, ids, mask, embedding="word", tokenizer=TOK)
    examples, _ = _expected_rows(case, kind, ids, mask)
    word_rows = model.get_input_embeddings().weight[ids[examples]]
    logits = case.oracle(model).layer_logits(out.hidden_states)[:, examples]
    logat, normxlogit = oracle.normxlogit(logits, word_rows, res.target)
    torch.testing.assert_close(res.embed_norm, word_rows.float().norm(dim=-1), **_TOL)
    assert not torch.allclose(res.embed_norm, out.hidden_states[0][examples].float().norm(dim=-1), rtol=1e-2)
    torch.testing.assert_close(res.logat, logat, **_TOL)
    torch.testing.assert_close(res.normxlogit, normxlogit, **_TOL)


@pytest.mark.parametrize("case_id", ["granite-lm", "granitemoe-lm", "granitemoeshared-lm"])
def test_an_integer_logits_scaling_divides_the_logits(case_id):
    """transformers types Granite's logits_scaling ``float | int``: a config.json storing 8 is a model dividing its
    logits by 8, not a token id (it was refused at attach)."""
    model = CASES[case_id].build(logits_scaling=8)
    assert type(model.config.logits_scaling) is int
    _check_against_oracle(CASES[case_id], model)


def test_a_classifier_head_replaced_by_a_small_mlp_is_read_to_its_last_layer():
    """A fine-tuning recipe: ``score`` replaced by Linear(d, 16), tanh, Linear(16, labels). The head's width is its
    last Linear's (the first's 16 was taken for it, and the model refused)."""
    case = CASES["llama-cls"]
    model = case.build()
    torch.manual_seed(1)
    model.score = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    first, last = oracle.linear(model.score[0]), oracle.linear(model.score[2])
    hand = oracle.HandHead(oracle.rms_norm(model.model.norm), lambda h: last(torch.tanh(first(h))), last_is_normed=True)
    _check_against_oracle(Case(case.config, case.model, lambda _: hand), model)


@pytest.mark.parametrize("case_id", ["falcon-lm", "deberta_v2-cls"])
def test_layer_subsets(case_id):
    case = CASES[case_id]
    model = case.build()
    ids, mask = _batch(case, _kind(model))
    for layers, expected in [([-1, 0], [0, 2]), ([-2], [1]), ("last", [2]), (1, [1])]:
        res, out = _run(model, ids, mask, layers=layers)
        assert res.layers == expected
        logat, _ = oracle.normxlogit(case.oracle(model).layer_logits(out.hidden_states), out.hidden_states[0],
                                     res.target)
        torch.testing.assert_close(res.logat, logat[expected], **_TOL)


def _changed_while_attached(case_id: str, change: Callable[[torch.nn.Module, nxl.Probe, Callable], None]) -> None:
    """``change`` made to the model between two recorded forwards, with the probe and a forward to call: the
    second's records differ from the first's and equal the oracle's as the model is then."""
    case = CASES[case_id]
    model = case.build()
    ids, mask = _batch(case, "causal_lm")
    with torch.no_grad(), nxl.attach(model, tokenizer=TOK) as probe:
        model(input_ids=ids, attention_mask=mask)
        before = probe.result()
        change(model, probe, lambda: model(input_ids=ids, attention_mask=mask))
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        after = probe.result()
    assert not torch.allclose(before.logat, after.logat)
    _check_against_oracle(case, model, (after, out))


@pytest.mark.parametrize("case_id", ["llama-lm", "gemma-lm"])
def test_weights_changed_while_attached_are_the_ones_applied(case_id: str):
    """A training loop that stays attached: the final norm (folded into the readout's rows: Gemma's as 1 + w) and
    the readout are read as they are at each forward, not as they were at attach."""

    def step(model, probe, forward):  # a step of an optimizer, in place
        model.model.norm.weight.mul_(2.0).add_(0.25)
        model.lm_head.weight.mul_(0.5)
    _changed_while_attached(case_id, step)


@pytest.mark.parametrize(("case_id", "attribute", "value"), [
    ("gemma2-lm", "final_logit_softcapping", 30.0), ("gemma2-lm", "final_logit_softcapping", None),
    ("gemma3-lm", "final_logit_softcapping", 30.0), ("granite-lm", "logits_scaling", 1.0),
    ("granitemoe-lm", "logits_scaling", 1.0), ("cohere-lm", "logit_scale", 2.0)])
def test_a_post_processing_value_changed_while_attached_is_the_one_applied(case_id: str, attribute: str, value):
    """transformers reads Gemma 2's softcap and Granite's logits_scaling from the config at each forward; the head
    read them once at attach, so after a change LogAt at l = L missed the model's own logits (by 5.09 for Gemma 2's
    cap 2 -> 30, 0.62 for Granite's 4 -> 1). They are read at each forward now. Where the model keeps a copy of its
    own (Cohere's logit_scale, applied from the copy; GraniteMoE's logits_scaling, applied from the config), a value
    changed in one place only is said, not guessed at; changed in both, it is the one applied."""

    def change(model, probe, forward):
        setattr(model.config, attribute, value)
        if attribute in vars(model):
            forward()
            with pytest.raises(RuntimeError, match=rf"config\.{attribute} is {value!r} but its own {attribute} is "):
                probe.result()
            setattr(model, attribute, value)
    _changed_while_attached(case_id, change)


# -- generic discovery and registering an architecture ------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "model_cls", "hand"),
    [
        (_cfg(tf.OlmoConfig, **_GQA), tf.OlmoForCausalLM, oracle.olmo),
        (_cfg(tf.Starcoder2Config, **_GQA), tf.Starcoder2ForSequenceClassification,
         oracle.layer_norm_decoder("model.norm")),
        (_cfg(tf.StableLmConfig, **_GQA), tf.StableLmForCausalLM, oracle.layer_norm_decoder("model.norm")),
        (_cfg(tf.GPTJConfig, **_GPT_NAMES, rotary_dim=4), tf.GPTJForCausalLM,
         oracle.layer_norm_decoder("transformer.ln_f")),
        (_cfg(tf.BloomConfig, **_DEC), tf.BloomForSequenceClassification, oracle.layer_norm_decoder("transformer.ln_f")),
        (_cfg(tf.MptConfig, vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, pad_token_id=PAD), tf.MptForCausalLM,
         oracle.layer_norm_decoder("transformer.norm_f")),
        # final norms named layer_norm, and one in the module holding the blocks (MBartForCausalLM calls it directly)
        (_cfg(tf.XGLMConfig, **_FAIRSEQ, num_layers=2, attention_heads=4, ffn_dim=64), tf.XGLMForCausalLM,
         oracle.layer_norm_decoder("model.layer_norm")),
        (_cfg(tf.BioGptConfig, **_ENC), tf.BioGptForSequenceClassification,
         oracle.layer_norm_decoder("biogpt.layer_norm")),
        (_cfg(tf.MBartConfig, **_FAIRSEQ, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4,
              decoder_ffn_dim=64), tf.MBartForCausalLM, oracle.layer_norm_decoder("model.decoder.layer_norm")),
    ],
    ids=["olmo-lm", "starcoder2-cls", "stablelm-lm", "gptj-lm", "bloom-cls", "mpt-lm", "xglm-lm", "biogpt-cls",
         "mbart-lm"],
)
def test_generic_discovery(private_registry, config, model_cls, hand):
    case = Case(config, model_cls, hand)
    model = case.build()
    # Discovery is what is tested here, so a registry entry added later for one of these types must not take over.
    registry._SPECS.pop(model.config.model_type, None)
    res = _check_against_oracle(case, model)
    assert res.meta["spec"] == f"discovered:{model.config.model_type}"


class MisnamedBaseLlama(tf.LlamaForCausalLM):
    """A task model whose base_model_prefix names an attribute it does not have (as Llama4ForCausalLM names
    ``language_model`` and holds ``model``): its ``base_model`` is the task model itself."""

    base_model_prefix = "language_model"


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["discovered", "refused"])
def test_a_base_model_held_under_another_name_than_its_prefix_is_found(private_registry, softcap):
    """Discovery looked for the base model only as ``model.base_model``: where that is the task model itself, it
    found no blocks and no final norm, and the refusal printed placeholders. Under a model_type no entry names, it
    is discovered (the oracle's numbers); where discovery refuses (a logit softcap it cannot interpret), the refusal
    prints the registration its modules show, and that registration, pasted, gives the oracle's numbers."""
    case = Case(_LLAMA, MisnamedBaseLlama, oracle.llama)
    model = case.build()
    assert model.base_model is model
    model.config.model_type = "nxl_llamalike"
    if softcap is None:
        assert _check_against_oracle(case, model).meta["spec"] == "discovered:nxl_llamalike"
        return
    model.config.final_logit_softcapping = softcap  # read by the registry, ignored by Llama's forward
    with pytest.raises(nxl.UnknownArchitectureError, match="final_logit_softcapping=30.0") as err:
        nxl.attach(model)
    call = re.search(r"nxl\.register_architecture\(.*?\]\}\)", str(err.value)).group(0)
    assert "<" not in call, call
    model.config.final_logit_softcapping = None
    eval(call, {"nxl": nxl})  # pasted as printed
    assert _check_against_oracle(case, model).meta["spec"] == "nxl_llamalike"


def test_a_config_without_a_pad_token_id_attribute_has_no_pad_id():
    """CodeGenConfig (transformers 5) has no pad_token_id attribute at all, which transformers reads as None: so does
    attach, and every forward after it (attach raised AttributeError)."""
    case = Case(_cfg(tf.CodeGenConfig, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32,
                     bos_token_id=1, eos_token_id=2), tf.CodeGenForCausalLM, oracle.layer_norm_decoder("transformer.ln_f"))
    model = case.build()
    assert not hasattr(model.config, "pad_token_id")
    assert _check_against_oracle(case, model).meta["spec"] == "discovered:codegen"


@pytest.fixture
def private_registry(monkeypatch):
    """Registrations inside a test do not leak into the others."""
    monkeypatch.setattr(registry, "_SPECS", registry.specs())


_MPNET = _cfg(tf.MPNetConfig, **_ENC)


def test_undiscoverable_model_says_how_to_register(private_registry):
    """MPNet has no final norm to find: the error says how to register it, and registering makes it work."""
    case = Case(_MPNET, tf.MPNetForSequenceClassification, oracle.roberta_classifier, decoder=False)
    model = case.build()
    with pytest.raises(nxl.UnknownArchitectureError, match=r"nxl\.register_architecture\('mpnet'") as err:
        nxl.attach(model)
    assert "registry/*.toml" in str(err.value)
    nxl.register_architecture("mpnet", blocks="mpnet.encoder.layer", pooling="first",
                              heads={"sequence_classification": ["classifier.dense", "tanh", "classifier.out_proj"]})
    _check_against_oracle(case, model)


@pytest.mark.parametrize("case_id", ["bert-cls", "bert-mlm"])
def test_an_unregistered_post_ln_encoder_is_told_a_registration_that_works(private_registry, case_id):
    """A BERT-like model under a model_type no entry names has no final norm for discovery to find: the refusal
    prints the registration its modules show (its blocks, no final norm, the pooler's dense and tanh or the MLM
    transform, the readout; CLS pooling for a classifier), not placeholders, and registering it as printed gives the
    oracle's numbers (the template offered a final norm such an encoder does not have)."""
    case = CASES[case_id]
    model = case.build()
    model.config.model_type = "nxl_bertlike"
    with pytest.raises(nxl.UnknownArchitectureError, match="generic discovery found no") as err:
        nxl.attach(model)
    call = re.search(r"nxl\.register_architecture\(.*?\]\}\)", str(err.value)).group(0)
    assert "<" not in call, call
    eval(call, {"nxl": nxl})  # pasted as printed
    assert _check_against_oracle(case, model).meta["spec"] == "nxl_bertlike"


@pytest.mark.parametrize(("config", "model_cls", "decoder"), [
    (_cfg(tf.ModernBertConfig, **_ENC), tf.ModernBertForSequenceClassification, False),
    (_cfg(tf.ModernBertDecoderConfig, **_ENC), tf.ModernBertDecoderForSequenceClassification, True),
], ids=["modernbert-cls", "modernbert_decoder-cls"])
def test_a_classifiers_printed_registration_reads_the_token_its_family_reads(private_registry, config, model_cls,
                                                                             decoder):
    """The registration printed for a classifier said pooling='first' by whether a final norm was found (a post-LN
    encoder has none): wrong both ways for ModernBERT's encoder, which has one (its final_norm, found now) and reads
    CLS, and its decoder, which has one and reads its last token. Pasted as printed, each gives the oracle's
    numbers: an encoder family (one transformers builds a masked LM of) reads the first token."""
    case = Case(config, model_cls, oracle.modernbert_classifier, decoder=decoder)
    model = case.build()
    with pytest.raises(nxl.UnknownArchitectureError, match="generic discovery found no") as err:
        nxl.attach(model)
    call = re.search(r"nxl\.register_architecture\(.*?\]\}\)", str(err.value)).group(0)
    assert ("pooling='first'" in call) is not decoder, call
    eval(call, {"nxl": nxl})  # pasted as printed
    assert _check_against_oracle(case, model).meta["spec"] == model.config.model_type


def test_register_file(private_registry, tmp_path):
    path = tmp_path / "mpnet.toml"
    path.write_text(
        '[mpnet]\nblocks = "mpnet.encoder.layer"\npooling = "first"\n'
        'heads.masked_lm = ["lm_head.dense", "gelu", "lm_head.layer_norm", "lm_head.decoder"]\n'
    )
    case = Case(_MPNET, tf.MPNetForMaskedLM, oracle.roberta_lm, decoder=False)
    model = case.build()
    with pytest.raises(nxl.UnknownArchitectureError, match="model_type 'mpnet'.*is not supported"):
        nxl.attach(model, tokenizer=TOK)
    (spec,) = nxl.register_file(path)
    assert spec.model_types == ("mpnet",) and spec.source == str(path)
    _check_against_oracle(case, model)


def test_logit_post_processing_blocks_discovery(private_registry):
    """VaultGemma softcaps its logits: discovery would miss that, so it refuses and says which step to add."""
    case = Case(_cfg(tf.VaultGemmaConfig, **_GQA, head_dim=8, final_logit_softcapping=2.0), tf.VaultGemmaForCausalLM,
                oracle.gemma)
    model = case.build()
    with pytest.raises(nxl.UnknownArchitectureError, match="final_logit_softcapping=2.0.*softcap:"):
        nxl.attach(model)
    nxl.register_architecture("vaultgemma", blocks="model.layers",
                              heads={"causal_lm": ["model.norm", "lm_head", "softcap:final_logit_softcapping"]})
    _check_against_oracle(case, model)


def test_a_recurrent_gemma_softcap_is_named_in_the_refusal(private_registry):
    """RecurrentGemma softcaps by config.logits_soft_cap: the refusal named no setting (the guess's numbers were
    only "not confirmed"); it names it and the step to add, and that registration is the model's own head."""
    model = Case(_cfg(tf.RecurrentGemmaConfig, **dict(_DEC, num_hidden_layers=3), lru_width=32, logits_soft_cap=2.0),
                 tf.RecurrentGemmaForCausalLM, oracle.gemma).build()
    with pytest.raises(nxl.UnknownArchitectureError, match=r"\(logits_soft_cap=2.0\).*'softcap:"):
        nxl.attach(model)
    nxl.register_architecture("recurrent_gemma", blocks="model.layers",
                              heads={"causal_lm": ["model.final_norm", "lm_head", "softcap:logits_soft_cap"]})
    nxl.attach(model).detach()  # checked against the model's own logits at attach


class ScaledOlmoForCausalLM(tf.OlmoForCausalLM):
    """A family that scales its logits by a factor no config value names (Inkling divides by a muP multiplier)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out


class TupleScaledOlmoForCausalLM(ScaledOlmoForCausalLM):
    """The same, returning a plain tuple (remote code, an export wrapper)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs).to_tuple()


@pytest.mark.parametrize(("offload", "model_cls"), [(None, ScaledOlmoForCausalLM), ("cpu", ScaledOlmoForCausalLM),
                                                    ("disk", ScaledOlmoForCausalLM),
                                                    (None, TupleScaledOlmoForCausalLM)])
def test_discovery_whose_head_misses_the_models_own_logits_refuses_and_says_how_to_register(private_registry, offload,
                                                                                            model_cls, tmp_path):
    """Generic discovery's guess (final norm, then lm_head) is checked once against the model's own logits: a model
    that computes them otherwise is refused with one line, not recorded with numbers off by its factor. Its weights
    offloaded (on meta until each forward) too: the check was skipped for them; and a model returning a plain tuple,
    whose logits were not found (the check compared nothing and passed)."""
    model = Case(_cfg(tf.OlmoConfig, **_GQA), model_cls, oracle.olmo).build()
    if offload is not None:
        accelerate = pytest.importorskip("accelerate")
        if offload == "cpu":
            accelerate.cpu_offload(model, execution_device="cpu")
        else:
            accelerate.disk_offload(model, offload_dir=str(tmp_path / "offload"), execution_device="cpu")
        assert model.get_input_embeddings().weight.is_meta
    name = model_cls.__name__
    with pytest.raises(nxl.UnknownArchitectureError, match=rf"model_type 'olmo' \({name}\) is not supported: "
                       rf"generic discovery's guess .* differ from {name}'s own .*"
                       r"nxl\.register_architecture\('olmo'"):
        nxl.attach(model)
    assert not nxl_hooks_on(model)  # nothing left on the model


class SentimentModel(tf.BertForSequenceClassification):
    """A user's subclass under a name of its own, its forward unchanged."""


class DoubledChat(tf.LlamaForCausalLM):
    """A user's subclass under a name of its own that doubles its logits."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


def test_a_subclass_under_a_name_of_its_own_reads_out_as_the_class_it_extends():
    """The head kind was read from the class's own name alone: ``class SentimentModel(BertForSequenceClassification)``
    was refused as a model NormXLogit does not explain (encoder-decoder, token classification...). It reads out as
    the class it extends, and its entry is checked against its own logits at attach, as any subclass's is: one that
    computes them otherwise is refused, not recorded with wrong numbers."""
    case = CASES["bert-cls"]
    res = _check_against_oracle(case, Case(case.config, SentimentModel, case.oracle, decoder=False).build())
    assert res.meta["head_kind"] == "sequence_classification"
    model = Case(_LLAMA, DoubledChat, oracle.llama).build()
    with pytest.raises(nxl.RegistryError, match=r"\[llama\] .* gives logits that differ from DoubledChat's own"):
        nxl.attach(model)
    assert not nxl_hooks_on(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_scaled_word_embedding_in_16_bits_is_its_raw_rows_norm(dtype):
    """Gemma in bf16/fp16, embedding="word": ‖W[id]‖₂ of the raw rows, not the 16-bit scaled output's norm divided
    back (rounded after the scale: up to 1.4e-3 relative off)."""
    case = CASES["gemma2-lm"]
    model = case.build().to(dtype)
    ids, mask = _batch(case, "causal_lm")
    res, _ = _run(model, ids, mask, embedding="word", layers=[-1])
    rows = model.get_input_embeddings().weight.detach()[ids].float()
    torch.testing.assert_close(res.embed_norm, rows.pow(2).sum(-1).sqrt(), rtol=1e-6, atol=0)


def test_a_word_embedding_scaled_by_a_float_is_read_unscaled(private_registry):
    """XGLM (as BioGPT and BART) keeps its embedding scale as a float, not a buffer (Gemma): ‖x_i⁰‖₂ is the raw row's
    norm either way."""
    nxl.register_architecture("xglm", blocks="model.layers", heads={"causal_lm": ["model.layer_norm", "lm_head"]})
    torch.manual_seed(0)
    model = tf.XGLMForCausalLM(tf.XGLMConfig(vocab_size=VOCAB, d_model=32, num_layers=2, attention_heads=4,
                                             ffn_dim=64, pad_token_id=PAD, scale_embedding=True)).eval()
    embedding = model.get_input_embeddings()
    assert isinstance(embedding.embed_scale, float) and embedding.embed_scale > 1
    ids = torch.randint(len(_SPECIAL), VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), nxl.attach(model, embedding="word") as probe:
        model(input_ids=ids)
    torch.testing.assert_close(probe.result().embed_norm[0], embedding.weight[ids[0]].detach().norm(dim=-1))


def test_backbone_bypassed_says_what_to_set(private_registry):
    """OPTForCausalLM calls model.decoder directly: without `backbone` in its entry the probe says so."""
    entry = registry.specs()["opt"]
    nxl.register_architecture("opt", blocks=entry.blocks, heads=entry.heads)
    model = CASES["opt-lm"].build()
    ids, mask = _batch(CASES["opt-lm"], "causal_lm")
    with nxl.attach(model) as probe:
        model(input_ids=ids, attention_mask=mask)
        with pytest.raises(RuntimeError, match="set `backbone`"):
            probe.result()


def test_variant_without_the_named_head_module():
    """DeBERTa-v2's non-legacy masked-LM head (a readout tied to the embedding) is not in the entry."""
    model = CASES["deberta_v2-mlm"].build(legacy=False)
    with pytest.raises(nxl.UnknownArchitectureError, match="no module 'cls.predictions.transform'"):
        nxl.attach(model, tokenizer=TOK)


@pytest.mark.parametrize("case_id", ["llama-lm", "gemma2-lm", "granite-lm", "qwen3-cls", "llama-reg"])
def test_a_folded_float32_rms_norm_gives_the_models_own_logit_at_the_last_layer_to_the_bit(case_id):
    """A float32 final RMS norm folded into the gathered rows reassociates the model's products (its rsqrt applied
    after the dot product, its gain in the rows): LogAt at l = L and the prediction position missed the model's own
    logit by float32 roundings, 5e-5 to 1.2e-4 on a d = 4096 Llama / Gemma 2 with logits near 100 / 30 (a regression
    head's |HoT(h) - HoT(h_p^L)| was not 0 there). It is the model's own logit, to the bit, every output of it; every
    layer still equals the oracle (the fold stays on)."""
    from nxl_hooks.arch.registry import resolve
    from nxl_hooks.method.head import Head

    case = CASES[case_id]
    model = case.build(num_labels=1 if case_id.endswith("-reg") else 16)
    with torch.no_grad():  # logits of a few hundred, where float32 roundings show
        readout = model.score if case_id.endswith(("-cls", "-reg")) else model.lm_head
        readout.weight.normal_(0.0, 30.0)
    assert Head(model, *resolve(model))._fold is not None  # the path under test
    kind = _kind(model)
    ids, mask = _batch(case, kind)
    outputs = list(range(model.config.num_labels if kind != "causal_lm" else VOCAB))
    res, out = _run(model, ids, mask, target=outputs, tokenizer=TOK)
    examples, positions = _expected_rows(case, kind, ids, mask)
    rows = torch.arange(len(examples))
    own = _own_logits(out, kind, examples, positions)
    at_l = res.logat[-1, rows, positions]
    if kind == "regression":
        assert torch.equal(at_l, torch.zeros_like(at_l))
    else:
        assert torch.equal(at_l, own)
    logits = case.oracle(model).layer_logits(out.hidden_states)[:, examples]
    if kind == "regression":
        expected = (logits - own[None, :, None]).abs()
    else:
        expected = logits
    torch.testing.assert_close(res.logat, expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("make, one_plus", [(_LLAMA, False), (_GEMMA2, True)], ids=["llama", "gemma2"])
def test_a_float32_rms_norm_is_folded_into_the_readout_with_its_own_gain_and_eps(make, one_plus):
    """The final RMS norm of a float32 decoder is folded (the readout rows scaled by its gain once, the per-token
    rsqrt applied after the gather): gain and eps equal the module's own, written by hand. Without the fold the
    numbers stay right (other tests), only slower; this test is what notices a fold that quietly turned off."""
    from nxl_hooks.arch.registry import resolve
    from nxl_hooks.method.head import Head

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(make()).eval()
    norm = model.model.norm
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)  # a gain that is not all ones (or zeros, for Gemma's 1 + w)
    spec, kind = resolve(model)
    fold = Head(model, spec, kind)._fold
    assert fold is not None
    expected = (1.0 + norm.weight) if one_plus else norm.weight
    torch.testing.assert_close(fold.gain, expected.detach().float(), rtol=1e-5, atol=1e-6)
    assert fold.eps == pytest.approx(model.config.rms_norm_eps)
    hidden = torch.randn(3, model.config.hidden_size) * 4
    by_hand = 1.0 / torch.sqrt(hidden.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
    torch.testing.assert_close(fold.scale(hidden), by_hand, rtol=1e-5, atol=1e-6)


def test_a_layer_norm_is_not_folded():
    from nxl_hooks.arch.registry import resolve
    from nxl_hooks.method.head import Head

    model = tf.AutoModelForCausalLM.from_config(_GPT2()).eval()
    spec, kind = resolve(model)
    assert Head(model, spec, kind)._fold is None
