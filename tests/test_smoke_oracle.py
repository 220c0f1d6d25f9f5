import torch
from transformers import LlamaConfig, LlamaForCausalLM

import nxl_hooks as nxl
from oracle import layer_logits, linear, normxlogit, rms_norm


def test_llama_all_layers_match_oracle():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 100, (1, 7))
    with torch.no_grad(), nxl.attach(model) as probe:
        out = model(input_ids=ids, output_hidden_states=True)
    res = probe.result()
    logits = layer_logits(out.hidden_states, rms_norm(model.model.norm), linear(model.lm_head), last_is_normed=True)
    logat, nxl_ref = normxlogit(logits, out.hidden_states[0], res.target)
    torch.testing.assert_close(res.logat, logat, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res.normxlogit, nxl_ref, rtol=1e-4, atol=1e-5)
