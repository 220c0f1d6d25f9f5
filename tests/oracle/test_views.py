"""Terminal views fit the console: any number of layers and tokens at 80 and 120 columns, never a cell of '…', and
one short line per generated token. Printed numbers are checked against the oracle."""

import re

import pytest
import torch
from rich.console import Console

import bpe_tiny
import oracle
import nxl_hooks as nxl
from nxl_hooks.apps.terminal import print_generation, render_table
from nxl_hooks.records.tokens import readable_ids

LONG = ("The keys to the cabinet are on the table.\n\nThe key to the cabinets is on the table. "
        "Paris is a city and Rome is a city; they are what they are.")


@pytest.fixture(scope="module")
def tok():
    return bpe_tiny.bpe_tokenizer()


@pytest.fixture(scope="module")
def deep(tok):
    """A 30-block model, like SmolLM2-135M."""
    return bpe_tiny.bpe_llama(tok, layers=30)


def expected_scores(model, ids: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
    """Oracle NormXLogit (L+1, seq) after the (1, seq) ``ids`` of ``target`` (default: the model's prediction)."""
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    logits = oracle.llama(model).layer_logits(out.hidden_states)
    target = out.logits[:, -1].argmax(-1) if target is None else target
    return oracle.normxlogit(logits, out.hidden_states[0], target)[1][:, 0]


def printed(console: Console) -> list[str]:
    return console.export_text().rstrip("\n").split("\n")


@pytest.mark.parametrize("width", [80, 120])
def test_thirty_layers_and_a_long_text_fit_as_top_tokens_per_layer(deep, tok, width):
    res = nxl.explain(deep, tok, LONG)
    console = Console(record=True, width=width)
    assert render_table(res, console, title="NormXLogit") == "top"
    lines = printed(console)
    assert max(len(line) for line in lines) <= width and "…" not in "".join(lines)
    layer_lines = [line for line in lines if re.match(r"L\d+ ", line)]
    assert [line.split()[0] for line in layer_lines] == [f"L{layer}" for layer in range(31)]
    expected = expected_scores(deep, tok(LONG, return_tensors="pt")["input_ids"])
    names = readable_ids(tok, tok(LONG)["input_ids"])
    ranked = res.rankable(0)
    for layer, line in enumerate(layer_lines):
        entries = re.findall(r"(\d+):(\S+) (\S+)", line)
        assert len(entries) >= 3  # several tokens per layer fit even at 80 columns
        scores = expected[layer].masked_fill(~ranked, float("-inf"))
        best = scores.argsort(descending=True, stable=True)[: len(entries)].tolist()
        assert [int(position) for position, _, _ in entries] == best
        assert [name for _, name, _ in entries] == [names[p] for p in best]
        torch.testing.assert_close(torch.tensor([float(v) for _, _, v in entries]), expected[layer, best],
                                   rtol=1e-3, atol=1e-5)


def test_tables_are_used_when_they_fit(deep, tok):
    short = nxl.explain(deep, tok, "The capital of France is")
    console = Console(record=True, width=80)
    assert render_table(short, console) == "layers"  # 5 tokens x 31 layers: layers as rows
    lines = printed(console)
    assert max(len(line) for line in lines) <= 80 and "…" not in "".join(lines)
    expected = expected_scores(deep, tok("The capital of France is", return_tensors="pt")["input_ids"])
    rows = {cells[0]: cells[1:] for line in lines if line.startswith("│")
            for cells in [[c.strip() for c in line.split("│")[1:-1]]]}
    for layer in range(31):
        torch.testing.assert_close(torch.tensor([float(c) for c in rows[f"L{layer}"]]), expected[layer],
                                   rtol=1e-3, atol=1e-5)
    shallow = bpe_tiny.bpe_llama(tok, layers=3)
    console = Console(record=True, width=80)
    assert render_table(nxl.explain(shallow, tok, LONG), console) == "tokens"  # few layers: tokens as rows
    assert max(len(line) for line in printed(console)) <= 80


def test_generate_prints_one_short_line_per_token(deep, tok):
    console = Console(record=True, width=80)
    call = print_generation(deep, tok, "The capital of France is", 6, console=console)
    lines = printed(console)
    assert len(call.steps) == 6 and len(lines) == 3 + 6  # the prompt, a legend, one line per token, why it stopped
    assert lines[-1] == "stopped: 6 token(s) generated, as many as asked for (--generate 6)"
    assert max(len(line) for line in lines) <= 80
    sequence = call.sequences
    with torch.no_grad():  # causal: one forward over the whole sequence holds every prefix's hidden states
        out = deep(sequence, output_hidden_states=True)
    logits = oracle.llama(deep).layer_logits(out.hidden_states)[-1, 0]  # the last layer, (seq, vocab)
    for line, step in zip(lines[2:], call.steps):
        n = step.position
        step_number, token, p_label, probability, layer = line.split()[:5]
        assert (int(step_number), token, p_label, layer) == (step.step, step.readable[0], "p", "L30:")
        own = out.logits[0, n - 1].softmax(-1)[step.token[0]]
        assert float(probability) == pytest.approx(float(own), rel=5e-3)  # printed with 3 digits
        scores = out.hidden_states[0][0, :n].norm(dim=-1) * logits[:n, step.token[0]]
        top = [int(p) for p in re.findall(r" (\d+):", line.split("L30:")[1])]
        scores[n - 1] = float("-inf")  # the prediction position does not rank
        assert top == scores.argsort(descending=True)[: len(top)].tolist()


def test_labels_and_token_texts_are_printed_as_they_are():
    """Label names and token texts are the model's and tokenizer's: never read as rich markup or emoji codes ('[/pos]'
    and Mistral's '[/INST]' raised MarkupError, '[link=...]' wrote a hyperlink escape, ':smile:' became 😄)."""
    import io

    import tiny
    from nxl_hooks.apps.terminal import show_attribution

    labels = {0: "[link=https://evil.example]neg[/link]", 1: "[/pos] :smile:"}
    model = tiny.build_model("bert")
    model.config.id2label, model.config.label2id = labels, {name: i for i, name in labels.items()}
    words = [word if word != "awful" else "[/INST]" for word in tiny.VOCAB]  # the vocabulary keeps its size
    tok = tiny.word_tokenizer(words, "[CLS] $A [SEP]")
    res = nxl.explain(model, tok, "the film was [/INST]", target=[0, 1])
    for view in ("layers", "tokens", "top"):
        console = Console(file=io.StringIO(), record=True, width=200, force_terminal=True)
        render_table(res, console, title=f"NormXLogit of {labels[0]!r}, {labels[1]!r}", view=view)
        assert "\x1b]8;" not in console.file.getvalue()  # what a terminal gets: no OSC 8 hyperlink
        text = " ".join(console.export_text().split())  # a title wider than its table wraps
        assert f"NormXLogit of {labels[0]!r}, {labels[1]!r}" in text and "[/INST]" in text
    console = Console(file=io.StringIO(), record=True, width=200)
    show_attribution(res, console)
    text = " ".join(console.export_text().split())
    for title in (f"NormXLogit of {labels[0]!r} (id 0", f"NormXLogit of {labels[1]!r} (id 1",
                  f"Contrast: NormXLogit of {labels[0]!r} (id 0,", f"minus {labels[1]!r} (id 1,", "read at '[CLS]'"):
        assert title in text


def test_an_all_nan_contrastive_table_says_why():
    """Contrastive has no foil where every output is explained (a one-logit multi-label classifier; both labels of a
    2-label one) or the probabilities are unknown (regression): every score is NaN, and the terminal, which showed
    tables of "nan" and nothing else, says why in one line; a table with a foil has no such line."""
    import tiny
    from transformers import BertConfig, BertForSequenceClassification

    from nxl_hooks.apps.terminal import show_attribution

    torch.manual_seed(0)
    bce = BertForSequenceClassification(BertConfig(**tiny._SIZES, max_position_embeddings=64, num_labels=1,
                                                   problem_type="multi_label_classification")).eval()
    two, tok = tiny.build_model("bert"), tiny.tokenizer()
    for model, target, foiled in ((bce, "predicted", False), (two, ["LABEL_0", "LABEL_1"], False),
                                  (tiny.build_model("regression"), "predicted", False), (two, "LABEL_0", True)):
        res = nxl.explain(model, tok, "the film was good", methods=["contrastive"], target=target)
        assert bool(res.scores["contrastive"].isnan().any()) is not foiled
        console = Console(record=True, width=200)
        show_attribution(res, console, method="contrastive")
        lines = [line for line in console.export_text().splitlines() if "no output is left to be the foil" in line]
        assert len(lines) == (0 if foiled else 1), lines


def test_a_regression_title_says_the_prediction_of_the_output_explained_and_only_logats_formula():
    """A head of two regression outputs explained at its second: the title said the first output's prediction; and
    it gave LogAt's |HoT(h) - prediction| as what any other method's scores are."""
    import tiny
    from transformers import BertConfig, BertForSequenceClassification

    from nxl_hooks.apps.terminal import show_attribution

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**tiny._SIZES, max_position_embeddings=64, num_labels=2,
                                                     problem_type="regression")).eval()
    tok = tiny.tokenizer()
    with torch.no_grad():
        outputs = model(**tok("the film was good", return_tensors="pt")).logits[0].tolist()
    assert f"{outputs[0]:.4g}" != f"{outputs[1]:.4g}"
    res = nxl.explain(model, tok, "the film was good", target=1, methods=["contrastive"])
    for method, title in (("normxlogit", f"NormXLogit, regression: norm x |HoT(h) - prediction {outputs[1]:.4g}|"),
                          ("contrastive", f"contrastive, regression: prediction {outputs[1]:.4g}, read at")):
        console = Console(record=True, width=200)
        show_attribution(res, console, method=method)
        assert title in " ".join(console.export_text().split())


def test_a_regression_file_without_its_prediction_is_shown(tmp_path):
    """The regression title says the prediction where the record has it; a file without it (hand-made, older)
    is shown without the number (it raised KeyError)."""
    import tiny
    from nxl_hooks.apps.terminal import show_attribution

    model, tok = tiny.build_model("regression"), tiny.tokenizer()
    with torch.no_grad():
        prediction = float(model(**tok("the film was good", return_tensors="pt")).logits[0, 0])
    res = nxl.explain(model, tok, "the film was good")
    res.meta.pop("prediction")
    for shown, what in ((nxl.explain(model, tok, "the film was good"), f"prediction {prediction:.4g}|"),
                        (nxl.Attribution.load(res.save(tmp_path / "a.safetensors")), "prediction|")):
        console = Console(record=True, width=200)
        show_attribution(shown, console)
        assert f"NormXLogit, regression: norm x |HoT(h) - {what}, read at" in " ".join(console.export_text().split())
