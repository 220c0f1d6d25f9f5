"""The ``nxl`` command line, run in-process: the printed table, ``--out``, errors, and ``nxl demo``.

Every number is checked against the oracle (``output_hidden_states=True`` and the head by hand), never
against the library.
"""

import errno
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaForSequenceClassification

import nxl_hooks as nxl
import oracle
import tiny
from nxl_hooks.apps.cli import main

ROOT = Path(__file__).resolve().parents[2]

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
    titles = [line.strip() for line in printed.splitlines() if "NormXLogit of" in line]
    assert [title.split(" (id")[0] for title in titles] == [  # one table per target, then their contrast
        "NormXLogit of 'LABEL_1'", "NormXLogit of 'LABEL_0'", "Contrast: NormXLogit of 'LABEL_1'"]
    assert "L1" not in table_rows(printed)
    res = nxl.Attribution.load(out_file)
    assert res.layers == [0, 2] and res.target.tolist() == [[1, 0]]
    for k, label in enumerate((1, 0)):
        _, expected = oracle.normxlogit(logits, embeddings, torch.tensor([label]))
        torch.testing.assert_close(res.normxlogit[..., k], expected[[0, 2]], rtol=1e-4, atol=1e-5)


def test_a_target_of_digits_that_is_also_another_outputs_label_name_says_which_reading_was_taken(tmp_path, capsys):
    """A classifier whose labels are named "1" and "2" (ids 0 and 1): --target 1 is id 1 (digits alone are an id), and
    was so silently while the label named "1" is another output; a note now says so and how to mean the label (" 1",
    which explains that label). --target 0 names no label: no note. Judged by the model's config and logits."""
    bert = tiny.build_model("bert", 0)
    bert.config.id2label, bert.config.label2id = {0: "1", 1: "2"}, {"1": 0, "2": 1}
    folder = tiny.save_model(tmp_path / "digits", "bert", model=bert)
    config, enc = bert.config, tiny.tokenizer()(TEXT, return_tensors="pt")
    with torch.no_grad():
        out = bert(**enc, output_hidden_states=True)
    logits = oracle.bert_classifier(bert).layer_logits(out.hidden_states)
    torch.testing.assert_close(logits[-1, 0, 0], out.logits[0], rtol=1e-4, atol=1e-5)  # the hand head is the model's
    named = config.label2id["1"]
    note = (f"note: --target 1 is read as id 1 ({config.id2label[1]!r}), not as the label named '1' (id {named}): to "
            "mean that label, give ' 1' (the name with a space before it: an item of digits alone is an id)")
    for target, explained, notes in (("1", 1, [note]), (" 1", named, None), ("0", 0, [])):
        out_file = tmp_path / f"{target.strip()}{len(target)}.safetensors"
        assert main(["attribute", str(folder), TEXT, "--target", target, "--out", str(out_file)]) == 0
        printed = " ".join(capsys.readouterr().out.split())  # rich wraps long lines at COLUMNS
        if notes is not None:
            assert re.findall(r"note: --target.*?is an id\)", printed) == notes
        else:  # the label's reading says it is not id 1, as before
            assert "note: --target" not in printed and "' 1' is read as the label named '1'" in printed
        res = nxl.Attribution.load(out_file)
        assert res.target.tolist() == [explained]
        _, expected = oracle.normxlogit(logits, out.hidden_states[0], torch.tensor([explained]))
        torch.testing.assert_close(res.normxlogit, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(float(res.probability[0]), float(out.logits[0].softmax(-1)[explained]), rtol=1e-4,
                                   atol=1e-6)


def test_text_pair_is_encoded_with_text_as_the_tokenizer_encodes_a_sentence_pair(saved, tmp_path):
    """--text-pair TEXT2: a classifier's sentence pair, as tokenizer(TEXT, TEXT2) encodes it."""
    path, out_file, pair = saved[0], tmp_path / "p.safetensors", "very bad plot"
    assert main(["attribute", str(path), TEXT, "--text-pair", pair, "--layers", "all", "--out", str(out_file)]) == 0
    model, tok = tiny.build_model("bert", 0), tiny.tokenizer()
    enc = tok(TEXT, pair, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    logits = oracle.bert_classifier(model).layer_logits(out.hidden_states)
    _, expected = oracle.normxlogit(logits, out.hidden_states[0], out.logits.argmax(-1))
    res = nxl.Attribution.load(out_file)
    assert res.input_ids.tolist() == enc["input_ids"].tolist() and len(res.input_ids[0]) > len(tok(TEXT)["input_ids"])
    torch.testing.assert_close(res.normxlogit, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "5"], "layer 5 is out of range"),
        (["--target", "7"], "label 7 is out of range: this classifier has"),
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


def test_output_paths_are_printed_as_they_are(saved, tmp_path, capsys):
    """A file name is not rich markup: 'x[/b]' raised MarkupError after the file was written, 'run[v2]' read 'run'."""
    out, page = tmp_path / "x[/b].safetensors", tmp_path / "run[v2] :smile:.html"
    (tmp_path / "x[").mkdir()  # the "/" in the name: x[ is a folder
    assert main(["attribute", str(saved[0]), TEXT, "--out", str(out), "--html", str(page)]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [f"saved {out}", f"wrote {page}"]
    llama = tiny.save_model(tmp_path / "llama", "llama")
    assert main(["attribute", str(llama), "the film was", "--generate", "1", "--html", str(page)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {page}"


def test_outputs_under_home_are_written_where_they_were_checked(saved, tmp_path, monkeypatch):
    """``~`` in an output path (quoted, so the shell left it as it is) is the home folder for the check and the write
    alike: ``evaluate`` made a folder named "~" in the working folder, ``attribute`` passed the check, ran, then
    failed."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    data = tiny.write_jsonl(tmp_path / "data.jsonl", 1)
    assert main(["attribute", str(saved[0]), TEXT, "--out", "~/a.safetensors", "--html", "~/a.html"]) == 0
    assert main(["evaluate", str(saved[0]), str(data), "--out", "~/eval", "--methods", "logat"]) == 0
    assert nxl.Attribution.load(home / "a.safetensors").tokens == [saved[1]]
    assert sorted(p.name for p in home.iterdir()) == ["a.html", "a.safetensors", "eval"]
    assert (home / "eval" / "summary.json").is_file() and not (tmp_path / "~").exists()


@pytest.fixture(scope="module")
def demo_by_hand():
    """The shipped demo model by hand on the 1000 held-out sentences the summary uses: per sentence and layer, the
    keyword's rank among the sentence's words by the oracle's NormXLogit of the predicted label."""
    from nxl_hooks.demo import MODEL_DIR
    from nxl_hooks.demo.task import HELD_OUT_SEED, make_examples

    model = LlamaForSequenceClassification.from_pretrained(MODEL_DIR).eval()
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)

    def ranks(texts: list[str], keyword_index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # Right padding under causal attention: a sentence's hidden states do not see the pads after it.
        enc = tok(texts, padding=True, return_tensors="pt", return_token_type_ids=False)
        with torch.no_grad():
            out = model(**enc, output_hidden_states=True)
        _, scores = oracle.normxlogit(oracle.llama(model).layer_logits(out.hidden_states), out.hidden_states[0],
                                      out.logits.argmax(-1))  # (3 layers, sentences, seq)
        rows = []
        for row, (text, index) in enumerate(zip(texts, keyword_index)):
            words = scores[:, row, : len(text.split())]  # the words; the [SEP] read by the classifier and pads follow
            rows.append(1 + (words > words[:, index : index + 1]).sum(-1))
        return torch.stack(rows), scores

    examples = make_examples(1000, seed=HELD_OUT_SEED)
    held_out, _ = ranks([e.text for e in examples], [e.evidence_index for e in examples])
    return examples, held_out, ranks


def _printed_spread(printed: str) -> dict[int, list[float]]:
    """{layer: [first %, top-2 %, median, q1, q3]} from the summary lines of nxl demo."""
    found = re.findall(r"L(\d)  first +([\d.]+)%  top-2 +([\d.]+)%  median rank ([\d.]+)  quartiles ([\d.]+)-([\d.]+)",
                       printed)
    return {int(layer): [float(first), float(top2), float(median), float(q1), float(q3)]
            for layer, first, top2, median, q1, q3 in found}


def test_demo_shows_a_typical_sentence_and_the_spread_of_ranks(capsys, demo_by_hand):
    examples, ranks, by_hand = demo_by_hand
    assert main(["demo"]) == 0
    printed = capsys.readouterr().out
    # The spread per layer, by hand: share ranked first and in the top 2, quartiles (linear interpolation).
    spread = _printed_spread(printed)
    assert sorted(spread) == [0, 1, 2]
    for layer in range(3):
        column = ranks[:, layer].double().numpy()
        q1, median, q3 = np.percentile(column, [25, 50, 75])
        assert spread[layer] == pytest.approx([100 * (column == 1).mean(), 100 * (column <= 2).mean(), median, q1, q3],
                                              abs=0.051)
    assert spread[2][0] > 85.0 and spread[0][0] < 50.0  # the keyword stands out at the last layer, not at the input
    # README and docs/command-line.md quote the spread: their lines are the ones the demo prints
    for page in ("README.md", "docs/command-line.md"):
        quoted = re.findall(r"^  L\d  first .+$", (ROOT / page).read_text(encoding="utf-8"), re.M)
        assert len(quoted) == 3 and all(line in printed for line in quoted), page
    # The sentence shown is typical: no held-out sentence has ranks closer to the median rank of every layer.
    shown = int(re.search(r"held-out sentence (\d+) \(typical", printed).group(1))
    distance = (ranks.double() - ranks.double().median(dim=0).values).abs().sum(-1)
    assert distance[shown] == distance.min() and examples[shown].text in printed
    own, scores = by_hand([examples[shown].text], [examples[shown].evidence_index])
    n = len(examples[shown].words)
    assert f"L0 {own[0, 0]}/{n}  L1 {own[0, 1]}/{n}  L2 {own[0, 2]}/{n}" in printed
    rows = table_rows(printed)
    torch.testing.assert_close(torch.tensor([float(c) for c in rows["L2"]]), scores[-1, 0], rtol=1e-3, atol=1e-4)
    assert "outside the training data" not in printed


def test_demo_on_your_sentence_says_what_lies_outside_training(capsys, demo_by_hand):
    examples, ranks, by_hand = demo_by_hand
    # The example of README and docs/command-line.md: inside the training distribution, yet 'superb' ranks last of
    # 4 at the last layer; the summary says how often 'superb' ranks first on the held-out sentences that have it.
    assert main(["demo", "the plot was superb"]) == 0
    printed = capsys.readouterr().out
    own, _ = by_hand(["the plot was superb"], [3])
    assert own[0].tolist()[2] == 4 and f"L2 {own[0, 2]}/4" in printed and "outside the training data" not in printed
    rows = [i for i, e in enumerate(examples) if e.evidence == "superb"]
    share = float((ranks[rows, 2] == 1).double().mean())
    summary = (f"'superb' alone: first at the last layer in {share:.1%} of the {len(rows)} held-out sentences "
               "that have it")
    assert summary in " ".join(printed.split())  # the console wraps it
    page = " ".join((ROOT / "docs" / "command-line.md").read_text(encoding="utf-8").split())
    assert f"`{summary}`" in page  # the docs quote the line as printed, nothing the demo does not say
    assert main(["demo", "The plot was superb indeed"]) == 0
    assert "outside the training data: words outside the demo vocabulary, read as [UNK]: The, indeed" in (
        capsys.readouterr().out)
    assert main(["demo", "superb"]) == 0
    assert "outside the training data: 1 word; the training sentences have 4 to 12" in capsys.readouterr().out
    assert main(["demo", "the plot was superb \x1b[31mRED"]) == 0  # a sentence from a file may hold escapes
    printed = capsys.readouterr().out
    assert "\x1b" not in printed and "your sentence: the plot was superb \\x1b[31mRED" in printed


def test_demo_finds_words_as_its_tokenizer_splits_them(capsys, demo_by_hand):
    """\\x1f is whitespace to str.split() but not to the tokenizer, which reads "the\\x1fplot" as one [UNK]: the rank
    printed is the keyword's (it was the next word's), and the [UNK] is named outside the training data. The ranks
    are out of the 3 words that rank, which the legend says, naming the [UNK] (it said "among the words")."""
    _, _, by_hand = demo_by_hand
    text = "the\x1fplot good was film"
    assert main(["demo", text]) == 0
    printed = capsys.readouterr().out
    _, scores = by_hand([text], [0])  # [UNK] good was film [SEP]: the words that rank are positions 1..3
    ranked = scores[:, 0, 1:4]
    own = (1 + (ranked > ranked[:, :1]).sum(-1)).tolist()
    assert f"evidence 'good' ranks per layer: L0 {own[0]}/3  L1 {own[1]}/3  L2 {own[2]}/3" in printed
    assert ("(1 = top among the 3 words that rank; the\\x1fplot (read as [UNK]) does not)"
            in " ".join(printed.split()))  # the console wraps it
    assert "outside the training data: words outside the demo vocabulary, read as [UNK]: the\\x1fplot" in printed


def test_demo_sentence_needs_one_keyword(capsys):
    assert main(["demo", "good and terrible"]) == 2
    assert "exactly one sentiment keyword (found 2)" in capsys.readouterr().err


def test_targets_keep_their_spaces_a_list_is_split_at_commas():
    from nxl_hooks.apps.options import parse_target

    assert parse_target(" Paris") == " Paris"  # a different BPE token than "Paris"
    assert parse_target(" 4") == " 4"
    assert parse_target(" are, is") == [" are", " is"]  # a comma list keeps the leading spaces too
    assert parse_target("Paris, London") == ["Paris", " London"]
    assert parse_target("1,LABEL_0") == [1, "LABEL_0"]


@pytest.mark.parametrize("option", ["--generate", "--top-k", "--limit", "--ig-steps"])
@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_counts_must_be_positive(tmp_path, capsys, option, value):
    command = {"--generate": ["attribute", "m", TEXT], "--top-k": ["audit", "--reference", "m", "d", "--out", "o"]}
    argv = command.get(option, ["evaluate", "m", "d", "--out", str(tmp_path)])
    assert main([*argv, option, value]) == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and "at least 1" in err and "Traceback" not in err


def test_python_m_cli_prints_cli_errors_as_one_line(saved, tmp_path):
    import subprocess
    import sys

    # --generate with --target is refused before the model loads: fast, and a CliError raised by the command.
    argv = ["attribute", str(saved[0]), "hi", "--generate", "2", "--target", "1"]
    done = subprocess.run([sys.executable, "-m", "nxl_hooks", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == ["nxl attribute: error: --generate explains each emitted token: "
                                                "drop --target"]


def test_version_is_the_projects(capsys):
    """nxl --version and python -m nxl_hooks --version print the version pyproject.toml declares (there was none)."""
    import subprocess
    import sys
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert main(["--version"]) == 0 and capsys.readouterr().out == f"nxl {version}\n"
    done = subprocess.run([sys.executable, "-m", "nxl_hooks", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"nxl {version}\n", "")


@pytest.mark.parametrize("command", ["export", "attribute", "generate"])
def test_output_whose_reader_went_away_ends_quietly_with_sigpipes_code(tmp_path, command):
    """`nxl ... | head -1` once head has its line: stdout a pipe nobody reads. A command that prints (export, tail,
    ctl) said "error: [Errno 32] Broken pipe" and exited 2, as for bad input; one that prints with rich (attribute,
    demo) exited 1, the code of records that are not whole. Now each ends without a word, exit code 141, as a
    program that SIGPIPE ends (`yes | head -1`) does."""
    import subprocess
    import sys

    if command == "generate":  # (a causal LM's; --out: its records are written whole all the same, then 141)
        model = tiny.build_model("llama")
        model.generation_config.eos_token_id = None
        lm = tiny.save_model(tmp_path / "lm", "llama", model=model)
    argv = {"export": ["export", str(ROOT / "tests" / "data" / "stream-v2.nxl"), str(tmp_path / "s.parquet")],
            "attribute": ["attribute", str(ROOT / "nxl_hooks" / "demo"), "the plot was superb"],
            "generate": ["attribute", str(tmp_path / "lm"), "the film was", "--generate", "3", "--out",
                         str(tmp_path / "g.nxl")]}[command]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        done = subprocess.run([sys.executable, "-m", "nxl_hooks", *argv], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)
    said = [line for line in done.stderr.splitlines() if "Loading weights" not in line and line.strip()]
    assert (done.returncode, said) == (141, []), done.stderr
    if command == "generate":  # (it stopped at its first line, leaving the call unended)
        (call,) = nxl.read_stream(tmp_path / "g.nxl")
        assert call.complete and call.sequences[0, -3:].tolist() == [step.token[0].item() for step in call.steps]
        assert len(call.steps) == 3 and lm.exists()


def test_columns_0_is_unset_not_a_console_of_no_width(saved, capsys, monkeypatch):
    """COLUMNS=0 (a container's terminal of unknown size) means unset, as shutil.get_terminal_size reads it: rich
    took it for a console 0 columns wide, and nxl attribute printed nothing at all, exit 0."""
    import shutil

    from nxl_hooks.apps.terminal import print_generation

    path = str(saved[0])
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *_: os.terminal_size((80, 24)))  # (whatever runs it)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["attribute", path, TEXT]) == 0
    expected = capsys.readouterr().out
    monkeypatch.setenv("COLUMNS", "0")
    assert main(["attribute", path, TEXT]) == 0
    printed = capsys.readouterr().out
    assert printed == expected and "L2" in printed, printed
    # the library's own view, given no console, reads it so too
    model = tiny.build_model("llama")
    model.generation_config.eos_token_id = None
    print_generation(model, tiny.tokenizer(), "the film was", 1)
    assert "prompt (5 tokens)" in capsys.readouterr().out


def test_a_stdout_that_cannot_encode_a_character_shows_it_escaped(tmp_path, monkeypatch):
    """An ASCII or Latin-1 stdout (PYTHONIOENCODING, a legacy locale, a file on Windows): the prompt's '│' (and any
    '␣' of a token) raised UnicodeEncodeError, and the command failed with exit code 2 after all its work, --out not
    written. stdout now escapes what it cannot encode, as stderr does."""
    import io
    import sys

    model = tiny.build_model("llama")
    model.generation_config.eos_token_id = None
    path = tiny.save_model(tmp_path / "lm", "llama", model=model)
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    assert main(["attribute", str(path), "the film was", "--generate", "2", "--out", str(tmp_path / "r.nxl")]) == 0
    assert sys.stdout.errors == "strict"  # as it was after the command: main may run in a program of the user's
    sys.stdout.flush()
    assert "prompt (5 tokens): [CLS]\\u2502the\\u2502film\\u2502was\\u2502[SEP]" in raw.getvalue().decode("ascii")
    # said as the attribution's --out is, with what the file is (a stream, whatever its name)
    assert raw.getvalue().decode("ascii").splitlines()[-1] == (f"saved {tmp_path / 'r.nxl'} (a stream of step "
                                                               "records: nxl.read_stream, nxl export)")
    (call,) = nxl.read_stream(tmp_path / "r.nxl")
    assert len(call.steps) == 2 and call.complete


def test_generate_honours_embedding(tmp_path, capsys):
    from transformers import GemmaConfig, GemmaForCausalLM

    # Gemma scales the word embedding by sqrt(hidden) before block 1, so the two embedding norms differ.
    torch.manual_seed(0)
    config = GemmaConfig(vocab_size=len(tiny.VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0)
    model = GemmaForCausalLM(config).eval()
    path = tiny.save_model(tmp_path / "gemma", "llama", model=model)
    ids = tiny.tokenizer()("the film was", return_tensors="pt")["input_ids"][0]
    words = model.get_input_embeddings().weight[ids].detach().norm(dim=-1)
    for embedding, scale in (("word", 1.0), ("layer_input", 32**0.5)):
        out = tmp_path / f"{embedding}.nxl"
        assert main(["attribute", str(path), "the film was", "--generate", "1", "--embedding", embedding,
                     "--out", str(out)]) == 0
        step = nxl.read_stream(out)[0].steps[0]
        torch.testing.assert_close(step.embed_norm[0, : len(ids)], words * scale, rtol=1e-4, atol=1e-4)
    capsys.readouterr()


def test_generate_that_is_not_recorded_says_why_and_fails(tmp_path, capsys, monkeypatch):
    """A generate call the library cannot record (the reason its rules give, here one of the test's): --generate
    says so with the library's own reason (not a guess about a stopping criterion), exit 1."""
    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "unsupported", lambda model, kwargs: "a reason of the test's; do what it says")
    path = tiny.save_model(tmp_path / "lm", "llama")
    assert main(["attribute", str(path), "the film was", "--generate", "2"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "not recorded after 0 of 2 token(s): a reason of the test's; do what it says" in out
    assert "stopping criterion" not in out


def test_generate_whose_out_fills_the_disk_says_how_many_records_it_holds_and_fails(tmp_path, capsys, monkeypatch):
    """A full disk after the call's first record: --out holds only what was written (read back), the last line says
    so with the fault, exit 1 as for a call not recorded (it said "4 token(s) generated, as many as asked for" and
    exited 0, the only word of the fault a log line)."""
    from nxl_hooks.records import writer

    model = tiny.build_model("llama")
    model.generation_config.eos_token_id = None  # every step runs
    path = tiny.save_model(tmp_path / "lm", "llama", model=model)
    real, writes = writer._write_all, []

    def full_disk(fd, data):  # the magic line and the call's frame fit, nothing after them
        writes.append(len(data))
        if len(writes) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(writer, "_write_all", full_disk)
    out = tmp_path / "run.nxl"
    assert main(["attribute", str(path), "the film was", "--generate", "4", "--out", str(out)]) == 1
    monkeypatch.undo()
    (call,) = nxl.read_stream(out)
    assert call.steps == [] and not call.complete
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (f"{out} holds only 0 of 4 step record(s): not written to the sink, which stopped: OSError: "
                    "[Errno 28] No space left on device"), last
