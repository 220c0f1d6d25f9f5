"""A catalogue of bad inputs to the library (issue 12): attach arguments, forwards, result methods, crafted and
damaged attribution and stream files, registry entries, sinks, dataset runs. Each case asserts the documented
error type and its message (what is wrong, what to do), that no hook is left on the model, and that no existing
file was changed. The CLI's own catalogue lives with the CLI tests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import re
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save as save_blob
from safetensors.torch import save_file

import bpe_tiny
import nxl_hooks as nxl
import oracle
import tiny
from nxl_hooks.apps import dataset
from nxl_hooks.arch import registry
from nxl_hooks.method.methods.contrastive import Contrastive
from nxl_hooks.records import files
from nxl_hooks.records import reader, writer
from nxl_hooks.records.attribution import RecordError

CATALOGUE: list[str] = []  # every case id, counted by test_catalogue_size


def cases(*items):
    """pytest params with ids, recorded in the catalogue."""
    CATALOGUE.extend(item[0] for item in items)
    return [pytest.param(*item[1:], id=item[0]) for item in items]


_hooks = tiny.nxl_hooks_on


@pytest.fixture(scope="module")
def lm():
    return tiny.build_model("llama")


@pytest.fixture(scope="module")
def bert():
    return tiny.build_model("bert")


@pytest.fixture()
def existing(tmp_path) -> Path:
    """A file with content that no failed call may change."""
    path = tmp_path / "existing.nxl"
    path.write_bytes(b"precious bytes\n" * 10)
    return path


# -- attach arguments ------------------------------------------------------------------------------------

_VOCAB = len(tiny.VOCAB)

@dataclasses.dataclass
class _Weighted:
    """A method of the user's whose setting is a tensor."""

    w: torch.Tensor
    name = "weighted"
    description = "LogAt"

    def score(self, given):
        return given.logat


ATTACH = cases(
    ("layers=True", {"layers": True}, "layers=True: use 'all', 'last'"),
    ("layers=False", {"layers": False}, "layers=False: use 'all', 'last'"),
    ("layers=1.5", {"layers": 1.5}, "layers=1.5: use"),
    ("layers=[1.0]", {"layers": [1.0]}, "layer 1.0 is not an int"),
    ("layers=None", {"layers": None}, "layers=None: use"),
    ("layers=[None]", {"layers": [None]}, "layer None is not an int"),
    ("layers='middle'", {"layers": "middle"}, "layers='middle': use 'all', 'last'"),
    ("layers=''", {"layers": ""}, "layers='': use 'all', 'last'"),
    ("layers=[]", {"layers": []}, "layers is empty"),
    ("layers=[3]", {"layers": [3]}, r"layer 3 is out of range: this model has 2 blocks, so layers are 0..2"),
    ("layers=[-4]", {"layers": [-4]}, "layer -4 is out of range"),
    ("layers=bytes", {"layers": b"\x01"}, "layers=b'\\\\x01': use"),
    ("layers=dict", {"layers": {0: 1}}, "layers={0: 1}: use"),
    ("layers=set", {"layers": {0, 1}}, "layers={0, 1}: use"),
    ("layers=['0']", {"layers": ["0"]}, "layer '0' is not an int"),
    ("layers=float tensor", {"layers": torch.tensor([0.5])}, "layer 0.5 is not an int"),
    ("layers=float numpy", {"layers": np.array([1.5])}, "layer 1.5 is not an int"),
    ("layers=[True]", {"layers": [True]}, "layer True is not an int"),
    ("target=None", {"target": None}, "target=None: use 'predicted'"),
    ("target=1.5", {"target": 1.5}, "target=1.5: use 'predicted'"),
    ("target=[1.5]", {"target": [1.5]}, "target/label 1.5 must be an int id or a string"),
    ("target=True", {"target": True}, "target=True: use"),
    ("target=[True]", {"target": [True]}, "target/label True must be an int id"),
    ("target=[None]", {"target": [None]}, "target/label None must be an int id"),
    ("target={}", {"target": {}}, r"target=\{\}: use"),
    ("target=bytes", {"target": b"ab"}, "target=b'ab': use"),
    ("target=[]", {"target": []}, "target list is empty"),
    ("target=float tensor", {"target": torch.tensor([1.5])}, "integer label ids, got dtype torch.float32"),
    ("target=bool tensor", {"target": torch.tensor([True])}, "integer label ids, got dtype torch.bool"),
    ("target=3-D tensor", {"target": torch.zeros(1, 1, 1, dtype=torch.long)}, r"got shape \(1, 1, 1\)"),
    ("target=empty tensor", {"target": torch.zeros(0, dtype=torch.long)}, "target tensor is empty"),
    ("target=float numpy", {"target": np.array([2.5])}, "integer label ids, got dtype torch.float64"),
    ("target=vocab size", {"target": _VOCAB}, f"target {_VOCAB} is out of range: the head has {_VOCAB} outputs"),
    ("target=-1", {"target": -1}, "target -1 is out of range"),
    ("target tensor out of range", {"target": torch.tensor([0, 99])}, "target 99 is out of range"),
    # one output named twice: a second, identical column, whose target - foil is 0 at every token (was accepted)
    ("target list naming one output twice", {"target": [5, 5]},
     r"^target list names output 5 twice \(5 and 5\): give different targets \(a target and its foil\)$"),
    ("target token and id of one output", {"target": ["good", tiny.VOCAB.index("good")], "tokenizer": tiny.tokenizer()},
     rf"^target list names output {tiny.VOCAB.index('good')} twice \('good' and {tiny.VOCAB.index('good')}\): give"),
    ("target tensor row naming one output twice", {"target": torch.tensor([[3, 4], [5, 5]])},
     r"^target tensor names output 5 twice in row 1 \(5 and 5\): give different targets"),
    ("target string without tokenizer", {"target": "film"}, r"pass attach\(..., tokenizer=tok\)"),
    ("target empty string", {"target": "", "tokenizer": tiny.tokenizer()},
     r"^target '' is empty: give a word, a token or an id$"),
    # its tokens as every output shows them (a byte-level BPE's pieces read 'ĠParis': tests/oracle/test_readable.py)
    ("target two-token string", {"target": "film was", "tokenizer": tiny.tokenizer()},
     rf"^target 'film was' is 2 tokens \(film was\): attach explains one token; pass one \(here the first, film: id "
     rf"{tiny.VOCAB.index('film')} or its piece 'film'\), or use nxl.explain"),
    ("embedding=None", {"embedding": None}, "embedding=None: use 'layer_input'"),
    ("embedding='words'", {"embedding": "words"}, "embedding='words': use 'layer_input'"),
    ("tokenizer too big", {"tokenizer": tiny.word_tokenizer(tiny.VOCAB + ["x", "y"])}, "does not match the model"),
    # its name, or no tokenizer (a processor): every forward failed on its token texts, raising from probe.result()
    ("tokenizer=hub id", {"tokenizer": "gpt2"}, r"tokenizer='gpt2' is a name, not a tokenizer: pass the tokenizer "
                                                r"object, AutoTokenizer.from_pretrained\('gpt2'\)"),
    ("tokenizer=path", {"tokenizer": Path("models/tok")}, r"tokenizer='models/tok' is a name, not a tokenizer"),
    ("tokenizer=object", {"tokenizer": object()}, r"tokenizer=<object> is not a tokenizer \(it has no len\(\)"),
    ("on_step=3", {"on_step": 3}, "on_step=3: give a function"),
    ("on_step='print'", {"on_step": "print"}, "on_step='print': give a function"),
    # accepted, then each call's records ended at its first step, on the TypeError of calling it
    ("on_step taking nothing", {"on_step": lambda: None},
     r"^on_step=<lambda> cannot be called as on_step\(step\) \(too many positional arguments\): give a function that "
     "takes a Step$"),
    ("on_step taking two", {"on_step": lambda step, call: None},
     r"^on_step=<lambda> cannot be called as on_step\(step\) \(missing a required argument: 'call'\)"),
    ("sink=3", {"sink": 3}, "sink=3: give a file path"),
    ("sink=list", {"sink": ["a"]}, r"sink=\['a'\]: give a file path"),
    ("keep_steps='no'", {"keep_steps": "no"}, r"keep_steps='no': give True \(keep the records"),  # (was kept)
    ("keep_calls=-1", {"keep_calls": -1}, "keep_calls=-1: give a number"),
    ("keep_calls=1.5", {"keep_calls": 1.5}, "keep_calls=1.5: give a whole number"),
    ("keep_calls=True", {"keep_calls": True}, "keep_calls=True: give a whole number"),
    ("keep_calls='2'", {"keep_calls": "2"}, "keep_calls='2': give a whole number"),
    ("cache_dtype=int8", {"cache_dtype": torch.int8}, "cache_dtype=torch.int8: use a floating-point dtype"),
    ("cache_dtype=bool", {"cache_dtype": torch.bool}, "cache_dtype=torch.bool: use a floating-point dtype"),
    ("cache_dtype='float16'", {"cache_dtype": "float16"}, "cache_dtype='float16': use a floating-point dtype"),
    ("cache_dtype=float", {"cache_dtype": float}, "cache_dtype=<class 'float'>: use a floating-point"),
    ("cache_device='nodev'", {"cache_device": "nodev"}, "cache_device='nodev' is not a device"),
    ("cache_device=3.5", {"cache_device": 3.5}, "cache_device=3.5 is not a device"),
    # accepted, then every call not recorded: a CUDA device on a CPU build ("AssertionError: Torch not compiled with
    # CUDA enabled"), the meta device ("attribution method 'normxlogit' returned a tensor on the meta device")
    ("cache_device='meta'", {"cache_device": "meta"}, r"^cache_device='meta' holds no data: use e.g. 'cpu'"),
    *([] if torch.cuda.is_available() else [
        ("cache_device='cuda', no CUDA", {"cache_device": "cuda"},
         r"^cache_device='cuda' cannot hold tensors here \(.*CUDA.*\): use 'cpu' or a device this torch has$")]),
    # a method's settings against the head, at attach (an out-of-range foil failed every forward, or read -1 as the
    # last output)
    ("foil=vocab size", {"methods": [Contrastive(foil=_VOCAB)]},
     rf"Contrastive\(foil={_VOCAB}\) is out of range: the head has {_VOCAB} outputs"),
    # a fixed foil that is the target itself: target − foil was 0 at every token, unsaid (as a target list naming one
    # output twice, refused above); and one row's of a per-row target tensor
    ("foil=target", {"target": 5, "methods": [Contrastive(foil=5)]},
     r"^Contrastive\(foil=5\) is contrasted with itself: output 5 is an explained target, and its gap to itself is 0 "
     r"at every token; give a foil that is not a target, or Contrastive\(\) for the model's best other output$"),
    ("foil=one row's target", {"target": torch.tensor([[3, 4], [6, 5]]), "methods": [Contrastive(foil=5)]},
     r"^Contrastive\(foil=5\) is contrasted with itself: output 5 is an explained target"),
    # two methods of one name (a record holds one score per name): the last took the first's place, unsaid
    ("methods=two foils", {"methods": [Contrastive(foil=3), Contrastive(foil=5)]},
     r"methods= gives two methods named 'contrastive' \(Contrastive\(foil=3\) and Contrastive\(foil=5\)\): a record "
     "holds one score per method name"),
    ("methods=own normxlogit", {"methods": [type("Own", (), {"name": "normxlogit", "description": "zero",
                                                               "score": lambda self, given: given.logat * 0})()]},
     r"methods= gives a method named 'normxlogit' \(Own\): that is the built-in method every record holds"),
    # settings whose repr runs over lines (a tensor's): the message did too, and grew with the tensor
    ("methods=two of tensor settings", {"methods": [_Weighted(torch.ones(40, 40)), _Weighted(torch.zeros(2, 2))]},
     r"^methods= gives two methods named 'weighted' \(_Weighted\(w=tensor\(\[\[1\., 1\., [^\n]{30,60}…"
     r" and _Weighted\(w=tensor\(\[\[0\., 0\.\], \[0\., 0\.\]\]\)\)\): a record holds one score per method "
     r"name; give one of them$"),
)


@pytest.mark.parametrize("foil", [-1, 1.0, True, "3", np.int64(-2)])
def test_a_foil_that_is_no_output_id_is_refused_when_made(foil):
    with pytest.raises(ValueError, match=rf"Contrastive\(foil={re.escape(repr(foil))}\): give an output id"):
        Contrastive(foil=foil)


def test_a_foil_of_a_numpy_integer_is_an_output_id():
    assert Contrastive(foil=np.int64(3)).foil == 3 and type(Contrastive(foil=np.int64(3)).foil) is int


@pytest.mark.parametrize("kwargs, message", ATTACH)
def test_bad_attach_arguments(lm, existing, kwargs, message):
    before = existing.read_bytes()
    with pytest.raises(ValueError, match=message):
        nxl.attach(lm, **kwargs, **({} if "sink" in kwargs else {"sink": existing}))
    assert _hooks(lm) == 0 and "generate" not in vars(lm)
    assert existing.read_bytes() == before  # a refused probe never opens (nor truncates) its sink


CLASSIFIER = cases(
    ("classifier sink", {"sink": "SINK"}, "sink: these record generate\\(\\) steps, but BertForSequenceClassification"),
    ("classifier on_step", {"on_step": print}, "on_step: these record generate\\(\\) steps.*not a causal LM"),
    ("classifier cache_dtype", {"cache_dtype": torch.bfloat16}, "cache_dtype: these record generate"),
    ("classifier cache_device", {"cache_device": "cpu"}, "cache_device: these record generate"),
    ("classifier label name", {"target": "positive"}, "label 'positive' is not one of the model's labels"),
    # a classifier's id is a label: it was told as "target 2 ... the head has 2 outputs", a head's words
    ("classifier label id", {"target": 2},
     r"^label 2 is out of range: this classifier has 2 labels, ids 0..1; give one of them or a label name"),
    ("classifier label -1", {"target": -1}, r"^label -1 is out of range: this classifier has 2 labels, ids 0..1"),
    ("classifier label tensor", {"target": torch.tensor([0, 5])}, r"^label 5 is out of range: this classifier has 2"),
    ("classifier id and label of one output", {"target": [1, "LABEL_1"]},
     r"^target list names output 1 twice \(1 and 'LABEL_1'\): give different targets"),
)


@pytest.mark.parametrize("kwargs, message", CLASSIFIER)
def test_bad_classifier_arguments(bert, existing, kwargs, message):
    before = existing.read_bytes()
    kwargs = {k: existing if v == "SINK" else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        nxl.attach(bert, **kwargs)
    assert _hooks(bert) == 0 and existing.read_bytes() == before


MODELS = cases(
    ("a string", "model", "str has no head-on-top"),
    ("a bare Linear", torch.nn.Linear(2, 2), "Linear has no head-on-top"),
    ("a base model without head", "BASE", "LlamaModel has no head-on-top"),
    # what AutoModelForCausalLM builds for Gemma 3 from 4B on: "attach to a *ForCausalLM" left nothing to do
    ("a vision-language model", "VLM", r"Gemma3ForConditionalGeneration has no head-on-top that nxl_hooks knows: "
     r"NormXLogit explains the head of a decoder-only or encoder text model .* vision-language \(Llava, "
     r"PaliGemma, Qwen2-VL, Gemma 3 from 4B\).* not supported \(docs/supported-models.md\)\.$"),
    ("an encoder-decoder model", "T5", r"T5ForConditionalGeneration has no head-on-top .* encoder-decoder \(T5, "),
    # its class name is a classifier's, but its head reads the decoder (the text shifted right): the line said to
    # register 'bart', and an entry that passes its checks would put each token's score on the one after it
    ("an encoder-decoder classifier", "BART", r"BartForSequenceClassification has no head-on-top .* "
     r"encoder-decoder \(T5, BART"),
    # XLMWithLMHeadModel reads as a causal LM by its name but is a masked LM unless config.causal: registering
    # what the message asks must explain its [MASK] tokens, not its last position
    ("a bidirectional XLM", "XLM", r"'xlm' \(XLMWithLMHeadModel\) is not supported: .* heads=\{'masked_lm': "),
    # a torch module of one's own named like a task model: attach raised AttributeError: 'PlainForCausalLM' object
    # has no attribute 'get_input_embeddings', from deep inside it
    ("a torch module that is no transformers model", "PLAIN", r"^PlainForCausalLM lacks get_input_embeddings and "
     r"base_model, which every transformers model has: .* subclass transformers.PreTrainedModel"),
)


class PlainForCausalLM(torch.nn.Module):
    """A decoder of one's own, with a config and a head, that is no transformers model."""

    def __init__(self):
        import transformers as tf
        super().__init__()
        self.config = tf.LlamaConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8)])
        self.lm_head = torch.nn.Linear(8, 16)


def _unexplained(name: str) -> torch.nn.Module:
    """A tiny model of a class nxl_hooks does not explain."""
    import transformers as tf
    if name == "PLAIN":
        return PlainForCausalLM()
    if name == "XLM":
        return tf.XLMWithLMHeadModel(tf.XLMConfig(vocab_size=16, emb_dim=8, n_layers=1, n_heads=2))
    if name == "BART":
        return tf.BartForSequenceClassification(tf.BartConfig(vocab_size=16, d_model=8, encoder_layers=1,
                                                              decoder_layers=1, encoder_attention_heads=2,
                                                              decoder_attention_heads=2, encoder_ffn_dim=16,
                                                              decoder_ffn_dim=16))
    if name == "T5":
        return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=16, d_model=8, d_ff=16, d_kv=4, num_layers=1,
                                                         num_heads=2))
    text = dict(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=4, layer_types=["sliding_attention", "full_attention"])
    vision = dict(model_type="siglip_vision_model", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    return tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(text_config=text, vision_config=vision, image_token_id=5,
                                                             mm_tokens_per_image=4))


@pytest.mark.parametrize("model, message", MODELS)
def test_models_without_a_head(lm, model, message):
    other = _unexplained(model) if model in ("VLM", "T5", "BART", "XLM", "PLAIN") else None
    with pytest.raises(nxl.UnknownArchitectureError, match=message):
        nxl.attach(lm.model if isinstance(model, str) and model == "BASE" else other or model)
    assert _hooks(lm) == 0 and (other is None or _hooks(other) == 0)


@pytest.mark.parametrize("given", [None, "model-id"])
def test_detach_all_of_no_model_says_what_to_give(given):
    with pytest.raises(ValueError, match=r"detach_all\((NoneType|str)\): give the model a probe was attached to"):
        nxl.detach_all(given)


@pytest.mark.parametrize("size", [0, -1, 2.5, True, "3"])
def test_a_subscription_size_that_is_no_whole_number_of_records_is_refused(lm, size):
    """0 and -1 were refused, but 2.5 held 3 records (its warning said it fell 2 behind), True one, and "3" raised a
    TypeError of the comparison: each is refused in one line; a numpy integer is a fine size."""
    with nxl.attach(lm) as probe:
        with pytest.raises(ValueError, match=rf"^size={re.escape(repr(size))}: give how many records a subscription "
                                             r"may hold \(1 or more\), or None$"):
            probe.subscribe(size=size)
        assert probe.subscribe(size=np.int64(2)).size == 2


@pytest.mark.parametrize("timeout", ["x", -1, float("nan"), True])
def test_a_flush_timeout_that_is_no_number_of_seconds_is_refused(lm, timeout):
    """"x" raised a TypeError from deep in threading, and -1 returned False, as if the sink were behind: each is
    refused in one line; None (however long it takes) and a numpy number are fine."""
    with nxl.attach(lm) as probe:
        with pytest.raises(ValueError, match=rf"^timeout={re.escape(repr(timeout))}: give the seconds to wait"):
            probe.flush(timeout)
        lm.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=1, do_sample=False)
        assert probe.flush(None) and probe.flush(np.float64(5)) and len(probe.steps) == 1
        assert probe.flush(float("inf")) and probe.flush(1e12)  # (they overflowed threading's clock)


def test_whole_numbers_and_numbers_are_read_by_one_rule():
    """The seed, the flush timeout, a foil and a layer each kept its own copy of what is a whole number or a number;
    one rule (arch.values) reads them all: numpy numbers are what they stand for, a bool is neither."""
    from nxl_hooks.arch.values import integer, real

    assert integer(np.int64(3)) == 3 and type(integer(np.int64(3))) is int and integer(-2) == -2
    assert [integer(v) for v in (True, np.True_, 1.0, np.float64(2), "1", None, [1])] == [None] * 7
    assert real(np.float32(0.5)) == 0.5 and real(2) == 2.0 and type(real(np.int64(2))) is float
    assert [real(v) for v in (True, np.True_, "1", None, 1j)] == [None] * 5


def test_a_numpy_bool_is_a_fine_keep_steps(lm):
    with nxl.attach(lm, keep_steps=np.False_) as probe:
        lm.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=1, do_sample=False)
    assert [len(call.steps) for call in probe.calls] == [0]  # its step streamed only (to nobody), not kept


def test_numpy_integers_are_fine_layers_and_targets(lm):
    """The other side of the catalogue: numpy ints and int arrays mean what Python ints and id tensors mean."""
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        out = lm(input_ids=ids, output_hidden_states=True)
        logits = oracle.llama(lm).layer_logits(out.hidden_states)
    for layers, target, per_row in (([np.int64(0), np.int32(-1)], np.int64(7), [7, 7]),
                                    (np.array([0, 2]), np.array([3, 11]), [3, 11])):
        with torch.no_grad(), nxl.attach(lm, layers=layers, target=target) as probe:
            lm(input_ids=ids)
        res = probe.result()
        assert res.layers == [0, 2] and res.target.tolist() == per_row
        expected = oracle.normxlogit(logits, out.hidden_states[0], torch.tensor(per_row))[1]
        torch.testing.assert_close(res.normxlogit, expected[[0, 2]], rtol=1e-4, atol=1e-5)


def test_masked_lm_without_tokenizer_and_attach_twice(lm, existing):
    from transformers import BertConfig, BertForMaskedLM

    mlm = BertForMaskedLM(BertConfig(vocab_size=_VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)).eval()
    with pytest.raises(ValueError, match="masked-LM attribution needs attach"):
        nxl.attach(mlm)
    before = existing.read_bytes()
    with nxl.attach(lm):
        with pytest.raises(RuntimeError, match="already attached"):
            nxl.attach(lm, sink=existing)
        assert existing.read_bytes() == before
    assert _hooks(lm) == 0


# -- what a method returns: refused naming the method ---------------------------------------------------------

# a tensor of the right shape with no dense data failed later, in the record, as a NotImplementedError naming nothing
METHOD_RETURNS = cases(
    ("method returns a meta tensor", lambda given: torch.empty(given.logat.shape, device="meta"),
     r"^attribution method 'test_returns' returned a tensor on the meta device \(shape \(3, 1, 5, 1\), no data\): "
     r"expected float scores shaped like logat \(3, 1, 5, 1\), a dense tensor with data$"),
    ("method returns a sparse tensor", lambda given: given.logat.to_sparse(),
     r"^attribution method 'test_returns' returned a torch.sparse_coo tensor: expected float scores"),
    ("method returns integer scores", lambda given: given.logat.long(),  # of the right shape: said only its shape
     r"^attribution method 'test_returns' returned int64 \(3, 1, 5, 1\): expected float scores shaped like logat"),
)


@pytest.mark.parametrize("make, message", METHOD_RETURNS)
def test_a_method_returning_scores_without_data_is_refused_naming_it(lm, make, message):
    returns = type("Returns", (), {"name": "test_returns", "description": "no dense scores",
                                   "score": lambda self, given: make(given)})()
    with pytest.raises(ValueError, match=message):
        nxl.explain(lm, tiny.tokenizer(), "the film was", methods=[returns])  # 5 tokens with [CLS], [SEP]
    assert _hooks(lm) == 0


# -- what a forward cannot explain: said by result(), never raised into the forward -----------------------

FORWARDS = cases(
    ("empty input", "lm", {"input_ids": torch.zeros(1, 0, dtype=torch.long)}, "empty input"),
    ("zero mask row (LM)", "lm", {"input_ids": torch.tensor([[5, 6, 7], [5, 6, 7]]),
                                  "attention_mask": torch.tensor([[1, 1, 1], [0, 0, 0]])}, "row 1 has no real token"),
    ("zero mask row (encoder)", "bert", {"input_ids": torch.tensor([[2, 6, 3], [2, 6, 3]]),
                                         "attention_mask": torch.tensor([[1, 1, 1], [0, 0, 0]])},
     "row 1 has no real token"),
    ("zero mask, one row", "lm", {"input_ids": torch.tensor([[5, 6]]), "attention_mask": torch.tensor([[0, 0]])},
     "row 0 has no real token"),
)


@pytest.mark.parametrize("which, inputs, message", FORWARDS)
def test_forwards_that_cannot_be_explained(lm, bert, which, inputs, message):
    model = lm if which == "lm" else bert
    try:
        plain = model(**inputs).logits
    except Exception as error:  # whatever the model does itself, attached or not
        plain = type(error)
    with nxl.attach(model) as probe:
        try:
            attached = model(**inputs).logits
        except Exception as error:
            attached = type(error)
        with pytest.raises(ValueError, match=message):
            probe.result()
    assert attached is plain if isinstance(plain, type) else torch.equal(attached, plain)
    assert _hooks(model) == 0


@pytest.mark.parametrize("empty", [[1, 3], [0, 1, 2, 4, 5], [0, 1, 2, 4, 5, 6, 7]])
def test_every_row_without_a_real_token_is_named_in_the_one_line_five_then_counted(lm, empty):
    """Several rows whose attention mask is all zeros: result()'s one line names each (as the mask has them), the
    first five by number and the rest counted, not only the first."""
    ids, mask = torch.full((8, 3), 5), torch.ones(8, 3, dtype=torch.long)
    mask[empty] = 0
    rows = [row for row in range(8) if not mask[row].any()]
    named = ", ".join(map(str, rows[:5])) + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")
    with nxl.attach(lm) as probe:
        lm(input_ids=ids, attention_mask=mask)
        with pytest.raises(ValueError, match=rf"^rows {named} have no real token \(their attention mask is all zeros, "
                                             r"or they are all padding\): there is no prediction to explain"):
            probe.result()
    assert _hooks(lm) == 0

def test_a_generate_row_of_padding_alone_is_noted_on_its_call_once(lm, caplog):
    """A generate batch with a row whose attention mask is all zeros was recorded without a word (its steps' masks
    all False at the prompt), where a plain forward's result() refuses such a row: the call's notes name it, once,
    by the forward's rule; a batch without one has no note, and generate's own output is unchanged."""
    ids, mask = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7]]), torch.tensor([[1, 1, 1], [0, 0, 0], [0, 1, 1]])
    given = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    plain = lm.generate(input_ids=ids, attention_mask=mask, **given)
    with nxl.attach(lm) as probe:
        assert torch.equal(lm.generate(input_ids=ids, attention_mask=mask, **given), plain)
        (call,) = probe.calls
        lm(input_ids=ids, attention_mask=mask)
        with pytest.raises(ValueError, match=r"^row 1 has no real token"):
            probe.result()
        lm.generate(input_ids=ids[[0, 2]], attention_mask=mask[[0, 2]], **given)
        assert probe.calls[-1].notes == []
    assert [note.split(":")[0] for note in call.notes] == [
        "row 1 has no real token (its attention mask is all zeros, or it is all padding)"]
    assert call.complete and not call.steps[0].mask[1].any() and call.steps[0].mask[2].tolist() == [False, True, True]
    assert caplog.text.count("generate's tokens for it follow no prompt") == 1  # (said once, in the log too)
    assert _hooks(lm) == 0


def test_explain_of_no_tokens_says_so_before_the_forward(caplog):
    """A tokenizer that adds no special token makes no token of "": explain raises nxl's line, not the model's own
    error on a zero-length input (a reshape), and runs no forward."""
    tok = bpe_tiny.bpe_tokenizer()
    model = bpe_tiny.bpe_llama(tok)
    assert tok("")["input_ids"] == []
    with pytest.raises(ValueError, match=r"^empty input: nxl_hooks needs at least one token per row"):
        nxl.explain(model, tok, "")
    assert _hooks(model) == 0 and "not recorded" not in caplog.text
    for text in ([], ["good", 3], 3):  # no text at all, or one that is no string: nxl's line, not the tokenizer's
        with pytest.raises(ValueError, match=r"^text is .*: give a string, or a non-empty list of strings"):
            nxl.explain(model, tok, text)
    for given, message in (("gpt2", r"^tokenizer='gpt2' is a name, not a tokenizer: pass the tokenizer object"),
                           (None, r"^tokenizer=None is not a tokenizer")):  # before the forward, whose texts need one
        with pytest.raises(ValueError, match=message):
            nxl.explain(model, given, "good")
    assert _hooks(model) == 0


@pytest.mark.parametrize("model, text, options, message", cases(
    ("text_pair not text", "bert", "good", {"text_pair": 3}, r"^text_pair is 3: give a string, or a list of strings"),
    ("text_pair count", "bert", ["good", "bad"], {"text_pair": ["the film"]},
     r"^text_pair gives 1 second texts for 2 texts: give one per text"),
    ("text_pair on a LM", "llama", "good", {"text_pair": "bad"},
     r"^text_pair is a classifier's second text, and this model is a causal_lm model, which reads one text: join"),
    ("text_pair with chat", "bert", "good", {"text_pair": "bad", "chat": True},
     r"^text_pair with chat=True: the chat template takes one message per text; give one of them"),
))
def test_explain_refuses_a_text_pair_it_cannot_encode_before_the_forward(lm, bert, model, text, options, message):
    """A sentence pair is a classifier's: one second text per text, no chat template; said before the forward."""
    model = {"bert": bert, "llama": lm}[model]
    with pytest.raises(ValueError, match=message):
        nxl.explain(model, tiny.tokenizer(), text, **options)
    assert _hooks(model) == 0


def test_explain_refuses_a_target_list_naming_one_output_twice_before_the_forward():
    """Two targets read as one output (a word and its token, a word with and without its space) are refused with the
    targets as written, before the model runs: contrastive's target - foil of an output with itself was 0 at every
    token, silently. Where the words read apart after one text, the line names the row where they do not."""
    tok = bpe_tiny.bpe_tokenizer()
    model = bpe_tiny.bpe_llama(tok)
    forwards = []
    handle = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    text, paris = "The capital of France is", tok.convert_tokens_to_ids("ĠParis")
    for target, twice in ((["Paris", " Paris"], "'Paris' and ' Paris'"), (["Paris", "ĠParis"], "'Paris' and 'ĠParis'"),
                          (["Paris", "London", paris], f"'Paris' and {paris}")):
        with pytest.raises(ValueError, match=rf"^target list names output {paris} twice \({twice}\): give different "
                                             r"targets \(a target and its foil\)$"):
            nxl.explain(model, tok, text, target=target, methods=["contrastive"])
    # after "is " the word is 'Paris' and ' Paris' another token: only the first text's row names one output twice
    with pytest.raises(ValueError, match=rf"^target list names output {paris} twice in row 0 \('Paris' and ' Paris'"):
        nxl.explain(model, tok, [text, text + " "], target=["Paris", " Paris"])
    handle.remove()
    assert not forwards and _hooks(model) == 0


def test_per_row_target_tensor_with_the_wrong_row_count(lm):
    with nxl.attach(lm, target=torch.tensor([3, 4, 5])) as probe:
        lm(input_ids=torch.tensor([[5, 6], [7, 8]]))
        with pytest.raises(ValueError, match="target tensor has 3 rows but this forward explains 2 rows"):
            probe.result()


# -- methods of a result ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def result(lm):
    return nxl.explain(lm, tiny.tokenizer(), ["the film was good", "bad plot"], layers=[0, 2])


RESULT_CALLS = cases(
    ("top row 2", lambda r: r.top(row=2), "row 2 is out of range: this attribution has 2 row"),
    ("top row -1", lambda r: r.top(row=-1), "row -1 is out of range"),
    ("top row 1.0", lambda r: r.top(row=1.0), "row 1.0 is out of range"),
    ("top row tensor", lambda r: r.top(row=torch.tensor(0)), r"row tensor\(0\) is out of range"),  # as label=
    ("top k -1", lambda r: r.top(-1), "k=-1: give how many tokens top.. returns, an int of 0 or more"),
    ("top k 2.0", lambda r: r.top(2.0), "k=2.0: give how many tokens"),
    ("top k True", lambda r: r.top(True), "k=True: give how many tokens"),  # a bool is no count, as row= and label=
    ("top label 1", lambda r: r.top(label=1), "label 1 is out of range: this attribution explains 1 target"),
    ("top layer 1", lambda r: r.top(layer=1), r"layer 1 was not captured; captured layers: \[0, 2\]"),
    ("top layer 'x'", lambda r: r.top(layer="x"), "layer 'x' is not an int"),
    ("layer 3", lambda r: r.layer(3), "layer 3 is out of range"),
    # each of a result's per-row methods, as top(): an IndexError, or another row read for row -1
    ("rankable row 2", lambda r: r.rankable(2), "row 2 is out of range: this attribution has 2 row"),
    ("token_labels row -1", lambda r: r.token_labels(-1), "row -1 is out of range"),
    ("target_info row 2", lambda r: r.target_info(2), "row 2 is out of range"),
    ("target_label label 1", lambda r: r.target_label(0, 1), "label 1 is out of range: this attribution explains 1"),
    ("norm_spread row 2", lambda r: r.norm_spread(2), "row 2 is out of range"),
    ("to_html rows", lambda r: r.to_html(rows=[5]), r"rows \[5\] out of range"),
    ("to_html label 1", lambda r: r.to_html(label=1), "label 1 is out of range: this attribution explains 1 target"),
    ("to_html label -1", lambda r: r.to_html(label=-1), "label -1 is out of range"),
    ("to_html method", lambda r: r.to_html(method="gradient"), "method='gradient': use 'normxlogit' or 'logat'"),
)


@pytest.mark.parametrize("call, message", RESULT_CALLS)
def test_bad_result_calls(result, call, message):
    with pytest.raises(ValueError, match=message):
        call(result)


def test_a_generation_page_of_a_target_not_explained(lm):
    from nxl_hooks.records.html import generation_html

    with torch.no_grad(), nxl.attach(lm, target=[3, 4]) as probe:
        lm.generate(torch.tensor([[1, 5, 7]]), max_new_tokens=1, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match="label 2 is out of range: this call explains 2 target"):
        generation_html(probe.calls[-1], label=2)


def test_top_ranks_each_rows_own_tokens(result):
    """Row 1 ("[CLS] bad plot [SEP]" and two pads): only its two words rank, by its own scores; named by a numpy
    integer too, as layer= and label= may be."""
    scores = result.normxlogit[-1, 1]
    expected = sorted((1, 2), key=lambda i: -float(scores[i]))
    assert [p for p, _, _ in result.top(5, row=1)] == expected
    assert [p for p, _, _ in result.top(5, row=np.int64(1), layer=np.int64(-1), label=np.int32(0))] == expected
    assert [name for _, name, _ in result.top(5, row=1)] == [result.tokens[1][i] for i in expected]
    everything = [p for p, _, _ in result.top(9, row=1, all_positions=True)]
    assert sorted(everything) == [0, 1, 2, 3]


def test_several_targets_round_trip(lm, tmp_path):
    res = nxl.explain(lm, tiny.tokenizer(), ["the film was good", "bad plot"], layers=[0, 2], target=["good", "bad"])
    back = nxl.Attribution.load(res.save(tmp_path / "k.safetensors"))
    ids = [tiny.VOCAB.index("good"), tiny.VOCAB.index("bad")]
    assert back.normxlogit.shape == (2, 2, 6, 2) and back.target.tolist() == [ids, ids]
    assert back.top(2, row=1, label=1) == res.top(2, row=1, label=1)


def test_nan_scores_rank_last(result):
    res = nxl.Attribution(**{**vars(result), "normxlogit": result.normxlogit.clone()})
    res.normxlogit[-1, 0, 1] = float("nan")  # "the"
    top = res.top(10, row=0)
    assert [p for p, _, _ in top][-1] == 1 and all(s == s for _, _, s in top[:-1])


# -- Attribution files -----------------------------------------------------------------------------------


def _parts(result) -> tuple[dict, dict]:
    tensors = {name: getattr(result, name).clone() for name in
               ("normxlogit", "logat", "embed_norm", "target", "mask", "position", "example", "special")}
    header = {"format": "nxl_hooks.attribution", "version": 1, "layers": list(result.layers),
              "tokens": [list(t) for t in result.tokens], "meta": dict(result.meta),
              "readable": [list(t) for t in result.readable], "target_text": [list(t) for t in result.target_text]}
    return tensors, header


def _edit(**changes):
    def apply(tensors: dict, header: dict) -> None:
        for key, value in changes.items():
            if key in header or key in ("layers", "tokens", "meta", "version", "format"):
                header[key] = value(header[key]) if callable(value) else value
            elif value is None:
                tensors.pop(key)
            else:
                tensors[key] = value(tensors[key])
    return apply


def _meta(**entries):
    return _edit(meta=lambda meta: {**meta, **entries})


CRAFTED = cases(
    *[(f"missing {name}", _edit(**{name: None}), f"tensor '{name}' is missing") for name in
      ("normxlogit", "logat", "embed_norm", "target", "mask", "position", "example")],
    ("normxlogit 2-D", _edit(normxlogit=lambda t: t[0], logat=lambda t: t[0]), r"normxlogit has shape \(2, 6\)"),
    ("normxlogit int", _edit(normxlogit=lambda t: t.long()), "normxlogit has dtype torch.int64, not a float"),
    ("normxlogit 0 rows", _edit(normxlogit=lambda t: t[:, :0], logat=lambda t: t[:, :0]), "none of them 0"),
    ("logat shape", _edit(logat=lambda t: t[:1]), r"logat has shape \(1, 2, 6\) but normxlogit \(2, 2, 6\)"),
    ("logat int", _edit(logat=lambda t: t.int()), "logat has dtype torch.int32"),
    ("embed_norm shape", _edit(embed_norm=lambda t: t[:, :3]), r"embed_norm has shape \(2, 3\), expected \(2, 6\)"),
    ("embed_norm bool", _edit(embed_norm=lambda t: t > 0), "embed_norm has dtype torch.bool"),
    ("mask float", _edit(mask=lambda t: t.float()), "mask has dtype torch.float32, not torch.bool"),
    ("mask shape", _edit(mask=lambda t: t[:, :2]), r"mask has shape \(2, 2\)"),
    ("target float", _edit(target=lambda t: t.float()), "target has dtype torch.float32, not an integer"),
    ("target rows", _edit(target=lambda t: t[:1]), r"target has shape \(1,\), expected \(2,\)"),
    ("target k axis", _edit(target=lambda t: t[:, None]), r"target has shape \(2, 1\), expected \(2,\)"),
    ("target negative", _edit(target=lambda t: t - 100), "target holds negative label ids"),
    ("position = seq", _edit(position=lambda t: t * 0 + 6), r"position is outside 0..5"),
    ("position negative", _edit(position=lambda t: t * 0 - 1), r"position is outside 0..5"),
    ("position float", _edit(position=lambda t: t.float()), "position has dtype torch.float32"),
    ("position bool", _edit(position=lambda t: t > 0), "position has dtype torch.bool"),
    ("example negative", _edit(example=lambda t: t - 5), "example holds negative row numbers"),
    ("example 2-D", _edit(example=lambda t: t[:, None]), r"example has shape \(2, 1\)"),
    ("special float", _edit(special=lambda t: t.float()), "special must be a bool tensor"),
    ("special shape", _edit(special=lambda t: t[:1]), "special must be a bool tensor of shape"),
    ("layers missing", _edit(layers=None), "layers is None: expected a list of 2 ints"),
    ("layers too short", _edit(layers=[0]), r"layers is \[0\]: expected a list of 2 ints"),
    ("layers unsorted", _edit(layers=[2, 0]), r"layers \[2, 0\] must be distinct, increasing"),
    ("layers repeated", _edit(layers=[2, 2]), r"layers \[2, 2\] must be distinct"),
    ("layers negative", _edit(layers=[-1, 2]), r"must be distinct, increasing and in 0..2"),
    ("layers beyond L", _edit(layers=[0, 7]), r"layers \[0, 7\] must be .* in 0..2"),
    ("layers bools", _edit(layers=[False, True]), "expected a list of 2 ints"),
    ("layers strings", _edit(layers=["0", "2"]), "expected a list of 2 ints"),
    ("tokens row count", _edit(tokens=lambda t: t[:1]), "tokens must be 2 list"),
    ("tokens length", _edit(tokens=lambda t: [row[:3] for row in t]), "tokens must be 2 list.*of 6 token strings"),
    ("tokens not strings", _edit(tokens=lambda t: [[1] * 6 for _ in t]), "tokens must be"),
    ("tokens a string", _edit(tokens="the film"), "tokens must be"),
    ("meta a list", _edit(meta=[1, 2]), "meta is a list, not a JSON object"),
    ("meta head_kind int", _meta(head_kind=3), "meta\\['head_kind'\\] is 3, not a str"),
    ("meta model_class list", _meta(model_class=["x"]), "meta\\['model_class'\\]"),
    ("meta n_blocks str", _meta(n_blocks="2"), "meta\\['n_blocks'\\] is '2', not a int"),
    ("meta n_blocks bool", _meta(n_blocks=True), "meta\\['n_blocks'\\] is True"),
    ("meta n_blocks negative", _meta(n_blocks=-3), "a negative block count"),
    ("meta prediction", _meta(prediction=[1.0, 2.0]), "meta\\['prediction'\\] must be one list of numbers per row"),
    ("meta prediction strings", _meta(prediction=[["a"], ["b"]]), "meta\\['prediction'\\] must be"),
    ("meta targets without request", _meta(targets=[[{"id": 1, "text": "good", "how": "id", "tokens": [1],
                                                      "texts": ["good"], "note": None}]]), "meta\\['targets'\\] must be"),
    ("meta targets too many", _meta(targets=[[{"request": "good", "id": 1, "text": "good", "how": "word",
                                               "tokens": [1], "texts": ["good"], "note": None}] * 2]),
     "meta\\['targets'\\] must be 2 list\\(s\\) \\(or one\\) of 1 objects"),
    ("meta targets a number", _meta(targets=5), "meta\\['targets'\\] must be 2 list"),
    ("meta targets 3 rows", _meta(targets=[[{}]] * 3), "meta\\['targets'\\] must be 2 list"),
    ("meta targets 2 per row", _meta(targets=[[{}, {}]]), "meta\\['targets'\\] must be .* of 1 objects"),
    ("meta targets not records", _meta(targets=[[1], [2]]), "meta\\['targets'\\] must be .* objects with the keys"),
    ("meta targets note int", _meta(targets=[[{"request": "good", "id": 1, "text": "good", "how": "word", "tokens": [1], "texts": ["good"], "note": 5}]]), "meta\\['targets'\\] must be"),
    # what the terminal and pages print as it is: raw escape sequences (an OSC 52 clipboard write, a window title)
    # and lone surrogates (to_html(path) failed to encode them) are no readable text
    ("readable escape", _edit(readable=lambda rows: [["\x1b]52;c;eA==\x07", *row[1:]] for row in rows]),
     r"readable holds '\\x1b\]52;c;eA==\\x07': a control or format character or a lone surrogate"),
    ("readable surrogate", _edit(readable=lambda rows: [[*row[:2], "fi\udc80lm", *row[3:]] for row in rows]),
     r"readable holds 'fi\\udc80lm'"),
    ("target_text bidi", _edit(target_text=lambda rows: [["\u202egood"] for _ in rows]),
     r"target_text holds '\\u202egood'"),
    ("meta model_class escape", _meta(model_class="Bert\x1b]0;title\x07"),
     r"meta holds 'Bert\\x1b\]0;title\\x07'"),
    ("meta targets note escape", _meta(targets=[[{"request": "good", "id": 1, "text": "good", "how": "word",
                                                  "tokens": [1], "texts": ["good"], "note": "\x1b[2J"}]]),
     r"meta\['targets'\] holds '\\x1b\[2J'"),
    ("format other", _edit(format="something.else"), "is not an attribution header"),
    ("version 99", _edit(version=99), "format version 99; upgrade nxl_hooks"),
    ("version string", _edit(version="1"), "format version '1' is not an int"),
)


@pytest.mark.parametrize("mutate, message", CRAFTED)
def test_crafted_attribution_files(result, tmp_path, mutate, message):
    tensors, header = _parts(result)
    mutate(tensors, header)
    path = tmp_path / "a.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"nxl_hooks": json.dumps(header)})
    before = path.read_bytes()
    with pytest.raises(RecordError, match=f"{re.escape(str(path))}: .*{message}"):
        nxl.Attribution.load(path)
    assert path.read_bytes() == before


def _valid_bytes(result, tmp_path) -> bytes:
    return result.save(tmp_path / "valid.safetensors").read_bytes()


def _with_header(good: bytes, change) -> bytes:
    """``good`` (an attribution file's bytes) with its safetensors header changed by ``change`` (a dict to a dict)."""
    (size,) = struct.unpack_from("<Q", good)
    header = json.dumps(change(json.loads(good[8: 8 + size]))).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + good[8 + size:]


RAW = cases(
    ("empty file", lambda good: b"", "is not a safetensors file nxl_hooks can read"),
    ("seven bytes", lambda good: b"1234567", "is not a safetensors file"),
    ("junk", lambda good: os.urandom(64), "is not a safetensors file"),
    ("huge header size", lambda good: struct.pack("<Q", 2**60) + good[8:], "is not a safetensors file"),
    ("truncated data", lambda good: good[:-10], "is not a safetensors file"),
    ("truncated header", lambda good: good[:40], "is not a safetensors file"),
    ("header not JSON", lambda good: good[:8] + b"\x00" * (len(good) - 8), "is not a safetensors file"),
    ("no nxl_hooks metadata", lambda good: save_blob({"x": torch.zeros(1)}), "not an nxl_hooks attribution file"),
    ("metadata not JSON", lambda good: save_blob({"x": torch.zeros(1)}, metadata={"nxl_hooks": "{oops"}),
     "'nxl_hooks' metadata is not valid JSON"),
    ("metadata too deep", lambda good: save_blob({"x": torch.zeros(1)}, metadata={"nxl_hooks": "[" * 100000}),
     "'nxl_hooks' metadata is not valid JSON"),
    ("metadata a list", lambda good: save_blob({"x": torch.zeros(1)}, metadata={"nxl_hooks": "[1]"}),
     "is not an attribution header"),
    # (safetensors' save never writes these; its load refused them, which nxl_hooks' own reading of the header
    # skipped: "string indices must be integers")
    ("__metadata__ a string", lambda good: _with_header(good, lambda header: {**header, "__metadata__": "nxl_hooks"}),
     r"is not a safetensors file nxl_hooks can read \(ValueError: not a safetensors blob: its __metadata__ is not a "
     r"map of strings\)"),
    ("__metadata__ of a JSON object", lambda good: _with_header(good, lambda header: {
        **header, "__metadata__": {"nxl_hooks": json.loads(header["__metadata__"]["nxl_hooks"])}}),
     "its __metadata__ is not a map of strings"),
)


@pytest.mark.parametrize("make, message", RAW)
def test_files_that_are_not_attributions(result, tmp_path, make, message):
    path = tmp_path / "a.safetensors"
    path.write_bytes(make(_valid_bytes(result, tmp_path)))
    with pytest.raises(RecordError, match=message):
        nxl.Attribution.load(path)


def test_a_stream_file_given_to_load_says_to_read_it_as_a_stream(stream_bytes, tmp_path):
    # `nxl attribute --generate 4 --out a.safetensors` writes a stream file: load's line said "truncated"
    path = tmp_path / "a.safetensors"
    path.write_bytes(stream_bytes)
    with pytest.raises(RecordError, match=r"^\S*a.safetensors is a stream file of generate step records .*: read it "
                                          r"with nxl.read_stream\(path\)$"):
        nxl.Attribution.load(path)
    assert len(nxl.read_stream(path)[0].steps) == 4  # the 4 tokens generated: what the line points to reads it


def test_a_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.safetensors"):
        nxl.Attribution.load(tmp_path / "nothing.safetensors")


@pytest.mark.parametrize("row, label, message", [(5, 0, "row 5 is out of range"), (-1, 0, "row -1 is out of range"),
                                                (0, 1, "label 1 is out of range")])
def test_a_resolution_out_of_range_is_refused(lm, row, label, message):
    # (a row past the end read the last one's, a negative row or label another's)
    res = nxl.explain(lm, tiny.tokenizer(), ["the film was", "a movie is"], target="good")
    assert res.resolution(0, 0)["request"] == "good"
    with pytest.raises(ValueError, match=message):
        res.resolution(row, label)


def test_a_file_descriptor_is_no_path(result, tmp_path):
    # os.stat takes an int as a descriptor: the file open under that number was looked at, then os.open failed
    path = result.save(tmp_path / "a.safetensors")
    with path.open("rb") as opened, pytest.raises(RecordError, match=rf"^{opened.fileno()} is not a file path: "):
        nxl.Attribution.load(opened.fileno())


def test_failed_saves_leave_the_existing_file(result, tmp_path, monkeypatch):
    path = result.save(tmp_path / "a.safetensors")
    before = path.read_bytes()
    bad = nxl.Attribution(**{**vars(result), "meta": {**result.meta, "x": object()}})
    with pytest.raises(TypeError, match="not JSON serializable"):
        bad.save(path)

    class FullDisk:  # the os module, but the final rename fails
        def __getattr__(self, name):
            return getattr(os, name)

        def replace(self, src, dst):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "os", FullDisk())
    with pytest.raises(OSError, match="No space left"):
        result.save(path)
    with pytest.raises(OSError, match="No space left"):
        result.to_html(path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]


def test_a_result_never_replaces_what_is_no_regular_file(result, tmp_path):
    """A save onto a FIFO, a device or a symbolic link would put a file in its place (as root, ``/dev/null``)."""
    fifo, link, target = tmp_path / "fifo", tmp_path / "link", tmp_path / "target.html"
    os.mkfifo(fifo)
    target.write_text("precious")
    link.symlink_to(target)
    with pytest.raises(ValueError, match=r"fifo is a FIFO \(named pipe\), not a regular file: .*give another path"):
        result.save(fifo)
    with pytest.raises(ValueError, match=r"link is a symbolic link, not a regular file"):
        result.to_html(link)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink() and target.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link", "target.html"]  # no temporary file left


# -- stream files ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stream_bytes(lm, tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("stream") / "run.nxl"
    lm.generation_config.eos_token_id = None
    ids = torch.tensor([[5, 6, 7, 8]])
    with nxl.attach(lm, sink=path):
        lm.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return path.read_bytes()


def _offsets(data: bytes) -> list[int]:
    return [offset for _, offset, _, _ in reader._frames(data)]


def _flip(frame: int, where: int):
    """One bit flipped ``where`` bytes into a frame (negative: from the frame's end)."""
    def make(data: bytes) -> bytes:
        offsets = [*_offsets(data), len(data)]
        out = bytearray(data)
        out[(offsets[frame] if where >= 0 else offsets[frame + 1]) + where] ^= 0x10
        return bytes(out)
    return make


def _length(frame: int, delta: int):
    """A frame's announced payload length changed by ``delta``."""
    def make(data: bytes) -> bytes:
        offset = _offsets(data)[frame]
        magic, length, crc = writer._FRAME.unpack_from(data, offset)
        return data[:offset] + writer._FRAME.pack(magic, length + delta, crc) + data[offset + writer._FRAME.size:]
    return make


def _cut_out(frame: int, size: int):
    def make(data: bytes) -> bytes:
        start = _offsets(data)[frame] + 40
        return data[:start] + data[start + size:]
    return make


def _insert(frame: int, junk: bytes):
    def make(data: bytes) -> bytes:
        start = _offsets(data)[frame]
        return data[:start] + junk + data[start:]
    return make


# frames: 0 = call, 1..4 = steps, 5 = end
DAMAGED = cases(
    ("call frame payload", _flip(0, 100), 0, "checksum"),
    ("step payload byte", _flip(2, 300), 2, "checksum"),
    ("step tensor data", _flip(3, -20), 3, "checksum"),
    ("step tensor last byte", _flip(4, -1), 4, "checksum"),
    ("end frame payload", _flip(5, 30), 5, "checksum"),
    ("frame marker", _flip(2, 0), 2, "no frame marker"),
    ("length grown past the end", _length(2, 10**6), 2, "announces"),
    ("length grown", _length(2, 7), 2, "checksum"),
    ("length shrunk", _length(2, -7), 2, "checksum"),
    ("checksum field", _flip(3, 13), 3, "checksum"),
    ("bytes cut out", _cut_out(1, 10), 1, "announces|checksum"),
    ("junk between frames", _insert(3, b"garbage!"), 3, "no frame marker"),
    ("zeros between frames", _insert(2, b"\x00" * 32), 2, "no frame marker"),
    ("a frame marker alone", _insert(4, b"NXLF"), 4, "announces|checksum"),
)


@pytest.mark.parametrize("make, frame, reason", DAMAGED)
def test_damaged_streams_warn_or_raise_and_say_where(stream_bytes, tmp_path, make, frame, reason):
    path = tmp_path / "run.nxl"
    path.write_bytes(make(stream_bytes))
    offset = _offsets(path.read_bytes())[frame] if frame < len(_offsets(path.read_bytes())) else None
    with pytest.raises(reader.StreamError, match=f"damaged: frame {frame} at byte {offset}: .*({reason})"):
        nxl.read_stream(path, strict=True)
    with pytest.warns(reader.StreamDamageWarning, match=f"frame {frame} at byte"):
        calls = nxl.read_stream(path)
    assert calls.damage.frame == frame and not calls.damage.torn
    assert calls.damage.steps_recovered == max(0, min(frame - 1, 4)) == sum(len(c.steps) for c in calls)


@pytest.mark.parametrize("cut", cases(*[(f"torn {n} bytes", n) for n in (1, 3, 10, 17, 60, 200)],
                                     *[(f"a new frame's first {n} bytes", -n) for n in (1, 3, 4, 15)]))
def test_a_torn_last_frame_is_quiet(stream_bytes, tmp_path, cut):
    path = tmp_path / "run.nxl"
    last = _offsets(stream_bytes)[-1]
    if cut < 0:  # the writer was killed right as it began the frame after the end frame
        last = len(stream_bytes)
        stream_bytes += (writer._FRAME_MAGIC + bytes(12))[:-cut]
    path.write_bytes(stream_bytes[: max(last + 1, len(stream_bytes) - max(cut, 0))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        (call,) = nxl.read_stream(path, strict=True)
        calls = nxl.read_stream(path)
    assert len(call.steps) == 4 and call.complete == (cut < 0)
    assert calls.damage.torn and calls.damage.frame == (6 if cut < 0 else 5) and calls.damage.offset == last


def _frame(payload: bytes) -> bytes:
    return writer._FRAME.pack(writer._FRAME_MAGIC, len(payload), zlib.crc32(payload)) + payload


def _record(tensors: dict, header) -> bytes:
    return save_blob({k: v.contiguous() for k, v in tensors.items()},
                     metadata={"nxl_hooks": header if isinstance(header, str) else json.dumps(header)})


def _step(**changes) -> bytes:
    tensors = {"token": torch.tensor([9]), "target": torch.tensor([9]), "normxlogit": torch.zeros(3, 1, 4),
               "logat": torch.zeros(3, 1, 4), "embed_norm": torch.ones(1, 4), "mask": torch.ones(1, 4, dtype=torch.bool),
               "active": torch.tensor([True])}
    header = {"kind": "step", "call": 0, "step": 0, "position": 4, "layers": [0, 1, 2], "n_blocks": 2}
    for key, value in changes.items():
        if key in header:
            header[key] = value
        elif value is None:
            tensors.pop(key)
        else:
            tensors[key] = value
    return _record(tensors, header)


CRAFTED_FRAMES = cases(
    ("not safetensors", b"hello world", "not a safetensors blob"),
    ("empty payload", b"", "not a safetensors blob"),
    ("no metadata", save_blob({"x": torch.zeros(1)}), "no nxl_hooks record header"),
    ("header not JSON", _record({"x": torch.zeros(1)}, "{nope"), "JSONDecodeError"),
    ("header a list", _record({"x": torch.zeros(1)}, "[1, 2]"), "no nxl_hooks record header"),
    ("header too deep", _record({"x": torch.zeros(1)}, "[" * 100000), "RecursionError"),
    ("unknown kind", _record({}, {"kind": "banana", "call": 0}), "unknown record kind 'banana'"),
    ("call index missing", _record({}, {"kind": "end"}), "'call' is None, expected int"),
    ("call index a string", _record({}, {"kind": "end", "call": "0"}), "'call' is '0', expected int"),
    ("end of an unknown call", _record({}, {"kind": "end", "call": 7, "complete": True}),
     "'end' frame for call 7, which no 'call' frame opened"),
    ("second call frame", _record({"prompt_mask": torch.ones(1, 4, dtype=torch.bool)},
                                  {"kind": "call", "call": 0, "layers": [0, 1, 2]}), "a second 'call' frame"),
    ("end complete not bool", _record({}, {"kind": "end", "call": 0, "complete": "yes"}), "'complete' is 'yes'"),
    ("end sequences float", _record({"sequences": torch.zeros(1, 5)}, {"kind": "end", "call": 0, "complete": True}),
     "tensor 'sequences' is torch.float32"),
    ("step token missing", _step(token=None), "tensor 'token' is missing"),
    ("step token float", _step(token=torch.tensor([9.0])), "tensor 'token' is torch.float32"),
    ("step token rows", _step(token=torch.tensor([9, 9])), "token / active have 2 / 1 rows, the call's prompt 1"),
    ("step active int", _step(active=torch.tensor([1])), "tensor 'active' is torch.int64"),
    ("step normxlogit missing", _step(normxlogit=None), "normxlogit None does not cover"),
    ("step normxlogit wrong position", _step(position=9), r"normxlogit \(3, 1, 4\) does not cover 1 row\(s\) x 9"),
    ("step position zero", _step(position=0, normxlogit=torch.zeros(3, 1, 0)), "does not cover"),
    ("step logat shape", _step(logat=torch.zeros(2, 1, 4)), "logat has shape"),
    ("step mask float", _step(mask=torch.ones(1, 4)), "mask has dtype torch.float32"),
    ("step target float", _step(target=torch.tensor([9.0])), "target has dtype torch.float32"),
    ("step layers unsorted", _step(layers=[2, 0, 1]), "must be distinct, increasing"),
    ("step layers beyond L", _step(layers=[0, 1, 5]), "must be distinct, increasing and in 0..2"),
    ("step layers strings", _step(layers="all"), "'layers' is 'all', expected a list of layer indices"),
    ("step index a float", _step(step=0.5), "'step' is 0.5, expected int"),
    ("step n_blocks string", _step(n_blocks="2"), "'n_blocks' is '2'"),
)


@pytest.mark.parametrize("payload, message", CRAFTED_FRAMES)
def test_crafted_frames_with_a_valid_checksum(stream_bytes, tmp_path, payload, message):
    """The crafted frame replaces frame 1 (the first step), after a genuine call frame."""
    offsets = _offsets(stream_bytes)
    path = tmp_path / "run.nxl"
    path.write_bytes(stream_bytes[: offsets[1]] + _frame(payload) + stream_bytes[offsets[2]:])
    before = path.read_bytes()
    for strict in (False, True):
        with pytest.raises(reader.StreamError, match=f"frame 1 at byte {offsets[1]} has a valid checksum but .*"
                                                     f"{message}"):
            nxl.read_stream(path, strict=strict)
    assert path.read_bytes() == before


def test_a_call_frame_whose_prompt_ids_and_mask_differ(stream_bytes, tmp_path):
    offsets = _offsets(stream_bytes)
    call = _record({"prompt_mask": torch.ones(1, 4, dtype=torch.bool), "prompt_ids": torch.ones(1, 3, dtype=torch.long)},
                   {"kind": "call", "call": 0, "layers": [0, 1, 2]})
    path = tmp_path / "run.nxl"
    path.write_bytes(stream_bytes[: offsets[0]] + _frame(call) + stream_bytes[offsets[1]:])
    with pytest.raises(reader.StreamError, match=r"frame 0 at byte .*prompt_ids \(1, 3\) and prompt_mask \(1, 4\)"):
        nxl.read_stream(path)


STREAM_FILES = cases(
    ("a text file", b"hello\n", "is not an nxl_hooks stream file"),
    ("an attribution file", save_blob({"x": torch.zeros(1)}), "is not an nxl_hooks stream file"),
    ("magic line only", writer._FILE_MAGIC, None),
    # a later nxl_hooks's stream is named as one, not as some other file
    ("a later format", b"nxl_hooks.stream/3\nNXLF", r"run.nxl is a stream file of format 3, which a later nxl_hooks "
                                                    r"wrote: nxl_hooks .* reads formats 1 to 2; upgrade nxl_hooks"),
    ("a format that is no number", b"nxl_hooks.stream/x\n", "is not an nxl_hooks stream file"),
)


def test_an_attribution_file_given_to_read_stream_says_to_load_it(result, tmp_path):
    # (said "is not an nxl_hooks stream file (written by attach(..., sink=path))", also by nxl export)
    path = result.save(tmp_path / "a.safetensors")
    with pytest.raises(reader.StreamError, match=r"^\S*a.safetensors is an attribution file .*: read it with "
                                                 r"nxl.Attribution.load\(path\)$"):
        nxl.read_stream(path)
    assert nxl.Attribution.load(path).layers == [0, 2]  # the layers it was explained at: what the line points to


@pytest.mark.parametrize("content, message", STREAM_FILES)
def test_files_that_are_not_streams(tmp_path, content, message):
    path = tmp_path / "run.nxl"
    path.write_bytes(content)
    if message is None:  # an attached probe that never generated: an empty, whole stream
        calls = nxl.read_stream(path, strict=True)
        assert calls == [] and calls.damage is None
        return
    with pytest.raises(reader.StreamError, match=message):
        nxl.read_stream(path)
    if content.startswith(b"nxl_hooks.stream/3"):  # a sink given it names it as the reader does, and empties nothing
        with pytest.raises(ValueError, match=r"run.nxl is a stream file of format 3, which a later nxl_hooks wrote "
                                             r"and a stream sink would empty: give another path"):
            nxl.Sink(path)
        assert path.read_bytes() == content


# -- sinks -----------------------------------------------------------------------------------------------


def test_a_sink_refuses_a_symlink_unless_told(lm, tmp_path, existing):
    link = tmp_path / "run.nxl"
    link.symlink_to(existing)
    before = existing.read_bytes()
    with pytest.raises(ValueError, match="run.nxl is a symbolic link.*follow_symlinks=True"):
        nxl.attach(lm, sink=link)
    with pytest.raises(ValueError, match="is a symbolic link"):
        nxl.Sink(link)
    assert existing.read_bytes() == before and _hooks(lm) == 0
    with pytest.raises(ValueError, match="holds something other than an nxl_hooks stream"):
        nxl.Sink(link, follow_symlinks=True)  # followed, and the file there holds no stream: never emptied
    assert existing.read_bytes() == before
    existing.write_bytes(b"")
    with nxl.attach(lm, sink=nxl.Sink(link, follow_symlinks=True)):
        lm.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    (call,) = nxl.read_stream(existing)  # written through the link, as asked
    assert len(call.steps) == 2 and link.is_symlink()


SINK_PATHS = cases(
    ("a file as its folder", "FILE/run.nxl", NotADirectoryError, "Not a directory"),  # a folder: rotating files
    ("a missing folder", "missing/run.nxl", FileNotFoundError, "No such file or directory"),
    # never waited on (a FIFO nobody reads would block the host's attach) nor written (frames that never read back)
    ("a FIFO", "FIFO", ValueError, r"FIFO is a FIFO \(named pipe\), not a regular file: .*give another path"),
    ("a device", "/dev/null", ValueError, r"/dev/null is a character device, not a regular file"),
)


@pytest.mark.parametrize("where, error, message", SINK_PATHS)
def test_sink_paths_that_cannot_be_written(lm, tmp_path, where, error, message):
    (tmp_path / "FILE").write_text("")
    os.mkfifo(tmp_path / "FIFO")
    with pytest.raises(error, match=message):
        nxl.attach(lm, sink=tmp_path / where)
    assert _hooks(lm) == 0


PARQUET_PATHS = cases(
    # the finished file is renamed over the path when the probe detaches: a stream file (the crash-safe records,
    # given the same name) or anyone's data was replaced by it, a folder failed the rename with the rows lost
    ("a stream file as the Parquet path", "run.nxl", r"run.nxl holds something other than a Parquet file, which the "
     r"Parquet sink would replace: give another path, or remove the file first \(a stream file: nxl export"),
    ("anyone's data as the Parquet path", "data.csv", r"data.csv holds something other than a Parquet file"),
    ("a folder as the Parquet path", "folder", r"folder is a folder: a Parquet sink writes one file; give a file "
     r"path \(.*folder/scores.parquet\)"),
)


@pytest.mark.parametrize("where, message", PARQUET_PATHS)
def test_a_parquet_sink_never_replaces_what_is_no_parquet_file(lm, tmp_path, where, message):
    pytest.importorskip("pyarrow.parquet")
    with nxl.attach(lm, sink=tmp_path / "run.nxl"):
        lm.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    (tmp_path / "folder").mkdir()
    before = {path: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()}
    with pytest.raises(ValueError, match=message):
        nxl.attach(lm, sink=f"parquet:{tmp_path / where}")
    assert _hooks(lm) == 0
    assert {path: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()} == before
    assert len(nxl.read_stream(tmp_path / "run.nxl", strict=True)[0].steps) == 2  # the records, still whole


# -- the registry ----------------------------------------------------------------------------------------

_HEAD = 'heads.causal_lm = ["model.norm", "lm_head"]\n'
TOML = cases(
    ("model_types a string", '[x]\nmodel_types = "llama"\nblocks = "model.layers"\n' + _HEAD,
     r"\[x\] in .*x.toml: key 'model_types' must be a non-empty list.*write \['llama'\]"),
    ("model_types empty", '[x]\nmodel_types = []\nblocks = "model.layers"\n' + _HEAD, "key 'model_types'"),
    ("model_types ints", '[x]\nmodel_types = [1]\nblocks = "model.layers"\n' + _HEAD, "key 'model_types'"),
    ("blocks an int", '[x]\nblocks = 5\n' + _HEAD, "key 'blocks' must be a dotted module path.*got 5"),
    ("blocks a list", '[x]\nblocks = ["model.layers"]\n' + _HEAD, "key 'blocks' must be a dotted module path"),
    ("blocks not a path", '[x]\nblocks = "model/layers"\n' + _HEAD, "key 'blocks' must be a dotted module path"),
    ("blocks missing", '[x]\n' + _HEAD, "key 'blocks' is missing"),
    ("heads missing", '[x]\nblocks = "model.layers"\n', "key 'heads' is missing"),
    ("unknown key", '[x]\nblock = "model.layers"\n' + _HEAD, "unknown key 'block' \\(did you mean 'blocks'\\?\\)"),
    ("unknown key 2", '[x]\nblocks = "model.layers"\nhead = 1\n' + _HEAD, "unknown key 'head'"),
    ("pooling", '[x]\nblocks = "model.layers"\npooling = "cls"\n' + _HEAD, "key 'pooling' must be one of"),
    ("backbone an int", '[x]\nblocks = "model.layers"\nbackbone = 1\n' + _HEAD, "key 'backbone' must be a dotted"),
    ("layer_outputs a string", '[x]\nblocks = "model.layers"\nlayer_outputs = "model.norm"\n' + _HEAD,
     "key 'layer_outputs' must be a table of layer numbers to module paths"),
    ("layer_outputs a name", '[x]\nblocks = "model.layers"\nlayer_outputs = { conv = "a.b" }\n' + _HEAD,
     "key 'layer_outputs' key 'conv' is not a layer number"),
    ("layer_outputs zero", '[x]\nblocks = "model.layers"\nlayer_outputs = { 0 = "a.b" }\n' + _HEAD,
     "key 'layer_outputs' key '0' is not a layer number"),
    ("layer_outputs a number", '[x]\nblocks = "model.layers"\nlayer_outputs = { 1 = 3 }\n' + _HEAD,
     "key 'layer_outputs.1' must be a dotted module path"),
    ("heads a string", '[x]\nblocks = "model.layers"\nheads = "lm_head"\n', "key 'heads' must be a table"),
    ("heads empty", '[x]\nblocks = "model.layers"\nheads = {}\n', "key 'heads' must be a table"),
    ("head kind", '[x]\nblocks = "model.layers"\nheads.lm = ["lm_head"]\n', "key 'heads.lm' is not a head kind"),
    ("head steps a string", '[x]\nblocks = "model.layers"\nheads.causal_lm = "lm_head"\n',
     "key 'heads.causal_lm' must be a non-empty list of step strings"),
    ("head steps empty", '[x]\nblocks = "model.layers"\nheads.causal_lm = []\n', "must be a non-empty list"),
    ("head step an int", '[x]\nblocks = "model.layers"\nheads.causal_lm = ["model.norm", 3]\n',
     "must be a non-empty list of step strings"),
    ("head step unknown", '[x]\nblocks = "model.layers"\nheads.causal_lm = ["model.norm", "lm head"]\n',
     "step 'lm head' is neither a module path"),
    ("post-processing first", '[x]\nblocks = "model.layers"\nheads.causal_lm = ["softcap:c", "lm_head"]\n',
     "step 'softcap:c': logit post-processing comes after the readout"),
    ("post-processing without attribute", '[x]\nblocks = "model.layers"\nheads.causal_lm = ["lm_head", "scale:"]\n',
     "step 'scale:': name a config attribute"),
    ("post-processing bare", '[x]\nblocks = "model.layers"\nheads.causal_lm = ["lm_head", "softcap"]\n',
     "step 'softcap': name a config attribute after it, 'softcap:<attr>'"),
    ("act without attribute", '[x]\nblocks = "model.layers"\nheads.causal_lm = ["act:", "lm_head"]\n',
     "step 'act:': name a config attribute"),
    ("ends with a function", '[x]\nblocks = "model.layers"\nheads.causal_lm = ["model.norm", "lm_head", "tanh"]\n',
     "must end with the readout module"),
    ("only post-processing", '[x]\nblocks = "model.layers"\nheads.causal_lm = ["scale:s"]\n',
     "must end with the readout module"),
    ("a table of scalars", 'x = 3\n', r"\[x\] .*must be a table of keys"),
    ("not TOML", '[x\nblocks = 1', "is not a valid TOML registry file"),
    ("not UTF-8", b"\xff\xfe[x]", "is not a valid TOML registry file"),
)


@pytest.mark.parametrize("text, message", TOML)
def test_bad_registry_files(tmp_path, text, message):
    path = tmp_path / "x.toml"
    good = "[good]\nblocks = 'a.b'\n" + _HEAD  # comes first: a file registers all of its entries or none
    text = text if isinstance(text, bytes) else (good + text if text.startswith("[") else text + good).encode()
    path.write_bytes(text)
    before = registry.specs()
    with pytest.raises(registry.RegistryError, match=message):
        nxl.register_file(path)
    assert registry.specs() == before  # all of a file or none of it


REGISTER = cases(
    ("model_types a string", {"model_types": "llama"}, "key 'model_types' must be a non-empty list"),
    ("blocks a number", {"blocks": 5}, "key 'blocks' must be a dotted module path"),
    ("heads a list", {"heads": ["lm_head"]}, "key 'heads' must be a table"),
    ("steps a string", {"heads": {"causal_lm": "lm_head"}}, "must be a non-empty list of step strings"),
    ("unknown option", {"pooler": "first"}, "unknown key 'pooler'"),
    ("pooling", {"pooling": "mean"}, "key 'pooling' must be one of"),
)


@pytest.mark.parametrize("changes, message", REGISTER)
def test_bad_register_architecture_calls(changes, message):
    before = registry.specs()
    with pytest.raises(registry.RegistryError, match=r"\[q\] in register_architecture\(\): .*" + message):
        nxl.register_architecture("q", **{"blocks": "model.layers", "heads": {"causal_lm": ["lm_head"]}, **changes})
    assert registry.specs() == before


RESOLVE = cases(
    ("attribute typo", ["model.norm", "lm_head", "softcap:final_logit_softcaping"],
     "step 'softcap:final_logit_softcaping': LlamaConfig has no attribute"),
    ("act typo", ["model.norm", "act:hiden_act", "lm_head"], "step 'act:hiden_act'.*did you mean 'hidden_act'"),
    ("not a number", ["model.norm", "lm_head", "scale:model_type"],
     "step 'scale:model_type': config.model_type is 'llama', not a number"),
    ("final norm left out", ["lm_head"], "leaves out the model's final norm 'model.norm' \\(LlamaRMSNorm\\)"),
)


@pytest.mark.parametrize("steps, message", RESOLVE)
def test_registry_heads_that_do_not_fit_the_model(lm, monkeypatch, tmp_path, steps, message):
    monkeypatch.setattr(registry, "_SPECS", registry.specs())
    path = tmp_path / "llama.toml"
    path.write_text(f'[llama]\nblocks = "model.layers"\nheads.causal_lm = {json.dumps(steps)}\n')
    nxl.register_file(path)
    where = rf"\[llama\] in {re.escape(str(path))}: key 'heads.causal_lm' "
    with pytest.raises(registry.RegistryError, match=where + message):
        nxl.attach(lm)
    assert _hooks(lm) == 0


# -- dataset runs ----------------------------------------------------------------------------------------


def test_a_failing_example_is_recorded_and_not_retried(tmp_path):
    calls = []

    def score(example):
        calls.append(example["n"])
        if example["n"] == 1:
            raise IndexError("index out of range in self (text longer than the model's positions?)")
        return {"n": example["n"]}

    items = [{"n": i, "id": f"e{i}"} for i in range(3)]
    records = dataset.run_dataset(items, score, tmp_path, settings={"m": 1})
    assert records[1] == {"id": "e1", "index": 1,
                          "error": "IndexError: index out of range in self (text longer than the model's positions?)"}
    assert dataset.run_dataset(items, score, tmp_path, settings={"m": 1}) == records and calls == [0, 1, 2]
    ok, summary = dataset.scored(records, lambda rs: {"n": len(rs)})
    assert ok == [records[0], records[2]] and summary == {"n": 2, "failed": [
        {"index": 1, "id": "e1", "error": records[1]["error"]}], "notes": []}  # (its records have no notes)
    with pytest.raises(ValueError, match="every example failed \\(1\\); the first: example 1: IndexError"):
        dataset.scored([records[1]], len)


RUNS = cases(
    ("run.json deleted", "delete", "2 of its records carry another run's identity"),
    ("run.json replaced", "replace", "different: model"),
    ("run.json not JSON", "garble", "carry another run's identity"),
    ("run.json of another version", "older", "holds a run made by nxl_hooks 0.3.0, whose records nxl_hooks .* does not "
                                             "resume \\(its numbers may differ\\); use another --out folder"),
)


@pytest.mark.parametrize("how, message", RUNS)
def test_resume_checks_the_run_identity_in_the_records(tmp_path, how, message):
    dataset.run_dataset([{"n": 0}, {"n": 1}], dict, tmp_path, settings={"model": "a"})
    run = tmp_path / "run.json"
    {"delete": run.unlink, "replace": lambda: run.write_text(json.dumps({**json.loads(run.read_text()), "model": "c"})),
     "garble": lambda: run.write_text("{"),
     "older": lambda: run.write_text(json.dumps({**json.loads(run.read_text()), "nxl_hooks": "0.3.0"}))}[how]()
    part = tmp_path / "parts" / "part-0.jsonl"
    before = part.read_bytes()
    with pytest.raises(dataset.SettingsMismatchError, match=message):
        dataset.run_dataset([{"n": 0}, {"n": 1}], dict, tmp_path, settings={"model": "b"})
    assert part.read_bytes() == before
    # the same run resumes without its run.json: the records say whose they are
    assert dataset.run_dataset([{"n": 0}, {"n": 1}], dict, tmp_path, settings={"model": "a"}) == [
        {"n": 0, "index": 0}, {"n": 1, "index": 1}]


def test_records_without_identity_need_a_matching_run_json(tmp_path):
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "part-0.jsonl").write_text('{"n": 0, "index": 0}\n')  # written before run ids
    with pytest.raises(dataset.SettingsMismatchError, match="another run's identity"):
        dataset.run_dataset([{"n": 0}], dict, tmp_path, settings={"model": "a"})
    (tmp_path / "run.json").write_text(json.dumps({"model": "a", "nxl_hooks": nxl.__version__}))
    assert dataset.run_dataset([{"n": 0}], dict, tmp_path, settings={"model": "a"}) == [{"n": 0, "index": 0}]


PARTS = cases(
    ("not JSON", "{oops\n", "part-0.jsonl:2 is corrupt"),
    ("JSON without index", '{"n": 1}\n', "part-0.jsonl:2 is corrupt \\(not a JSON record with an index\\)"),
    ("index a string", '{"index": "1"}\n', "part-0.jsonl:2 is corrupt"),
    ("a list", "[1, 2]\n", "part-0.jsonl:2 is corrupt"),
)


@pytest.mark.parametrize("line, message", PARTS)
def test_corrupt_part_files(tmp_path, line, message):
    dataset.run_dataset([{"n": 0}], dict, tmp_path, settings={})
    part = tmp_path / "parts" / "part-0.jsonl"
    part.write_text(part.read_text() + line)
    with pytest.raises(ValueError, match=message):
        dataset.run_dataset([{"n": 0}, {"n": 1}], dict, tmp_path, settings={})


def test_outputs_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    dataset.write_outputs(tmp_path, [{"a": 1}], {"n": 1}, "<p>old</p>")
    before = {name: (tmp_path / name).read_bytes() for name in ("records.jsonl", "summary.json", "report.html")}

    with pytest.raises(TypeError, match="not JSON serializable"):
        dataset.write_outputs(tmp_path, [{"a": 1}, {"b": object()}], {"n": 2}, "<p>new</p>")
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)



# -- the evaluation API: nxl_hooks.eval.audit and nxl_hooks.eval.faithfulness, called from Python ----------------

def _without_mask_token():
    tok = tiny.tokenizer()
    tok.mask_token = None
    return tok


_AUDIT_RECORD = {"schema": "nxl_hooks.audit/1", "layers": [0, 1, 2]}
_EVAL_RECORD = {"schema": "nxl_hooks.eval/1", "ks": [0.1], "eval_layer": 2, "kind": "sequence_classification"}
EVALUATION = cases(
    ("audit explain unknown", lambda m: m.audit.audit_example(m.bert, m.bert, m.tok, {"text": "good"}, explain="own"),
     r"^explain='own': use 'target' \(the example's target, else the reference's prediction\) or 'reference'"),
    ("audit of no records", lambda m: m.audit.aggregate([]), r"^aggregate needs at least one audit record$"),
    ("audit records of two layer sets", lambda m: m.audit.aggregate([_AUDIT_RECORD, {**_AUDIT_RECORD, "layers": [2]}]),
     r"^records must all be nxl_hooks.audit/1 records with the same layers: aggregate one audit at a time$"),
    ("audit compare of two targets", lambda m: m.audit.compare(*[nxl.explain(m.bert, m.tok, "good film",
                                                                               target=[0, 1])] * 2),
     r"^compare one target at a time \(the attributions have a trailing target axis\)$"),
    ("evaluation of no records", lambda m: m.ev.aggregate([]), r"^aggregate needs at least one record$"),
    ("evaluation record of another schema", lambda m: m.ev.aggregate([{"schema": "nxl_hooks.audit/1"}]),
     r"^not an nxl_hooks evaluation record \(schema 'nxl_hooks.audit/1', expected 'nxl_hooks.eval/1'\)$"),
    ("evaluation records of two settings", lambda m: m.ev.aggregate([_EVAL_RECORD, {**_EVAL_RECORD, "ks": [0.2]}]),
     r"^records differ in ks, eval_layer or head kind: aggregate runs of one setting at a time$"),
    ("masked-LM example of two masks", lambda m: m.ev.score_example(
        tiny.build_model("mlm"), m.tok, {"text": "the [MASK] was [MASK]"}, methods=("logat",)),
     r"^a masked-LM example needs exactly one '\[MASK\]'; found 2$"),
    ("mask perturbation without a mask token", lambda m: m.ev.score_example(
        m.bert, _without_mask_token(), {"text": "good film"}, methods=("logat",), perturbation="mask"),
     r"^mask perturbation needs a tokenizer with a mask token; pass perturbation='delete'$"),
    ("custom scores of another length", lambda m: m.ev.score_example(m.bert, m.tok, {"text": "good film"}, methods=(),
                                                                     custom={"mine": [1.0]}),
     r"^custom method 'mine': give a new name and one score per token \(4 tokens here\)$"),
    ("custom scores under a method's name", lambda m: m.ev.score_example(
        m.bert, m.tok, {"text": "good film"}, methods=(), custom={"logat": [1.0] * 4}),
     r"^custom method 'logat': give a new name and one score per token \(4 tokens here\)$"),
)


@pytest.mark.parametrize("call, message", EVALUATION)
def test_evaluation_calls_that_cannot_run_say_what_to_do(bert, call, message):
    from types import SimpleNamespace

    from nxl_hooks.eval import audit
    from nxl_hooks.eval import faithfulness as ev

    with pytest.raises(ValueError, match=message):
        call(SimpleNamespace(audit=audit, ev=ev, bert=bert, tok=tiny.tokenizer()))
    assert _hooks(bert) == 0

def test_catalogue_size():
    """The library part of the catalogue is at least what issue 12 asks; docs/testing.md quotes the exact figure
    (tests/process/test_cli_bad_inputs.py::test_docs_state_the_catalogue)."""
    assert len(CATALOGUE) >= 150, len(CATALOGUE)
