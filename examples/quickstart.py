"""The README's Python example, end to end and offline: a tiny random Llama saved to a local folder, loaded back
the way a hub id would be, explained at every layer, during a forward and during generate.

    python examples/quickstart.py
"""

import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import nxl_hooks as nxl
from nxl_hooks.demo import MODEL_DIR

tok = AutoTokenizer.from_pretrained(MODEL_DIR)  # the demo's word-level tokenizer
with tempfile.TemporaryDirectory() as folder:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()  # a local path works exactly like a hub id

enc = tok(["the film was great"], return_tensors="pt")
with torch.no_grad(), nxl.attach(model, layers="all", tokenizer=tok) as probe:
    model(**enc)
res = probe.result()
print("normxlogit", tuple(res.normxlogit.shape), "layers", res.layers)
print("top tokens at the last layer:", res.top(3, layer=-1))

with torch.no_grad(), nxl.attach(model, tokenizer=tok) as probe:
    out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
for step in probe.steps:
    print(f"step {step.step}: emitted {tok.convert_ids_to_tokens(step.token.tolist())} "
          f"context {step.normxlogit.shape[-1]} tokens")
