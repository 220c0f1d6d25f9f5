"""The quantization audit: per-example metrics equal ones computed by hand from the oracle, reports lead with change."""

import json
import re
from pathlib import Path

import pytest
import torch
from scipy import stats
from transformers import (BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM, RobertaConfig,
                          RobertaForSequenceClassification)

import oracle
import tiny
from nxl_hooks import attach
from nxl_hooks.eval import audit
from nxl_hooks.apps.cli import main


def _oracle_scores(model, ids: torch.Tensor, target: int | None = None) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(NormXLogit (L+1, seq), target, logits at the last position) of a causal LM, from output_hidden_states."""
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        logits = oracle.llama(model).layer_logits(out.hidden_states)
    final = out.logits[0, -1].float()
    target = int(final.argmax()) if target is None else target
    _, scores = oracle.normxlogit(logits, out.hidden_states[0], torch.tensor([target]))
    return scores[:, 0], target, final


def _by_hand(ref: torch.Tensor, cand: torch.Tensor, top_k: int, ranked: slice = slice(1, -1)) -> dict:
    """Metrics per layer over the ``ranked`` positions: by default [CLS] (a special token) and the prediction position
    (the last token, [SEP]) are left out of rankings."""
    out = {"spearman": [], "kendall": [], "topk": [], "drift": []}
    for r, c in zip(ref, cand):
        a, b = r[ranked].double().numpy(), c[ranked].double().numpy()
        out["spearman"].append(stats.spearmanr(a, b).statistic)
        out["kendall"].append(stats.kendalltau(a, b).statistic)
        k = min(top_k, len(a))
        out["topk"].append(len(set(a.argsort()[::-1][:k]) & set(b.argsort()[::-1][:k])) / k)
        out["drift"].append(float((c - r).norm() / r.norm()))
    return out


def test_quantized_audit_matches_oracle(tmp_path):
    path = tiny.save_model(tmp_path / "llama", "llama", seed=3)
    data = tiny.write_jsonl(tmp_path / "data.jsonl", 5)
    assert (
        main(
            [
                "audit",
                "--reference",
                str(path),
                "--quantize",
                "8bit",
                str(data),
                "--out",
                str(tmp_path / "out"),
                "--top-k",
                "3",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())

    reference = LlamaForCausalLM.from_pretrained(path).eval()
    candidate = LlamaForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_8bit=True)).eval()
    assert type(candidate.model.layers[0].mlp.up_proj).__name__ == "Linear8bitLt"
    tok = tiny.tokenizer()
    agree = []
    for record, example in zip(records, tiny.examples(5)):
        ids = torch.tensor([tok(example["text"])["input_ids"]])
        ref, target, ref_logits = _oracle_scores(reference, ids)
        cand, _, cand_logits = _oracle_scores(candidate, ids, target)
        assert record["target"] == target and record["tokens"] == tok.convert_ids_to_tokens(ids[0])
        assert record["agree"] == (int(cand_logits.argmax()) == target)
        agree.append(record["agree"])
        assert record["candidate_output"] == pytest.approx(float(cand_logits.softmax(-1)[target]), rel=1e-4)
        torch.testing.assert_close(torch.tensor(record["reference_scores"]), ref[-1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(record["candidate_scores"]), cand[-1], rtol=1e-4, atol=1e-5)
        for name, values in _by_hand(ref, cand, 3).items():
            assert record[name] == pytest.approx(values, rel=1e-4, abs=1e-6), name
    assert summary["agreement"] == sum(agree) / len(agree)
    assert summary["per_layer"]["spearman"] == pytest.approx(
        [sum(r["spearman"][i] for r in records) / len(records) for i in range(3)]
    )


def test_a_regression_audit_report_shows_its_output_not_a_prediction_of_none():
    """A regression has no prediction to compare: its examples read "prediction None → None · explained: the
    reference's prediction 0"; they now name the one output and its change."""
    from nxl_hooks.apps.reports import audit_report

    model, tok = tiny.build_model("regression", 0), tiny.tokenizer()
    records = [{**audit.audit_example(model, model, tok, {"text": "the film was good", "id": "a"}), "index": 0}]
    page = audit_report(audit.aggregate(records), records)
    block = page[page.index('class="example"'):page.index("<h2>Per layer</h2>")]
    assert "None" not in block and "prediction" not in block
    assert "example 0 (id &#x27;a&#x27;) · explained: the one output (regression), output" in block


def test_a_regression_examples_target_is_said_unused():
    """A regression head explains its one output, as nxl evaluate says: a target in the data failed the example as a
    label the model lacks ("label 'good' is not one of the model's labels ['LABEL_0']")."""
    model, tok = tiny.build_model("regression", 0), tiny.tokenizer()
    record = audit.audit_example(model, model, tok, {"text": "the film was good", "target": "good"})
    assert record["target"] == 0 and record["explained"] == "reference prediction"
    assert record["dataset_target"] == "good" and record["spearman"] == pytest.approx([1.0] * 3)
    assert record["notes"] == ["target not used: a regression head explains its one output"]


@pytest.mark.parametrize("top_k", [0, -2, 2.5, True])
def test_a_top_k_that_is_no_positive_whole_number_is_a_value_error(top_k):
    """top_k=0 was a ZeroDivisionError, and a negative one sliced from the end: an overlap of -1, recorded."""
    model, tok = tiny.build_model("bert", 0), tiny.tokenizer()
    message = rf"^top_k={re.escape(repr(top_k))}: give the k of the top-k overlap as a whole number of at least 1$"
    with pytest.raises(ValueError, match=message):
        audit.audit_example(model, model, tok, {"text": "the film was good"}, top_k=top_k)
    with torch.no_grad(), attach(model, layers="all", tokenizer=tok) as probe:
        model(**tok("the film was good", return_tensors="pt"))
    with pytest.raises(ValueError, match=message):
        audit.compare(probe.result(), probe.result(), top_k=top_k)


def test_same_weights_show_no_change_and_a_changed_block_changes_only_the_layers_after_it():
    model, twin = tiny.build_model("bert", 0), tiny.build_model("bert", 0)
    tok, example = tiny.tokenizer(), {"text": "the film was very good"}
    record = audit.audit_example(model, twin, tok, example)
    assert record["agree"] and record["spearman"] == pytest.approx([1.0] * 3)
    assert record["kendall"] == pytest.approx([1.0] * 3) and record["topk"] == [1.0] * 3 and record["drift"] == [0.0] * 3
    with torch.no_grad():  # the last block's output projection changes: layers 0 and 1 stay, layer 2 moves
        weight = twin.bert.encoder.layer[1].output.dense.weight
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    record = audit.audit_example(model, twin, tok, example)
    ids = torch.tensor([tok(example["text"])["input_ids"]])
    scores = []
    for m in (model, twin):
        with torch.no_grad():
            out = m(input_ids=ids, output_hidden_states=True)
            logits = oracle.bert_classifier(m).layer_logits(out.hidden_states)
        scores.append(oracle.normxlogit(logits, out.hidden_states[0], torch.tensor([record["target"]]))[1][:, 0])
    ref, cand = scores
    expected = [float((c - r).norm() / r.norm()) for r, c in zip(ref, cand)]
    assert record["drift"][:2] == [0.0, 0.0] and expected[2] > 0.01
    assert record["drift"] == pytest.approx(expected, rel=1e-4, abs=1e-7)
    assert record["spearman"][:2] == pytest.approx([1.0, 1.0])


def test_a_candidate_whose_outputs_overflow_is_a_value_error_not_a_record_of_nans():
    """A float16 candidate whose last block overflows (NaN logits): the record gave its prediction as output 0, its
    output, last-layer scores and drift NaN (in records.jsonl and summary.json, which JSON has not); the example fails
    now, naming the model and what to do."""
    import copy

    model, tok = tiny.overflowing(tiny.build_model("llama", 0)), tiny.tokenizer()
    half = copy.deepcopy(model).half()
    ids = torch.tensor([tok("the film was very good")["input_ids"]])
    with torch.no_grad():
        assert model(input_ids=ids).logits.isfinite().all() and half(input_ids=ids).logits[0, -1].isnan().all()
    with pytest.raises(ValueError, match=r"^the candidate model's outputs at the prediction position are NaN or "
                                         r"infinite \(an overflow, as in float16\): load the model in bfloat16 or "
                                         r"float32$"):
        audit.audit_example(model, half, tok, {"text": "the film was very good"})


def test_a_float64_models_prediction_is_its_argmax_where_float32_would_tie_two_logits():
    """Two float64 logits 1e-12 apart: the reference's prediction (and the agreement) is its own argmax; its outputs
    were rounded to float32 first, where both are one number and the first was taken."""
    model, tok = tiny.build_model("llama", 0).double(), tiny.tokenizer()
    ids = torch.tensor([tok("the film was very good")["input_ids"]])
    own = tiny.tie_below_float32(model, input_ids=ids)
    top = int(own.argmax())
    assert own[top - 1] < own[top] and own[top - 1].float() == own[top].float()
    record = audit.audit_example(model, model, tok, {"text": "the film was very good"})
    assert record["reference_prediction"] == record["candidate_prediction"] == int(own.argmax())


def test_a_text_longer_than_either_model_reads_is_refused_in_one_line():
    """audit_example (the Python API, not only `nxl audit`) refuses a text past the shorter model's positions."""
    model, tok = tiny.build_model("bert", 0), tiny.tokenizer()
    limit = model.config.max_position_embeddings
    text = " ".join(["good"] * limit)
    with pytest.raises(ValueError, match=rf"the text is {limit + 2} tokens, but the model reads at most {limit} "):
        audit.audit_example(model, tiny.build_model("bert", 0), tok, {"text": text})


def test_report_leads_with_flipped_then_lowest_spearman(tmp_path):
    reference, candidate, tok = tiny.build_model("bert", 0), tiny.build_model("bert", 5), tiny.tokenizer()
    records = [
        {**audit.audit_example(reference, candidate, tok, ex), "index": i} for i, ex in enumerate(tiny.examples(8))
    ]
    summary = audit.aggregate(records)
    assert summary["flipped"] == sum(not r["agree"] for r in records) > 0
    from nxl_hooks.apps.reports import audit_report

    page = audit_report(summary, records, show=len(records))
    shown = [int(i) for i in re.findall(r'class="example" data-index="(\d+)"', page)]
    flipped = [i for i in shown if not records[i]["agree"]]
    assert shown[: len(flipped)] == flipped and len(flipped) == summary["flipped"]
    rest = [records[i]["spearman"][-1] for i in shown[len(flipped) :]]
    assert rest == sorted(rest)
    # an example that failed is in none of the figures: the page names it (as summary.json does), and only then
    assert "failed and are in none" not in page
    failed = audit_report({**summary, "failed": [{"index": 8, "id": "x<y", "error": "ValueError: too long"}]}, records)
    assert "1 example(s) failed and are in none of these figures" in failed
    assert "example 8 (x&lt;y): ValueError: too long" in failed
    assert page.index('class="example"') < page.index("<h2>Per layer</h2>")



@pytest.mark.parametrize("layers, shown", [([0], "layer 0, the last of the layers audited"),
                                           ("all", "layer 2, the model's last")])
def test_the_summary_and_report_name_the_layer_their_last_layer_numbers_are_of(layers, shown):
    """`nxl audit --layers 0` called layer 0's numbers "the last layer" (the tiny BERT's last is 2): the summary keeps
    last_layer and says which layer it is, and the report names it."""
    reference, candidate, tok = tiny.build_model("bert", 0), tiny.build_model("bert", 5), tiny.tokenizer()
    records = [{**audit.audit_example(reference, candidate, tok, ex, layers=layers), "index": i}
               for i, ex in enumerate(tiny.examples(3))]
    summary = audit.aggregate(records)
    index = 0 if layers == [0] else 2
    assert summary["last_layer_index"] == index and summary["model_last_layer"] == 2
    assert summary["last_layer"]["spearman"] == summary["per_layer"]["spearman"][-1]
    from nxl_hooks.apps.reports import audit_report

    page = audit_report(summary, records).replace("&#x27;", "'")  # (the model's: escaped as every text is)
    assert f"{shown}: Spearman" in page and f"lowest Spearman at {shown}" in page
    assert "last layer" not in page and f"layer {index}: Spearman" in page


def test_most_changed_puts_a_collapsed_ranking_first_and_a_text_too_short_to_rank_last():
    """Spearman is undefined both where one side's scores are all equal (the ranking collapsed: a real change) and
    where fewer than two tokens rank (nothing could change order); only the first is a change."""
    def record(agree, rho, topk, drift):
        return {"agree": agree, "spearman": [rho], "topk": [topk], "drift": [drift]}

    records = [record(True, None, None, 9.0),  # 0: one ranked token: no order to change, however large the drift
               record(True, 0.9, 0.8, 0.1),    # 1
               record(True, None, 0.2, 0.5),   # 2: the candidate's scores collapsed to one value
               record(False, 0.95, 1.0, 0.1),  # 3: flipped
               record(True, -0.3, 0.2, 0.2),   # 4
               record(True, 0.9, 0.8, 0.3)]    # 5: as 1, with more drift
    assert audit.most_changed(records) == [3, 2, 4, 5, 1, 0]
    # A real one-token text: both undefined (no order to change), so it comes after a real example's correlation.
    reference, candidate, tok = tiny.build_model("bert", 0), tiny.build_model("bert", 5), tiny.tokenizer()
    short, real = (audit.audit_example(reference, candidate, tok, {"text": text})
                   for text in ("good", "the film was good"))
    assert short["spearman"][-1] is None and short["topk"][-1] is None and real["spearman"][-1] is not None
    assert audit.most_changed([short, real]) == [1, 0]

def test_bad_arguments_say_what_to_do(tmp_path, capsys):
    data = tiny.write_jsonl(tmp_path / "data.jsonl", 2)
    assert main(["audit", "--reference", "x", str(data), "--out", str(tmp_path / "o")]) == 2
    assert "--candidate MODEL or --quantize" in capsys.readouterr().err


def test_what_both_models_explain_is_what_the_report_says_and_the_user_picks_it(tmp_path):
    """Issue 24 item 10: an example whose dataset target differs from the reference's prediction. By default (and
    as the docs say) both models explain the dataset's target; --explain reference explains the reference's
    prediction. The scores are the oracle's for that token, and the report names what was explained."""
    path = tiny.save_model(tmp_path / "ref", "llama", seed=3)
    other = tiny.save_model(tmp_path / "cand", "llama", seed=4)
    tok = tiny.tokenizer()
    reference = LlamaForCausalLM.from_pretrained(path).eval()
    text = "the film was very good"
    ids = torch.tensor([tok(text)["input_ids"]])
    _, predicted, _ = _oracle_scores(reference, ids)
    word = next(w for w in ("plot", "film", "bad") if tok.convert_tokens_to_ids(w) != predicted)
    wanted = tok.convert_tokens_to_ids(word)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": text, "target": word}) + "\n" + json.dumps({"text": "the plot was bad"}) + "\n")
    docs = " ".join((Path(__file__).resolve().parents[2] / "docs" / "faithfulness.md").read_text().split())
    assert "--explain reference" in docs and "the reference's prediction" in docs
    for flag, explained, token in (([], "target", wanted), (["--explain", "reference"], "reference prediction",
                                                             predicted)):
        out = tmp_path / f"out{len(flag)}"
        assert main(["audit", "--reference", str(path), "--candidate", str(other), str(data), "--out", str(out),
                     *flag]) == 0
        first, second = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
        assert (first["target"], first["explained"]) == (token, explained)
        assert (second["explained"], second["target"]) == ("reference prediction", second["reference_prediction"])
        scores, _, _ = _oracle_scores(reference, ids, token)
        torch.testing.assert_close(torch.tensor(first["reference_scores"]), scores[-1], rtol=1e-4, atol=1e-5)
        page = " ".join((out / "report.html").read_text().split())
        if explained == "target":
            assert f"explained: the dataset&#x27;s target &#x27;{word}&#x27; ({wanted})" in page
            assert ("both models explaining the dataset&#x27;s target in 1 examples, the reference&#x27;s prediction "
                    "in 1") in page
        else:
            assert "explained: the reference&#x27;s prediction " in page and "(the dataset&#x27;s target: " in page
            assert "both models explaining the reference&#x27;s prediction (nxl audit --explain)" in page


def test_a_candidate_whose_config_only_records_its_problem_type_has_the_references_head():
    """transformers writes problem_type at a fine-tune's first training forward: "single_label_classification" is
    what an unset one reads as, so the copy is the same head; multi-label reads its outputs otherwise."""
    from nxl_hooks.eval.audit import check_same_head

    reference, candidate = tiny.build_model("bert", seed=0), tiny.build_model("bert", seed=1)
    candidate.config.problem_type = "single_label_classification"
    check_same_head(reference, candidate)
    candidate.config.problem_type = "multi_label_classification"
    with pytest.raises(ValueError, match=r"the candidate has a sequence_classification head of 2 outputs \(LABEL_0, "
                                         r"LABEL_1, multi-label\) but the reference"):
        check_same_head(reference, candidate)


@pytest.mark.parametrize("layers, said", [
    ([], "has 1 blocks but the reference 2, so --layers reads layers 0..2 (3) of the reference and [0, 1] of the "
         "candidate; an audit compares each layer of the reference with the same layer of the candidate"),
    (["--layers", "2"], ": layer 2 is out of range: this model has 1 blocks"),
], ids=["all", "out-of-range"])
def test_a_candidate_the_layers_cannot_be_compared_on_is_one_line_before_any_example(tmp_path, capsys, layers, said):
    """Only the reference was checked before the dataset ran: a candidate of another depth failed every example
    (both models run on each) with "attribute the same text with the same layers", and left a partial --out."""
    reference = tiny.save_model(tmp_path / "ref", "llama", seed=3)
    shallow = LlamaForCausalLM(LlamaConfig(**{**tiny._SIZES, "num_hidden_layers": 1}, num_key_value_heads=2))
    candidate = tiny.save_model(tmp_path / "cand", "llama", model=shallow)
    data = tiny.write_jsonl(tmp_path / "data.jsonl", 3)
    out = tmp_path / "out"
    assert main(["audit", "--reference", str(reference), "--candidate", str(candidate), str(data), "--out", str(out),
                 *layers]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(f"nxl audit: error: the candidate {candidate}") and said in err, err
    assert "example 0 failed" not in err and not out.exists()


def _roberta(positions: int) -> torch.nn.Module:
    """A tiny RoBERTa classifier over tiny.VOCAB whose position table starts after padding_idx 1, as RoBERTa's."""
    torch.manual_seed(0)
    config = RobertaConfig(**{**tiny._SIZES, "pad_token_id": 1}, max_position_embeddings=positions)
    return RobertaForSequenceClassification(config).eval()


def test_a_roberta_text_as_long_as_its_positions_hold_is_audited_and_one_token_more_refused_by_the_shorter_model():
    """RoBERTa's position ids start after padding_idx, so its table holds fewer tokens than max_position_embeddings:
    the model's own forward is the oracle (it runs on the longest text that fits and fails on one token more). The
    audit takes exactly that text, refuses the next in one line (not the model's IndexError), and the limit is the
    shorter model's whichever of the two it is."""
    roberta, bert, tok = _roberta(12), tiny.build_model("bert", 0), tiny.tokenizer()
    texts = [" ".join(["good"] * words) for words in range(1, 20)]
    runs = []
    for text in texts:
        try:
            with torch.no_grad():
                roberta(**tok(text, return_tensors="pt"))
            runs.append(True)
        except (IndexError, RuntimeError):  # (an embedding or a gather past the position table)
            runs.append(False)
    fits = runs.index(False) - 1
    assert fits > 0 and not any(runs[fits + 1:])
    longest, over = texts[fits], texts[fits + 1]
    limit = len(tok(longest)["input_ids"])
    assert len(tok(over)["input_ids"]) == limit + 1 < bert.config.max_position_embeddings
    record = audit.audit_example(roberta, roberta, tok, {"text": longest})
    assert record["tokens"] == tok.convert_ids_to_tokens(tok(longest)["input_ids"])
    for reference, candidate in ((roberta, roberta), (roberta, bert), (bert, roberta)):
        with pytest.raises(ValueError, match=rf"^the text is {limit + 1} tokens, but the model reads at most {limit} "):
            audit.audit_example(reference, candidate, tok, {"text": over})


def test_each_records_outputs_and_predictions_are_the_models_own_and_the_summary_counts_them():
    """Both models explain the dataset's target (label 'pos', where the reference may predict 'neg'): each record's
    outputs are the target's probability in each model's own softmax, its predictions each model's own argmax and
    label name, and the summary's agreement, flips and output change follow from those logits."""
    reference, candidate, tok = tiny.build_model("bert", 0), tiny.build_model("bert", 5), tiny.tokenizer()
    examples = [{"text": example["text"], "target": "pos"} for example in tiny.examples(8)]
    for model in (reference, candidate):
        model.config.id2label, model.config.label2id = {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1}
        # a random tiny BERT predicts one class, nearly sure, for every text: its margins centred and spread to +-3
        with torch.no_grad():
            margins = sorted(float(logits[1] - logits[0]) for logits in (
                model(**tok(example["text"], return_tensors="pt")).logits[0] for example in examples))
            middle = (margins[3] + margins[4]) / 2
            model.classifier.bias[1] -= middle
            scale = 3 / max(abs(margin - middle) for margin in margins)
            model.classifier.weight.mul_(scale)
            model.classifier.bias.mul_(scale)
    records = [audit.audit_example(reference, candidate, tok, example) for example in examples]
    own, changes = [], []
    for record, example in zip(records, examples):
        with torch.no_grad():
            ref, cand = (model(**tok(example["text"], return_tensors="pt")).logits[0].softmax(-1)
                         for model in (reference, candidate))
        ref_top, cand_top = int(ref.argmax()), int(cand.argmax())
        own.append((ref_top, cand_top))
        assert record["target"] == 1 and record["explained"] == "target" and record["target_text"] == "pos"
        assert (record["reference_prediction"], record["candidate_prediction"]) == (ref_top, cand_top)
        assert record["reference_prediction_text"] == ["neg", "pos"][ref_top]
        assert record["candidate_prediction_text"] == ["neg", "pos"][cand_top]
        assert record["agree"] is (ref_top == cand_top)
        assert record["reference_output"] == pytest.approx(float(ref[1]), rel=1e-5)
        assert record["candidate_output"] == pytest.approx(float(cand[1]), rel=1e-5)
        changes.append(abs(float(cand[1]) - float(ref[1])))
    flips = sum(ref_top != cand_top for ref_top, cand_top in own)
    assert 0 < flips < len(examples) and {ref_top for ref_top, _ in own} == {0, 1}  # (each case is checked)
    summary = audit.aggregate(records)
    assert summary["flipped"] == flips and summary["agreement"] == pytest.approx(1 - flips / len(examples))
    assert summary["output_change"] == pytest.approx(sum(changes) / len(changes), rel=1e-5)
    assert summary["explained"] == {"target": len(examples), "reference prediction": 0}


def test_an_example_whose_embedding_norms_are_equal_is_flagged_flat_and_counted():
    """A model whose embedding rows all have one norm (as models that normalize them): NormXLogit ranks as LogAt, and
    the record says so (flat_norms) where a random model's does not; the summary counts the flagged examples. The
    spread is worked out by hand from the input of block 1 on the ranked tokens (all but the prediction and the
    special tokens)."""
    import bpe_tiny

    tok = bpe_tiny.bpe_tokenizer()
    flat, plain = bpe_tiny.bpe_llama(tok, seed=1), bpe_tiny.bpe_llama(tok, seed=1)
    with torch.no_grad():
        weight = flat.model.embed_tokens.weight
        weight.mul_(3.0 / weight.norm(dim=-1, keepdim=True).clamp_min(1e-6))
    text = "The capital of France is"
    ids = torch.tensor([tok(text)["input_ids"]])
    ranked = [i for i, token in enumerate(ids[0].tolist()[:-1]) if token not in tok.all_special_ids]
    spreads = []
    for model in (flat, plain):
        with torch.no_grad():
            norms = model(input_ids=ids, output_hidden_states=True).hidden_states[0][0, ranked].double().norm(dim=-1)
        spreads.append(float(norms.std(unbiased=False) / norms.mean()))
    assert len(ranked) > 1 and spreads[0] < 1e-6 and spreads[1] > 1e-2
    records = [audit.audit_example(model, model, tok, {"text": text}) for model in (flat, plain)]
    assert [record["flat_norms"] for record in records] == [True, False]
    assert audit.aggregate(records)["flat_norms"] == 1


def test_a_text_with_fewer_ranked_tokens_than_k_overlaps_over_those_it_has():
    """top_k=5 on a text of two ranked words: each model's top k is both words, so the overlap is 1 at every layer
    (|both| / 2), whatever the two models score, not |both| / k (0.4)."""
    reference, candidate, tok = tiny.build_model("bert", 0), tiny.build_model("bert", 5), tiny.tokenizer()
    text = "good film"
    assert len(tok(text)["input_ids"]) == 4  # [CLS] good film [SEP]: the two words rank, [CLS] and [SEP] do not
    record = audit.audit_example(reference, candidate, tok, {"text": text}, top_k=5)
    assert record["topk"] == [1.0] * len(record["layers"])


def test_the_means_leave_out_what_says_nothing_and_say_how_many_and_why():
    """A text of one ranked token has no correlation or overlap; one of no more ranked tokens than k overlaps 1
    whatever changed. The means left both out silently and counted the second as agreement: each mean now says over
    how many examples it is (``counted``), why the others are not in it (``left_out``), and the report says so."""
    reference, candidate, tok = tiny.build_model("bert", 0), tiny.build_model("bert", 5), tiny.tokenizer()
    texts = ["good", "good film", "the film was good and the film was good"]
    records = [audit.audit_example(reference, candidate, tok, {"text": text}, top_k=5) for text in texts]
    specials = set(tok.all_special_ids)
    # the tokenizer's own count: every token but the special ones ([CLS], [SEP]: the prediction position)
    assert [r["ranked"] for r in records] == [sum(i not in specials for i in tok(t)["input_ids"]) for t in texts]
    assert [r["ranked"] for r in records] == [1, 2, 9]
    short, two, long_ = records
    layers = len(short["layers"])
    assert short["spearman"][-1] is None and short["topk"][-1] is None and two["topk"] == [1.0] * layers
    assert all(r["spearman"][-1] is not None for r in (two, long_)) and all(r["drift"][-1] for r in records)
    summary = audit.aggregate(records)
    # only the long text's overlap says anything: the mean is its own, not pulled up by the two-word text's 1
    assert summary["per_layer"]["topk"] == long_["topk"]
    assert summary["per_layer"]["spearman"] == [(a + b) / 2 for a, b in zip(two["spearman"], long_["spearman"])]
    assert summary["counted"] == {"spearman": [2] * layers, "kendall": [2] * layers, "topk": [1] * layers,
                                  "drift": [3] * layers}
    assert summary["left_out"] == {"spearman": {audit.SHORT: 1}, "kendall": {audit.SHORT: 1},
                                   "topk": {audit.SHORT: 1, audit.ALL_RANKED: 1}, "drift": {}}
    from nxl_hooks.apps.reports import audit_report

    page = audit_report(summary, records).replace("&#x27;", "'")
    assert ("top-5 overlap: 2 of 3 examples left out (1: fewer than two ranked tokens; 1: no more ranked tokens than "
            "k (its overlap is 1 whatever changed))") in page
    assert "Spearman: 1 of 3 examples left out (1: fewer than two ranked tokens)" in page and "drift:" not in page
    # an audit where every mean is over every example says nothing of the kind
    assert "leave out" not in audit_report(audit.aggregate([long_]), [long_])
