"""Shared pieces of the big-model tests (quantized, dispatched/offloaded, PEFT, CUDA): tiny models saved to
disk so they can be reloaded with a ``quantization_config`` or a ``device_map``, and one oracle check.

    path = save(tmp_path, "llama")
    res = check(model, oracle.HandHead(...), ids, mask)   # asserts all layers and l = L parity
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM,
                          LlamaForSequenceClassification, RobertaConfig, RobertaForSequenceClassification)

import nxl_hooks as nxl
import oracle

VOCAB = 128
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)

FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig(**_SHAPE, num_key_value_heads=2, pad_token_id=0)),
    "llama_cls": (LlamaForSequenceClassification, LlamaConfig(**_SHAPE, num_key_value_heads=2, pad_token_id=0,
                                                              num_labels=3)),
    "bert": (BertForSequenceClassification, BertConfig(**_SHAPE, max_position_embeddings=32, pad_token_id=0)),
    "roberta": (RobertaForSequenceClassification, RobertaConfig(**_SHAPE, max_position_embeddings=40, pad_token_id=1)),
}


#: One test_architectures case per registered family: the rows of the support matrix (docs/supported-models.md).
ONE_PER_FAMILY = ["llama-lm", "gemma2-lm", "phi-lm", "gpt2-lm", "gpt_neox-lm", "opt-lm", "falcon-lm", "cohere-lm",
                  "granite-lm", "bert-cls", "roberta-cls", "deberta_v2-cls"]


def build(family: str, seed: int = 0, **config) -> torch.nn.Module:
    """A random tiny model of ``family`` (hidden 64, 2 layers); ``config`` overrides fields (``num_labels=32``)."""
    cls, base = FAMILIES[family]
    torch.manual_seed(seed)
    return cls(type(base)(**{**base.to_dict(), **config})).eval()


def save(path: Path, family: str, seed: int = 0, **config) -> Path:
    """:func:`build` then ``save_pretrained(path)``: reload it with a quantization_config or a device_map."""
    build(family, seed, **config).save_pretrained(path)
    return path


def batch(seed: int = 1, rows: int = 2, seq: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids in 3..VOCAB-1 (no pad/special ids) and a mask whose second row is right-padded by two."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=generator)
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[1:, -2:] = 0
    return ids, mask


def llama_head(model) -> oracle.HandHead:
    """Llama HoT by hand for the norm, and the model's own readout *called* (it may be quantized or adapted)."""
    return oracle.HandHead(oracle.rms_norm(model.model.norm), _readout(model), last_is_normed=True)


def _readout(model) -> torch.nn.Module:
    return model.lm_head if hasattr(model, "lm_head") else model.score


def bert_head(model) -> oracle.HandHead:
    """BERT classifier HoT with the model's own (maybe bitsandbytes) pooler dense and classifier called."""
    return oracle.HandHead(lambda h: h, oracle.then(model.bert.pooler.dense, torch.tanh, model.classifier),
                           last_is_normed=False)


def roberta_head(model) -> oracle.HandHead:
    head = oracle.then(model.classifier.dense, torch.tanh, model.classifier.out_proj)
    return oracle.HandHead(lambda h: h, head, last_is_normed=False)


def positions(model, mask: torch.Tensor) -> torch.Tensor:
    """The prediction position per row: CLS for encoders, the last real token for decoders."""
    if model.config.model_type in ("bert", "roberta"):
        return torch.zeros(mask.shape[0], dtype=torch.long)
    return mask.sum(-1) - 1


def check(model, hand: oracle.HandHead, ids: torch.Tensor, mask: torch.Tensor, *, rtol: float = 1e-4,
          atol: float = 1e-5, attach_to=None) -> nxl.Attribution:
    """Attach to ``attach_to`` (default ``model``), run ``model`` once, and assert every layer equals the oracle
    from ``output_hidden_states`` and ``hand``, and LogAt at l = L equals the model's own logit."""
    ids = ids.masked_fill(mask == 0, model.config.pad_token_id)  # classifiers pool by pad id, not by mask
    device = model.get_input_embeddings().weight.device
    device = device if device.type != "meta" else torch.device("cpu")
    with torch.no_grad(), nxl.attach(attach_to if attach_to is not None else model) as probe:
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
    res = probe.result()
    with torch.no_grad():
        logits = hand.layer_logits(out.hidden_states).cpu()
    logat, expected = oracle.normxlogit(logits, out.hidden_states[0].cpu(), res.target)
    torch.testing.assert_close(res.logat, logat, rtol=rtol, atol=atol)
    torch.testing.assert_close(res.normxlogit, expected, rtol=rtol, atol=atol)
    rows = torch.arange(len(ids))
    own = out.logits.float().cpu()
    own = own[rows, positions(model, mask)] if own.dim() == 3 else own
    at_p = res.logat[-1, rows, positions(model, mask)]
    torch.testing.assert_close(at_p, own[rows, res.target], rtol=rtol, atol=atol)
    return res
