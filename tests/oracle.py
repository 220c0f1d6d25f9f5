"""Independent oracle for the tests: NormXLogit from ``output_hidden_states=True`` and a head applied by hand.

Written apart from the library on purpose: nothing here imports nxl_hooks. Each family's head is spelled
out as plain tensor code on the model's own weights.
"""

from __future__ import annotations

from typing import Callable

import torch

Fn = Callable[[torch.Tensor], torch.Tensor]


def layer_logits(hidden_states: tuple[torch.Tensor, ...], norm: Fn, head: Fn, *, last_is_normed: bool) -> torch.Tensor:
    """Full HoT logits per layer: (L+1, batch, seq, outputs).

    transformers already applies the final norm to ``hidden_states[-1]`` for most decoders
    (``last_is_normed=True``); applying it twice would be the silent bug the SPEC warns about.
    """
    out = []
    last = len(hidden_states) - 1
    for index, hidden in enumerate(hidden_states):
        normed = hidden if (index == last and last_is_normed) else norm(hidden)
        out.append(head(normed).float())
    return torch.stack(out)


def normxlogit(logits: torch.Tensor, embeddings: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logat, normxlogit), each (L+1, batch, seq) for one target id per row."""
    index = target.view(1, -1, 1, 1).expand(logits.shape[0], -1, logits.shape[2], 1)
    logat = logits.gather(-1, index)[..., 0]
    return logat, embeddings.float().norm(dim=-1)[None] * logat


def rms_norm(module: torch.nn.Module, *, one_plus: bool = False) -> Fn:
    """Llama-style RMSNorm by hand (Gemma stores ``weight - 1``)."""

    def apply(h: torch.Tensor) -> torch.Tensor:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        if one_plus:  # Gemma: the weight in float32, then the input's dtype
            return (x * (1.0 + module.weight.float())).to(h.dtype)
        return module.weight * x.to(h.dtype)  # Llama: the input's dtype first, then the weight in it

    return apply


def layer_norm(module: torch.nn.LayerNorm) -> Fn:
    def apply(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(h, module.normalized_shape, module.weight, module.bias, module.eps)

    return apply


def linear(module: torch.nn.Module) -> Fn:
    def apply(h: torch.Tensor) -> torch.Tensor:
        out = h @ module.weight.t()
        return out + module.bias if getattr(module, "bias", None) is not None else out

    return apply


def softcap(fn: Fn, cap: float | None) -> Fn:
    """Gemma2's final-logit softcapping, tanh(x / c) * c, after ``fn``."""
    if cap is None:
        return fn
    return lambda h: torch.tanh(fn(h) / cap) * cap


def then(*fns: Fn) -> Fn:
    """Compose left to right: ``then(f, g)(h) == g(f(h))``."""

    def apply(h: torch.Tensor) -> torch.Tensor:
        for fn in fns:
            h = fn(h)
        return h

    return apply


def cohere_layer_norm(module: torch.nn.Module) -> Fn:
    """Cohere's LayerNorm: mean-centred, weight only, no bias."""

    def apply(h: torch.Tensor) -> torch.Tensor:
        x = h.float()
        x = x - x.mean(-1, keepdim=True)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
        return (module.weight.float() * x).to(h.dtype)

    return apply


def plain_layer_norm(h: torch.Tensor) -> torch.Tensor:
    """OLMo's LayerNorm: no weight, no bias, eps 1e-5."""
    return torch.nn.functional.layer_norm(h.float(), h.shape[-1:], None, None, 1e-5).to(h.dtype)


# -- hand-written heads-on-top per family --------------------------------------------------------------
#
# Each returns a HandHead: ``norm`` is what transformers has already applied to ``hidden_states[-1]`` for
# decoders (final norm, and OPT's project_out), ``head`` the rest (readout and logit post-processing).


class HandHead:
    """A family's HoT by hand, split where transformers' ``hidden_states[-1]`` stops."""

    def __init__(self, norm: Fn, head: Fn, *, last_is_normed: bool,
                 states: Callable[[torch.Tensor, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]] | None = None
                 ) -> None:
        self.norm, self.head, self.last_is_normed = norm, head, last_is_normed
        #: (input ids, ``output_hidden_states``) -> the embeddings then every block's output, the last normed where
        #: ``last_is_normed``: what a family whose tuple is laid out otherwise gives (:func:`state_space`)
        self.states = states or (lambda ids, hidden: hidden)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """HoT of raw block outputs (pre-norm), all outputs: (..., outputs)."""
        return self.head(self.norm(hidden)).float()

    def layer_logits(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """(L+1, batch, seq, outputs) from ``output_hidden_states=True``."""
        return layer_logits(hidden_states, self.norm, self.head, last_is_normed=self.last_is_normed)


def _identity(h: torch.Tensor) -> torch.Tensor:
    return h


def _decoder_readout(model: torch.nn.Module) -> torch.nn.Module:
    # *ForCausalLM reads out with lm_head (GPT-NeoX: embed_out); *ForSequenceClassification with score.
    for name in ("lm_head", "embed_out", "score"):
        if isinstance(getattr(model, name, None), torch.nn.Linear):
            return getattr(model, name)
    raise AttributeError(f"{type(model).__name__} has no lm_head / embed_out / score")


def _is_causal_lm(model: torch.nn.Module) -> bool:
    return not type(model).__name__.endswith("ForSequenceClassification")


def llama(model) -> HandHead:
    """Llama, Mistral, Qwen2, Qwen3, Phi3: RMSNorm ``model.norm`` then lm_head / score."""
    return HandHead(rms_norm(model.model.norm), linear(_decoder_readout(model)), last_is_normed=True)


def gemma(model) -> HandHead:
    """Gemma, Gemma2: RMSNorm with (1 + weight); Gemma2's causal LM softcaps its logits (classifiers do not)."""
    cap = getattr(model.config, "final_logit_softcapping", None) if _is_causal_lm(model) else None
    head = softcap(linear(_decoder_readout(model)), cap)
    return HandHead(rms_norm(model.model.norm, one_plus=True), head, last_is_normed=True)


def cohere(model) -> HandHead:
    """Cohere: mean-centred LayerNorm, logits times ``config.logit_scale``."""
    readout, scale = linear(model.lm_head), model.config.logit_scale
    return HandHead(cohere_layer_norm(model.model.norm), lambda h: readout(h) * scale, last_is_normed=True)


def granite(model) -> HandHead:
    """Granite: RMSNorm, logits divided by ``config.logits_scaling``."""
    readout, divide = linear(model.lm_head), model.config.logits_scaling
    return HandHead(rms_norm(model.model.norm), lambda h: readout(h) / divide, last_is_normed=True)


def olmo(model) -> HandHead:
    """OLMo: parameter-free LayerNorm."""
    return HandHead(plain_layer_norm, linear(_decoder_readout(model)), last_is_normed=True)


def layer_norm_decoder(norm_path: str):
    """Decoders with a plain LayerNorm final norm at ``norm_path`` (Phi, GPT-2, GPT-NeoX, Falcon, StarCoder2)."""

    def build(model) -> HandHead:
        norm = model.get_submodule(norm_path)
        return HandHead(layer_norm(norm), linear(_decoder_readout(model)), last_is_normed=True)

    return build


def opt(model) -> HandHead:
    """OPT: final LayerNorm (may be absent), then project_out when word_embed_proj_dim != hidden_size.
    transformers' ``hidden_states[-1]`` has both applied."""
    decoder = model.model.decoder
    steps = [layer_norm(decoder.final_layer_norm)] if decoder.final_layer_norm is not None else []
    if decoder.project_out is not None:
        steps.append(linear(decoder.project_out))
    return HandHead(then(*steps) if steps else _identity, linear(_decoder_readout(model)), last_is_normed=True)


def _gelu(h: torch.Tensor) -> torch.Tensor:
    return 0.5 * h * (1.0 + torch.erf(h / 2.0**0.5))


def bert_classifier(model) -> HandHead:
    """BERT: pooler dense + tanh applied to every token (authors' code), then classifier. Post-LN: no norm."""
    head = then(linear(model.bert.pooler.dense), torch.tanh, linear(model.classifier))
    return HandHead(_identity, head, last_is_normed=False)


def _prediction_head(predictions) -> Fn:
    # BERT / legacy DeBERTa MLM: transform (dense, gelu, LayerNorm), then the decoder.
    transform = predictions.transform  # (its activation is the config's hidden_act)
    return then(linear(transform.dense), transform.transform_act_fn, layer_norm(transform.LayerNorm),
                linear(predictions.decoder))


def bert_lm(model) -> HandHead:
    """BertForMaskedLM / BertLMHeadModel: ``cls.predictions`` on every token."""
    return HandHead(_identity, _prediction_head(model.cls.predictions), last_is_normed=False)


def roberta_classifier(model) -> HandHead:
    """RoBERTa: classifier.dense, tanh, classifier.out_proj."""
    head = then(linear(model.classifier.dense), torch.tanh, linear(model.classifier.out_proj))
    return HandHead(_identity, head, last_is_normed=False)


def roberta_lm(model) -> HandHead:
    """RobertaForMaskedLM / RobertaForCausalLM: lm_head dense, gelu, layer_norm, decoder."""
    lm = model.lm_head
    return HandHead(_identity, then(linear(lm.dense), _gelu, layer_norm(lm.layer_norm), linear(lm.decoder)),
                    last_is_normed=False)


def modernbert_classifier(model) -> HandHead:
    """ModernBERT and its decoder: final_norm, then head.dense, gelu, head.norm and classifier."""
    head = then(linear(model.head.dense), _gelu, layer_norm(model.head.norm), linear(model.classifier))
    return HandHead(layer_norm(model.model.final_norm), head, last_is_normed=True)


def deberta_classifier(model) -> HandHead:
    """DeBERTa-v2/v3: ContextPooler dense + gelu (``pooler_hidden_act``), then classifier."""
    assert model.config.pooler_hidden_act == "gelu", "this oracle spells out gelu only"
    return HandHead(_identity, then(linear(model.pooler.dense), _gelu, linear(model.classifier)), last_is_normed=False)


def deberta_lm(model) -> HandHead:
    """DeBERTa-v2 masked LM, legacy head (``config.legacy``, the default)."""
    return HandHead(_identity, _prediction_head(model.cls.predictions), last_is_normed=False)


def electra_classifier(model) -> HandHead:
    """ELECTRA: classifier.dense, gelu (not tanh), classifier.out_proj."""
    head = then(linear(model.classifier.dense), _gelu, linear(model.classifier.out_proj))
    return HandHead(_identity, head, last_is_normed=False)


def electra_lm(model) -> HandHead:
    """ELECTRA generator (masked LM and causal LM): dense, gelu, LayerNorm, generator_lm_head."""
    pred = model.generator_predictions
    head = then(linear(pred.dense), _gelu, layer_norm(pred.LayerNorm), linear(model.generator_lm_head))
    return HandHead(_identity, head, last_is_normed=False)


def distilbert_classifier(model) -> HandHead:
    """DistilBERT: pre_classifier, ReLU, classifier."""
    head = then(linear(model.pre_classifier), torch.relu, linear(model.classifier))
    return HandHead(_identity, head, last_is_normed=False)


def distilbert_lm(model) -> HandHead:
    """DistilBERT masked LM: vocab_transform, gelu, vocab_layer_norm, vocab_projector."""
    head = then(linear(model.vocab_transform), _gelu, layer_norm(model.vocab_layer_norm), linear(model.vocab_projector))
    return HandHead(_identity, head, last_is_normed=False)


def state_space(model) -> HandHead:
    """Mamba, Mamba-2, FalconMamba: RMSNorm ``backbone.norm_f`` then lm_head. Their ``hidden_states`` hold no
    embeddings (the first is block 1's output) and end with block L's output twice, raw then normed: the word
    embeddings go first and the raw one is dropped. Mamba-2 from transformers 5.25 collects them as other decoders
    do (the embeddings, blocks 1..L-1, the normed last), which are taken as they are."""
    backbone = model.backbone

    def states(ids, hidden):
        embeddings = backbone.embeddings(ids)
        if torch.equal(hidden[0], embeddings):
            return hidden
        return (embeddings, *hidden[:-2], hidden[-1])

    return HandHead(rms_norm(backbone.norm_f), linear(model.lm_head), last_is_normed=True, states=states)


def prefix_logits(model, hand: HandHead, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Generation oracle: re-run the whole prefix without a cache, positions as ``generate`` assigns them
    (``cumsum(mask) - 1``, so left padding does not shift them). Returns (HoT logits (L+1, batch, n, outputs),
    the embeddings: ``hidden_states[0]``, or where :attr:`HandHead.states` puts them) for ``normxlogit``; the
    prediction for the token at index n is at position n - 1."""
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, output_hidden_states=True,
                    use_cache=False)
        hidden = hand.states(ids, out.hidden_states)
    return hand.layer_logits(hidden), hidden[0]


def full_mask(call) -> torch.Tensor:
    """The attention mask generate used for a recorded call: the prompt's, then ones for every generated position."""
    new = call.sequences.shape[1] - call.prompt_mask.shape[1]
    return torch.cat([call.prompt_mask, torch.ones(call.prompt_mask.shape[0], new, dtype=torch.bool)], dim=1)


def check_call(model, call, new_tokens: int, hand: HandHead | None = None) -> list[torch.Tensor]:
    """Every step record of a finished generation ``call`` (prompt_mask, sequences, steps) equals the no-cache oracle
    (:func:`prefix_logits` of its own output up to that step), at the layers the call says it holds; returns the
    oracle's own argmax per step."""
    assert call.complete and len(call.steps) == new_tokens == call.sequences.shape[1] - call.prompt_mask.shape[1]
    return check_steps(model, call, hand)


def check_steps(model, call, hand: HandHead | None = None) -> list[torch.Tensor]:
    """:func:`check_call` of the records a returned ``call`` holds, its first steps, however many (a call whose
    records stop early)."""
    hand, sequences, attention = hand or llama(model), call.sequences, full_mask(call)
    prompt_len = call.prompt_mask.shape[1]
    argmaxes = []
    for index, step in enumerate(call.steps):
        n = step.position
        assert (step.step, n) == (index, prompt_len + index)
        torch.testing.assert_close(step.token, sequences[:, n])  # the emitted token, the last one included
        torch.testing.assert_close(step.target, step.token)
        logits, embeddings = prefix_logits(model, hand, sequences[:, :n], attention[:, :n])
        logat, expected = (values[call.layers] for values in normxlogit(logits, embeddings, step.token))
        real = attention[:, :n].expand_as(step.logat)
        torch.testing.assert_close(step.logat[real], logat[real], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(step.normxlogit[real], expected[real], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(step.embed_norm[attention[:, :n]], embeddings.norm(dim=-1)[attention[:, :n]])
        argmaxes.append(logits[-1, :, -1].argmax(-1))
    return argmaxes


def gguf_quantization(path) -> dict:
    """What a GGUF file's header says of how its weights are stored, read with gguf's own reader (the
    ``general.file_type`` field's value by its ``LlamaFileType`` name, None where absent, and the tensors per GGML
    type): what a model loaded from it records as its ``quantization``, less the dtype it was dequantized to."""
    import collections

    import gguf

    reader = gguf.GGUFReader(path)
    field = reader.fields.get("general.file_type")
    file_type = None if field is None else gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name
    counts = collections.Counter(tensor.tensor_type.name for tensor in reader.tensors)
    return {"quant_method": "gguf", "file_type": file_type, "tensor_types": dict(counts)}
