"""Chat-aware ranking: a chat template's own tokens (markers, the system prompt) do not rank; the user's message and
the generated text do. The oracle for which positions are the template's is the rendered strings cut by hand: each
piece of the conversation (template text, message text) tokenized on its own, in order, gives the positions of its
tokens (the tiny byte-level BPE splits at every special token and before every newline, so the pieces' tokens are
the prompt's tokens). The real-model test asks SmolLM2 the question of issue 18."""

from __future__ import annotations

import contextlib
import re
import signal

import pytest
import torch

import bpe_tiny
import nxl_hooks as nxl
from nxl_hooks.apps.cli import main
from nxl_hooks.method.chat import chat_prompt, locate_template, template_rows
from nxl_hooks.method.select import rankable
from nxl_hooks.records.sink import read_stream

QUESTION = "The capital of France is"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tok = bpe_tiny.bpe_tokenizer()
    model = bpe_tiny.bpe_llama(tok)
    return model, tok, bpe_tiny.save_bpe(tmp_path_factory.mktemp("chat") / "hf", model, tok)


def by_hand(tok, pieces: list[tuple[str, bool]]) -> tuple[list[int], set[int]]:
    """The ids of the concatenated ``pieces`` (text, is it a message's text that ranks) and the positions of the
    ranked pieces' tokens."""
    ids, ranked = [], set()
    for text, ranks in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        if ranks:
            ranked |= set(range(len(ids), len(ids) + len(piece)))
        ids += piece
    return ids, ranked


USER_TURN = [("<|im_start|>user\n", False), (QUESTION, True), ("<|im_end|>\n<|im_start|>assistant\n", False)]


def test_explain_ranks_exactly_the_users_message(world):
    model, tok, _ = world
    ids, ranked = by_hand(tok, USER_TURN)
    res = nxl.explain(model, tok, QUESTION, chat=True)
    assert res.input_ids[0].tolist() == ids and res.meta["template"] == "located"
    assert {p for p, _, _ in res.top(len(ids))} == ranked
    assert set(res.rankable(0).nonzero().flatten().tolist()) == ranked
    # everything ranks on request: the template's markers too
    assert {p for p, _, _ in res.top(len(ids), all_positions=True)} == set(range(len(ids)))
    without = nxl.explain(model, tok, QUESTION)
    assert without.template is None and "template" not in without.meta


def test_the_template_flags_survive_a_file(world, tmp_path):
    model, tok, _ = world
    res = nxl.explain(model, tok, [QUESTION, "Paris is a city."], chat=True)
    loaded = nxl.Attribution.load(res.save(tmp_path / "a.safetensors"))
    assert torch.equal(loaded.template, res.template) and loaded.top(50, row=1) == res.top(50, row=1)
    _, ranked = by_hand(tok, [("<|im_start|>user\n", False), ("Paris is a city.", True)])
    offset = int((~res.mask[1]).sum()) if tok.padding_side == "left" else 0
    assert {p - offset for p, _, _ in res.top(50, row=1)} == ranked


def test_a_batch_explained_with_a_left_padding_tokenizer_ranks_each_users_message(world):
    model, _, _ = world
    tok = bpe_tiny.bpe_tokenizer()
    tok.padding_side = "left"  # (as most chat models' tokenizers: explain pads a batch on the right all the same)
    messages = [QUESTION, "Rome"]  # of different lengths: the second row is padded
    res = nxl.explain(model, tok, messages, chat=True)
    assert res.meta["template"] == "located" and not res.mask[1].all()
    for row, message in enumerate(messages):
        ids, ranked = by_hand(tok, [("<|im_start|>user\n", False), (message, True),
                                    ("<|im_end|>\n<|im_start|>assistant\n", False)])
        assert res.input_ids[row, :len(ids)].tolist() == ids
        assert set(res.rankable(row).nonzero().flatten().tolist()) == ranked


@pytest.mark.parametrize("before, after", [("", " The answer is"), ("Hello there. ", "")])
def test_ids_holding_the_chat_and_more_text_are_not_located(world, before, after):
    # the user's own tokens around the rendered chat would be taken for the template's and never rank
    _, tok, _ = world
    ids, ranked = by_hand(tok, USER_TURN)
    text = [tok(extra, add_special_tokens=False)["input_ids"] for extra in (before, after)]
    longer = [*text[0], *ids, *text[1]]
    prompt, messages = chat_prompt(tok, QUESTION), [{"role": "user", "content": QUESTION}]
    assert set((~template_rows(tok, [prompt], torch.tensor([ids]))[0]).nonzero().flatten().tolist()) == ranked
    assert template_rows(tok, [prompt], torch.tensor([longer])) is None
    assert template_rows(tok, [prompt], torch.tensor([longer]), torch.ones(1, len(longer))) is None
    assert locate_template(tok, longer, messages) is None and locate_template(tok, longer) is None
    # padding around it is no text: the chat is located, padded on either side, from the mask or the pad token
    pad = [tok.pad_token_id] * 3
    for padded in ([*ids, *pad], [*pad, *ids]):
        shift = len(pad) if padded[0] == tok.pad_token_id else 0
        for mask in (None, torch.tensor([[int(shift <= i < shift + len(ids)) for i in range(len(padded))]])):
            template = template_rows(tok, [prompt], torch.tensor([padded]), mask)
            assert set((~template[0]).nonzero().flatten().tolist()) == {p + shift for p in ranked}


def test_located_from_ids_alone_system_prompt_and_earlier_turns(world):
    _, tok, _ = world
    pieces = [("<|im_start|>system\n", False), ("Answer in one word.", False), ("<|im_end|>\n<|im_start|>user\n", False),
              ("Rome is a city.", True), ("<|im_end|>\n<|im_start|>assistant\n", False), ("The key.", True),
              ("<|im_end|>\n<|im_start|>user\n", False), (QUESTION, True), ("<|im_end|>\n<|im_start|>assistant\n", False)]
    ids, ranked = by_hand(tok, pieces)
    template = locate_template(tok, ids)
    assert set((~template).nonzero().flatten().tolist()) == ranked
    # with the request's messages given, the same
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Rome is a city."},
                {"role": "assistant", "content": "The key."}, {"role": "user", "content": QUESTION}]
    assert torch.equal(locate_template(tok, ids, messages), template)
    # a prompt that is no chat conversation: nothing is located (everything ranks)
    assert locate_template(tok, tok(QUESTION)["input_ids"]) is None
    assert locate_template(tok, ids, [{"role": "user", "content": "something else"}]) is None


def _chat_pipeline(model, tok, new_tokens: int):
    """A chat pipeline's call on a system prompt and QUESTION, recorded: its prompt ids and the positions that rank
    (the user's message) are those cut by hand. Returns (call, ids, ranked)."""
    from transformers import pipeline

    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": QUESTION}]
    ids, ranked = by_hand(tok, [("<|im_start|>system\n", False), ("Answer in one word.", False),
                                ("<|im_end|>\n<|im_start|>user\n", False), (QUESTION, True),
                                ("<|im_end|>\n<|im_start|>assistant\n", False)])
    with nxl.attach(model, tokenizer=tok, layers="last") as probe:
        pipeline("text-generation", model=model, tokenizer=tok)(messages, max_new_tokens=new_tokens, do_sample=False)
    call = probe.calls[-1]
    assert call.prompt_ids[0].tolist() == ids
    assert set((~call.prompt_template[0]).nonzero().flatten().tolist()) == ranked
    return call, ids, ranked


def test_a_chat_pipeline_on_a_tokenizer_that_adds_a_bos_its_template_does_not_write_ranks_the_users_message(world):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    model, _, _ = world
    plain = bpe_tiny.bpe_tokenizer()  # (its backend is changed: not the world's)
    # as TinyLlama-Chat's: the tokenizer adds its BOS, the template writes none, and apply_chat_template (the chat
    # pipeline's, a server's) tokenizes without special tokens
    backend = plain.backend_tokenizer
    bos = "<|endoftext|>"
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                           special_tokens=[(bos, plain.convert_tokens_to_ids(bos))])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", chat_template=bpe_tiny.CHAT_TEMPLATE)
    assert tok("Rome")["input_ids"][0] == tok.bos_token_id
    call, ids, ranked = _chat_pipeline(model, tok, 1)
    # and with the BOS the tokenizer adds (nxl.explain's encoding): its BOS is the template's
    template = locate_template(tok, [tok.bos_token_id, *ids])
    assert set((~template).nonzero().flatten().tolist()) == {p + 1 for p in ranked}


def test_a_template_that_rewrites_the_message_is_said_and_everything_ranks(world):
    model, tok, _ = world
    upper = bpe_tiny.bpe_tokenizer()
    upper.chat_template = bpe_tiny.CHAT_TEMPLATE.replace("m['content']", "m['content'] | upper")
    assert chat_prompt(upper, QUESTION).spans is None
    res = nxl.explain(model, upper, QUESTION, chat=True)
    assert res.template is None and res.meta["template"].startswith("not located")
    real = res.mask[0].clone()
    real[int(res.position[0])] = False
    assert torch.equal(res.rankable(0), real & ~res.special[0] if res.special is not None else real)


def test_rankable_falls_back_when_only_template_is_left():
    mask = torch.ones(4, dtype=torch.bool)
    template = torch.tensor([True, True, True, False])
    assert rankable(mask, 3, None, template).tolist() == [True, True, True, False]
    assert rankable(mask, 3, None, torch.tensor([True, False, True, False])).tolist() == [False, True, False, False]


def test_rankable_rows_fall_back_each_on_its_own():
    """(rows, seq) with one prediction position per row (a generate step's batch, Parquet's ranked column): only the
    row with nothing left besides special tokens ranks them; the others still leave theirs out, and padding and
    each row's own prediction never rank."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    special = torch.tensor([[True, True, False, False], [True, False, False, True], [False, True, False, False]])
    ranked = rankable(mask, torch.tensor([2, 1, 3]), special)
    assert ranked.tolist() == [[True, True, False, False],  # [CLS] [SEP] prediction pad: the specials, as nothing else
                               [False, False, True, False],  # [CLS] prediction word [SEP]: the word alone
                               [False, False, True, False]]  # pad [CLS] word prediction: the word alone
    assert rankable(mask, torch.tensor([2, 1, 3]), special, fallback=False)[0].tolist() == [False] * 4


def test_generate_ranks_the_message_and_generated_tokens_and_says_why_it_stopped(world, tmp_path, capsys):
    _, tok, folder = world
    stream = tmp_path / "run.nxl"
    assert main(["attribute", str(folder), QUESTION, "--chat", "--generate", "3", "--layers", "last",
                 "--out", str(stream)]) == 0
    out = capsys.readouterr().out
    assert "ranked: the user's message and the generated text" in out
    assert "stopped: 3 token(s) generated" in out
    ids, ranked = by_hand(tok, USER_TURN)
    call = read_stream(stream)[0]
    assert call.prompt_ids[0].tolist() == ids
    assert set((~call.prompt_template[0]).nonzero().flatten().tolist()) == ranked
    for step in call.steps:
        res = step.to_attribution(template=call.context_template(step.position))
        generated = set(range(len(ids), step.position - 1))  # the token being read from is the prediction
        assert {p for p, _, _ in res.top(100)} == ranked | generated
    # every printed top position is the user's text or a generated token
    lines = [line for line in out.splitlines() if line.strip()[:1].isdigit() and " L" in line]
    positions = {int(part.split(":")[0]) for line in lines for part in line.split(":", 1)[1].split()
                 if part.split(":")[0].isdigit()}
    assert len(lines) == 3 and positions and positions <= ranked | set(range(len(ids), len(ids) + 3))


@pytest.mark.real_model
def test_smollm2_chat_ranks_france_for_paris(smollm2_dir, tmp_path, capsys):
    out = tmp_path / "chat.safetensors"
    assert main(["attribute", str(smollm2_dir), "What is the capital of France?", "--chat", "--target", " Paris",
                 "--layers", "last", "--out", str(out)]) == 0
    capsys.readouterr()
    res = nxl.Attribution.load(out)
    top = [text for _, text, _ in res.top(3)]
    assert "␣France" in top
    assert {"system", "istant", "↵"}.isdisjoint(top)


def test_evaluate_never_perturbs_the_template_and_counts_the_message(world):
    from nxl_hooks.eval import faithfulness as ev

    model, tok, _ = world
    ids, ranked = by_hand(tok, USER_TURN)
    ids = torch.tensor(ids)
    template = locate_template(tok, ids.tolist())
    scores = torch.arange(len(ids), dtype=torch.float32).flip(0)  # the template's first markers score highest
    position = len(ids) - 1
    perturbed, _ = ev.perturb(ids, position, scores, 3, keep_top=False, mode="delete", template=template)
    kept = set(range(len(ids))) - set(sorted(ranked)[:3])  # the highest-scoring ranked tokens are the first ones
    assert perturbed.tolist() == [int(ids[i]) for i in sorted(kept)]
    record = ev.score_example(model, tok, {"text": chat_prompt(tok, QUESTION).text}, methods=["normxlogit"],
                              ks=(0.5,))
    assert record["counts"] == [int(len(ranked) * 0.5)]


def test_a_pipeline_with_chat_messages_records_where_the_template_is(world):
    model, tok, _ = world
    call, ids, ranked = _chat_pipeline(model, tok, 2)
    step = call.steps[-1]
    res = step.to_attribution(template=call.context_template(step.position))
    assert {p for p, _, _ in res.top(100)} == ranked | set(range(len(ids), step.position - 1))


def test_a_call_refuses_to_rank_another_calls_step_by_its_own_prompt(world):
    """``probe.calls[1].attribution(probe.calls[0].steps[0])`` ranked the chat call's step by the plain call's prompt:
    the template's markers ranked, silently. It is refused; its own call (and a shallow copy of
    it, which shares its steps) ranks it as ``step.to_attribution()`` does."""
    import copy

    model, tok, _ = world
    chat, ids, ranked = _chat_pipeline(model, tok, 2)
    with nxl.attach(model, tokenizer=tok, layers="last") as probe:
        model.generate(**tok([QUESTION], return_tensors="pt"), max_new_tokens=2, do_sample=False)
    (plain,) = probe.calls
    step = chat.steps[0]
    with pytest.raises(ValueError, match="this step is another call's, whose prompt is its context"):
        plain.attribution(step)
    assert {p for p, _, _ in chat.attribution(step).top(100)} == ranked | set(range(len(ids), step.position - 1))
    assert copy.copy(chat).attribution(step).top(100) == step.to_attribution().top(100)


def test_a_template_of_the_wrong_shape_is_refused(world):
    model, tok, _ = world
    res = nxl.explain(model, tok, QUESTION, chat=True)
    res.template = res.template[:, :3]
    with pytest.raises(nxl.RecordError, match=r"template must be a bool tensor of shape \(1, 20\)"):
        res.check()


#: A ChatML template with a default system prompt, as SmolLM2's: the page must fold it away.
SYSTEM = "You are a helpful assistant named Tiny."
DEFAULT_SYSTEM = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\n" + SYSTEM + "<|im_end|>\n{% endif %}"
                  + bpe_tiny.CHAT_TEMPLATE)


def flat_world(path):
    """A tiny chat model whose input embeddings have nearly one norm (as a model that normalizes them), with a
    default system prompt: (folder, tokenizer, embedding matrix)."""
    tok = bpe_tiny.bpe_tokenizer()
    tok.chat_template = DEFAULT_SYSTEM
    model = bpe_tiny.bpe_llama(tok)
    with torch.no_grad():
        weight = model.get_input_embeddings().weight
        noise = 1 + 1e-4 * torch.randn(weight.shape[0], 1, generator=torch.Generator().manual_seed(3))
        weight.copy_(weight / weight.norm(dim=-1, keepdim=True).clamp_min(1e-12) * noise)  # the pad row stays 0
    return bpe_tiny.save_bpe(path, model, tok), tok, weight.detach().clone()


def test_generate_page_marks_and_folds_the_template_scales_by_what_ranks_and_says_the_terminals_spread(
        tmp_path, capsys):
    """Issue 24 item 12. The --generate page marks the template's columns (▫), folds them away so the table starts
    at the user's message, colours each row by its ranked cells only, and prints the one coefficient of variation
    the terminal prints: the oracle's, over the user's message tokens (cut by hand) of the embedding matrix."""
    import tiny

    folder, tok, weight = flat_world(tmp_path / "hf")
    page = tmp_path / "gen.html"
    assert main(["attribute", str(folder), QUESTION, "--chat", "--generate", "3", "--layers", "last",
                 "--html", str(page)]) == 0
    out = capsys.readouterr().out
    ids, ranked = by_hand(tok, [(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n", False),
                                (QUESTION, True), ("<|im_end|>\n<|im_start|>assistant\n", False)])
    norms = weight[ids].norm(dim=-1).double()[sorted(ranked)]
    spread = f"coefficient of variation {float(norms.std(unbiased=False) / norms.mean()):.1e}"
    text = page.read_text(encoding="utf-8")
    assert out.count("coefficient of variation") == 1 and spread in " ".join(out.split())
    assert text.count("coefficient of variation") == 1 and spread in text
    # the template's columns: marked, classed and folded; the user's words are the first columns shown
    cells = tiny.elements(text, "td", "nxl-cell")
    columns = len(ids) + 3  # the prompt, then the generated tokens
    assert len(cells) == 3 * columns
    folded = [j for j in range(columns) if "nxl-template" in cells[j].get("class", "")]
    assert folded == [j for j in range(len(ids)) if j not in ranked]
    assert 'id="nxl-generation" class="nxl-folded"' in text and ".nxl-folded .nxl-template{display:none}" in text
    assert f"your message (column {min(ranked)})" in text and 'id="nxl-template"' in text
    import json

    data = json.loads(text.split('id="nxl-data">')[1].split("</script>")[0])
    assert [c.startswith("▫ ") for c in data["columns"]] == [j in folded for j in range(columns)]
    assert next(c for j, c in enumerate(data["columns"]) if j not in folded) == f"{min(ranked)}: The"
    # each row's colour: its largest |score| among the ranked cells is full colour, whatever the template's are
    louder = 0
    for i in range(3):
        row = cells[i * columns:(i + 1) * columns]
        values = {j: float(c["data-value"]) for j, c in enumerate(row) if "data-value" in c}
        rank = [j for j in values if data["ranked"][i][j]]
        assert set(rank) == (set(ranked) | set(range(len(ids), len(ids) + i))) - {len(ids) + i - 1}
        peak = max(rank, key=lambda j: abs(values[j]))
        assert row[peak]["style"].startswith("background:rgb(214,39,40)" if values[peak] > 0 else
                                             "background:rgb(31,119,180)")
        louder += any(abs(values[j]) > abs(values[peak]) for j in folded)
    assert louder  # a template column scores higher somewhere: by today's rule it would have set the scale
    # the prompt above the table greys the template's tokens; the terminal ranks without them too
    prompt = text.split('<p class="prompt">')[1].split("</p>")[0]
    assert prompt.count('<span class="nxl-template">') == len(ids) - len(ranked)
    lines = [line for line in out.splitlines() if line.strip()[:1].isdigit() and " L3:" in line]
    printed = {int(part.split(":")[0]) for line in lines for part in line.split("L3:", 1)[1].split()
               if part.split(":")[0].isdigit()}
    assert len(lines) == 3 and printed and printed <= ranked | set(range(len(ids), len(ids) + 2))



@pytest.mark.parametrize("chat", [True, False])
def test_a_left_padded_rows_page_shows_its_own_prompt_at_its_batch_positions(world, chat):
    """A batch generated with left padding (as chat models' tokenizers pad), with and without a chat template: the
    shorter row's page said "Prompt (N tokens" of the whole batch's width, listed the pad tokens in its prompt and
    gave them blank columns at the table's start. It shows the row's own tokens, as many as the tokenizer's attention
    mask counts (each by hand), says how many padding positions it leaves out, and its columns keep their positions
    in the batch (the step views' and nxl tail's); its message starts after the template's prefix. The unpadded
    row's page says no padding."""
    import tiny
    from nxl_hooks.records.html import generation_html

    model, _, _ = world
    tok = bpe_tiny.bpe_tokenizer()
    tok.padding_side = "left"
    messages = [QUESTION, "Rome"]  # of different lengths: the second row is padded
    before, after = ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n") if chat else ("", "")
    enc = (tok.apply_chat_template([[{"role": "user", "content": m}] for m in messages], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True, padding=True) if chat else
           tok(messages, return_tensors="pt", padding=True))
    with nxl.attach(model, tokenizer=tok) as probe:
        model.generate(**enc, max_new_tokens=2, do_sample=False)
    call = probe.calls[-1]
    assert (call.prompt_template is not None) is chat
    width = enc["input_ids"].shape[1]
    for row, message in enumerate(messages):
        ids, ranked = by_hand(tok, [(before, False), (message, True), (after, False)])
        real = int(enc["attention_mask"][row].sum())
        pad = width - real
        assert real == len(ids) and enc["input_ids"][row, pad:].tolist() == ids and (pad > 0) == (row == 1)
        text = generation_html(call, row=row)
        said = (f"; this row's {pad} position(s) of padding are left out, here and in the table, whose columns keep "
                f"their positions in the batch (as nxl tail and the step views number tokens): its prompt starts at "
                f"column {pad}):")
        assert f"Prompt ({real} tokens; ␣ a space, ↵ a newline" + (said if pad else "):") in text
        assert len(re.sub("<[^>]*>", "", text.split('<p class="prompt">')[1].split("</p>")[0]).split(" ")) == real
        table = text.split('id="nxl-generation"')[1]
        heads = [label.removeprefix("▫ ").split(":")[0] for label in
                 re.findall(r"<th(?: class=\"[^\"]*\")?>([^<]*)</th>", table.split("</thead>")[0])[1:]]
        shown = list(range(pad, width + 2))  # the row's prompt, then its two generated tokens
        assert heads == [str(j) for j in shown]
        assert [int(c["data-col"]) for c in tiny.elements(table, "td", "nxl-cell")] == shown * 2
        if chat:
            assert f"so the table starts at your message (column {pad + min(ranked)}):" in text
        else:
            assert "your message" not in text

@contextlib.contextmanager
def within(seconds: int):
    """Raises TimeoutError in the block after ``seconds`` (a regex's search is interrupted too)."""
    def late(*_):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, late)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("generation", [True, False])
def test_a_long_conversation_is_located_from_ids_in_one_pass(world, generation):
    # 61 messages: splitting the decoded prompt every possible way took 22 s at 33 messages and 4x more every 4
    _, tok, _ = world
    pieces = [("<|im_start|>system\n", False), ("Answer in one word.", False), ("<|im_end|>\n", False)]
    for turn in range(61):
        role = "assistant" if turn % 2 else "user"
        pieces += [(f"<|im_start|>{role}\n", False), (f"Turn {turn} is a city.", True), ("<|im_end|>\n", False)]
    if generation:
        pieces.append(("<|im_start|>assistant\n", False))
    ids, ranked = by_hand(tok, pieces)
    with within(60):
        template = locate_template(tok, ids)
    assert template is not None and set((~template).nonzero().flatten().tolist()) == ranked


@pytest.mark.parametrize("message", ["help", "Tiny", "user"])
def test_a_message_also_in_the_template_is_placed_where_the_user_wrote_it(world, message):
    # "help" is in the default system prompt's "helpful", "user" in the role marker: a search from the start
    # ranked those template tokens instead of the message
    model, _, _ = world
    tok = bpe_tiny.bpe_tokenizer()
    tok.chat_template = DEFAULT_SYSTEM
    before = "<|im_start|>system\n" + SYSTEM + "<|im_end|>\n<|im_start|>user\n"
    ids, ranked = by_hand(tok, [(before, False), (message, True), ("<|im_end|>\n<|im_start|>assistant\n", False)])
    assert chat_prompt(tok, message).spans == ((len(before), len(before) + len(message)),)
    res = nxl.explain(model, tok, message, chat=True)
    assert res.input_ids[0].tolist() == ids and set(res.rankable(0).nonzero().flatten().tolist()) == ranked
    assert set((~locate_template(tok, ids)).nonzero().flatten().tolist()) == ranked
