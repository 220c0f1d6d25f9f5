"""A tiny byte-level BPE world for the readable-token tests: a tokenizer trained here on a few sentences (so 'Ġ'
pieces, newline tokens and words that are one token with and without a leading space appear, as in real
checkpoints), tiny Llama models over it, a chat template, and a GGUF file written from such a model.

    tok = bpe_tokenizer(); model = bpe_llama(tok)
    mlm_tok = roberta_tokenizer()                       # RoBERTa's specials, '<mask>' with lstrip
    folder = save_bpe(tmp_path / "bpe")                 # model + tokenizer, loadable by the CLI
    gguf = write_gguf(tmp_path / "tiny.gguf", model, tok)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SENTENCES = [
    "The capital of France is Paris.\nThe capital of Italy is Rome.",
    "Paris is a city. Rome is a city. London is a city.",
    "The keys to the cabinet are on the table.\n\nThe key to the cabinets is on the table.",
    "They are here and it is there; we are what we are, and it is what it is.",
    "the film was very good and the plot was great",
]
LAYERS = 3


def _trained(specials: list[str]) -> Tokenizer:
    """Byte-level BPE (GPT-2 style, no prefix space) trained on :data:`SENTENCES`, ``specials`` its first ids."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(SENTENCES * 20, trainer)
    return backend


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style, no prefix space) trained on :data:`SENTENCES`, with a ChatML template."""
    tok = PreTrainedTokenizerFast(tokenizer_object=_trained(SPECIALS), bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  unk_token="<|endoftext|>", pad_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def roberta_tokenizer() -> PreTrainedTokenizerFast:
    """The same BPE with RoBERTa's special tokens and template (``<s> text </s>``); its ``<mask>`` strips the space
    before it (``lstrip``, as roberta-base's), so ' <mask>' is one token."""
    backend = _trained(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    backend.add_special_tokens([AddedToken("<mask>", lstrip=True, normalized=False, special=True)])  # trained without
    backend.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                   cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")


def bpe_llama(tok: PreTrainedTokenizerFast, seed: int = 0, layers: int = LAYERS, **config) -> LlamaForCausalLM:
    """A random tiny Llama causal LM over ``tok``'s vocabulary (tied embeddings, as SmolLM2)."""
    torch.manual_seed(seed)
    settings = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=1,
                    eos_token_id=2, pad_token_id=2, max_position_embeddings=256)
    model = LlamaForCausalLM(LlamaConfig(**{**settings, **config})).eval()
    model.generation_config.eos_token_id = None  # random weights: generate the number of tokens asked for
    return model


def save_bpe(path: Path, model: LlamaForCausalLM | None = None, tok: PreTrainedTokenizerFast | None = None) -> Path:
    tok = tok or bpe_tokenizer()
    (model or bpe_llama(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp stores q/k rows interleaved for its rotary layout; transformers' GGUF loader undoes exactly this.
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path: Path, model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, *, header: dict | None = None,
               drop: tuple[str, ...] = (), transpose: tuple[str, ...] = (), extra: dict | None = None,
               q8_0: tuple[str, ...] = ()) -> Path:
    """``model`` and ``tok`` as a float32 GGUF file (llama architecture, gpt2 tokenizer, chat template); the tensors
    named in ``q8_0`` stored quantized, as Q8_0 blocks, and ``header={"file_type": LlamaFileType.MOSTLY_Q8_0}``
    writes ``general.file_type`` (left out by default, as the float file has none).

    A crafted file for the refusal tests: ``header`` overrides ``block_count``, ``embedding_length``,
    ``feed_forward_length``, ``head_count`` or ``tokens`` (None: left out); the tensors named in ``drop`` are left out, those in
    ``transpose`` written transposed; ``extra``: more tensors (name -> array). ``write_gguf(p, m, t, header={"block_count": 10**6})``"""
    import gguf

    cfg = model.config
    vocab = tok.get_vocab()
    pieces = sorted(vocab, key=vocab.get)
    given = {"block_count": cfg.num_hidden_layers, "embedding_length": cfg.hidden_size,
             "feed_forward_length": cfg.intermediate_size, "head_count": cfg.num_attention_heads, "tokens": pieces,
             "file_type": None, **(header or {})}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(given["block_count"])
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(given["embedding_length"])
    writer.add_feed_forward_length(given["feed_forward_length"])
    writer.add_head_count(given["head_count"])
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    if given["file_type"] is not None:
        writer.add_file_type(given["file_type"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    if given["tokens"] is not None:
        writer.add_token_list(given["tokens"])
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_token_types([3 if piece in SPECIALS else 1 for piece in pieces])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    sd = {name: value.detach().float().numpy() for name, value in model.state_dict().items()}

    def add(name: str, value: np.ndarray) -> None:
        if name in drop:
            return
        value = np.ascontiguousarray(value.T) if name in transpose else value
        if name in q8_0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(value, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, value)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
                 "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
        for short, long in names.items():
            add(f"blk.{i}.{short}.weight", sd[p + long + ".weight"])
        add(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        add(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
