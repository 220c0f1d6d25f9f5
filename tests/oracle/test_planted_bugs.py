"""Tests written to catch six bugs that, planted by hand one at a time, passed the rest of the suite (issue 12).

Each checks against an independent oracle (tests/oracle.py, scipy, softmax by hand), never the library itself,
on inputs chosen so that the bug changes the answer: a generation long enough to grow the feature cache twice,
rows with different targets, a flipped payload byte, a pair whose probability is far from 0.5, padded rows,
and a candidate whose prediction differs from the reference's.
"""

import pytest
import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM

import nxl_hooks as nxl
import oracle
import tiny
from nxl_hooks.eval import audit
from nxl_hooks.eval import faithfulness as ev
from nxl_hooks.records import reader, writer
from oracle import check_call
from tiny import word_tokenizer


@pytest.fixture(scope="module")
def lm() -> LlamaForCausalLM:
    return tiny.generating_llama()


# -- 1. the generation feature cache keeps its old rows when it grows ---------------------------------------


def test_generation_past_two_cache_growths_matches_the_uncached_oracle(lm):
    """The cache starts at 16 positions and doubles: 7 + 40 positions grow it twice (16 -> 32 -> 64)."""
    ids = torch.randint(1, tiny.GEN_VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    with nxl.attach(lm, layers="all") as probe:
        out = lm.generate(input_ids=ids, max_new_tokens=40, do_sample=False)
    emitted = out[0, 7:].tolist()
    # the test can tell the emitted token from the previous one and one step from another
    assert all(a != b for a, b in zip(emitted, emitted[1:])) and len(set(emitted)) > 10
    argmaxes = check_call(lm, probe.calls[0], 40)  # every step against a re-run of its whole prefix
    assert all(torch.equal(a, s.token) for a, s in zip(argmaxes, probe.steps))
    assert probe.steps[-1].position == 46


# -- 2. a per-row target tensor explains each row's own ids -------------------------------------------------


def test_per_row_target_tensor_explains_each_rows_own_ids(lm):
    ids = torch.randint(1, tiny.GEN_VOCAB, (3, 6), generator=torch.Generator().manual_seed(21))
    hand = oracle.llama(lm)
    with torch.no_grad():
        out = lm(input_ids=ids, output_hidden_states=True)
    logits = hand.layer_logits(out.hidden_states)  # (L+1, rows, seq, vocab)
    for target in (torch.tensor([3, 40, 77]), torch.tensor([[3, 5], [40, 9], [77, 60]])):
        with torch.no_grad(), nxl.attach(lm, target=target) as probe:
            lm(input_ids=ids)
        res = probe.result()
        columns = target if target.dim() == 2 else target[:, None]
        for row in range(3):
            for k, label in enumerate(columns[row].tolist()):
                _, expected = oracle.normxlogit(logits[:, row:row + 1], out.hidden_states[0][row:row + 1],
                                                torch.tensor([label]))
                got = res.normxlogit[:, row] if target.dim() == 1 else res.normxlogit[:, row, :, k]
                torch.testing.assert_close(got, expected[:, 0], rtol=1e-4, atol=1e-5)


def test_per_row_target_tensor_in_generate(lm):
    ids = torch.randint(1, tiny.GEN_VOCAB, (2, 5), generator=torch.Generator().manual_seed(22))
    with nxl.attach(lm, target=torch.tensor([8, 61])) as probe:
        lm.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    call, hand = probe.calls[0], oracle.llama(lm)
    for step in call.steps:
        assert step.target.tolist() == [8, 61]
        logits, embeddings = oracle.prefix_logits(lm, hand, call.sequences[:, : step.position],
                                                  torch.ones(2, step.position, dtype=torch.bool))
        _, expected = oracle.normxlogit(logits, embeddings, torch.tensor([8, 61]))
        torch.testing.assert_close(step.normxlogit, expected, rtol=1e-4, atol=1e-4)


# -- 3. read_stream checks every frame's checksum ----------------------------------------------------------


def test_read_stream_refuses_a_frame_with_a_flipped_payload_byte(lm, tmp_path):
    ids = torch.randint(1, tiny.GEN_VOCAB, (1, 5), generator=torch.Generator().manual_seed(23))
    path = tmp_path / "run.nxl"
    with nxl.attach(lm, sink=path) as probe:
        lm.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    data = path.read_bytes()
    frames = list(reader._frames(data))  # (index, offset, payload, why); frame 0 is the call, 1.. the steps
    index, offset, payload, _ = frames[4]  # step 3
    # a byte inside the tensor data (after the safetensors header): the blob still parses, only the CRC can tell
    header_size = int.from_bytes(payload[:8], "little")
    where = offset + writer._FRAME.size + 8 + header_size + 5
    flipped = bytearray(data)
    flipped[where] ^= 0x40
    path.write_bytes(bytes(flipped))
    with pytest.warns(reader.StreamDamageWarning, match=f"frame {index} at byte {offset}.*checksum"):
        calls = nxl.read_stream(path)
    (call,) = calls
    assert len(call.steps) == 3 and not call.complete
    assert (calls.damage.frame, calls.damage.offset, calls.damage.steps_recovered) == (index, offset, 3)
    assert not calls.damage.torn and calls.damage.frames_after == len(frames) - index - 1
    assert (call.thread, call.request_id) == (probe.calls[0].thread, probe.calls[0].request_id)
    for read, kept in zip(call.steps, probe.steps):  # what comes before the damage is exact
        assert torch.equal(read.normxlogit, kept.normxlogit)
    with pytest.raises(reader.StreamError, match=f"damaged: frame {index} at byte {offset}"):
        nxl.read_stream(path, strict=True)


# -- 4. evaluate's pair probability is p(target) over (target, foil) ---------------------------------------

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "fine", "plain", "bad", "the", "key", "keys", "is", "are"]


def test_pair_probability_is_the_targets_share_of_the_pair():
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)).eval()
    with torch.no_grad():
        model.lm_head.weight[WORDS.index("is")] += 0.5 * model.model.norm.weight  # "is" well above "are"
    tok = word_tokenizer(WORDS, "[CLS] $A")
    text = "the key the keys good"
    ranking = [0.0, 5.0, 4.0, 3.0, 2.0, 1.0]  # drop "the", "key", "the", "keys", "good" in that order
    rec = ev.score_example(model, tok, {"text": text, "target": "is", "foil": "are", "label": "is"}, methods=(),
                           custom={"mine": ranking})
    ids = tok(text)["input_ids"]

    def p_is(row: list[int]) -> float:  # softmax over the pair (is, are), by hand
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([row])).logits[0, -1]
        pair = logits[[WORDS.index("is"), WORDS.index("are")]]
        return float(torch.exp(pair[0]) / torch.exp(pair).sum())

    original = p_is(ids)
    assert rec["probability"] == "pair" and abs(original - 0.5) > 0.05
    assert rec["output"] == pytest.approx(original, abs=1e-5)
    assert rec["correct"] is (original > 0.5)
    for count, change in zip(rec["counts"], rec["methods"]["mine"]["comprehensiveness"]):
        kept = [ids[0], *ids[1 + count:]]  # [CLS] and the prediction position are never removed
        if count >= len(ids) - 1:
            kept = [ids[0], ids[-1]]
        assert change == pytest.approx(original - p_is(kept), abs=1e-5)


# -- 5 and 6. the audit ranks real tokens only, and both models explain the reference's target ---------------


def _oracle_normxlogit(model, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(L+1, rows, seq) NormXLogit of a Llama LM at one target per row, from output_hidden_states."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        logits = oracle.llama(model).layer_logits(out.hidden_states)
        return oracle.normxlogit(logits, out.hidden_states[0], targets)[1]


def _metrics_by_hand(ref: torch.Tensor, cand: torch.Tensor, ranked: torch.Tensor, real: torch.Tensor, k: int):
    a, b = ref[ranked].double().numpy(), cand[ranked].double().numpy()
    top = lambda v: set(v.argsort(kind="stable")[::-1][:k].tolist())  # noqa: E731
    return (stats.spearmanr(a, b).statistic, stats.kendalltau(a, b).statistic, len(top(a) & top(b)) / k,
            float((cand - ref)[real].norm() / ref[real].norm()))


def test_audit_compare_ranks_only_real_tokens_of_a_padded_row():
    reference, candidate, tok = tiny.build_model("llama", 0), tiny.build_model("llama", 1), tiny.tokenizer()
    tok.padding_side = "right"
    enc = tok(["the film was very good and the plot was great", "bad plot"], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with torch.no_grad(), nxl.attach(reference, tokenizer=tok) as probe:
        reference(input_ids=ids, attention_mask=mask)
    ref = probe.result()
    with torch.no_grad(), nxl.attach(candidate, tokenizer=tok, target=ref.target) as probe:
        candidate(input_ids=ids, attention_mask=mask)
    cand = probe.result()
    expected_ref = _oracle_normxlogit(reference, ids, mask, ref.target)
    expected_cand = _oracle_normxlogit(candidate, ids, mask, ref.target)
    row, k = 1, 2
    real = mask[row].bool()
    n = int(real.sum())  # "[CLS] bad plot [SEP]", then padding; the prediction is read at [SEP]
    assert n == 4 and not real[n:].any()
    ranked = torch.zeros_like(real)
    ranked[1:n - 1] = True  # neither [CLS], nor the prediction position, nor padding
    got = audit.compare(ref, cand, row=row, top_k=k)
    for layer in range(len(got["layers"])):
        rho, tau, overlap, drift = _metrics_by_hand(expected_ref[layer, row], expected_cand[layer, row], ranked,
                                                    real, k)
        assert got["spearman"][layer] == pytest.approx(rho, abs=1e-6)
        assert got["kendall"][layer] == pytest.approx(tau, abs=1e-6)
        assert got["topk"][layer] == pytest.approx(overlap)
        assert got["drift"][layer] == pytest.approx(drift, rel=1e-4)


def test_audit_candidate_explains_the_references_target_when_its_prediction_flips():
    reference, candidate, tok = tiny.build_model("llama", 0), tiny.build_model("llama", 1), tiny.tokenizer()
    example = tiny.examples(3)[2]
    record = audit.audit_example(reference, candidate, tok, example, top_k=3)
    ids = torch.tensor([tok(example["text"])["input_ids"]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref_pred = int(reference(input_ids=ids).logits[0, -1].argmax())
        cand_pred = int(candidate(input_ids=ids).logits[0, -1].argmax())
    assert ref_pred != cand_pred and record["agree"] is False  # the case the bug needs
    assert record["target"] == ref_pred and record["candidate_prediction"] == cand_pred
    expected = _oracle_normxlogit(candidate, ids, mask, torch.tensor([ref_pred]))[-1, 0]
    own = _oracle_normxlogit(candidate, ids, mask, torch.tensor([cand_pred]))[-1, 0]
    assert not torch.allclose(expected, own, rtol=1e-2)  # explaining its own prediction would be told apart
    torch.testing.assert_close(torch.tensor(record["candidate_scores"]), expected, rtol=1e-4, atol=1e-5)
    ref_scores = _oracle_normxlogit(reference, ids, mask, torch.tensor([ref_pred]))
    cand_scores = _oracle_normxlogit(candidate, ids, mask, torch.tensor([ref_pred]))
    ranked = torch.zeros(ids.shape[1], dtype=torch.bool)
    ranked[1:-1] = True
    for layer in range(3):
        rho, _, overlap, drift = _metrics_by_hand(ref_scores[layer, 0], cand_scores[layer, 0], ranked,
                                                  torch.ones_like(ranked), 3)
        assert record["spearman"][layer] == pytest.approx(rho, abs=1e-6)
        assert record["topk"][layer] == pytest.approx(overlap)
        assert record["drift"][layer] == pytest.approx(drift, rel=1e-4)
