"""The ``nxl`` command line, run in-process: the printed table, ``--out``, errors, and ``nxl demo``.

Every number is checked against the oracle (``output_hidden_states=True`` and the head by hand), never
against the library.
"""

import re

import pytest
import torch
from transformers import AutoTokenizer, LlamaForSequenceClassification

import nxl_hooks as nxl
import oracle
import tiny
from nxl_hooks.cli import main

TEXT = "the film was very good"


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    # rich sizes tables to COLUMNS when stdout is not a terminal: wide enough for rows = layers.
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny BERT classifier saved to disk (loaded by path, as a user would), with oracle NormXLogit."""
    path = tiny.save_model(tmp_path_factory.mktemp("models") / "bert", "bert", seed=0)
    model, tok = tiny.build_model("bert", 0), tiny.tokenizer()
    enc = tok(TEXT, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    logits = oracle.bert_classifier(model).layer_logits(out.hidden_states)  # (L+1, 1, seq, labels)
    return path, tok.convert_ids_to_tokens(enc["input_ids"][0]), logits, out.hidden_states[0]


def table_rows(text: str) -> dict[str, list[str]]:
    """{first cell: other cells} of the first rich table in ``text``; the header row is keyed 'layer'."""
    rows = {}
    for line in text.splitlines():
        if line.startswith(("┃", "│")):
            cells = [cell.strip() for cell in re.split(r"[┃│]", line)[1:-1]]
            rows.setdefault(cells[0], cells[1:])
        elif line.startswith("└"):
            break
    return rows


def test_attribute_prints_the_oracle_numbers_and_saves_them(saved, tmp_path, capsys):
    path, tokens, logits, embeddings = saved
    out_file = tmp_path / "a.safetensors"
    assert main(["attribute", str(path), TEXT, "--out", str(out_file)]) == 0
    printed = capsys.readouterr().out
    predicted = logits[-1, 0, 0].argmax()  # BERT reads [CLS]
    _, expected = oracle.normxlogit(logits, embeddings, predicted[None])  # (L+1, 1, seq)
    rows = table_rows(printed)
    assert rows["layer"] == tokens  # the header holds the tokens, [CLS] ... [SEP]
    for layer in range(expected.shape[0]):
        printed_scores = torch.tensor([float(cell) for cell in rows[f"L{layer}"]])
        torch.testing.assert_close(printed_scores, expected[layer, 0], rtol=1e-3, atol=1e-4)  # 4 digits shown
    res = nxl.Attribution.load(out_file)
    torch.testing.assert_close(res.normxlogit[:, 0], expected[:, 0], rtol=1e-4, atol=1e-5)
    assert res.tokens == [tokens] and res.layers == [0, 1, 2] and int(res.target[0]) == int(predicted)


def test_layers_and_target_list(saved, tmp_path, capsys):
    path, tokens, logits, embeddings = saved
    out_file = tmp_path / "b.safetensors"
    assert main(["attribute", str(path), TEXT, "--layers", "0,-1", "--target", "1,LABEL_0", "--out", str(out_file)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("LABEL_1' (id 1)") == 1 and printed.count("LABEL_0' (id 0)") == 1  # one table per target
    assert "L1" not in table_rows(printed)
    res = nxl.Attribution.load(out_file)
    assert res.layers == [0, 2] and res.target.tolist() == [[1, 0]]
    for k, label in enumerate((1, 0)):
        _, expected = oracle.normxlogit(logits, embeddings, torch.tensor([label]))
        torch.testing.assert_close(res.normxlogit[..., k], expected[[0, 2]], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "5"], "layer 5 is out of range"),
        (["--target", "7"], "target 7 is out of range"),
        (["--target", "joyful"], "label 'joyful' is not one of the model's labels"),
        (["--layers", "x"], "use 'all', 'last' or a comma list"),
    ],
    ids=["layer", "target-id", "target-label", "layers-syntax"],
)
def test_bad_input_exits_2_with_one_line(saved, capsys, argv, message):
    assert main(["attribute", str(saved[0]), TEXT, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_model_path_exits_2(tmp_path, capsys):
    assert main(["attribute", str(tmp_path / "nope"), TEXT]) == 2
    err = capsys.readouterr().err
    assert "no model folder at" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_demo_ranks_the_keyword_first_at_the_last_layer(capsys):
    from nxl_hooks.demo import MODEL_DIR
    from nxl_hooks.demo.task import HELD_OUT_SEED, make_examples

    assert main(["demo"]) == 0
    printed = capsys.readouterr().out
    # Independently: the shipped model's last layer by hand, the keyword must top the sentence's words.
    example = make_examples(1, seed=HELD_OUT_SEED)[0]
    model = LlamaForSequenceClassification.from_pretrained(MODEL_DIR).eval()
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    enc = tok(example.text, return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    assert out.logits.argmax(-1).item() == example.label
    logits = oracle.llama(model).layer_logits(out.hidden_states)
    _, expected = oracle.normxlogit(logits, out.hidden_states[0], out.logits.argmax(-1))
    words = expected[-1, 0, :-1]  # the last token is the [SEP] the classifier reads
    assert words.argmax().item() == example.evidence_index
    rows = table_rows(printed)
    torch.testing.assert_close(torch.tensor([float(c) for c in rows["L2"]]), expected[-1, 0], rtol=1e-3, atol=1e-4)
    match = re.search(rf"evidence '{example.evidence}' ranks per layer: .*L2 (\d+)/(\d+)", printed)
    assert match and match.groups() == ("1", str(len(example.words)))
    share = float(re.search(r"at the last layer in ([\d.]+)%", printed).group(1))
    assert share >= 85.0


def test_demo_sentence_needs_one_keyword(capsys):
    assert main(["demo", "good and terrible"]) == 2
    assert "exactly one sentiment keyword (found 2)" in capsys.readouterr().err
