"""Registry entries are checked against the model they describe (issue 19, item 3).

A table of wrong user entries, each registered with ``nxl.register_architecture`` (or a TOML file) and attached to
a tiny model of its family: every one is refused at attach with one line naming the entry, the key, what was found
and what was expected, and leaves no hook behind. Some are wrong in kind (blocks that are no ModuleList, head steps
that are no module, a config value that is a token id), found by looking; the rest look fine and give wrong numbers,
found by the registry oracle that runs a user's entry once against the model's own logits. Valid user entries still
attach and equal the hand-written oracle of tests/oracle.py; shipped entries are not run at attach on the classes
they are tested for (transformers' own), and are run on any other class.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch
import transformers as tf
from transformers.modeling_outputs import SequenceClassifierOutput

import nxl_hooks as nxl
from nxl_hooks.arch import registry
from nxl_hooks.method import verify
from test_architectures import CASES, TOK, Case, _batch, _check_against_oracle
from test_architectures import private_registry  # noqa: F401 - a fixture
from tiny import nxl_hooks_on

_MODELS: dict[str, torch.nn.Module] = {}


def _model(case_id: str) -> torch.nn.Module:
    """The tiny model of a test_architectures case, built once (attach leaves it unchanged)."""
    if case_id not in _MODELS:
        _MODELS[case_id] = CASES[case_id].build()
    return _MODELS[case_id]


def H(kind: str, *steps: str) -> dict:
    """A ``heads`` change: one head kind and its steps."""
    return {"heads": {kind: list(steps)}}


LM, CLS, MLM = "causal_lm", "sequence_classification", "masked_lm"
NORM = "model.norm"
_LIST = "expected the ModuleList of the model's blocks"
_MODULE = "expected a module of the head-on-top"
_INSIDE = "inside the blocks 'model.layers'; expected a module of the head-on-top"
_FLOAT = "by its name a token id, count or size; expected a"
_NUMBERS = r"gives logits that differ from \w+'s own by [0-9.e+-]+ .* on a random input; expected the model's head"
_BACKBONE = "expected the module that takes input_ids and runs the blocks"

# (model case, changes to the shipped entry of its model type, the key named, what the line says)
BAD = {
    # -- blocks: not a ModuleList of blocks
    "blocks final norm": ("llama-lm", {"blocks": NORM}, "blocks", f"names 'model.norm', a LlamaRMSNorm; {_LIST}"),
    "blocks lm_head": ("llama-lm", {"blocks": "lm_head"}, "blocks", f"a Linear; {_LIST}"),
    "blocks one block": ("llama-lm", {"blocks": "model.layers.0"}, "blocks", f"a LlamaDecoderLayer; {_LIST}"),
    "blocks attention": ("llama-lm", {"blocks": "model.layers.1.self_attn"}, "blocks", f"a LlamaAttention; {_LIST}"),
    "blocks embedding": ("llama-lm", {"blocks": "model.embed_tokens"}, "blocks", f"an? Embedding; {_LIST}"),
    "blocks backbone": ("llama-lm", {"blocks": "model"}, "blocks", f"a LlamaModel; {_LIST}"),
    "blocks rotary": ("llama-lm", {"blocks": "model.rotary_emb"}, "blocks", f"RotaryEmbedding; {_LIST}"),
    "blocks a tensor": ("llama-lm", {"blocks": "lm_head.weight"}, "blocks", r"a Parameter of shape \(64, 32\), not a"),
    "blocks a tensor 2": ("llama-lm", {"blocks": "model.embed_tokens.weight"}, "blocks", "a Parameter of shape"),
    "blocks config": ("llama-lm", {"blocks": "config"}, "blocks", f"a LlamaConfig, not a module; {_LIST}"),
    "blocks forward": ("llama-lm", {"blocks": "forward"}, "blocks", "the method/function 'forward', not a module"),
    "blocks dtype": ("llama-lm", {"blocks": "dtype"}, "blocks", "a dtype, not a module"),
    "blocks missing": ("llama-lm", {"blocks": "model.layerz"}, "blocks", "which LlamaForCausalLM does not have"),
    "blocks index": ("llama-lm", {"blocks": "model.layers.7"}, "blocks", "which LlamaForCausalLM does not have"),
    "blocks gpt2 block": ("gpt2-lm", {"blocks": "transformer.h.0"}, "blocks", f"a GPT2Block; {_LIST}"),
    "blocks gpt2 wte": ("gpt2-lm", {"blocks": "transformer.wte"}, "blocks", f"an? Embedding; {_LIST}"),
    "blocks bert encoder": ("bert-cls", {"blocks": "bert.encoder"}, "blocks", f"a BertEncoder; {_LIST}"),
    "blocks bert pooler": ("bert-cls", {"blocks": "bert.pooler"}, "blocks", f"a BertPooler; {_LIST}"),
    # -- head steps that are not modules
    "step a tensor": ("llama-lm", H(LM, NORM, "lm_head.weight"), "heads.causal_lm", f"a Parameter .*; {_MODULE}"),
    "step norm weight": ("llama-lm", H(LM, "model.norm.weight", "lm_head"), "heads.causal_lm", "a Parameter"),
    "step config": ("llama-lm", H(LM, NORM, "config"), "heads.causal_lm", f"a LlamaConfig, not a module; {_MODULE}"),
    "step forward": ("llama-lm", H(LM, NORM, "forward"), "heads.causal_lm", "the method/function 'forward'"),
    "step dtype": ("llama-lm", H(LM, NORM, "dtype", "lm_head"), "heads.causal_lm", "a dtype, not a module"),
    # -- head steps that name no module of the model: a typo, a function no step is (not blamed on another step)
    "readout typo": ("llama-lm", H(LM, NORM, "lm_hed"), "heads.causal_lm",
                     "step 'lm_hed': LlamaForCausalLM has no module 'lm_hed' \\(did you mean 'lm_head'\\?\\); "
                     "expected"),
    "step unknown function": ("llama-lm", H(LM, NORM, "sigmoid", "lm_head"), "heads.causal_lm",
                              "has no module 'sigmoid'; expected a module path of the head-on-top, a function"),
    # -- head steps that are modules of the wrong kind or place
    "readout up_proj": ("llama-lm", H(LM, NORM, "model.layers.0.mlp.up_proj"), "heads.causal_lm",
                        f"'model.layers.0.mlp.up_proj' is a Linear {_INSIDE}"),
    "readout q_proj": ("llama-lm", H(LM, NORM, "model.layers.0.self_attn.q_proj"), "heads.causal_lm", _INSIDE),
    "readout down_proj": ("llama-lm", H(LM, NORM, "model.layers.1.mlp.down_proj"), "heads.causal_lm", _INSIDE),
    "step a block": ("llama-lm", H(LM, NORM, "model.layers.1", "lm_head"), "heads.causal_lm", _INSIDE),
    "step the blocks": ("llama-lm", H(LM, NORM, "model.layers", "lm_head"), "heads.causal_lm", "the blocks"),
    "step the backbone": ("llama-lm", H(LM, NORM, "model", "lm_head"), "heads.causal_lm", "contains the blocks"),
    "readout embedding": ("llama-lm", H(LM, NORM, "model.embed_tokens"), "heads.causal_lm",
                          "readout 'model.embed_tokens' .*has no Linear layer; expected the vocabulary size 64"),
    "readout the norm": ("llama-lm", H(LM, NORM), "heads.causal_lm", "readout 'model.norm' .*has no Linear layer"),
    "final norm left out": ("llama-lm", H(LM, "lm_head"), "heads.causal_lm", "leaves out the model's final norm"),
    "nested final norm left out": ("opt-lm", H(LM, "model.decoder.project_out", "lm_head"), "heads.causal_lm",
                                   "leaves out the model's final norm 'model.decoder.final_layer_norm'"),
    "readout twice": ("llama-lm", H(LM, NORM, "lm_head", "lm_head"), "heads.causal_lm",
                      "cannot be applied to the output of the last block"),
    "bert readout pooler": ("bert-cls", H(CLS, "bert.pooler.dense"), "heads.sequence_classification",
                            r"readout 'bert.pooler.dense' \(Linear\) gives 32 values per position; expected num_labels = 2"),
    "bert readout pooler 2": ("bert-cls", H(CLS, "bert.pooler.dense", "tanh", "bert.pooler.dense"),
                              "heads.sequence_classification", "gives 32 values per position; expected num_labels"),
    "bert step in blocks": ("bert-cls", H(CLS, "bert.encoder.layer.1.output.dense", "classifier"),
                            "heads.sequence_classification", "inside the blocks 'bert.encoder.layer'"),
    "mlm readout transform": ("bert-mlm", H(MLM, "cls.predictions.transform"), "heads.masked_lm",
                              "gives 32 values per position; expected the vocabulary size 64"),
    "llama-cls readout in blocks": ("llama-cls", H(CLS, NORM, "model.layers.1.mlp.gate_proj"),
                                    "heads.sequence_classification", _INSIDE),
    "gpt2 readout conv1d": ("gpt2-lm", H(LM, "transformer.ln_f", "transformer.h.1.mlp.c_fc"), "heads.causal_lm",
                            "inside the blocks 'transformer.h'"),
    # -- config values of the wrong kind
    "divide by pad id": ("llama-lm", H(LM, NORM, "lm_head", "divide:pad_token_id"), "heads.causal_lm",
                         f"step 'divide:pad_token_id': config.pad_token_id is 0, {_FLOAT} scale"),
    "softcap by pad id": ("llama-lm", H(LM, NORM, "lm_head", "softcap:pad_token_id"), "heads.causal_lm",
                          f"config.pad_token_id is 0, {_FLOAT} cap"),
    "softcap by bos id": ("llama-lm", H(LM, NORM, "lm_head", "softcap:bos_token_id"), "heads.causal_lm", _FLOAT),
    "scale by vocab": ("llama-lm", H(LM, NORM, "lm_head", "scale:vocab_size"), "heads.causal_lm", _FLOAT),
    "scale by layers": ("llama-lm", H(LM, NORM, "lm_head", "scale:num_hidden_layers"), "heads.causal_lm", _FLOAT),
    "scale by a string": ("llama-lm", H(LM, NORM, "lm_head", "scale:model_type"), "heads.causal_lm",
                          "config.model_type is 'llama', not a number"),
    "divide by an activation": ("llama-lm", H(LM, NORM, "lm_head", "divide:hidden_act"), "heads.causal_lm",
                                "config.hidden_act is 'silu', not a number"),
    "softcap by a bool": ("llama-lm", H(LM, NORM, "lm_head", "softcap:tie_word_embeddings"), "heads.causal_lm",
                          "config.tie_word_embeddings is False, not a number"),
    "divide by zero": ("llama-lm", H(LM, NORM, "lm_head", "divide:attention_dropout"), "heads.causal_lm",
                       "config.attention_dropout is 0.0; expected a finite non-zero number"),
    "scale typo": ("llama-lm", H(LM, NORM, "lm_head", "scale:logit_scael"), "heads.causal_lm",
                   "LlamaConfig has no attribute 'logit_scael'"),
    "act a token id": ("llama-lm", H(LM, NORM, "act:pad_token_id", "lm_head"), "heads.causal_lm",
                       "config.pad_token_id is 0; expected the name of an activation function"),
    "act a model type": ("llama-lm", H(LM, NORM, "act:model_type", "lm_head"), "heads.causal_lm",
                         "config.model_type is 'llama'; expected the name of an activation"),
    # -- wrong numbers, found by the registry oracle
    "scale by eps": ("llama-lm", H(LM, NORM, "lm_head", "scale:rms_norm_eps"), "heads.causal_lm", _NUMBERS),
    "softcap by init range": ("llama-lm", H(LM, NORM, "lm_head", "softcap:initializer_range"), "heads.causal_lm",
                              _NUMBERS),
    "norm twice": ("llama-lm", H(LM, NORM, NORM, "lm_head"), "heads.causal_lm", _NUMBERS),
    "activation added": ("llama-lm", H(LM, NORM, "act:hidden_act", "lm_head"), "heads.causal_lm", _NUMBERS),
    "tanh added": ("llama-lm", H(LM, NORM, "tanh", "lm_head"), "heads.causal_lm", _NUMBERS),
    "llama-cls pooling first": ("llama-cls", {"pooling": "first"}, "pooling",
                                "is 'first', but LlamaForSequenceClassification reads its prediction at the last "
                                "non-pad token; expected 'last_non_pad'"),
    "bert pooling last": ("bert-cls", {"pooling": "last_non_pad"}, "pooling", r"the first token \(CLS\); expected 'first'"),
    "bert no tanh": ("bert-cls", H(CLS, "bert.pooler.dense", "classifier"), "heads.sequence_classification",
                     _NUMBERS),
    "bert no pooler": ("bert-cls", H(CLS, "tanh", "classifier"), "heads.sequence_classification", _NUMBERS),
    "mlm no transform": ("bert-mlm", H(MLM, "cls.predictions.decoder"), "heads.masked_lm", _NUMBERS),
    "mlm transform dense only": ("bert-mlm", H(MLM, "cls.predictions.transform.dense", "cls.predictions.decoder"),
                                 "heads.masked_lm", _NUMBERS),
    "gpt2 scale by eps": ("gpt2-lm", H(LM, "transformer.ln_f", "lm_head", "scale:layer_norm_epsilon"),
                          "heads.causal_lm", _NUMBERS),
    "gemma2 softcap left out": ("gemma2-lm", H(LM, NORM, "lm_head"), "heads.causal_lm", _NUMBERS),
    "gemma2 softcap twice": ("gemma2-lm", H(LM, NORM, "lm_head", "softcap:final_logit_softcapping",
                                            "softcap:final_logit_softcapping"), "heads.causal_lm", _NUMBERS),
    "gemma2 divide not softcap": ("gemma2-lm", H(LM, NORM, "lm_head", "divide:final_logit_softcapping"),
                                  "heads.causal_lm", _NUMBERS),
    # -- backbone
    "backbone final norm": ("llama-lm", {"backbone": NORM}, "backbone",
                            f"a LlamaRMSNorm that does not contain the blocks 'model.layers'; {_BACKBONE}"),
    "backbone lm_head": ("llama-lm", {"backbone": "lm_head"}, "backbone", "does not contain the blocks"),
    "backbone embedding": ("llama-lm", {"backbone": "model.embed_tokens"}, "backbone", "does not contain the blocks"),
    "backbone the blocks": ("llama-lm", {"backbone": "model.layers"}, "backbone",
                            f"a ModuleList whose forward takes no input_ids or inputs_embeds; {_BACKBONE}"),
    "backbone one block": ("llama-lm", {"backbone": "model.layers.0"}, "backbone", "does not contain the blocks"),
    "backbone config": ("llama-lm", {"backbone": "config"}, "backbone", "a LlamaConfig, not a module"),
    "backbone a tensor": ("llama-lm", {"backbone": "lm_head.weight"}, "backbone", "a Parameter of shape"),
    "backbone missing": ("llama-lm", {"backbone": "model.decoder"}, "backbone", "which LlamaForCausalLM does not have"),
    "backbone bert encoder": ("bert-cls", {"backbone": "bert.encoder"}, "backbone",
                              "a BertEncoder whose forward takes no input_ids"),
    "backbone opt layers": ("opt-lm", {"backbone": "model.decoder.layers"}, "backbone", "whose forward takes no"),
    "backbone opt embedding": ("opt-lm", {"backbone": "model.decoder.embed_tokens"}, "backbone",
                               "does not contain the blocks"),
    # -- layer_outputs: where h[l] is read in place of block l's output
    "layer_outputs beyond L": ("deberta_v2_conv-cls", {"layer_outputs": {3: "deberta.encoder.conv"}},
                               "layer_outputs.3", "names layer 3, but 'deberta.encoder.layer' holds 2 blocks"),
    "layer_outputs missing": ("deberta_v2_conv-cls", {"layer_outputs": {1: "deberta.encoder.convolution"}},
                              "layer_outputs.1", "which DebertaV2ForSequenceClassification does not have"),
    "layer_outputs a block": ("deberta_v2_conv-cls", {"layer_outputs": {1: "deberta.encoder.layer.1"}},
                              "layer_outputs.1", "a DebertaV2Layer inside or around the blocks"),
    "layer_outputs the encoder": ("deberta_v2_conv-cls", {"layer_outputs": {1: "deberta.encoder"}},
                                  "layer_outputs.1", "a DebertaV2Encoder inside or around the blocks"),
    "layer_outputs a tensor": ("deberta_v2_conv-cls", {"layer_outputs": {1: "deberta.encoder.conv.conv.weight"}},
                               "layer_outputs.1", "a Parameter of shape"),
    "layer_outputs never runs": ("deberta_v2_conv-cls", {"layer_outputs": {1: "deberta.encoder.rel_embeddings"}},
                                 "layer_outputs.1", "which ran 0 times in one forward of "
                                 "DebertaV2ForSequenceClassification; expected a module the backbone runs once"),
    "layer_outputs another shape": ("llama-lm", {"layer_outputs": {1: "model.rotary_emb"}}, "layer_outputs.1",
                                    r"gives outputs of shape \(1, 6, 8\) in one forward of LlamaForCausalLM; "
                                    r"expected .* giving its shape \(1, 6, 32\)"),
    "layer_outputs the final norm": ("llama-lm", {"layer_outputs": {1: NORM}}, "layer_outputs.1",
                                     "names 'model.norm', which is not given block 1's output in one forward of "
                                     "LlamaForCausalLM; expected a module the backbone runs once on block 1's output, "
                                     r"giving its shape \(1, 6, 32\), whose output block 2 takes"),
    "layer_outputs not the last": ("deberta_v2_conv1-cls", {"layer_outputs": {}}, "heads.sequence_classification",
                                   _NUMBERS),
}


def _register(name: str, model: torch.nn.Module, changes: dict) -> registry.ArchSpec:
    """A user entry for the model's type: its shipped entry's fields with ``changes``."""
    shipped = registry.specs()[model.config.model_type]
    fields = {"blocks": shipped.blocks, "heads": dict(shipped.heads), "pooling": shipped.pooling,
              "backbone": shipped.backbone, "layer_outputs": shipped.layer_outputs, **changes}
    return nxl.register_architecture(name, model_types=[model.config.model_type], **fields)


def _refused(model: torch.nn.Module, entry: str, key: str, message: str, source: str = "register_architecture()"):
    with pytest.raises(nxl.RegistryError) as error:
        nxl.attach(model, tokenizer=TOK)
    text = str(error.value)
    assert "\n" not in text and len(text) < 600, text
    assert text.startswith(f"registry entry [{entry}] in {source}: key {key!r} "), text
    assert re.search(message, text), text
    assert nxl_hooks_on(model) == 0


def test_the_table_holds_the_55_kinds_of_failure():
    assert len(BAD) >= 55
    kinds = {key.split(".")[0] for _, _, key, _ in BAD.values()}
    assert kinds == {"blocks", "heads", "backbone", "pooling", "layer_outputs"}


@pytest.mark.parametrize("name", list(BAD))
def test_a_wrong_entry_is_refused_in_one_line(private_registry, name):
    case_id, changes, key, message = BAD[name]
    model = _model(case_id)
    entry = "user_" + re.sub(r"\W", "_", name)
    _register(entry, model, changes)
    _refused(model, entry, key, message)


def test_blocks_that_do_not_all_run_are_refused(private_registry):
    """A ModuleList of which the forward runs only a part (num_hidden_layers cut to 1): block 1 never runs."""
    model = CASES["llama-lm"].build()
    model.config.num_hidden_layers = 1
    _register("half", model, {})
    _refused(model, "half", "blocks", "names 'model.layers', whose block 1 ran 0 times in one forward")


def test_an_integer_logits_scaling_of_0_is_refused():
    """An int is a scale (test_architectures.py::test_an_integer_logits_scaling_divides_the_logits), but 0 is none
    to divide by (a bool is "not a number": "softcap by a bool")."""
    model = CASES["granite-lm"].build(logits_scaling=0)
    _refused(model, "granite", "heads.causal_lm", "step 'divide:logits_scaling': config.logits_scaling is 0; expected "
             "a finite non-zero number", source=registry.specs()["granite"].source)


def test_a_wrong_toml_entry_names_its_file(private_registry, tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[mine]\nmodel_types = ["llama"]\nblocks = "model.layers"\n'
                    'heads.causal_lm = ["model.norm", "lm_head", "divide:pad_token_id"]\n')
    nxl.register_file(path)
    _refused(_model("llama-lm"), "mine", "heads.causal_lm", _FLOAT, source=str(path))


@pytest.mark.parametrize("value, where", [
    ("[" * 5000 + "]" * 5000, "too deeply to parse"),
    ("[" * 60 + '"lm_head"' + "]" * 60, "too deeply to parse|nests deeper than 4 levels"),
    ('[[[["model.norm"], "lm_head"]]]', r"\[deep\] in .*: key 'heads' nests deeper than 4 levels"),
    ("{a = {b = {c = {d = {e = 1}}}}}", r"\[deep\] in .*: key 'heads' nests deeper than 4 levels"),
], ids=["5000 arrays", "60 arrays", "5 arrays", "5 tables"])
def test_deeply_nested_toml_is_one_line(tmp_path, value, where):
    path = tmp_path / "deep.toml"
    text = '[deep]\nblocks = "model.layers"\nheads.causal_lm = ' + value + "\n"
    path.write_text(text if not value.startswith("{") else text.replace("heads.causal_lm", "heads"))
    before = registry.specs()
    with pytest.raises(nxl.RegistryError) as error:
        nxl.register_file(path)
    assert "\n" not in str(error.value) and re.search(where, str(error.value)), str(error.value)
    assert registry.specs() == before


def test_deeply_nested_register_call_is_one_line():
    steps: list = ["lm_head"]
    for _ in range(10000):
        steps = [steps]
    with pytest.raises(nxl.RegistryError, match=r"^registry entry \[q\] in register_architecture\(\): key 'heads' "
                                                r"nests deeper than 4 levels"):
        nxl.register_architecture("q", blocks="model.layers", heads={"causal_lm": steps})


class _MeanPooled:
    """A classifier that pools the mean of its tokens' final hidden states (sentence-transformers' way), then applies
    its family's head-on-top to that one vector: BERT's pooler dense, tanh and classifier, Llama's score."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        hidden = self.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask[..., None].to(hidden.dtype)
        return SequenceClassifierOutput(logits=self.on_top((hidden * weights).sum(1) / weights.sum(1)))


class MeanPooledBert(_MeanPooled, tf.BertForSequenceClassification):
    def on_top(self, pooled):
        return self.classifier(self.bert.pooler.activation(self.bert.pooler.dense(pooled)))


class MeanPooledLlama(_MeanPooled, tf.LlamaForSequenceClassification):
    def on_top(self, pooled):
        return self.score(pooled)  # (the backbone's last hidden state is normed already)


@pytest.mark.parametrize("case_id, model_cls", [("bert-cls", MeanPooledBert), ("llama-cls", MeanPooledLlama)])
def test_a_mean_pooled_classifier_is_refused_naming_the_pooling(case_id, model_cls):
    """Neither pooling the registry knows reads a mean-pooled classifier's prediction: its entry (the shipped one,
    run on this subclass) was refused as a head whose steps give the wrong numbers, with no word of pooling. The
    model's own logits are its family's hand-written head (tests/oracle.py) applied to the mean of its tokens, and
    neither the first nor the last token's: the refusal names 'pooling' and says why no value of it fits."""
    case = CASES[case_id]
    model = Case(case.config, model_cls, case.oracle).build()
    ids = torch.randint(5, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        hidden = model.base_model(input_ids=ids).last_hidden_state
    head = case.oracle(model).head
    torch.testing.assert_close(head(hidden.mean(1)), own)
    assert not any(torch.allclose(head(hidden[:, at]), own, atol=1e-3) for at in (0, -1))
    _refused(model, model.config.model_type, "pooling",
             f"is '{registry.specs()[model.config.model_type].pooling}', but {model_cls.__name__} pools the mean of "
             r"its tokens .* which no pooling reads; expected a classifier that reads one token \('first' or "
             "'last_non_pad'\\)", source=registry.specs()[model.config.model_type].source)


# -- what still works ----------------------------------------------------------------------------------------

GOOD = ["llama-lm", "llama-cls", "llama-reg", "gemma2-lm", "gpt2-lm", "opt_proj-lm", "falcon-lm", "granite-lm",
        "cohere-lm", "bert-cls", "bert-mlm", "roberta-cls", "distilbert-mlm", "deberta_v2-cls",
        "deberta_v2_conv-cls", "deberta_v2_conv1-cls"]


@pytest.mark.parametrize("case_id", GOOD)
def test_a_valid_user_entry_attaches_and_equals_the_oracle(private_registry, case_id):
    """The shipped entry registered again as a user's: the registry oracle runs once, accepts it, and the
    attribution equals tests/oracle.py's hand-written head."""
    case = CASES[case_id]
    model = case.build()
    spec = _register("mine", model, {})
    assert not registry.is_shipped(spec)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    _check_against_oracle(case, model)  # one attach, one recorded forward
    assert len(forwards) == 2  # the registry oracle's forward at attach, then the test's own
    _check_against_oracle(case, model)
    assert len(forwards) == 3  # checked once per entry, model class, head kind and config: not again


def test_shipped_entries_run_no_forward_at_attach():
    model = CASES["llama-lm"].build()
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    assert registry.is_shipped(registry.resolve(model)[0])
    with nxl.attach(model):
        pass
    assert forwards == []


def test_the_oracle_restores_training_mode(private_registry):
    model = CASES["bert-cls"].build().train()
    _register("mine", model, {})
    with nxl.attach(model, tokenizer=TOK):
        pass
    assert all(module.training for module in model.modules())


@pytest.mark.parametrize("back", ["model.layers.0.owner=.", "model.layers.1.prev=model.layers",
                                  "model.layers.0.mlp.up=model.layers.0"], ids=["to the model", "to the list",
                                                                               "to the block"])
def test_a_cycle_of_submodules_is_one_line(private_registry, back):
    """A back-reference registered as a submodule (issue 24, item 8): torch's own eval() recursed forever at attach
    (RecursionError); now one line naming the module that closes the cycle, and no hook left behind."""
    model = CASES["llama-lm"].build()
    _register("cyc", model, {})
    where, target = back.split("=")
    parent, _, name = where.rpartition(".")
    registry.get_path(model, parent).add_module(name, model if target == "." else registry.get_path(model, target))
    with pytest.raises(ValueError) as error:
        nxl.attach(model, tokenizer=TOK)
    text = str(error.value)
    assert "\n" not in text and len(text) < 400, text
    assert text.startswith(f"LlamaForCausalLM has a cycle of submodules: {where} is a "), text
    assert "keep such a back-reference outside the module tree" in text
    assert nxl_hooks_on(model) == 0


def test_a_module_shared_by_two_parents_is_no_cycle(private_registry):
    """A shared (tied) submodule reached twice is not a cycle: the entry still attaches."""
    model = CASES["llama-lm"].build()
    _register("shared", model, {})
    model.model.layers[1].add_module("twin", model.model.layers[0].mlp)
    with nxl.attach(model, tokenizer=TOK):
        pass
    assert nxl_hooks_on(model) == 0


def test_a_user_entry_on_the_id_of_a_shipped_one_is_still_checked(private_registry, monkeypatch):
    """A user's entry that replaced a shipped one may take its freed address, so its id(): it was taken for shipped
    (tested per family) and its numbers were never checked. The allocator decides that, so here id() answers the
    shipped entry's id for every object, as it then does."""
    model = CASES["llama-lm"].build()
    shipped = registry.specs()[model.config.model_type]
    monkeypatch.setattr(registry, "id", lambda _: id(shipped), raising=False)
    _register("user_on_shipped_id", model, {"layer_outputs": {1: "model.rotary_emb"}})
    _refused(model, "user_on_shipped_id", "layer_outputs.1", "gives outputs of shape")


class ScaledLlamaForCausalLM(tf.LlamaForCausalLM):
    """A class of its own that reuses the model type 'llama' (as a subclass or remote code does) and scales its
    logits, which the shipped entry, tested on transformers' own classes, does not describe."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out


class PlainLlamaForCausalLM(tf.LlamaForCausalLM):
    """A subclass that computes its logits as LlamaForCausalLM does."""


def test_a_shipped_entry_on_a_class_of_its_own_is_checked_against_its_logits():
    """The shipped entry was not run against a class it was not tested for: a subclass scaling its logits by 3 was
    recorded with LogAt at l = L a third of its own logit. Now it is refused as a user's entry is; a subclass that
    keeps the logits attaches (one forward for the check) and equals the oracle; transformers' own class runs none
    (test_shipped_entries_run_no_forward_at_attach)."""
    case = CASES["llama-lm"]
    _refused(Case(case.config, ScaledLlamaForCausalLM, case.oracle).build(), "llama", "heads.causal_lm", _NUMBERS,
             source=registry.specs()["llama"].source)
    plain = Case(case.config, PlainLlamaForCausalLM, case.oracle)
    model = plain.build()
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    _check_against_oracle(plain, model)
    assert len(forwards) == 2  # the registry oracle's forward at attach, then the test's own


@pytest.mark.parametrize("request_", ["whole", "held"])
def test_the_check_follows_its_own_forward_only(request_):
    """At ``nxl attach`` to a live server the registry oracle checks an entry while the server's threads run
    forwards. A request run whole during the check's forward went through the check's counting hooks: the blocks
    ran twice, and a valid entry was refused. A request held inside block 0 while the check ended found the check's
    hook removed and called it the short way: TypeError raised into the server's request. Now the check counts its
    own forward only, and a removed hook does nothing; the request's logits are the model's own."""
    case = CASES["llama-lm"]
    served = type(f"Served{request_.title()}LlamaForCausalLM", (tf.LlamaForCausalLM,), {})  # checked: its own class
    model = Case(case.config, served, case.oracle).build()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    checking, inside, release, got = threading.get_ident(), threading.Event(), threading.Event(), {}

    def server():
        try:
            with torch.no_grad():
                got[request_] = model(input_ids=ids).logits
        except Exception as error:  # what the request's caller would have seen
            got[request_] = error

    def hold(module, args, output):  # on block 0, ahead of the check's own hook: the held request waits here
        if threading.current_thread().name == "held":
            inside.set()
            release.wait(60)

    def during(module, args):  # the check's forward: the request runs whole, or starts and is held
        if threading.get_ident() == checking and thread.ident is None:
            thread.start()
            if request_ == "whole":
                thread.join()
            else:
                inside.wait(60)

    thread = threading.Thread(target=server, name=request_)
    handles = [model.model.layers[0].register_forward_hook(hold), model.register_forward_pre_hook(during)]
    try:
        with nxl.attach(model, tokenizer=TOK):
            pass
    finally:
        release.set()
        thread.join(60)
        for handle in handles:
            handle.remove()
    assert isinstance(got[request_], torch.Tensor), got[request_]
    assert torch.equal(got[request_], plain)
    assert nxl_hooks_on(model) == 0


class TupleLlamaForCausalLM(tf.LlamaForCausalLM):
    """A class of its own returning a plain tuple (remote code, an export wrapper), its logits times ``scale``."""

    scale = 1.0

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * self.scale
        return out.to_tuple()


class NoLogitsLlamaForCausalLM(tf.LlamaForCausalLM):
    """A class of its own whose forward returns its logits under a name of its own: no logits to check against."""

    def forward(self, *args, **kwargs):
        return {"scores": super().forward(*args, **kwargs).logits}


def test_a_tuple_output_is_checked_against_its_first_element():
    """The check read the model's logits from ``output.logits`` only: a subclass returning a plain tuple was compared
    with nothing and cached as checked, and with its logits scaled by 3 was recorded with LogAt at l = L a third of
    its own logit. Now a tuple's first element is its logits: the scaled one is refused; the unscaled one attaches and
    its LogAt at l = L equals its own logit; a forward whose logits cannot be found is refused, not passed."""
    case = CASES["llama-lm"]
    scaled = type("ScaledTupleLlamaForCausalLM", (TupleLlamaForCausalLM,), {"scale": 3.0})
    _refused(Case(case.config, scaled, case.oracle).build(), "llama", "heads.causal_lm", _NUMBERS,
             source=registry.specs()["llama"].source)
    model = Case(case.config, TupleLlamaForCausalLM, case.oracle).build()
    ids, mask = _batch(case, LM)
    with torch.no_grad(), nxl.attach(model, tokenizer=TOK) as probe:
        own = model(input_ids=ids, attention_mask=mask)[0]
    res = probe.result()
    rows = torch.arange(len(res.example))
    torch.testing.assert_close(res.logat[-1, rows, res.position],
                               own[res.example, res.position][rows, res.target], rtol=1e-5, atol=1e-5)
    no_logits = Case(case.config, NoLogitsLlamaForCausalLM, case.oracle).build()
    with pytest.raises(nxl.RegistryError, match=r"^registry entry \[llama\] .*: cannot be checked against "
                       r"NoLogitsLlamaForCausalLM's own logits .*returns dict with no logits tensor"):
        nxl.attach(no_logits, tokenizer=TOK)
    assert nxl_hooks_on(no_logits) == 0


def test_an_entry_is_checked_again_for_a_config_that_changes_its_head(private_registry):
    """A user's entry passed once per entry, class and head kind: one leaving out Gemma 2's softcap passed on a model
    with no softcap, then a model of the same class with one was recorded unchecked (LogAt 8.19 where its own logit
    was 2.0). The config is part of what passed: the second model is refused."""
    _register("no_softcap", _model("gemma2-lm"), H(LM, NORM, "lm_head"))
    with nxl.attach(CASES["gemma2-lm"].build(final_logit_softcapping=None), tokenizer=TOK):
        pass
    _refused(CASES["gemma2-lm"].build(), "no_softcap", "heads.causal_lm", _NUMBERS)


def test_a_layer_outputs_module_must_be_given_block_ls_output_and_give_block_l_plus_1_its_input(private_registry):
    """layer_outputs was checked by "ran once, block-shaped": DeBERTa-v2's conv numbered layer 2 (it runs on block 1's
    output) passed with 3 blocks, and layers 1 and 2 were recorded ~1 off transformers' hidden_states. Now the
    forward's data flow is checked: the module is given block l's output, and block l + 1 is given the module's."""
    model = CASES["deberta_v2_conv-cls"].build(num_hidden_layers=3)
    _register("conv_at_2", model, {"layer_outputs": {2: "deberta.encoder.conv"}})
    _refused(model, "conv_at_2", "layer_outputs.2", "names 'deberta.encoder.conv', which is not given block 2's output")
    # a module given block 1's output whose output goes nowhere: a side branch, not the residual stream
    model = CASES["llama-lm"].build()
    model.side = torch.nn.LayerNorm(32)

    def side_branch(block: torch.nn.Module, args: tuple) -> None:
        model.side(args[0])  # block 2 is given block 1's output, not this
    model.model.layers[1].register_forward_pre_hook(side_branch)
    _register("side", model, {"layer_outputs": {1: "side"}})
    _refused(model, "side", "layer_outputs.1", "names 'side', which gives an output block 2 is not given in one forward")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_check_in_16_bits_refuses_a_missing_softcap_and_passes_every_valid_entry(private_registry, dtype):
    """In 16 bits the check allowed 5% of the largest logit: a Gemma 2 entry leaving out a softcap of 30 (the real
    models' value), about 0.19 off at a largest logit near 9 (3 bf16 ulps), passed in bf16 while float32 refused it.
    The head runs the model's own modules in its dtype, so a valid entry is exact: now 2 epsilons of the dtype are
    allowed, and every GOOD entry still attaches."""
    for case_id in GOOD:  # (first: _register copies the entry the model type has now)
        model = CASES[case_id].build().to(dtype)
        _register(f"valid_{case_id}", model, {})
        with nxl.attach(model, tokenizer=TOK):
            pass
    model = CASES["gemma2-lm"].build(final_logit_softcapping=30.0).to(dtype)
    _register("no_softcap", model, H(LM, NORM, "lm_head"))
    _refused(model, "no_softcap", "heads.causal_lm", _NUMBERS)
