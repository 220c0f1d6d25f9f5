"""Issue 18's smaller surprises: a summary repr for results, steps and calls (never raw tensors); a target word the
tokenizer splits is explained as its first token with a warning line above the table; the heatmap page never
scrolls sideways at 31 layers and marks the chat template's rows; a generation says why it stopped. The numbers a
repr shows are checked against the oracle (hidden states and Llama's head by hand)."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import torch
from rich.console import Console

import bpe_tiny
import nxl_hooks as nxl
import oracle
import tiny
from nxl_hooks.apps.cli import main
from nxl_hooks.apps.terminal import print_generation
from test_chat_ranking import world  # noqa: F401 - the fixture: (model, tokenizer, its folder)

PROMPT = "The capital of France is"


def oracle_scores(model, tok, text: str, target: int) -> torch.Tensor:
    """(layers, seq) NormXLogit of ``target`` by hand: each token's embedding norm times its layer logit."""
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
        logits = oracle.llama(model).layer_logits(out.hidden_states)
    return oracle.normxlogit(logits, out.hidden_states[0], torch.tensor([target]))[1][:, 0]


def test_attribution_repr_is_a_summary_with_the_oracles_top_tokens(world):
    model, tok, _ = world
    res = nxl.explain(model, tok, [PROMPT, "Paris is a city."], target="Paris")
    text = repr(res)
    assert text == str(res) and "tensor(" not in text and len(text.splitlines()) == 3
    seq = res.normxlogit.shape[2]
    assert f"2 row(s) x {seq} tokens" in text and "layers 0..3 (4)" in text
    row0 = text.splitlines()[1]
    assert f"(id {int(res.target[0])}, p " in row0
    expected = oracle_scores(model, tok, PROMPT, int(res.target[0]))[-1]
    expected[-1] = float("-inf")  # the prediction position does not rank
    best = [int(i) for i in expected.argsort(descending=True)[:3]]
    shown = [int(p) for p in re.findall(r"(\d+):'", row0.split("top at L3:")[1])]
    offset = int((~res.mask[0]).sum()) if tok.padding_side == "left" else 0
    assert [p - offset for p in shown] == best
    assert f"{float(expected[best[0]]):.4g}" in row0


def test_attribution_repr_shows_each_target_of_a_row_with_its_own_top_tokens():
    """k targets per row: the repr showed only each row's first target and its ranking; each has its line now (the
    first three, then how many more), with the oracle's top tokens for that target."""
    model, tok = tiny.build_model("llama", 0), tiny.tokenizer()
    text, words = "the film was", ["good", "bad", "great", "awful"]
    res = nxl.explain(model, tok, text, target=words)
    lines = repr(res).removesuffix(">").splitlines()
    assert len(lines) == 1 + 3 + 1 and "4 targets per row" in lines[0] and lines[-1].strip() == "... 1 more target(s)"
    for label, (line, word) in enumerate(zip(lines[1:4], words)):
        target = tiny.VOCAB.index(word)
        assert line.startswith("  row 0: " if label == 0 else "         ") and f"target '{word}' (id {target}," in line
        expected = oracle_scores(model, tok, text, target)[-1]
        ranked = [i for i in expected.argsort(descending=True).tolist() if 0 < i < len(expected) - 1][:3]  # no [CLS],
        # [SEP] (special) nor the prediction position
        shown = [int(p) for p in re.findall(r"(\d+):'", line.split("top at L2:")[1])]
        assert shown == ranked, (line, expected)


def test_step_and_call_reprs_are_summaries(world):
    model, tok, _ = world
    inputs = tok(PROMPT, return_tensors="pt")
    with nxl.attach(model, tokenizer=tok) as probe:
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    call = probe.calls[-1]
    step = call.steps[1]
    assert "tensor(" not in repr(step) + repr(call)
    assert f"token '{step.readable[0]}' (id {int(step.token[0])}, p {float(step.probability[0]):.3g})" in repr(step)
    # the text as the tokenizer decodes it: a word-level tokenizer's words were run together ('w32w17w82')
    generated = tok.decode(out[0, inputs["input_ids"].shape[1]:])
    assert " " in generated
    assert repr(call).endswith(f"generated '{generated}'>") and "3 step(s), complete" in repr(call)
    # the top context positions of the step: the oracle's best positions at the last layer
    scores = step.normxlogit[-1, 0].clone()
    scores[step.position - 1] = float("-inf")
    assert repr(step).split("L3: ")[1].startswith(f"{int(scores.argmax())} ")


def test_a_calls_repr_ends_row_0s_text_at_its_end_token():
    """Row 0 ended before row 1: its repr's generated text went on with generate's padding after the end token
    ('#74#95#0#0'), which call.texts leaves out. It is the tokens generate returns for row 0, up to its end."""
    model = tiny.generating_llama()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    free = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    model.generation_config.eos_token_id = int(free[0, 5])  # row 0's second token ends it, not row 1
    assert int(free[0, 5]) not in free[1, 4:].tolist()
    with nxl.attach(model) as probe:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert len(probe.calls[-1].steps) == 4
    assert repr(probe.calls[-1]).endswith("generated '" + "".join(f"#{t}" for t in out[0, 4:6].tolist()) + "'>")
    # the steps after row 0's end: their repr presented generate's padding as row 0's token, with the context
    # positions that "explain" it; they say row 0 had ended, with the token generate padded it with
    for step, pad in zip(probe.calls[-1].steps[2:], out[0, 6:].tolist()):
        assert repr(step) == (f"<Step call {step.call} step {step.step}: row 0 had ended (generate's padding: token "
                              f"'#{pad}', id {pad}); 1 of the 1 other row(s) still generating, at position "
                              f"{4 + step.step}, layers 0..3 (4)>")


def test_a_steps_repr_with_fixed_targets_names_the_explained_one_and_gives_only_their_probabilities():
    """``attach(target=[a, b])``: the step's repr names the explained target (label 0) with its probability and ranks
    the context for it; the emitted token shows a probability only where it is one of the targets (the record holds
    the targets' only). Numbers (shown to 3 digits) against the model's own softmax and the oracle's NormXLogit of
    target a."""
    model = tiny.generating_llama()
    ids = torch.randint(1, tiny.GEN_VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    chances = out.logits[0, -1].float().softmax(-1)
    token = int(chances.argmax())
    other = (token + 7) % tiny.GEN_VOCAB or 1
    nx = oracle.normxlogit(oracle.llama(model).layer_logits(out.hidden_states), out.hidden_states[0],
                           torch.tensor([other]))[1][-1, 0]
    nx[-1] = float("-inf")  # the prediction position does not rank
    for targets in ([other, token], [other, (other + 1) % tiny.GEN_VOCAB or 2]):
        with nxl.attach(model, layers="all", target=targets) as probe:
            model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)
        text = repr(probe.steps[0])
        shown = re.search(rf"token '#{token}' \(id {token}(?:, p ([\d.e-]+))?\)", text)
        if token in targets:
            assert abs(float(shown.group(1)) - float(chances[token])) <= 6e-3 * float(chances[token]), text
        else:
            assert shown.group(1) is None, text
        named = re.search(rf"explaining target '#{other}' \(id {other}, p ([\d.e-]+)\)", text)
        assert abs(float(named.group(1)) - float(chances[other])) <= 6e-3 * float(chances[other]), text
        assert text.split("L3: ")[1].startswith(f"{int(nx.argmax())} "), text


def test_a_split_target_word_warns_above_the_table(world, capsys, monkeypatch):
    _, tok, folder = world
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["attribute", str(folder), PROMPT, "--target", "Pariss", "--layers", "last"]) == 0
    lines = capsys.readouterr().out.splitlines()
    pieces = tok.convert_ids_to_tokens(tok(PROMPT + " Pariss", add_special_tokens=False)["input_ids"][5:])
    assert len(pieces) == 2  # ' Paris' + 's': the request is two tokens, the first is explained
    warning = next(i for i, line in enumerate(lines) if line.startswith("warning: 'Pariss' is 2 tokens here"))
    table = next(i for i, line in enumerate(lines) if "NormXLogit of 'Pariss' -> '␣Paris'" in line)
    assert warning < table


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack, self.tables, self.row_labels, self.in_th = [], [], [], False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.tables.append((attrs.get("class", ""), self.stack[-1] if self.stack else None))
        if tag == "th" and self.stack and self.stack[-1][0] == "tr" and "tbody" in [t for t, _ in self.stack]:
            self.in_th = True
            self.row_labels.append("")
        self.stack.append((tag, attrs.get("class", "")))

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop()[0] != tag:
            pass
        if tag == "th":
            self.in_th = False

    def handle_data(self, data):
        if self.in_th:
            self.row_labels[-1] += data


def test_a_31_layer_heatmap_fits_the_page_and_marks_the_template(world):
    _, tok, _ = world
    model = bpe_tiny.bpe_llama(tok, layers=30)
    res = nxl.explain(model, tok, PROMPT, chat=True)
    assert len(res.layers) == 31
    page = res.to_html()
    parsed = _Page()
    parsed.feed(page)
    # the layout rule: every heatmap sits alone in a box that scrolls by itself (never the page), with compact cells
    assert parsed.tables and all(parent == ("div", "nxl-scroll") for _, parent in parsed.tables)
    assert all("nxl-compact" in cls for cls, _ in parsed.tables)
    assert ".nxl .nxl-scroll{max-width:100%;overflow-x:auto}" in page
    marked = [label.startswith("▫") for label in parsed.row_labels]
    assert marked == res.template[0][res.mask[0]].tolist() and any(marked) and not all(marked)


def test_generation_says_it_stopped_at_the_end_token(world):
    model, tok, _ = world
    enc = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        first = int(model(**enc).logits[0, -1].argmax())
    model.generation_config.eos_token_id = first  # the greedy first token ends the generation
    try:
        console = Console(record=True, width=300)
        call = print_generation(model, tok, PROMPT, 5, layers="last", console=console)
    finally:
        model.generation_config.eos_token_id = None
    last = console.export_text().strip().splitlines()[-1]
    assert len(call.steps) == 1
    assert last == (f"stopped: the model emitted '{call.steps[0].readable[0]}' (id {first}), an end token of its "
                    "generation config (end of turn / EOS), after 1 token(s)")


def test_a_steps_repr_ranks_as_its_calls_top_leaving_out_the_chat_template(world, tmp_path):
    """A chat prompt's step: the repr's top context positions are those of ``call.attribution(step).top()``, the
    user's message and generated tokens only (it ranked the template's markers, which top() leaves out), in memory
    and read back from the stream file. The oracle of which positions rank: the template located by hand."""
    from test_chat_ranking import USER_TURN, by_hand

    model, tok, _ = world
    ids, ranked = by_hand(tok, USER_TURN)
    enc = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    assert enc["input_ids"][0].tolist() == ids
    with nxl.attach(model, tokenizer=tok, layers="all", sink=tmp_path / "run.nxl") as probe:
        model.generate(**enc, max_new_tokens=3, do_sample=False)
    for call in (probe.calls[-1], nxl.read_stream(tmp_path / "run.nxl")[0]):
        assert call.prompt_template is not None
        for step in call.steps:
            shown = [int(p) for p in re.findall(r"(\d+) -?[\d.]", repr(step).split(": ")[-1])]
            allowed = ranked | set(range(len(ids), step.position - 1))
            scores = step.normxlogit[-1, 0]
            best = sorted(allowed, key=lambda p: -float(scores[p]))[:3]
            assert shown == best, repr(step)


def test_steps_and_calls_still_pickle_for_another_process(world):
    """multiprocessing and ProcessPoolExecutor hand records over by pickle: a linked step (its weak link to its call
    is not pickled) and its call come back with the same tokens and scores (the link made both refuse)."""
    import copy
    import gc
    import pickle

    model, tok, _ = world
    enc = tok("The capital of France is", return_tensors="pt")
    with nxl.attach(model, tokenizer=tok, layers="all") as probe:
        model.generate(**enc, max_new_tokens=2, do_sample=False)
    call = probe.calls[-1]
    back = pickle.loads(pickle.dumps(call))
    step = pickle.loads(pickle.dumps(call.steps[-1]))
    assert torch.equal(step.normxlogit, call.steps[-1].normxlogit) and torch.equal(step.token, call.steps[-1].token)
    assert [torch.equal(a.normxlogit, b.normxlogit) for a, b in zip(back.steps, call.steps)] == [True, True]
    assert all(s._call() is back for s in back.steps) and step._call is None  # the call's own again; alone, none
    shallow = copy.copy(call)  # shares the steps: they stay the original's, also once the copy is gone
    del shallow
    gc.collect()
    assert all(s._call() is call for s in call.steps)



def test_a_steps_top_without_texts_names_tokens_as_its_view_does():
    """Recorded without a tokenizer, a step's view names a context token '#ID' ('@N' where even its id is not at
    hand: the step alone, its call not linked); its ``to_attribution()`` named them by position ('3'), its emitted
    token by its bare id ('10' where the step's repr says '#10'). Both name them by the one rule of ``names``,
    for every row, linked to its call and unpickled alone."""
    import pickle

    model = tiny.generating_llama()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with nxl.attach(model, layers="all") as probe:
        generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                   do_sample=False)
    call = probe.calls[-1]
    step = call.steps[-1]
    assert step.context is None and step.readable is None
    # the context the step saw, from generate's own output (prompt, then the tokens before the step's): the names' ids
    seen = generated[:, :step.position].tolist()
    assert call.context_ids(step.position).tolist() == seen
    assert step.token.tolist() == generated[:, step.position].tolist()
    alone = pickle.loads(pickle.dumps(step))
    for record, owner in ((step, call), (alone, None)):
        res = record.to_attribution()
        for row in range(2):
            expected = [f"#{i}" for i in seen[row]] if owner else [
                f"@{n}" for n in range(step.position)]
            assert res.token_labels(row) == expected
            view = record.view(owner, k=3, row=row)
            for layer in step.layers:
                assert [(p, text) for p, text, _ in res.top(3, layer=layer, row=row)] == [
                    (p, text) for p, text, _ in view.scores["normxlogit"][layer]]
            token = int(step.token[row])
            assert f"target '#{token}' (id {token}, p " in repr(res).splitlines()[1 + row]
