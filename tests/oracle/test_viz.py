"""HTML heatmaps and report pages show the right numbers, and need nothing from the network."""

import json
import re

import pytest
import torch

import oracle
import tiny
from nxl_hooks.eval import faithfulness as ev
from nxl_hooks.apps.reports import evaluate_report
from nxl_hooks.records.html import heatmap, line_chart

TEXTS = ["the film was very good", "bad plot"]


@pytest.fixture(scope="module")
def explained():
    """(attribution, oracle NormXLogit (L+1, batch, seq), attention mask) of a padded batch on a tiny BERT."""
    import nxl_hooks as nxl

    model, tok = tiny.build_model("bert", 0), tiny.tokenizer()
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad(), nxl.attach(model, tokenizer=tok) as probe:
        out = model(**enc, output_hidden_states=True)
        logits = oracle.bert_classifier(model).layer_logits(out.hidden_states)
    _, expected = oracle.normxlogit(logits, out.hidden_states[0], out.logits.argmax(-1))
    return probe.result(), expected, enc["attention_mask"].bool()


def assert_heatmap_matches(page: str, expected: torch.Tensor, mask: torch.Tensor) -> None:
    """One table per row; cells token-major, one per (real token, layer), each equal to the oracle's score."""
    cells = tiny.elements(page, "td", "nxl-cell")
    start = 0
    for row in range(expected.shape[1]):
        real = mask[row].nonzero().flatten()
        want = expected[:, row, real].T.flatten()  # (tokens, layers), row-major like the table
        got = cells[start : start + len(want)]
        start += len(want)
        torch.testing.assert_close(torch.tensor([float(c["data-value"]) for c in got]), want, rtol=1e-4, atol=1e-5)
        layers = expected.shape[0]
        assert [(int(c["data-row"]), int(c["data-col"])) for c in got] == [
            (i, layer) for i in range(len(real)) for layer in range(layers)
        ]
    assert start == len(cells)


def test_to_html_heatmap_equals_oracle_and_writes_file(explained, tmp_path):
    res, expected, mask = explained
    page = res.to_html(tmp_path / "a.html")
    assert (tmp_path / "a.html").read_text() == page
    assert_heatmap_matches(page, expected, mask)
    assert "0: [CLS] ◀" in page and "[PAD]" not in page  # the prediction position is marked; padding is left out


def test_pages_are_self_contained(explained):
    res, _, _ = explained
    page = res.to_html()
    assert page.startswith("<!DOCTYPE html>")
    for external in ("http:", "https:", "//cdn", "<script", "<link", "src=", "url(", "@import"):
        assert external not in page


def test_repr_html_is_a_styled_fragment(explained):
    res, expected, mask = explained
    fragment = res._repr_html_()
    assert "<html" not in fragment and fragment.startswith("<style>")
    assert_heatmap_matches(fragment, expected, mask)


def test_heatmap_colour_follows_sign_and_column_scale():
    page = heatmap(["a", "b"], ["L0", "L1"], [[2.0, -0.1], [-1.0, None]])
    styles = [c.get("style", "") for c in tiny.elements(page, "td", "nxl-cell")]
    assert styles[0].startswith("background:rgb(214,39,40)")  # the column maximum: full red
    assert styles[1].startswith("background:rgb(31,119,180)")  # alone in its column: full blue
    assert styles[2].startswith("background:rgb(143,187,218)")  # half of the column maximum, negative
    assert styles[3] == ""  # None stays blank


def test_line_chart_points_carry_values_and_none_breaks_the_line():
    svg = line_chart(
        [1, 2, 3, 4], {"a": [0.5, None, 0.25, 0.0], "b": [1.0, 1.0, 1.0, 1.0]}, title="t", x_label="x", y_label="y"
    )
    points = tiny.elements(svg, "circle", "nxl-point")
    assert [(p["data-series"], float(p["data-x"]), float(p["data-y"])) for p in points] == [
        ("a", 1, 0.5),
        ("a", 3, 0.25),
        ("a", 4, 0.0),
        ("b", 1, 1.0),
        ("b", 2, 1.0),
        ("b", 3, 1.0),
        ("b", 4, 1.0),
    ]
    assert len(tiny.elements(svg, "polyline")) == 2  # a's lone first point draws no segment
    ys = {float(p["data-y"]): float(p["cy"]) for p in points}
    assert ys[1.0] < ys[0.5] < ys[0.25] < ys[0.0]  # higher values are drawn higher


def test_line_chart_leaves_out_non_finite_values_and_keeps_its_axis():
    """An inf breaks the line like None and does not set the axis (it pushed every finite point off the plot)."""
    finite = line_chart([1, 2, 3], {"a": [0.5, 0.25, 0.0]}, title="t", x_label="x", y_label="y")
    svg = line_chart([1, 2, 3, 4], {"a": [0.5, 0.25, 0.0, float("inf")], "b": [float("-inf")] * 4},
                     title="t", x_label="x", y_label="y")
    points = tiny.elements(svg, "circle", "nxl-point")
    assert [(p["data-series"], float(p["data-y"])) for p in points] == [("a", 0.5), ("a", 0.25), ("a", 0.0)]
    assert [p["cy"] for p in points] == [p["cy"] for p in tiny.elements(finite, "circle", "nxl-point")]


def evaluate_page() -> tuple[str, dict]:
    model, tok = tiny.build_model("bert", 0), tiny.tokenizer()
    records = [ev.score_example(model, tok, example, ["random", "normxlogit"]) for example in tiny.examples(2)]
    summary = ev.aggregate(records)
    return evaluate_report(summary), summary


def test_evaluate_report_plots_the_summary():
    page, summary = evaluate_page()
    points = tiny.elements(page, "circle", "nxl-point")
    curves = summary["methods"]
    first_chart = points[: 2 * len(summary["ks"])]  # comprehensiveness comes first
    assert [float(p["data-y"]) for p in first_chart] == curves["random"]["comprehensiveness_curve"] + curves[
        "normxlogit"
    ]["comprehensiveness_curve"]
    assert [float(p["data-x"]) for p in first_chart[:9]] == [10, 20, 30, 40, 50, 60, 70, 80, 90]
    ap_table = page[page.index("Average precision of the evidence") : page.index("Normalized dot product")]
    cells = [float(c["data-value"]) for c in tiny.elements(ap_table, "td", "nxl-cell")]
    layers = len(summary["layers"])
    assert cells == curves["random"]["ap"] * layers + curves["normxlogit"]["ap"]
    assert re.search(r"<td>random \(baseline\)</td>", page) and re.search(r"<td>normxlogit</td>", page)


def test_evaluate_report_plots_each_k_at_the_percentage_given():
    """round(100 * K) plotted K = 0.125 at 12 and 0.025 at 2 (and labelled them so); each point sits at 100 x K."""
    model, tok = tiny.build_model("bert", 0), tiny.tokenizer()
    ks = (0.025, 0.125, 0.5)
    records = [ev.score_example(model, tok, example, ["random"], ks=ks) for example in tiny.examples(2)]
    page = evaluate_report(ev.aggregate(records))
    assert [float(p["data-x"]) for p in tiny.elements(page, "circle", "nxl-point")[:3]] == [2.5, 12.5, 50]
    assert ">12.5</text>" in page and ">12</text>" not in page


def _summary_rows(page: str) -> dict[str, list[tuple[str, bool]]]:
    """The summary table of an evaluate page: method -> its cells as (text, bold)."""
    table = page[page.index('<table class="nxl-stats">'):]
    table = table[:table.index("</table>")]
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", table.split("<tbody>")[1]):
        cells = re.findall(r"<td( class=best)?>(.*?)</td>", row)
        rows[cells[0][1]] = [(text, bool(bold)) for bold, text in cells[1:]]
    return rows


def test_the_random_baseline_is_never_best():
    """Issue 24, item 16: random's 0 s / example (and any score it wins by chance) was bolded as best; best is now
    among the real methods, and random is labelled a baseline."""
    page, summary = evaluate_page()
    rows = _summary_rows(page)
    assert set(rows) == {"random (baseline)", "normxlogit"}
    assert summary["methods"]["random"]["seconds"] == 0.0 < summary["methods"]["normxlogit"]["seconds"]
    assert not any(bold for _, bold in rows["random (baseline)"])
    assert all(bold for text, bold in rows["normxlogit"] if text != "–")  # the only real method: best everywhere
    assert "never best" in page


@pytest.mark.parametrize("ap, best", [
    ({"logat": 0.5, "normxlogit": 0.5, "contrastive": 0.25}, {"logat", "normxlogit"}),  # a tie: both best
    ({"logat": 0.5, "normxlogit": 0.75, "contrastive": 0.75}, {"normxlogit", "contrastive"}),
    ({"logat": 0.25, "normxlogit": 0.5, "contrastive": None}, {"normxlogit"}),
    ({"logat": None, "normxlogit": None, "contrastive": None}, set()),
])
def test_every_method_tied_for_best_is_marked(ap, best):
    """Two methods with exactly one value: both are best, in the terminal table and on the page (the later one alone
    was marked)."""
    from nxl_hooks.apps.reports import evaluate_summary

    methods = {name: {"aopc_comprehensiveness": None, "aopc_sufficiency": None, "ap_eval": value, "dot_eval": None,
                      "seconds": None, "layered": True, "ap": None, "dot": None} for name, value in ap.items()}
    summary = {"n": 1, "eval_layer": 2, "kind": "classification", "perturbation": "mask", "ks": [0.5], "layers": [0],
               "methods": methods}
    printed = {line.split()[0]: line.split()[3] for line in evaluate_summary(summary).splitlines()[2:-1]}
    assert {name for name, cell in printed.items() if cell.endswith("*")} == best
    assert {name for name, cells in _summary_rows(evaluate_report(summary)).items() if cells[2][1]} == best


def test_nxl_evaluate_prints_its_summary_with_each_methods_own_time(tmp_path, capsys):
    """It printed only where it wrote; now the table too, each number the summary's, best marked among the real
    methods."""
    from nxl_hooks.apps.cli import main
    from nxl_hooks.records.html import fmt

    path = tiny.save_model(tmp_path / "bert", "bert", seed=0)
    data = tiny.write_jsonl(tmp_path / "d.jsonl", 3)
    assert main(["evaluate", str(path), str(data), "--out", str(tmp_path / "o"), "--methods",
                 "random,embed_norm,logat,normxlogit"]) == 0
    out = capsys.readouterr().out.splitlines()
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    start = out.index(f"{summary['n']} examples, ranking layer {summary['eval_layer']}:")
    header, *rows, note = out[start + 1:start + 7]
    assert header.split() == ["method", "AOPC", "comp.", "↑", "AOPC", "suff.", "↓", "AP", "↑", "dot", "↑", "s", "/",
                              "example"]
    assert note == "* best among the methods; a baseline (random) is a floor to beat, never best"
    keys = ("aopc_comprehensiveness", "aopc_sufficiency", "ap_eval", "dot_eval", "seconds")
    real = [n for n in summary["methods"] if n != "random"]
    for line, name in zip(rows, summary["methods"], strict=True):
        label = "random (baseline)" if name == "random" else name
        assert line.startswith(label)
        values = line[len(label):].split()
        numbers = summary["methods"][name]
        assert [v.rstrip("*") for v in values] == [fmt(numbers.get(key)) for key in keys], line
        for value, key, high in zip(values, keys, (True, False, True, True, False)):
            candidates = [numbers_[key] for n, numbers_ in summary["methods"].items() if n in real
                          and numbers_.get(key) is not None]
            best = numbers.get(key) is not None and name in real and numbers[key] == (max if high else min)(candidates)
            assert value.endswith("*") == best, (line, key)
    seconds = [summary["methods"][n]["seconds"] for n in real]
    assert len(set(seconds)) == len(seconds)  # each method's own time, not one number for three


def test_attribute_command_writes_the_heatmap_page(tmp_path, capsys):
    from nxl_hooks.apps.cli import main

    path = tiny.save_model(tmp_path / "bert", "bert", seed=0)
    assert main(["attribute", str(path), TEXTS[0], "--html", str(tmp_path / "a.html")]) == 0
    model, tok = tiny.build_model("bert", 0), tiny.tokenizer()
    enc = tok(TEXTS[:1], return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
        logits = oracle.bert_classifier(model).layer_logits(out.hidden_states)
    _, expected = oracle.normxlogit(logits, out.hidden_states[0], out.logits.argmax(-1))
    assert_heatmap_matches((tmp_path / "a.html").read_text(), expected, enc["attention_mask"].bool())


@pytest.fixture(scope="module")
def generation():
    """(generation page, its call, oracle NormXLogit per step (L+1, n)) of 4 greedy tokens on a byte-level BPE
    model, the prompt holding '</script>' and a newline."""
    import bpe_tiny
    import nxl_hooks as nxl
    from nxl_hooks.records.html import generation_html

    tok = bpe_tiny.bpe_tokenizer()
    model = bpe_tiny.bpe_llama(tok)
    enc = tok("The capital </script> of\nFrance is", return_tensors="pt")
    with nxl.attach(model, tokenizer=tok, layers="all") as probe:
        model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=2)
    call = probe.calls[0]
    expected = []
    for step in call.steps:
        n = step.position
        logits, embeddings = oracle.prefix_logits(model, oracle.llama(model), call.sequences[:, :n],
                                                  torch.ones(1, n, dtype=torch.bool))
        expected.append(oracle.normxlogit(logits, embeddings, step.token)[1][:, 0])
    return generation_html(call), call, expected


def generation_cells_match(page: str, expected: list, layer: int) -> None:
    """Row i holds step i's scores at ``layer`` over its context, blank after it."""
    cells = tiny.elements(page, "td", "nxl-cell")
    width = len(cells) // len(expected)
    assert width * len(expected) == len(cells)
    for i, scores in enumerate(expected):
        row = cells[i * width: (i + 1) * width]
        n = scores.shape[-1]
        torch.testing.assert_close(torch.tensor([float(c["data-value"]) for c in row[:n]]), scores[layer],
                                   rtol=1e-4, atol=1e-6)
        assert all("data-value" not in c for c in row[n:])


def test_generation_page_holds_every_layer_of_every_step(generation):
    import json

    page, call, expected = generation
    generation_cells_match(page, expected, -1)  # the last layer is shown first
    data = json.loads(page.split('id="nxl-data">')[1].split("</script>")[0])
    assert data["layers"] == list(range(4)) and data["columns"][: len(call.readable[0])] == [
        f"{j}: {name}" for j, name in enumerate(call.readable[0])]
    for i, scores in enumerate(expected):
        got = torch.tensor([[v for v in layer[: scores.shape[-1]]] for layer in data["values"][i]])
        torch.testing.assert_close(got, scores, rtol=1e-4, atol=1e-6)
        assert data["rows"][i].startswith(f"{i}: {call.steps[i].readable[0]} · p ")
    assert sum(column.endswith(": ↵") for column in data["columns"]) == 1  # the prompt's one newline, visible
    assert page.count("</script>") == 2  # the prompt's '</script>' cannot end the data block
    for external in ("http:", "https:", "//cdn", "src=", "<link", "url(", "@import"):
        assert external not in page


def test_heatmap_takes_each_peak_once_not_once_per_cell():
    class Counted(float):
        calls = 0

        def __abs__(self):
            Counted.calls += 1
            return Counted(float.__abs__(self))

    n = 300
    for scale in ("column", "row", "all"):
        Counted.calls = 0
        heatmap([str(i) for i in range(n)], ["L0"], [[Counted((-1) ** i * (i + 1))] for i in range(n)], scale=scale)
        assert Counted.calls <= 10 * n, scale  # a few passes over the cells; a pass per cell made it n x n


def test_generation_page_says_where_and_why_recording_stopped(generation):
    import dataclasses

    import bpe_tiny
    import nxl_hooks as nxl
    from nxl_hooks.records.html import generation_html

    page, call, _ = generation
    assert "not recorded" not in page and "incomplete" not in page  # a finished call: every step shown
    torn = dataclasses.replace(call, complete=False)  # as read from a stream cut before its end frame
    assert "note: incomplete: the record ends after step 3" in generation_html(torn)

    tok = bpe_tiny.bpe_tokenizer()
    model = bpe_tiny.bpe_llama(tok)
    enc = tok("The capital of France is", return_tensors="pt")

    def boom(step):
        if step.step == 1:
            raise RuntimeError("callback failed")

    with nxl.attach(model, tokenizer=tok, layers="all", on_step=boom) as probe:
        model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=2)
    partial = generation_html(probe.calls[-1])
    assert "note: not recorded after step 1: callback failed" in partial
    assert len(tiny.elements(partial, "td", "nxl-cell")) == 2 * (enc["input_ids"].shape[1] + 2)  # steps 0 and 1

    resumed, cache = tiny.resuming(model, enc["input_ids"])
    with nxl.attach(model, tokenizer=tok, layers="all") as probe:
        model.generate(resumed, max_new_tokens=2, do_sample=False, pad_token_id=2, **cache)
    unrecorded = generation_html(probe.calls[-1])  # no steps: still a page, saying why
    assert unrecorded.startswith("<!DOCTYPE html>")
    assert "note: not recorded: generate was given a KV cache" in unrecorded
    assert "nothing to show" in unrecorded and not tiny.elements(unrecorded, "td", "nxl-cell")


def test_generation_page_names_tokens_without_texts_as_the_step_views_do():
    """Without a tokenizer a token is #ID, and a prompt given as inputs_embeds (no ids either) reads @position, on
    the page as in its step views: the page read 'None' for each such prompt token and bare numbers for ids."""
    import bpe_tiny
    import nxl_hooks as nxl
    from nxl_hooks.records.html import generation_html

    tok = bpe_tiny.bpe_tokenizer()
    model = bpe_tiny.bpe_llama(tok)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    n = ids.shape[1]
    with nxl.attach(model, layers="all") as probe:  # no tokenizer: no texts
        out = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=2)
        model.generate(inputs_embeds=model.get_input_embeddings()(ids).detach(), max_new_tokens=2, do_sample=False,
                       pad_token_id=2)
    for call, prompt in zip(probe.calls, ([f"#{i}" for i in ids[0].tolist()], [f"@{j}" for j in range(n)])):
        page = generation_html(call)
        data = json.loads(page.split('id="nxl-data">')[1].split("</script>")[0])
        assert data["columns"][:n] == [f"{j}: {name}" for j, name in enumerate(prompt)]
        assert f'<p class="prompt">{" ".join(prompt)}</p>' in page
        emitted = [f"#{int(step.token[0])}" for step in call.steps]
        assert data["columns"][n] == f"{n}: {emitted[0]}" and data["columns"][n] == f"{n}: #{int(out[0, n])}"
        assert [row.split(" · ")[0] for row in data["rows"]] == [f"{i}: {name}" for i, name in enumerate(emitted)]
        assert [step["token"] for step in data["steps"]] == emitted  # the views read the same names


def test_generation_page_leaves_out_the_padding_after_a_rows_end():
    """A row that emitted its end token before the batch stopped is padded by generate: the page showed those pad
    steps as tokens it generated (rows, scores, bold best tokens). Its rows are the tokens generate returns for it, up
    to its end token, and a note says the rest was padding; the other row keeps every step."""
    import nxl_hooks as nxl
    from nxl_hooks.records.html import generation_html

    model = tiny.generating_llama()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    free = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    model.generation_config.eos_token_id = int(free[0, 5])  # row 0's second token ends it, not row 1
    assert int(free[0, 5]) not in free[1, 4:].tolist()
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    for row, kept in ((0, 2), (1, 4)):
        page = generation_html(probe.calls[-1], row=row)
        data = json.loads(page.split('id="nxl-data">')[1].split("</script>")[0])
        generated = [f"#{token}" for token in out[row, 4 : 4 + kept].tolist()]
        assert [name.split(" · ")[0] for name in data["rows"]] == [f"{i}: {t}" for i, t in enumerate(generated)]
        assert data["columns"] == [f"{j}: #{token}" for j, token in enumerate(out[row, : 4 + kept].tolist())]
        assert ("not shown" in page) == (row == 0)


def test_attribution_page_says_why_every_contrastive_cell_is_blank():
    """A regression head has no probabilities, so no foil: every contrastive score is NaN and every cell blank. The
    terminal said why; the page was a table of blank cells saying nothing. It says it now, above the table; a fixed
    foil gives numbers and no such note (another output's: the one output's own foil, its gap to itself, was 0 in
    every cell and is refused now)."""
    from transformers import BertConfig, BertForSequenceClassification

    import nxl_hooks as nxl
    from nxl_hooks.method.methods.contrastive import Contrastive

    model, tok = tiny.build_model("regression", 0), tiny.tokenizer()
    blank = nxl.explain(model, tok, TEXTS[0], methods=["contrastive"]).to_html(method="contrastive")
    assert not any("data-value" in cell for cell in tiny.elements(blank, "td", "nxl-cell"))
    assert "no output is left to be the foil" in blank
    two = BertForSequenceClassification(BertConfig(**tiny._SIZES, max_position_embeddings=64, num_labels=2,
                                                   problem_type="regression")).eval()
    fixed = nxl.explain(two, tok, TEXTS[0], methods=[Contrastive(foil=1)], target=0).to_html(method="contrastive")
    assert all("data-value" in cell for cell in tiny.elements(fixed, "td", "nxl-cell"))
    assert "no output is left to be the foil" not in fixed


def test_html_pages_rank_every_position_with_all_positions(tmp_path):
    """--all-positions reaches both pages: the template's columns are not folded, and a step's bold tokens are the
    best of every real context token, as the oracle ranks them."""
    import bpe_tiny
    from nxl_hooks.apps.cli import main

    tok = bpe_tiny.bpe_tokenizer()
    model = bpe_tiny.bpe_llama(tok)
    folder = bpe_tiny.save_bpe(tmp_path / "chat", model, tok)
    for every in (False, True):
        page_path = tmp_path / f"gen_{every}.html"
        assert main(["attribute", str(folder), "The capital of France is", "--chat", "--generate", "2",
                     "--layers", "last", "--html", str(page_path)] + (["--all-positions"] if every else [])) == 0
        page = page_path.read_text()
        data = json.loads(page.split('id="nxl-data">')[1].split("</script>")[0])
        assert ('class="nxl-folded"' in page) is not every and ("they rank too" in page) is every
        for i, step in enumerate(data["steps"]):
            scores = [v for v in data["values"][i][-1]]
            ranked = data["ranked"][i]
            real = [j for j, v in enumerate(scores) if v is not None]
            eligible = real if every else [j for j in real if ranked[j]]
            template = [j for j in real if data["columns"][j].startswith("▫ ")]
            assert template and (set(template) <= set(eligible)) is every  # the template ranks with the switch only
            want = sorted(eligible, key=lambda j: -scores[j])[:3]
            assert [entry[0] for entry in step["scores"]["normxlogit"][str(data["layers"][-1])]] == want
        html_path = tmp_path / f"a_{every}.html"
        assert main(["attribute", str(folder), "The capital of France is", "--chat", "--html", str(html_path)]
                    + (["--all-positions"] if every else [])) == 0
        assert ("they rank too" in html_path.read_text()) is every


def test_heatmap_blanks_infinite_scores_and_scales_by_the_finite_ones():
    page = heatmap(["a", "b", "c", "d"], ["L0"], [[2.0], [float("-inf")], [float("inf")], [float("nan")]])
    cells = tiny.elements(page, "td", "nxl-cell")
    assert cells[0]["style"].startswith("background:rgb(214,39,40)")  # the finite maximum: full red, not white
    for cell, shown in zip(cells[1:], ("-inf", "inf", "nan")):
        assert "style" not in cell and "data-value" not in cell and cell["title"].endswith(f": {shown}")
    from nxl_hooks.records.html import _colour

    assert _colour(float("nan")) == ("rgb(255,255,255)", "#222")  # no colour for no number (NaN clipped to full red)


def test_attribution_page_scales_each_layer_by_the_tokens_that_rank(explained):
    """[CLS] (the prediction position, a special token) and [SEP] colour on the scale of the words, clipped."""
    import copy

    res, expected, mask = explained
    expected = expected.clone()
    expected[:, 0, 0] = 10 * expected[:, 0].abs().amax(-1)  # [CLS] far above every word: it must not set the scale
    res = copy.copy(res)
    res.scores = {**res.scores, "normxlogit": res.scores["normxlogit"].clone()}
    res.scores["normxlogit"][:, 0, 0] = expected[:, 0, 0]
    ids = tiny.tokenizer()(TEXTS, return_tensors="pt", padding=True)["input_ids"][0]
    specials = set(tiny.tokenizer().all_special_ids)
    real = mask[0].nonzero().flatten().tolist()
    words = [i for i in real if int(ids[i]) not in specials]
    assert len(words) < len(real)
    cells = tiny.elements(res.to_html(rows=[0]), "td", "nxl-cell")
    layers = expected.shape[0]
    for n, i in enumerate(real):
        for layer in range(layers):
            value = float(expected[layer, 0, i])
            t = min(1.0, abs(value) / max(abs(float(expected[layer, 0, w])) for w in words))
            base = (214, 39, 40) if value >= 0 else (31, 119, 180)
            rgb = ",".join(str(round(255 + (c - 255) * t)) for c in base)
            assert cells[n * layers + layer]["style"].startswith(f"background:rgb({rgb})"), (i, layer)


def test_generation_page_reads_a_character_split_over_byte_tokens_whole_everywhere():
    """An emoji of four byte tokens, in the prompt and generated: the prompt, the column headers and the row labels
    all show the character (they read raw bytes, '…' or the character, depending on where)."""
    import bpe_tiny
    import nxl_hooks as nxl
    from nxl_hooks.records.html import generation_html

    tok = bpe_tiny.bpe_tokenizer()
    model = bpe_tiny.bpe_llama(tok)
    emoji = tok("😀")["input_ids"]
    assert len(emoji) == 4 and tok.decode(emoji) == "😀"
    enc = tok("Hello 😀 there", return_tensors="pt")
    n = enc["input_ids"].shape[1]
    with nxl.attach(model, tokenizer=tok, layers="all") as probe:
        model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=2,
                       prefix_allowed_tokens_fn=lambda b, ids: [emoji[len(ids) - n]])
    page = generation_html(probe.calls[-1])
    data = json.loads(page.split('id="nxl-data">')[1].split("</script>")[0])
    prompt = page.split('<p class="prompt">')[1].split("</p>")[0]
    assert prompt.count("😀") == 4 and "\\x" not in prompt
    assert [name.split(": ", 1)[1] for name in data["columns"][n:]] == ["😀"] * 4
    assert [name.split(" · ")[0] for name in data["rows"]] == [f"{i}: 😀" for i in range(4)]
